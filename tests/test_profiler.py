import json

import numpy as np

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
    assert s["kernels"]["linear_fwd"]["calls"] == 2 * 3 + 1  # 3 per block + the head
    assert s["kernels"]["linear_gelu_fwd"]["calls"] == 2  # the MLP's first layer
    assert s["kernels"]["linear_bwd"]["calls"] == 9
    assert s["kernels"]["attention_fwd"]["calls"] == 2 and s["kernels"]["cross_entropy_bwd"]["calls"] == 1
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
