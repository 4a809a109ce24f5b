"""kiln's CUDA kernels against PyTorch on the same GPU, in one process, at the paper's shapes.

    python benchmarks/kernel_speed.py [--iters 50] [--only gelu,layer_norm,...]

Per kernel family and dtype: median milliseconds of kiln and of PyTorch, and the GB/s of the
bytes that must move (memory-bound kernels) or TFLOP/s (attention). Prints a table and writes
benchmarks/results/kernels/kernels-<date>.json with the commit, the device, the command and every figure.
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
from result_file import run_fields, write_json

BF16 = np.dtype(ml_dtypes.bfloat16)
ROOT = Path(__file__).resolve().parents[1]


def kiln_and_torch():
    """kiln's CUDA backend and torch, both seeing the GPU; (None, None) with the reason printed when not."""
    sys.path.insert(0, str(ROOT / "src"))
    import torch

    import kiln
    if not kiln.cuda_is_available() or not torch.cuda.is_available():
        print("needs a GPU visible to both CuPy and PyTorch", file=sys.stderr)
        return None, None
    return kiln.backend.get_backend("cuda"), torch


def write_rows(benchmark: str, torch, args, rows: list) -> Path:
    """The result file of a kernel benchmark: its rows with where they come from, at --out or at
    benchmarks/results/<benchmark>/<benchmark>-<date>.json; returns its path."""
    record = {"benchmark": benchmark, **run_fields("cuda"), "torch": torch.__version__, "iters": args.iters,
              "rows": rows}
    return write_json(record, Path(args.out) if args.out else
                      ROOT / "benchmarks" / "results" / benchmark / f"{benchmark}-{datetime.date.today()}.json")


def _event_ms(run, iters: int, stream_kind: str) -> list:
    """Milliseconds of each of `iters` calls of run(), between two events on the stream its work goes to
    (kiln's, or torch's current one)."""
    times = []
    if stream_kind == "kiln":
        import cupy

        from kiln.backend.cuda import device
        s = device.stream()
        for _ in range(iters):
            a, b = cupy.cuda.Event(), cupy.cuda.Event()
            a.record(s)
            run()
            b.record(s)
            b.synchronize()
            times.append(cupy.cuda.get_elapsed_time(a, b))
    else:
        import torch
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
    return times


def graph_ms(fn, iters: int, stream_kind: str, reps: int = 10, warmup: int = 3) -> float:
    """GPU milliseconds of one call: `reps` calls recorded as one CUDA graph (kiln's capture, or
    torch.cuda.graph), the graph replayed `iters` times between events, the median replay / reps.
    Neither side's host launch cost counts (a training step replays its graph the same way); timed
    call by call instead, a kernel of 0.1 ms reads as the Python that launches it (0.25 ms for kiln)."""
    def calls():
        for _ in range(reps):
            fn()  # its outputs freed at once: the next call reuses them, as a step's layers do

    if stream_kind == "kiln":
        from kiln.backend.cuda import graph
        for _ in range(warmup):
            fn()
        g = graph.capture(calls)
        times = _event_ms(g.launch, iters, stream_kind)
        g.release()
    else:
        import torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # torch's rule: warm up on a side stream before capturing
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            calls()
        times = _event_ms(g.replay, iters, stream_kind)
        del g
    return float(np.median(times)) / reps


def median_ms(fn, iters: int, stream_kind: str, warmup: int = 3) -> float:
    """Median over `iters` of one call, timed with events on the stream the work runs on."""
    for _ in range(warmup):
        fn()
    return float(np.median(_event_ms(fn, iters, stream_kind)))


def _torch_dtype(dtype):
    import torch
    return torch.bfloat16 if np.dtype(dtype) == BF16 else torch.float32


def bench_gelu(k, iters):
    import torch
    import torch.nn.functional as F
    out = []
    shape = (16, 1024, 3072)
    n = math.prod(shape)
    for dtype in (np.float32, BF16):
        x = k.rng_normal(k.new_generator(0), shape, dtype)
        g = k.rng_normal(k.new_generator(1), shape, dtype)
        tx = torch.randn(shape, device="cuda", dtype=_torch_dtype(dtype))
        tg = torch.randn_like(tx)
        item = np.dtype(dtype).itemsize
        for name, kfn, tfn, nbytes in (
                ("fwd", lambda: k.gelu_fwd(x), lambda: F.gelu(tx, approximate="tanh"), 2 * n * item),
                ("bwd", lambda: k.gelu_bwd(g, x),
                 lambda: torch.ops.aten.gelu_backward(tg, tx, approximate="tanh"), 3 * n * item)):
            out.append(_row("gelu", name, dtype, shape, kfn, tfn, iters, nbytes=nbytes))
    return out


def bench_layer_norm(k, iters):
    import torch
    import torch.nn.functional as F
    out = []
    n, c = 16384, 768
    for dtype in (np.float32, BF16):
        gen = k.new_generator(0)
        x, g = k.rng_normal(gen, (n, c), dtype), k.rng_normal(gen, (n, c), dtype)
        w, b = k.rng_normal(gen, (c,), dtype), k.rng_normal(gen, (c,), dtype)
        _, mean, rstd = k.layer_norm_fwd(x, w, b, 1e-5)
        td = _torch_dtype(dtype)
        tx, tg = torch.randn(n, c, device="cuda", dtype=td), torch.randn(n, c, device="cuda", dtype=td)
        tw, tb = torch.randn(c, device="cuda", dtype=td), torch.randn(c, device="cuda", dtype=td)
        _, tmean, trstd = torch.ops.aten.native_layer_norm(tx, [c], tw, tb, 1e-5)
        item = np.dtype(dtype).itemsize
        out.append(_row("layer_norm", "fwd", dtype, (n, c), lambda: k.layer_norm_fwd(x, w, b, 1e-5),
                        lambda: F.layer_norm(tx, [c], tw, tb, 1e-5), iters, nbytes=2 * n * c * item))
        out.append(_row("layer_norm", "bwd", dtype, (n, c),
                        lambda: k.layer_norm_bwd(g, x, w, mean, rstd, True, True),
                        lambda: torch.ops.aten.native_layer_norm_backward(tg, tx, [c], tmean, trstd, tw, tb,
                                                                          [True, True, True]),
                        iters, nbytes=3 * n * c * item))
        # the residual add fused with the LayerNorm after it, against torch's add then layer_norm
        y, ds = k.rng_normal(gen, (n, c), dtype), k.rng_normal(gen, (n, c), dtype)
        s, _, smean, srstd = k.add_layer_norm_fwd(x, y, w, b, 1e-5)
        ty, tds = torch.randn_like(tx), torch.randn_like(tx)
        out.append(_row("layer_norm", "add+fwd", dtype, (n, c), lambda: k.add_layer_norm_fwd(x, y, w, b, 1e-5),
                        lambda: F.layer_norm(tx + ty, [c], tw, tb, 1e-5), iters, nbytes=4 * n * c * item))
        out.append(_row("layer_norm", "bwd+ds", dtype, (n, c),
                        lambda: k.add_layer_norm_bwd(ds, g, s, w, smean, srstd, True, True),
                        lambda: torch.ops.aten.native_layer_norm_backward(tg, tx, [c], tmean, trstd, tw, tb,
                                                                          [True, True, True])[0] + tds,
                        iters, nbytes=4 * n * c * item))
    return out


def bench_cross_entropy(k, iters):
    import torch
    import torch.nn.functional as F
    out = []
    n, v = 16384, 50304
    for dtype in (np.float32, BF16):
        gen = k.new_generator(0)
        logits = k.rng_normal(gen, (n, v), dtype)
        targets = k.asarray(np.random.default_rng(0).integers(0, v, n))
        tl = torch.randn(n, v, device="cuda", dtype=_torch_dtype(dtype), requires_grad=True)
        tt = torch.randint(0, v, (n,), device="cuda")
        item = np.dtype(dtype).itemsize

        def kiln_fwd_bwd():
            loss, lse = k.cross_entropy_fwd(logits, targets, -100)
            return k.cross_entropy_bwd(loss, logits, targets, lse, -100)

        def torch_fwd_bwd():
            tl.grad = None
            F.cross_entropy(tl.float() if dtype == BF16 else tl, tt).backward()

        out.append(_row("cross_entropy", "fwd", dtype, (n, v), lambda: k.cross_entropy_fwd(logits, targets, -100),
                        lambda: F.cross_entropy(tl.detach().float() if dtype == BF16 else tl.detach(), tt),
                        iters, nbytes=n * v * item))
        out.append(_row("cross_entropy", "fwd+bwd", dtype, (n, v), kiln_fwd_bwd, torch_fwd_bwd, iters,
                        nbytes=3 * n * v * item))
    return out


def bench_lm_head(k, iters):
    """GPT-2 124M's LM head and loss at B16 T1024 in bf16: kiln's fused chunks against kiln's and
    PyTorch's unfused linear + cross_entropy (forward and backward); and the fused kernel alone on
    one 4096-row chunk (loss and in-place dlogits) against PyTorch's cross_entropy fwd+bwd on it."""
    import torch
    import torch.nn.functional as F

    from kiln.backend.cuda.cross_entropy import kept_row_bytes
    from kiln.backend.cuda.launch import get_kernel, i32, i64
    out = []
    n, c, v = 16384, 768, 50304
    gen = k.new_generator(0)
    x, w = k.rng_normal(gen, (n, c), BF16), k.rng_normal(gen, (v, c), BF16)
    targets = k.asarray(np.random.default_rng(0).integers(0, v, n))
    one = k.asarray(np.float32(1.0))
    tx = torch.randn(n, c, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    tw = torch.randn(v, c, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    tt = torch.randint(0, v, (n,), device="cuda")

    def torch_unfused():
        tx.grad = tw.grad = None
        F.cross_entropy(F.linear(tx, tw).float(), tt).backward()

    def kiln_fused():
        loss, dx, dw = k.lm_head_xent_fwd(x, w, targets, -100)
        return k.lm_head_xent_bwd(one, dx, dw, w.dtype)

    def kiln_unfused():
        logits = k.linear_fwd(x, w, None)
        loss, lse = k.cross_entropy_fwd(logits, targets, -100)
        dlogits = k.cross_entropy_bwd(one, logits, targets, lse, -100)
        return k.linear_bwd(dlogits, x, w, True, True, False)

    flops = 3 * 2 * n * c * v
    out.append(_row("lm_head", "fused chunks fwd+bwd", BF16, (n, c, v), kiln_fused, torch_unfused, iters, flops=flops))
    out.append(_row("lm_head", "unfused fwd+bwd", BF16, (n, c, v), kiln_unfused, torch_unfused, iters, flops=flops))
    rows = 4096
    logits = k.rng_normal(gen, (rows, v), BF16)
    tl = torch.randn(rows, v, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    tt4 = tt[:rows]
    losses = k.empty((2 * rows,), np.float32)
    kern = get_kernel("cross_entropy.cu", "cross_entropy_fused<__nv_bfloat16, long long>")

    kept = kept_row_bytes(v, 2)

    def kiln_chunk(shared_mem):
        return lambda: kern((rows,), (512,), (logits, targets[:rows], losses, losses[rows:], one, i32(v), i64(-100)),
                            shared_mem=shared_mem)

    def torch_chunk():
        tl.grad = None
        F.cross_entropy(tl.float(), tt4).backward()

    # bytes that must move: the logits read and dlogits written (the row kept in shared memory between
    # the kernel's two passes, as lm_head.py launches it where it fits); and reading the row twice
    out.append(_row("lm_head", "fused chunk, row kept" if kept else "fused chunk (no room to keep the row)", BF16, (rows, v), kiln_chunk(kept),
                    torch_chunk, iters, nbytes=2 * rows * v * 2))
    out.append(_row("lm_head", "fused chunk, row read twice", BF16, (rows, v), kiln_chunk(0), torch_chunk, iters,
                    nbytes=3 * rows * v * 2))
    return out


def gpt2_param_shapes():
    shapes = [(50304, 768), (1024, 768)]
    for _ in range(12):
        shapes += [(768,), (768,), (2304, 768), (2304,), (768, 768), (768,), (768,), (768,),
                   (3072, 768), (3072,), (768, 3072), (768,)]
    return shapes + [(768,), (768,)]


def _gpt2_optimizer_state(k):
    import torch
    shapes = gpt2_param_shapes()
    gen = k.new_generator(0)
    ps = [k.rng_normal(gen, s, np.float32) for s in shapes]
    gs = [k.rng_normal(gen, s, np.float32) for s in shapes]
    ms = [k.zeros(s, np.float32) for s in shapes]
    vs = [k.zeros(s, np.float32) for s in shapes]
    wds = [0.1 if len(s) == 2 else 0.0 for s in shapes]
    tps = [torch.randn(s, device="cuda", requires_grad=True) for s in shapes]
    for t in tps:
        t.grad = torch.randn_like(t)
    return shapes, sum(math.prod(s) for s in shapes), ps, gs, ms, vs, wds, tps


def bench_adamw(k, iters):
    """AdamW over GPT-2 124M's 148 fp32 tensors; with the clip: kiln's norm + fused step vs
    torch's clip_grad_norm_ (norm + scale) + fused step. "tables rebuilt" drops kiln's table
    cache before every call, as a training step whose gradient buffers moved does."""
    import torch

    from kiln.backend.cuda import adamw as cuda_adamw
    shapes, nparams, ps, gs, ms, vs, wds, tps = _gpt2_optimizer_state(k)
    opt = torch.optim.AdamW(tps, lr=1e-4, weight_decay=0.1, fused=True)
    step = [0]

    def kiln_step():
        step[0] += 1
        k.adamw_step(ps, gs, ms, vs, wds, 1e-4, 0.9, 0.95, 1e-8, step[0])

    def kiln_step_rebuilt():
        cuda_adamw._tables.clear()
        kiln_step()

    def kiln_clip_step():
        step[0] += 1
        norm = k.grad_norm(gs)
        k.adamw_step(ps, gs, ms, vs, wds, 1e-4, 0.9, 0.95, 1e-8, step[0], clip_norm=norm, max_norm=1.0)

    def torch_clip_step():
        torch.nn.utils.clip_grad_norm_(tps, 1.0)
        opt.step()

    return [_row("adamw", "step", np.float32, (nparams,), kiln_step, opt.step, iters, nbytes=7 * 4 * nparams),
            _row("adamw", "step, tables rebuilt", np.float32, (nparams,), kiln_step_rebuilt, opt.step, iters,
                 nbytes=7 * 4 * nparams),
            _row("adamw", "clip+step", np.float32, (nparams,), kiln_clip_step, torch_clip_step, iters,
                 nbytes=8 * 4 * nparams)]


def bench_grad_norm(k, iters):
    import torch
    shapes, nparams, ps, gs, ms, vs, wds, tps = _gpt2_optimizer_state(k)
    tgrads = [t.grad for t in tps]
    f = k.asarray(np.asarray(1.0, dtype=np.float32))
    tf = torch.ones((), device="cuda")
    norm_fn = (torch.nn.utils.get_total_norm if hasattr(torch.nn.utils, "get_total_norm") else
               lambda gs_: torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in gs_])))
    return [_row("grad_norm", "norm", np.float32, (nparams,), lambda: k.grad_norm(gs), lambda: norm_fn(tgrads),
                 iters, nbytes=4 * nparams),
            _row("grad_norm", "scale_", np.float32, (nparams,), lambda: k.scale_(gs, f),
                 lambda: torch._foreach_mul_(tgrads, tf), iters, nbytes=8 * nparams)]


def bench_embedding(k, iters):
    """wte [50304, 768] backward from 16x1024 ids (uniform and Zipf-skewed like real text) and
    wpe [1024, 768] from 1024 positions; bytes = grad read + dweight written."""
    import torch
    out = []
    b, t, c = 16, 1024, 768
    rng = np.random.default_rng(0)
    cases = (("wte uniform", 50304, rng.integers(0, 50304, b * t)),
             ("wte zipf", 50304, np.minimum(rng.zipf(1.2, b * t) - 1, 50303)),
             ("wpe", 1024, np.arange(t)))
    for dtype in (np.float32, BF16):
        for name, v, idx in cases:
            n = idx.size
            g = k.rng_normal(k.new_generator(0), (n, c), dtype)
            di = k.asarray(idx.astype(np.int64))
            tg = torch.randn(n, c, device="cuda", dtype=_torch_dtype(dtype))
            ti = torch.as_tensor(idx, device="cuda")
            item = np.dtype(dtype).itemsize
            out.append(_row("embedding", f"bwd {name}", dtype, (n, v, c), lambda: k.embedding_bwd(g, di, v),
                            lambda: torch.ops.aten.embedding_dense_backward(tg, ti, v, -1, False), iters,
                            nbytes=(n + v) * c * item))
    return out


def bench_bias_grad(k, iters):
    """A linear layer's bias gradient, the column sums of its output's gradient [B*T, C] (GPT-2's c_proj,
    c_attn and c_fc widths), kiln's part and finish kernels (fp32 sums, written fp32 for the master weights)
    against torch's sum over rows (in bf16: its fp32 accumulation rounded to bf16); bytes = the gradient read.
    Graph-timed: call by call, kiln's ~0.1 ms of Python launches is what the event pair measures (device-check-2026-12-08-h100-s22's rows)."""
    import torch
    out = []
    rows = 16 * 1024
    for dtype in (np.float32, BF16):
        for c in (768, 2304, 3072):
            g = k.rng_normal(k.new_generator(0), (rows, c), dtype)
            w = k.rng_normal(k.new_generator(1), (c, 8), dtype)  # only its shape is read: no dx is made
            tg = torch.randn(rows, c, device="cuda", dtype=_torch_dtype(dtype))
            out.append(_row("bias_grad", f"C={c}", dtype, (rows, c),
                            lambda: k.linear_bwd(g, None, w, False, False, True, np.float32),
                            lambda: tg.sum(0), iters, nbytes=rows * c * np.dtype(dtype).itemsize, timer=graph_ms))
    return out


def bench_attention(k, iters):
    import torch
    import torch.nn.functional as F
    out = []
    shape = (16, 12, 1024, 64)
    b, h, t, d = shape
    flops_fwd = 4 * b * h * t * t * d / 2  # causal: half the score matrix
    for dtype in (np.float32, BF16):
        gen = k.new_generator(0)
        q, kk, v, g = (k.rng_normal(gen, shape, dtype) for _ in range(4))
        scale = 1.0 / math.sqrt(d)
        o, lse = k.attention_fwd(q, kk, v, scale)
        td = _torch_dtype(dtype)
        tq, tk, tv = (torch.randn(shape, device="cuda", dtype=td, requires_grad=True) for _ in range(3))
        tg = torch.randn(shape, device="cuda", dtype=td)

        def torch_fwd_bwd():
            sdpa_fwd_bwd(tq, tk, tv, tg)

        def kiln_fwd_bwd():
            out_, lse_ = k.attention_fwd(q, kk, v, scale)
            return k.attention_bwd(g, q, kk, v, out_, lse_, scale)

        out.append(_row("attention", "fwd", dtype, shape, lambda: k.attention_fwd(q, kk, v, scale),
                        lambda: F.scaled_dot_product_attention(tq.detach(), tk.detach(), tv.detach(), is_causal=True),
                        iters, flops=flops_fwd))
        out.append(_row("attention", "fwd+bwd", dtype, shape, kiln_fwd_bwd, torch_fwd_bwd, iters,
                        flops=3.5 * flops_fwd))
    return out


def sdpa_fwd_bwd(q, k, v, grad):
    """SDPA's causal forward and its (dq, dk, dv), returned, as kiln's backward returns them: never added
    into .grad (`.backward()` on leaves that already hold gradients adds three elementwise kernels a call)."""
    import torch
    import torch.nn.functional as F
    return torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), grad)


def host_ms(fn, iters: int) -> float:
    """Median host milliseconds of one call without waiting for the device (launch + Python):
    when it is close to the event time, the call is bound by the host, not the kernel."""
    import time

    from kiln.backend.cuda import device
    times = []
    for _ in range(iters):
        device.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(1000.0 * (time.perf_counter() - t0))
    device.synchronize()
    return float(np.median(times))


def _row(family, op, dtype, shape, kfn, tfn, iters, nbytes=None, flops=None, timer=median_ms):
    """timer: median_ms (call by call, the host's launch cost included where it exceeds the GPU's time)
    or graph_ms (the GPU's time alone, for kernels shorter than their launch)."""
    kms = timer(kfn, iters, "kiln")
    khost = host_ms(kfn, iters)
    tms = timer(tfn, iters, "torch")
    row = {"family": family, "op": op, "dtype": np.dtype(dtype).name, "shape": list(shape),
           "kiln_ms": kms, "kiln_host_ms": khost, "torch_ms": tms, "speedup": tms / kms}
    if nbytes is not None:
        row.update(bytes=nbytes, kiln_gbps=nbytes / kms / 1e6, torch_gbps=nbytes / tms / 1e6)
    if flops is not None:
        row.update(flops=flops, kiln_tflops=flops / kms / 1e9, torch_tflops=flops / tms / 1e9)
    rate = (f"{row['kiln_gbps']:8.0f} {row['torch_gbps']:8.0f} GB/s" if nbytes is not None
            else f"{row['kiln_tflops']:8.1f} {row['torch_tflops']:8.1f} TFLOP/s")
    print(f"{family:14s} {op:22s} {row['dtype']:9s} {kms:9.3f} {khost:9.3f} {tms:9.3f} {row['speedup']:6.2f}x {rate}",
          flush=True)
    return row


BENCHES = {"gelu": bench_gelu, "layer_norm": bench_layer_norm, "cross_entropy": bench_cross_entropy,
           "adamw": bench_adamw, "grad_norm": bench_grad_norm, "embedding": bench_embedding,
           "attention": bench_attention, "lm_head": bench_lm_head,
           "bias_grad": bench_bias_grad}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--only", default=",".join(BENCHES), help="comma-separated families: " + ",".join(BENCHES))
    p.add_argument("--out", default=None, help="result file (default benchmarks/results/kernels/kernels-<date>.json)")
    args = p.parse_args(argv)
    k, torch = kiln_and_torch()
    if k is None:
        return 2
    print(f"{'family':14s} {'op':22s} {'dtype':9s} {'kiln ms':>9s} {'host ms':>9s} {'torch ms':>9s} {'ratio':>7s}  kiln / torch")
    rows = []
    for name in args.only.split(","):
        rows += BENCHES[name.strip()](k, args.iters)
    write_rows("kernels", torch, args, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
