"""Finite-difference gradient checks in float64 for kiln ops."""

import numpy as np

import kiln


def gradcheck(fn, *arrays, eps=1e-6, tol=1e-7, seed=None):
    """Check d(sum(fn(*x) * R))/dx of every float input against central differences.

    `arrays` are NumPy float64 inputs (integer arrays are passed through as constant tensors);
    R is a fixed random weighting, so every output element matters.
    """
    rng = np.random.default_rng(seed)
    tensors = [kiln.tensor(a, requires_grad=a.dtype.kind == "f") for a in arrays]
    out = fn(*tensors)
    weight = rng.standard_normal(out.shape)
    (out * kiln.tensor(weight, dtype=out.dtype)).sum().backward()

    def objective(values):
        with kiln.no_grad():
            return float((fn(*[kiln.tensor(v) for v in values]).numpy() * weight).sum())

    for i, a in enumerate(arrays):
        if a.dtype.kind != "f":
            continue
        analytic = tensors[i].grad.numpy()
        numeric = np.zeros_like(a)
        for j in range(a.size):
            plus = [v.copy() for v in arrays]
            minus = [v.copy() for v in arrays]
            plus[i].flat[j] += eps
            minus[i].flat[j] -= eps
            numeric.flat[j] = (objective(plus) - objective(minus)) / (2 * eps)
        err = np.abs(analytic - numeric).max() / max(1.0, np.abs(numeric).max())
        assert err <= tol, f"input {i}: max error {err:.3g} (analytic vs finite differences)"


def randn(*shape, rng=None):
    return (rng or np.random.default_rng()).standard_normal(shape)
