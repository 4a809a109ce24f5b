"""Multi-tensor AdamW (decoupled weight decay) and the global gradient norm, in place."""

import math

import numpy as np


def grad_norm(grads):
    """The L2 norm of all gradients together, as a 0-d float32 (float64 for float64) array. The
    squares are summed in float64 whatever the gradients' dtype (as ZeRO's sharded clip sums them:
    a float32 norm then rounds to the same bits however the gradients were split)."""
    return _norm_of_sumsqs([_sumsq(g) for g in grads], _norm_dtype(grads))


def _norm_dtype(arrays):
    return np.float64 if all(a.dtype == np.float64 for a in arrays) else np.float32


def _sumsq(grad):
    wide = grad.reshape(-1).astype(np.float64)
    return float(np.dot(wide, wide))


def _norm_of_sumsqs(sumsqs, dtype):
    total = 0.0
    for s in sumsqs:
        total += s
    return np.asarray(math.sqrt(total), dtype=dtype)


class GradNormParts:
    """grad_norm of gradients that come one at a time and are dropped (AdamW in backward): each one's
    sum of squares is kept in its parameter's slot, and the norm adds them in parameter order: for
    gradients of every parameter it is grad_norm(grads) bit for bit."""

    def __init__(self, params):
        self.sumsqs = [None] * len(params)
        self.dtype = _norm_dtype(params)

    def add(self, index: int, grad) -> None:
        self.sumsqs[index] = _sumsq(grad)

    def norm(self):
        return _norm_of_sumsqs([s for s in self.sumsqs if s is not None], self.dtype)


def grad_norm_parts(params):
    """A GradNormParts for gradients shaped as these parameter arrays, in this order."""
    return GradNormParts(params)


def scale_(arrays, factor):
    """Multiply every array in place by a 0-d factor."""
    for a in arrays:
        a *= np.asarray(factor, dtype=a.dtype)


def clip_coef(norm, max_norm):
    """torch.nn.utils.clip_grad_norm_'s factor min(1, max_norm / (norm + 1e-6)), as a 0-d array (NaN stays NaN)."""
    dt = norm.dtype.type  # np.minimum dispatches to CuPy for a device norm
    return np.minimum(dt(max_norm) / (norm + dt(1e-6)), dt(1.0))


def adamw_step(params, grads, exp_avgs, exp_avg_sqs, weight_decays, lr, beta1, beta2, eps, step,
               clip_norm=None, max_norm=0.0, copies=None):
    """One AdamW update of every parameter, in place, the same arithmetic as torch.optim.AdamW.

    clip_norm (a 0-d array, or None): read every gradient as g * clip_coef(clip_norm, max_norm),
    the clip fused into the update; the gradients themselves are not changed.
    copies: per parameter, an array of its shape in a compute dtype (or None): set to the updated
    parameter cast to that dtype (the copy a mixed-precision forward reads, kiln.ops.convert.KeptCopy).
    """
    coef = None if clip_norm is None else clip_coef(clip_norm, max_norm)
    bias_correction1 = 1.0 - beta1 ** step
    bias_correction2_sqrt = math.sqrt(1.0 - beta2 ** step)
    step_size = lr / bias_correction1
    copies = [None] * len(params) if copies is None else copies
    for p, g, m, v, wd, c in zip(params, grads, exp_avgs, exp_avg_sqs, weight_decays, copies):
        dt = p.dtype.type
        if coef is not None:
            g = g * coef.astype(g.dtype)
        if wd != 0.0:
            p *= dt(1.0 - lr * wd)
        m += (g - m) * dt(1.0 - beta1)
        v *= dt(beta2)
        v += g * g * dt(1.0 - beta2)
        denom = np.sqrt(v) / dt(bias_correction2_sqrt)
        denom += dt(eps)
        p -= dt(step_size) * (m / denom)
        if c is not None:
            c[...] = p.astype(c.dtype)
