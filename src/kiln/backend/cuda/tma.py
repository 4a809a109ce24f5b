"""Tensor maps for the Hopper TMA (cp.async.bulk.tensor): `cuTensorMapEncodeTiled` from the CUDA
driver through ctypes, returned as the 128 bytes a kernel takes by value (a `__grid_constant__`
parameter; CuPy passes a one-element NumPy array by value).

A map describes a [B, H, T, D] array of 16-bit elements as it lies in memory (unit stride along
D, any 16-byte-aligned row, head and batch strides: views of a packed qkv buffer included) and
the box one load moves: `rows` rows x 64 columns (128 bytes, the 128-byte swizzle's width), laid
out in shared memory with that swizzle, which is the wgmma operand layout of kernels/attention.cu
(SwTile). Rows past T read as zeros.
"""

from __future__ import annotations

import ctypes
import functools
import threading

import numpy as np

from kiln.backend.cuda import device as rt
from kiln.errors import DeviceError, ShapeError

# CUtensorMapDataType, CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion,
# CUtensorMapFloatOOBfill (cuda.h; tests/test_op_attention.py reads them back from the header)
_DATA_TYPES = {"bfloat16": 9, "float16": 6}
_INTERLEAVE_NONE = 0
_SWIZZLE_128B = 3
_L2_PROMOTION_128B = 2
_OOB_FILL_ZEROS = 0  # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: boxes past T read as zeros
BOX_COLUMNS = 64  # 128 bytes of 16-bit elements
MAP_BYTES = 128

_lib = None
_lock = threading.Lock()


def _driver():
    global _lib
    with _lock:
        if _lib is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as e:
                raise DeviceError(f"TMA tensor maps need the CUDA driver (libcuda.so.1): {e}") from e
            fn = lib.cuTensorMapEncodeTiled
            u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                           ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
            fn.restype = ctypes.c_int
            _lib = lib
    return _lib


def strides_bytes(shape, strides, itemsize: int) -> list[int]:
    """The (row, head, batch) byte strides a map of a [B, H, T, D] array is encoded with: the
    array's own, and for an axis of length 1 (whose stride is never used) the extent of the axes
    inside it, so that every stride is a positive multiple of 16 as TMA requires."""
    b, h, t, d = shape
    inner = d * itemsize
    out = []
    for n, s in ((t, strides[2]), (h, strides[1]), (b, strides[0])):
        s = s if n > 1 else -(-inner // 16) * 16
        if s <= 0 or s % 16:
            raise ShapeError(f"a TMA tensor map needs row, head and batch strides that are positive multiples of "
                             f"16 bytes, got {s} bytes in an array of shape {tuple(shape)}, strides {tuple(strides)}")
        out.append(int(s))
        inner = s * n
    return out


def tile_map(a, rows: int) -> np.ndarray:
    """The tensor map of a [B, H, T, D] bfloat16 or float16 device array, boxes of `rows` x 64 columns."""
    name = np.dtype(a.dtype).name
    if name not in _DATA_TYPES or a.ndim != 4 or a.shape[3] % BOX_COLUMNS or a.strides[3] != a.dtype.itemsize:
        raise ShapeError(f"a TMA tensor map takes a [B, H, T, D] bfloat16/float16 array with D a multiple of "
                         f"{BOX_COLUMNS} and unit stride along D, got {name} {tuple(a.shape)} strides {a.strides}")
    if rt.ptr(a) % 16:
        raise ShapeError(f"a TMA tensor map needs a 16-byte-aligned base address, got {rt.ptr(a):#x}")
    return _encode(rt.ptr(a), tuple(a.shape), tuple(a.strides), name, a.dtype.itemsize, rows)


def encode_arguments(shape, strides, name: str, itemsize: int, rows: int) -> tuple:
    """cuTensorMapEncodeTiled's arguments after the map and the address, as plain integers:
    (data type, rank, globalDim, globalStrides, boxDim, elementStrides, interleave, swizzle,
    L2 promotion, OOB fill) for a [B, H, T, D] array of `shape` and byte `strides`, boxes of
    `rows` x 64 columns. Checks what the driver documents (cuda.h) and would refuse with a bare
    CUDA_ERROR_INVALID_VALUE: every dimension in 1..2^31, strides multiples of 16 below 2^40,
    box sides in 1..256 (the inner side, 64 x 2 bytes, is the 128-byte swizzle's span)."""
    b, h, t, d = shape
    if name not in _DATA_TYPES or itemsize != 2:
        raise ShapeError(f"a TMA tensor map here takes bfloat16 or float16, got {name} ({itemsize} bytes)")
    if not all(1 <= n <= 2**31 for n in shape):
        raise ShapeError(f"a TMA tensor map needs every dimension in 1..2^31, got shape {tuple(shape)}")
    if not 1 <= rows <= 256:
        raise ShapeError(f"a TMA box has at most 256 rows, got {rows}")
    byte_strides = strides_bytes(shape, strides, itemsize)
    if max(byte_strides) >= 2**40:
        raise ShapeError(f"a TMA tensor map needs strides below 2^40 bytes, got {byte_strides}")
    return (_DATA_TYPES[name], 4, (d, t, h, b), tuple(byte_strides), (BOX_COLUMNS, rows, 1, 1), (1, 1, 1, 1),
            _INTERLEAVE_NONE, _SWIZZLE_128B, _L2_PROMOTION_128B, _OOB_FILL_ZEROS)


@functools.lru_cache(maxsize=256)
def _encode(address: int, shape: tuple, strides: tuple, name: str, itemsize: int, rows: int) -> np.ndarray:
    """The map, a function of its arguments alone (so cached: encoding costs microseconds of host
    time a call, which a small launch would otherwise wait for). Read-only to its callers."""
    dtype, rank, dims, byte_strides, box, elem, interleave, swizzle, l2, oob = encode_arguments(
        shape, strides, name, itemsize, rows)
    raw = np.zeros(MAP_BYTES + 64, dtype=np.uint8)  # CUtensorMap is 64-byte aligned
    start = -raw.ctypes.data % 64
    out = raw[start:start + MAP_BYTES].view(np.dtype((np.void, MAP_BYTES)))
    status = _driver().cuTensorMapEncodeTiled(
        out.ctypes.data, dtype, rank, address, (ctypes.c_uint64 * 4)(*dims), (ctypes.c_uint64 * 3)(*byte_strides),
        (ctypes.c_uint32 * 4)(*box), (ctypes.c_uint32 * 4)(*elem), interleave, swizzle, l2, oob)
    if status != 0:
        raise DeviceError(f"cuTensorMapEncodeTiled failed with CUresult {status} for {name} {shape}, "
                          f"strides {strides} (bytes), box {rows} x {BOX_COLUMNS}")
    out.flags.writeable = False
    return out
