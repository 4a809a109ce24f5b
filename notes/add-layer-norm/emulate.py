"""Run the CUDA LayerNorm wrappers on the CPU with NumPy emulations of the kernels, checking
each launch's argument list against the kernel signature (names, count, scalar types).

After applying the patch, from the repo root: PYTHONPATH=src python3 notes/add-layer-norm/emulate.py
(CPU only; it checks the wrapper's launches and results, not the CUDA code itself)."""
import re, sys
import numpy as np, ml_dtypes
import kiln.backend.cuda.layer_norm as L
from kiln.backend.cuda import device as rt
from kiln.backend.cuda import compiler

class NP:
    def __getattr__(self, n): return getattr(np, n)
    float32 = np.float32
rt.cupy = lambda: NP()
rt.ptr = lambda a: a.__array_interface__["data"][0]
rt.device_id = lambda: 0

launches = []
SIG = {  # kernel base name -> kinds of args: a = array (or None for nullable), i = int32, f = float32
    "layer_norm_fwd_reg": "aaaaaaif", "layer_norm_fwd_any": "aaaaaaiif",
    "add_layer_norm_fwd_reg": "aaaaaaaaif", "add_layer_norm_fwd_any": "aaaaaaaaiif",
    "layer_norm_bwd_reg": "aaaaaaai", "add_layer_norm_bwd_reg": "aaaaaaaai",
    "layer_norm_bwd_any": "aaaaaaii", "add_layer_norm_bwd_any": "aaaaaaaii",
    "layer_norm_dwdb_any": "aaaaaiii", "layer_norm_dwdb_finish": "aiinn",
}
F = lambda a: a.astype(np.float32)
CT = {"float": np.float32, "__nv_bfloat16": ml_dtypes.bfloat16, "__half": np.float16}

def ln_rows(v, w, b, eps):
    mu = v.mean(-1, keepdims=True); r = 1 / np.sqrt(((v - mu) ** 2).mean(-1, keepdims=True) + eps)
    return (v - mu) * r * F(w) + F(b), mu[:, 0], r[:, 0]

def bwd_rows(g, x, w, mu, r):
    xh = (F(x) - mu[:, None]) * r[:, None]; gw = F(g) * F(w)
    a = gw.mean(-1, keepdims=True); bb = (gw * xh).mean(-1, keepdims=True)
    return r[:, None] * (gw - a - xh * bb), xh

def fake_get_kernel(family, expr):
    assert expr in compiler.FAMILIES[family], expr
    m = re.match(r"(\w+)<([^,>]+)(?:, (\d+))?>", expr)
    base, T, C = m.group(1), CT[m.group(2)], m.group(3)
    def k(grid, block, args):
        sig = SIG[base]
        assert len(args) == len(sig), (expr, len(args), len(sig))
        for a, kind in zip(args, sig):
            if kind == "a": assert isinstance(a, np.ndarray), (expr, type(a))
            if kind == "n": assert a is None or isinstance(a, np.ndarray)
            if kind == "i": assert isinstance(a, np.int32), (expr, type(a))
            if kind == "f": assert isinstance(a, np.float32), (expr, type(a))
        for a in args:
            if isinstance(a, np.ndarray) and a.dtype != np.float32 and base != "layer_norm_dwdb_finish":
                assert a.dtype == T or a.dtype == np.float32, (expr, a.dtype, T)
        if C is not None:
            for a in args:
                if isinstance(a, np.ndarray) and a.dtype == T and a.ndim == 2: assert a.shape[1] == int(C)
                if isinstance(a, np.ndarray): assert rt.ptr(a) % 16 == 0, expr
        launches.append(expr)
        if "fwd" in base:
            add = base.startswith("add_")
            if add:
                x, y, w, b, s, h, mean, rstd = args[:8]
                s[...] = (F(x) + F(y)).astype(T); v = F(s)
            else:
                x, w, b, h, mean, rstd = args[:6]; v = F(x)
            eps = args[-1]
            out, mu, r = ln_rows(v, w, b, eps)
            h[...] = out.astype(T); mean[...] = mu; rstd[...] = r
        elif "bwd" in base:
            add = base.startswith("add_")
            ds, rest = (args[0], args[1:]) if add else (None, args)
            g, x, w, mean, rstd, dx = rest[:6]
            d, xh = bwd_rows(g, x, w, mean, rstd)
            if add: d = d + F(ds)
            dx[...] = d.astype(T)
            if base.endswith("_reg"):
                partial, n = rest[6], int(rest[7]); parts = grid[0]
                assert block == (256,) and partial.shape == (2 * parts, x.shape[1])
                blk = (np.arange(n) // 8) % parts
                for kk in range(parts):
                    sel = blk == kk
                    partial[kk] = (F(g)[sel] * xh[sel]).sum(0); partial[parts + kk] = F(g)[sel].sum(0)
        elif base == "layer_norm_dwdb_any":
            g, x, mean, rstd, partial, n, C_, rpc = args; parts = grid[1]
            xh = (F(x) - mean[:, None]) * rstd[:, None]
            for kk in range(parts):
                sl = slice(kk * int(rpc), min(int(n), (kk + 1) * int(rpc)))
                partial[kk] = (F(g)[sl] * xh[sl]).sum(0); partial[parts + kk] = F(g)[sl].sum(0)
        elif base == "layer_norm_dwdb_finish":
            partial, parts, C_, dw, db = args
            if dw is not None: dw[...] = partial[:int(parts)].sum(0).astype(T)
            if db is not None: db[...] = partial[int(parts):].sum(0).astype(T)
    return k

L.get_kernel = fake_get_kernel
from kiln.backend import cpu

def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.isfinite(a).all()
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)

def poisoned(shape, dtype):
    return np.full(shape, np.nan, dtype=dtype)
NP.empty = staticmethod(lambda shape, dtype=float, order="C": poisoned(shape, dtype))
NP.empty_like = staticmethod(lambda a, dtype=None, **k: poisoned(a.shape, dtype or a.dtype))

rng = np.random.default_rng(0)
TOL = {np.float32: 1e-5, ml_dtypes.bfloat16: 1e-2, np.float16: 2e-3}
for dt in (np.float32, ml_dtypes.bfloat16, np.float16, np.float64):
    for (n, c) in [(5, 768), (37, 100), (64, 1024), (9, 2048), (3, 5000), (7, 4096), (300, 768)]:
        for aff in ("wb", "w", "none"):
            for with_ds in (True, False):
                launches.clear()
                x = (rng.standard_normal((n, c)) * 2 + 0.5).astype(dt); y = rng.standard_normal((n, c)).astype(dt)
                w = rng.standard_normal(c).astype(dt) if aff != "none" else None
                b = rng.standard_normal(c).astype(dt) if aff == "wb" else None
                gs = rng.standard_normal((n, c)).astype(dt) if with_ds else None
                gh = rng.standard_normal((n, c)).astype(dt)
                s, h, mean, rstd = L.add_layer_norm_fwd(x, y, w, b, 1e-5)
                s_ref = np.add(x, y)
                assert np.array_equal(s.astype(np.float64), s_ref.astype(np.float64))
                f = lambda a: None if a is None else a.astype(np.float64)
                ry, rm, rr = cpu.layer_norm_fwd(f(s_ref), f(w), f(b), 1e-5)
                tol = TOL.get(dt, 1e-12)
                assert rel(h, ry) < tol, (dt, n, c)
                dx, dw, db = L.add_layer_norm_bwd(gs, gh, s, w, mean, rstd, w is not None, b is not None)
                rdx, rdw, rdb = cpu.add_layer_norm_bwd(f(gs), f(gh), f(s_ref), f(w), rm, rr, w is not None, b is not None)
                assert rel(dx, rdx) < 10 * tol, (dt, n, c, rel(dx, rdx))
                if w is not None: assert rel(dw, rdw) < 10 * tol
                else: assert dw is None
                if b is not None: assert rel(db, rdb) < 10 * tol
                else: assert db is None
                # the plain LayerNorm through the shared backward
                y2, m2, r2 = L.layer_norm_fwd(s, w, b, 1e-5)
                assert rel(y2, ry) < tol
                dx2, _, _ = L.layer_norm_bwd(gh, s, w, m2, r2, w is not None, b is not None)
                rdx2, _, _ = cpu.layer_norm_bwd(f(gh), f(s_ref), f(w), rm, rr, False, False)
                assert rel(dx2, rdx2) < 10 * tol
        print(np.dtype(dt).name, "ok; last launches:", launches)
# unaligned: offset views take the generic kernels
x = rng.standard_normal((19 * 768 + 2,)).astype(np.float32)[2:].reshape(19, 768)
y = rng.standard_normal((19, 768)).astype(np.float32)
launches.clear(); L.add_layer_norm_fwd(x, y, None, None, 1e-5); print("unaligned:", launches)
