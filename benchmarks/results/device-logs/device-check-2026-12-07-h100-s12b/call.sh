export PYTHONUNBUFFERED=1 KILN_COMMIT=3310e3f
L=/tmp/c3; mkdir -p $L
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader | tee $L/gpu.txt
S=$(date +%s)
(PYTHONPATH=$PWD/src timeout 170 python3 -m pytest -q -m "cuda and not slow" -p no:cacheprovider tests/test_op_attention.py > $L/tests-attention.log 2>&1; echo "tests-attention rc $? in $(( $(date +%s) - S )) s") | tee -a $L/gpu.txt
tail -n 3 $L/tests-attention.log
python3 benchmarks/ab.py run --repeat 2 --logs $L/ab --timeout 90 -- python3 benchmarks/attention.py --bwd split 2>&1 | tee $L/ab-driver.log
python3 benchmarks/ab.py table $L/ab | tee $L/ab-table.txt | cut -c1-45,100-
tar -czf $OUT/c3.tgz -C /tmp c3
