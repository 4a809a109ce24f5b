"""kiln.train.plain_step: the benchmarks' step is the Trainer's (one process, no accumulation)."""

import numpy as np

import kiln
from kiln.nn import GPT, GPTConfig
from kiln.optim import AdamW, gpt_param_groups
from kiln.train import plain_step

CFG = GPTConfig(block_size=16, vocab_size=32, n_layer=2, n_head=2, n_embd=16)


def _model_and_opt():
    model = GPT(CFG, generator=kiln.Generator(7))
    return model, AdamW(gpt_param_groups(model, 0.1), lr=1e-2, betas=(0.9, 0.95))


def test_plain_step_is_zero_grad_forward_backward_clip_update():
    tokens = np.random.default_rng(0).integers(0, 32, (3, 17))
    x, y = kiln.tensor(tokens[:, :-1]), kiln.tensor(tokens[:, 1:])
    model, opt = _model_and_opt()
    ref, ref_opt = _model_and_opt()
    step = plain_step(model, opt, grad_clip=0.05)
    for _ in range(3):
        loss = step(x, y)
        ref_opt.zero_grad()
        _, ref_loss = ref(x, y)
        ref_loss.backward()
        ref_opt.clip_grad_norm_(0.05)
        ref_opt.step()
        assert loss.item() == ref_loss.item()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert np.array_equal(p.numpy(), q.numpy())


def test_plain_step_without_a_clip_and_with_a_hook():
    tokens = np.random.default_rng(1).integers(0, 32, (2, 17))
    x, y = kiln.tensor(tokens[:, :-1]), kiln.tensor(tokens[:, 1:])
    clipped, unclipped = _model_and_opt(), _model_and_opt()
    calls = []
    plain_step(*clipped, grad_clip=1e-3)(x, y)
    plain_step(*unclipped, grad_clip=0.0, after_backward=lambda: calls.append(1))(x, y)
    assert calls == [1]
    moved = [np.abs(p.numpy() - q.numpy()).max() for p, q in zip(clipped[0].parameters(), unclipped[0].parameters())]
    assert max(moved) > 0  # a tiny clip changes the update (AdamW's first step is sign-like, so only slightly)
