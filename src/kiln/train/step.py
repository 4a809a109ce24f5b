"""The plain training step: zero_grad, forward, backward, the global-norm clip fused into AdamW, update.

It is the Trainer's step (trainer.py `_step_body`) without gradient accumulation, DDP, model
parallelism or injected faults, for programs that drive a model themselves (the benchmarks, the
tests of graph capture). Device work only, so `kiln.graph.CapturedStep(plain_step(...))` records it.
"""

from __future__ import annotations

from collections.abc import Callable


def plain_step(model, optimizer, grad_clip: float = 1.0, after_backward: Callable[[], None] | None = None):
    """step(x, y) -> the loss tensor; the clip is skipped when grad_clip <= 0. after_backward runs
    between backward and the clip (DDP's wait_gradients)."""

    def step(x, y):
        optimizer.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        if after_backward is not None:
            after_backward()
        if grad_clip > 0:
            optimizer.clip_grad_norm_(grad_clip)
        optimizer.step()
        return loss

    return step
