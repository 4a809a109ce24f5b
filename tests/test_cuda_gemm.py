"""kiln's cuBLASLt GEMM against float64 NumPy: every transpose / leading-dimension combination.

The integration report's probe found exactly one right call among sixteen accepted-looking
ones, and that swapped leading dimensions are silently accepted and silently wrong; this
probe walks (trans_a, trans_b) x (tight, padded) leading dimensions of kiln's row-major
`cublaslt.gemm` entry for fp32, tf32 and bf16, and then the backend entries (matmul, batched
matmul, linear_fwd/linear_bwd with and without bias) against the CPU backend. Relative error
||gpu - ref|| / ||ref||: fp32 <= 1e-5, tf32 <= 1e-3, bf16 <= 1e-2.
"""

from __future__ import annotations

import itertools
import math

import ml_dtypes
import numpy as np
import pytest

import kiln
from kiln.backend import cpu
from tests.conftest import rel

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not kiln.cuda_is_available(), reason="needs an NVIDIA GPU with CuPy")]

BF16 = np.dtype(ml_dtypes.bfloat16)
# precision mode -> (array dtype, tolerance)
MODES = {"fp32": (np.float32, 1e-5), "tf32": (np.float32, 1e-3), "bf16": (BF16, 1e-2)}


@pytest.fixture
def gpu():
    backend = kiln.backend.get_backend("cuda")
    before = backend.get_matmul_precision()
    yield backend
    backend.set_matmul_precision(before)


def stored(rng, rows, cols, ld, dtype):
    """A [rows, cols] matrix inside a [rows, ld] buffer (ld >= cols), as host (buffer, view)."""
    buf = rng.standard_normal((rows, ld)).astype(dtype)
    return buf, buf[:, :cols]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("m,n,k", [(256, 512, 128), (37, 29, 45), (1, 64, 8), (64, 1, 33)])
@pytest.mark.parametrize("trans_a,trans_b,pad_a,pad_b,pad_c", list(itertools.product([False, True], repeat=5)))
def test_gemm_probe_every_transpose_and_leading_dimension(gpu, mode, m, n, k, trans_a, trans_b, pad_a, pad_b, pad_c):
    from kiln.backend.cuda import cublaslt
    dtype, tol = MODES[mode]
    gpu.set_matmul_precision(mode)
    rng = np.random.default_rng()
    # A is [m, k], stored as [k, m] when transposed; B is [k, n], stored [n, k] when transposed.
    ar, ac = (k, m) if trans_a else (m, k)
    br, bc = (n, k) if trans_b else (k, n)
    lda, ldb, ldc = ac + 8 * pad_a, bc + 8 * pad_b, n + 8 * pad_c
    a_buf, a_view = stored(rng, ar, ac, lda, dtype)
    b_buf, b_view = stored(rng, br, bc, ldb, dtype)
    a_op = a_view.astype(np.float64).T if trans_a else a_view.astype(np.float64)
    b_op = b_view.astype(np.float64).T if trans_b else b_view.astype(np.float64)
    ref = a_op @ b_op
    da, db = gpu.asarray(a_buf), gpu.asarray(b_buf)
    dc = gpu.asarray(np.full((m, ldc), np.nan, dtype=dtype))
    cublaslt.gemm(da, db, dc, m=m, n=n, k=k, trans_a=trans_a, trans_b=trans_b, lda=lda, ldb=ldb, ldc=ldc)
    out = gpu.to_numpy(dc)
    assert rel(out[:, :n], ref) <= tol
    if pad_c:  # the padding of C is not touched
        assert np.isnan(out[:, n:].astype(np.float32)).all()


@pytest.mark.parametrize("mode", list(MODES))
def test_gemm_bias_epilogue(gpu, mode):
    from kiln.backend.cuda import cublaslt
    dtype, tol = MODES[mode]
    gpu.set_matmul_precision(mode)
    rng = np.random.default_rng()
    m, n, k = 96, 80, 64
    a, b, bias = (rng.standard_normal(s).astype(dtype) for s in ((m, k), (k, n), (n,)))
    c = gpu.empty((m, n), dtype)
    cublaslt.gemm(gpu.asarray(a), gpu.asarray(b), c, m=m, n=n, k=k, bias=gpu.asarray(bias), epilogue="bias")
    ref = a.astype(np.float64) @ b.astype(np.float64) + bias.astype(np.float64)
    assert rel(gpu.to_numpy(c), ref) <= tol


@pytest.mark.parametrize("shape", [(1, 8), (3, 1001), (33, 768), (300, 2304),
                                   pytest.param((16384, 3072), marks=pytest.mark.slow)])
@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float16], ids=["fp32", "bf16", "fp16"])
def test_linear_bias_grad_is_a_deterministic_column_sum(gpu, shape, dtype):
    """linear_bwd's dbias: kiln's column sums (matmul.cu) of grad, vector and scalar paths, several parts and a
    partial last one, against float64; the same bits twice (fixed-order finish)."""
    rng = np.random.default_rng()
    g = rng.standard_normal(shape).astype(dtype)
    w = rng.standard_normal((shape[1], 5)).astype(dtype)
    db = gpu.linear_bwd(gpu.asarray(g), None, gpu.asarray(w), False, False, True)[2]
    db32 = gpu.linear_bwd(gpu.asarray(g), None, gpu.asarray(w), False, False, True, np.float32)[2]
    ref = g.astype(np.float64).sum(axis=0)
    assert db.dtype == np.dtype(dtype) and db32.dtype == np.float32
    assert rel(gpu.to_numpy(db), ref) <= (1e-5 if dtype == np.float32 else 1e-2)
    assert rel(gpu.to_numpy(db32), ref) <= 1e-5
    again = gpu.linear_bwd(gpu.asarray(g), None, gpu.asarray(w), False, False, True)[2]
    assert np.array_equal(gpu.to_numpy(again), gpu.to_numpy(db))


@pytest.mark.parametrize("parts", [1, 3, 129, 700])
@pytest.mark.parametrize("c", [5, 8, 768, 1001])
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["fp32", "bf16"])
def test_column_sum_finish_adds_every_part_of_both_outputs(gpu, parts, c, dtype):
    """column_sum_finish on its own: outputs 0 and 1 the column sums of their parts' rows (float4 lanes when
    c % 4 == 0, one float else; part counts below, at and past its 128 part lanes), a None output skipped,
    the same bits on a second call."""
    from kiln.backend.cuda.launch import column_sum_finish
    rng = np.random.default_rng(parts * 10007 + c)
    partial = rng.standard_normal((2 * parts, c)).astype(np.float32)
    ref = partial.astype(np.float64).reshape(2, parts, c).sum(axis=1)
    p = gpu.asarray(partial)
    outs = [gpu.empty((c,), dtype), gpu.empty((c,), dtype)]
    column_sum_finish("matmul.cu", p, parts, c, outs)
    for out, r in zip(outs, ref):
        assert rel(gpu.to_numpy(out), r) <= (1e-6 if dtype == np.float32 else 1e-2)
    again = gpu.empty((c,), dtype)
    column_sum_finish("matmul.cu", p, parts, c, (None, again))
    assert np.array_equal(gpu.to_numpy(again), gpu.to_numpy(outs[1]))


def test_gemm_gelu_aux_bias_epilogue(gpu):
    from kiln.backend.cuda import cublaslt
    rng = np.random.default_rng()
    m, n, k = 64, 96, 32
    a, b, bias = (rng.standard_normal(s).astype(np.float32) for s in ((m, k), (k, n), (n,)))
    c, aux = gpu.empty((m, n), np.float32), gpu.empty((m, n), np.float32)
    cublaslt.gemm(gpu.asarray(a), gpu.asarray(b), c, m=m, n=n, k=k, bias=gpu.asarray(bias),
                  epilogue="gelu_aux_bias", aux=aux, aux_ld=n)
    pre = a.astype(np.float64) @ b.astype(np.float64) + bias
    assert rel(gpu.to_numpy(aux), pre) <= 1e-5
    assert rel(gpu.to_numpy(c), cpu.gelu_fwd(pre)) <= 1e-3  # cuBLASLt's GELU approximation


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["fp32", "bf16"])
def test_gemm_accumulates_into_float32(gpu, dtype):
    """out (+)= A^T @ B with out float32 (bf16 operands too) and beta = 1: the fused LM head's dweight."""
    from kiln.backend.cuda import cublaslt
    rng = np.random.default_rng()
    m, n, k = 80, 48, 40
    a, b = rng.standard_normal((k, m)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
    start = rng.standard_normal((m, n)).astype(np.float32)
    out = gpu.asarray(start)
    cublaslt.gemm(gpu.asarray(a), gpu.asarray(b), out, m=m, n=n, k=k, trans_a=True, accumulate=True)
    ref = start + a.astype(np.float64).T @ b.astype(np.float64)
    assert rel(gpu.to_numpy(out), ref) <= 1e-5
    cublaslt.gemm(gpu.asarray(a), gpu.asarray(b), out, m=m, n=n, k=k, trans_a=True)  # beta = 0: overwritten
    assert rel(gpu.to_numpy(out), ref - start) <= 1e-5
    with pytest.raises(kiln.KilnError, match="into"):
        cublaslt.gemm(gpu.asarray(a), gpu.asarray(b), gpu.empty((m, n), np.float64), m=m, n=n, k=k, trans_a=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_linear_gelu_fwd_matches_the_cpu_backend(gpu, dtype):
    """bf16: the GELU_AUX_BIAS epilogue (gelu and the pre-activation from one GEMM); fp32: GEMM + kiln's GELU."""
    import ml_dtypes
    dt = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    rng = np.random.default_rng()
    x, w, b = (rng.standard_normal(s).astype(dt) for s in ((96, 64), (256, 64), (256,)))
    h, pre = gpu.linear_gelu_fwd(gpu.asarray(x), gpu.asarray(w), gpu.asarray(b))
    rh, rpre = cpu.linear_gelu_fwd(*(a.astype(np.float64) for a in (x, w, b)))
    tol = 1e-5 if dtype == "float32" else 1e-2
    assert rel(gpu.to_numpy(pre), rpre) <= tol
    assert rel(gpu.to_numpy(h), rh) <= tol


@pytest.mark.parametrize("dtype, need_db", [("float32", True), ("bfloat16", True), ("bfloat16", False)],
                         ids=["fp32", "bf16-dgelu-column_sums", "bf16-dgelu"])
def test_linear_gelu_bwd_matches_the_cpu_backend(gpu, dtype, need_db):
    """dpre = (grad @ weight) * gelu'(pre) and fc's bias gradient: bf16 in one GEMM (the DGELU epilogue) and
    kiln's column sums of dpre, fp32 as GEMM + kiln's GELU backward; dbias in float32 (a bf16 copy of fp32
    master weights). Two runs give the same bits."""
    import ml_dtypes
    dt = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    rng = np.random.default_rng()
    rows, n_out, n_in = 1000, 64, 256  # rows not a multiple of a tile
    g, w, pre = (rng.standard_normal(s).astype(dt) for s in ((rows, n_out), (n_out, n_in), (rows, n_in)))
    runs = [gpu.linear_gelu_bwd(gpu.asarray(g), gpu.asarray(pre), gpu.asarray(w), need_db, np.float32)
            for _ in range(2)]
    ref_dpre, ref_db = cpu.linear_gelu_bwd(*(a.astype(np.float64) for a in (g, pre, w)), True)
    tol = 1e-5 if dtype == "float32" else 1e-2
    dpre, db = runs[0]
    assert dpre.dtype == dt and rel(gpu.to_numpy(dpre), ref_dpre) <= tol
    if need_db:
        assert db.dtype == np.float32 and db.shape == (n_in,) and rel(gpu.to_numpy(db), ref_db) <= tol
    else:
        assert db is None
    for a, b in zip(runs[0], runs[1]):
        assert (a is None and b is None) or gpu.to_numpy(a).tobytes() == gpu.to_numpy(b).tobytes()


def test_plans_are_cached(gpu):
    from kiln.backend.cuda import cublaslt
    a = gpu.asarray(np.ones((32, 16), np.float32))
    b = gpu.asarray(np.ones((16, 8), np.float32))
    gpu.matmul(a, b)
    count = len(cublaslt._plans)
    gpu.matmul(a, b)
    assert len(cublaslt._plans) == count


def _rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


MATMUL_CASES = [
    ((5, 7), (7, 3), None),
    ((4, 3, 65, 64), (4, 3, 64, 65), None),          # attention scores [B,H,T,D] @ [B,H,D,T]
    ((4, 3, 65, 65), (4, 3, 65, 64), None),
    ((2, 9, 33), (33, 17), None),                    # folded into one GEMM
    ((17, 33), (2, 33, 9), None),                    # broadcast A (batch stride 0)
    ((2, 1, 8, 4), (1, 3, 4, 5), None),              # partial broadcast (materialised)
    ((6, 16, 8), (6, 16, 8), "swap_b"),              # b^T as a view: transpose flag
    ((6, 8, 16), (6, 8, 16), "swap_a"),              # a^T as a view
    pytest.param((16, 1024, 768), (768, 768), None, marks=pytest.mark.slow),  # GPT-2 projection
    ((7,), (7, 3), None), ((5, 7), (7,), None),      # 1-D operands
]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("sa,sb,view", MATMUL_CASES)
def test_matmul_matches_cpu(gpu, mode, sa, sb, view):
    dtype, tol = MODES[mode]
    gpu.set_matmul_precision(mode)
    rng = np.random.default_rng()
    a, b = _rand(rng, sa, dtype), _rand(rng, sb, dtype)
    da, db = gpu.asarray(a), gpu.asarray(b)
    if view == "swap_b":
        b, db = np.swapaxes(b, -1, -2), db.swapaxes(-1, -2)
    if view == "swap_a":
        a, da = np.swapaxes(a, -1, -2), da.swapaxes(-1, -2)
    ref = cpu.matmul(a.astype(np.float64), b.astype(np.float64))
    out = gpu.matmul(da, db)
    assert out.dtype == np.dtype(dtype)
    assert rel(gpu.to_numpy(out), ref) <= tol


LINEAR_SHAPES = [(5, 7, 3), (64, 768, 2304), (37, 45, 29),
                 pytest.param(16 * 1024, 768, 3072, marks=pytest.mark.slow)]  # GPT-2 MLP


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("n,fin,fout", LINEAR_SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_fwd_bwd_match_cpu(gpu, mode, n, fin, fout, with_bias):
    dtype, tol = MODES[mode]
    gpu.set_matmul_precision(mode)
    rng = np.random.default_rng()
    x, w, g = _rand(rng, (n, fin), dtype), _rand(rng, (fout, fin), dtype), _rand(rng, (n, fout), dtype)
    b = _rand(rng, (fout,), dtype) if with_bias else None
    y = gpu.linear_fwd(gpu.asarray(x), gpu.asarray(w), None if b is None else gpu.asarray(b))
    f = lambda a: None if a is None else a.astype(np.float64)  # noqa: E731
    assert rel(gpu.to_numpy(y), cpu.linear_fwd(f(x), f(w), f(b))) <= tol
    dx, dw, db = gpu.linear_bwd(gpu.asarray(g), gpu.asarray(x), gpu.asarray(w), True, True, with_bias)
    rdx, rdw, rdb = cpu.linear_bwd(f(g), f(x), f(w), True, True, with_bias)
    assert rel(gpu.to_numpy(dx), rdx) <= tol
    assert rel(gpu.to_numpy(dw), rdw) <= tol
    if with_bias:
        assert db.dtype == np.dtype(dtype) and rel(gpu.to_numpy(db), rdb) <= tol
    else:
        assert db is None
    dx2, dw2, db2 = gpu.linear_bwd(gpu.asarray(g), None, gpu.asarray(w), True, False, False)
    assert dw2 is None and db2 is None and rel(gpu.to_numpy(dx2), rdx) <= tol


@pytest.mark.parametrize("n,fin,fout", LINEAR_SHAPES)
def test_linear_bwd_param_grads_in_fp32(gpu, n, fin, fout):
    """bf16 operands over fp32 master weights: the dW GEMM writes its fp32 accumulator as dweight and dbias
    is fp32 too (BGRADB in D's type, or the reduction), at fp32-accumulation accuracy, no bf16 rounding."""
    rng = np.random.default_rng()
    x, w, g = _rand(rng, (n, fin), BF16), _rand(rng, (fout, fin), BF16), _rand(rng, (n, fout), BF16)
    dx, dw, db = gpu.linear_bwd(gpu.asarray(g), gpu.asarray(x), gpu.asarray(w), True, True, True, np.float32)
    f = lambda a: a.astype(np.float64)  # noqa: E731
    rdx, rdw, rdb = cpu.linear_bwd(f(g), f(x), f(w), True, True, True)
    assert dx.dtype == BF16 and dw.dtype == np.float32 and db.dtype == np.float32
    assert rel(gpu.to_numpy(dx), rdx) <= 1e-2
    assert rel(gpu.to_numpy(dw), rdw) <= 1e-4 and rel(gpu.to_numpy(db), rdb) <= 1e-4  # fp32 sums of n terms


def test_matmul_precision_rejects_unknown_modes(gpu):
    with pytest.raises(kiln.KilnError, match="allowed: fp32, tf32, bf16"):
        gpu.set_matmul_precision("fp8")


def test_gemm_runs_on_kilns_stream(gpu):
    import cupy

    from kiln.backend.cuda import device
    a = gpu.asarray(np.ones((8, 8), np.float32))
    gpu.matmul(a, a)
    assert cupy.cuda.get_current_stream().ptr == device.stream().ptr != 0
    assert math.isclose(float(gpu.to_numpy(gpu.matmul(a, a))[0, 0]), 8.0)
