"""The fused LM head: mean cross-entropy of x @ weight^T against targets, the logits never whole.

A language model's last projection and its loss as one op: the [N, V] logits exist one chunk
of rows at a time, and their gradient goes straight into dx and dweight inside the forward
(the loss is a scalar, so the backward only scales them by its upstream gradient; a retained graph
scales copies, so that a second backward, AdamW's exact clip in kiln.optim.adamw, finds them again). For GPT-2
124M at B16 T1024 in bf16 that keeps 3.2 GB of logits and dlogits out of the step's peak.
"""

from __future__ import annotations

from kiln.autograd import Function, graph_retained, is_unit_grad
from kiln.errors import DTypeError, ShapeError
from kiln.ops.convert import grad_dtype


class LMHeadCrossEntropy(Function):
    fresh_grads = True  # backward returns the forward's own buffers, aliasing nothing else

    @staticmethod
    def forward(ctx, x, weight, targets, ignore_index, chunk_rows):
        need_dx, need_dw = ctx.needs_input_grad[:2]
        loss, dx, dw = x.backend.lm_head_xent_fwd(x.data, weight.data, targets.data, ignore_index, chunk_rows,
                                                  need_dx, need_dw)
        ctx.grads = (dx, dw)
        ctx.meta = (x.shape, grad_dtype(weight), x.backend)  # dweight stays fp32 for fp32 master weights
        return loss

    @staticmethod
    def backward(ctx, g):
        dx, dw = ctx.grads
        if graph_retained():
            dx, dw = (None if a is None else a.copy() for a in (dx, dw))
        x_shape, w_dtype, backend = ctx.meta
        dx, dw = backend.lm_head_xent_bwd(None if is_unit_grad(g) else g, dx, dw, w_dtype)
        return (None if dx is None else dx.reshape(x_shape)), dw, None

    def release(self) -> None:
        super().release()
        self.grads = None


def lm_head_cross_entropy(x, weight, targets, ignore_index: int = -100, chunk_rows: int | None = None):
    """cross_entropy(x @ weight^T, targets) for x [..., C], weight [V, C], targets [...], computed in
    chunks of chunk_rows rows (default: as many as fit the backend's chunk budget)."""
    if x.dtype is not weight.dtype or not x.dtype.is_floating:
        raise DTypeError(f"lm_head_cross_entropy: x and weight must share a floating dtype, got {x.dtype} "
                         f"and {weight.dtype}")
    if targets.dtype.is_floating or targets.dtype.name == "bool":
        raise DTypeError(f"lm_head_cross_entropy targets must be integer class indices, got {targets.dtype}")
    if weight.ndim != 2 or x.ndim < 1 or x.shape[-1] != weight.shape[1] or x.shape[:-1] != targets.shape:
        raise ShapeError(f"lm_head_cross_entropy: x {x.shape}, weight {weight.shape} and targets {targets.shape} "
                         "do not fit (expected [..., C], [V, C] and [...])")
    if chunk_rows is not None and (not isinstance(chunk_rows, int) or chunk_rows <= 0):
        raise ShapeError(f"lm_head_cross_entropy: chunk_rows must be a positive integer, got {chunk_rows!r}")
    c = x.shape[-1]
    return LMHeadCrossEntropy.apply(x.reshape(-1, c), weight, targets.reshape(-1), ignore_index, chunk_rows)
