"""Same-process timing of attention.cu variants (HEAD, new, new with fwd launch bounds 1)."""
import shutil, sys, tempfile
from pathlib import Path
import numpy as np
import cupy as cp
from kiln.backend.cuda import compiler, device
from kiln.backend.cuda import attention as att

def use(src):
    d = Path(tempfile.mkdtemp())
    for p in compiler.KERNEL_DIR.glob("*.cuh"):
        shutil.copy(p, d)
    (d / "attention.cu").write_text(Path(src).read_text())
    compiler.KERNEL_DIR = d
    compiler._modules.clear(); compiler._kernels.clear()

def ms(fn, iters=30):
    s = device.stream()
    for _ in range(3): fn()
    ts = []
    for _ in range(iters):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(s); fn(); b.record(s); b.synchronize()
        ts.append(cp.cuda.get_elapsed_time(a, b))
    return float(np.median(ts))

shape = (16, 12, 1024, 64)
rs = cp.random.RandomState(0)
q, k, v, g = (rs.standard_normal(shape, dtype=cp.float32).astype("bfloat16") for _ in range(4))
scale = 1 / 8
cp.cuda.Device().synchronize()
fl = 4 * 16 * 12 * 1024 * 1024 * 64 / 2
res = {}
for name in sys.argv[1:]:
    use(f"variants/{name}.cu")
    o, l = att.attention_fwd(q, k, v, scale)
    grads = att.attention_bwd(g, q, k, v, o, l, scale)
    res[name] = [x.astype(cp.float32) for x in (o, l) + tuple(grads)]
    f = ms(lambda: att.attention_fwd(q, k, v, scale))
    def fb():
        o_, l_ = att.attention_fwd(q, k, v, scale)
        att.attention_bwd(g, q, k, v, o_, l_, scale)
    t = ms(fb)
    print(f"{name:6s} fwd {f:.3f} ms {fl/f/1e9:.0f} TF/s  fwd+bwd {t:.3f} ms {3.5*fl/t/1e9:.0f} TF/s  bwd {t-f:.3f}", flush=True)
ref = res[sys.argv[1]]
for name in sys.argv[2:]:
    print(name, "vs", sys.argv[1], "max|diff| o,lse,dq,dk,dv:",
          [float(cp.abs(a - b).max()) for a, b in zip(res[name], ref)],
          "bitwise:", [bool(cp.array_equal(a, b)) for a, b in zip(res[name], ref)])
