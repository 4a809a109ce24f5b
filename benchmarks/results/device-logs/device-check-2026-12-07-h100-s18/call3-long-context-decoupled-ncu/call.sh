#!/usr/bin/env bash
# s18 call 3 at 064f78d: the long context B2 T16384 bf16 (auto = fused-tma at D64, T >= 2048), kiln vs eager; the
# A/B of fused-tma (064f78d) / fused-tma with each consumer's dQ part staged and accumulated apart (4695bae), then
# 4695bae's fused-tma tests; Nsight Compute on split-tma's and fused-tma's backwards at 8x12x2048x64
set -u
O=$OUT/r; mkdir -p $O
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
pack() { (cd $OUT && tar czf r.tgz.tmp r && mv r.tgz.tmp r.tgz); }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader > $O/gpu.txt 2>&1
t0=$SECONDS; timeout -s KILL 120 python3 benchmarks/gpt2_step.py --modes bf16 --frameworks kiln,eager --batch-size 2 --seq-len 16384 --steps 10 --warmup 3 --out $O/gpt2-long > $O/gpt2-long.log 2>&1; echo "long bf16 rc $? $((SECONDS-t0)) s" >> $O/summary.txt
pack
t0=$SECONDS; timeout -s KILL 150 python3 benchmarks/ab.py run --arms ab-arms/dec --repeat 2 --logs $O/ab-dec --timeout 70 -- python3 benchmarks/attention.py --ops bwd --bwd fused-tma --shapes 16x12x1024x64,32x12x512x64,8x12x2048x64,2x12x16384x64 > $O/ab-dec.log 2>&1; echo "ab-dec rc $? $((SECONDS-t0)) s" >> $O/summary.txt
python3 benchmarks/ab.py table $O/ab-dec > $O/ab-dec-table.txt 2>&1; cat $O/ab-dec-table.txt >> $O/summary.txt
pack
t0=$SECONDS; (cd /tmp/kiln-ab/1-* && PYTHONPATH=$PWD/src timeout -s KILL 90 python3 -m pytest -x -q -p no:cacheprovider -m cuda tests/test_op_attention.py -k "fused_tma or bitwise") > $O/dec-tests.log 2>&1; echo "dec tests rc $? $((SECONDS-t0)) s" >> $O/summary.txt; tail -2 $O/dec-tests.log >> $O/summary.txt
pack
t0=$SECONDS; timeout -s KILL 100 ncu --clock-control none --profile-from-start off --set full --import-source no -o $O/ncu python3 benchmarks/attention_ncu.py --shape 8x12x2048x64 --calls split-tma,fused-tma > $O/ncu.log 2>&1; echo "ncu rc $? $((SECONDS-t0)) s" >> $O/summary.txt
ncu --import $O/ncu.ncu-rep --page details > $O/ncu-details.log 2>&1
ncu --import $O/ncu.ncu-rep --page source --csv --print-source sass > /tmp/ncu-sass.csv 2>&1
python3 benchmarks/ncu_summary.py $O/ncu-details.log /tmp/ncu-sass.csv --out $O/ncu-summary.md > $O/ncu-summary.log 2>&1; echo "ncu summary rc $?" >> $O/summary.txt
rm -f $O/ncu.ncu-rep
pack
