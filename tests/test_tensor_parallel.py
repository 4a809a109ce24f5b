"""Tensor parallelism (§4.2) on real MPI ranks: each parallel layer and the whole GPT equal the
dense ones in float64, async TP (N = 2, 4) equals plain TP, and one block's forward makes
exactly Megatron's all-reduces."""

import pytest

from tests.mpi_runner import run_ranks

TOL = 1e-12


@pytest.mark.dist
@pytest.mark.parametrize("n", [2, 4])
def test_tensor_parallel_layers_and_gpt_equal_dense(n, tmp_path):
    results, _, _ = run_ranks("tensor_parallel_equal.py", n, tmp_path, timeout=90)
    tokens, width = 2 * 16, 8 * n  # the GPT's batch tokens and n_embd in the rank script
    for r, res in enumerate(results):
        counts = {k: res.pop(k) for k in list(res) if k.startswith("block_all_reduces_")}
        assert len(res) == 28, sorted(res)  # every check reported
        bad = {k: v for k, v in res.items() if v > TOL}
        assert not bad, (r, bad)
        # two all-reduces of the [B, T, C] activations per block forward (attention and MLP
        # outputs); async TP makes each N all-reduces of a 1/N share, nothing else
        for chunks in (1, 2, 4):
            assert counts[f"block_all_reduces_{chunks}"] == [tokens * width // chunks] * (2 * chunks), (r, counts)
