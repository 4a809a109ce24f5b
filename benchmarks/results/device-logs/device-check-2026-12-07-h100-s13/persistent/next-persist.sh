# one call (any GPU, ~6-8 min): the persistent split-tma backward (next/bwd-tma-persistent) — smoke test, its tests,
# an A/B against main (split-tma one job a block) at 6 shapes, GPT-2 bf16 steps, long context vs eager
export PYTHONUNBUFFERED=1
L=/tmp/np; mkdir -p $L/arm
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader | tee -a $L/gpu.txt
tar -xzf ab-arms/2-next_bwd-tma-persistent.tgz -C $L/arm
A=$L/arm
export KILN_COMMIT=$(python3 -c "import json; print(json.load(open('ab-arms/manifest.json'))[2]['commit'])")
S=$(date +%s)
(cd $A && PYTHONPATH=$A/src timeout 120 python3 -m pytest -x -q -m cuda -p no:cacheprovider tests/test_op_attention.py \
  -k "tma_equals_split and bf16 and (shape0 or shape2)" > $L/smoke.log 2>&1; echo "smoke rc $? in $(( $(date +%s) - S )) s") | tee -a $L/gpu.txt
tail -n 3 $L/smoke.log
if ! grep -q "smoke rc 0" $L/gpu.txt; then tar -czf $OUT/np.tgz -C /tmp np; exit 1; fi
S=$(date +%s)
(cd $A && PYTHONPATH=$A/src timeout 150 python3 -m pytest -q -m "cuda and not slow" -p no:cacheprovider tests/test_op_attention.py \
  -k "split-tma or tma_equals_split or tma_is_bitwise or auto" > $L/tests-split-tma.log 2>&1; echo "tests split-tma rc $? in $(( $(date +%s) - S )) s") | tee -a $L/gpu.txt
tail -n 3 $L/tests-split-tma.log
tar -czf $OUT/np.tgz -C /tmp np
python3 benchmarks/ab.py run --repeat 2 --logs $L/ab --timeout 70 -- python3 benchmarks/attention.py --ops bwd --bwd split,split-tma \
  --shapes 32x12x512x64,16x12x1024x64,8x16x1024x64,8x12x2048x64,4x12x4096x64,2x12x16384x64 2>&1 | tee $L/ab-driver.log
python3 benchmarks/ab.py table $L/ab > $L/ab-table.txt 2>&1; cat $L/ab-table.txt
tar -czf $OUT/np.tgz -C /tmp np
for v in split split-tma; do
  (cd $A && KILN_ATTENTION_BWD=$v PYTHONPATH=$A/src timeout 90 python3 benchmarks/gpt2_step.py --modes bf16 --frameworks kiln \
    --steps 40 --warmup 10 --out $L/gpt2-$v > $L/gpt2-$v.log 2>&1; echo "gpt2 $v rc $?") | tee -a $L/gpu.txt
  grep -h "tok/s" $L/gpt2-$v.log | head -1
done
for v in split auto; do
  (cd $A && KILN_ATTENTION_BWD=$v PYTHONPATH=$A/src timeout 90 python3 benchmarks/gpt2_step.py --modes bf16 --frameworks kiln \
    --batch-size 2 --seq-len 16384 --steps 10 --warmup 3 --out $L/long-$v > $L/long-$v.log 2>&1; echo "long $v rc $?") | tee -a $L/gpu.txt
  grep -h "tok/s" $L/long-$v.log | head -1
done
(cd $A && PYTHONPATH=$A/src timeout 90 python3 benchmarks/gpt2_step.py --modes bf16 --frameworks eager \
  --batch-size 2 --seq-len 16384 --steps 10 --warmup 3 --out $L/long-eager > $L/long-eager.log 2>&1; echo "long eager rc $?") | tee -a $L/gpu.txt
grep -h "tok/s" $L/long-eager.log | head -1
tar -czf $OUT/np.tgz -C /tmp np
