"""Gradient buckets: parameters' gradients laid out in flat buffers of at most `cap` bytes.

DDP (Algorithm 1) copies each gradient into its bucket as it becomes ready and all-reduces a
bucket once it is complete. The layout is the part ZeRO reuses: every bucket's length is padded
to a multiple of `pad_to` (the world size), so a bucket reduce-scatters into equal shards
(`Bucket.shard`), and `slot(p)` says where a parameter lives in it.
"""

from __future__ import annotations

from kiln.tensor import Tensor


class Bucket:
    """One flat zeroed buffer (a Tensor) holding `params`' gradients back to back, in order."""

    def __init__(self, index: int, params: list, pad_to: int):
        self.index, self.params = index, params
        first = params[0]
        self.offsets, n = [], 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.numel = n
        padded = -(-n // pad_to) * pad_to
        self.buffer = Tensor._wrap(first.backend.zeros((padded,), first.dtype.np), first.device)
        self.pending = len(params)  # gradients still to come in this backward (Algorithm 1, line 16)
        self.work = None             # the all-reduce in flight

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.dtype.itemsize

    def view(self, i: int):
        """params[i]'s slot in the buffer, shaped like the parameter (an array view)."""
        p = self.params[i]
        return self.buffer.data[self.offsets[i]:self.offsets[i] + p.numel()].reshape(p.shape)

    def shard(self, rank: int, world_size: int):
        """Rank's equal share of the padded buffer (what a reduce-scatter leaves it), an array view."""
        size = self.buffer.numel() // world_size
        return self.buffer.data[rank * size:(rank + 1) * size]


class GradientBuckets:
    """Parameters in gradient-ready order, cut into buckets of <= cap_bytes of one dtype and device
    each (a parameter larger than the cap gets a bucket of its own)."""

    def __init__(self, params: list, cap_bytes: int, pad_to: int = 1):
        self.cap_bytes = int(cap_bytes)
        groups, current, size = [], [], 0
        for p in params:
            nbytes = p.numel() * p.dtype.itemsize
            if current and (size + nbytes > self.cap_bytes or p.dtype is not current[0].dtype
                            or p.device != current[0].device):
                groups.append(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            groups.append(current)
        self.buckets = [Bucket(i, g, pad_to) for i, g in enumerate(groups)]
        self._slots = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}

    def slot(self, p) -> tuple[Bucket, int]:
        return self._slots[id(p)]

    @property
    def order(self) -> list:
        return [p for b in self.buckets for p in b.params]

    def __len__(self) -> int:
        return len(self.buckets)
