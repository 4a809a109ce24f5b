"""benchmarks/ab.py: each arm runs its own tree (not the checkout's: the pitfall that voided an A/B on
2026-12-06), arms interleaved, and the attention tables merged with medians and ratios."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmark_support import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
WAITING = sorted((ROOT / "benchmarks" / "arms").glob("*.patch"))


def _git(repo, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                   capture_output=True)


@pytest.fixture()
def repo(tmp_path):
    r = tmp_path / "repo"
    (r / "src" / "kiln").mkdir(parents=True)
    (r / "benchmarks" / "results").mkdir(parents=True)
    (r / "benchmarks" / "results" / "big.json").write_text("{}")
    (r / "benchmarks" / "which.py").write_text("import kiln\nprint('version', kiln.VERSION)\n")
    _git(r, "init", "-q")
    for version in (1, 2):
        (r / "src" / "kiln" / "__init__.py").write_text(f"VERSION = {version}\n")
        _git(r, "add", "-A")
        _git(r, "commit", "-q", "-m", f"v{version}")
    (r / "src" / "kiln" / "__init__.py").write_text("VERSION = 3\n")  # the working tree, uncommitted
    return r


def test_every_arm_runs_its_own_tree_interleaved(repo, tmp_path):
    ab = load_benchmark("ab")
    arms = ab.prepare(["HEAD~1", "HEAD", "wt"], repo, tmp_path / "arms")
    assert [a["name"] for a in arms] == ["HEAD_1", "HEAD", "wt"] and arms[2]["commit"].endswith("+wt")
    runs = ab.run(tmp_path / "arms", tmp_path / "work", tmp_path / "logs", [sys.executable, "benchmarks/which.py"],
                  repeat=2, timeout=60)
    assert [(r["arm"], r["run"], r["rc"]) for r in runs] == [
        ("HEAD_1", 1, 0), ("HEAD", 1, 0), ("wt", 1, 0), ("HEAD_1", 2, 0), ("HEAD", 2, 0), ("wt", 2, 0)]
    got = {r["log"]: (tmp_path / "logs" / r["log"]).read_text().strip() for r in runs}
    assert got["HEAD_1-2.log"] == "version 1" and got["HEAD-1.log"] == "version 2" and got["wt-2.log"] == "version 3"
    assert not (tmp_path / "work" / "HEAD" / "benchmarks" / "results").exists()  # results stay home
    assert json.loads((tmp_path / "logs" / "runs.json").read_text())["runs"] == runs


def test_a_patch_arm_is_head_with_the_patch(repo, tmp_path):
    """benchmarks/arms/*.patch: a change kept on main as a patch (a session's branches do not reach the next
    session) runs as HEAD with it applied; the checkout is not touched; a patch that does not apply is refused."""
    ab = load_benchmark("ab")
    patch = tmp_path / "v5.patch"
    patch.write_text("--- a/src/kiln/__init__.py\n+++ b/src/kiln/__init__.py\n@@ -1 +1 @@\n-VERSION = 2\n+VERSION = 5\n")
    arms = ab.prepare(["HEAD", f"{patch},KNOB=1"], repo, tmp_path / "arms")
    blob = subprocess.run(["git", "hash-object", str(patch)], capture_output=True, text=True, check=True).stdout[:7]
    assert [a["name"] for a in arms] == ["HEAD", "v5_KNOB_1"] and arms[1]["commit"].endswith(f"+v5@{blob}")
    assert arms[1]["env"] == {"KNOB": "1"} and not (tmp_path / "arms" / "ab-index").exists()
    runs = ab.run(tmp_path / "arms", tmp_path / "work", tmp_path / "logs", [sys.executable, "benchmarks/which.py"],
                  repeat=1, timeout=60)
    assert [(tmp_path / "logs" / r["log"]).read_text().strip() for r in runs] == ["version 2", "version 5"]
    assert (repo / "src" / "kiln" / "__init__.py").read_text() == "VERSION = 3\n"  # the working tree as it was
    subprocess.run(["git", "diff", "--cached", "--quiet"], cwd=repo, check=True)  # and the index
    patch.write_text(patch.read_text().replace("VERSION = 2", "VERSION = 9"))
    with pytest.raises(SystemExit, match="does not apply to HEAD"):
        ab.prepare([str(patch)], repo, tmp_path / "arms")


def test_runs_json_names_the_finished_runs_after_each(repo, tmp_path, monkeypatch):
    """A call cut off at its limit keeps the table of the runs it finished: runs.json is written after each."""
    ab = load_benchmark("ab")
    ab.prepare(["HEAD~1", "HEAD"], repo, tmp_path / "arms")
    seen = []
    real = ab.subprocess.run

    def run_and_look(cmd, **kw):
        path = tmp_path / "logs" / "runs.json"
        seen.append(len(json.loads(path.read_text())["runs"]) if path.exists() else 0)
        return real(cmd, **kw)
    monkeypatch.setattr(ab.subprocess, "run", run_and_look)
    ab.run(tmp_path / "arms", tmp_path / "work", tmp_path / "logs", [sys.executable, "benchmarks/which.py"],
           repeat=2, timeout=60)
    assert seen[-4:] == [0, 1, 2, 3]


_MEET = """
import os, pathlib, sys, time
import kiln
meet = pathlib.Path(os.environ["MEET"])
(meet / os.environ["KILN_AB_ARM"]).write_text(os.environ["KILN_COMMIT"])
t0 = time.monotonic()
while len(list(meet.iterdir())) < int(os.environ["ARMS"]):  # every arm's check is running at once
    if time.monotonic() - t0 > 30:
        sys.exit("alone")
    time.sleep(0.05)
print("version", kiln.VERSION)
if kiln.VERSION == 2:
    sys.exit(3)
if kiln.VERSION == 3:
    time.sleep(60)
"""


def test_check_runs_every_arm_at_once_in_its_own_tree(repo, tmp_path, monkeypatch):
    """ab.py check: the arms' tests side by side, each in its tree; a failing arm's rc and a hanging arm's
    "timeout" (with what it printed before) are reported, and the exit status says whether all passed."""
    ab = load_benchmark("ab")
    ab.prepare(["HEAD~1", "HEAD", "wt"], repo, tmp_path / "arms")
    (tmp_path / "meet").mkdir()
    monkeypatch.setenv("MEET", str(tmp_path / "meet"))
    monkeypatch.setenv("ARMS", "3")
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)  # check's own setting keeps the killed arm's line
    rc = ab.main(["check", "--arms", str(tmp_path / "arms"), "--work", str(tmp_path / "work"), "--logs",
                  str(tmp_path / "logs"), "--timeout", "20", "--", sys.executable, "-c", _MEET])
    checks = json.loads((tmp_path / "logs" / "checks.json").read_text())["checks"]
    assert [(c["arm"], c["rc"], c["last"]) for c in checks] == [
        ("HEAD_1", 0, "version 1"), ("HEAD", 3, "version 2"), ("wt", "timeout", "version 3")]
    assert rc == 1 and max(checks[0]["seconds"], checks[1]["seconds"]) < 20 <= checks[2]["seconds"] < 40
    assert (tmp_path / "meet" / "wt").read_text().endswith("+wt")


def _logs(folder, figures, log_text):
    """runs.json of arms base (aaa) and new (bbb), and a log a run: figures {arm: (run 1's, run 2's)}."""
    arms = [{"name": "base", "commit": "aaa"}, {"name": "new", "commit": "bbb"}]
    runs = []
    for arm, values in figures.items():
        for i, v in enumerate(values, 1):
            (folder / f"{arm}-{i}.log").write_text(log_text(v))
            runs.append({"arm": arm, "run": i, "log": f"{arm}-{i}.log"})
    (folder / "runs.json").write_text(json.dumps({"arms": arms, "runs": runs}))


def test_the_table_has_every_run_the_medians_and_the_ratios(tmp_path):
    ab = load_benchmark("ab")
    _logs(tmp_path, {"base": (1.0, 1.2), "new": (0.5, 0.7)}, lambda v: (
        "B x H x T x D      op       dtype     fwd          bwd      kiln ms   sdpa ms ...\n"
        f"2x12x16384x64      fwd      bfloat16  tma-pingpong -          {v:.3f}     1.926    321.4    428.1   0.75x\n"))
    lines = ab.table(tmp_path).splitlines()
    assert lines[0] == "kiln ms; base = aaa, new = bbb"
    row = lines[2].split()
    assert row[:3] == ["2x12x16384x64", "fwd", "tma-pingpong"]
    assert row[3:] == ["1.000", "1.200", "0.500", "0.700", "1.100", "0.600", "0.545"]


def test_an_arm_may_carry_settings_for_its_runs(repo, tmp_path):
    """REV,VAR=VALUE: two arms of one tree, a knob set in one (the DGELU_BGRAD A/B of 2026-12-07 ran its knob
    outside the interleaving for want of this)."""
    ab = load_benchmark("ab")
    (repo / "benchmarks" / "knob.py").write_text("import os\nprint('knob', os.environ.get('KILN_KNOB', 'unset'))\n")
    arms = ab.prepare(["wt", "wt,KILN_KNOB=0,KILN_OTHER=a=b"], repo, tmp_path / "arms")
    assert [a["name"] for a in arms] == ["wt", "wt_KILN_KNOB_0_KILN_OTHER_a_b"]
    assert arms[0]["env"] == {} and arms[1]["env"] == {"KILN_KNOB": "0", "KILN_OTHER": "a=b"}
    runs = ab.run(tmp_path / "arms", tmp_path / "work", tmp_path / "logs", [sys.executable, "benchmarks/knob.py"],
                  repeat=1, timeout=60)
    assert [(tmp_path / "logs" / r["log"]).read_text().strip() for r in runs] == ["knob unset", "knob 0"]
    with pytest.raises(SystemExit, match="VAR=VALUE"):
        ab.prepare(["HEAD,KILN_KNOB"], repo, tmp_path / "bad")


def test_the_table_reads_gpt2_step_tokens_per_second(tmp_path):
    ab = load_benchmark("ab")
    _logs(tmp_path, {"base": (476556, 476742), "new": (482975, 484519)}, lambda v: (
        f"kiln     bf16      {v} tok/s    7.36 GiB loss 10.817 -> 3.085 (44 s)\n"
        "         GEMM tuning: {'plans_tuned': 0}\n| kiln | bf16 | 1 | nan |\n"))
    lines = ab.table(tmp_path).splitlines()
    assert lines[0] == "tokens/s; base = aaa, new = bbb"
    assert lines[2].split() == ["kiln", "bf16", "476556", "476742", "482975", "484519", "476649", "483747", "1.015"]


@pytest.mark.parametrize("patch", WAITING, ids=[p.stem for p in WAITING])
def test_every_patch_waiting_for_a_device_applies_here_and_is_listed(patch):
    """benchmarks/arms/: each patch still applies to this tree (a change to the code under it rebases it, `git
    apply -3`, so the next device call can run it) and its README names it (as a link)."""
    r = subprocess.run(["git", "apply", "--check", str(patch)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, f"{patch.name} no longer applies: rebase it or drop it with its row\n{r.stderr}"
    assert f"({patch.name})" in (ROOT / "benchmarks" / "arms" / "README.md").read_text()
