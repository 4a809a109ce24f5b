"""Training: `TrainConfig` and its checks (config.py), the `Trainer` loop (trainer.py), the plain
step of programs that drive a model themselves (step.py).

    from kiln.train import TrainConfig, Trainer
    summary = Trainer(TrainConfig(model="tiny", max_steps=200)).fit()

The run folder a Trainer fills is kiln.checkpoint.run_folder's (load_run, load_pretrained).
"""

from kiln.checkpoint.run_folder import load_pretrained, load_run, plot_losses
from kiln.data.shards import unigram_entropy
from kiln.train.config import TrainConfig, apply_precision, resolve_device
from kiln.train.step import plain_step
from kiln.train.trainer import Trainer

__all__ = [
           "TrainConfig",
           "Trainer",
           "apply_precision",
           "load_pretrained",
           "load_run",
           "plain_step",
           "plot_losses",
           "resolve_device",
           "unigram_entropy",
]
