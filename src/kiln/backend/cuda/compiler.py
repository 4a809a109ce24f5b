"""NVRTC compilation of kiln's kernel families and a disk cache of the cubins.

Each `kernels/<family>.cu` is compiled once per process and device architecture, with the
template instantiations and block constants that its launcher module (`<family>.py` beside it)
registers with `register_family` (compile-time specialisation on dtype and on shapes, as the
paper does; a constant both sides use is defined once, in Python, and passed as `-D`). Cubins
are cached on disk under a hash of the source, the shared headers, the options and the NVRTC
version, so a second process loads instead of compiling. Launching is launch.py's.
The same `compile_family` runs on a CPU-only machine (tests/test_kernel_compile.py) to catch
compile errors and register spills before any device time is spent.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from kiln.errors import KilnError

KERNEL_DIR = Path(__file__).parent / "kernels"

# The C++ type of each dtype the kernels are instantiated for.
CTYPES = {"float32": "float", "bfloat16": "__nv_bfloat16", "float16": "__half"}
IDX_CTYPES = {"int64": "long long", "int32": "int"}

FLOAT_CTYPES = ("float", "__nv_bfloat16", "__half")
INDEX_CTYPES = ("long long", "int")

# family file -> the name expressions its launcher launches, and the -D constants it compiles
# with; filled by each family module's register_family (importing kiln.backend.cuda loads all).
FAMILIES: dict[str, list[str]] = {}
DEFINES: dict[str, dict[str, int]] = {}


def register_family(family: str, expressions, defines: dict | None = None) -> None:
    """Declare kernels/<family>'s instantiations and its block constants (passed as -DNAME=value)."""
    FAMILIES[family] = list(expressions)
    DEFINES[family] = dict(defines or {})


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


def nvrtc_options(arch: str, verbose_ptxas: bool = False, family: str | None = None) -> list[str]:
    """The options a family is compiled with (no fast-math: fp32 kernels must match 1e-5), its
    registered constants included."""
    opts = [f"--gpu-architecture={arch}", "-std=c++17", "--device-as-default-execution-space",
            f"-I{KERNEL_DIR}"] + [f"-I{d}" for d in cuda_include_dirs()]
    opts += [f"-D{name}={value}" for name, value in sorted(DEFINES.get(family, {}).items())]
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
    """A family's cubin, the mangled name of each name expression and NVRTC's log (and its PTX, when asked for)."""

    def __init__(self, family: str, cubin: bytes, lowered: dict, log: str, ptx: str | None = None):
        self.family = family
        self.cubin = cubin
        self.lowered = lowered
        self.log = log
        self.ptx = ptx


def _check(result, what, family, log=""):
    from cuda.bindings import nvrtc
    err = result[0] if isinstance(result, tuple) else result
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        name = nvrtc.nvrtcGetErrorString(err)[1].decode()
        raise KernelCompileError(f"NVRTC {what} failed for kernel family {family}: {name}\n{log}")
    return result[1:] if isinstance(result, tuple) and len(result) > 1 else None


def compile_family(family: str, arch: str = "sm_90a", name_expressions=None,
                   verbose_ptxas: bool = False, extra_options=(), ptx: bool = False) -> CompiledFamily:
    """Compile kernels/<family> with NVRTC (cuda.bindings) to a cubin (and keep the PTX when `ptx`); raise
    KernelCompileError with the log."""
    from cuda.bindings import nvrtc
    source = family_source(family)
    exprs = list(FAMILIES[family] if name_expressions is None else name_expressions)
    opts = nvrtc_options(arch, verbose_ptxas, family) + list(extra_options)
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
        text = None
        if ptx:
            buf = bytearray(_check(nvrtc.nvrtcGetPTXSize(prog), "PTX size", family)[0])
            _check(nvrtc.nvrtcGetPTX(prog, buf), "PTX", family)
            text = bytes(buf).rstrip(b"\x00").decode()
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return CompiledFamily(family, cubin, lowered, log, text)


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


_EIATTR_KPARAM_INFO = 0x17  # cuda's nvinfo attribute of one kernel parameter
_EIFMT_SVAL = 0x04           # an attribute with a 16-bit size and that many bytes of value


def _elf_section(elf: bytes, name: str) -> bytes | None:
    """The contents of the section called `name` in a 64-bit little-endian ELF (a cubin), or None."""
    shoff = int.from_bytes(elf[0x28:0x30], "little")
    entsize, count, names_at = (int.from_bytes(elf[o:o + 2], "little") for o in (0x3A, 0x3C, 0x3E))

    def field(i, at, width):  # a field of section header i
        start = shoff + i * entsize + at
        return int.from_bytes(elf[start:start + width], "little")

    names = field(names_at, 24, 8)  # the section names' table: its file offset
    want = name.encode() + b"\0"
    for i in range(count):
        at = names + field(i, 0, 4)
        if elf[at:at + len(want)] == want:
            return elf[field(i, 24, 8):field(i, 24, 8) + field(i, 32, 8)]
    return None


def param_sizes(cubin: bytes, mangled: str) -> list[int] | None:
    """The byte size of each parameter of kernel `mangled`, in order, from the cubin's `.nv.info.<kernel>`
    section (EIATTR_KPARAM_INFO records: ordinal, offset, and the size in bits 18-31 of their flags), or None
    where the table is missing or does not describe parameters 0..n-1 laid out without overlap."""
    info = _elf_section(cubin, f".nv.info.{mangled}")
    if info is None:
        return None
    params, i = {}, 0
    while i + 4 <= len(info):
        fmt, attr = info[i], info[i + 1]
        if fmt != _EIFMT_SVAL:
            i += 4  # the other formats carry their value in these 4 bytes
            continue
        size = int.from_bytes(info[i + 2:i + 4], "little")
        value = info[i + 4:i + 4 + size]
        if attr == _EIATTR_KPARAM_INFO and size >= 12:
            ordinal, offset = (int.from_bytes(value[o:o + 2], "little") for o in (4, 6))
            params[ordinal] = (offset, (int.from_bytes(value[8:12], "little") >> 18) & 0x3FFF)
        i += 4 + size
    if sorted(params) != list(range(len(params))):
        return None
    layout = [params[k] for k in range(len(params))]
    if any(o + n > o2 for (o, n), (o2, _) in zip(layout, layout[1:])):
        return None
    return [n for _, n in layout]


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
    for part in (family, family_source(family), _headers_digest(), " ".join(nvrtc_options(arch, family=family)),
                 "\n".join(FAMILIES[family]), _nvrtc_version()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def load_or_compile(family: str, arch: str) -> CompiledFamily:
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
