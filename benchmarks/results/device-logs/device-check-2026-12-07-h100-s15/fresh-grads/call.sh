set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 KILN_COMMIT=0fa7e7c
O=$OUT/r; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/summary.txt
S=$SECONDS; timeout 150 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_autograd.py tests/test_op_layer_norm.py tests/test_module.py tests/test_cuda_model.py tests/test_cuda_graph.py > $O/tests.log 2>&1
echo "tests rc $? in $((SECONDS-S)) s" | tee -a $O/summary.txt; tail -1 $O/tests.log | tee -a $O/summary.txt; grep -E '^(FAILED|ERROR)' $O/tests.log | head
S=$SECONDS; timeout 150 python3 benchmarks/ab.py run --repeat 2 --logs $O/ab -- python3 benchmarks/gpt2_step.py --modes bf16 --frameworks kiln --steps 40 --warmup 10 --out /tmp/ab-g > $O/ab.log 2>&1
echo "ab rc $? in $((SECONDS-S)) s" | tee -a $O/summary.txt
for f in $O/ab/*.log; do echo "$(basename $f) $(grep 'kiln  *bf16' $f)"; done | tee -a $O/summary.txt
S=$SECONDS; timeout 100 python3 benchmarks/gpt2_step.py --modes bf16 --frameworks kiln-tuned --steps 40 --warmup 10 --kernel-profile $O/prof-tuned --out $O/tuned > $O/tuned.log 2>&1
echo "tuned rc $? in $((SECONDS-S)) s" | tee -a $O/summary.txt; grep -A1 'kiln-tuned *bf16' $O/tuned.log | head -3 | tee -a $O/summary.txt
S=$SECONDS; timeout 120 ncu --clock-control none --profile-from-start off --set full --import-source no -o $O/ln-ncu python3 ab-arms/ln_ncu.py > $O/ln-ncu.log 2>&1
echo "ln-ncu rc $? in $((SECONDS-S)) s" | tee -a $O/summary.txt
ncu --import $O/ln-ncu.ncu-rep --page details > $O/ln-ncu-details.log 2>&1; rm -f $O/ln-ncu.ncu-rep
grep -E 'add_layer_norm|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Theoretical Occ|Eligible|Issued Warp' $O/ln-ncu-details.log | head -40
cd $OUT && tar czf r.tgz r && rm -rf r
