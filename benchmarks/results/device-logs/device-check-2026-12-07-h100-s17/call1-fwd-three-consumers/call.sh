#!/usr/bin/env bash
# call 1 of 2026-12-07 s17: the three-consumer forward at D 64 (46f776c): its tests, then A/B of 0ebce61 / HEAD
# (tma-pingpong) / HEAD tma, forward only, then the whole attention test file
set -u
O=$OUT/r; mkdir -p $O
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 KILN_COMMIT=$(git rev-parse --short HEAD)
pack() { (cd $OUT && tar czf r.tgz.tmp r && mv r.tgz.tmp r.tgz); }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader > $O/gpu.txt 2>&1
t0=$SECONDS; timeout 200 python3 -m pytest -x -q -p no:cacheprovider -m cuda tests/test_op_attention.py -k "fwd_tma or fwd_reads_a_broadcast" > $O/smoke.log 2>&1; echo "smoke rc $? $((SECONDS-t0)) s" >> $O/summary.txt
tail -3 $O/smoke.log >> $O/summary.txt; grep -E "FAILED|Error" $O/smoke.log | head -20 >> $O/summary.txt
pack
t0=$SECONDS; timeout 260 python3 benchmarks/ab.py run --repeat 2 --logs $O/ab --timeout 100 -- python3 benchmarks/attention.py --ops fwd --bwd split > $O/ab.log 2>&1; echo "ab rc $? $((SECONDS-t0)) s" >> $O/summary.txt
python3 benchmarks/ab.py table $O/ab > $O/ab-table.txt 2>&1; head -14 $O/ab-table.txt >> $O/summary.txt
pack
t0=$SECONDS; timeout 200 python3 benchmarks/cuda_suite.py --shards 4 --logs $O/tests --paths tests/test_op_attention.py tests/test_kernel_compile.py > $O/tests.log 2>&1; echo "tests rc $? $((SECONDS-t0)) s" >> $O/summary.txt
tail -8 $O/tests.log >> $O/summary.txt
pack
