"""Where kiln's kernels are launched: `get_kernel` loads a compiled family (compiler.py) onto the
device and a `Kernel` call launches on kiln's stream (the one `use_stream` names, if any); plus
the plumbing the family launchers share: dtype dispatch, alignment, grids, scalar arguments, fallbacks.

A launcher launches a compiled kernel when the arrays' dtype has an instantiation (float32,
bfloat16, float16); float64 and other dtypes are reference-only on the GPU and run the CPU
backend's kernel on a host copy (correct, slow, and never on a training hot path).
"""

from __future__ import annotations

import os
import threading
import warnings

import numpy as np

from kiln.backend.cuda import device as rt
from kiln.backend.cuda.compiler import (
    CTYPES,
    FAMILIES,
    IDX_CTYPES,
    KernelCompileError,
    family_source,
    load_or_compile,
    nvrtc_options,
    param_sizes,
)
from kiln.errors import KilnError

THREADS = 256


def ctype(dtype) -> str | None:
    """The kernels' C++ type for a float dtype, or None when no kernel is instantiated for it."""
    return CTYPES.get(np.dtype(dtype).name)


def idx_ctype(dtype) -> str | None:
    return IDX_CTYPES.get(np.dtype(dtype).name)


def aligned16(*arrays) -> bool:
    """True when every array (None is skipped) starts on a 16-byte boundary (Pack loads are legal)."""
    return all(a is None or rt.ptr(a) % 16 == 0 for a in arrays)


def cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


def contiguous(a):
    """a itself when C-contiguous, else a contiguous copy (kernels index rows densely)."""
    return a if a.flags.c_contiguous else rt.cupy().ascontiguousarray(a)


# A column reduction over rows (a bias or LayerNorm-parameter gradient) in two deterministic steps
# (kernels/column_sum.cuh): blocks of COLUMN_PART_THREADS threads each sum ROWS_PER_PART rows of their
# columns into one fp32 row of partial sums, then column_sum_finish adds the rows in a fixed order.
ROWS_PER_PART = 32        # ~12 blocks an SM over GPT-2's [16384, 3072] gradients: loads in flight
COLUMN_PART_THREADS = 128
FINISH_COLUMNS = 8        # column_sum_finish: a block's columns (one 32-byte sector of each partial row)
FINISH_THREADS = 256      # its (column lane, part lane) threads: 128 part lanes of float4, or 32 of floats
_MAX_GRID_Y = 65535


def column_parts(rows: int, c: int, vec_pack: int):
    """(grid, rows per part, parts) of a column_sum_part-style kernel over [rows, c]; vec_pack: the
    columns a thread owns (its 16-byte pack, or 1)."""
    per_part = max(ROWS_PER_PART, cdiv(rows, _MAX_GRID_Y))
    parts = cdiv(rows, per_part)
    return (cdiv(cdiv(c, vec_pack), COLUMN_PART_THREADS), parts), per_part, parts


def column_sum_finish_kernels(ctypes) -> list[str]:
    """The column_sum_finish instantiations a family that launches it registers, for output types ctypes."""
    return [f"column_sum_finish<{t}, {FINISH_COLUMNS}, {v}>" for t in ctypes for v in ("true", "false")]


def column_sum_finish(family: str, partial, parts: int, c: int, outs) -> None:
    """outs[i] = the column sums of partial's fp32 rows [i * parts, (i + 1) * parts), in a fixed order, for
    each of the one or two outputs (None: not wanted), all of one dtype (family: the kernel file that
    registers column_sum_finish_kernels for it)."""
    dtype = next(o.dtype for o in outs if o is not None)
    vec = "true" if c % 4 == 0 and aligned16(partial) else "false"
    get_kernel(family, f"column_sum_finish<{ctype(dtype)}, {FINISH_COLUMNS}, {vec}>")(
        (cdiv(c, FINISH_COLUMNS), len(outs)), (FINISH_THREADS,),
        (partial, i32(parts), i32(c), *outs, *(None,) * (2 - len(outs))))


def as_index(a):
    """An index array the kernels take (int64 or int32), contiguous."""
    cp = rt.cupy()
    a = contiguous(a)
    if idx_ctype(a.dtype) is None:
        a = a.astype(cp.int64)
    return a


def to_host(x):
    """A host copy of a device array (lists and tuples element by element; anything else as it is), read
    on CuPy's current stream once the work queued there has run."""
    if isinstance(x, (list, tuple)):
        return type(x)(to_host(v) for v in x)
    if hasattr(x, "get") and hasattr(x, "dtype") and not isinstance(x, (np.ndarray, np.generic)):
        return x.get()
    return x


def to_device(x):
    """Device copies of the host arrays in x (lists and tuples element by element), queued on CuPy's
    current stream."""
    if isinstance(x, np.ndarray):
        return rt.cupy().asarray(x)
    if isinstance(x, (list, tuple)):
        return type(x)(to_device(v) for v in x)
    return x


def cpu_fallback(fn, *args):
    """Run the CPU backend's `fn` on host copies of the device arrays and bring the results back. It says
    so (a RuntimeWarning, once per op and arguments): on a GPU run that op is slow, and a training step
    that uses it cannot be captured as a CUDA graph, so the user should hear why.

    Its copies are ordered with kiln's stream as a kernel launch is: it makes that stream CuPy's current
    one first, so the host reads the arguments after the work that writes them and the results' uploads
    come before the work that reads them. (On 2026-12-05 on the H200 the legacy null stream was current
    here, left so by CuPy's stream stack, see device.compute_stream: the packed-views test read zeros.)"""
    arrays = ", ".join(f"{a.dtype} {list(a.shape)}" for a in args if hasattr(a, "shape") and hasattr(a, "dtype"))
    warnings.warn(f"kiln: {fn.__name__} has no CUDA kernel for these arguments ({arrays}): it runs on the CPU, "
                  "with copies both ways, and a training step that uses it runs op by op", RuntimeWarning, stacklevel=3)
    rt.stream()
    return to_device(fn(*[to_host(a) for a in args]))


STATIC_SHARED_LIMIT = 48 * 1024  # dynamic shared memory past this needs the kernel's opt-in attribute
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # cuda.h's CUfunction_attribute


def set_max_dynamic_shared(function, nbytes: int) -> None:
    """cuFuncSetAttribute(MaxDynamicSharedMemorySize) on a CuPy Function (a cubin module's) or the Function
    inside a RawKernel (a RawModule's). CuPy's Function has no property for it: only RawKernel does."""
    import cupy
    func = getattr(function, "kernel", function)
    cupy.cuda.driver.funcSetAttribute(func.ptr, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, int(nbytes))


def argument_bytes(a) -> int | None:
    """The bytes CuPy hands the driver for a kernel argument (cupy/cuda/function.pyx's _pointer): 8 for None or
    a device array, a NumPy scalar's itemsize, a one-element host array's itemsize (by value: a TMA map), 8 for
    a Python int, bool or float (int64, float64); None for anything else."""
    if a is None or hasattr(a, "__cuda_array_interface__"):
        return 8
    if isinstance(a, np.ndarray):
        return a.itemsize if a.size == 1 else None
    if isinstance(a, np.generic):
        return a.itemsize
    if isinstance(a, (int, float)):
        return 8
    return None


def _misfit(a, n: int) -> bool:
    """The driver copies a parameter's n bytes from its argument's value: fewer bytes there read past it, and a
    float of another width is another number (an integer wider than its parameter is read by its low bytes:
    the same value, little-endian)."""
    got = argument_bytes(a)
    if got is None:
        return False
    return got < n or (got != n and isinstance(a, (float, np.floating)))


def check_arguments(expr: str, sizes: list[int], args) -> None:
    """KilnError unless args are as many as the kernel's parameters and each one fits its parameter (_misfit):
    otherwise a slip in an argument list is silent (every parameter after a missing one shifted, garbage
    read past a 4-byte scalar where 8 are taken)."""
    if len(args) != len(sizes):
        raise KilnError(f"kernel {expr} takes {len(sizes)} arguments, this launch passes {len(args)}")
    wrong = [f"argument {i} is {argument_bytes(a)} bytes ({type(a).__name__}), its parameter {n}"
             for i, (a, n) in enumerate(zip(args, sizes)) if _misfit(a, n)]
    if wrong:
        raise KilnError(f"kernel {expr}: " + "; ".join(wrong))


class Kernel:
    """One compiled kernel; calling it launches on kiln's stream. With `sizes` (its parameters' bytes, from the
    cubin: KILN_CHECK_LAUNCHES=1) every launch's arguments are checked against them first."""

    def __init__(self, family: str, expr: str, function, sizes: list[int] | None = None):
        self.family = family
        self.expr = expr
        self._fn = function
        self._sizes = sizes
        self._dynamic_shared = STATIC_SHARED_LIMIT  # what the kernel may use without opting in

    def __call__(self, grid, block, args, shared_mem: int = 0):
        from kiln.backend.cuda import device
        grid = tuple(int(g) for g in grid) if isinstance(grid, tuple) else (int(grid),)
        block = tuple(int(b) for b in block) if isinstance(block, tuple) else (int(block),)
        if self._sizes is not None:
            check_arguments(self.expr, self._sizes, args)
        if any(g <= 0 for g in grid):
            return  # an empty launch (zero rows): nothing to do
        if shared_mem > self._dynamic_shared:  # cudaFuncSetAttribute(MaxDynamicSharedMemorySize), once
            set_max_dynamic_shared(self._fn, shared_mem)
            self._dynamic_shared = int(shared_mem)
        self._fn(grid, block, args, shared_mem=shared_mem, stream=device.stream())


_modules: dict = {}
_lock = threading.Lock()


def _load_module(family: str):
    """The loaded module of a family for the current device: (kind, module, its CompiledFamily or None)."""
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
        compiled = load_or_compile(family, arch)
    except KernelCompileError:
        raise
    except (ImportError, OSError, RuntimeError):
        compiled = None  # no usable cuda.bindings NVRTC here: let CuPy's NVRTC compile it
    if compiled is not None:
        module = cupy.cuda.function.Module()
        module.load(compiled.cubin)
        return ("module", module, compiled)
    # CuPy compiles the same source with the same options (and caches the result on disk in
    # ~/.cupy/kernel_cache, keyed by source and options).
    opts = tuple(o for o in nvrtc_options(arch, family=family) if not o.startswith("--gpu-architecture"))
    try:
        module = cupy.RawModule(code=family_source(family), options=opts,
                                name_expressions=list(FAMILIES[family]))
        module.compile()
    except Exception as e:  # CuPy's CompileException carries the log in its message
        raise KernelCompileError(f"NVRTC (through CuPy) failed for kernel family {family}: {e}") from e
    return ("raw", module, None)


def get_kernel(family: str, expr: str) -> Kernel:
    """The kernel `expr` (a name expression its family module registered), compiled at first use."""
    if expr not in FAMILIES.get(family, ()):
        raise KilnError(f"kernel {expr!r} is not instantiated in {family}; add it to the family's register_family list")
    from kiln.backend.cuda import device
    cache_k = (family, expr, device.device_id())
    k = _kernels.get(cache_k)
    if k is None:
        kind, module, compiled = _load_module(family)
        if kind == "module":
            mangled = compiled.lowered[expr]
            sizes = param_sizes(compiled.cubin, mangled) if os.environ.get("KILN_CHECK_LAUNCHES") == "1" else None
            k = Kernel(family, expr, module.get_function(mangled), sizes)
        else:  # CuPy compiled it: no cubin here to read the parameters from
            k = Kernel(family, expr, module.get_function(expr))
        _kernels[cache_k] = k
    return k


_kernels: dict = {}


def i32(x) -> np.int32:
    return np.int32(x)


def i64(x) -> np.int64:
    return np.int64(x)


def f32(x) -> np.float32:
    return np.float32(x)
