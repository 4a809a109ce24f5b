# Next session, one call (~6 min, any GPU): the CUDA suite with split-tma as the default backward at head dim 64, then
# attention.py at the paper's shapes (fwd, bwd, fwd+bwd against SDPA: the target row's figures since split-tma), then
# GPT-2 bf16 kiln/compile and long context fp32 against eager. Then, on an H200 (kind nvidia-h200, needs_h200 true):
# bash ab-arms/next-h200-largest.sh (the largest model, never measured on an H200).
export PYTHONUNBUFFERED=1 KILN_COMMIT=$(git rev-parse --short HEAD) PYTHONPATH=$PWD/src
L=/tmp/ns; mkdir -p $L
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader | tee $L/gpu.txt
S=$(date +%s); timeout 220 python3 benchmarks/cuda_suite.py --shards 4 --logs $L/suite > $L/cuda-suite.log 2>&1
echo "cuda suite rc $? in $(( $(date +%s) - S )) s" | tee -a $L/gpu.txt; tail -n 6 $L/cuda-suite.log; tar -czf $OUT/ns.tgz -C /tmp ns
S=$(date +%s); timeout 150 python3 benchmarks/attention.py --out $L/attention.json > $L/attention.log 2>&1
echo "attention rc $? in $(( $(date +%s) - S )) s" | tee -a $L/gpu.txt; grep "fwd+bwd" $L/attention.log; tar -czf $OUT/ns.tgz -C /tmp ns
S=$(date +%s); timeout 120 python3 benchmarks/gpt2_step.py --modes bf16 --frameworks kiln,eager,compile --steps 40 --warmup 10 --out $L/gpt2 > $L/gpt2.log 2>&1
echo "gpt2 rc $? in $(( $(date +%s) - S )) s" | tee -a $L/gpu.txt; grep "tok/s" $L/gpt2.log; tar -czf $OUT/ns.tgz -C /tmp ns
