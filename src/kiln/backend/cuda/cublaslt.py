"""kiln's thin ctypes binding to cuBLASLt: row-major GEMMs on kiln's buffers, stream and workspace.

CuPy's cuBLAS wrapper cannot be captured in a CUDA graph; cuBLASLt called directly can
(DESIGN.md), so every matmul goes through `gemm` here. The row-major convention
(reference/cublas-integration-report.txt §3): cuBLAS is column-major, and a row-major C[M, N]
is the column-major C'[N, M] with ld = C's row stride; C = op(A) @ op(B) is C' = op(B)' op(A)',
so cuBLASLt's first operand is B and its second is A, each described as stored, with the
transpose as a flag (never a transposed copy). Swapping the two leading dimensions is
silently accepted and silently wrong, which is why tests/test_cuda_gemm.py walks every
transpose and leading-dimension combination against a float64 reference.

Enum values below are from cublasLt.h / cublas_api.h / library_types.h of CUDA 13
(nvidia-cublas 13.10 wheel, nvidia/cu13/include).
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import numpy as np

from kiln.backend.cuda import device as rt
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
# cublasLt.h: cublasLtEpilogue_t
EPILOGUES = {
    "default": 1,          # CUBLASLT_EPILOGUE_DEFAULT
    "bias": 4,             # CUBLASLT_EPILOGUE_BIAS: D += bias, bias length = rows of D (= N row-major)
    "gelu_aux_bias": 164,  # CUBLASLT_EPILOGUE_GELU_AUX_BIAS = GELU_AUX (32|128) | BIAS (4)
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
            "cublasLtMatmul": [_vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp,
                               ctypes.POINTER(ctypes.c_uint64 * 8),
                               _vp, ctypes.c_size_t, _vp],
        }
        for name, args in sig.items():
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = ctypes.c_int
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
    """A cached matmul descriptor, four layouts and the heuristic's algorithm for one GEMM shape."""

    def __init__(self, key, dtype, m, n, k, trans_a, trans_b, lda, ldb, ldc, batch, strides, epilogue,
                 aligns, aux_ld, vec_aligns, out_dtype=None, accumulate=False):
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
        if epilogue != "default":
            _set(lib.cublasLtMatmulDescSetAttribute, self.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                 ctypes.c_int32(dt))
        if epilogue == "gelu_aux_bias":
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
            self.result = _HeuristicResult()
            count = ctypes.c_int(0)
            # The heuristic reads the bias/aux pointers' alignment (not their data), and those
            # pointers are set per call; so the plan is keyed by that alignment and the heuristic
            # sees a placeholder address with exactly that alignment.
            if epilogue != "default":
                base = ctx.workspace.data.ptr  # 256-aligned
                self.set_pointer(CUBLASLT_MATMUL_DESC_BIAS_POINTER, base + vec_aligns[0] % 256)
                if epilogue == "gelu_aux_bias":
                    self.set_pointer(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, base + vec_aligns[1] % 256)
            _check(lib.cublasLtMatmulAlgoGetHeuristic(ctx.handle, self.desc, *self.layouts, pref, 1,
                                                      ctypes.byref(self.result), ctypes.byref(count)),
                   "cublasLtMatmulAlgoGetHeuristic", what)
        finally:
            lib.cublasLtMatmulPreferenceDestroy(pref)
        if count.value < 1 or self.result.state != 0:
            raise CublasError(f"cuBLASLt has no algorithm for {what} (compute type {compute_type(dtype)})")
        self.alpha = ctypes.c_float(1.0)
        self.beta = ctypes.c_float(1.0 if accumulate else 0.0)

    def set_pointer(self, attr: int, ptr: int) -> None:
        _set(self.lib.cublasLtMatmulDescSetAttribute, self.desc, attr, _vp(ptr))

    def run(self, a_ptr, b_ptr, c_ptr) -> None:
        ctx = _context()
        la, lb, lc, ld = self.layouts
        # cuBLASLt's A is our B, its B is our A; C = D (read only when accumulating: beta = 1).
        _check(self.lib.cublasLtMatmul(ctx.handle, self.desc, ctypes.byref(self.alpha), _vp(b_ptr), la,
                                       _vp(a_ptr), lb, ctypes.byref(self.beta), _vp(c_ptr), lc, _vp(c_ptr), ld,
                                       ctypes.byref(self.result.algo), _vp(ctx.workspace.data.ptr),
                                       WORKSPACE_BYTES, _vp(rt.stream().ptr)),
               "cublasLtMatmul", self.what)


def gemm(a, b, out, *, m, n, k, trans_a=False, trans_b=False, lda=None, ldb=None, ldc=None,
         batch=1, stride_a=0, stride_b=0, stride_c=0, bias=None, epilogue="default", aux=None,
         aux_ld=0, accumulate=False):
    """Row-major out[m, n] = op(A) @ op(B) (+ epilogue) on device buffers, on kiln's stream.

    A is [m, k] with row stride lda, or with trans_a stored [k, m]; B is [k, n] with row
    stride ldb, or with trans_b stored [n, k]; strides are in elements. `a`, `b`, `out` are
    CuPy arrays whose first element is the first matrix. Epilogues: "bias" adds bias[n];
    "gelu_aux_bias" writes gelu(x + bias) to out and x + bias to `aux` (row stride aux_ld);
    `out` is A's and B's dtype, or float32 for bfloat16/float16 operands (fp32 accumulation kept
    in the output); with accumulate, out += op(A) @ op(B) in place (beta = 1: in the GEMM, in a
    fixed order, e.g. a weight gradient summed over chunks of rows).
    """
    if epilogue not in EPILOGUES:
        raise ConfigError(f"unknown GEMM epilogue {epilogue!r}; allowed: {', '.join(EPILOGUES)}")
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
                                   epilogue, aligns, aux_ld, vec_aligns, out.dtype, accumulate)
    if epilogue != "default":
        if bias is None:
            raise ConfigError(f"GEMM epilogue {epilogue!r} needs a bias buffer")
        plan.set_pointer(CUBLASLT_MATMUL_DESC_BIAS_POINTER, rt.ptr(bias))
    if epilogue == "gelu_aux_bias":
        plan.set_pointer(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, rt.ptr(aux))
    plan.run(*ptrs)
