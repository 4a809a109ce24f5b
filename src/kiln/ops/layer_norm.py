"""Layer normalisation over the last axis, with affine weight and bias; and the residual add
fused with the LayerNorm that follows it (add_layer_norm).

Mixed precision as autocast's: the residual stream may be wider than the sublayers' activations (an
fp32 residual under bf16 GEMMs). The normalised output then comes in the narrower dtype (out_dtype;
for add_layer_norm the branch's), the sum and the gradients of the residual stay in its dtype."""

from __future__ import annotations

from kiln.autograd import Fresh, Function
from kiln.errors import DTypeError, ShapeError
from kiln.ops.convert import grad_dtype


class LayerNorm(Function):
    fresh_grads = True  # backward returns new arrays (AccumulateGrad keeps them uncopied)

    @staticmethod
    def forward(ctx, x, weight, bias, eps, out_dtype):
        c = x.shape[-1]
        x2 = x.data.reshape(-1, c)
        y, mean, rstd = x.backend.layer_norm_fwd(x2, weight.data, None if bias is None else bias.data, eps,
                                                 out_dtype.np)
        ctx.save_for_backward(x, weight)
        ctx.meta = (mean, rstd, x.backend, bias is not None, grad_dtype(weight))
        return y.reshape(x.shape)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved
        mean, rstd, backend, has_bias, param_grad_dtype = ctx.meta
        c = x.shape[-1]
        need = ctx.needs_input_grad
        dx, dw, db = backend.layer_norm_bwd(g.reshape(-1, c), x.reshape(-1, c), w, mean, rstd,
                                            need[1], has_bias and need[2], param_grad_dtype)
        dx = dx.reshape(x.shape) if need[0] else None
        return (dx, dw, db) if has_bias else (dx, dw)


class AddLayerNorm(Function):
    """(s, h) = (x + y, layer_norm(x + y)): one kernel forward, one (plus the dweight/dbias finish)
    backward. The gradient of s and the LayerNorm's input gradient are added inside the backward
    kernel, and the result is the gradient of x and of y alike (one array for both: not fresh).
    A y narrower than x (a bf16 branch on an fp32 residual) gets that gradient rounded to its dtype (by
    the backward kernel, in the pass that stores dx), and h comes in y's dtype: autocast's add of a bf16
    output to an fp32 residual, then its fp32 LayerNorm rounded for the next GEMM."""

    materialize_grads = False  # an unused s (the last block's) or h comes as None, not as zeros
    fresh_grads = (False, False, True, True)  # dx serves x and y; dweight and dbias are the finish's new arrays

    @staticmethod
    def forward(ctx, x, y, weight, bias, eps):
        c = x.shape[-1]
        s, h, mean, rstd = x.backend.add_layer_norm_fwd(x.data.reshape(-1, c), y.data.reshape(-1, c), weight.data,
                                                        None if bias is None else bias.data, eps, y.dtype.np)
        s = s.reshape(x.shape)
        ctx.save_for_backward(Fresh(s), weight)  # s is an output: it shares the output's version
        ctx.meta = (mean, rstd, x.backend, bias is not None, grad_dtype(weight), y.dtype.np)
        return s, h.reshape(x.shape)

    @staticmethod
    def backward(ctx, ds, dh):
        s, w = ctx.saved
        mean, rstd, backend, has_bias, param_grad_dtype, branch_dtype = ctx.meta
        need = ctx.needs_input_grad
        if dh is None:  # only the sum was used: its gradient passes to x and y as it is
            dx, dw, db = ds, None, None
            dy = dx if dx is None or dx.dtype == branch_dtype else dx.astype(branch_dtype)
        else:  # a narrower y's gradient comes out of the backward kernel with dx, not from a cast after it
            c = s.shape[-1]
            dx, dy, dw, db = backend.add_layer_norm_bwd(None if ds is None else ds.reshape(-1, c),
                                                        dh.reshape(-1, c), s.reshape(-1, c), w, mean, rstd, need[2],
                                                        has_bias and need[3], param_grad_dtype,
                                                        branch_dtype if need[1] else None)
            dx, dy = dx.reshape(s.shape), dy.reshape(s.shape)
        grads = (dx if need[0] else None, dy if need[1] else None, dw)
        return grads + (db,) if has_bias else grads


def _check_affine(op, x, weight, bias):
    c = x.shape[-1] if x.ndim else 0
    if weight.shape != (c,) or (bias is not None and bias.shape != (c,)):
        raise ShapeError(f"{op} over the last axis of {x.shape} needs weight and bias of shape "
                         f"({c},), got {weight.shape} and {None if bias is None else bias.shape}")


def layer_norm(x, weight, bias=None, eps: float = 1e-5, out_dtype=None):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last axis (biased variance), computed in
    fp32 (fp64 for fp64 x) and stored in out_dtype (default x's): bf16 out of an fp32 residual."""
    _check_affine("layer_norm", x, weight, bias)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    _check_narrower("layer_norm", x.dtype, out_dtype)
    if bias is None:
        return LayerNorm.apply(x, weight, None, eps, out_dtype)
    return LayerNorm.apply(x, weight, bias, eps, out_dtype)


# a residual stream's dtype -> the narrower activation dtypes it may carry (autocast's bf16 over fp32)
_NARROWER = {"float32": ("bfloat16", "float16")}


def _check_narrower(op, wide, narrow) -> None:
    if narrow is not wide and narrow.name not in _NARROWER.get(wide.name, ()):
        raise DTypeError(f"{op}: a {wide.name} residual with {narrow.name} activations; allowed: the same dtype, or "
                         + ", ".join(f"{w} with {' or '.join(n)}" for w, n in _NARROWER.items()))


def add_layer_norm(x, y, weight, bias=None, eps: float = 1e-5):
    """(s, h) with s = x + y and h = layer_norm(s, weight, bias, eps), in one op.

    A pre-norm transformer's residual add and the LayerNorm after it: s is the new residual
    stream, h the next sublayer's input. x and y have one shape and one dtype (no broadcasting).
    s is rounded to the dtype before it is normalised, exactly as `layer_norm(x + y)` does.
    y may be narrower than x (a bf16 branch on an fp32 residual): s is in x's dtype, h in y's."""
    if x.shape != y.shape:
        raise ShapeError(f"add_layer_norm adds tensors of one shape, got {x.shape} and {y.shape}")
    _check_narrower("add_layer_norm", x.dtype, y.dtype)
    _check_affine("add_layer_norm", x, weight, bias)
    if bias is None:
        return AddLayerNorm.apply(x, y, weight, None, eps)
    return AddLayerNorm.apply(x, y, weight, bias, eps)
