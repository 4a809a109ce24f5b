"""Matrix products: batched `matmul` and the `linear` layer (y = x @ W^T + b)."""

from __future__ import annotations

from kiln.autograd import Function
from kiln.errors import DTypeError, ShapeError
from kiln.ops.convert import grad_dtype
from kiln.ops.elementwise import unbroadcast


def _swap(a):
    return a.swapaxes(-1, -2)


class MatMul(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a if ctx.needs_input_grad[1] else None,
                              b if ctx.needs_input_grad[0] else None)
        ctx.shapes = (a.shape, b.shape)
        ctx.backend = a.backend
        return a.backend.matmul(a.data, b.data)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved
        na, nb = ctx.needs_input_grad
        mm = ctx.backend.matmul
        return (unbroadcast(mm(g, _swap(b)), ctx.shapes[0]) if na else None,
                unbroadcast(mm(_swap(a), g), ctx.shapes[1]) if nb else None)


def _check_float_pair(op, a, b):
    if a.dtype is not b.dtype:
        raise DTypeError(f"{op}: dtype mismatch {a.dtype} and {b.dtype}; convert one with .to() first")
    if not a.dtype.is_floating:
        raise DTypeError(f"{op} needs floating-point tensors, got {a.dtype}")


def matmul(a, b):
    """a @ b with batching and broadcasting over leading axes; 1-D operands as in NumPy."""
    _check_float_pair("matmul", a, b)
    if a.ndim == 0 or b.ndim == 0:
        raise ShapeError("matmul needs tensors of at least one dimension; use * for scalars")
    squeeze_a, squeeze_b = a.ndim == 1, b.ndim == 1
    if squeeze_a:
        a = a.reshape(1, a.shape[0])
    if squeeze_b:
        b = b.reshape(b.shape[0], 1)
    if a.shape[-1] != b.shape[-2]:
        raise ShapeError(f"matmul: shapes {a.shape} and {b.shape} do not fit "
                         f"({a.shape[-1]} != {b.shape[-2]})")
    out = MatMul.apply(a, b)
    if squeeze_a:
        out = out.reshape(out.shape[:-2] + out.shape[-1:])
    if squeeze_b:
        out = out.reshape(out.shape[:-1])
    return out


class Linear(Function):
    fresh_grads = True  # backward returns new arrays (AccumulateGrad keeps them uncopied)

    @staticmethod
    def forward(ctx, x, weight, bias=None):
        ctx.has_bias = bias is not None
        ctx.backend = x.backend
        ctx.x_shape = x.shape
        ctx.param_grad_dtype = grad_dtype(weight)
        nx, nw = ctx.needs_input_grad[:2]
        ctx.save_for_backward(x if nw else None, weight if nx else None)
        x2 = x.data.reshape(-1, x.shape[-1])
        y = x.backend.linear_fwd(x2, weight.data, None if bias is None else bias.data)
        return y.reshape(x.shape[:-1] + (weight.shape[0],))

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved
        need = ctx.needs_input_grad
        g2 = g.reshape(-1, g.shape[-1])
        x2 = None if x is None else x.reshape(-1, x.shape[-1])
        dx, dw, db = ctx.backend.linear_bwd(g2, x2, w, need[0], need[1],
                                            ctx.has_bias and need[2], ctx.param_grad_dtype)
        if dx is not None:
            dx = dx.reshape(ctx.x_shape)
        return (dx, dw, db) if ctx.has_bias else (dx, dw)


class LinearGELU(Function):
    fresh_grads = True  # backward returns new arrays (AccumulateGrad keeps them uncopied)

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.backend = x.backend
        ctx.x_shape = x.shape
        ctx.param_grad_dtype = grad_dtype(weight)
        nx, nw = ctx.needs_input_grad[:2]
        ctx.save_for_backward(x if nw else None, weight if nx else None)
        x2 = x.data.reshape(-1, x.shape[-1])
        h, pre = x.backend.linear_gelu_fwd(x2, weight.data, bias.data)
        ctx.pre = pre  # an intermediate, not an input: nothing can modify it in place
        return h.reshape(x.shape[:-1] + (weight.shape[0],))

    def release(self) -> None:
        super().release()
        self.pre = None

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved
        need = ctx.needs_input_grad
        g2 = g.reshape(-1, g.shape[-1])
        if need[2]:  # the bias gradient (column sums of dpre) made in the GELU backward's pass, not its own
            dpre, db = ctx.backend.gelu_bwd_bias(g2, ctx.pre, ctx.param_grad_dtype)
        else:
            dpre, db = ctx.backend.gelu_bwd(g2, ctx.pre), None
        x2 = None if x is None else x.reshape(-1, x.shape[-1])
        dx, dw, _ = ctx.backend.linear_bwd(dpre, x2, w, need[0], need[1], False, ctx.param_grad_dtype)
        if dx is not None:
            dx = dx.reshape(ctx.x_shape)
        return dx, dw, db


class GELULinear(Function):
    """gelu(pre) @ weight^T + bias keeping pre, not gelu(pre): the backward makes gelu(pre) again (one
    elementwise pass) for dweight, so an MLP keeps its pre-activation once instead of it and its GELU."""

    fresh_grads = True  # backward returns new arrays (AccumulateGrad keeps them uncopied)

    @staticmethod
    def forward(ctx, pre, weight, bias=None):
        ctx.has_bias = bias is not None
        ctx.backend = pre.backend
        ctx.param_grad_dtype = grad_dtype(weight)
        ctx.save_for_backward(pre, weight)
        h = pre.backend.gelu_fwd(pre.data.reshape(-1, pre.shape[-1]))
        y = pre.backend.linear_fwd(h, weight.data, None if bias is None else bias.data)
        return y.reshape(pre.shape[:-1] + (weight.shape[0],))

    @staticmethod
    def backward(ctx, g):
        pre, w = ctx.saved
        need = ctx.needs_input_grad
        pre2, g2 = pre.reshape(-1, pre.shape[-1]), g.reshape(-1, g.shape[-1])
        dpre = None
        if need[0]:  # the GELU's backward in the GEMM that makes its output's gradient (linear_gelu_bwd)
            dpre = ctx.backend.linear_gelu_bwd(g2, pre2, w, False)[0].reshape(pre.shape)
        h = ctx.backend.gelu_fwd(pre2) if need[1] else None
        _, dw, db = ctx.backend.linear_bwd(g2, h, None, False, need[1], ctx.has_bias and need[2],
                                           ctx.param_grad_dtype)
        return (dpre, dw, db) if ctx.has_bias else (dpre, dw)


class LinearGELULinear(Function):
    """gelu(x @ fc_weight^T + fc_bias) @ proj_weight^T + proj_bias, a GPT MLP, in one op: its backward makes
    the GELU's input gradient in the GEMM that makes the GELU output's gradient (linear_gelu_bwd: cuBLASLt's
    DGELU epilogue in bf16), so no [N, hidden] gradient is written and read again between the two layers.
    Keeps what LinearGELU then Linear keep: x, the pre-activation and the GELU."""

    fresh_grads = True  # backward returns new arrays (AccumulateGrad keeps them uncopied)

    @staticmethod
    def forward(ctx, x, fc_weight, fc_bias, proj_weight, proj_bias=None):
        ctx.has_bias = proj_bias is not None
        ctx.backend = x.backend
        ctx.x_shape = x.shape
        ctx.fc_grad_dtype, ctx.proj_grad_dtype = grad_dtype(fc_weight), grad_dtype(proj_weight)
        nx, nfc = ctx.needs_input_grad[:2]
        ctx.save_for_backward(x if nfc else None, fc_weight if nx else None, proj_weight)
        x2 = x.data.reshape(-1, x.shape[-1])
        h, pre = x.backend.linear_gelu_fwd(x2, fc_weight.data, fc_bias.data)
        y = x.backend.linear_fwd(h, proj_weight.data, None if proj_bias is None else proj_bias.data)
        ctx.pre = pre  # intermediates, not inputs: nothing can modify them in place
        ctx.h = h if ctx.needs_input_grad[3] else None
        return y.reshape(x.shape[:-1] + (proj_weight.shape[0],))

    def release(self) -> None:
        super().release()
        self.pre = self.h = None

    @staticmethod
    def backward(ctx, g):
        x, w_fc, w_proj = ctx.saved
        need = ctx.needs_input_grad + (False,)
        g2 = g.reshape(-1, g.shape[-1])
        _, dw_proj, db_proj = ctx.backend.linear_bwd(g2, ctx.h, None, False, need[3], ctx.has_bias and need[4],
                                                     ctx.proj_grad_dtype)
        dx = dw_fc = db_fc = None
        if need[0] or need[1] or need[2]:
            dpre, db_fc = ctx.backend.linear_gelu_bwd(g2, ctx.pre, w_proj, need[2], ctx.fc_grad_dtype)
            x2 = None if x is None else x.reshape(-1, x.shape[-1])
            dx, dw_fc, _ = ctx.backend.linear_bwd(dpre, x2, w_fc, need[0], need[1], False, ctx.fc_grad_dtype)
            if dx is not None:
                dx = dx.reshape(ctx.x_shape)
        return (dx, dw_fc, db_fc, dw_proj, db_proj) if ctx.has_bias else (dx, dw_fc, db_fc, dw_proj)


class NormLinear(Function):
    """x @ weight^T + bias for x = layer_norm(s, norm weight, norm bias) keeping s, not x: the backward makes
    x again from s (one row pass of the LayerNorm forward, whose kernel made x: the same bits) for dweight.
    A pre-norm block keeps s anyway (the residual stream, for the LayerNorm's backward), so x costs nothing.
    s may be wider than x (an fp32 residual under bf16 activations): x is made in x's dtype, rounded from
    the fp32 LayerNorm exactly as the forward's LayerNorm rounded it."""

    fresh_grads = True  # backward returns new arrays (AccumulateGrad keeps them uncopied)

    @staticmethod
    def forward(ctx, x, weight, bias, norm):
        s, norm_weight, norm_bias, eps = norm
        ctx.has_bias = bias is not None
        ctx.backend = x.backend
        ctx.x_shape = x.shape
        ctx.param_grad_dtype = grad_dtype(weight)
        ctx.eps, ctx.x_dtype = eps, x.dtype.np
        nx, nw = ctx.needs_input_grad[:2]
        ctx.save_for_backward(weight if nx else None, *((s, norm_weight, norm_bias) if nw else (None, None, None)))
        y = x.backend.linear_fwd(x.data.reshape(-1, x.shape[-1]), weight.data, None if bias is None else bias.data)
        return y.reshape(x.shape[:-1] + (weight.shape[0],))

    @staticmethod
    def backward(ctx, g):
        w, s, norm_weight, norm_bias = ctx.saved
        need = ctx.needs_input_grad
        x2 = None
        if s is not None:
            x2 = ctx.backend.layer_norm_fwd(s.reshape(-1, s.shape[-1]), norm_weight, norm_bias, ctx.eps,
                                            ctx.x_dtype)[0]
        dx, dw, db = ctx.backend.linear_bwd(g.reshape(-1, g.shape[-1]), x2, w, need[0], need[1],
                                            ctx.has_bias and need[2], ctx.param_grad_dtype)
        if dx is not None:
            dx = dx.reshape(ctx.x_shape)
        return (dx, dw, db) if ctx.has_bias else (dx, dw)


def norm_linear(x, weight, bias, s, norm_weight, norm_bias=None, eps: float = 1e-5):
    """linear(x, weight, bias) for x = layer_norm(s, norm_weight, norm_bias, eps) (the caller's: it is not
    checked), keeping s for the backward instead of x (a pre-norm block's c_attn and c_fc when activations
    are short: 2 of a block's 16 saved [B, T, C] arrays fewer). s is of x's dtype or wider (an fp32 residual
    whose LayerNorm was rounded to bf16 x), the norm's weights of s's."""
    _check_float_pair("norm_linear", x, weight)
    if weight.ndim != 2 or x.ndim < 1 or x.shape[-1] != weight.shape[1] or s.shape != x.shape or \
            (bias is not None and bias.shape != (weight.shape[0],)) or norm_weight.shape != (x.shape[-1],):
        raise ShapeError(f"norm_linear: input {x.shape}, weight {weight.shape}, bias "
                         f"{None if bias is None else bias.shape}, normed {s.shape} and norm weight {norm_weight.shape} "
                         "do not fit (expected [..., in], [out, in], [out], [..., in], [in])")
    return NormLinear.apply(x, weight, bias, (s, norm_weight, norm_bias, eps))


def gelu_linear(pre, weight, bias=None):
    """linear(gelu(pre), weight, bias) in one op that keeps pre for the backward, not gelu(pre) (a GPT
    MLP's second layer when activations are short: 4 of a block's 16 saved [B, T, C] arrays fewer)."""
    _check_float_pair("gelu_linear", pre, weight)
    if weight.ndim != 2 or pre.ndim < 1 or pre.shape[-1] != weight.shape[1] or \
            (bias is not None and bias.shape != (weight.shape[0],)):
        raise ShapeError(f"gelu_linear: input {pre.shape}, weight {weight.shape} and bias "
                         f"{None if bias is None else bias.shape} do not fit (expected [..., in], [out, in], [out])")
    if bias is None:
        return GELULinear.apply(pre, weight)
    _check_float_pair("gelu_linear", pre, bias)
    return GELULinear.apply(pre, weight, bias)


def linear_gelu(x, weight, bias):
    """gelu(x @ weight^T + bias) in one op: a GPT MLP's first layer. On the GPU in bf16 the GELU rides
    in the GEMM's epilogue; the pre-activation is kept for the backward either way."""
    _check_float_pair("linear_gelu", x, weight)
    _check_float_pair("linear_gelu", x, bias)
    if weight.ndim != 2 or x.ndim < 1 or x.shape[-1] != weight.shape[1] or bias.shape != (weight.shape[0],):
        raise ShapeError(f"linear_gelu: input {x.shape}, weight {weight.shape} and bias {bias.shape} do not fit "
                         "(expected [..., in], [out, in] and [out])")
    return LinearGELU.apply(x, weight, bias)


def linear_gelu_linear(x, fc_weight, fc_bias, proj_weight, proj_bias=None):
    """linear(gelu(linear(x, fc_weight, fc_bias)), proj_weight, proj_bias) in one op (a GPT MLP): on the GPU
    in bf16 the GELU rides in the first GEMM's epilogue and its backward in the epilogue of the GEMM that makes
    its gradient (LinearGELULinear)."""
    for a in (fc_weight, fc_bias, proj_weight) + (() if proj_bias is None else (proj_bias,)):
        _check_float_pair("linear_gelu_linear", x, a)
    hidden = fc_weight.shape[0] if fc_weight.ndim == 2 else None
    if fc_weight.ndim != 2 or proj_weight.ndim != 2 or x.ndim < 1 or x.shape[-1] != fc_weight.shape[1] or \
            fc_bias.shape != (hidden,) or proj_weight.shape[1] != hidden or \
            (proj_bias is not None and proj_bias.shape != (proj_weight.shape[0],)):
        raise ShapeError(f"linear_gelu_linear: input {x.shape}, fc weight {fc_weight.shape} and bias {fc_bias.shape}, "
                         f"proj weight {proj_weight.shape} and bias {None if proj_bias is None else proj_bias.shape} "
                         "do not fit (expected [..., in], [hidden, in], [hidden], [out, hidden], [out])")
    if proj_bias is None:
        return LinearGELULinear.apply(x, fc_weight, fc_bias, proj_weight)
    return LinearGELULinear.apply(x, fc_weight, fc_bias, proj_weight, proj_bias)


def linear(x, weight, bias=None):
    """x[..., in] @ weight[out, in]^T + bias[out], the layout of torch.nn.Linear."""
    _check_float_pair("linear", x, weight)
    if weight.ndim != 2 or x.ndim < 1 or x.shape[-1] != weight.shape[1]:
        raise ShapeError(f"linear: input of shape {x.shape} does not fit a weight of shape "
                         f"{weight.shape} (expected input [..., {weight.shape[-1] if weight.ndim else '?'}])")
    if bias is not None:
        _check_float_pair("linear", x, bias)
        if bias.shape != (weight.shape[0],):
            raise ShapeError(f"linear: bias of shape {bias.shape} for a weight of shape {weight.shape}")
        return Linear.apply(x, weight, bias)
    return Linear.apply(x, weight)
