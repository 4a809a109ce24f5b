"""Optimizers and schedules: AdamW, warm-up + cosine decay, gradient clipping."""

from kiln.optim.adamw import AdamW, gpt_param_groups
from kiln.optim.clip import clip_grad_norm_
from kiln.optim.schedule import warmup_cosine_lr

__all__ = ["AdamW", "gpt_param_groups", "clip_grad_norm_", "warmup_cosine_lr"]
