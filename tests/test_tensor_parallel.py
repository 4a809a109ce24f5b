"""Tensor parallelism (§4.2) on real MPI ranks: each parallel layer and the whole GPT equal the
dense ones in float64 (with the LayerNorm and GELU outputs recomputed in backward too), async TP (N = 2, 4)
equals plain TP, and one block's forward makes
exactly Megatron's all-reduces."""

import pytest

from tests.mpi_runner import run_ranks

TOL = 1e-12


@pytest.mark.dist
@pytest.mark.parametrize("n", [2, 4])
def test_tensor_parallel_layers_and_gpt_equal_dense(n, tmp_path):
    results, _, _ = run_ranks("tensor_parallel_equal.py", n, tmp_path, timeout=90)
    tokens, width = 2 * 16, 8 * n  # the GPT's batch tokens and n_embd in the rank script
    for r, res in enumerate(results):
        counts = {k: res.pop(k) for k in list(res) if k.startswith("block_all_reduces_")}
        assert len(res) == 30, sorted(res)  # every check reported
        bad = {k: v for k, v in res.items() if v > TOL}
        assert not bad, (r, bad)
        # two all-reduces of the [B, T, C] activations per block forward (attention and MLP
        # outputs); async TP makes each N all-reduces of a 1/N share, nothing else
        for chunks in (1, 2, 4):
            assert counts[f"block_all_reduces_{chunks}"] == [tokens * width // chunks] * (2 * chunks), (r, counts)


@pytest.mark.dist
@pytest.mark.parametrize("peer", ["torch", "torch-sp"])
def test_tp_benchmark_torch_peer_trains_the_same_losses_on_two_ranks(peer, tmp_path):
    """benchmarks/tp.py on 2 CPU ranks (MPI for kiln, gloo for PyTorch): the DTensor peer (every
    parameter a DTensor, fused AdamW, clip_grad_norm_, loss_parallel; with sequence parallelism too)
    trains kiln's losses and gradient norms, plain and async TP, to fp32 rounding over 5 clipped
    AdamW steps."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from tests.mpi_runner import mpiexec
    out = tmp_path / "tp.json"
    cmd = [mpiexec(), "-n", "2", sys.executable, str(Path(__file__).parents[1] / "benchmarks" / "tp.py"),
           "--device", "cpu", "--preset", "tiny", "--batch-size", "2", "--seq-len", "32", "--steps", "5",
           "--chunks", "1,2", "--precision", "fp32", "--out", str(out), *(["--torch-sp"] if peer == "torch-sp" else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["framework"], r["chunks"]) for r in rows] == [("kiln", 1), ("kiln", 2), (peer, None)]
    assert all(r["loss_diff"] < 1e-5 and r["grad_norm_diff"] < 1e-5 for r in rows), rows
    assert min(rows[-1]["grad_norms"]) > 1.0  # the clip at 1.0 acted on every step, on both sides


def test_async_tp_trace_counts_kernels_by_stream_and_the_collective_time_under_gemms():
    """benchmarks/async_tp_trace.py's reading of a Chrome trace: two chunks' GEMMs on stream 7, their
    all-reduces on stream 20, the first all-reduce half under the second GEMM, the last after it."""
    from tests.benchmark_support import load_benchmark
    mod = load_benchmark("async_tp_trace")

    def kernel(name, ts, dur, stream):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}
    events = [kernel("nvjet_tst_128x64_64x4_1x2_h_bz_TNT", 0, 10, 7), kernel("sm90_xmma_gemm_bf16", 10, 10, 7),
              kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 15, 10, 20),
              kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 30, 4, 20), kernel("layer_norm_fwd<float>", 20, 3, 7),
              kernel("gemm_on_the_comm_stream", 31, 2, 20),  # a GEMM, but not beside the all-reduce
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaEventRecord", "ts": 0, "dur": 1},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamWaitEvent", "ts": 1, "dur": 1},
              {"ph": "i", "cat": "kernel", "name": "ncclDevKernel_instant", "ts": 2}]
    s = mod.summarize({"traceEvents": events}, steps=1)
    assert (s["gemm_kernels_per_step"], s["collective_kernels_per_step"], s["other_kernels_per_step"]) == (3, 2, 1)
    assert (s["gemm_streams"], s["collective_streams"]) == ([7, 20], [20])
    assert (s["event_records_per_step"], s["stream_waits_per_step"]) == (1, 1)
    assert s["collective_ms_per_step"] == pytest.approx(14e-3) and s["overlapped_ms_per_step"] == pytest.approx(5e-3)
    assert s["overlap_fraction"] == pytest.approx(5 / 14)
    assert mod.covered_us([(0, 10)], [(2, 4), (3, 6), (8, 20)]) == 6.0
