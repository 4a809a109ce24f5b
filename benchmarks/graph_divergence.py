"""Diagnostic for the open CUDA-graph bug: eager vs graph-replayed training of small GPTs in one process.

    PYTHONPATH=src python benchmarks/graph_divergence.py     (GPU; output in benchmarks/results/diagnostics/cuda-graph-divergence-*.log)

Each line trains the same model twice (op by op, then replayed as a CUDA graph from step 2) and
prints the largest loss and parameter differences, and, at the first replayed step, how far the
gradients, the gradient norm and the Adam moments of the two runs are apart (which part diverges).
On the H200 at bd56aa8 the first model and a model of new shapes replay exactly; later models
with shapes already seen in the process diverge.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import numpy as np

import kiln
from kiln.graph import CapturedStep
from kiln.nn import GPT, GPTConfig
from kiln.optim import AdamW, gpt_param_groups
from kiln.train import apply_precision


def run(graph, cfg, vary_lr, warm, steps=6, clip=True):
    rng = np.random.default_rng(5)
    model = GPT(cfg, generator=kiln.Generator(3)).to("cuda")
    apply_precision(model, "fp32", kiln.device("cuda"))
    opt = AdamW(gpt_param_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.95))
    held = {}

    def body(x, y):
        opt.zero_grad(); _, loss = model(x, y); loss.backward()
        held["norm"] = opt.clip_grad_norm_(1.0) if clip else None
        opt.step(); return loss
    step = CapturedStep(body)
    from kiln.backend.cuda import adamw as cuda_adamw
    tables_before = len(cuda_adamw._captured_tables)
    out, at_capture = [], None
    for i in range(steps):
        if warm and i == 1: kiln.device("cuda").backend.end_warmup()
        for g in opt.param_groups: g["lr"] = 1e-3 * (i + 1) / steps if vary_lr else 1e-3
        x = kiln.tensor(rng.integers(0, cfg.vocab_size, (4, cfg.block_size)), device="cuda")
        y = kiln.tensor(rng.integers(0, cfg.vocab_size, (4, cfg.block_size)), device="cuda")
        loss = step(x, y) if (graph and i >= 2) else body(x, y)
        out.append(loss.item())
        bad = allocator_problems()
        if bad:
            print(f"    step {i}: allocator bookkeeping broken: {bad[:4]}", flush=True)
        if graph and i >= 2 and (i <= 3 or DETAIL):
            print(f"    step {i}: hyper (group, ptr, device, host) {hyper_check(step, opt)}  stray table pointers "
                  f"{table_check(model, opt, len(cuda_adamw._captured_tables) - tables_before)[:6]}", flush=True)
        if i == 2:  # the first replayed step: gradients, norm and moments as the graph left them
            m, v = opt._moments
            at_capture = {"grads": [p.grad.numpy() for p in model.parameters()],
                          "norm": None if held["norm"] is None else held["norm"].item(),
                          "m": [a.get() for a in m], "v": [a.get() for a in v]}
    return np.array(out), [p.numpy() for p in model.parameters()], [n for n, _ in model.named_parameters()], at_capture


def allocator_problems():
    """What is wrong with the allocator's bookkeeping: blocks handed out twice, overlapping, lost."""
    from kiln.backend.cuda import allocator
    return allocator.installed().integrity_problems()


def hyper_check(step, opt):
    """The AdamW hyper buffers the captured graph reads, against the values the host expects now."""
    from kiln.backend.cuda.adamw import adamw_hyper
    out = []
    for hook in step._hooks:
        cells = dict(zip(hook.__code__.co_freevars, (c.cell_contents for c in hook.__closure__ or ())))
        for gi, buf, _ in cells.get("hypers", ()):
            want = adamw_hyper(opt.param_groups[gi]["lr"], *opt.betas, opt.step_count)
            out.append((gi, hex(buf.data.ptr), [round(float(x), 6) for x in buf.get()], [round(x, 6) for x in want]))
    return out


def table_check(model, opt, n_new):
    """Pointers in the optimizer tables of the latest capture that are none of the model's
    parameters, gradients or moments (the graph would update memory that is not this model's)."""
    from kiln.backend.cuda import adamw
    m, v = opt._moments
    mine = {p.data.data.ptr for p in model.parameters()} | {p.grad.data.data.ptr for p in model.parameters()} | \
           {a.data.ptr for a in m} | {a.data.ptr for a in v}
    stray = []
    for tab in adamw._captured_tables[-n_new:]:
        host = tab.buf.get()
        k = (len(host) - 1 - (tab.ntensors + 1) // 2) // tab.ntensors - 2
        ptrs = host[:k * tab.ntensors]
        stray += [hex(int(x)) for x in ptrs if int(x) not in mine]
        if not np.array_equal(host, tab.host):
            stray.append("device table differs from its pinned host copy")
    return stray


def worst(a_list, b_list, names, k=2):
    return sorted(((float(np.abs(a - b).max()), nm) for a, b, nm in zip(a_list, b_list, names)), reverse=True)[:k]


small = GPTConfig(vocab_size=512, block_size=128, n_layer=2, n_head=4, n_embd=128)
mid = GPTConfig(vocab_size=512, block_size=128, n_layer=2, n_head=4, n_embd=256)
cases = [("small", small, True, False, True), ("small const-lr", small, False, False, True),
         ("small warm", small, True, True, True), ("mid D64", mid, True, False, True),
         ("small noclip", small, True, False, False), ("small 3 steps", small, True, False, True)]
DETAIL = False
only = sys.argv[1:]  # case names to run (default: all), e.g. to run one case in a fresh process
for name, cfg, vary, warm, clip in cases:
    if only and name not in only:
        continue
    n = 3 if "3 steps" in name else 6
    e, ep, names, ec = run(False, cfg, vary, warm, n, clip)
    g, gp, _, gc = run(True, cfg, vary, warm, n, clip)
    print(f"{name:16} loss diff {np.abs(e - g).max():.2e}  losses g {np.round(g, 3)}  worst params {worst(gp, ep, names)}\n"
          f"{'':16} at the first replay: grads {worst(gc['grads'], ec['grads'], names)}  norm g/e {gc['norm']} / {ec['norm']}  "
          f"m {worst(gc['m'], ec['m'], names, 1)}  v {worst(gc['v'], ec['v'], names, 1)}", flush=True)
