"""Conversions that stay in the graph: dtype casts, device moves, copies."""

from __future__ import annotations

from kiln.autograd import Function


class ToDType(Function):
    fresh_grads = True  # the cast back is a new array: AccumulateGrad may keep it without a copy

    @staticmethod
    def forward(ctx, x, dtype):
        ctx.src = x.dtype.np
        ctx.backend = x.backend
        return x.backend.cast(x.data, dtype.np)

    @staticmethod
    def backward(ctx, g):
        # g already in the source dtype: the op that used the cast made it so (grad_dtype), as a new
        # array (every op that does has fresh_grads), so passing it on keeps this class's promise
        return g if g.dtype == ctx.src else ctx.backend.cast(g, ctx.src)


def grad_dtype(x):
    """The NumPy dtype x's gradient is best made in: when x is a cast of another tensor (a bf16 copy of
    an fp32 master weight), that tensor's dtype, so the op that uses x writes its gradient in fp32 from
    its fp32 accumulator and the cast's backward has nothing to do; else x's own dtype."""
    return x.grad_fn.src if isinstance(x.grad_fn, ToDType) else x.dtype.np


class KeptCopy:
    """A tensor's copy in another dtype, kept across steps: a master weight's bf16 copy in a
    mixed-precision step. It is recast only when the tensor changed since (its version moved);
    AdamW writes it from each updated value (kiln.optim.AdamW), so a training step casts no weight.

    A recast writes into the same buffer, so a CUDA graph that reads the copy keeps reading the
    right one. Whoever changes the tensor in place between graph replays (no forward checks the
    version inside a replay) calls refresh() after, as the Trainer does when it undoes a step."""

    __slots__ = ("dtype", "data", "version")

    def __init__(self, dtype):
        self.dtype = dtype
        self.data = None     # the backend array, allocated at the first read
        self.version = None  # the tensor's version that data holds

    def read(self, x):
        """The copy of x (recast first when x changed since)."""
        if self.data is None or self.version != x._version[0]:
            self.refresh(x)
        return self.data

    def refresh(self, x) -> None:
        """Recast x into the copy's buffer (a new buffer only when x's shape or array type changed)."""
        if self.data is None or self.data.shape != x.data.shape or type(self.data) is not type(x.data):
            self.data = x.backend.cast(x.data, self.dtype.np)
        else:
            x.backend.cast(x.data, self.dtype.np, out=self.data)
        self.version = x._version[0]


class ToKeptDType(ToDType):
    """x.to(kept.dtype) read from `kept`, a copy that x keeps (KeptCopy); the backward is ToDType's."""

    @staticmethod
    def forward(ctx, x, kept):
        ctx.src = x.dtype.np
        ctx.backend = x.backend
        return kept.read(x)


class ToDevice(Function):
    @staticmethod
    def forward(ctx, x, device):
        ctx.src_backend = x.backend
        ctx.out_device = device
        return device.backend.asarray(x.data)

    @staticmethod
    def backward(ctx, g):
        return ctx.src_backend.asarray(g)


class Clone(Function):
    @staticmethod
    def forward(ctx, x):
        return x.data.copy()

    @staticmethod
    def backward(ctx, g):
        return g


def to_dtype(x, dtype):
    return ToDType.apply(x, dtype)


def to_kept_dtype(x, kept):
    """x in kept.dtype, from the copy x keeps (KeptCopy): no cast when x has not changed since."""
    return ToKeptDType.apply(x, kept)


def to_device(x, device):
    return ToDevice.apply(x, device)


def clone(x):
    return Clone.apply(x)


def contiguous(x):
    """x itself when its memory is already C-contiguous, else a contiguous copy."""
    return x if x.data.flags.c_contiguous else Clone.apply(x)
