"""Matrix products: batched matmul, and the linear layer y = x @ W^T + b with its backward."""

import numpy as np

from kiln.backend.cpu.compute import upcast


def _gemm(a, b, out_dtype):
    if a.dtype == out_dtype and b.dtype == out_dtype and out_dtype in (np.float32, np.float64):
        return a @ b
    return (upcast(a) @ upcast(b)).astype(out_dtype, copy=False)


def matmul(a, b):
    """a @ b with NumPy's batching and broadcasting rules."""
    return _gemm(a, b, a.dtype)


def linear_fwd(x, weight, bias):
    """y[N, out] = x[N, in] @ weight[out, in]^T (+ bias[out]), the bias added to the fp32 product and y
    rounded once to x's dtype, as a GEMM's bias epilogue does (cuBLASLt on the GPU, oneDNN under
    torch.autocast). Rounding the bf16 product and again after a bf16 bias add made kiln's bf16 training part
    from fp32 1.7-2.7x faster over the first 20 steps (benchmarks/results/fidelity/bf16_cause-2026-12-05.md)."""
    y = upcast(x) @ upcast(weight).T
    if bias is not None:
        y += upcast(bias)
    return y.astype(x.dtype, copy=False)


def linear_gelu_fwd(x, weight, bias):
    """(gelu(pre), pre) for pre = x @ weight^T + bias: the MLP's first layer, its pre-activation kept
    for the backward."""
    from kiln.backend.cpu.gelu import gelu_fwd
    pre = linear_fwd(x, weight, bias)
    return gelu_fwd(pre), pre


def linear_gelu_bwd(grad, pre, weight, need_db, param_grad_dtype=None):
    """(dpre, dbias) for y = gelu(pre) @ weight^T (+ b): dpre = (grad @ weight) * gelu'(pre), the product kept
    in fp32 and dpre rounded once to pre's dtype, as a GEMM's DGELU epilogue does; dbias = the column sums
    of dpre as stored (the bias gradient of the layer that made pre, as linear_bwd sums its grad), in
    param_grad_dtype (default pre's), None unless need_db."""
    from kiln.backend.cpu.gelu import gelu_bwd
    dtype = pre.dtype
    dpre = gelu_bwd(_gemm(grad, weight, np.float32 if dtype != np.float64 else dtype), upcast(pre))
    dpre = dpre.astype(dtype, copy=False)
    db = None
    if need_db:
        db = upcast(dpre).sum(axis=0).astype(dtype if param_grad_dtype is None else param_grad_dtype, copy=False)
    return dpre, db


def linear_bwd(grad, x, weight, need_dx, need_dw, need_db, param_grad_dtype=None):
    """(dx, dweight, dbias) for y = x @ weight^T + b; grad and x are 2-D. x is None when dweight is
    not needed, weight when dx is not (autograd saves only what the backward reads). dweight and
    dbias are in param_grad_dtype (default grad's): float32 for a bf16 copy of fp32 master weights."""
    dtype = grad.dtype  # = x's = weight's (linear checks that they match)
    pdtype = dtype if param_grad_dtype is None else np.dtype(param_grad_dtype)
    dx = _gemm(grad, weight, dtype) if need_dx else None
    dw = _gemm(grad.T, x, pdtype) if need_dw else None
    db = upcast(grad).sum(axis=0).astype(pdtype, copy=False) if need_db else None
    return dx, dw, db
