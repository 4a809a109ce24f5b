"""Every kernel family compiles for sm_90a with NVRTC, without a GPU, and ptxas reports no spills.

Runs in CI on the CPU machine: NVRTC (cuda-bindings + nvidia-cuda-nvrtc) and the CUDA headers
(nvidia-cuda-runtime) are all it needs. Each family is compiled with exactly the template
instantiations its launcher module registers (compiler.FAMILIES, filled by kiln/backend/cuda/<family>.py),
with `--ptxas-options=-v`, and the log is checked per kernel: no spill stores or loads and no stack frame.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("cuda.bindings.nvrtc", reason="needs cuda-bindings (and nvidia-cuda-nvrtc)")

from kiln.backend.cuda import compiler  # noqa: E402
from kiln.backend.cuda.compiler import FAMILIES, KERNEL_DIR, KernelCompileError  # noqa: E402

ARCH = "sm_90a"


def _headers_present() -> bool:
    return any((__import__("pathlib").Path(d) / "cuda_bf16.h").exists() for d in compiler.cuda_include_dirs())


if not _headers_present():
    pytest.skip("CUDA headers (cuda_bf16.h) not found: pip install nvidia-cuda-runtime", allow_module_level=True)


def test_every_kernel_file_is_a_registered_family():
    on_disk = {p.name for p in KERNEL_DIR.glob("*.cu")}
    assert on_disk == set(FAMILIES), f"kernels/ has {sorted(on_disk)}, FAMILIES lists {sorted(FAMILIES)}"


def test_block_constants_are_defined_once_in_python():
    """A constant both the launcher and its kernel use (rows per block, tile sizes) is passed as -D
    from the family module: the source uses it and does not define it (nor a fallback value)."""
    sources = {f: (KERNEL_DIR / f).read_text() for f in FAMILIES}
    headers = "".join(p.read_text() for p in KERNEL_DIR.glob("*.cuh"))
    assert compiler.DEFINES["layer_norm.cu"] == {"KILN_LN_WARPS": 8}
    for family, defines in compiler.DEFINES.items():
        options = compiler.nvrtc_options(ARCH, family=family)
        for name, value in defines.items():
            assert name in sources[family], f"{family} does not use {name}"
            assert f"#define {name}" not in sources[family] + headers and f"#ifndef {name}" not in sources[family]
            assert f"-D{name}={value}" in options


# Spills kept on purpose, each at exactly the bytes ptxas 13.0.88 reports (the device image's compiler, which
# pyproject.toml pins for CI: NVRTC 13.5 allocates otherwise), every one in the kernel the device timings
# were measured with: the split dK/dV at D = 128 with 32 query rows a tile (attention.py's DKDV_DEFAULT) took
# 0.87-0.89x the time of 16 rows on an H100 (benchmarks/results/device-logs/device-check-2026-12-06-h100-s1/
# and -s5/; 13.5 spills 8 bytes there); the split-tma dK/dV at D = 128 took 0.79x split's backward time
# (device-check-2026-12-07-h100-s14/; 13.5 does not spill there).
KEPT_SPILLS = {f"attention_bwd_{kernel}<{t}, {args}>": spill for t in ("__nv_bfloat16", "__half") for kernel, args, spill in (
    ("dkdv_tc", "128", {"registers": 255, "stack": 16, "spill_stores": 12, "spill_loads": 12}),
    ("dkdv_tma", "128", {"registers": 168, "stack": 16, "spill_stores": 16, "spill_loads": 16}),
    # the fused dK/dV/dQ kernel (KILN_ATTENTION_BWD=fused-tma; its timings: benchmarks/results/attention/NOTES.md)
    ("dkdv_tma", "64, true", {"registers": 168, "stack": 8, "spill_stores": 4, "spill_loads": 4}))}


@pytest.fixture(scope="module")
def compiled():
    return {}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_compiles_without_spills(family, compiled):
    result = compiler.compile_family(family, ARCH, verbose_ptxas=True, ptx=True)
    compiled[family] = result
    assert result.cubin[:4] == b"\x7fELF", "NVRTC did not return a cubin"
    assert set(result.lowered) == set(FAMILIES[family])
    report = compiler.ptxas_report(result.log)
    by_expr = {expr: report.get(mangled) for expr, mangled in result.lowered.items()}
    missing = [e for e, r in by_expr.items() if r is None]
    assert not missing, f"ptxas reported nothing for {missing}\n{result.log}"
    bad = {e: r for e, r in by_expr.items()
           if (r["spill_stores"] or r["spill_loads"] or r["stack"]) and r != KEPT_SPILLS.get(e)}
    assert not bad, "register spills or stack frames:\n" + "\n".join(f"  {e}: {r}" for e, r in sorted(bad.items()))
    for e, r in by_expr.items():
        assert r["registers"] is not None and r["registers"] <= 255, (e, r)


def _ptx_param_sizes(ptx: str, mangled: str) -> list[int]:
    """Each parameter's bytes from the PTX entry's declarations (`.param .u32 x`, `.param .align 64 .b8 x[128]`)."""
    start = ptx.index(f".entry {mangled}(")
    sizes = []
    for decl in re.findall(r"\.param\s+([^,]*)", ptx[start:ptx.index(")", start)]):
        bits = int(re.match(r"(?:\.align\s+\d+\s+)?\.[a-z]+(\d+)", decl).group(1))
        count = re.search(r"\[(\d+)\]\s*$", decl.strip())
        sizes.append(bits // 8 * (int(count.group(1)) if count else 1))
    return sizes


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_cubins_parameter_table_matches_the_ptx(family, compiled):
    """compiler.param_sizes (what KILN_CHECK_LAUNCHES checks every launch against) reads the cubin's
    .nv.info tables; the PTX's entry declarations say the same independently, for every kernel."""
    result = compiled.get(family) or compiler.compile_family(family, ARCH, ptx=True)
    for expr, mangled in result.lowered.items():
        assert compiler.param_sizes(result.cubin, mangled) == _ptx_param_sizes(result.ptx, mangled), expr
    if family == "attention.cu":  # one known by heart: 9 pointers, 5 ints, the scale, 4 layouts of 3 strides
        fused = compiler.param_sizes(result.cubin, result.lowered["attention_bwd_fused_tc<__nv_bfloat16, 64>"])
        assert fused == [8] * 9 + [4] * 5 + [4] + [8] * 12
        tma = compiler.param_sizes(result.cubin, result.lowered["attention_fwd_tma<__nv_bfloat16, 64, true>"])
        assert tma[:3] == [128] * 3  # the TMA maps, by value


def test_compile_error_names_the_family_and_carries_the_log(tmp_path, monkeypatch):
    monkeypatch.setattr(compiler, "KERNEL_DIR", tmp_path)
    monkeypatch.setitem(compiler.FAMILIES, "broken.cu", ["broken<float>"])
    (tmp_path / "broken.cu").write_text("template <typename T> __global__ void broken(T* x) { x[0] = undefined_name; }\n")
    with pytest.raises(KernelCompileError) as e:
        compiler.compile_family("broken.cu", ARCH)
    assert "broken.cu" in str(e.value) and "undefined_name" in str(e.value)


def test_ptxas_report_parses_spills():
    log = ("ptxas info    : Compiling entry function '_Z1kPf' for 'sm_90a'\n"
           "ptxas info    : Function properties for _Z1kPf\n"
           "ptxas         .     16 bytes stack frame, 12 bytes spill stores, 8 bytes spill loads\n"
           "ptxas info    : Used 64 registers, used 0 barriers\n")
    assert compiler.ptxas_report(log) == {"_Z1kPf": {"registers": 64, "stack": 16, "spill_stores": 12,
                                                     "spill_loads": 8}}


def test_cache_key_changes_with_source(tmp_path, monkeypatch):
    monkeypatch.setattr(compiler, "KERNEL_DIR", tmp_path)
    monkeypatch.setitem(compiler.FAMILIES, "k.cu", ["k"])
    (tmp_path / "k.cu").write_text("__global__ void k() {}\n")
    a = compiler.cache_key("k.cu", ARCH)
    (tmp_path / "k.cu").write_text("__global__ void k() { }\n")
    assert compiler.cache_key("k.cu", ARCH) != a
    assert compiler.cache_key("k.cu", "sm_80") != compiler.cache_key("k.cu", ARCH)


def test_compiling_leaves_python_bytes_alone():
    """NVRTC writes the log and the cubin into the buffers it is given. Given b" " * 1 (CPython's
    cached one-byte b" "), the empty log's terminator turned every later b" " * n and bytes([32])
    of the process into zeros: on the H200 that zeroed checkpoint headers' padding and broke
    `import torch` in the benchmark (2026-12-03)."""
    family = compiler.compile_family("elementwise.cu", ARCH)
    assert family.log == ""  # the empty log: the one-byte buffer that hit the cached b" "
    n = len(family.lowered)   # runtime values, not literals the compiler would fold
    assert bytes([32]) == b"\x20" and b" " * n == bytes([32] * n)


def test_attention_tma_launch_registers_cover_the_setmaxnreg_split():
    """attention_fwd_tma's and the split-tma backward's consumers raise their registers with setmaxnreg.inc,
    which waits until the block's pool (the registers ptxas gives each of the 384 threads at launch) holds
    them: a launch count below the producer's 128 x 24 plus the consumers' 256 x 240 would hang every launch."""
    from kiln.backend.cuda import attention
    exprs = [e for e in FAMILIES["attention.cu"] if e.startswith("attention_") and "_tma<" in e]
    assert {e.split("<")[0] for e in exprs} == {"attention_fwd_tma", "attention_bwd_dkdv_tma", "attention_bwd_dq_tma"}
    result = compiler.compile_family("attention.cu", ARCH, name_expressions=exprs, verbose_ptxas=True)
    report = compiler.ptxas_report(result.log)
    need = 128 * attention.TMA_PRODUCER_REGS + (attention.TMA_THREADS - 128) * attention.TMA_CONSUMER_REGS
    for e in exprs:
        regs = report[result.lowered[e]]["registers"]
        assert attention.TMA_THREADS * regs >= need, f"{e}: {regs} registers at launch, the split needs {need}"


def test_attention_dkdv_tuning_knob_compiles_without_spills():
    """KILN_ATTENTION_DKDV_TILES (read at import) changes the split dK/dV kernel's rows and bound only: the
    fused backward keeps its own 64 rows at D = 64 (a 32-row tile once broke the family's compile there), and
    16 rows at D = 128 (the default before 2026-12-06) take back the 32 rows' spill."""
    import json
    import os
    import subprocess
    import sys
    code = ("import json; from kiln.backend.cuda import attention, compiler; "
            "e = [x for x in compiler.FAMILIES['attention.cu'] if 'dkdv_tc' in x or 'fused_tc' in x]; "
            "r = compiler.compile_family('attention.cu', 'sm_90a', name_expressions=e, verbose_ptxas=True); "
            "rep = compiler.ptxas_report(r.log); print(json.dumps({x: rep[m] for x, m in r.lowered.items()}))")
    env = {**os.environ, "KILN_ATTENTION_DKDV_TILES": "64:32x3,128:16x1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.splitlines()[-1])
    assert any("fused_tc" in x for x in report) and any("dkdv_tc" in x for x in report)
    for expr, r in report.items():
        assert r["spill_stores"] == r["spill_loads"] == 0, f"{expr}: {r}"
        if "dkdv_tc" in expr and ", 64>" in expr:
            assert r["registers"] <= 168, f"{expr}: 3 blocks of 128 threads an SM need <= 168 registers, got {r}"
