# One call (~5 min, any GPU): split-tma at head dim 128, never run on a GPU. Arms (ab-arms/manifest.json): 0 main
# (split at 128), 1 4945903 (the TMA dQ kernel forming delta + split's dK/dV), 2 e236766 (split-tma whole: the TMA
# dK/dV kernel with K and V from shared memory). Smoke test and the split-tma tests on arm 2, then the A/B.
# Prediction: arm 1 5-10% faster bwd at 4x32x2048x128 / 2x16x8192x128 than split; arm 2 10-15%.
export PYTHONUNBUFFERED=1
L=/tmp/nd; mkdir -p $L/arm
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee -a $L/gpu.txt
tar -xzf ab-arms/2-e236766.tgz -C $L/arm; A=$L/arm
S=$(date +%s)
(cd $A && PYTHONPATH=$A/src timeout 150 python3 -m pytest -x -q -m cuda -p no:cacheprovider tests/test_op_attention.py \
  -k "variant_equals_split and split-tma and bf16 and (shape1 or shape3 or shape6)" > $L/smoke.log 2>&1; echo "smoke rc $? in $(( $(date +%s) - S )) s") | tee -a $L/gpu.txt
tail -n 3 $L/smoke.log; tar -czf $OUT/nd.tgz -C /tmp nd
S=$(date +%s)
(cd $A && PYTHONPATH=$A/src timeout 150 python3 -m pytest -q -m "cuda and not slow" -p no:cacheprovider tests/test_op_attention.py \
  -k "split-tma or split_tma or bwd_tma" > $L/tests.log 2>&1; echo "tests rc $? in $(( $(date +%s) - S )) s") | tee -a $L/gpu.txt
tail -n 3 $L/tests.log; tar -czf $OUT/nd.tgz -C /tmp nd
grep -q "smoke rc 0" $L/gpu.txt || exit 1
python3 benchmarks/ab.py run --repeat 2 --logs $L/ab --timeout 70 -- python3 benchmarks/attention.py --ops bwd --bwd split,split-tma \
  --shapes 4x32x2048x128,2x16x8192x128,8x16x1024x128,16x12x1024x64 2>&1 | tee $L/ab-driver.log
python3 benchmarks/ab.py table $L/ab > $L/ab-table.txt 2>&1; cat $L/ab-table.txt; tar -czf $OUT/nd.tgz -C /tmp nd
