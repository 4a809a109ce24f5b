"""Every GEMM of the GPT-2 124M step: cuBLASLt's heuristic pick against the tuned one (issue 14).

    python benchmarks/gemm_autotune.py [--modes bf16,tf32,fp32] [--iters 30] [--batch-size 16] [--seq-len 1024]

Per mode, one eager step of kiln's GPT-2 124M (as gpt2_step builds it, tuning off) records the key of every
GEMM it runs (shape, layouts, alignments, epilogue, accumulation) and how often; then for each distinct key,
on fresh buffers of that layout, the tuner's own timing (cublaslt._time_candidates, the rounds tuning runs at
a plan's first use) picks its candidate, and the heuristic's pick and the tuned one are timed again, alone
in rounds of --iters launches (median ms). Calls per step x the difference is what tuning saves in a step;
the tuner's wall time per key is what it costs, once, in the first step on a machine without the file.
The GPU kernels of one launch of each (torch.profiler) name what changed (a split-K reduce gone, a tile).
Prints a table and writes benchmarks/results/kernels/gemm_autotune-<date>.json and .md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from collections import Counter
from pathlib import Path

import ml_dtypes
import numpy as np
from result_file import run_fields, write_json

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
          "float16": np.dtype(np.float16)}


def record_step_gemms(mode: str, batch: int, seq_len: int) -> Counter:
    """{plan key: calls} of one eager GPT-2 124M training step in `mode` (tuning off: nothing is timed)."""
    import kiln
    from kiln.backend.cuda import cublaslt
    from kiln.nn import GPT, preset
    from kiln.optim import AdamW, gpt_param_groups
    from kiln.train import apply_precision, plain_step
    os.environ["KILN_GEMM_AUTOTUNE"] = "0"
    dev = kiln.device("cuda")
    model = GPT(preset("gpt2-124m", block_size=max(1024, seq_len)), generator=kiln.Generator(1234))
    model.to(dev)
    apply_precision(model, mode, dev)
    step = plain_step(model, AdamW(gpt_param_groups(model, 0.1), lr=6e-4, betas=(0.9, 0.95), eps=1e-8))
    rng = np.random.default_rng(0)
    x, y = (kiln.tensor(rng.integers(0, 50257, (batch, seq_len)), device=dev) for _ in range(2))
    calls: Counter = Counter()
    real = cublaslt.prepare

    def spy(*args, **kw):
        plan, key, ptrs, operands = real(*args, **kw)
        calls[key] += 1
        return plan, key, ptrs, operands
    cublaslt.prepare = spy
    try:
        step(x, y).item()
    finally:
        cublaslt.prepare = real
    del model, step, x, y
    return calls


def buffers_for(key):
    """Fresh device buffers of normal draws laid out as the GEMM of `key` found its own (leading dimensions,
    batch strides, alignments), and gemm's keywords for them."""
    import kiln
    backend = kiln.backend.get_backend("cuda")
    gen = backend.new_generator(0)
    (_, dtype, _, m, n, k, ta, tb, lda, ldb, ldc, batch, (sa, sb, sc), epilogue, aligns, aux_ld, vec_aligns,
     out_dtype, accumulate) = key
    dt, ot = DTYPES[dtype], DTYPES[out_dtype]

    def matrix(rows, cols, ld, stride, d, align):
        count = (batch - 1) * stride + (rows - 1) * ld + cols
        skip = (align % 256) // d.itemsize  # the recorded pointer's alignment, from a 256-aligned block
        return backend.rng_normal(gen, (count + skip,), d)[skip:]
    a = matrix(*((k, m) if ta else (m, k)), lda, sa, dt, aligns[0])
    b = matrix(*((n, k) if tb else (k, n)), ldb, sb, dt, aligns[1])
    out = matrix(m, n, ldc, sc, ot, aligns[2])
    kw = dict(m=m, n=n, k=k, trans_a=ta, trans_b=tb, lda=lda, ldb=ldb, ldc=ldc, batch=batch, stride_a=sa,
              stride_b=sb, stride_c=sc, epilogue=epilogue, accumulate=accumulate)
    if epilogue != "default":
        kw["bias"] = matrix(1, n, n, 0, dt, vec_aligns[0])
    if epilogue == "gelu_aux_bias":
        kw.update(aux=matrix(m, n, aux_ld, 0, dt, vec_aligns[1]), aux_ld=aux_ld)
    return a, b, out, kw


def kernel_names(plan, algo, ops) -> list | None:
    """The GPU kernels one launch of `algo` runs (CUPTI through torch.profiler, which sees cuBLASLt's kernels
    on kiln's stream): shows a split-K GEMM's reduce kernel, or its absence. None without PyTorch."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return None
    from kiln.backend.cuda import device
    try:
        torch.cuda.init()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            plan.launch_status(algo, ops.a_ptr, ops.b_ptr, ops.c_ptr)
            device.synchronize()
    except RuntimeError as e:  # no CUPTI: the table goes on without names
        return [f"(profiler failed: {e})"]
    return sorted({e.key for e in prof.key_averages() if str(getattr(e, "device_type", "")).endswith("CUDA")})


def compare(key, iters: int) -> dict:
    """The tuner's pick for `key`, its cost, and the heuristic's and the tuned algorithm's median ms."""
    from kiln.backend.cuda import cublaslt, gemm_autotune as tune
    os.environ["KILN_GEMM_AUTOTUNE"] = "1"
    cublaslt._plans.pop(key, None)
    a, b, out, kw = buffers_for(key)
    plan, got, _, operands = cublaslt.prepare(a, b, out, **kw)
    assert got == key, f"the buffers' layout gives another plan: {got} for {key}"
    ops = operands()
    t0 = time.perf_counter()
    tuner_ms = cublaslt._time_candidates(plan, ops)
    cost_s = time.perf_counter() - t0
    pick = tune.choose(tuner_ms)
    # The two alone, more launches, in rounds as the tuner does
    everyone, timed = plan.candidates, tune.TIMED
    plan.candidates, tune.TIMED = [everyone[0], everyone[pick]], iters
    try:
        heuristic_ms, tuned_ms = cublaslt._time_candidates(plan, ops)
    finally:
        plan.candidates, tune.TIMED = everyone, timed
    (_, dtype, _, m, n, k, ta, tb, _, _, _, batch, _, epilogue, _, _, _, out_dtype, accumulate) = key
    names = [kernel_names(plan, everyone[i].algo, ops) for i in (0, pick)]
    return {"heuristic_kernels": names[0], "tuned_kernels": names[1],"dtype": dtype, "out_dtype": out_dtype, "m": m, "n": n, "k": k, "trans_a": ta, "trans_b": tb,
            "batch": batch, "epilogue": epilogue, "accumulate": accumulate, "candidates": len(everyone),
            "tuner_ms": tuner_ms, "pick": pick, "heuristic_ms": heuristic_ms,
            "tuned_ms": heuristic_ms if pick == 0 else tuned_ms, "tuning_cost_s": cost_s,
            "tflops_heuristic": 2 * m * n * k * batch / heuristic_ms / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="bf16,tf32,fp32")
    ap.add_argument("--iters", type=int, default=30, help="launches of each of the two algorithms timed")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--out", help="the JSON path (default benchmarks/results/kernels/gemm_autotune-<date>.json)")
    args = ap.parse_args()
    import kiln
    if not kiln.cuda_is_available():
        sys.exit("needs an NVIDIA GPU with CuPy")
    from kiln.backend.cuda import cublaslt
    rows, lines = [], ["| mode | m | n | k | ta | tb | epilogue | acc | calls/step | cands | heuristic ms | tuned ms "
                       "(pick) | speedup | saved ms/step | tuning s |", "|" + "---|" * 15]
    summary = {}
    for mode in args.modes.split(","):
        calls = record_step_gemms(mode, args.batch_size, args.seq_len)
        cublaslt.set_matmul_precision(mode)
        saved = cost = base = 0.0
        for key, count in sorted(calls.items(), key=lambda kv: -kv[1]):
            r = {"mode": mode, "calls_per_step": count, **compare(key, args.iters)}
            r["saved_ms_per_step"] = count * (r["heuristic_ms"] - r["tuned_ms"])
            rows.append(r)
            saved, cost, base = saved + r["saved_ms_per_step"], cost + r["tuning_cost_s"], \
                base + count * r["heuristic_ms"]
            lines.append(f"| {mode} | {r['m']} | {r['n']} | {r['k']} | {int(r['trans_a'])} | {int(r['trans_b'])} | "
                         f"{r['epilogue']} | {int(r['accumulate'])} | {count} | {r['candidates']} | "
                         f"{r['heuristic_ms']:.4f} | {r['tuned_ms']:.4f} ({r['pick']}) | "
                         f"{r['heuristic_ms'] / r['tuned_ms']:.3f} | {r['saved_ms_per_step']:.3f} | "
                         f"{r['tuning_cost_s']:.3f} |")
            print(lines[-1], flush=True)
        summary[mode] = {"gemm_shapes": len(calls), "gemm_calls_per_step": sum(calls.values()),
                         "heuristic_gemm_ms_per_step": base, "saved_ms_per_step": saved, "tuning_cost_s": cost}
        print(f"{mode}: {len(calls)} GEMM keys, {sum(calls.values())} calls/step, heuristic {base:.2f} ms/step, "
              f"tuning saves {saved:.2f} ms/step ({100 * saved / base:.1f}% of the GEMMs), costs {cost:.2f} s once",
              flush=True)
    date = datetime.date.today()
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / "kernels" / f"gemm_autotune-{date}.json"
    write_json({"benchmark": "gemm_autotune", **run_fields("cuda"), "batch": [args.batch_size, args.seq_len],
                "iters": args.iters, "summary": summary, "rows": rows}, out)
    changed = [f"- {r['mode']} m={r['m']} n={r['n']} k={r['k']} {r['epilogue']}{' accumulate' if r['accumulate'] else ''}"
               f": {' + '.join(r['heuristic_kernels'] or ['?'])} -> {' + '.join(r['tuned_kernels'] or ['?'])}"
               for r in rows if r["pick"] != 0]
    table = "\n".join(lines) + "\n\nKernels where tuning changed the pick:\n" + "\n".join(changed or ["- none"]) + \
        "\n\n" + "\n".join(
        f"- {mode}: {s['gemm_shapes']} GEMM keys, {s['gemm_calls_per_step']} calls a step; heuristic "
        f"{s['heuristic_gemm_ms_per_step']:.2f} ms a step, tuned saves {s['saved_ms_per_step']:.2f} ms; tuning "
        f"costs {s['tuning_cost_s']:.2f} s once" for mode, s in summary.items()) + "\n"
    out.with_suffix(".md").write_text(table)


if __name__ == "__main__":
    main()
