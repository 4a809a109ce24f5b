"""Multi-tensor AdamW (decoupled weight decay) and the global gradient norm, in place."""

import math

import numpy as np


def grad_norm(grads):
    """The L2 norm of all gradients together, as a 0-d float32 (float64 for float64) array. The
    squares are summed in float64 whatever the gradients' dtype (as ZeRO's sharded clip sums them:
    a float32 norm then rounds to the same bits however the gradients were split)."""
    dt = np.float64 if all(g.dtype == np.float64 for g in grads) else np.float32
    return norm_of_sumsqs([grad_sumsq(g) for g in grads], dt)


def grad_sumsq(grad):
    """One gradient's sum of squares, summed in float64: its term of grad_norm (AdamW in backward
    takes each gradient's as it is made, kiln.optim.adamw)."""
    wide = grad.reshape(-1).astype(np.float64)
    return float(np.dot(wide, wide))


def norm_of_sumsqs(sumsqs, dtype):
    """sqrt of the grad_sumsq terms added in the order given, a 0-d array of dtype: in the gradients'
    order it is grad_norm(grads) bit for bit."""
    total = 0.0
    for s in sumsqs:
        total += s
    return np.asarray(math.sqrt(total), dtype=dtype)


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
