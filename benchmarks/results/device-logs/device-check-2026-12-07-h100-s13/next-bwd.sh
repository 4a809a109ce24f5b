# Next session, one call (~4-5 min, any GPU): the attention CUDA tests on the next/bwd-overwrite arm, then an A/B of
# the split backward: main, next/bwd-overwrite (scale-d 0), next/split-group-2 and -1 (fewer heads in flight).
# run: command "bash ab-arms/next-bwd.sh", carry ["ab-arms"]
export PYTHONUNBUFFERED=1 KILN_COMMIT=$(git rev-parse --short HEAD)
L=/tmp/nb; mkdir -p $L/arm
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader | tee $L/gpu.txt
tar -xzf ab-arms/1-next_bwd-overwrite.tgz -C $L/arm
S=$(date +%s)
(cd $L/arm && PYTHONPATH=$L/arm/src timeout 200 python3 -m pytest -q -m "cuda and not slow" -p no:cacheprovider \
  tests/test_op_attention.py > $L/tests-bwd-overwrite.log 2>&1; \
  echo "tests-bwd-overwrite rc $? in $(( $(date +%s) - S )) s") | tee -a $L/gpu.txt
tail -n 3 $L/tests-bwd-overwrite.log
python3 benchmarks/ab.py run --repeat 2 --logs $L/ab --timeout 60 -- python3 benchmarks/attention.py --ops bwd \
  --shapes 32x12x512x64,16x12x1024x64,8x16x1024x64,8x12x2048x64,4x12x4096x64,2x12x16384x64,4x32x2048x128 2>&1 | tee $L/ab-driver.log
python3 benchmarks/ab.py table $L/ab | tee $L/ab-table.txt | cut -c1-45,100-
tar -czf $OUT/nb.tgz -C /tmp nb
