"""kiln's dtypes: a name, the array library's dtype, and what kind of number it holds."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from kiln.errors import DTypeError


class DType:
    """One element type. The same object on every device; `np` is its NumPy/CuPy dtype."""

    __slots__ = ("name", "np", "is_floating", "itemsize")

    def __init__(self, name: str, np_dtype, is_floating: bool):
        self.name = name
        self.np = np.dtype(np_dtype)
        self.is_floating = is_floating
        self.itemsize = self.np.itemsize

    def __repr__(self) -> str:
        return f"kiln.{self.name}"

    def __reduce__(self):
        return (get_dtype, (self.name,))


float64 = DType("float64", np.float64, True)
float32 = DType("float32", np.float32, True)
bfloat16 = DType("bfloat16", ml_dtypes.bfloat16, True)
float16 = DType("float16", np.float16, True)
int64 = DType("int64", np.int64, False)
int32 = DType("int32", np.int32, False)
uint16 = DType("uint16", np.uint16, False)
bool_ = DType("bool", np.bool_, False)

ALL_DTYPES = (float64, float32, bfloat16, float16, int64, int32, uint16, bool_)
_BY_NAME = {d.name: d for d in ALL_DTYPES}
_BY_NP = {d.np: d for d in ALL_DTYPES}


def get_dtype(value) -> DType:
    """A DType from a DType, its name ("float32", "bf16") or a NumPy dtype."""
    if isinstance(value, DType):
        return value
    if isinstance(value, str):
        name = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16", "half": "float16",
                "float": "float32", "double": "float64", "long": "int64", "int": "int32"}.get(value, value)
        if name in _BY_NAME:
            return _BY_NAME[name]
        raise DTypeError(f"unknown dtype {value!r}; allowed: {', '.join(_BY_NAME)}")
    try:
        np_dtype = np.dtype(value)
    except TypeError:
        np_dtype = None
    if np_dtype is not None and np_dtype in _BY_NP:
        return _BY_NP[np_dtype]
    raise DTypeError(f"unsupported dtype {value!r}; allowed: {', '.join(_BY_NAME)}")
