"""The Tensor: a backend array with a kiln dtype, a device and its place in the autograd graph.

Views, strides and broadcasting come from the array library (NumPy on `cpu`, CuPy on `cuda`);
the Tensor asks its device's backend for everything else. Views share a version counter with
their base, so an in-place change of any of them is seen by the backward that saved the other.
"""

from __future__ import annotations

import numbers

import numpy as np

from kiln import autograd
from kiln.backend import CPU, Device, device as parse_device
from kiln.dtypes import DType, get_dtype
from kiln.errors import AutogradError, DTypeError, KilnError


class Tensor:
    __slots__ = ("data", "dtype", "device", "requires_grad", "grad", "grad_fn", "_output_nr",
                 "_version", "_accumulator", "_post_accumulate_hooks", "__weakref__")

    def __init__(self, data, dtype=None, device=None, requires_grad: bool = False):
        """A new leaf tensor holding a copy of `data` (a list, scalar, NumPy/CuPy array or Tensor)."""
        if isinstance(data, Tensor):
            data = data.data
        dev = parse_device(device) if device is not None else _device_of(data)
        backend = dev.backend
        kd = get_dtype(dtype) if dtype is not None else None
        arr = backend.asarray(data, dtype=kd.np if kd is not None else None)
        if kd is None and arr.dtype.kind == "f" and arr.dtype.itemsize == 8 and not _is_array(data):
            arr = arr.astype("float32")  # Python floats make float32 tensors, as in PyTorch
        arr = arr.copy() if _shares(arr, data) else arr
        self._init(arr, dev, requires_grad)

    def _init(self, arr, dev: Device, requires_grad: bool, grad_fn=None, output_nr: int = 0,
              version=None):
        self.data = arr
        self.dtype = get_dtype(arr.dtype)
        self.device = dev
        if requires_grad and not self.dtype.is_floating:
            raise DTypeError(f"only floating-point tensors can require grad, not {self.dtype}")
        self.requires_grad = requires_grad
        self.grad = None
        self.grad_fn = grad_fn
        self._output_nr = output_nr
        self._version = version if version is not None else [0]
        self._accumulator = None
        self._post_accumulate_hooks = []

    @classmethod
    def _wrap(cls, arr, dev, requires_grad=False, grad_fn=None, output_nr=0, version=None) -> "Tensor":
        """A Tensor around an existing backend array, with no copy."""
        if isinstance(arr, np.generic):  # NumPy reductions return scalars; a Tensor holds arrays
            arr = np.asarray(arr)
        t = cls.__new__(cls)
        t._init(arr, dev if dev is not None else CPU, requires_grad, grad_fn, output_nr, version)
        return t

    # ----------------------------------------------------------------- properties
    @property
    def shape(self) -> tuple:
        return tuple(self.data.shape)

    @property
    def ndim(self) -> int:
        return self.data.ndim

    def numel(self) -> int:
        return int(self.data.size)

    def size(self, dim=None):
        return self.shape if dim is None else self.shape[dim]

    @property
    def is_leaf(self) -> bool:
        return self.grad_fn is None

    @property
    def backend(self):
        return self.device.backend

    @property
    def version(self) -> int:
        """How many in-place changes this tensor (or a view of its storage) has had."""
        return self._version[0]

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        grad = f", grad_fn={type(self.grad_fn).__name__}" if self.grad_fn is not None else (
            ", requires_grad=True" if self.requires_grad else "")
        dev = "" if self.device == CPU else f", device='{self.device}'"
        return f"tensor({self.numpy()!r}, dtype={self.dtype}{dev}{grad})"

    # ----------------------------------------------------------------- autograd
    def backward(self, grad=None, retain_graph: bool = False) -> None:
        """Accumulate d(self)/d(leaf) into every leaf's `.grad`; `grad` defaults to 1 for a scalar."""
        if not self.requires_grad:
            raise AutogradError("backward on a tensor that does not require grad")
        if grad is None:
            if self.numel() != 1:
                raise AutogradError(f"backward needs a gradient for a non-scalar tensor of shape {self.shape}")
            g = self.backend.xp.ones(self.shape, dtype=self.dtype.np)
        else:
            g = grad.data if isinstance(grad, Tensor) else self.backend.asarray(grad, dtype=self.dtype.np)
            if tuple(g.shape) != self.shape:
                raise AutogradError(f"gradient of shape {tuple(g.shape)} for a tensor of shape {self.shape}")
        autograd.backward(self, g, retain_graph=retain_graph, unit=grad is None)

    def detach(self) -> "Tensor":
        """The same storage, out of the graph."""
        return Tensor._wrap(self.data, self.device, version=self._version)

    def requires_grad_(self, value: bool = True) -> "Tensor":
        if not self.is_leaf:
            raise AutogradError("requires_grad_ can only change leaf tensors; use detach() first")
        if value and not self.dtype.is_floating:
            raise DTypeError(f"only floating-point tensors can require grad, not {self.dtype}")
        self.requires_grad = value
        return self

    def register_post_accumulate_grad_hook(self, hook) -> None:
        """Call hook(tensor) each time this leaf's gradient for a backward is final."""
        if not self.is_leaf:
            raise AutogradError("post-accumulate hooks are for leaf tensors only")
        self._post_accumulate_hooks.append(hook)

    # ----------------------------------------------------------------- host access
    def item(self):
        if self.numel() != 1:
            raise KilnError(f"item() needs a tensor with one element, this one has shape {self.shape}")
        return self.numpy().reshape(()).item()

    def numpy(self):
        """The data as a NumPy array (the same memory on the CPU, a copy from a GPU)."""
        return self.backend.to_numpy(self.data)

    def tolist(self):
        return self.numpy().tolist()

    # ----------------------------------------------------------------- conversion
    def to(self, *args, dtype=None, device=None) -> "Tensor":
        """A tensor of another dtype and/or device: to(kiln.float64), to('cuda'), to('cpu', 'bfloat16')."""
        for a in args:
            if isinstance(a, DType):
                dtype = a
            elif isinstance(a, Device):
                device = a
            elif isinstance(a, str):
                try:
                    dtype = get_dtype(a)
                except DTypeError:
                    device = a
            else:
                raise KilnError(f"to() takes a dtype or a device, not {a!r}")
        out = self
        if device is not None and parse_device(device) != self.device:
            out = _ops.convert.to_device(out, parse_device(device))
        if dtype is not None and get_dtype(dtype) is not out.dtype:
            out = _ops.convert.to_dtype(out, get_dtype(dtype))
        return out

    def float(self) -> "Tensor":
        return self.to(get_dtype("float32"))

    def clone(self) -> "Tensor":
        return _ops.convert.clone(self)

    def contiguous(self) -> "Tensor":
        return _ops.convert.contiguous(self)

    # ----------------------------------------------------------------- in place (no autograd)
    def _check_inplace(self) -> None:
        if autograd.is_grad_enabled() and self.requires_grad:
            raise AutogradError(
                "in-place change of a tensor that requires grad; do it under kiln.no_grad() "
                "(as an optimizer does) or on a detached copy")

    def _bump(self) -> "Tensor":
        self._version[0] += 1
        return self

    def _other_array(self, other):
        if isinstance(other, Tensor):
            if other.device != self.device:
                from kiln.errors import DeviceError
                raise DeviceError(f"in-place op between {self.device} and {other.device}")
            return other.data
        return _ops.elementwise.scalar_array(self, other)

    def zero_(self) -> "Tensor":
        self._check_inplace()
        self.data[...] = 0
        return self._bump()

    def fill_(self, value) -> "Tensor":
        self._check_inplace()
        self.data[...] = value
        return self._bump()

    def copy_(self, src) -> "Tensor":
        self._check_inplace()
        arr = src.data if isinstance(src, Tensor) else src
        if tuple(arr.shape) != self.shape and self.backend.xp.broadcast_shapes(arr.shape, self.shape) != self.shape:
            from kiln.errors import ShapeError
            raise ShapeError(f"copy_ from shape {tuple(arr.shape)} into shape {self.shape}")
        self.data[...] = self.backend.asarray(arr).astype(self.dtype.np, copy=False)
        return self._bump()

    def add_(self, other, alpha=1.0) -> "Tensor":
        self._check_inplace()
        o = self._other_array(other)
        self.data += o if alpha == 1.0 else o * alpha
        return self._bump()

    def sub_(self, other) -> "Tensor":
        self._check_inplace()
        self.data -= self._other_array(other)
        return self._bump()

    def mul_(self, other) -> "Tensor":
        self._check_inplace()
        self.data *= self._other_array(other)
        return self._bump()

    def div_(self, other) -> "Tensor":
        self._check_inplace()
        self.data /= self._other_array(other)
        return self._bump()

    def __setitem__(self, index, value) -> None:
        self._check_inplace()
        self.data[_ops.shape.array_index(index)] = self._other_array(value)
        self._bump()

    # ----------------------------------------------------------------- operators
    def __add__(self, other): return _ops.elementwise.add(self, other)
    def __radd__(self, other): return _ops.elementwise.add(self, other)
    def __sub__(self, other): return _ops.elementwise.sub(self, other)
    def __rsub__(self, other): return _ops.elementwise.sub(other, self)
    def __mul__(self, other): return _ops.elementwise.mul(self, other)
    def __rmul__(self, other): return _ops.elementwise.mul(self, other)
    def __truediv__(self, other): return _ops.elementwise.div(self, other)
    def __rtruediv__(self, other): return _ops.elementwise.div(other, self)
    def __neg__(self): return _ops.elementwise.neg(self)
    def __pow__(self, other): return _ops.elementwise.pow(self, other)
    def __rpow__(self, other): return _ops.elementwise.pow(other, self)
    def __matmul__(self, other): return _ops.matmul.matmul(self, other)
    def __getitem__(self, index): return _ops.shape.getitem(self, index)
    def __eq__(self, other): return _ops.elementwise.compare(self, other, "equal")
    def __ne__(self, other): return _ops.elementwise.compare(self, other, "not_equal")
    def __lt__(self, other): return _ops.elementwise.compare(self, other, "less")
    def __le__(self, other): return _ops.elementwise.compare(self, other, "less_equal")
    def __gt__(self, other): return _ops.elementwise.compare(self, other, "greater")
    def __ge__(self, other): return _ops.elementwise.compare(self, other, "greater_equal")
    __hash__ = object.__hash__

    def __bool__(self) -> bool:
        if self.numel() != 1:
            raise KilnError(f"the truth value of a tensor of shape {self.shape} is ambiguous")
        return bool(self.item())

    def __float__(self) -> float:
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def exp(self): return _ops.elementwise.exp(self)
    def log(self): return _ops.elementwise.log(self)
    def sqrt(self): return _ops.elementwise.sqrt(self)
    def tanh(self): return _ops.elementwise.tanh(self)
    def pow(self, exponent): return _ops.elementwise.pow(self, exponent)
    def sum(self, dim=None, keepdim=False): return _ops.reduce.sum(self, dim, keepdim)
    def mean(self, dim=None, keepdim=False): return _ops.reduce.mean(self, dim, keepdim)
    def max(self, dim=None, keepdim=False): return _ops.reduce.max(self, dim, keepdim)
    def argmax(self, dim=None, keepdim=False): return _ops.reduce.argmax(self, dim, keepdim)
    def reshape(self, *shape): return _ops.shape.reshape(self, _shape_args(shape))
    def view(self, *shape): return _ops.shape.reshape(self, _shape_args(shape))
    def transpose(self, dim0, dim1): return _ops.shape.transpose(self, dim0, dim1)
    def permute(self, *dims): return _ops.shape.permute(self, _shape_args(dims))
    def split(self, split_size, dim=0): return _ops.shape.split(self, split_size, dim)
    def matmul(self, other): return _ops.matmul.matmul(self, other)
    def softmax(self, dim=-1): return _ops.softmax.softmax(self, dim)
    def log_softmax(self, dim=-1): return _ops.softmax.log_softmax(self, dim)

    @property
    def T(self) -> "Tensor":
        if self.ndim != 2:
            raise KilnError(f".T is for 2-D tensors; this one has shape {self.shape}; use transpose()")
        return self.transpose(0, 1)


def _shape_args(args) -> tuple:
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        return tuple(args[0])
    return tuple(args)


def _is_array(data) -> bool:
    return hasattr(data, "dtype") and hasattr(data, "shape")


def _shares(arr, data) -> bool:
    return arr is data or (_is_array(data) and getattr(arr, "base", None) is data)


def _device_of(data) -> Device:
    if _is_array(data) and type(data).__module__.startswith("cupy"):
        return Device("cuda", data.device.id)
    return CPU


# ---------------------------------------------------------------------- creation
def tensor(data, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    """A new leaf tensor with a copy of data; Python floats become float32, ints int64."""
    return Tensor(data, dtype=dtype, device=device, requires_grad=requires_grad)


def _filled(fill, shape, dtype, device, requires_grad):
    dev = parse_device(device)
    kd = get_dtype(dtype or "float32")
    xp = dev.backend.xp
    arr = xp.full(_shape_args(shape), fill, dtype=kd.np)
    return Tensor._wrap(arr, dev, requires_grad=requires_grad)


def zeros(*shape, dtype=None, device=None, requires_grad=False) -> Tensor:
    return _filled(0, shape, dtype, device, requires_grad)


def ones(*shape, dtype=None, device=None, requires_grad=False) -> Tensor:
    return _filled(1, shape, dtype, device, requires_grad)


def full(shape, value, dtype=None, device=None, requires_grad=False) -> Tensor:
    return _filled(value, (shape,) if isinstance(shape, numbers.Integral) else shape, dtype, device,
                   requires_grad)


def zeros_like(t: Tensor, dtype=None) -> Tensor:
    return zeros(t.shape, dtype=dtype or t.dtype, device=t.device)


def ones_like(t: Tensor, dtype=None) -> Tensor:
    return ones(t.shape, dtype=dtype or t.dtype, device=t.device)


def arange(start, stop=None, step=1, dtype=None, device=None) -> Tensor:
    if stop is None:
        start, stop = 0, start
    dev = parse_device(device)
    kd = get_dtype(dtype or "int64")
    return Tensor._wrap(dev.backend.xp.arange(start, stop, step, dtype=kd.np), dev)


from kiln import ops as _ops  # noqa: E402  (the ops need Tensor defined first)
