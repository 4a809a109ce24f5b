"""benchmarks/largest_model.py: its memory and FLOP arithmetic, the saved bytes it counts, and one small
case of each framework on the CPU."""

import argparse
import json
import math

import pytest

from kiln.nn import GPTConfig
from tests.benchmark_support import load_benchmark

GIB = 2 ** 30


def load():
    return load_benchmark("largest_model")


def test_the_target_model_has_10_58b_parameters_and_needs_recomputed_blocks_on_an_h200():
    lm = load()
    assert lm.n_params(76) == pytest.approx(8.77e9, rel=2e-3)  # PyTorch's largest
    assert lm.n_params(92) == pytest.approx(10.58e9, rel=1e-3)
    h200 = 143_771 * 2 ** 20
    assert lm.recompute_plan(76, h200, gelu=False) == 0  # 98 GiB of weights and moments, 28.5 GiB of activations
    for gelu, low, high in ((False, 40, 52), (True, 10, 16)):
        k = lm.recompute_plan(92, h200, gelu)
        assert low <= k <= high
        assert lm.predicted_bytes(92, k, gelu) <= h200 < lm.predicted_bytes(92, k - 1, gelu)
    assert lm.recompute_plan(200, h200) == 200  # more than fits: every block, and still too much


def test_the_flop_factor_counts_one_more_forward_per_recomputed_block_and_a_backward_for_the_clip():
    lm = load()
    assert lm.flops_factor(92, 0, False) == 1.0
    assert lm.flops_factor(92, 92, False) == pytest.approx(4 / 3)
    assert lm.flops_factor(92, 0, True) == pytest.approx(5 / 3)
    assert lm.flops_factor(92, 46, True) == pytest.approx(1 + 1 / 6 + 2 / 3 + 1 / 6)


def test_the_predicted_ratio_is_the_flop_factor_and_for_the_host_clip_the_copies_back():
    """The H100 run of 2026-12-06: PyTorch 42 layers at 1.41 s a step; kiln 53 layers, 28 recomputed: clip off
    predicted 0.85 (measured 0.88), through host memory 0.68 (measured 0.70), by a second backward 0.47 at 36
    recomputed (measured 0.49)."""
    lm = load()
    ref = {"params": lm.n_params(42), "step_s": 1.41}
    row = {"params": lm.n_params(53), "n_layer": 53, "recompute_blocks": 28}
    off = lm.predicted_product({**row, "clip": "off"}, ref)
    assert off == pytest.approx(1 / lm.flops_factor(53, 28, False)) and off == pytest.approx(0.85, abs=0.005)
    assert lm.predicted_product({**row, "clip": "host"}, ref) == pytest.approx(0.68, abs=0.01)
    assert lm.predicted_product({**row, "clip": "on", "recompute_blocks": 36}, ref) == pytest.approx(0.47, abs=0.005)


def test_a_plain_block_keeps_sixteen_activations_and_a_recomputed_one_two():
    """On the CPU the attention output's [B, T, H*D] view is a copy (one more than the GPU's layout)."""
    got = load().saved_per_block()
    assert got["recomputed"] == 2.0
    assert got["plain"] == pytest.approx(16 + 1 + 4 / 64 + 4 / 64)  # + the CPU's copy, the LSE, 2 x (mean, rstd)
    # the fused MLP keeps x (1), the pre-activation (4) and the GELU (4); attention's c_attn and c_proj their inputs
    assert got["plain_by_op"]["LinearGELULinear"] == 9.0 and got["plain_by_op"]["Linear"] == 2.0
    assert got["norm_gelu_recomputed"] == got["plain"] - 6  # the GELU output (4) and two LayerNorm outputs not kept
    by_op = got["norm_gelu_recomputed_by_op"]
    assert by_op["GELULinear"] == 4.0 and by_op["Linear"] == 1.0 and "NormLinear" not in by_op  # keeps s: kept anyway


@pytest.mark.parametrize("framework, clip", [("kiln", "on"), ("kiln", "off"), ("kiln", "host"), ("torch-eager", "on")])
def test_one_small_case_runs_on_the_cpu(monkeypatch, framework, clip):
    lm = load()
    monkeypatch.setattr(lm, "B", 2)
    monkeypatch.setattr(lm, "T", 16)
    monkeypatch.setattr(lm, "VOCAB", 64)
    monkeypatch.setattr(lm, "config", lambda n: GPTConfig(vocab_size=64, block_size=16, n_layer=n, n_head=2, n_embd=32))
    args = argparse.Namespace(framework=framework, n_layer=3, clip=clip, recompute_blocks=2, recompute_norm_gelu="on",
                              steps=3, warmup=1, device="cpu")
    r = lm.worker(args)
    assert r["params"] == lm.n_params(3) and r["tokens_per_s"] > 0 and len(r["losses"]) == 3
    assert all(abs(v - math.log(64)) < 0.3 for v in r["losses"])  # random tokens: about log V from the start


def test_the_cases_and_the_table():
    lm = load()
    args = argparse.Namespace(torch_layers=[76], kiln_layers=[76, 92], clip=["off", "on"], recompute_blocks=None,
                              recompute_norm_gelu="on", torch_compile=False)
    cases = lm.cases(args, 143_771 * 2 ** 20)
    assert [(c["framework"], c["n_layer"], c["clip"], c["recompute_blocks"]) for c in cases] == [
        ("torch-eager", 76, "on", 0), ("kiln", 76, "off", 0), ("kiln", 76, "on", 0),
        ("kiln", 92, "off", 16), ("kiln", 92, "on", 16)]
    done = {"framework": "kiln", "n_layer": 92, "clip": "off", "recompute_blocks": 16, "recompute_norm_gelu": "on",
            "params": lm.n_params(92), "tokens_per_s": 640.0, "step_s": 3.2, "peak_allocated_gib": 137.0,
            "predicted_gib": 139.9, "product_vs_torch": 0.93, "predicted_product_vs_torch": 0.945}
    torch_row = {"framework": "torch-eager", "n_layer": 76, "clip": "on", "recompute_blocks": None,
                 "recompute_norm_gelu": None, "params": lm.n_params(76), "tokens_per_s": 839.0, "step_s": 2.44,
                 "peak_allocated_gib": 131.9, "product_vs_torch": 1.0}
    failed = {**cases[-1], "error": "Traceback ...\nMemoryError: out of memory"}
    text = lm.table([torch_row, done, failed])
    assert "| kiln | 92 | 10.58B | off | 16, on | 640 | 3.20 | 137.0 | 139.9 | 0.930 | 0.945 |" in text
    assert "MemoryError: out of memory" in text and text.count("\n") == 4


def test_the_record_is_written_after_each_case_with_ratios_to_pytorch(tmp_path):
    """write_record (called after every case, so a call cut short keeps what finished): the json and md of
    the rows so far, each finished row's tokens x params against PyTorch's, an error row kept as it is."""
    lm = load()
    args = argparse.Namespace(out=str(tmp_path), name="largest", steps=3, warmup=1)
    torch_row = {"framework": "torch-eager", "n_layer": 2, "params": 2e9, "clip": "on", "recompute_blocks": None,
                 "recompute_norm_gelu": "off", "tokens_per_s": 100.0, "step_s": 20.48, "peak_allocated_gib": 30.0,
                 "tokens_x_params": 2e11}
    kiln_row = {**torch_row, "framework": "kiln", "n_layer": 3, "params": 3e9, "tokens_per_s": 80.0,
                "tokens_x_params": 2.4e11, "recompute_blocks": 1, "recompute_norm_gelu": "on", "predicted_gib": 31.0}
    failed = {"framework": "kiln", "n_layer": 4, "clip": "host", "recompute_blocks": 2, "error": "out of memory"}
    rows = [torch_row, kiln_row, failed]
    written = lm.write_record(args, rows, 80 * GIB)
    assert written[1]["product_vs_torch"] == pytest.approx(1.2) and "product_vs_torch" not in written[2]
    assert "product_vs_torch" not in rows[1]  # the caller's rows are not changed
    record = json.loads((tmp_path / "largest.json").read_text())
    assert [r["framework"] for r in record["rows"]] == ["torch-eager", "kiln", "kiln"]
    assert record["device_gib"] == 80 and record["rows"][1]["product_vs_torch"] == pytest.approx(1.2)
    md = (tmp_path / "largest.md").read_text()
    assert "| kiln | 3 | 3.00B | on | 1, on | 80 |" in md and "out of memory" in md
