"""The attention benchmarks' arithmetic: SDPA's forward+backward returns its gradients, as kiln's backward
does, and never adds them into .grad (that cost three elementwise kernels a call, timed as SDPA's); the
schedule model's job numbering; attention.py's --shapes and --ops."""

import pytest
import torch

from tests.benchmark_support import load_benchmark


def test_sdpa_fwd_bwd_returns_the_gradients_and_leaves_grad_alone():
    sdpa_fwd_bwd = load_benchmark("kernel_speed").sdpa_fwd_bwd
    gen = torch.Generator().manual_seed(0)
    q, k, v, g = (torch.randn(2, 3, 16, 8, generator=gen) for _ in range(4))
    q, k, v = (a.requires_grad_() for a in (q, k, v))
    first = sdpa_fwd_bwd(q, k, v, g)
    second = sdpa_fwd_bwd(q, k, v, g)
    assert all(a.grad is None for a in (q, k, v))
    leaves = [a.detach().clone().requires_grad_() for a in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True).backward(g)
    for got, again, leaf in zip(first, second, leaves):
        assert torch.equal(got, again) and torch.allclose(got, leaf.grad, rtol=1e-5, atol=1e-6)


def test_the_schedule_model_numbers_every_job_once_and_levels_the_blocks():
    """attention_schedule's mirror of GroupedJob's numbering gives each (head, row block) once, groups
    included (the last one smaller), each group starting with its longest rows; the ticket never leaves a
    block more loaded than the static stride did, nor head groups than the split kernels' head-major order,
    at the paper's shapes of many jobs."""
    sched = load_benchmark("attention_schedule")
    for n_bh, n_blocks, group in ((192, 8, 66), (24, 128, 5), (7, 3, 2), (12, 8, 12)):
        jobs = [sched.job(w, n_bh, n_blocks, group) for w in range(n_bh * n_blocks)]
        assert sorted(jobs) == [(h, r) for h in range(n_bh) for r in range(n_blocks)]
        assert [r for _, r in jobs[:min(group, n_bh)]] == [0] * min(group, n_bh)
    for shape in ((16, 12, 1024, 64), (2, 12, 8192, 64), (2, 16, 8192, 128)):
        row = sched.simulate(shape, 132, 0.5)
        assert 1.0 <= row["fwd_ticket"] <= row["fwd_static"] and 1.0 <= row["fwd_grouped"] < row["fwd_static"]
        assert row["fwd_grouped_heads"] <= row["fwd_static_heads"]
        assert 1.0 <= row["split_grouped4"] < row["split_head-major"]
    fewer = sched.simulate((32, 12, 512, 64), 132, 0.5, split_jobs=(4, 2))  # groups for 2 jobs a slot: half the heads
    assert fewer["split_grouped2_heads"] * 2 == fewer["split_grouped4_heads"] == 192
    assert fewer["split_grouped2_mib"] * 2 == fewer["split_grouped4_mib"] == 48


def test_the_fused_schedule_model_waits_only_where_the_adds_go_against_the_walk():
    """attention_fused_schedule: with the adds into a tile in descending key-block order and the jobs handed out
    in that order, no block ever waits while the adds take under two tiles' products (the fused makespan is the
    plain ticket's); ascending order (the v5 kernel's, measured slower than split) waits; every job finishes."""
    fs = load_benchmark("attention_fused_schedule")
    for n_bh, t in ((192, 1024), (24, 4096), (3, 512)):
        n_blocks, n_tiles = t // fs.KEYS, t // fs.QUERIES
        plain = fs.ticket_makespan([n_tiles - 2 * kb + 0.3 for h in range(n_bh) for kb in reversed(range(n_blocks))],
                                   132)
        for latency in (0.0, 1.0, 1.9):
            assert fs.fused_makespan(n_bh, t, 132, latency, 0.3, True, 1) == pytest.approx(plain)
        assert fs.fused_makespan(n_bh, t, 132, 1.0, 0.3, False, 1) > plain
    assert fs.fused_makespan(24, 4096, 132, 5.0, 0.3, True, 1) > fs.fused_makespan(24, 4096, 132, 0.0, 0.3, True, 1)
    assert fs.split_makespan(192, 1024, 132, 0.3) > fs.fused_makespan(192, 1024, 132, 1.0, 0.3, True, 1)


def test_the_fused_schedule_model_is_bound_by_its_writer_when_an_add_takes_longer_than_a_tiles_products():
    """attention_fused_schedule's writer: adds that take `copy` units each, one at a time a block, bound the kernel
    at `copy` units a tile once they take longer than the products (1 unit); below that they cost ~nothing."""
    fs = load_benchmark("attention_fused_schedule")
    n_bh, t = 24, 4096
    n_blocks, n_tiles = t // fs.KEYS, t // fs.QUERIES
    per_sm = n_bh * sum(n_tiles - 2 * kb for kb in range(n_blocks)) / 132
    free = fs.fused_makespan(n_bh, t, 132, 1.0, 0.3, True, 1)
    assert fs.fused_makespan(n_bh, t, 132, 1.0, 0.3, True, 1, copy=0.5) == pytest.approx(free, rel=0.05)
    slow = [fs.fused_makespan(n_bh, t, 132, 1.0, 0.3, True, 1, copy=copy) for copy in (1.5, 2.0)]
    for copy, span in zip((1.5, 2.0), slow):  # the writer's adds end to end, plus the tail's imbalance
        assert copy * per_sm <= span <= 1.3 * copy * per_sm, (copy, span, per_sm)
    assert slow[1] > slow[0]
    # one stage: the consumers wait for each add to have been read before the next tile
    assert fs.fused_makespan(n_bh, t, 132, 1.0, 0.3, True, 1, copy=0.5, stages=1) > 1.3 * free


def test_the_fused_kernels_places_in_line_are_each_tiles_walkers_in_descending_order():
    """The fused-tma kernel's arithmetic (its walk and its writer's place): at every query tile the key blocks that
    walk it hold places 0, 1, ... with no gap and no repeat, the last key block first, for any lengths and mask
    offset: a gap or a repeat would leave a block waiting forever for a counter."""
    import random
    fs = load_benchmark("attention_fused_schedule")
    gen = random.Random(0)
    cases = [(1024, 1024, 0), (65, 200, 3), (200, 65, 135), (100, 37, 37), (16384, 16384, 0)]
    cases += [(gen.randint(1, 700), gen.randint(1, 700), 0) for _ in range(150)]
    cases += [(n_q, n_k, gen.randint(0, n_k)) for n_q, n_k in ((gen.randint(1, 700), gen.randint(1, 700))
                                                               for _ in range(150))]
    for n_q, n_k, off in cases:
        n_kb = -(-n_k // fs.KEYS)
        at = {}
        for kb in range(n_kb):
            for qt in fs.walk(kb, n_q, off):
                at.setdefault(qt, []).append((fs.place(kb, qt, n_kb, off), kb))
        assert sorted(at) == list(range(-(-n_q // fs.QUERIES))), (n_q, n_k, off)  # every tile: acc written whole
        for qt, walkers in at.items():
            assert sorted(p for p, _ in walkers) == list(range(len(walkers))), (n_q, n_k, off, qt)
            assert min(walkers)[1] == max(kb for _, kb in walkers), (n_q, n_k, off, qt)  # the last key block first


def test_attention_benchmark_narrows_to_the_shapes_and_ops_asked_and_refuses_others():
    bench = load_benchmark("attention")
    assert bench.parse_shapes("") == list(bench.SHAPES)
    assert bench.parse_shapes("16x12x1024x64, 2X16X8192X128") == [(16, 12, 1024, 64), (2, 16, 8192, 128)]
    assert bench.parse_ops("fwd+bwd,fwd") == ("fwd", "fwd+bwd")
    for bad in ("16x12x1024", "16x12x0x64", "axbxcxd"):
        with pytest.raises(ValueError, match="four positive integers"):
            bench.parse_shapes(bad)
    for bad in ("", "fwd,back"):
        with pytest.raises(ValueError, match="--ops takes some of"):
            bench.parse_ops(bad)


def test_attention_benchmark_plots_a_result_file(tmp_path):
    """--plot draws a committed result file again (no GPU): a panel per op present, a PNG beside the JSON; a
    record without rows is refused rather than drawn empty."""
    import json
    bench = load_benchmark("attention")
    row = {"dtype": "bfloat16", "fwd_kernel": "tma-pingpong", "bwd_kernel": None, "kiln_tflops": 240.0,
           "torch_tflops": 310.0, "ratio": 0.77}
    rows = [{**row, "op": "fwd", "shape": [16, 12, 1024, 64]}, {**row, "op": "fwd", "shape": [2, 12, 16384, 64]},
            {**row, "op": "fwd+bwd", "shape": [16, 12, 1024, 64], "bwd_kernel": "split-tma"}]
    src = tmp_path / "attention.json"
    src.write_text(json.dumps({"gpu": "test", "date": "2026-12-07", "commit": "abc", "rows": rows}))
    assert bench.main(["--plot", str(src)]) == 0
    png = src.with_suffix(".png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    with pytest.raises(ValueError, match="no attention rows"):
        bench.plot({"rows": []}, tmp_path / "empty.png")
