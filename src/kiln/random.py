"""Seeded random number generators, one per device, whose state a checkpoint can save."""

from __future__ import annotations

from kiln.backend import device as parse_device
from kiln.dtypes import get_dtype


class Generator:
    """A seeded stream of random numbers on one device (PCG64 on the CPU)."""

    def __init__(self, seed: int = 0, device="cpu"):
        self.device = parse_device(device)
        self.seed = int(seed)
        self.native = self.device.backend.new_generator(self.seed)

    def manual_seed(self, seed: int) -> "Generator":
        self.seed = int(seed)
        self.native = self.device.backend.new_generator(self.seed)
        return self

    def get_state(self):
        return self.device.backend.generator_state(self.native)

    def set_state(self, state) -> None:
        self.device.backend.set_generator_state(self.native, state)


_defaults: dict = {}


def default_generator(device="cpu") -> Generator:
    dev = parse_device(device)
    if dev not in _defaults:
        _defaults[dev] = Generator(0, dev)
    return _defaults[dev]


def manual_seed(seed: int) -> None:
    """Reseed the default generator of every device used so far (and of the CPU)."""
    default_generator("cpu")
    for gen in _defaults.values():
        gen.manual_seed(seed)


def _sampled(kind, shape, dtype, device, generator, requires_grad):
    from kiln.tensor import Tensor, _shape_args
    gen = generator or default_generator(device or "cpu")
    dev = gen.device if device is None else parse_device(device)
    if dev != gen.device:
        from kiln.errors import DeviceError
        raise DeviceError(f"a generator on {gen.device} cannot fill a tensor on {dev}")
    kd = get_dtype(dtype or "float32")
    fn = dev.backend.rng_normal if kind == "normal" else dev.backend.rng_uniform
    return Tensor._wrap(fn(gen.native, _shape_args(shape), kd.np), dev, requires_grad=requires_grad)


def randn(*shape, dtype=None, device=None, generator=None, requires_grad=False):
    """Standard normal samples."""
    return _sampled("normal", shape, dtype, device, generator, requires_grad)


def rand(*shape, dtype=None, device=None, generator=None, requires_grad=False):
    """Uniform samples in [0, 1)."""
    return _sampled("uniform", shape, dtype, device, generator, requires_grad)
