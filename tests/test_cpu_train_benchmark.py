"""benchmarks/cpu_train.py's workers train the tiny preset at its own context (its T128 default outlived
the preset's move to a 64-token context and failed), and both frameworks see the same losses."""

import pytest

from tests.benchmark_support import load_benchmark


@pytest.mark.parametrize("framework", ["kiln", "torch"])
def test_a_worker_trains_at_the_presets_context(framework):
    r = load_benchmark("cpu_train")._worker(framework, steps=3, warmup=1, b=2)
    assert len(r["losses"]) == 4 and r["tokens_per_s"] > 0 and r["peak_rss_mib"] > 0


def test_both_workers_start_from_the_same_loss():
    bench = load_benchmark("cpu_train")
    kiln_losses, torch_losses = (bench._worker(fw, steps=2, warmup=1, b=2)["losses"] for fw in ("kiln", "torch"))
    assert abs(kiln_losses[0] - torch_losses[0]) < 1e-5 * abs(torch_losses[0])
