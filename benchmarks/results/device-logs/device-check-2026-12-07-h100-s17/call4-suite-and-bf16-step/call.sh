#!/usr/bin/env bash
# call 4 of 2026-12-07 s17 at HEAD: the whole CUDA suite (4 shards), then the bf16 step with eager and compile
set -u
O=$OUT/r; mkdir -p $O
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 KILN_COMMIT=$(git rev-parse --short HEAD)
pack() { (cd $OUT && tar czf r.tgz.tmp r && mv r.tgz.tmp r.tgz); }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader > $O/gpu.txt 2>&1
t0=$SECONDS; timeout 260 python3 benchmarks/cuda_suite.py --shards 4 --logs $O/tests > $O/tests.log 2>&1; echo "tests rc $? $((SECONDS-t0)) s" >> $O/summary.txt
tail -8 $O/tests.log >> $O/summary.txt
pack
t0=$SECONDS; timeout 100 python3 benchmarks/gpt2_step.py --modes bf16 --frameworks kiln,eager,compile --steps 50 --warmup 10 --out $O/gpt2 > $O/gpt2.log 2>&1; echo "gpt2 rc $? $((SECONDS-t0)) s" >> $O/summary.txt
tail -6 $O/gpt2.log >> $O/summary.txt
pack
