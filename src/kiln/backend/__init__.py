"""Where bytes live and how kernels run: a Device names one, `get_backend` gives its module.

A backend is a module that holds arrays of its array library (`xp`: NumPy on `cpu`, CuPy on
`cuda`) and implements the named kernels that `kiln.ops` call (`layer_norm_fwd`, ...). The CPU
backend is the reference; every other backend is tested against it.
"""

from __future__ import annotations

import importlib

from kiln.errors import DeviceError

_DEVICE_TYPES = ("cpu", "cuda")


class Device:
    """A place for tensors: `cpu`, or `cuda:N`."""

    __slots__ = ("type", "index")

    def __init__(self, type: str, index: int = 0):
        self.type = type
        self.index = index

    @property
    def backend(self):
        return get_backend(self.type)

    def __eq__(self, other) -> bool:
        if isinstance(other, str):
            other = device(other)
        return isinstance(other, Device) and self.type == other.type and self.index == other.index

    def __hash__(self) -> int:
        return hash((self.type, self.index))

    def __str__(self) -> str:
        return "cpu" if self.type == "cpu" else f"{self.type}:{self.index}"

    def __repr__(self) -> str:
        return f"device({str(self)!r})"


CPU = Device("cpu")


def device(value) -> Device:
    """Parse "cpu", "cuda", "cuda:1" or a Device into a Device."""
    if isinstance(value, Device):
        return value
    if value is None:
        return CPU
    if not isinstance(value, str):
        raise DeviceError(f"device must be a string like 'cpu' or 'cuda:0', got {value!r}")
    kind, _, index = value.partition(":")
    if kind not in _DEVICE_TYPES:
        raise DeviceError(f"unknown device {value!r}; allowed: 'cpu', 'cuda', 'cuda:N'")
    if kind == "cpu":
        if index not in ("", "0"):
            raise DeviceError(f"unknown device {value!r}; the CPU has only index 0")
        return CPU
    if index == "":
        return Device("cuda", 0)
    if not index.isdigit():
        raise DeviceError(f"bad device index in {value!r}; expected 'cuda:N' with N >= 0")
    return Device("cuda", int(index))


_BACKENDS: dict = {}


def get_backend(kind: str):
    """The backend module for a device type; importing `cuda` checks that CuPy and a GPU exist."""
    mod = _BACKENDS.get(kind)
    if mod is None:
        if kind not in _DEVICE_TYPES:
            raise DeviceError(f"unknown device type {kind!r}; allowed: {', '.join(_DEVICE_TYPES)}")
        mod = importlib.import_module(f"kiln.backend.{kind}")
        if kind == "cuda":
            mod.ensure_available()
        _BACKENDS[kind] = mod
    return mod


def cuda_is_available() -> bool:
    """True when CuPy imports and sees at least one GPU."""
    try:
        get_backend("cuda")
    except DeviceError:
        return False
    return True


def is_device_array(value) -> bool:
    """True for an array in device memory (a CuPy array), told without importing the device library."""
    return type(value).__module__.partition(".")[0] == "cupy"


def array_backend(array):
    """The backend module an array belongs to (the cpu one for NumPy, else cuda)."""
    import numpy as np
    return get_backend("cpu" if isinstance(array, (np.ndarray, np.generic)) else "cuda")


def array_module(array):
    """NumPy or CuPy, whichever `array` belongs to (for code that only has the array)."""
    import numpy as np
    if isinstance(array, (np.ndarray, np.generic)):
        return np
    import cupy
    return cupy
