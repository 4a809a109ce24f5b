"""Learning-rate schedules."""

import math

from kiln.errors import ConfigError


def warmup_cosine_lr(step: int, max_lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """Linear warm-up to max_lr over warmup_steps, then cosine decay to min_lr at total_steps."""
    if warmup_steps < 0 or total_steps <= 0 or min_lr > max_lr:
        raise ConfigError(f"schedule needs warmup >= 0, total > 0 and min_lr <= max_lr; got "
                          f"warmup={warmup_steps}, total={total_steps}, min_lr={min_lr}, max_lr={max_lr}")
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= total_steps:
        return min_lr
    ratio = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (max_lr - min_lr)
