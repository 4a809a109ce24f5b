"""NVRTC compilation of kiln's kernel families, a disk cache of the cubins, and kernel launch.

Each `kernels/<family>.cu` is compiled once per process and device architecture, with the
template instantiations listed in `FAMILIES` (compile-time specialisation on dtype and on
shapes, as the paper does). Cubins are cached on disk under a hash of the source, the shared
headers, the options and the NVRTC version, so a second process loads instead of compiling.
The same `compile_family` runs on a CPU-only machine (tests/test_kernel_compile.py) to catch
compile errors and register spills before any device time is spent.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from pathlib import Path

import numpy as np

from kiln.errors import KilnError

KERNEL_DIR = Path(__file__).parent / "kernels"

# The C++ type of each dtype the kernels are instantiated for.
CTYPES = {"float32": "float", "bfloat16": "__nv_bfloat16", "float16": "__half"}
IDX_CTYPES = {"int64": "long long", "int32": "int"}

_F = ("float", "__nv_bfloat16", "__half")
_IDX = ("long long", "int")
# LayerNorm widths compiled with the row held in registers; others take the generic kernel.
LAYER_NORM_WIDTHS = (256, 512, 768, 1024, 1536, 2048, 3072, 4096)
# The backward holds four row-sized register arrays, so it is specialised only up to 1024.
LAYER_NORM_BWD_WIDTHS = (256, 512, 768, 1024)
# The forward of the residual add fused with a LayerNorm (add_layer_norm_fwd_reg) also holds the
# row, plus a second input in flight: at 4096 the fp16 instantiation spills (224 bytes), so
# 4096 takes the generic kernel. Its backward is layer_norm_bwd_reg's, widths as above.
ADD_LAYER_NORM_WIDTHS = tuple(c for c in LAYER_NORM_WIDTHS if c <= 3072)
ATTENTION_HEAD_DIMS = (32, 64, 128)


def _layer_norm_exprs():
    # layer_norm_* and add_layer_norm_* (the residual add fused with the LayerNorm after it);
    # dweight/dbias of both go through layer_norm_dwdb_*.
    out = []
    for t in _F:
        for c in LAYER_NORM_WIDTHS:
            if c % (32 * (16 // (4 if t == "float" else 2))) == 0:
                out.append(f"layer_norm_fwd_reg<{t}, {c}>")
                if c in ADD_LAYER_NORM_WIDTHS:
                    out.append(f"add_layer_norm_fwd_reg<{t}, {c}>")
                if c in LAYER_NORM_BWD_WIDTHS:
                    out += [f"layer_norm_bwd_reg<{t}, {c}>", f"add_layer_norm_bwd_reg<{t}, {c}>"]
        out += [f"layer_norm_fwd_any<{t}>", f"layer_norm_bwd_any<{t}>", f"add_layer_norm_fwd_any<{t}>",
                f"add_layer_norm_bwd_any<{t}>", f"layer_norm_dwdb_any<{t}>", f"layer_norm_dwdb_finish<{t}>"]
    return out


def _attention_exprs():
    # float32 runs on the CUDA cores (strict fp32); bfloat16 and float16 on the tensor cores.
    out = []
    for d in ATTENTION_HEAD_DIMS:
        out += [f"attention_fwd<float, {d}>", f"attention_bwd_dkdv<float, {d}>",
                f"attention_bwd_dq<float, {d}>"]
        for t in _F[1:]:
            out += [f"attention_fwd_tc<{t}, {d}>", f"attention_bwd_dkdv_tc<{t}, {d}>",
                    f"attention_bwd_dq_tc<{t}, {d}>"]
        out += [f"attention_bwd_delta<{t}, {d}>" for t in _F]
    return out


# family file -> name expressions the backend launches (the compile test instantiates these).
FAMILIES = {
    "gelu.cu": [f"gelu_fwd<{t}>" for t in _F] + [f"gelu_bwd<{t}>" for t in _F],
    "layer_norm.cu": _layer_norm_exprs(),
    "softmax.cu": [f"{k}<{t}>" for k in ("softmax_fwd", "softmax_bwd", "log_softmax_fwd",
                                         "log_softmax_bwd") for t in _F],
    "cross_entropy.cu": ([f"cross_entropy_fwd<{t}, {i}>" for t in _F for i in _IDX]
                         + [f"cross_entropy_bwd<{t}, {i}>" for t in _F for i in _IDX]
                         + [f"cross_entropy_count<{i}>" for i in _IDX]
                         + ["cross_entropy_mean"]),
    "attention.cu": _attention_exprs(),
    "embedding.cu": ([f"embedding_fwd<{t}, {i}>" for t in _F for i in _IDX]
                     + [f"embedding_bwd<{t}, {i}>" for t in _F for i in _IDX]),
    "adamw.cu": ([f"adamw_multi<{p}, {g}>" for p, g in (("float", "float"),
                                                          ("__nv_bfloat16", "__nv_bfloat16"),
                                                          ("__half", "__half"),
                                                          ("float", "__nv_bfloat16"))]
                 + [f"sumsq_multi<{t}>" for t in _F] + ["sumsq_finish", "adamw_set_hyper"]
                 + [f"scale_multi<{t}>" for t in _F]),
    "elementwise.cu": [f"add<{t}>" for t in _F] + [f"cast<{a}, {b}>" for a in _F for b in _F if a != b],
    "random.cu": ([f"philox_uniform<{t}>" for t in _F] + [f"philox_normal<{t}>" for t in _F]
                  + [f"dropout_fwd<{t}>" for t in _F]),
}


class KernelCompileError(KilnError):
    """NVRTC refused a kernel family: the message carries the family, the options and the log."""


def cuda_include_dirs() -> list[str]:
    """Directories holding cuda_bf16.h and friends: the pip `nvidia` wheels, then the toolkit."""
    dirs = []
    try:
        import nvidia  # namespace package of the nvidia-* wheels
        for base in list(nvidia.__path__):
            for sub in ("cu13/include", "cuda_runtime/include", "cuda_nvrtc/include"):
                p = Path(base) / sub
                if (p / "cuda_bf16.h").exists() or (p / "cuda_runtime.h").exists():
                    dirs.append(str(p))
    except ImportError:
        pass
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            dirs.append(os.path.join(os.environ[env], "include"))
    dirs.append("/usr/local/cuda/include")
    seen, out = set(), []
    for d in dirs:
        if d not in seen and os.path.isdir(d):
            seen.add(d)
            out.append(d)
    return out


def nvrtc_options(arch: str, verbose_ptxas: bool = False) -> list[str]:
    """The options every family is compiled with (no fast-math: fp32 kernels must match 1e-5)."""
    opts = [f"--gpu-architecture={arch}", "-std=c++17", "--device-as-default-execution-space",
            f"-I{KERNEL_DIR}"] + [f"-I{d}" for d in cuda_include_dirs()]
    if verbose_ptxas:
        opts.append("--ptxas-options=-v")
    return opts


def family_source(family: str) -> str:
    path = KERNEL_DIR / family
    if family not in FAMILIES or not path.exists():
        raise KilnError(f"unknown kernel family {family!r}; known: {', '.join(sorted(FAMILIES))}")
    return path.read_text()


def _headers_digest() -> str:
    h = hashlib.sha256()
    for p in sorted(KERNEL_DIR.glob("*.cuh")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


class CompiledFamily:
    """A family's cubin, the mangled name of each name expression and NVRTC's log."""

    def __init__(self, family: str, cubin: bytes, lowered: dict, log: str):
        self.family = family
        self.cubin = cubin
        self.lowered = lowered
        self.log = log


def _check(result, what, family, log=""):
    from cuda.bindings import nvrtc
    err = result[0] if isinstance(result, tuple) else result
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        name = nvrtc.nvrtcGetErrorString(err)[1].decode()
        raise KernelCompileError(f"NVRTC {what} failed for kernel family {family}: {name}\n{log}")
    return result[1:] if isinstance(result, tuple) and len(result) > 1 else None


def compile_family(family: str, arch: str = "sm_90a", name_expressions=None,
                   verbose_ptxas: bool = False, extra_options=()) -> CompiledFamily:
    """Compile kernels/<family> with NVRTC (cuda.bindings) to a cubin; raise KernelCompileError with the log."""
    from cuda.bindings import nvrtc
    source = family_source(family)
    exprs = list(FAMILIES[family] if name_expressions is None else name_expressions)
    opts = nvrtc_options(arch, verbose_ptxas) + list(extra_options)
    prog = _check(nvrtc.nvrtcCreateProgram(source.encode(), family.encode(), 0, [], []),
                  "create", family)[0]
    try:
        for e in exprs:
            _check(nvrtc.nvrtcAddNameExpression(prog, e.encode()), "add name expression", family)
        res = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "log size", family)[0]
        # NVRTC writes into the buffer it is given: never a bytes object. b" " * 1 is CPython's
        # cached b" ", and an empty log ("\0") written into it turned every later b" " * n and
        # bytes([32]) of the process into zeros (checkpoint headers' padding, torch's op schemas:
        # the "corrupt checkpoints of CUDA runs" of 2026-12-03)
        buf = bytearray(size)
        _check(nvrtc.nvrtcGetProgramLog(prog, buf), "log", family)
        log = bytes(buf).rstrip(b"\x00 ").decode(errors="replace")
        _check(res, "compile", family, f"options: {' '.join(opts)}\n{log}")
        lowered = {}
        for e in exprs:
            name = _check(nvrtc.nvrtcGetLoweredName(prog, e.encode()), "lowered name", family)[0]
            lowered[e] = name.decode() if isinstance(name, bytes) else str(name)
        n = _check(nvrtc.nvrtcGetCUBINSize(prog), "cubin size", family)[0]
        cubin = bytearray(n)
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "cubin", family)
        cubin = bytes(cubin)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return CompiledFamily(family, cubin, lowered, log)


_PTXAS_FUNC = re.compile(r"Compiling entry function '([^']+)'")
_PTXAS_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")


def ptxas_report(log: str) -> dict:
    """{mangled kernel: {registers, stack, spill_stores, spill_loads}} from a ptxas -v log."""
    out: dict = {}
    cur = None
    for line in log.splitlines():
        m = _PTXAS_FUNC.search(line)
        if m:
            cur = m.group(1)
            out[cur] = {"registers": None, "stack": 0, "spill_stores": 0, "spill_loads": 0}
            continue
        if cur is None:
            continue
        m = _PTXAS_STACK.search(line)
        if m:
            out[cur].update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                            spill_loads=int(m.group(3)))
        m = _PTXAS_REGS.search(line)
        if m:
            out[cur]["registers"] = int(m.group(1))
    return out


def _nvrtc_version() -> str:
    try:
        from cuda.bindings import nvrtc
        return "%d.%d" % tuple(nvrtc.nvrtcVersion()[1:])
    except ImportError:
        return "cupy"


def cache_dir() -> Path:
    base = os.environ.get("KILN_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kiln", "kernels")
    return Path(base)


def cache_key(family: str, arch: str) -> str:
    h = hashlib.sha256()
    for part in (family, family_source(family), _headers_digest(), " ".join(nvrtc_options(arch)),
                 "\n".join(FAMILIES[family]), _nvrtc_version()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def _load_or_compile(family: str, arch: str) -> CompiledFamily:
    key = cache_key(family, arch)
    d = cache_dir()
    cubin_path, names_path = d / f"{family}-{key}.cubin", d / f"{family}-{key}.json"
    if cubin_path.exists() and names_path.exists():
        try:
            return CompiledFamily(family, cubin_path.read_bytes(), json.loads(names_path.read_text()), "")
        except (OSError, ValueError):
            pass  # a torn cache entry: compile again and overwrite it
    compiled = compile_family(family, arch)
    try:
        d.mkdir(parents=True, exist_ok=True)
        for path, data in ((cubin_path, compiled.cubin), (names_path, json.dumps(compiled.lowered).encode())):
            tmp = path.with_suffix(path.suffix + f".{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache is not an error: the kernels still run
    return compiled


class Kernel:
    """One compiled kernel; calling it launches on kiln's stream."""

    def __init__(self, family: str, expr: str, function):
        self.family = family
        self.expr = expr
        self._fn = function

    def __call__(self, grid, block, args, shared_mem: int = 0):
        from kiln.backend.cuda import device
        grid = tuple(int(g) for g in grid) if isinstance(grid, tuple) else (int(grid),)
        block = tuple(int(b) for b in block) if isinstance(block, tuple) else (int(block),)
        if any(g <= 0 for g in grid):
            return  # an empty launch (zero rows): nothing to do
        self._fn(grid, block, args, shared_mem=shared_mem, stream=device.stream())


_modules: dict = {}
_lock = threading.Lock()


def _load_module(family: str):
    """The loaded module of a family for the current device: (kind, module, lowered names)."""
    from kiln.backend.cuda import device
    arch = device.arch()
    key = (family, device.device_id())
    with _lock:
        mod = _modules.get(key)
        if mod is None:
            mod = _load_module_uncached(family, arch)
            _modules[key] = mod
    return mod


def _load_module_uncached(family, arch):
    import cupy
    try:
        compiled = _load_or_compile(family, arch)
    except KernelCompileError:
        raise
    except (ImportError, OSError, RuntimeError):
        compiled = None  # no usable cuda.bindings NVRTC here: let CuPy's NVRTC compile it
    if compiled is not None:
        module = cupy.cuda.function.Module()
        module.load(compiled.cubin)
        return ("module", module, compiled.lowered)
    # CuPy compiles the same source with the same options (and caches the result on disk in
    # ~/.cupy/kernel_cache, keyed by source and options).
    opts = tuple(o for o in nvrtc_options(arch) if not o.startswith("--gpu-architecture"))
    try:
        module = cupy.RawModule(code=family_source(family), options=opts,
                                name_expressions=list(FAMILIES[family]))
        module.compile()
    except Exception as e:  # CuPy's CompileException carries the log in its message
        raise KernelCompileError(f"NVRTC (through CuPy) failed for kernel family {family}: {e}") from e
    return ("raw", module, None)


def get_kernel(family: str, expr: str) -> Kernel:
    """The kernel `expr` (a name expression listed in FAMILIES[family]), compiled at first use."""
    if expr not in FAMILIES.get(family, ()):
        raise KilnError(f"kernel {expr!r} is not instantiated in {family}; add it to FAMILIES")
    from kiln.backend.cuda import device
    cache_k = (family, expr, device.device_id())
    k = _kernels.get(cache_k)
    if k is None:
        kind, module, lowered = _load_module(family)
        fn = module.get_function(lowered[expr]) if kind == "module" else module.get_function(expr)
        k = Kernel(family, expr, fn)
        _kernels[cache_k] = k
    return k


_kernels: dict = {}


def i32(x) -> np.int32:
    return np.int32(x)


def i64(x) -> np.int64:
    return np.int64(x)


def f32(x) -> np.float32:
    return np.float32(x)
