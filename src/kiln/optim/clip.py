"""Global gradient-norm clipping, computed and applied on the device (no host sync)."""

from __future__ import annotations

from kiln.autograd import no_grad
from kiln.errors import KilnError
from kiln.tensor import Tensor


@no_grad()
def clip_grad_norm_(params, max_norm: float) -> Tensor:
    """Scale all gradients in place by min(1, max_norm / (norm + 1e-6)), as torch does; returns the norm.

    A training loop with kiln's AdamW should call `optimizer.clip_grad_norm_(max_norm)` instead:
    the same clip, fused into the optimizer's step (no pass over the gradients of its own).
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        raise KilnError("clip_grad_norm_ found no gradients; call backward() first")
    backend = grads[0].backend
    norm = backend.grad_norm([g.data for g in grads])
    xp = backend.xp
    coef = xp.minimum(xp.asarray(max_norm, dtype=norm.dtype) / (norm + norm.dtype.type(1e-6)),
                      norm.dtype.type(1.0))
    backend.scale_([g.data for g in grads], coef)
    for g in grads:
        g._version[0] += 1
    return Tensor._wrap(norm, grads[0].device)
