"""benchmarks/kernel_compare.py: kernel tables read, kernels sorted into families, the side-by-side table."""

import pytest

from tests.benchmark_support import load_benchmark

SEP = "-" * 90 + "  " + "  ".join(["-" * 12] * 10)


def _table(title, rows):
    """A table as gpt2_step.py's --kernel-profile writes it (torch.profiler's key_averages)."""
    head = ["Name", "Self CPU %", "Self CPU", "CPU total %", "CPU total", "CPU time avg", "Self CUDA", "Self CUDA %",
            "CUDA total", "CUDA time avg", "# of Calls"]
    lines = [title, SEP, "  ".join(h.rjust(12) for h in head), SEP]
    for name, cuda, calls in rows:
        lines.append(f"{name:>90}  " + "  ".join(v.rjust(12) for v in (
            "0.00%", "0.000us", "0.00%", "0.000us", "0.000us", cuda, "1.00%", cuda, "1.000us", str(calls))))
    lines.append(f"{'cudaGraphLaunch':>90}  " + "  ".join(v.rjust(12) for v in (
        "2.30%", "2.378ms", "2.30%", "2.378ms", "792.545us", "0.000us", "0.00%", "0.000us", "0.000us", "3")))
    return "\n".join(lines + [SEP, "Self CPU time total: 1.0ms", ""])


def test_tables_are_read_sorted_into_families_and_compared():
    kc = load_benchmark("kernel_compare")
    kiln = _table("kiln bf16: GPU kernels of 3 steps (divide the totals by 3)", [
        ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "6.000ms", 36),
        ("void attention_bwd_dkdv_tma<__nv_bfloat16, 64>(TmaMap, TmaMap, __nv_bfloat16 const*, __...", "3.000ms", 12),
        ("void add_layer_norm_bwd_dy_reg<float, __nv_bfloat16, 768>(float const*, __nv_bfloat16 c...", "1.500ms", 23),
        ("Memset (Unknown)", "300.000us", 128),
        ("something_new", "30.000us", 3)])
    peer = _table("compile bf16: GPU kernels of 2 steps (divide the totals by 2)", [
        ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "4.000ms", 24),
        ("triton_poi_fused_gelu_gelu_backward_view_6", "2.000ms", 24)])
    steps, rows = kc.parse(kiln)
    assert steps == 3 and len(rows) == 5  # the host-side row (no GPU time) is not a kernel
    fams = kc.by_family(kiln)
    assert fams["GEMM"] == pytest.approx((2.0, 12.0)) and fams["attention"] == pytest.approx((1.0, 4.0))
    assert fams["layer norm (+ residual add)"][0] == pytest.approx(0.5)
    assert fams["memset / copy / cast"] == pytest.approx((0.1, 128 / 3)) and "other" in fams
    md = kc.table(fams, kc.by_family(peer), ("kiln", "compile"))
    assert "| GEMM | 2.00 | 12 | 2.00 | 12 | +0.00 |" in md
    assert "| GELU | 0.00 | 0 | 1.00 | 12 | -1.00 |" in md
    assert "| **total** | 3.61 | 67 | 3.00 | 24 | +0.61 |" in md
    with pytest.raises(ValueError, match="steps"):
        kc.parse("a table without its title\n")


def test_family_order_puts_fused_norms_before_casts_and_attention_before_gemms():
    kc = load_benchmark("kernel_compare")
    assert kc.family("triton_per_fused__to_copy_add_native_layer_norm_backward_view_9") == "layer norm (+ residual add)"
    assert kc.family("triton_poi_fused__to_copy_view_2") == "memset / copy / cast"
    assert kc.family("fmha_cutlassF_f32_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<...") == "attention"
    assert kc.family("sm90_xmma_gemm_bf16bf16_bf16f32_f32_nn_n_tilesize128x128x64_warpgroupsize1x1x1_aux_bf16") == \
        "GEMM + GELU epilogue"
    assert kc.family("nvjet_sm90_tst_192x128_64x5_1x2_h_bz_coopA_geluauxbias_auxt_TNN") == "GEMM + GELU epilogue"
    assert kc.family("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_bias_TNN") == "GEMM"


def test_gpt2_step_writes_the_comparison_beside_its_kernel_tables(tmp_path):
    gs = load_benchmark("gpt2_step")
    (tmp_path / "kernels-kiln-bf16.txt").write_text(_table("kiln bf16: GPU kernels of 1 steps (divide the totals by 1)",
                                                           [("nvjet_sm90_x", "2.000ms", 3)]))
    (tmp_path / "kernels-compile-bf16.txt").write_text(
        _table("compile bf16: GPU kernels of 1 steps (divide the totals by 1)", [("nvjet_sm90_x", "1.500ms", 3)]))
    written = gs.compare_kernels(tmp_path, ["kiln", "eager", "compile"], ["bf16", "fp32"])  # eager's table missing
    assert [p.name for p in written] == ["kernel-compare-kiln-compile-bf16.md"]
    assert "| GEMM | 2.00 | 3 | 1.50 | 3 | +0.50 |" in written[0].read_text()
    assert written[0].with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
