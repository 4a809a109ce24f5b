import json

import numpy as np
import pytest

import kiln
from kiln.nn import GPT, GPTConfig
from kiln.profiler import Profiler


def test_profiler_spans_every_kernel_call_and_writes_a_chrome_trace(tmp_path):
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    x = kiln.tensor(np.random.default_rng().integers(0, 64, (2, 16)))
    with Profiler(kiln.device("cpu")) as prof:
        _, loss = model(x, x)
        loss.backward()
    s = prof.summary()
    assert s["kernels"]["linear_fwd"]["calls"] == 2 * 3  # 3 per block (the head is in lm_head_xent)
    assert s["kernels"]["linear_gelu_fwd"]["calls"] == 2  # the MLP's first layer
    assert s["kernels"]["linear_bwd"]["calls"] == 8
    assert s["kernels"]["attention_fwd"]["calls"] == 2
    assert s["kernels"]["lm_head_xent_fwd"]["calls"] == 1 and s["kernels"]["lm_head_xent_bwd"]["calls"] == 1
    # block 0's ln_1 is a LayerNorm of its own; every residual add is fused with the LayerNorm
    # after it (ln_2, the next block's ln_1, ln_f): two per block, forward and backward
    for kernel, calls in (("layer_norm_fwd", 1), ("layer_norm_bwd", 1), ("add_layer_norm_fwd", 2 * 2),
                          ("add_layer_norm_bwd", 2 * 2)):
        assert s["kernels"][kernel]["calls"] == calls, kernel
    assert 0 < s["tracked_ms"] <= s["total_ms"]
    prof.export_chrome_trace(tmp_path / "t.json")
    trace = json.loads((tmp_path / "t.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["tid"] == "device"]
    assert len(spans) == sum(k["calls"] for k in s["kernels"].values())
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    assert "linear_fwd" in prof.table()
    assert kiln.backend.get_backend("cpu").linear_fwd.__module__ == "kiln.backend.cpu.matmul"  # unwrapped


# ---------------------------------------------------------------- profiler v2

def test_gpt2_124m_flops_per_token_and_mfu_against_a_hand_count():
    """Table 1's GPT-2 124M (d 768, 12 layers, vocab 50304, T 1024), counted by hand per token:
    the blocks' GEMMs c_attn 2*768*2304, attn.c_proj 2*768*768, c_fc 2*768*3072, mlp.c_proj
    2*3072*768; the LM head 2*768*50304; the scores QK^T and PV 2 * 2 * 1024 * 768 per layer (full,
    PaLM's convention); backward twice the forward."""
    from kiln.nn import preset
    from kiln.profiler.cost import gpt_flops_per_token, mfu
    block = 2 * 768 * 2304 + 2 * 768 * 768 + 2 * 768 * 3072 + 2 * 3072 * 768   # 14,155,776
    attention = 2 * 2 * 1024 * 768                                           # 3,145,728
    forward = 12 * (block + attention) + 2 * 768 * 50304                     # 284,884,992
    assert gpt_flops_per_token(preset("gpt2-124m"), 1024) == 3 * forward == 854_654_976
    # the README's bf16 step (473,940 tok/s) on DESIGN.md's measured 790 TFLOP/s cuBLAS ceiling
    assert mfu(473_940, 854_654_976, 790e12) == pytest.approx(0.51273, abs=1e-5)


def test_kernel_flops_of_a_step_add_up_to_the_model_count():
    """The profiler's per-call FLOPs (from the kernels' argument shapes) over one training step: the
    GEMMs are exactly the model count's 6 per weight per token, attention the causal triangle."""
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    model = GPT(cfg)
    b, t = 3, 16
    x = kiln.tensor(np.random.default_rng().integers(0, 64, (b, t)))
    with Profiler(kiln.device("cpu")) as prof:
        _, loss = model(x, x)
        loss.backward()
    k = prof.summary()["kernels"]
    gemm = sum(k[n]["flops"] for n in ("linear_fwd", "linear_bwd", "linear_gelu_fwd", "linear_gelu_bwd",
                                             "lm_head_xent_fwd"))
    d = cfg.n_embd
    assert gemm == 6 * (cfg.n_layer * 12 * d * d + d * cfg.vocab_size) * b * t
    attention = k["attention_fwd"]["flops"] + k["attention_bwd"]["flops"]
    assert attention == 3 * cfg.n_layer * 4 * b * d * (t * (t + 1) // 2)
    assert k["layer_norm_fwd"]["flops"] == 0 and k["layer_norm_fwd"]["bytes"] == (
        b * t * d * 4 * 2 + 2 * d * 4 + 2 * b * t * 4)  # x in, y out, weight, bias, mean, rstd


def test_allocation_timeline_accounts_for_every_allocation():
    """kiln's allocator (its bookkeeping over a fake driver) through a step-like run of kernels that
    allocate and free: the timeline's running sum is the allocator's allocated bytes, its peak the
    allocator's peak, its counts the allocator's, and every byte is charged to the op that asked."""
    from kiln.backend.cuda.allocator import CachingAllocator
    from kiln.profiler.timeline import AllocationTimeline
    addresses = iter(range(1 << 24, 1 << 50, 1 << 24))  # apart by more than a block
    alloc = CachingAllocator(driver_malloc=lambda size, dev: next(addresses), driver_free=lambda p, dev: None)
    rng = np.random.default_rng()
    held = [alloc.malloc(int(s)) for s in rng.integers(1, 1 << 16, 5)]  # live before profiling
    before = alloc.memory_stats()
    alloc.reset_peak_stats()
    timeline = AllocationTimeline()
    timeline.start_bytes = before["allocated_bytes"]
    alloc.observers.append(timeline)
    charged = {}
    for _step in range(3):
        for op in ("linear_fwd", "attention_fwd", "linear_bwd", "adamw_step"):
            timeline.op = op
            for _ in range(int(rng.integers(1, 6))):
                if held and rng.random() < 0.4:
                    alloc.free(held.pop(int(rng.integers(len(held)))))
                else:
                    size = int(rng.choice([rng.integers(1, 4096), rng.integers(1 << 20, 1 << 23)]))
                    held.append(alloc.malloc(size))
                    charged[op] = charged.get(op, 0) + alloc.rounding(size)
            timeline.op = AllocationTimeline.OUTSIDE
    alloc.observers.remove(timeline)
    after = alloc.memory_stats()
    s = timeline.summary()
    assert s["end_bytes"] == after["allocated_bytes"]
    assert s["peak_bytes"] == after["peak_allocated_bytes"]
    assert s["allocs"] == after["num_allocs"] - before["num_allocs"]
    assert s["frees"] == after["num_frees"] - before["num_frees"]
    assert {op: v["bytes"] for op, v in s["per_op"].items()} == charged
    assert all(e.stream == "kiln" and e.rounded >= e.requested for e in timeline.events)


def test_ceilings_are_measured_once_and_cached(tmp_path, monkeypatch):
    from kiln.profiler import ceilings as ceil
    monkeypatch.setenv("KILN_CACHE", str(tmp_path))
    calls = []
    real = ceil.measure
    monkeypatch.setattr(ceil, "measure", lambda dev: calls.append(1) or real(dev, gemm_n=256, copy_mib=8))
    cpu = kiln.device("cpu")
    first = ceil.ceilings(cpu)
    assert ceil.ceilings(cpu) == first and len(calls) == 1
    assert json.loads(ceil.cache_path(cpu).read_text()) == first
    assert first["gemm_tflops"]["fp32"] > 0 and first["copy_gbps"] > 0
    ceil.ceilings(cpu, refresh=True)
    assert len(calls) == 2


def test_a_kernels_ceiling_fraction_is_its_rate_over_the_ceiling():
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32))
    model.fused_lm_head = False  # the logits whole: cross_entropy_fwd is the memory-bound call checked
    x = kiln.tensor(np.random.default_rng().integers(0, 64, (2, 16)))
    limits = {"gemm_tflops": {"fp32": 0.5, "fp64": 0.25}, "copy_gbps": 20.0, "device": "test",
              "measured": "now"}
    with Profiler(kiln.device("cpu"), ceilings=limits) as prof:
        _, loss = model(x, x)
        loss.backward()
    k = prof.summary()["kernels"]
    # one call each: the time-weighted fraction is the call's rate over the ceiling
    ln = k["layer_norm_fwd"]
    assert ln["ceiling_fraction"] == pytest.approx(ln["bytes"] / (ln["ms"] * 1e-3) / 20e9)
    ce = k["cross_entropy_fwd"]
    assert ce["ceiling_fraction"] == pytest.approx(ce["gbps"] / 20.0)
    lin = k["linear_fwd"]  # several calls: between the slowest and the fastest call's fraction
    assert lin["tflops"] == pytest.approx(lin["flops"] / (lin["ms"] * 1e-3) / 1e12)


def test_train_profile_writes_everything_and_logs_mfu(tmp_path):
    from kiln.profiler.ceilings import ceilings
    from kiln.profiler.cost import gpt_flops_per_token
    from kiln.train import TrainConfig, Trainer
    cfg = TrainConfig(model="tiny", model_overrides={"n_layer": 1, "n_embd": 32, "n_head": 2}, batch_size=2,
                      seq_len=32, device="cpu", max_steps=7, eval_interval=7, eval_iters=1, progress=False,
                      sample_tokens=0, profile=True, out_dir=str(tmp_path), run_name="p")
    trainer = Trainer(cfg)
    s = trainer.fit()
    folder = tmp_path / "p" / "profile"
    for name in ("trace.json", "profile.txt", "profile.json", "allocations.csv", "memory.png", "report.html",
                 "report.png", "overhead.json"):
        assert (folder / name).stat().st_size > 0, name
    prof = json.loads((folder / "profile.json").read_text())
    assert prof["kernels"]["adamw_step"]["calls"] == 2  # the two profiled steps (steps 5 and 6)
    over = json.loads((folder / "overhead.json").read_text())
    assert over["plain_steps"] == 2 and over["overhead"] == pytest.approx(
        over["profiled_step_ms"] / over["plain_step_ms"] - 1)
    trace = json.loads((folder / "trace.json").read_text())
    assert any(e["ph"] == "C" for e in trace["traceEvents"]) or prof["allocations"]["allocs"] == 0
    fpt = gpt_flops_per_token(trainer.model_config, 32)
    peak = 1e12 * ceilings(trainer.device)["gemm_tflops"]["fp32"]
    rows = [json.loads(line) for line in (tmp_path / "p" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["mfu"] == pytest.approx(r["tokens_per_s"] * fpt / peak) for r in rows)
    assert s["mfu"] > 0 and s["flops_per_token"] == fpt
    assert "mfu" in (folder.parent / "summary.json").read_text()


@pytest.mark.cuda
@pytest.mark.skipif(not kiln.cuda_is_available(), reason="needs an NVIDIA GPU and CuPy")
def test_cuda_timeline_matches_the_allocator_over_a_gpt_step():
    from kiln.backend.cuda.allocator import installed
    dev = kiln.device("cuda")
    model = GPT(GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=128)).to(dev)
    x = kiln.tensor(np.random.default_rng().integers(0, 512, (4, 64)), device=dev)
    _, loss = model(x, x)
    loss.backward()  # warm: kernels compiled, GEMM plans made
    dev.backend.synchronize()
    installed().reset_peak_stats()
    with Profiler(dev) as prof:
        model.zero_grad()
        _, loss = model(x, x)
        loss.backward()
    stats = dev.backend.memory_stats()
    a = prof.summary()["allocations"]
    assert a["allocs"] > 0 and a["end_bytes"] == stats["allocated_bytes"]
    assert a["peak_bytes"] == stats["peak_allocated_bytes"]


@pytest.mark.cuda
@pytest.mark.skipif(not kiln.cuda_is_available(), reason="needs an NVIDIA GPU and CuPy")
def test_cuda_ceilings_and_nvtx_ranges(tmp_path, monkeypatch):
    """Measured GEMM ceilings in the order Hopper has them (bf16 > tf32 > fp32) and a copy rate of
    TB/s; NVTX ranges open and close around every kernel without error."""
    from kiln.profiler.ceilings import ceilings
    monkeypatch.setenv("KILN_CACHE", str(tmp_path))
    dev = kiln.device("cuda")
    c = ceilings(dev)
    g = c["gemm_tflops"]
    assert g["bf16"] > g["tf32"] > g["fp32"] > 10 and c["copy_gbps"] > 1000
    model = GPT(GPTConfig(vocab_size=512, block_size=64, n_layer=1, n_head=4, n_embd=128)).to(dev)
    x = kiln.tensor(np.random.default_rng().integers(0, 512, (4, 64)), device=dev)
    with Profiler(dev, ceilings=c, nvtx=True) as prof:
        _, loss = model(x, x)
        loss.backward()
    k = prof.summary()["kernels"]
    assert 0 < k["linear_fwd"]["ceiling_fraction"] < 1.5
