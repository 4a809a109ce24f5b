"""Module and Parameter: a tree of named parameters with state_dict, train/eval and device moves."""

from __future__ import annotations

from collections import OrderedDict

from kiln.autograd import no_grad
from kiln.backend import device as parse_device
from kiln.dtypes import get_dtype
from kiln.errors import KilnError, ShapeError
from kiln.ops.convert import KeptCopy
from kiln.tensor import Tensor


class Parameter(Tensor):
    """A leaf tensor that a Module owns and an optimizer updates; requires grad by default.

    `kept`: its copy in the compute dtype of a mixed-precision step (a KeptCopy, made at the first
    forward that asks for one), which AdamW writes with each update; None until then."""

    __slots__ = ("kept",)

    def __init__(self, data, requires_grad: bool = True):
        if isinstance(data, Tensor):
            self._init(data.data, data.device, requires_grad)
        else:
            super().__init__(data, requires_grad=requires_grad)

    def _init(self, *args, **kwargs):
        super()._init(*args, **kwargs)
        self.kept = None

    def kept_copy(self, dtype) -> KeptCopy:
        """The copy of this parameter in dtype that it keeps (a new one when it kept another dtype)."""
        if self.kept is None or self.kept.dtype is not dtype:
            self.kept = KeptCopy(dtype)
        return self.kept

    def __repr__(self) -> str:
        return "Parameter(" + super().__repr__() + ")"


class Module:
    """Base of every layer: assign Parameters and Modules as attributes and they are registered."""

    def __init__(self):
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "training", True)

    def __setattr__(self, name, value):
        if "_parameters" not in self.__dict__:
            raise KilnError(f"{type(self).__name__}.__init__ must call super().__init__() first")
        # a replacement of the same kind keeps its place: a model whose layers were swapped for their
        # parallel forms (kiln.distributed) lists its parameters in the dense model's order
        if isinstance(value, Parameter):
            self._modules.pop(name, None)
            self._parameters[name] = value
        elif isinstance(value, Module):
            self._parameters.pop(name, None)
            self._modules[name] = value
        else:
            self._parameters.pop(name, None)
            self._modules.pop(name, None)
        object.__setattr__(self, name, value)

    def forward(self, *args, **kwargs):  # pragma: no cover - abstract
        raise NotImplementedError

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    # ------------------------------------------------------------------ traversal
    def named_modules(self, prefix: str = ""):
        yield prefix, self
        for name, mod in self._modules.items():
            yield from mod.named_modules(f"{prefix}.{name}" if prefix else name)

    def modules(self):
        for _, m in self.named_modules():
            yield m

    def named_parameters(self, prefix: str = ""):
        """(name, parameter) pairs, each parameter once (a tied weight under its first name)."""
        seen = set()
        for mod_name, mod in self.named_modules(prefix):
            for name, p in mod._parameters.items():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield (f"{mod_name}.{name}" if mod_name else name), p

    def parameters(self):
        for _, p in self.named_parameters():
            yield p

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # ------------------------------------------------------------------ state
    def state_dict(self) -> "OrderedDict[str, Tensor]":
        """Every parameter by name, detached (the same storage)."""
        return OrderedDict((name, p.detach()) for name, p in self.named_parameters())

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Copy tensors into the parameters of the same names; strict checks keys and shapes."""
        own = dict(self.named_parameters())
        missing = [k for k in own if k not in state]
        unexpected = [k for k in state if k not in own]
        if strict and (missing or unexpected):
            raise KilnError(f"state_dict does not match {type(self).__name__}: missing keys {missing}, "
                            f"unexpected keys {unexpected}")
        for name, p in own.items():
            if name not in state:
                continue
            value = state[name]
            arr_shape = tuple(value.shape)
            if arr_shape != p.shape:
                raise ShapeError(f"state_dict[{name!r}] has shape {arr_shape}, the parameter has {p.shape}")
            with no_grad():
                src = value.data if isinstance(value, Tensor) else value
                p.copy_(p.backend.asarray(src).astype(p.dtype.np, copy=False))

    # ------------------------------------------------------------------ modes, devices, grads
    def train(self, mode: bool = True) -> "Module":
        for m in self.modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self) -> "Module":
        return self.train(False)

    def to(self, device=None, dtype=None) -> "Module":
        """Move (and/or cast) every parameter in place, keeping each Parameter object."""
        dev = parse_device(device) if device is not None else None
        kd = get_dtype(dtype) if dtype is not None else None
        for p in self.parameters():
            arr = p.data
            if dev is not None and dev != p.device:
                arr = dev.backend.asarray(arr)
            if kd is not None and kd is not p.dtype:
                arr = arr.astype(kd.np)
            if arr is not p.data:
                p.data = arr
                p.device = dev if dev is not None else p.device
                p.dtype = get_dtype(arr.dtype)
                p.grad = None
                p._version[0] += 1
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.parameters():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.data[...] = 0


class ModuleList(Module):
    """Modules in a list, registered as "0", "1", ..."""

    def __init__(self, modules=()):
        super().__init__()
        for m in modules:
            self.append(m)

    def append(self, module: Module) -> None:
        setattr(self, str(len(self._modules)), module)

    def __iter__(self):
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, i: int) -> Module:
        return list(self._modules.values())[i]
