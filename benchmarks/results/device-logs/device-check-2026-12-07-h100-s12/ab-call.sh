export KILN_COMMIT=f51b3cc PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=src timeout 90 python3 -m pytest -x -q -m cuda -p no:cacheprovider tests/test_op_attention.py -k "tma_agrees or tma_reads_packed" > /tmp/smoke.log 2>&1; echo "smoke rc $?" | tee -a $OUT/gpu.txt; tail -3 /tmp/smoke.log
python3 benchmarks/ab.py run --repeat 2 --logs /tmp/ab --timeout 120 -- python3 benchmarks/attention.py --bwd split 2>&1 | tee /tmp/ab/run-driver.log
python3 benchmarks/ab.py table /tmp/ab | tee $OUT/ab-table.txt | head -12
cp /tmp/smoke.log /tmp/ab/; tar -czf $OUT/ab.tgz -C /tmp ab
OUT=$OUT bash benchmarks/device_check.sh tests
