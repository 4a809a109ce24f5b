"""The whole GPT on the GPU against the CPU backend, and a short bf16 run against fp32 (device only)."""

import numpy as np
import pytest

import kiln
from kiln.nn import GPT, GPTConfig
from kiln.optim import AdamW, clip_grad_norm_, gpt_param_groups
from kiln.train import apply_precision

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not kiln.cuda_is_available(), reason="needs an NVIDIA GPU and CuPy")]

CFG = GPTConfig(vocab_size=512, block_size=128, n_layer=2, n_head=4, n_embd=128)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def _pair(seed):
    cpu = GPT(CFG, generator=kiln.Generator(seed)).to(dtype="float64")
    gpu = GPT(CFG, generator=kiln.Generator(seed)).to("cuda")
    return cpu, gpu


@pytest.mark.parametrize("precision,tol", [("fp32", 1e-5), ("tf32", 1e-3), ("bf16", 1e-2)])
def test_forward_and_backward_match_the_cpu_backend(precision, tol):
    rng = np.random.default_rng()
    cpu, gpu = _pair(int(rng.integers(1 << 30)))
    apply_precision(gpu, precision, kiln.device("cuda"))
    x, y = rng.integers(0, CFG.vocab_size, (4, 128)), rng.integers(0, CFG.vocab_size, (4, 128))
    _, loss = cpu(kiln.tensor(x), kiln.tensor(y))  # the fused LM head: no logits
    loss.backward()
    _, g_loss = gpu(kiln.tensor(x, device="cuda"), kiln.tensor(y, device="cuda"))
    g_loss.backward()
    with kiln.no_grad():
        logits, _ = cpu(kiln.tensor(x))
        g_logits, _ = gpu(kiln.tensor(x, device="cuda"))
    assert rel(g_loss.item(), loss.item()) <= tol
    assert rel(g_logits.to("float32").numpy(), logits.numpy()) <= tol
    grad_tol = {"fp32": 1e-4, "tf32": 1e-2, "bf16": 5e-2}[precision]  # gradients sum many rounded terms
    for (name, p), q in zip(cpu.named_parameters(), gpu.parameters()):
        assert q.grad.dtype is kiln.float32
        assert rel(q.grad.numpy(), p.grad.numpy()) <= grad_tol, name
    apply_precision(gpu, "fp32", kiln.device("cuda"))


def test_a_short_bf16_run_tracks_fp32():
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 64, (8, 128)), None) for _ in range(30)]
    curves = {}
    for precision in ("fp32", "bf16"):
        model = GPT(CFG, generator=kiln.Generator(11)).to("cuda")
        apply_precision(model, precision, kiln.device("cuda"))
        opt = AdamW(gpt_param_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.95))
        losses = []
        for x, _ in batches:
            xt = kiln.tensor(x, device="cuda")
            opt.zero_grad()
            _, loss = model(xt, xt)  # learn to copy the current token: the loss must fall fast
            loss.backward()
            clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
        curves[precision] = np.array(losses)
        apply_precision(model, "fp32", kiln.device("cuda"))
    assert curves["fp32"][-1] < 0.5 * curves["fp32"][0]
    assert np.max(np.abs(curves["bf16"] - curves["fp32"])) < 0.1 * curves["fp32"][0]
