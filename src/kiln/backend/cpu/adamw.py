"""Multi-tensor AdamW (decoupled weight decay) and the global gradient norm, in place."""

import math

import numpy as np


def grad_norm(grads):
    """The L2 norm of all gradients together, as a 0-d float32 (float64 for float64) array."""
    dt = np.float64 if all(g.dtype == np.float64 for g in grads) else np.float32
    total = sum(float(np.dot(g.reshape(-1).astype(dt, copy=False), g.reshape(-1).astype(dt, copy=False)))
                for g in grads)
    return np.asarray(math.sqrt(total), dtype=dt)


def scale_(arrays, factor):
    """Multiply every array in place by a 0-d factor."""
    for a in arrays:
        a *= np.asarray(factor, dtype=a.dtype)


def adamw_step(params, grads, exp_avgs, exp_avg_sqs, weight_decays, lr, beta1, beta2, eps, step):
    """One AdamW update of every parameter, in place, the same arithmetic as torch.optim.AdamW."""
    bias_correction1 = 1.0 - beta1 ** step
    bias_correction2_sqrt = math.sqrt(1.0 - beta2 ** step)
    step_size = lr / bias_correction1
    for p, g, m, v, wd in zip(params, grads, exp_avgs, exp_avg_sqs, weight_decays):
        dt = p.dtype.type
        if wd != 0.0:
            p *= dt(1.0 - lr * wd)
        m += (g - m) * dt(1.0 - beta1)
        v *= dt(beta2)
        v += g * g * dt(1.0 - beta2)
        denom = np.sqrt(v) / dt(bias_correction2_sqrt)
        denom += dt(eps)
        p -= dt(step_size) * (m / denom)
