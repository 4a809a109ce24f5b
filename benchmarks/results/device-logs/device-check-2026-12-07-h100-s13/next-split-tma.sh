# Next session, one call (~5-6 min, any GPU): the split-tma backward, never run on a GPU, in two trees:
#   v2 = next/bwd-tma-delta (6682880: dK/dV and dQ kernels with TMA, dQ first forming delta, no delta kernel)
#   v1 = next/dkdv-tma      (06bbe96: the same with the delta kernel)
# per tree: a smoke test (2 tests, the family's compile included), the attention tests of split-tma, its backward
# against split's in one process; v1 only if v2's tests fail; then, for the tree that passed, kiln's bf16 GPT-2
# step under split, split-tma, split.
# run: command "bash ab-arms/next-split-tma.sh", carry ["ab-arms"]
export PYTHONUNBUFFERED=1
L=/tmp/st; mkdir -p $L
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader | tee $L/gpu.txt
good=""
for arm in v2:bwd-tma-delta v1:dkdv-tma; do
  name=${arm%%:*}; A=$L/$name; mkdir -p $A; tar -xzf ab-arms/${arm#*:}.tgz -C $A
  export KILN_COMMIT=$name
  S=$(date +%s)
  (cd $A && PYTHONPATH=$A/src timeout 120 python3 -m pytest -x -q -m cuda -p no:cacheprovider tests/test_op_attention.py \
    -k "tma_equals_split and bf16 and (shape0 or shape2)" > $L/$name-smoke.log 2>&1; echo "$name smoke rc $? in $(( $(date +%s) - S )) s") | tee -a $L/gpu.txt
  tail -n 4 $L/$name-smoke.log
  grep -q "$name smoke rc 0" $L/gpu.txt || continue  # a failed (or hung) smoke test: the next tree
  S=$(date +%s)
  (cd $A && PYTHONPATH=$A/src timeout 200 python3 -m pytest -q -m "cuda and not slow" -p no:cacheprovider tests/test_op_attention.py \
    -k "split-tma or tma_equals_split" > $L/$name-tests.log 2>&1; echo "$name tests rc $? in $(( $(date +%s) - S )) s") | tee -a $L/gpu.txt
  tail -n 4 $L/$name-tests.log
  (cd $A && PYTHONPATH=$A/src timeout 120 python3 benchmarks/attention.py --ops bwd --bwd split,split-tma \
    --shapes 32x12x512x64,16x12x1024x64,8x12x2048x64,4x12x4096x64,2x12x16384x64 > $L/$name-attention.log 2>&1; echo "$name attention rc $?") | tee -a $L/gpu.txt
  tail -n 12 $L/$name-attention.log
  tar -czf $OUT/st.tgz -C /tmp st
  if grep -q "$name tests rc 0" $L/gpu.txt; then good=$name; break; fi  # v1 only if v2 fails
done
if [ -n "$good" ]; then
  A=$L/$good
  for variant in split split-tma split; do
    (cd $A && KILN_ATTENTION_BWD=$variant PYTHONPATH=$A/src timeout 120 python3 benchmarks/gpt2_step.py --modes bf16 --frameworks kiln \
      --steps 40 --warmup 10 --out $L/gpt2-$good-$variant > $L/gpt2-$good-$variant.log 2>&1; echo "gpt2 $good $variant rc $?") | tee -a $L/gpu.txt
    grep -h "tok/s\|tokens/s" $L/gpt2-$good-$variant.log | tail -2
  done
fi
tar -czf $OUT/st.tgz -C /tmp st
