"""One add_layer_norm_bwd (fp32 residual, bf16 branch, the _dy kernel) and one add_layer_norm_fwd at GPT-2's
16384 x 768, warmed up, then inside cudaProfilerStart/Stop for ncu --profile-from-start off."""
import cupy as cp
import ml_dtypes
import numpy as np

import kiln

be = kiln.backend.get_backend("cuda")
rng = np.random.default_rng(0)
n, c = 16384, 768
bf = ml_dtypes.bfloat16
x = be.asarray(rng.standard_normal((n, c)).astype(np.float32))
y = be.asarray(rng.standard_normal((n, c)).astype(bf))
w = be.asarray(rng.standard_normal(c).astype(np.float32))
b = be.asarray(rng.standard_normal(c).astype(np.float32))
gs = be.asarray(rng.standard_normal((n, c)).astype(np.float32))
gh = be.asarray(rng.standard_normal((n, c)).astype(bf))
def run():
    s, h, mean, rstd = be.add_layer_norm_fwd(x, y, w, b, 1e-5, bf)
    return be.add_layer_norm_bwd(gs, gh, s, w, mean, rstd, True, True, np.float32, bf)
for _ in range(3):
    run()
cp.cuda.runtime.deviceSynchronize()
ev = [cp.cuda.Event() for _ in range(2)]
ev[0].record(); [run() for _ in range(20)]; ev[1].record(); ev[1].synchronize()
print("fwd+bwd x20 ms each", cp.cuda.get_elapsed_time(ev[0], ev[1]) / 20)
cp.cuda.runtime.profilerStart(); run(); cp.cuda.runtime.deviceSynchronize(); cp.cuda.runtime.profilerStop()
