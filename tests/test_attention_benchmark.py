"""The attention benchmarks' PyTorch side: SDPA's forward+backward returns its gradients, as kiln's
backward does, and never adds them into .grad (that cost three elementwise kernels a call, timed as SDPA's)."""

import torch

from tests.benchmark_support import load_benchmark


def test_sdpa_fwd_bwd_returns_the_gradients_and_leaves_grad_alone():
    sdpa_fwd_bwd = load_benchmark("kernel_speed").sdpa_fwd_bwd
    gen = torch.Generator().manual_seed(0)
    q, k, v, g = (torch.randn(2, 3, 16, 8, generator=gen) for _ in range(4))
    q, k, v = (a.requires_grad_() for a in (q, k, v))
    first = sdpa_fwd_bwd(q, k, v, g)
    second = sdpa_fwd_bwd(q, k, v, g)
    assert all(a.grad is None for a in (q, k, v))
    leaves = [a.detach().clone().requires_grad_() for a in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True).backward(g)
    for got, again, leaf in zip(first, second, leaves):
        assert torch.equal(got, again) and torch.allclose(got, leaf.grad, rtol=1e-5, atol=1e-6)
