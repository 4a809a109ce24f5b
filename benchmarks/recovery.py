"""Recovery under `kiln launch`: per fault class, the time from the fault to training again and the
steps lost (issue 16, paper §4.4).

Each fault is injected (KILN_FAULT) into a `kiln train` run under `kiln launch`; the supervisor's
incidents.jsonl gives, per incident, detect_s (from the rank's last heartbeat to the detection),
recovery_s (from the detection to the first step of the restarted gang, or the in-place fix) and
steps_lost (steps recomputed: the faulted step minus the step resumed from). The final parameters
are checked bit for bit against an unfaulted run (the skipped step excepted for `skip`).

    python benchmarks/recovery.py                          # CPU, tiny model, every fault class
    python benchmarks/recovery.py --device cuda --faults kill,nan --out $OUT   # one GPU
    python benchmarks/recovery.py --faults ddp2-kill-rank-1 --repeat 5 --busy 2  # the rank named, 5 runs, loaded

--repeat runs each fault that many times (the table's figures are the first run's; the rank each run's
incident named is listed: a dead rank's peers die milliseconds after it, so naming the right one is a race
the launcher must not lose); --busy starts that many spinning processes for the faulted runs, a loaded
machine like a 2-core CI.

Writes benchmarks/results/recovery/recovery-<device>-<date>.json and .md (or into --out) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from result_file import commit, src_dirty

ROOT = Path(__file__).resolve().parents[1]
MODEL = {"n_layer": 2, "n_embd": 64, "n_head": 2, "block_size": 64}  # head dim 32: a CUDA attention kernel (16 is not)
# fault -> (KILN_FAULT, extra launch options, ranks: 1, or 2 = `--mpi --nproc 2 -- kiln train --parallel ddp`)
FAULTS = {
    "kill": ("kill@step={k}", [], 1),
    "hang": ("hang@step={k}", ["--hang-timeout-min", "3"], 1),
    "nan": ("nan@step={k}", [], 1),
    "nan-skip": ("nan@step={k}", ["--on-bad-step", "skip"], 1),
    "spike-rollback": ("spike@step={k}", ["--on-bad-step", "rollback", "--spike-min-history", "8"], 1),
    "oom": ("oom@step={k}", [], 1),
    "truncate": ("truncate@step={c}", [], 1),
    "corrupt": ("corrupt@step={c}", [], 1),
    "kill-mid-checkpoint": ("kill_ckpt@step={c}", [], 1),
    "ddp2-kill-rank-1": ("kill@step={k},rank=1", [], 2),
    "ddp2-stalled-collective": ("hang@step={k},rank=1", ["--hang-timeout-min", "60"], 2),
}
DIST_TIMEOUT_S = "5"  # KILN_DIST_TIMEOUT of the DDP runs: a stalled all-reduce fails after this


def train_command(a, ranks: int) -> list[str]:
    sets = [x for k, v in MODEL.items() for x in ("--set", f"{k}={v}")]
    ddp = ["--parallel", "ddp"] if ranks > 1 else []
    return [sys.executable, "-m", "kiln.cli", "train", *ddp, *sets, "--batch-size", str(a.batch_size), "--steps",
            str(a.steps), "--eval-interval", str(a.steps), "--device", a.device, "--no-progress",
            "--checkpoint-interval", str(a.interval)]


def launch(run: Path, a, fault: str | None, options: list[str], ranks: int) -> tuple[float, int]:
    env = {k: v for k, v in os.environ.items() if k != "KILN_FAULT"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env["KILN_DIST_TIMEOUT"] = DIST_TIMEOUT_S
    if fault:
        env["KILN_FAULT"] = fault
    gang = ["--mpi", "--nproc", str(ranks)] if ranks > 1 else []
    cmd = [sys.executable, "-m", "kiln.cli", "launch", "--run-dir", str(run), "--max-restarts", "2", *gang,
           *options, "--", *train_command(a, ranks)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0, proc.returncode


def final_params(run: Path) -> dict:
    from safetensors.numpy import load_file
    return load_file(str(run / "model.safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--interval", type=int, default=8, help="checkpoint interval")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--out", default=None, help="folder for the result file (default benchmarks/results)")
    ap.add_argument("--keep", default=None, help="keep the run folders here (default: a temporary folder)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each fault")
    ap.add_argument("--busy", type=int, default=0, help="spinning processes beside the faulted runs")
    a = ap.parse_args()
    if a.repeat < 1 or a.busy < 0:
        ap.error("--repeat takes at least 1, --busy at least 0")
    folder = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="kiln-recovery-"))
    folder.mkdir(parents=True, exist_ok=True)
    k, c = a.steps // 2 + 2, a.interval * 2  # the faulted step; the checkpoint step for checkpoint faults
    references, walls = {}, {}
    rows = {}
    for name in a.faults.split(","):
        spec, options, ranks = FAULTS[name]
        if ranks not in references:  # the unfaulted run of this gang
            walls[ranks], _ = launch(folder / f"reference-{ranks}", a, None, [], ranks)
            references[ranks] = final_params(folder / f"reference-{ranks}")
        reference, wall_ref = references[ranks], walls[ranks]
        fault = spec.format(k=k, c=c)
        named = []
        for rep in range(a.repeat):
            run = folder / (name if rep == 0 else f"{name}-{rep}")
            busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.busy)]
            try:
                wall, _ = launch(run, a, fault, options, ranks)
            finally:
                for p in busy:
                    p.kill()
                    p.wait()
            incidents = [json.loads(line) for line in (run / "incidents.jsonl").read_text().splitlines()]
            got = final_params(run)
            equal = all(np.array_equal(got[n], reference[n]) for n in reference)
            main_incident = next(i for i in incidents if not i["class"].startswith("checkpoint_"))
            named.append(main_incident["rank"])
            if rep == 0:
                rows[name] = {"fault": fault, "ranks": ranks, "classes": [i["class"] for i in incidents],
                              "action": main_incident["action"], "detect_s": main_incident["detect_s"],
                              "recovery_s": main_incident["recovery_s"],
                              "fault_to_training_s": round((main_incident["detect_s"] or 0) + main_incident["recovery_s"], 3),
                              "steps_lost": main_incident["steps_lost"], "wall_s": round(wall, 2),
                              "extra_wall_s": round(wall - wall_ref, 2), "final_params_equal_unfaulted": equal,
                              "incidents": incidents}
            else:
                rows[name]["final_params_equal_unfaulted"] &= equal
            print(f"{name} run {rep}: {[i['class'] for i in incidents]} rank {main_incident['rank']} "
                  f"({main_incident['evidence'][:120]}), detect {main_incident['detect_s']} s, recover "
                  f"{main_incident['recovery_s']} s, lost {main_incident['steps_lost']} steps, equal {equal}", flush=True)
        rows[name]["ranks_named"] = named
    record = {"benchmark": "recovery", "date": time.strftime("%Y-%m-%d"), "commit": commit(),
              "dirty": src_dirty(),
              "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                          "load_average": os.getloadavg()},
              "model": MODEL, "device": a.device, "steps": a.steps, "checkpoint_interval": a.interval,
              "batch_size": a.batch_size, "dist_timeout_s": float(DIST_TIMEOUT_S),
              "repeat": a.repeat, "busy": a.busy,
              "reference_wall_s": {str(r): round(w, 2) for r, w in walls.items()}, "results": rows}
    lines = [f"{a.steps} steps, checkpoint every {a.interval}, {a.device}, commit {record['commit'][:7]}; "
             "unfaulted runs " + ", ".join(f"{r} rank(s) {w:.1f} s wall" for r, w in walls.items())
             + (f"; each fault {a.repeat} times" if a.repeat > 1 else "")
             + (f", {a.busy} spinning processes beside the faulted runs" if a.busy else ""), "",
             "| fault | ranks | incident classes | rank named (each run) | action | detect (s) | recover (s) "
             "| fault to training (s) | steps lost | extra wall (s) | final params = unfaulted |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['ranks']} | {', '.join(r['classes'])} | {', '.join(map(str, r['ranks_named']))} "
                     f"| {r['action']} | {r['detect_s']} | "
                     f"{r['recovery_s']:.3g} | {r['fault_to_training_s']:.3g} | {r['steps_lost']} | "
                     f"{r['extra_wall_s']} | {'bit for bit' if r['final_params_equal_unfaulted'] else 'no' + (' (skipped step)' if 'skip' in r['action'] else '')} |")
    table = "\n".join(lines) + "\n"
    out_dir = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / "recovery"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"recovery-{a.device.split(':')[0]}-{record['date']}.json"
    out.write_text(json.dumps(record, indent=2))
    out.with_suffix(".md").write_text(table)
    print("\n" + table)
    print(f"wrote {out} and {out.with_suffix('.md').name}")


if __name__ == "__main__":
    main()
