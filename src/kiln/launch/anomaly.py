"""Bad-step detection: a NaN/Inf loss or gradient norm, or a spike, by a rolling z-score.

As llm.c's outlier detector: keep the last `window` accepted values of a series; a new value
whose z-score against them exceeds `z` is a spike, if it is also `ratio` times the window's
mean (a smooth series has a tiny deviation, and early training's natural rise of the gradient
norm, 1.5x over a few steps, scored z = 6-10 on the CPU test model). Only accepted steps enter
the window, so a spike does not hide the next one. Detection starts once `min_history` values
are in.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass
class BadStep:
    kind: str       # "nan" (a non-finite value) or "spike"
    series: str     # "loss" or "grad_norm"
    step: int
    value: float
    zscore: float | None
    evidence: str


class RollingZScore:
    """Mean and standard deviation of the last `window` values."""

    def __init__(self, window: int):
        self.values: deque[float] = deque(maxlen=window)

    def zscore(self, x: float) -> float | None:
        n = len(self.values)
        if n < 2:
            return None
        mean = sum(self.values) / n
        std = math.sqrt(sum((v - mean) ** 2 for v in self.values) / (n - 1))
        return (x - mean) / std if std > 0 else (math.inf if x != mean else 0.0)

    def push(self, x: float) -> None:
        self.values.append(x)


class BadStepDetector:
    """Checks each step's loss and gradient norm (paper §4.4's "per-rank straggler divergence"
    aside, the numerics half of the fault taxonomy)."""

    def __init__(self, z: float = 6.0, window: int = 100, min_history: int = 10, ratio: float = 2.0):
        self.z, self.min_history, self.ratio = float(z), int(min_history), float(ratio)
        self.series = {"loss": RollingZScore(window), "grad_norm": RollingZScore(window)}

    def check(self, step: int, loss: float | None, grad_norm: float | None) -> BadStep | None:
        values = {"loss": loss, "grad_norm": grad_norm}
        for name, x in values.items():
            if x is not None and not math.isfinite(x):
                return BadStep("nan", name, step, x, None, f"{name} is {x} at step {step}")
        if self.z > 0:
            for name, x in values.items():
                window = self.series[name]
                if x is None or len(window.values) < self.min_history:
                    continue
                z = window.zscore(x)
                n = len(window.values)
                mean = sum(window.values) / n
                if z is not None and z > self.z and x > self.ratio * mean:
                    return BadStep("spike", name, step, x, z,
                                   f"{name} {x:.6g} at step {step} is {z:.1f} standard deviations above "
                                   f"the mean {mean:.6g} of the last {n} steps (thresholds: z > {self.z:g} "
                                   f"and {self.ratio:g}x the mean)")
        for name, x in values.items():
            if x is not None:
                self.series[name].push(x)
        return None
