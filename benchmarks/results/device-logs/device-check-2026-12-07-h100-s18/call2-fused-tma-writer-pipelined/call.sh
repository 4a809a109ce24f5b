#!/usr/bin/env bash
# s18 call 2 at f0f6c99: fused-tma with the writer pipelined: its tests, attention.py bwd split-tma vs fused-tma,
# the long-context bf16 step A/B split-tma / fused-tma
set -u
O=$OUT/r; mkdir -p $O
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
pack() { (cd $OUT && tar czf r.tgz.tmp r && mv r.tgz.tmp r.tgz); }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader > $O/gpu.txt 2>&1
t0=$SECONDS; timeout -s KILL 200 python3 -m pytest -x -q -p no:cacheprovider -m cuda tests/test_op_attention.py -k "fused_tma or variant_equals_split or bitwise" > $O/smoke.log 2>&1; rc=$?; echo "smoke rc $rc $((SECONDS-t0)) s" >> $O/summary.txt
tail -3 $O/smoke.log >> $O/summary.txt; grep -E "FAILED|Error" $O/smoke.log | head -20 >> $O/summary.txt
pack
[ $rc -eq 0 ] || exit 1
t0=$SECONDS; timeout -s KILL 150 python3 benchmarks/attention.py --ops bwd,fwd+bwd --bwd split-tma,fused-tma --shapes 16x12x1024x64,8x16x1024x64,32x12x512x64,8x12x2048x64,2x12x16384x64 --out $O/attn.json > $O/attn.log 2>&1; echo "attn rc $? $((SECONDS-t0)) s" >> $O/summary.txt
grep "bwd " $O/attn.log >> $O/summary.txt
pack
t0=$SECONDS; timeout -s KILL 220 python3 benchmarks/ab.py run --arms ab-arms/long --repeat 2 --logs $O/ab-long -- python3 benchmarks/gpt2_step.py --modes bf16 --frameworks kiln --batch-size 2 --seq-len 16384 --steps 10 --warmup 3 --out /tmp/ab-l > $O/ab-long.log 2>&1; echo "ab-long rc $? $((SECONDS-t0)) s" >> $O/summary.txt
python3 benchmarks/ab.py table $O/ab-long > $O/ab-long-table.txt 2>&1; cat $O/ab-long-table.txt >> $O/summary.txt
pack
