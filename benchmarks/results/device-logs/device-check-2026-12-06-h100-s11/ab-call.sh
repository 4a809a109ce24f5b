set -u
# Each arm runs from its own copy (benchmarks/ + that arm's src/): kernel_speed.py puts ROOT/src first on sys.path.
export PYTHONUNBUFFERED=1
L=/tmp/logs; mkdir -p $L
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee $L/gpu.txt
for a in base ffma wt; do mkdir -p /tmp/$a && cp -r benchmarks /tmp/$a/ && tar -xzf ab-$a-src.tgz -C /tmp/$a; done
for i in 1 2; do
  for a in base ffma wt; do
    if [ $a = ffma ]; then B=split; else B=split,fused-bulk; fi
    (cd /tmp/$a && PYTHONPATH=/tmp/$a/src timeout 100 python3 benchmarks/attention.py --bwd $B --out $L/attention-$a-$i.json > $L/attention-$a-$i.log 2>&1; echo "$a $i rc $?") | tee -a $L/summary.txt
  done
done
mkdir -p $L/ncu; OUT=$L/ncu PYTHONPATH=$PWD/src timeout 200 bash benchmarks/device_check.sh attention-ncu > $L/ncu-driver.log 2>&1; echo "ncu rc $?" | tee -a $L/summary.txt
ls -la $L/ncu
tar -czf $OUT/call.tgz -C /tmp logs; ls -la $OUT
