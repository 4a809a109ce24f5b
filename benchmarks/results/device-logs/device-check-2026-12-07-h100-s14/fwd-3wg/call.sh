# One call (~4 min, H100): the forward with three consumers (next/fwd-3wg, tma-pingpong3), never run on a GPU: its
# forward tests (smoke first), then main's tma-pingpong against the branch's tma-pingpong and tma-pingpong3 at the
# paper's D64 shapes, interleaved twice. Prediction: the forward is issue-latency bound (Nsight Compute: 0.70 eligible
# warps a scheduler, issue 44% busy): a third consumer warp a scheduler -> 5-20% faster at T >= 2048, less at T 512-1024
# (192-row jobs leave 11% of rows empty there); the branch's tma-pingpong unchanged.
export PYTHONUNBUFFERED=1
L=/tmp/n3; mkdir -p $L/main $L/br
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee -a $L/gpu.txt
tar -xzf ab-arms/0-main.tgz -C $L/main; tar -xzf ab-arms/1-next_fwd-3wg.tgz -C $L/br
(cd $L/main && PYTHONPATH=$L/main/src python3 -c "from kiln.backend.cuda import attention, compiler; compiler.load_or_compile('attention.cu', 'sm_90a')") > $L/compile-main.log 2>&1 &
S=$(date +%s)
(cd $L/br && PYTHONPATH=$L/br/src timeout 120 python3 -m pytest -x -q -m cuda -p no:cacheprovider tests/test_op_attention.py \
  -k "fwd_tma_matches and tma-pingpong3 and bf16 and causal" > $L/smoke.log 2>&1; echo "smoke rc $? in $(( $(date +%s) - S )) s") | tee -a $L/gpu.txt
tail -n 3 $L/smoke.log; wait; tar -czf $OUT/n3.tgz -C /tmp n3
grep -q "smoke rc 0" $L/gpu.txt || exit 1
SH=32x12x512x64,16x12x1024x64,8x12x2048x64,2x12x8192x64,2x12x16384x64,4x32x2048x128
for r in 1 2; do
  (cd $L/main && PYTHONPATH=$L/main/src KILN_COMMIT=main timeout 60 python3 benchmarks/attention.py --ops fwd --fwd tma-pingpong \
    --shapes $SH --out $L/main-$r.json > $L/main-$r.log 2>&1; echo "main $r rc $?") | tee -a $L/gpu.txt
  (cd $L/br && PYTHONPATH=$L/br/src KILN_COMMIT=9d9672d timeout 60 python3 benchmarks/attention.py --ops fwd --fwd tma-pingpong,tma-pingpong3 \
    --shapes $SH --out $L/br-$r.json > $L/br-$r.log 2>&1; echo "br $r rc $?") | tee -a $L/gpu.txt
done
grep -h " fwd " $L/main-*.log $L/br-*.log | sort | tee $L/table.txt; tar -czf $OUT/n3.tgz -C /tmp n3
S=$(date +%s)
(cd $L/br && PYTHONPATH=$L/br/src timeout 100 python3 -m pytest -q -m "cuda and not slow" -p no:cacheprovider tests/test_op_attention.py \
  -k "fwd and tma-pingpong3 or fwd_tma_agrees" > $L/tests.log 2>&1; echo "tests rc $? in $(( $(date +%s) - S )) s") | tee -a $L/gpu.txt
tail -n 3 $L/tests.log; tar -czf $OUT/n3.tgz -C /tmp n3
