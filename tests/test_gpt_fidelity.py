"""kiln's GPT against the same GPT in PyTorch: loss, logits, every gradient, 20 AdamW steps."""

import numpy as np
import pytest
import torch

import kiln
from kiln.nn import GPT, GPTConfig
from kiln.optim import AdamW, clip_grad_norm_, gpt_param_groups
from tests.conftest import rel
from tests.torch_gpt import torch_gpt_forward, torch_params

CFG = GPTConfig(vocab_size=67, block_size=16, n_layer=2, n_head=2, n_embd=24)


def batch(rng, b=3, t=16):
    idx = rng.integers(0, CFG.vocab_size, (b, t))
    return idx, rng.integers(0, CFG.vocab_size, (b, t))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("dtype,tol", [("float64", 1e-10), ("float32", 1e-5)])
def test_loss_logits_and_grads_match_pytorch(dtype, tol, tie, fused):
    """With the fused LM head (the default) and with whole logits (fused_lm_head = False)."""
    rng = np.random.default_rng()
    cfg = GPTConfig(**{**CFG.__dict__, "tie_weights": tie})
    model = GPT(cfg, generator=kiln.Generator(int(rng.integers(1 << 30)))).to(dtype=dtype)
    model.fused_lm_head = fused
    tdt = torch.float64 if dtype == "float64" else torch.float32
    tp = torch_params(model, tdt)
    idx, tgt = batch(rng)
    logits, loss = model(kiln.tensor(idx), kiln.tensor(tgt))
    loss.backward()
    if fused:
        assert logits is None
        with kiln.no_grad():
            logits, _ = model(kiln.tensor(idx))
    t_logits, t_loss = torch_gpt_forward(tp, cfg, torch.tensor(idx), torch.tensor(tgt))
    t_loss.backward()
    assert rel(loss.item(), t_loss.item()) <= tol
    assert rel(logits.numpy(), t_logits.detach().numpy()) <= tol
    for name, p in model.named_parameters():
        assert rel(p.grad.numpy(), tp[name].grad.numpy()) <= tol, name


def test_twenty_adamw_steps_match_pytorch_float32():
    rng = np.random.default_rng()
    model = GPT(CFG, generator=kiln.Generator(int(rng.integers(1 << 30))))
    tp = torch_params(model, torch.float32)
    names = [n for n, _ in model.named_parameters()]
    groups = gpt_param_groups(model, 0.1)
    opt = AdamW(groups, lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    by_id = {id(p): n for n, p in model.named_parameters()}
    t_opt = torch.optim.AdamW([{"params": [tp[by_id[id(p)]] for p in g["params"]],
                                "weight_decay": g["weight_decay"]} for g in groups],
                              lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    assert len(names) == len(tp)
    for step in range(20):
        idx, tgt = batch(rng)
        opt.zero_grad()
        _, loss = model(kiln.tensor(idx), kiln.tensor(tgt))
        loss.backward()
        norm = clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        t_opt.zero_grad()
        _, t_loss = torch_gpt_forward(tp, CFG, torch.tensor(idx), torch.tensor(tgt))
        t_loss.backward()
        t_norm = torch.nn.utils.clip_grad_norm_(list(tp.values()), 1.0)
        t_opt.step()
        assert rel(loss.item(), t_loss.item()) <= 1e-5, step
        assert rel(norm.item(), t_norm.item()) <= 1e-4, step
