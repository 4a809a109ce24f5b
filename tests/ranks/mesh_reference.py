"""What the mesh rank scripts (mesh_training_equal.py, mesh_sharded_equal.py) compare against: the
float64 GPT, its AdamW and the batches of the single-process reference run."""

import numpy as np

import kiln
from kiln.nn import GPT, GPTConfig
from kiln.optim import AdamW, gpt_param_groups

STEPS, ROWS, T, CLIP = 5, 4, 16, 0.5
cfg = GPTConfig(vocab_size=64, block_size=T, n_layer=2, n_head=4, n_embd=32)


def gpt(state=None):
    """The float64 GPT every run starts from (seed 0), or with `state`'s dense parameters."""
    model = GPT(cfg, generator=kiln.Generator(0)).to(dtype="float64")
    if state is not None:
        model.load_state_dict({k: kiln.tensor(v) for k, v in state.items()})
    return model


def optimizer(model):
    return AdamW(gpt_param_groups(model, 0.1), lr=3e-3, betas=(0.9, 0.95))


def batches():
    """STEPS + 1 whole batches (x, y) of ROWS x T tokens, the same on every rank."""
    rng = np.random.default_rng(7)
    return [(rng.integers(0, 64, (ROWS, T)), rng.integers(0, 64, (ROWS, T))) for _ in range(STEPS + 1)]
