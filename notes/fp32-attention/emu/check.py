# check.py "B,H,T,D;B,H,T,D..." [layout 0|1] [cp.async mode 0|1|2] [tsan]: runs the emulated fp32 kernels
# (./emu) on random inputs and compares out, lse, dq, dk, dv with the float64 CPU reference.
# layout 1: q, k, v, dq, dk, dv as views of [B, T, 3, H, D], out and grad of [B, T, H, D].
# mode 0: cp.async copies land at issue, 1: at the wait, 2: either, at random.
import os, subprocess, sys, tempfile, time
import numpy as np
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "src"))
from kiln.backend.cpu import attention as cpu

def rel(got, ref):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if not np.isfinite(got).all():
        return float("inf")
    d = np.linalg.norm(ref)
    return float(np.linalg.norm(got - ref) / (d if d > 0 else 1.0))

def run(shape, layout=0, mode=0, tsan=False, seed=0, scale_in=1.0):
    b, h, t, d = shape
    rng = np.random.default_rng(seed)
    q, k, v, g = ((rng.standard_normal(shape) * scale_in).astype(np.float32) for _ in range(4))
    with tempfile.TemporaryDirectory() as dd:
        for n, a in zip("qkvg", (q, k, v, g)):
            a.tofile(f"{dd}/{n}.bin")
        exe = os.path.join(HERE, "emu_tsan" if tsan else "emu")
        t0 = time.time()
        r = subprocess.run([exe, dd, str(b), str(h), str(t), str(d), str(layout), str(seed + 1)],
                           capture_output=True, text=True, env=dict(os.environ, EMU_MODE=str(mode)))
        el = time.time() - t0
        if r.returncode != 0 or "WARNING: ThreadSanitizer" in r.stderr:
            print("FAILED rc", r.returncode, r.stderr[-3000:])
            return False
        rd = lambda n, s: np.fromfile(f"{dd}/{n}.bin", np.float32).reshape(s)
        out, lse = rd("out", shape), rd("lse", shape[:3])
        dq, dk, dv = rd("dq", shape), rd("dk", shape), rd("dv", shape)
    sc = 1.0 / np.sqrt(np.float32(d))
    f = lambda a: a.astype(np.float64)
    rout, rlse = cpu.attention_fwd(f(q), f(k), f(v), float(sc))
    refs = cpu.attention_bwd(f(g), f(q), f(k), f(v), f(out), f(lse), float(sc))
    errs = dict(out=rel(out, rout), lse=rel(lse, rlse), dq=rel(dq, refs[0]), dk=rel(dk, refs[1]), dv=rel(dv, refs[2]))
    tol = dict(out=5e-5, lse=5e-5, dq=1e-4, dk=1e-4, dv=1e-4)
    ok = all(errs[x] <= tol[x] for x in errs) and "stray_writes 0 align_errors 0" in r.stdout
    print(f"{'ok  ' if ok else 'FAIL'} {shape} layout={layout} mode={mode} tsan={tsan} {el:.1f}s "
          + " ".join(f"{x}={e:.2e}" for x, e in errs.items()) + " | " + r.stdout.strip() + (" | " + r.stderr.strip()[-300:] if r.stderr.strip() else ""))
    return ok

if __name__ == "__main__":
    shapes = [tuple(map(int, s.split(","))) for s in sys.argv[1].split(";")]
    layout = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    mode = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    tsan = len(sys.argv) > 4 and sys.argv[4] == "tsan"
    ok = all([run(s, layout, mode, tsan) for s in shapes])
    sys.exit(0 if ok else 1)
