# One call (~5 min, any GPU): the TMA forward's exponentials partly on the FMA pipe (KILN_ATTENTION_EXP2_FMA, period
# 0 = none = main's cubin, 4, 2, and 3 at D64; 4 at D128), interleaved twice in one tree; then the forward tests under
# periods 1 and 3. Prediction: D64 is MUFU-bound (a tile's 8192 exponentials take the MUFU as long as its two
# products take the tensor cores; D64 fwd 377 TFLOP/s vs D128 504): period 4 -> 5-15% faster fwd at D64 T >= 2048,
# nothing at D128.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src KILN_COMMIT=$(git rev-parse --short HEAD)
L=/tmp/ne; mkdir -p $L
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee -a $L/gpu.txt
S=$(date +%s)
for v in 0 4 2 3; do  # compile each arm's family at once, in parallel
  KILN_ATTENTION_EXP2_FMA=64:$v,128:$v python3 -c "from kiln.backend.cuda import attention, compiler; compiler.load_or_compile('attention.cu', 'sm_90a')" > $L/compile-$v.log 2>&1 &
done; wait; echo "compiled in $(( $(date +%s) - S )) s" | tee -a $L/gpu.txt
SH=32x12x512x64,16x12x1024x64,8x16x1024x64,8x12x2048x64,4x12x4096x64,2x12x8192x64,2x12x16384x64,4x32x2048x128,2x16x8192x128
for rep in 1 2; do for v in 0 4 2 3; do
  S=$(date +%s); KILN_ATTENTION_EXP2_FMA=64:$v,128:$v timeout 60 python3 benchmarks/attention.py --ops fwd --shapes $SH \
    --out $L/fwd-p$v-r$rep.json > $L/fwd-p$v-r$rep.log 2>&1
  echo "p$v r$rep rc $? in $(( $(date +%s) - S )) s" | tee -a $L/gpu.txt
done; tar -czf $OUT/ne.tgz -C /tmp ne; done
python3 - <<'PY' | tee $L/table.txt
import json, glob, statistics, collections
t = collections.defaultdict(list)
for f in glob.glob("/tmp/ne/fwd-p*-r*.json"):
    p = f.split("fwd-p")[1].split("-")[0]
    for r in json.load(open(f))["rows"]:
        t[("x".join(map(str, r["shape"])), p)].append((r["kiln_ms"], r["torch_ms"]))
for sh in dict.fromkeys(k[0] for k in t):
    base = statistics.median(x[0] for x in t[(sh, "0")])
    print(f"{sh:16s} " + "  ".join(f"p{p} {statistics.median(x[0] for x in t[(sh, p)]):.4f} ({statistics.median(x[0] for x in t[(sh, p)]) / base:.3f}x)"
                                  for p in "0423" if (sh, p) in t)
          + f"  sdpa {statistics.median(x[1] for k, v in t.items() if k[0] == sh for x in v):.4f}")
PY
tar -czf $OUT/ne.tgz -C /tmp ne
S=$(date +%s); KILN_ATTENTION_EXP2_FMA=64:4,128:4 timeout 200 python3 -m pytest -q -m "cuda and not slow" -p no:cacheprovider \
  tests/test_op_attention.py -k "fwd or exp2_fma" > $L/tests.log 2>&1; echo "tests rc $? in $(( $(date +%s) - S )) s" | tee -a $L/gpu.txt
tail -n 3 $L/tests.log; tar -czf $OUT/ne.tgz -C /tmp ne
