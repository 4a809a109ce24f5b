"""DP x TP x CP composed on one DeviceMesh (§2.2, §4.2-4.3): 5 AdamW steps on 4 and 8 real MPI
ranks (8 on 2 cores: ~14 s) equal one process on the whole batch (float64), and the run's
checkpoint loads into another layout (checked on the ranks) and into one process (checked here)."""

import numpy as np
import pytest

import kiln
from kiln.checkpoint import load
from kiln.nn import GPT, GPTConfig
from tests.mpi_runner import run_ranks


@pytest.mark.dist
@pytest.mark.parametrize("dp, tp, cp, transport, chunks", [(1, 2, 2, "p2p", 2), (2, 2, 1, "p2p", 1),
                                                          (2, 1, 2, "all_gather", 1), (2, 2, 2, "p2p", 2)])
def test_mesh_training_equals_one_process_and_its_checkpoint_loads_anywhere(dp, tp, cp, transport, chunks, tmp_path):
    results, _, _ = run_ranks("mesh_training_equal.py", dp * tp * cp, tmp_path, dp, tp, cp, transport, chunks,
                              tmp_path, timeout=120)
    coords = sorted((res["coordinate"]["dp"], res["coordinate"]["cp"], res["coordinate"]["tp"]) for res in results)
    assert coords == sorted((a, b, c) for a in range(dp) for b in range(cp) for c in range(tp))
    for r, res in enumerate(results):
        assert res["grad_group"] == dp * cp, (r, res)
        assert res["moved"] > 1e-3  # the 5 steps changed the weights: the comparison is not of the start
        assert res["param_diff"] <= 1e-10 and res["loss_diff"] <= 1e-10 and res["norm_diff"] <= 1e-10, (r, res)
        assert res["ref_norms"][0] > 0.5  # the clip acted
        assert res["other_layout_loss_diff"] <= 1e-10, (r, res)
    saved = load(tmp_path / "mesh.kiln")
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)).to(dtype="float64")
    model.load_state_dict({k: kiln.tensor(v) for k, v in saved["model"].items()})
    rng = np.random.default_rng(7)
    batches = [(rng.integers(0, 64, (4, 16)), rng.integers(0, 64, (4, 16))) for _ in range(6)]
    x, y = batches[-1]  # the rank script's evaluation batch
    loss = model(kiln.tensor(x), kiln.tensor(y))[1].item()
    assert abs(loss - float(saved["eval_loss"])) <= 1e-10
