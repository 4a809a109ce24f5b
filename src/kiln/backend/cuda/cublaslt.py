"""kiln's thin ctypes binding to cuBLASLt: row-major GEMMs on kiln's buffers, stream and workspace.

CuPy's cuBLAS wrapper cannot be captured in a CUDA graph; cuBLASLt called directly can
(DESIGN.md), so every matmul goes through `gemm` here. The row-major convention
(reference/cublas-integration-report.txt §3): cuBLAS is column-major, and a row-major C[M, N]
is the column-major C'[N, M] with ld = C's row stride; C = op(A) @ op(B) is C' = op(B)' op(A)',
so cuBLASLt's first operand is B and its second is A, each described as stored, with the
transpose as a flag (never a transposed copy). Swapping the two leading dimensions is
silently accepted and silently wrong, which is why tests/test_cuda_gemm.py walks every
transpose and leading-dimension combination against a float64 reference.

Which of cuBLASLt's algorithms a plan runs is gemm_autotune.py's question: with tuning on (the
KILN_GEMM_AUTOTUNE=1; off by default) the fastest of the heuristic's candidates, timed once per shape per machine and kept in a file.

Enum values below are from cublasLt.h / cublas_api.h / library_types.h of CUDA 13
(nvidia-cublas 13.10 wheel, nvidia/cu13/include).
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
import time
import warnings
from pathlib import Path

import numpy as np

from kiln.backend.cuda import allocator, device as rt, gemm_autotune as tune
from kiln.errors import ConfigError, KilnError

# library_types.h: cudaDataType
CUDA_R_32F = 0
CUDA_R_64F = 1
CUDA_R_16F = 2
CUDA_R_16BF = 14
# cublas_api.h: cublasComputeType_t
CUBLAS_COMPUTE_32F = 68
CUBLAS_COMPUTE_64F = 70
CUBLAS_COMPUTE_32F_FAST_16BF = 75
CUBLAS_COMPUTE_32F_FAST_TF32 = 77
# cublas_api.h: cublasOperation_t
CUBLAS_OP_N = 0
CUBLAS_OP_T = 1
# cublas_api.h: cublasStatus_t (the ones worth naming in an error)
STATUS_NAMES = {0: "SUCCESS", 1: "NOT_INITIALIZED", 3: "ALLOC_FAILED", 7: "INVALID_VALUE",
                8: "ARCH_MISMATCH", 11: "MAPPING_ERROR", 13: "EXECUTION_FAILED",
                14: "INTERNAL_ERROR", 15: "NOT_SUPPORTED", 16: "LICENSE_ERROR"}
# cublasLt.h: cublasLtMatmulDescAttributes_t
CUBLASLT_MATMUL_DESC_TRANSA = 3          # int32_t (cublasOperation_t)
CUBLASLT_MATMUL_DESC_TRANSB = 4          # int32_t
CUBLASLT_MATMUL_DESC_EPILOGUE = 7        # uint32_t (cublasLtEpilogue_t)
CUBLASLT_MATMUL_DESC_BIAS_POINTER = 8    # void*
CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER = 11  # void*
CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD = 12       # int64_t
CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE = 26         # int32_t (cudaDataType)
# cublasLt.h: cublasLtMatrixLayoutAttribute_t
CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT = 5            # int32_t
CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET = 6   # int64_t, in elements
# cublasLt.h: cublasLtMatmulPreferenceAttributes_t
CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1      # uint64_t
CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES = 5    # uint32_t, default 256
CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES = 6
CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES = 7
CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES = 8
# cublasLt.h: cublasLtEpilogue_t, with what each does with the bias vector and the aux matrix
# (None: not used; "in": read; "out": written). Aux is an [m, n] matrix beside D (row stride aux_ld).
EPILOGUES = {
    "default": 1,          # CUBLASLT_EPILOGUE_DEFAULT
    "bias": 4,             # CUBLASLT_EPILOGUE_BIAS: D += bias, bias length = rows of D (= N row-major)
    "gelu_aux_bias": 164,  # CUBLASLT_EPILOGUE_GELU_AUX_BIAS = GELU_AUX (32|128) | BIAS (4)
    "dgelu": 192,          # CUBLASLT_EPILOGUE_DGELU = 64|128: D = (A B) * gelu'(aux)
}
EPILOGUE_ROLES = {  # epilogue: (bias, aux)
    "default": (None, None), "bias": ("in", None), "gelu_aux_bias": ("in", "out"), "dgelu": (None, "in"),
}

WORKSPACE_BYTES = 32 << 20
PRECISIONS = ("fp32", "tf32", "bf16")
_precision = "fp32"


def set_matmul_precision(mode: str) -> None:
    """How float32 GEMMs compute: "fp32" exact, "tf32" tensor cores, "bf16" (bf16-rounded operands).

    bfloat16 and float16 arrays always multiply their own dtype with fp32 accumulation.
    """
    global _precision
    if mode not in PRECISIONS:
        raise ConfigError(f"unknown matmul precision {mode!r}; allowed: {', '.join(PRECISIONS)}")
    _precision = mode


def get_matmul_precision() -> str:
    return _precision


class CublasError(KilnError):
    """cuBLASLt refused or failed a call: the message names the call, the status and the GEMM."""


class _HeuristicResult(ctypes.Structure):
    # cublasLtMatmulHeuristicResult_t: algo (8 x uint64), workspaceSize, state, wavesCount, reserved[4]
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def library_candidates() -> list[str]:
    """Where libcublasLt.so.13 is looked for: the pip `nvidia` wheels, the toolkit, the loader path."""
    out = []
    try:
        import nvidia
        for base in list(nvidia.__path__):
            for sub in ("cu13/lib", "cublas/lib"):
                out.append(str(Path(base) / sub / "libcublasLt.so.13"))
    except ImportError:
        pass
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            out.append(os.path.join(os.environ[env], "lib64", "libcublasLt.so.13"))
    out.append("/usr/local/cuda/lib64/libcublasLt.so.13")
    out.append("libcublasLt.so.13")
    return out


_lib = None
_lib_lock = threading.Lock()
_vp = ctypes.c_void_p


def _load_library():
    global _lib
    if _lib is not None:
        return _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        errors = []
        lib = None
        for path in library_candidates():
            if os.path.sep in path and not os.path.exists(path):
                continue
            try:
                lib = ctypes.CDLL(path)
                break
            except OSError as e:
                errors.append(f"{path}: {e}")
        if lib is None:
            raise KilnError("cannot load libcublasLt.so.13 (install cupy-cuda13x's CUDA wheels or the "
                            "CUDA 13 toolkit); tried: " + "; ".join(errors or library_candidates()))
        # Every argument typed: untyped ctypes calls pass ints as 32-bit C ints, which would
        # truncate 64-bit device pointers and handles.
        sig = {
            "cublasLtCreate": [ctypes.POINTER(_vp)],
            "cublasLtMatmulDescCreate": [ctypes.POINTER(_vp), ctypes.c_int, ctypes.c_int],
            "cublasLtMatmulDescSetAttribute": [_vp, ctypes.c_int, _vp, ctypes.c_size_t],
            "cublasLtMatrixLayoutCreate": [ctypes.POINTER(_vp), ctypes.c_int, ctypes.c_uint64,
                                           ctypes.c_uint64, ctypes.c_int64],
            "cublasLtMatrixLayoutSetAttribute": [_vp, ctypes.c_int, _vp, ctypes.c_size_t],
            "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(_vp)],
            "cublasLtMatmulPreferenceSetAttribute": [_vp, ctypes.c_int, _vp, ctypes.c_size_t],
            "cublasLtMatmulPreferenceDestroy": [_vp],
            "cublasLtMatmulAlgoGetHeuristic": [_vp, _vp, _vp, _vp, _vp, _vp, _vp, ctypes.c_int,
                                               ctypes.POINTER(_HeuristicResult), ctypes.POINTER(ctypes.c_int)],
            "cublasLtMatmulAlgoCheck": [_vp, _vp, _vp, _vp, _vp, _vp, ctypes.POINTER(ctypes.c_uint64 * 8),
                                        ctypes.POINTER(_HeuristicResult)],
            "cublasLtMatmul": [_vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp,
                               ctypes.POINTER(ctypes.c_uint64 * 8),
                               _vp, ctypes.c_size_t, _vp],
        }
        for name, args in sig.items():
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = ctypes.c_int
        lib.cublasLtGetVersion.argtypes = []
        lib.cublasLtGetVersion.restype = ctypes.c_size_t
        _lib = lib
        return lib


def _check(status: int, call: str, what: str = "") -> None:
    if status != 0:
        raise CublasError(f"{call} failed with CUBLAS_STATUS_{STATUS_NAMES.get(status, status)} ({status})"
                          + (f" for {what}" if what else ""))


def _set(fn, obj, attr: int, value) -> None:
    _check(fn(obj, attr, ctypes.byref(value), ctypes.sizeof(value)), fn.__name__, f"attribute {attr}")


class _Context:
    """Per-device handle and workspace (a CuPy buffer kiln owns)."""

    def __init__(self):
        lib = _load_library()
        self.handle = _vp()
        _check(lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.workspace = rt.cupy().empty((WORKSPACE_BYTES,), dtype=np.uint8)


_contexts: dict = {}
_plans: dict = {}


def _context() -> _Context:
    dev = rt.device_id()
    ctx = _contexts.get(dev)
    if ctx is None:
        ctx = _contexts[dev] = _Context()
    return ctx


DTYPES = {"float32": CUDA_R_32F, "bfloat16": CUDA_R_16BF, "float16": CUDA_R_16F}


def compute_type(dtype) -> int:
    """cuBLAS compute type for operands of `dtype` under the current precision setting."""
    name = np.dtype(dtype).name
    if name != "float32":
        return CUBLAS_COMPUTE_32F
    return {"fp32": CUBLAS_COMPUTE_32F, "tf32": CUBLAS_COMPUTE_32F_FAST_TF32,
            "bf16": CUBLAS_COMPUTE_32F_FAST_16BF}[_precision]


def _alignment(ptr: int) -> int:
    """The largest power of two <= 256 dividing ptr (what MIN_ALIGNMENT_*_BYTES is told)."""
    a = 256
    while a > 1 and ptr % a:
        a //= 2
    return a


def lt_problem(m, n, k, trans_a, trans_b, lda, ldb, ldc):
    """The column-major cuBLASLt problem for row-major C[m, n] = op(A) @ op(B).

    Returns ((opA, rowsA, colsA, ldA), (opB, rowsB, colsB, ldB), (rowsC, colsC, ldC)) for
    cuBLASLt's A (= our B) and B (= our A), each layout as stored in memory.
    """
    # our B: [k, n] row-major = column-major n x k (ld = ldb), or with trans_b stored [n, k]
    # = column-major k x n, transposed.
    lt_a = (CUBLAS_OP_T, k, n, ldb) if trans_b else (CUBLAS_OP_N, n, k, ldb)
    # our A: [m, k] row-major = column-major k x m (ld = lda), or with trans_a stored [k, m]
    # = column-major m x k, transposed.
    lt_b = (CUBLAS_OP_T, m, k, lda) if trans_a else (CUBLAS_OP_N, k, m, lda)
    return lt_a, lt_b, (n, m, ldc)


class _Plan:
    """A cached matmul descriptor, four layouts, the heuristic's candidate algorithms for one GEMM shape
    (its first pick first; `count` asked for) and `algo`, the one it runs: None until its first use."""

    def __init__(self, key, dtype, m, n, k, trans_a, trans_b, lda, ldb, ldc, batch, strides, epilogue,
                 aligns, aux_ld, vec_aligns, out_dtype=None, accumulate=False, count=1):
        lib = _load_library()
        ctx = _context()
        self.lib = lib
        out_dtype = dtype if out_dtype is None else out_dtype
        what = (f"{np.dtype(dtype).name} GEMM m={m} n={n} k={k} trans_a={trans_a} trans_b={trans_b} "
                f"lda={lda} ldb={ldb} ldc={ldc} batch={batch} epilogue={epilogue} out={np.dtype(out_dtype).name} "
                f"accumulate={accumulate}")
        self.what = what
        dt = DTYPES[np.dtype(dtype).name]
        dt_out = DTYPES[np.dtype(out_dtype).name]
        (op_a, ra, ca, la), (op_b, rb, cb, lb), (rc, cc, lc) = lt_problem(m, n, k, trans_a, trans_b, lda, ldb, ldc)
        self.desc = _vp()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), compute_type(dtype), CUDA_R_32F),
               "cublasLtMatmulDescCreate", what)
        _set(lib.cublasLtMatmulDescSetAttribute, self.desc, CUBLASLT_MATMUL_DESC_TRANSA, ctypes.c_int32(op_a))
        _set(lib.cublasLtMatmulDescSetAttribute, self.desc, CUBLASLT_MATMUL_DESC_TRANSB, ctypes.c_int32(op_b))
        _set(lib.cublasLtMatmulDescSetAttribute, self.desc, CUBLASLT_MATMUL_DESC_EPILOGUE,
             ctypes.c_uint32(EPILOGUES[epilogue]))
        bias_role, aux_role = EPILOGUE_ROLES[epilogue]
        if bias_role:
            _set(lib.cublasLtMatmulDescSetAttribute, self.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                 ctypes.c_int32(dt))
        if aux_role:
            _set(lib.cublasLtMatmulDescSetAttribute, self.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
                 ctypes.c_int64(aux_ld))
        self.layouts = []
        sa, sb, sc = strides
        for rows, cols, ld, stride, ldt in ((ra, ca, la, sb, dt), (rb, cb, lb, sa, dt), (rc, cc, lc, sc, dt_out),
                                            (rc, cc, lc, sc, dt_out)):
            lay = _vp()
            _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), ldt, rows, cols, ld),
                   "cublasLtMatrixLayoutCreate", what)
            if batch > 1:
                _set(lib.cublasLtMatrixLayoutSetAttribute, lay, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                     ctypes.c_int32(batch))
                _set(lib.cublasLtMatrixLayoutSetAttribute, lay, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                     ctypes.c_int64(stride))
            self.layouts.append(lay)
        pref = _vp()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        try:
            _set(lib.cublasLtMatmulPreferenceSetAttribute, pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                 ctypes.c_uint64(WORKSPACE_BYTES))
            # Our A is cuBLASLt's B and vice versa; C and D are the output.
            al_a, al_b, al_c = aligns
            for attr, val in ((CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, al_b),
                              (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, al_a),
                              (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, al_c),
                              (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, al_c)):
                _set(lib.cublasLtMatmulPreferenceSetAttribute, pref, attr, ctypes.c_uint32(val))
            results = (_HeuristicResult * count)()
            found = ctypes.c_int(0)
            # The heuristic reads the bias/aux pointers' alignment (not their data), and those
            # pointers are set per call; so the plan is keyed by that alignment and the heuristic
            # sees a placeholder address with exactly that alignment.
            base = ctx.workspace.data.ptr  # 256-aligned
            if bias_role:
                self.set_pointer(CUBLASLT_MATMUL_DESC_BIAS_POINTER, base + vec_aligns[0] % 256)
            if aux_role:
                self.set_pointer(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, base + vec_aligns[1] % 256)
            _check(lib.cublasLtMatmulAlgoGetHeuristic(ctx.handle, self.desc, *self.layouts, pref, count,
                                                      results, ctypes.byref(found)),
                   "cublasLtMatmulAlgoGetHeuristic", what)
        finally:
            lib.cublasLtMatmulPreferenceDestroy(pref)
        # Only algorithms that run here and fit kiln's workspace (the preference already asks for that).
        self.candidates = [r for r in results[:max(0, min(found.value, count))]
                           if r.state == 0 and r.workspaceSize <= WORKSPACE_BYTES]
        if not self.candidates:
            raise CublasError(f"cuBLASLt has no algorithm for {what} (compute type {compute_type(dtype)})")
        self.tune = count > 1
        self.accumulate = bool(accumulate)
        self.algo = None
        self.alpha = ctypes.c_float(1.0)
        self.beta = ctypes.c_float(1.0 if accumulate else 0.0)

    def set_pointer(self, attr: int, ptr: int) -> None:
        _set(self.lib.cublasLtMatmulDescSetAttribute, self.desc, attr, _vp(ptr))

    def check(self, algo) -> bool:
        """Whether cuBLASLt accepts a stored algorithm (8 ints) for this plan within kiln's workspace."""
        result = _HeuristicResult()
        la, lb, lc, ld = self.layouts
        status = self.lib.cublasLtMatmulAlgoCheck(_context().handle, self.desc, la, lb, lc, ld,
                                                  ctypes.byref(_algo(algo)), ctypes.byref(result))
        return status == 0 and result.state == 0 and result.workspaceSize <= WORKSPACE_BYTES

    def launch_status(self, algo, a_ptr, b_ptr, c_ptr) -> int:
        """Queue the GEMM with `algo` on kiln's stream; cuBLASLt's status."""
        ctx = _context()
        la, lb, lc, ld = self.layouts
        # cuBLASLt's A is our B, its B is our A; C = D (read only when accumulating: beta = 1).
        return self.lib.cublasLtMatmul(ctx.handle, self.desc, ctypes.byref(self.alpha), _vp(b_ptr), la,
                                       _vp(a_ptr), lb, ctypes.byref(self.beta), _vp(c_ptr), lc, _vp(c_ptr), ld,
                                       ctypes.byref(algo), _vp(ctx.workspace.data.ptr), WORKSPACE_BYTES,
                                       _vp(rt.stream().ptr))

    def run(self, a_ptr, b_ptr, c_ptr) -> None:
        _check(self.launch_status(self.algo, a_ptr, b_ptr, c_ptr), "cublasLtMatmul", self.what)


def _algo(values):
    """A `cublasLtMatmulAlgo_t` (8 x uint64) from a stored list, or itself."""
    return values if isinstance(values, ctypes.Array) else (ctypes.c_uint64 * 8)(*values)


class Operands:
    """What timing a plan's candidates needs of one call: the pointers, and the byte spans the GEMM reads (A,
    B, the epilogue's inputs, and C = D when accumulating) and writes (D, and the epilogue's outputs: aux under
    GELU_AUX_BIAS), each epilogue output as (attribute, pointer, span)."""

    def __init__(self, a_ptr, b_ptr, c_ptr, c_span, a_span, b_span, reads=(), writes=()):
        self.a_ptr, self.b_ptr, self.c_ptr = a_ptr, b_ptr, c_ptr
        self.c_span, self.writes = c_span, list(writes)
        self.read = [a_span, b_span, *reads]

    def written(self) -> list:
        return [self.c_span] + [w[2] for w in self.writes]


def span(ptr: int, rows: int, cols: int, ld: int, itemsize: int, batch: int = 1, stride: int = 0) -> tuple:
    """[first byte, past the last byte) of `batch` row-major [rows, cols] matrices with row stride ld,
    `stride` elements apart."""
    return ptr, ptr + ((batch - 1) * stride + (rows - 1) * ld + cols) * itemsize


def needs_scratch(accumulate: bool, ops: Operands) -> bool:
    """Whether the candidates must write into scratch copies rather than the real outputs: with beta = 1
    each launch adds into C again, and an output that overlaps an input would change what the next candidate
    reads. Otherwise (beta = 0, D write-only) they write into D and aux, and the chosen algorithm's run
    after tuning is the one whose result stays."""
    return accumulate or any(w0 < r1 and r0 < w1 for w0, w1 in ops.written() for r0, r1 in ops.read)


_tune_stats = {"plans_tuned": 0, "plans_from_cache": 0, "plans_untuned_in_capture": 0,
               "plans_untuned_no_memory": 0, "candidates_timed": 0, "tuning_s": 0.0, "scratch_bytes_peak": 0}
_warned: set = set()  # the warnings given in this process, once each
_algo_caches: dict = {}


def autotune_stats() -> dict:
    """What GEMM tuning did in this process: plans tuned (timed), taken from the file, first met inside a
    capture or left without memory for their scratch (the heuristic's pick, both); candidates timed; host
    seconds spent timing; the most scratch bytes held at once."""
    return dict(_tune_stats)


def _warn_once(kind: str, message: str) -> None:
    if kind not in _warned:
        _warned.add(kind)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def _algo_cache() -> tune.AlgoCache:
    dev = rt.device_id()
    cache = _algo_caches.get(dev)
    if cache is None:
        name, version = rt.device_name(), int(_load_library().cublasLtGetVersion())
        cache = _algo_caches[dev] = tune.AlgoCache(tune.cache_path(name, version), name, version)
    return cache


def select(plan: _Plan, key, ops: Operands):
    """The algorithm `plan` runs from now on in this process (gemm_autotune.py says why it never changes):
    the heuristic's first when tuning is off; the file's, when cuBLASLt accepts it; inside a stream capture
    (where nothing may be timed), or without the memory for a scratch copy, the heuristic's first, said once;
    else the fastest candidate, timed now."""
    first = plan.candidates[0].algo
    if not plan.tune:
        return first
    cache, dkey = _algo_cache(), tune.disk_key(key)
    entry = cache.get(dkey)
    stale = None
    if entry is not None:
        if plan.check(entry["algo"]):
            _tune_stats["plans_from_cache"] += 1
            return _algo(entry["algo"])
        stale = entry["algo"]  # another cuBLASLt build or workspace: tune again, and overwrite it
    if rt.stream().is_capturing():
        _tune_stats["plans_untuned_in_capture"] += 1
        _warn_once("capture", f"kiln: a GEMM ({plan.what}) first ran inside a CUDA graph capture, where kiln cannot "
                   "time cuBLASLt's algorithms: it runs the heuristic's pick for this whole process (as may other "
                   "shapes met first in a capture; run one step eagerly before capturing, as the Trainer does, to "
                   "tune them)")
        return first
    if len(plan.candidates) == 1:
        times, index = [float("nan")], 0
    else:
        t0 = time.perf_counter()
        times = _time_candidates(plan, ops)
        _tune_stats["tuning_s"] += time.perf_counter() - t0
        if times is None:
            _tune_stats["plans_untuned_no_memory"] += 1
            _warn_once("memory", f"kiln: no device memory for the scratch copy of C that timing a GEMM ({plan.what}) "
                       "needs: it runs the heuristic's pick for this whole process (as may other such GEMMs), untimed "
                       "and not written to the algorithm file")
            return first
        _tune_stats["candidates_timed"] += len(times)
        index = tune.choose(times)
    _tune_stats["plans_tuned"] += 1
    pick = plan.candidates[index].algo
    mine = {"algo": list(pick), "index": index, "candidates": len(plan.candidates),
            "median_ms": [round(t, 5) if math.isfinite(t) else None for t in times]}
    kept = cache.put(dkey, mine, stale)
    if kept["algo"] != mine["algo"] and plan.check(kept["algo"]):
        return _algo(kept["algo"])  # another process (a rank) tuned this shape first: run what it runs
    return pick


def _time_candidates(plan: _Plan, ops: Operands) -> list | None:
    """Median milliseconds of one launch of each candidate (inf for one cuBLASLt refuses; None, with nothing
    launched, when the device has no memory for the scratch copies), by CUDA events on
    kiln's stream: WARMUP rounds, then TIMED rounds, each launching every candidate once, in turn, with an
    event after each launch, all queued before the one synchronisation. So the device runs the launches back
    to back (an interval between two events is one launch, not the host's pace), and every candidate meets
    the same clocks and the same warm caches (rounds, not one candidate after another: the heuristic's
    pick, first in the list, would otherwise run while the clocks still ramp up). The median, not the
    minimum: on a shared GPU (test shards, another rank) other work falls into some intervals."""
    cp = rt.cupy()
    s = rt.stream()
    c_ptr, scratch = ops.c_ptr, []
    if needs_scratch(plan.accumulate, ops):
        c0, c1 = ops.c_span
        try:  # kiln's allocator: 256-aligned or better, as D needs
            scratch = [cp.empty((end - start,), dtype=np.uint8) for start, end in ops.written()]
        except (MemoryError, allocator.OutOfMemoryError):  # CuPy's OutOfMemoryError is a MemoryError
            return None
        if plan.accumulate:  # D = C + A B: the candidates add into a copy of C, never into C itself
            cp.cuda.runtime.memcpyAsync(scratch[0].data.ptr, c0, c1 - c0, cp.cuda.runtime.memcpyDeviceToDevice,
                                        s.ptr)
        c_ptr = scratch[0].data.ptr
        for (attr, _, _), copy in zip(ops.writes, scratch[1:]):
            plan.set_pointer(attr, copy.data.ptr)
    _tune_stats["scratch_bytes_peak"] = max(_tune_stats["scratch_bytes_peak"], sum(x.nbytes for x in scratch))
    n = len(plan.candidates)
    ok = [True] * n
    intervals: list = [[] for _ in range(n)]  # (event before, event after) of each timed launch
    try:
        for _ in range(tune.WARMUP):
            for j, cand in enumerate(plan.candidates):
                if ok[j]:
                    ok[j] = plan.launch_status(cand.algo, ops.a_ptr, ops.b_ptr, c_ptr) == 0
        last = cp.cuda.Event()
        last.record(s)
        for _ in range(tune.TIMED):
            for j, cand in enumerate(plan.candidates):
                if ok[j]:
                    ok[j] = plan.launch_status(cand.algo, ops.a_ptr, ops.b_ptr, c_ptr) == 0
                    after = cp.cuda.Event()
                    after.record(s)
                    intervals[j].append((last, after))
                    last = after
        s.synchronize()
    finally:
        if scratch:
            for attr, ptr, _ in ops.writes:
                plan.set_pointer(attr, ptr)
        del scratch  # back to kiln's allocator: the device is done with it (synchronised above)
    return [float(np.median([cp.cuda.get_elapsed_time(e0, e1) for e0, e1 in intervals[j]])) if ok[j]
            else float("inf") for j in range(n)]


def prepare(a, b, out, *, m, n, k, trans_a=False, trans_b=False, lda=None, ldb=None, ldc=None,
            batch=1, stride_a=0, stride_b=0, stride_c=0, bias=None, epilogue="default", aux=None,
            aux_ld=0, accumulate=False):
    """gemm's first half: (plan, key, pointers, operands) of a call, the plan made at first sight of its key
    and its bias and aux pointers set; operands() gives the Operands that timing the plan needs."""
    if epilogue not in EPILOGUES:
        raise ConfigError(f"unknown GEMM epilogue {epilogue!r}; allowed: {', '.join(EPILOGUES)}")
    bias_role, aux_role = EPILOGUE_ROLES[epilogue]
    if bias_role and bias is None or aux_role and aux is None:
        raise ConfigError(f"GEMM epilogue {epilogue!r} needs {'a bias' if bias_role and bias is None else 'an aux'} "
                          "buffer")
    dtype = np.dtype(a.dtype)
    if np.dtype(b.dtype) != dtype or (np.dtype(out.dtype) != dtype and not (
            np.dtype(out.dtype).name == "float32" and dtype.name in ("bfloat16", "float16"))):
        raise ConfigError(f"GEMM operands {np.dtype(a.dtype).name} and {np.dtype(b.dtype).name} into "
                          f"{np.dtype(out.dtype).name}: allowed are one dtype throughout, or bfloat16/float16 "
                          "operands into float32")
    lda = lda if lda is not None else (m if trans_a else k)
    ldb = ldb if ldb is not None else (k if trans_b else n)
    ldc = ldc if ldc is not None else n
    ptrs = (rt.ptr(a), rt.ptr(b), rt.ptr(out))
    aligns = tuple(_alignment(p) for p in ptrs)
    vec_aligns = (_alignment(rt.ptr(bias)) if bias is not None else 256,
                  _alignment(rt.ptr(aux)) if aux is not None else 256)
    strides = (int(stride_a), int(stride_b), int(stride_c))
    key = (rt.device_id(), np.dtype(dtype).name, compute_type(dtype), m, n, k, bool(trans_a), bool(trans_b),
           lda, ldb, ldc, batch, strides if batch > 1 else (0, 0, 0), epilogue, aligns, aux_ld, vec_aligns,
           np.dtype(out.dtype).name, bool(accumulate))
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = _Plan(key, dtype, m, n, k, trans_a, trans_b, lda, ldb, ldc, batch, strides,
                                   epilogue, aligns, aux_ld, vec_aligns, out.dtype, accumulate,
                                   tune.candidate_count(2 * m * n * k * batch))
    vectors = []  # (attribute, pointer, span, role) of the epilogue's bias and aux
    if bias_role:
        vectors.append((CUBLASLT_MATMUL_DESC_BIAS_POINTER, rt.ptr(bias),
                        span(rt.ptr(bias), 1, n, n, np.dtype(bias.dtype).itemsize), bias_role))
    if aux_role:
        vectors.append((CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, rt.ptr(aux),
                        span(rt.ptr(aux), m, n, aux_ld, np.dtype(aux.dtype).itemsize), aux_role))
    for attr, ptr, _, _ in vectors:
        plan.set_pointer(attr, ptr)

    def operands() -> Operands:
        item, out_item = dtype.itemsize, np.dtype(out.dtype).itemsize
        a_rows, a_cols = (k, m) if trans_a else (m, k)
        b_rows, b_cols = (n, k) if trans_b else (k, n)
        return Operands(
            *ptrs, c_span=span(ptrs[2], m, n, ldc, out_item, batch, stride_c),
            a_span=span(ptrs[0], a_rows, a_cols, lda, item, batch, stride_a),
            b_span=span(ptrs[1], b_rows, b_cols, ldb, item, batch, stride_b),
            reads=[sp for _, _, sp, role in vectors if role == "in"],
            writes=[(attr, ptr, sp) for attr, ptr, sp, role in vectors if role == "out"])
    return plan, key, ptrs, operands


def gemm(a, b, out, *, m, n, k, trans_a=False, trans_b=False, lda=None, ldb=None, ldc=None,
         batch=1, stride_a=0, stride_b=0, stride_c=0, bias=None, epilogue="default", aux=None,
         aux_ld=0, accumulate=False):
    """Row-major out[m, n] = op(A) @ op(B) (+ epilogue) on device buffers, on kiln's stream.

    A is [m, k] with row stride lda, or with trans_a stored [k, m]; B is [k, n] with row
    stride ldb, or with trans_b stored [n, k]; strides are in elements. `a`, `b`, `out` are
    CuPy arrays whose first element is the first matrix. Epilogues: "bias" adds bias[n];
    "gelu_aux_bias" writes gelu(x + bias) to out and x + bias to `aux` (row stride aux_ld); "dgelu" writes
    (A B) * gelu'(aux) (the GELU's backward: aux its input);
    `out` is A's and B's dtype, or float32 for bfloat16/float16 operands (fp32 accumulation kept
    in the output); with accumulate, out += op(A) @ op(B) in place (beta = 1: in the GEMM, in a
    fixed order, e.g. a weight gradient summed over chunks of rows). A shape's first call picks the
    algorithm its plan keeps (`select`: tuned, from the file, or the heuristic's).
    """
    plan, key, ptrs, operands = prepare(
        a, b, out, m=m, n=n, k=k, trans_a=trans_a, trans_b=trans_b, lda=lda, ldb=ldb, ldc=ldc, batch=batch,
        stride_a=stride_a, stride_b=stride_b, stride_c=stride_c, bias=bias, epilogue=epilogue, aux=aux,
        aux_ld=aux_ld, accumulate=accumulate)
    if plan.algo is None:
        plan.algo = select(plan, key, operands())
    plan.run(*ptrs)
