set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 KILN_COMMIT=6b8da99
O=$OUT
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader | tee $O/summary.txt
S=$(date +%s)
(timeout 80 python3 -m pytest -q -m "cuda and not slow" -p no:cacheprovider tests/test_op_attention.py -k "bwd or grad or fused" > $O/tests-attention-bwd.log 2>&1; echo "tests-attention-bwd rc $? in $(( $(date +%s) - S )) s") | tee -a $O/summary.txt
S=$(date +%s)
(timeout 60 python3 benchmarks/attention.py --bwd split,fused-bulk --out /tmp/attention.json > $O/attention.log 2>&1; echo "attention rc $? in $(( $(date +%s) - S )) s") | tee -a $O/summary.txt
S=$(date +%s)
tail -2 $O/tests-attention-bwd.log; grep -E "16x12x1024x64|2x12x16384" $O/attention.log
