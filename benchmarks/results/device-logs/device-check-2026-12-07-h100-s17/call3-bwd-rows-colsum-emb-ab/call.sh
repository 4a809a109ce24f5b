#!/usr/bin/env bash
# call 3 of 2026-12-07 s17 at 4a37542: the split-tma backward's and the elementwise tests, then A/B of 3419745 (= 0ebce61's
# kernels) / fea2cdf (jobs' rows by TMA) on the attention backward at six shapes, then A/B of 3419745 / fea2cdf /
# ed360e7 (+ column sums unroll 8) / 4a37542 (+ token + position add and its gradient) on the bf16 step
set -u
O=$OUT/r; mkdir -p $O
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 KILN_COMMIT=$(git rev-parse --short HEAD)
pack() { (cd $OUT && tar czf r.tgz.tmp r && mv r.tgz.tmp r.tgz); }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader > $O/gpu.txt 2>&1
t0=$SECONDS; timeout 150 python3 -m pytest -x -q -p no:cacheprovider -m cuda tests/test_op_attention.py tests/test_op_elementwise.py -k "bwd_tma or bitwise or split_tma or matches_split or packed or add or sum_leading" > $O/smoke.log 2>&1; rc=$?; echo "smoke rc $rc $((SECONDS-t0)) s" >> $O/summary.txt
tail -3 $O/smoke.log >> $O/summary.txt; grep -E "FAILED|Error" $O/smoke.log | head -20 >> $O/summary.txt
pack
[ $rc -eq 0 ] || exit 1
t0=$SECONDS; timeout 130 python3 benchmarks/ab.py run --arms ab-arms/attn --repeat 2 --logs $O/ab-attn --timeout 60 -- python3 benchmarks/attention.py --ops bwd,fwd+bwd --bwd auto --shapes 16x12x1024x64,8x16x1024x64,32x12x512x64,8x12x2048x64,2x12x16384x64,4x32x2048x128 > $O/ab-attn.log 2>&1; echo "ab-attn rc $? $((SECONDS-t0)) s" >> $O/summary.txt
python3 benchmarks/ab.py table $O/ab-attn > $O/ab-attn-table.txt 2>&1; head -14 $O/ab-attn-table.txt >> $O/summary.txt
pack
t0=$SECONDS; timeout 300 python3 benchmarks/ab.py run --arms ab-arms/step --repeat 2 --logs $O/ab-gpt2 -- python3 benchmarks/gpt2_step.py --modes bf16 --frameworks kiln --steps 40 --warmup 10 --out /tmp/ab-g > $O/ab-gpt2.log 2>&1; echo "ab-gpt2 rc $? $((SECONDS-t0)) s" >> $O/summary.txt
python3 benchmarks/ab.py table $O/ab-gpt2 > $O/ab-gpt2-table.txt 2>&1; cat $O/ab-gpt2-table.txt >> $O/summary.txt
pack
