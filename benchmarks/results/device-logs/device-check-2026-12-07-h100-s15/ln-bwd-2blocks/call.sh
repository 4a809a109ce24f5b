set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 KILN_COMMIT=9034a7b
O=$OUT/r; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/summary.txt
S=$SECONDS; timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_op_layer_norm.py tests/test_kernel_compile.py > $O/tests.log 2>&1
echo "tests rc $? in $((SECONDS-S)) s" | tee -a $O/summary.txt; tail -1 $O/tests.log | tee -a $O/summary.txt; grep -E '^(FAILED|ERROR)' $O/tests.log | head
S=$SECONDS; timeout 40 ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy --section LaunchStats python3 ab-arms/ln_ncu.py > $O/ln-ncu.log 2>&1
echo "ln-ncu rc $? in $((SECONDS-S)) s" | tee -a $O/summary.txt
grep -E 'add_layer_norm_bwd|Duration|DRAM Throughput|Registers Per|Achieved Occupancy' $O/ln-ncu.log | tail -6
S=$SECONDS; timeout 150 python3 benchmarks/ab.py run --repeat 1 --logs $O/ab -- python3 benchmarks/gpt2_step.py --modes bf16 --frameworks kiln --steps 60 --warmup 10 --out /tmp/ab-g > $O/ab.log 2>&1
echo "ab rc $? in $((SECONDS-S)) s" | tee -a $O/summary.txt
for f in $O/ab/*.log; do echo "$(basename $f) $(grep 'kiln  *bf16' $f)"; done | tee -a $O/summary.txt
cd $OUT && tar czf r.tgz r && rm -rf r
