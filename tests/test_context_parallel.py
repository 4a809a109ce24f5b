"""Context parallelism (§4.3) on real MPI ranks: ring (p2p), all-gather and all-to-all (Ulysses)
attention over a sharded sequence equal full causal attention, output and dq/dk/dv, with the
contiguous and the zigzag (load-balanced) layout; and the data-boundary layout itself."""

import numpy as np
import pytest

from kiln.distributed.context_parallel import (
    TRANSPORTS,
    sequence_positions,
    shard_sequence,
)
from kiln.errors import ShapeError
from tests.mpi_runner import run_ranks

TOL = {"float64": 1e-12, "float32": 1e-5}


def test_zigzag_gives_rank_r_chunks_r_and_2w_minus_1_minus_r_with_their_positions():
    t, w = 16, 4
    seq = np.arange(100, 100 + t)[None, :]
    held = [shard_sequence(seq, r, w, zigzag=True)[0] for r in range(w)]
    assert held[1].tolist() == [102, 103, 112, 113]  # chunks 1 and 6 of 8
    for r in range(w):
        np.testing.assert_array_equal(held[r] - 100, sequence_positions(t, r, w, zigzag=True))
    assert sorted(np.concatenate(held).tolist()) == seq[0].tolist()  # every token once
    assert shard_sequence(seq, 2, w, zigzag=False)[0].tolist() == list(range(108, 112))
    with pytest.raises(ShapeError, match="divisible by 8"):
        shard_sequence(np.zeros((1, 12)), 0, w, zigzag=True)


@pytest.mark.dist
@pytest.mark.parametrize("n", [2, 4])
def test_context_parallel_attention_equals_full_causal_attention(n, tmp_path):
    results, _, _ = run_ranks("context_parallel_equal.py", n, tmp_path, timeout=90)
    for r, res in enumerate(results):
        assert len(res) == 2 * len(TRANSPORTS) * 2, sorted(res)
        for case, errors in res.items():
            assert len(errors) == 4 and max(errors) <= TOL[case.split("/")[0]], (r, case, errors)
