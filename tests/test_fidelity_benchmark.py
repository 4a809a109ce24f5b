"""benchmarks/fidelity.py: the gap arithmetic, the corpus it finds on the machine, and a short
kiln-vs-PyTorch run on the CPU whose curves agree to fp32 rounding."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmark_support import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


def load():
    return load_benchmark("fidelity")


def test_gaps_are_the_largest_difference_at_an_evaluation_and_targets_follow_the_paper():
    fid = load()
    rows = [{"framework": "eager", "mode": "fp32", "evals": [[100, 5.0], [200, 4.0], [300, 3.5]]},
            {"framework": "kiln", "mode": "fp32", "evals": [[100, 5.001], [200, 4.004], [300, 3.502]]},
            {"framework": "eager", "mode": "bf16", "evals": [[100, 5.0], [200, 4.0]]},
            {"framework": "compile", "mode": "bf16", "evals": [[100, 5.01], [200, 4.0]]},
            {"framework": "kiln", "mode": "bf16", "evals": [[100, 5.005], [200, 4.008]]}]
    g = fid.gaps(rows)
    assert g["fp32"]["kiln_vs_eager"] == pytest.approx(0.004) and g["fp32"]["kiln_vs_eager_at_step"] == 200
    assert g["fp32"]["target"] == 3e-3 and g["fp32"]["met"] is False
    assert g["bf16"]["target"] == pytest.approx(0.01) and g["bf16"]["kiln_vs_eager"] == pytest.approx(0.008)
    assert g["bf16"]["met"] is True


def test_the_corpus_is_python_sources_already_on_the_machine():
    files = load().python_sources(site_packages=False)
    assert len(files) > 500 and all(f.suffix == ".py" for f in files)
    assert any(f.name == "json.py" or f.parent.name == "json" for f in files)


def test_a_short_cpu_run_has_kiln_and_pytorch_on_one_curve(tmp_path):
    from kiln.data.corpus import bundled_dataset
    data = bundled_dataset()
    cmd = [sys.executable, str(ROOT / "benchmarks" / "fidelity.py"), "--device", "cpu", "--modes", "fp32",
           "--model", "tiny", "--n-layer", "1", "--n-embd", "64", "--n-head", "2", "--seq-len", "32",
           "--batch-size", "2", "--steps", "6", "--eval-interval", "3", "--eval-iters", "2", "--data", str(data),
           "--compare", "always", "--out", str(tmp_path), "--name", "f"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((tmp_path / "f.json").read_text())
    rows = {r["framework"]: r for r in record["rows"]}
    assert [s for s, _ in rows["kiln"]["evals"]] == [3, 6] == [s for s, _ in rows["eager"]["evals"]]
    assert rows["kiln"]["losses"][0] == pytest.approx(rows["eager"]["losses"][0], rel=1e-6)
    assert record["gaps"]["fp32"]["kiln_vs_eager"] < 1e-5 and record["gaps"]["fp32"]["met"] is True
    assert "no op beyond the fp32 tolerance" in record["compare"]["fp32"]["headline"]
    assert (tmp_path / "f.png").stat().st_size > 0 and (tmp_path / "f-fp32-compare" / "compare.md").is_file()
