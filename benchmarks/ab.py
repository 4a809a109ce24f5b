"""A/B of source trees in one device call: each arm is a commit's (or the working tree's) code, run from
a folder of its own, the arms interleaved, and `benchmarks/attention.py`'s tables merged into one.

    here, in the checkout:  python benchmarks/ab.py prepare 53bfcb3 HEAD wt      (-> ab-arms/, git-ignored)
                            python benchmarks/ab.py prepare HEAD HEAD,KILN_DGELU=0   (an arm with a setting)
                            python benchmarks/ab.py prepare HEAD benchmarks/arms/NAME.patch   (HEAD with a patch)
    on the device:          python3 benchmarks/ab.py check --logs $OUT/ab-tests -- \\
                                python3 -m pytest -q -m cuda tests/test_op_attention.py   (all arms at once)
                            python3 benchmarks/ab.py run --repeat 2 --logs $OUT/ab -- \\
                                python3 benchmarks/attention.py --bwd split
                            python3 benchmarks/ab.py table $OUT/ab

(pass `carry: ["ab-arms"]` to the device call). A rev may carry environment settings after commas
(`REV,VAR=VALUE,...`), set for its runs: two arms of one tree, a knob on and off. A rev that is a `.patch` file
is HEAD with the patch applied, its commit HEAD+NAME@BLOB (BLOB: the patch file's git hash, so a log names the
patch's version); benchmarks/arms/ keeps changes waiting for a device call on main, because a session's branches
do not reach the next session's checkout. `table` merges
benchmarks/attention.py's kiln ms and benchmarks/gpt2_step.py's tokens/s. An arm holds src/, benchmarks/ (without results/),
tests/ and pyproject.toml; the command runs with the arm's folder as its working directory and the
arm's src/ as PYTHONPATH. A folder per arm, not PYTHONPATH alone, because the benchmarks put their
own ROOT/src first on sys.path (kernel_speed.py): an A/B that only switched PYTHONPATH ran one tree
in every arm (2026-12-06). Kernels compile into the shared cache under a hash of their source, so
arms never share a stale cubin.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATHS = ("src", "benchmarks", "tests", "pyproject.toml")
EXCLUDE = "benchmarks/results"
OPS = ("fwd", "bwd", "fwd+bwd")


def _git(*args, cwd: Path, env: dict | None = None) -> bytes:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          env=None if env is None else dict(os.environ, **env)).stdout


def _patched_tree(patch: Path, repo: Path, scratch: Path) -> str:
    """The tree of HEAD with the patch applied (through an index of its own: the checkout is not touched)."""
    index = scratch / "ab-index"
    env = {"GIT_INDEX_FILE": str(index)}
    try:
        _git("read-tree", "HEAD", cwd=repo, env=env)
        try:
            _git("apply", "--cached", str(patch.resolve()), cwd=repo, env=env)
        except subprocess.CalledProcessError as e:
            raise SystemExit(f"ab.py prepare: {patch} does not apply to HEAD:\n{e.stderr.decode()}") from None
        return _git("write-tree", cwd=repo, env=env).decode().strip()
    finally:
        index.unlink(missing_ok=True)


def prepare(revs: list[str], repo: Path, out: Path) -> list[dict]:
    """ab-arms/<i>-<name>.tgz for each rev (`wt`: the working tree's tracked and untracked, not ignored,
    files) and manifest.json naming them in order."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.tgz"):
        old.unlink()
    arms = []
    for i, spec in enumerate(revs):
        rev, *settings = spec.split(",")
        env = {}
        for kv in settings:
            var, eq, value = kv.partition("=")
            if not eq or not var:
                raise SystemExit(f"ab.py prepare: {spec!r}: settings after the rev are VAR=VALUE, comma-separated")
            env[var] = value
        patch = Path(rev) if rev.endswith(".patch") else None
        label = ",".join([patch.stem, *settings]) if patch else spec
        name = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in label)
        if rev == "wt":
            sha = _git("rev-parse", "--short", "HEAD", cwd=repo).decode().strip() + "+wt"
            files = _git("ls-files", "-co", "--exclude-standard", "--", *PATHS, f":(exclude){EXCLUDE}", cwd=repo)
            with tarfile.open(out / f"{i}-{name}.tgz", "w:gz") as tar:
                for f in files.decode().splitlines():
                    if (repo / f).is_file():
                        tar.add(repo / f, arcname=f)
        else:
            if patch:
                head = _git("rev-parse", "--short", "HEAD", cwd=repo).decode().strip()
                blob = _git("hash-object", str(patch.resolve()), cwd=repo).decode().strip()[:7]
                rev, sha = _patched_tree(patch, repo, out), f"{head}+{patch.stem}@{blob}"
            else:
                sha = _git("rev-parse", "--short", rev, cwd=repo).decode().strip()
            top = set(_git("ls-tree", "--name-only", rev, cwd=repo).decode().splitlines())
            data = _git("archive", "--format=tar", rev, "--", *[p for p in PATHS if p in top], f":(exclude){EXCLUDE}",
                        cwd=repo)
            with tarfile.open(out / f"{i}-{name}.tgz", "w:gz") as tar, tarfile.open(fileobj=io.BytesIO(data)) as src:
                for member in src.getmembers():
                    tar.addfile(member, src.extractfile(member) if member.isfile() else None)
        arms.append({"name": name, "rev": spec.split(",")[0], "commit": sha, "file": f"{i}-{name}.tgz", "env": env})
    (out / "manifest.json").write_text(json.dumps(arms, indent=1) + "\n")
    return arms


def extract(arms_dir: Path, work: Path) -> list[dict]:
    """Every arm's folder (work/<name>) made from its archive; the manifest's arms, in order."""
    arms = json.loads((arms_dir / "manifest.json").read_text())
    for arm in arms:
        d = work / arm["name"]
        d.mkdir(parents=True, exist_ok=True)
        with tarfile.open(arms_dir / arm["file"]) as tar:
            tar.extractall(d, filter="data")
    return arms


def _arm_env(arm: dict, d: Path) -> dict:
    """The arm's settings, its src/ first, its name and commit; output unbuffered, so the log of a run killed at
    its timeout ends where the run stopped."""
    return dict(os.environ, **arm.get("env", {}), PYTHONPATH=str(d / "src"), KILN_AB_ARM=arm["name"],
                KILN_COMMIT=arm["commit"], PYTHONUNBUFFERED="1")


def run(arms_dir: Path, work: Path, logs: Path, cmd: list[str], repeat: int, timeout: float) -> list[dict]:
    """Every arm's folder made from its archive, then the command run in each, arm after arm, `repeat` times."""
    if not cmd:
        raise SystemExit("ab.py run: no command after --")
    arms = extract(arms_dir, work)
    logs.mkdir(parents=True, exist_ok=True)
    runs = []
    for i in range(1, repeat + 1):
        for arm in arms:
            d = work / arm["name"]
            log = logs / f"{arm['name']}-{i}.log"
            t0 = time.monotonic()
            with open(log, "w") as f:
                try:
                    rc = subprocess.run(cmd, cwd=d, env=_arm_env(arm, d), stdout=f, stderr=subprocess.STDOUT,
                                        timeout=timeout).returncode
                except subprocess.TimeoutExpired:
                    rc = "timeout"
            runs.append({"arm": arm["name"], "commit": arm["commit"], "run": i, "rc": rc,
                         "seconds": round(time.monotonic() - t0, 1), "log": log.name})
            print(f"{arm['name']} ({arm['commit']}) run {i}: rc {rc} in {runs[-1]['seconds']} s", flush=True)
            # after every run: a device call cut off at its limit still has the table of the runs it finished
            (logs / "runs.json").write_text(json.dumps({"command": cmd, "arms": arms, "runs": runs}, indent=1) + "\n")
    return runs


def check(arms_dir: Path, work: Path, logs: Path, cmd: list[str], timeout: float) -> list[dict]:
    """The command (an arm's tests, before it is timed) in every arm's folder at once, not timed: one log an arm
    (<name>-check.log) and {arm, commit, rc, seconds (when it ended, from the start), last line} each, in the
    manifest's order. A run still going `timeout` seconds after the start is killed (rc "timeout": a kernel
    that hangs)."""
    if not cmd:
        raise SystemExit("ab.py check: no command after --")
    arms = extract(arms_dir, work)
    logs.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    procs = {}
    for arm in arms:
        d = work / arm["name"]
        f = open(logs / f"{arm['name']}-check.log", "w")
        procs[arm["name"]] = (f, subprocess.Popen(cmd, cwd=d, env=_arm_env(arm, d), stdout=f, stderr=subprocess.STDOUT))
    ended = {}  # arm -> (rc, seconds), as each ends
    while len(ended) < len(procs):
        late = time.monotonic() - t0 > timeout
        for name, (f, proc) in procs.items():
            if name in ended:
                continue
            rc = proc.poll()
            if rc is None and late:
                proc.kill()
                proc.wait()
                rc = "timeout"
            if rc is not None:
                f.close()
                ended[name] = (rc, round(time.monotonic() - t0, 1))
        time.sleep(0.1)
    checks = []
    for arm in arms:
        rc, seconds = ended[arm["name"]]
        lines = (logs / f"{arm['name']}-check.log").read_text(errors="replace").strip().splitlines()
        checks.append({"arm": arm["name"], "commit": arm["commit"], "rc": rc, "seconds": seconds,
                       "last": lines[-1] if lines else ""})
        print(f"{arm['name']} ({arm['commit']}) check: rc {rc} in {seconds} s: {checks[-1]['last']}", flush=True)
    (logs / "checks.json").write_text(json.dumps({"command": cmd, "checks": checks}, indent=1) + "\n")
    return checks


def attention_rows(text: str) -> dict[tuple, float]:
    """kiln's ms per (shape, op, fwd kernel, bwd kernel) from a benchmarks/attention.py log."""
    rows = {}
    for line in text.splitlines():
        p = line.split()
        if len(p) >= 10 and p[1] in OPS and p[0].count("x") == 3:
            try:
                rows[(p[0], p[1], p[3], p[4])] = float(p[5])
            except ValueError:
                continue
    return rows


def gpt2_step_rows(text: str) -> dict[tuple, float]:
    """tokens/s per (framework, mode) from a benchmarks/gpt2_step.py log."""
    rows = {}
    for line in text.splitlines():
        p = line.split()
        if len(p) >= 4 and p[3] == "tok/s":
            try:
                rows[(p[0], p[1])] = float(p[2])
            except ValueError:
                continue
    return rows


def table(logs: Path) -> str:
    """Each case's figure in every run, each arm's median, and the median's ratio to the first arm's: kiln ms of
    benchmarks/attention.py logs, or tokens/s of benchmarks/gpt2_step.py logs."""
    meta = json.loads((logs / "runs.json").read_text())
    names = [a["name"] for a in meta["arms"]]
    texts = [(r["arm"], r["run"], (logs / r["log"]).read_text(errors="replace")) for r in meta["runs"]]
    parsed = [(unit, [(a, i, parse(text)) for a, i, text in texts])
              for unit, parse in (("kiln ms", attention_rows), ("tokens/s", gpt2_step_rows))]
    found = [(unit, runs) for unit, runs in parsed if any(rows for _, _, rows in runs)]
    if not found:
        return "no benchmarks/attention.py or benchmarks/gpt2_step.py rows in these logs\n"
    unit, runs = found[0]
    cases = list(dict.fromkeys(k for _, _, rows in runs for k in rows))
    cols = [f"{a}-{i}" for a, i, _ in runs]
    out = [f"{unit}; " + ", ".join(f"{a['name']} = {a['commit']}" for a in meta["arms"]),
           " ".join(["case".ljust(44)] + [c.rjust(9) for c in cols] + [f"med {n}".rjust(9) for n in names]
                    + [f"{n}/{names[0]}".rjust(9) for n in names[1:]])]
    for case in cases:
        vals = [rows.get(case) for _, _, rows in runs]
        med = {n: statistics.median([v for (a, _, _), v in zip(runs, vals) if a == n and v is not None] or [float("nan")])
               for n in names}
        fmt = "{:.3f}" if unit == "kiln ms" else "{:.0f}"
        cells = [("-" if v is None else fmt.format(v)).rjust(9) for v in vals]
        cells += [fmt.format(med[n]).rjust(9) for n in names]
        cells += [f"{med[n] / med[names[0]]:.3f}".rjust(9) for n in names[1:]]
        out.append(" ".join([" ".join(c for c in case if c != "-").ljust(44)] + cells))
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("prepare", help="archive each rev's code (wt: the working tree; REV,VAR=VALUE: with a setting) "
                                       "into --arms")
    p.add_argument("revs", nargs="+")
    p.add_argument("--arms", type=Path, default=ROOT / "ab-arms")
    r = sub.add_parser("run", help="run the command after -- in every arm, interleaved")
    r.add_argument("--arms", type=Path, default=ROOT / "ab-arms")
    r.add_argument("--work", type=Path, default=Path("/tmp/kiln-ab"))
    r.add_argument("--logs", type=Path, required=True)
    r.add_argument("--repeat", type=int, default=2)
    r.add_argument("--timeout", type=float, default=300, help="seconds one run may take")
    r.add_argument("cmd", nargs=argparse.REMAINDER)
    c = sub.add_parser("check", help="run the command after -- in every arm at once (its tests before timing it)")
    c.add_argument("--arms", type=Path, default=ROOT / "ab-arms")
    c.add_argument("--work", type=Path, default=Path("/tmp/kiln-ab"))
    c.add_argument("--logs", type=Path, required=True)
    c.add_argument("--timeout", type=float, default=300, help="seconds the checks may take together")
    c.add_argument("cmd", nargs=argparse.REMAINDER)
    t = sub.add_parser("table", help="merge the runs' benchmarks/attention.py or gpt2_step.py figures")
    t.add_argument("logs", type=Path)
    args = ap.parse_args(argv)
    if args.what == "prepare":
        for arm in prepare(args.revs, ROOT, args.arms):
            print(f"{arm['file']}: {arm['rev']} = {arm['commit']}")
    elif args.what in ("run", "check"):
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        if args.what == "run":
            done = run(args.arms, args.work, args.logs, cmd, args.repeat, args.timeout)
        else:
            done = check(args.arms, args.work, args.logs, cmd, args.timeout)
        return 0 if all(r["rc"] == 0 for r in done) else 1
    else:
        sys.stdout.write(table(args.logs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
