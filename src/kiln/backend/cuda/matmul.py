"""Matrix products through cuBLASLt: batched matmul, linear forward (bias epilogue) and backward.

Operands are passed as they lie in memory: a row-major matrix, or the transpose of one (a
`swapaxes` view), becomes a transpose flag and a leading dimension, never a copy. Layouts a
GEMM cannot express (a column stride other than 1 on both axes, batch dims that do not
collapse to one stride, partial broadcasting) are made contiguous first.
"""

from __future__ import annotations

import math

import numpy as np

from kiln.backend.cpu import matmul as cpu
from kiln.backend.cuda import cublaslt, device as rt
from kiln.backend.cuda.compiler import FLOAT_CTYPES, register_family
from kiln.backend.cuda.launch import (
    COLUMN_PART_THREADS,
    aligned16,
    column_parts,
    column_sum_finish,
    column_sum_finish_kernels,
    contiguous,
    cpu_fallback,
    ctype,
    get_kernel,
    i32,
)

# The GEMMs are cuBLASLt's; matmul.cu holds the bias gradient's column sums.
register_family("matmul.cu", [f"column_sum_part<{t}, {v}>" for t in FLOAT_CTYPES for v in ("true", "false")]
                + column_sum_finish_kernels(FLOAT_CTYPES))


def _gemm_dtype(*arrays) -> bool:
    return all(np.dtype(a.dtype).name in cublaslt.DTYPES for a in arrays) and \
        len({np.dtype(a.dtype) for a in arrays}) == 1


def as_matrix(x):
    """(array, transposed, ld) for the last two axes of x: x is row-major with row stride ld, or
    (transposed) the transpose of a row-major array with row stride ld; copies when neither."""
    r, c = x.shape[-2], x.shape[-1]
    item = x.dtype.itemsize
    sr, sc = x.strides[-2], x.strides[-1]
    if sr % item == 0 and sc % item == 0 and sr >= 0 and sc >= 0:
        er, ec = sr // item, sc // item
        if (ec == 1 or c == 1) and (er >= max(c, 1) or r == 1):
            return x, False, max(er if r > 1 else c, 1)
        if (er == 1 or r == 1) and (ec >= max(r, 1) or c == 1):
            return x, True, max(ec if c > 1 else r, 1)
    x = rt.cupy().ascontiguousarray(x)
    return x, False, max(c, 1)


def _batch_stride(x, batch: tuple):
    """(array, stride in elements) so that matrix i of the flattened batch starts at i * stride."""
    cp = rt.cupy()
    xb = tuple(x.shape[:-2])
    if math.prod(xb) == 1:
        return x, 0  # one matrix for every batch entry (broadcast): stride 0
    if (1,) * (len(batch) - len(xb)) + xb != batch:  # partially broadcast: materialise
        x = cp.ascontiguousarray(cp.broadcast_to(x, batch + tuple(x.shape[-2:])))
    item = x.dtype.itemsize
    dims = [(s, st) for s, st in zip(x.shape[:-2], x.strides[:-2]) if s != 1]
    ok = all(st % item == 0 and st >= 0 for _, st in dims)
    for (_, st0), (s1, st1) in zip(dims, dims[1:]):
        ok = ok and st0 == st1 * s1
    if not ok:
        x = cp.ascontiguousarray(x)
        dims = [(s, st) for s, st in zip(x.shape[:-2], x.strides[:-2]) if s != 1]
    return x, (dims[-1][1] // item if dims else 0)


def _operand(x, batch: tuple):
    """(array, transposed, ld, batch stride) of one batched GEMM operand."""
    x, stride = _batch_stride(x, batch)
    y, trans, ld = as_matrix(x)
    if y is not x:  # copied to row-major: matrices now lie r * c apart (or stay broadcast)
        stride = 0 if math.prod(y.shape[:-2]) == 1 else y.shape[-2] * y.shape[-1]
    return y, trans, ld, stride


def matmul(a, b):
    """a @ b with NumPy's batching and broadcasting rules, fp32 accumulation, out in a's dtype."""
    cp = rt.cupy()
    if not _gemm_dtype(a, b) or a.ndim == 0 or b.ndim == 0:
        if a.dtype == np.float64 and b.dtype == np.float64:
            return cp.matmul(a, b)
        return cpu_fallback(cpu.matmul, a, b)
    squeeze_a, squeeze_b = a.ndim == 1, b.ndim == 1
    if squeeze_a:
        a = a.reshape(1, -1)
    if squeeze_b:
        b = b.reshape(-1, 1)
    m, k = a.shape[-2:]
    n = b.shape[-1]
    batch = tuple(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    if b.ndim == 2 and a.ndim > 2:  # fold a's batch into its rows: one GEMM
        out = matmul(a.reshape(-1, k), b).reshape(batch + (m, n))
    else:
        out = cp.empty(batch + (m, n), dtype=a.dtype)
        nb = math.prod(batch)
        if out.size and k == 0:
            out[...] = 0
        elif out.size:
            a, ta, lda, sa = _operand(a, batch)
            b, tb, ldb, sb = _operand(b, batch)
            cublaslt.gemm(a, b, out, m=m, n=n, k=k, trans_a=ta, trans_b=tb, lda=lda, ldb=ldb, ldc=n,
                          batch=nb, stride_a=sa, stride_b=sb, stride_c=m * n)
    if squeeze_a:
        out = out.reshape(out.shape[:-2] + out.shape[-1:])
    if squeeze_b:
        out = out.reshape(out.shape[:-1])
    return out


def linear_fwd(x, weight, bias):
    """y[N, out] = x[N, in] @ weight[out, in]^T (+ bias[out]), the bias in cuBLASLt's epilogue."""
    cp = rt.cupy()
    if not _gemm_dtype(x, weight) or (bias is not None and bias.dtype != x.dtype):
        return cpu_fallback(cpu.linear_fwd, x, weight, bias) if x.dtype != np.float64 else \
            _linear_fwd_f64(x, weight, bias)
    n_rows, k = x.shape
    n_out = weight.shape[0]
    y = cp.empty((n_rows, n_out), dtype=x.dtype)
    if y.size == 0:
        return y
    if k == 0:
        y[...] = 0 if bias is None else bias
        return y
    xa, tx, ldx = as_matrix(x)
    wa, tw, ldw = as_matrix(weight)
    if bias is None:
        cublaslt.gemm(xa, wa, y, m=n_rows, n=n_out, k=k, trans_a=tx, trans_b=not tw, lda=ldx, ldb=ldw)
    else:
        cublaslt.gemm(xa, wa, y, m=n_rows, n=n_out, k=k, trans_a=tx, trans_b=not tw, lda=ldx, ldb=ldw,
                      bias=cp.ascontiguousarray(bias), epilogue="bias")
    return y


_no_gelu_epilogue: set = set()  # (dtype, m, n, k) where cuBLASLt offered no GELU_AUX_BIAS algorithm


def linear_gelu_fwd(x, weight, bias):
    """(gelu(pre), pre) for pre = x @ weight^T + bias. In bf16/fp16 one GEMM writes both (cuBLASLt's
    GELU_AUX_BIAS epilogue: no GELU pass over the [N, 4C] activations); fp32 keeps kiln's exact GELU
    kernel (cuBLASLt's GELU is a ~1e-3 approximation) after the GEMM."""
    from kiln.backend.cuda.gelu import gelu_fwd
    cp = rt.cupy()
    n_rows, k = x.shape
    n_out = weight.shape[0]
    key = (np.dtype(x.dtype).name, n_rows, n_out, k)
    if bias is None or np.dtype(x.dtype).name not in ("bfloat16", "float16") or not _gemm_dtype(x, weight, bias) \
            or n_rows == 0 or k == 0 or key in _no_gelu_epilogue:
        pre = linear_fwd(x, weight, bias)
        return gelu_fwd(pre), pre
    h = cp.empty((n_rows, n_out), dtype=x.dtype)
    pre = cp.empty((n_rows, n_out), dtype=x.dtype)
    xa, tx, ldx = as_matrix(x)
    wa, tw, ldw = as_matrix(weight)
    try:
        cublaslt.gemm(xa, wa, h, m=n_rows, n=n_out, k=k, trans_a=tx, trans_b=not tw, lda=ldx, ldb=ldw,
                      bias=cp.ascontiguousarray(bias), epilogue="gelu_aux_bias", aux=pre, aux_ld=n_out)
    except cublaslt.CublasError:
        _no_gelu_epilogue.add(key)
        pre = linear_fwd(x, weight, bias)
        return gelu_fwd(pre), pre
    return h, pre


_no_dgelu_epilogue: set = set()  # (dtype, m, n, k) where cuBLASLt offered no DGELU algorithm


def linear_gelu_bwd(grad, pre, weight, need_db, param_grad_dtype=None):
    """(dpre, dbias) for y = gelu(pre) @ weight^T (+ b): dpre = (grad @ weight) * gelu'(pre), dbias = dpre's
    column sums (None unless need_db: the bias gradient of the layer that made pre, _bias_grad) in
    param_grad_dtype (default pre's). In bf16/fp16 the GELU's backward rides in the GEMM (cuBLASLt's DGELU
    epilogue, its GELU derivative the ~1e-3 approximation its forward's GELU_AUX_BIAS is): no [N, in]
    gradient of the GELU's output is written and read again. fp32 keeps kiln's exact GELU kernels after the
    GEMM. (DGELU_BGRAD, dbias in the same GEMM, found no algorithm for an fp32 bias gradient under bf16
    operands on the H100: its heuristic answered INVALID_VALUE, device-check-2026-12-07-h100-s15.)"""
    cp = rt.cupy()
    n_rows, n_out = grad.shape
    n_in = weight.shape[1]
    pdtype = np.dtype(pre.dtype if param_grad_dtype is None else param_grad_dtype)
    key = (np.dtype(pre.dtype).name, n_rows, n_in, n_out)
    if np.dtype(pre.dtype).name not in ("bfloat16", "float16") or not _gemm_dtype(grad, weight, pre) \
            or pre.shape != (n_rows, n_in) or pdtype.name not in ("float32", np.dtype(pre.dtype).name) \
            or n_rows == 0 or n_out == 0 or n_in == 0 or key in _no_dgelu_epilogue:
        return _linear_gelu_bwd_unfused(grad, pre, weight, need_db, pdtype)
    ga, tg, ldg = as_matrix(grad)
    wa, tw, ldw = as_matrix(weight)
    pre = contiguous(pre)
    dpre = cp.empty((n_rows, n_in), dtype=pre.dtype)
    try:
        cublaslt.gemm(ga, wa, dpre, m=n_rows, n=n_in, k=n_out, trans_a=tg, trans_b=tw, lda=ldg, ldb=ldw,
                      epilogue="dgelu", aux=pre, aux_ld=n_in)
    except cublaslt.CublasError:
        _no_dgelu_epilogue.add(key)
        return _linear_gelu_bwd_unfused(grad, pre, weight, need_db, pdtype)
    db = None
    if need_db:
        db = cp.empty((n_in,), dtype=pdtype)
        _bias_grad(dpre, db)
    return dpre, db


def _linear_gelu_bwd_unfused(grad, pre, weight, need_db, pdtype):
    """linear_gelu_bwd as the GEMM, then kiln's GELU backward (with the column sums in its pass)."""
    from kiln.backend.cuda.gelu import gelu_bwd, gelu_bwd_bias
    if not _gemm_dtype(grad, weight, pre) or not (pdtype == pre.dtype or (
            pdtype == np.float32 and np.dtype(pre.dtype).name in ("bfloat16", "float16"))):
        return cpu_fallback(cpu.linear_gelu_bwd, grad, pre, weight, need_db, pdtype)
    dh = linear_bwd(grad, None, weight, True, False, False)[0]
    return gelu_bwd_bias(dh, pre, pdtype) if need_db else (gelu_bwd(dh, pre), None)


def _linear_fwd_f64(x, weight, bias):
    y = x @ weight.T
    if bias is not None:
        y += bias.astype(y.dtype, copy=False)
    return y


def linear_bwd(grad, x, weight, need_dx, need_dw, need_db, param_grad_dtype=None):
    """(dx, dweight, dbias) for y = x @ weight^T + b; dbias is kiln's column sum of grad (_bias_grad).

    param_grad_dtype: dweight's and dbias's dtype (default grad's); float32 with bf16/fp16 operands
    (the bf16 copy of fp32 master weights) has the GEMM write its fp32 accumulator as it is, so no
    cast pass follows, and the gradient is not rounded to bf16 on its way to the fp32 weight."""
    cp = rt.cupy()
    pdtype = np.dtype(grad.dtype if param_grad_dtype is None else param_grad_dtype)
    if not _gemm_dtype(*(a for a in (grad, weight, x) if a is not None)) or not (
            pdtype == grad.dtype or (pdtype == np.float32 and np.dtype(grad.dtype).name in ("bfloat16", "float16"))):
        if grad.dtype == np.float64:
            dx = grad @ weight if need_dx else None
            dw = (grad.T @ x).astype(pdtype, copy=False) if need_dw else None
            db = grad.sum(axis=0).astype(pdtype, copy=False) if need_db else None
            return dx, dw, db
        return cpu_fallback(cpu.linear_bwd, grad, x, weight, need_dx, need_dw, need_db, pdtype)
    n_rows, n_out = grad.shape
    n_in = weight.shape[1] if weight is not None else x.shape[1]
    ga, tg, ldg = as_matrix(grad)
    dx = dw = db = None
    if need_dx:
        dx = cp.empty((n_rows, n_in), dtype=grad.dtype)
        if dx.size and n_out == 0:
            dx[...] = 0
        elif dx.size:
            wa, tw, ldw = as_matrix(weight)
            cublaslt.gemm(ga, wa, dx, m=n_rows, n=n_in, k=n_out, trans_a=tg, trans_b=tw, lda=ldg, ldb=ldw)
    if need_db:
        db = cp.empty((n_out,), dtype=pdtype)
    if need_dw:
        dw = cp.empty((n_out, n_in), dtype=pdtype)
        if dw.size and n_rows == 0:
            dw[...] = 0
            if db is not None:
                db[...] = 0
            return dx, dw, db
        if dw.size:
            xa, tx, ldx = as_matrix(x)
            # dW[out, in] = grad^T @ x: our A is grad^T, so its transpose flag flips.
            args = dict(m=n_out, n=n_in, k=n_rows, trans_a=not tg, trans_b=tx, lda=ldg, ldb=ldx)
            cublaslt.gemm(ga, xa, dw, **args)
    if db is not None and db.size:
        _bias_grad(grad, db)
    return dx, dw, db


def _bias_grad(grad, db) -> None:
    """db[c] = the sum over rows of grad[:, c] (db may be fp32 over bf16 grad): one read of grad, per-part
    fp32 sums and a fixed-order finish (matmul.cu). cuBLASLt's BGRADB epilogue, used until 2026-12-04,
    ran as a kernel of its own too (globalKernelBgradAB, ~2.2 TB/s in the GPT-2 profile), and offers no
    algorithm for some dtype pairs."""
    t = ctype(grad.dtype)
    if t is None or ctype(db.dtype) is None:
        db[...] = grad.astype(np.float64).sum(axis=0).astype(db.dtype)
        return
    grad = contiguous(grad)
    rows, c = grad.shape
    pack = 16 // grad.dtype.itemsize
    vec = c % pack == 0 and aligned16(grad)
    grid, per_part, parts = column_parts(rows, c, pack if vec else 1)
    partial = rt.cupy().empty((parts, c), dtype=np.float32)
    get_kernel("matmul.cu", f"column_sum_part<{t}, {'true' if vec else 'false'}>")(
        grid, (COLUMN_PART_THREADS,), (grad, partial, i32(rows), i32(c), i32(per_part)))
    column_sum_finish("matmul.cu", partial, parts, c, (db,))
