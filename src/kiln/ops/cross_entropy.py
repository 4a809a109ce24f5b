"""Cross-entropy from logits, fused with the softmax, mean over non-ignored targets."""

from __future__ import annotations

from kiln.autograd import Function
from kiln.errors import DTypeError, ShapeError


class CrossEntropy(Function):
    @staticmethod
    def forward(ctx, logits, targets, ignore_index):
        loss, lse = logits.backend.cross_entropy_fwd(logits.data, targets.data, ignore_index)
        ctx.save_for_backward(logits)
        ctx.meta = (targets.data, lse, ignore_index, logits.backend)
        return loss  # float32 (float64 for float64 logits), whatever the logits dtype

    @staticmethod
    def backward(ctx, g):
        (logits,) = ctx.saved
        targets, lse, ignore_index, backend = ctx.meta
        return backend.cross_entropy_bwd(g, logits, targets, lse, ignore_index), None


def cross_entropy(logits, targets, ignore_index: int = -100):
    """mean over targets != ignore_index of -log softmax(logits)[target]; logits [..., V], targets [...]."""
    if targets.dtype.is_floating or targets.dtype.name == "bool":
        raise DTypeError(f"cross_entropy targets must be integer class indices, got {targets.dtype}")
    if logits.shape[:-1] != targets.shape:
        raise ShapeError(f"cross_entropy: logits {logits.shape} need targets of shape "
                         f"{logits.shape[:-1]}, got {targets.shape}")
    v = logits.shape[-1]
    return CrossEntropy.apply(logits.reshape(-1, v), targets.reshape(-1), ignore_index)
