"""Gradients parked in page-locked host memory while the global norm is summed: AdamW in backward's
exact clip in one backward pass instead of two (`AdamW(..., in_backward=True, clip_via="host")`).

The clip's coefficient needs the norm of the whole gradient before the first update. The default
(`clip_via="recompute"`) runs backward twice over a retained graph (a second backward's FLOPs, and the
retained graph's activations held through the first pass). Here each gradient, as backward makes it, is
added to the norm and copied to the host on a copy stream (its device block is given back once the copy
has read it); after backward the gradients come back in parameter order, each copy overlapping the
previous parameter's update, through two device staging buffers. The gradients' bytes cross PCIe twice
(on an H100, ~25 GB each way for a 6B-parameter fp32 model) and live in host memory between; the
update reads the same bits the device made, so the result is the ordinary step's bit for bit.
"""

from __future__ import annotations

import collections

from kiln.errors import KilnError

# Gradients kept on the device while their copies to the host are still reading them: past this, the
# compute stream waits for the oldest copy before the gradient's block can be handed out again. Small: at
# ~50 GB/s a block's largest gradient (d=3072: 151 MB) is copied in ~3 ms, its block's backward takes ~25.
WINDOW_BYTES = 256 << 20


class HostGradStash:
    def __init__(self, backend):
        self.backend = backend
        self._host: dict = {}  # parameter index -> its page-locked host buffer, kept from step to step
        self._copy_stream = None
        self._pending: collections.deque = collections.deque()  # (copied event, gradient array)
        self._pending_bytes = 0
        self.order: list[int] = []  # the parameters stashed since the last drain, in backward's order

    def put(self, i: int, grad) -> None:
        """Copy gradient `grad` (a device array the compute stream has just made) of parameter `i` to
        the host; the caller drops its reference: the stash keeps the array until the copy has read it."""
        b = self.backend
        if self._copy_stream is None:
            self._copy_stream = b.new_stream()
        host = self._host.get(i)
        if host is None or host.shape != grad.shape or host.dtype != grad.dtype:
            try:
                host = self._host[i] = b.pinned_empty(grad.shape, grad.dtype)
            except Exception as e:  # the driver's error (a locked-memory limit, the host's memory)
                held = sum(h.nbytes for h in self._host.values())
                raise KilnError(f"the exact clip through host memory (clip_via='host') holds every gradient in "
                                f"page-locked host memory ({held / 1e9:.1f} GB held, {grad.nbytes / 1e6:.0f} MB more "
                                f"refused: {type(e).__name__}: {e}); use clip_via='recompute' "
                                "(--adamw-clip-via recompute): a second backward, no host memory") from e
        made = b.event()
        made.record(b.stream())
        self._copy_stream.wait_event(made)
        b.copy_async(host, grad, stream=self._copy_stream)
        copied = b.event()
        copied.record(self._copy_stream)
        self._pending.append((copied, grad))
        self._pending_bytes += grad.nbytes
        self.order.append(i)
        while self._pending_bytes > WINDOW_BYTES and len(self._pending) > 1:
            self._retire()

    def _retire(self) -> None:
        """The oldest copy's gradient goes back to the allocator: the compute stream waits for the copy
        first, so a kernel given its block later (the allocator serves one stream) runs after it."""
        copied, grad = self._pending.popleft()
        self.backend.stream().wait_event(copied)
        self._pending_bytes -= grad.nbytes

    def drain(self) -> None:
        """Every copy to the host ordered before the compute stream's next work; no gradient kept."""
        while self._pending:
            self._retire()

    def returned(self):
        """(parameter index, device array holding its gradient) for each stashed parameter, in order;
        the array is valid until the next item is asked for (the caller's kernels on the compute stream
        are ordered before the buffer is written again). Clears `order`."""
        b = self.backend
        self.drain()
        order, self.order = self.order, []
        if not order:
            return
        sizes: dict = {}
        for i in order:
            h = self._host[i]
            sizes[h.dtype] = max(sizes.get(h.dtype, 0), h.size)
        staging = {dt: [b.empty((n,), dt), b.empty((n,), dt)] for dt, n in sizes.items()}
        # The staging blocks may have been backward's, which queued kernels on the compute stream can still
        # be reading: the copy stream writes them only after everything queued there so far.
        ready = b.event()
        ready.record(b.stream())
        self._copy_stream.wait_event(ready)
        landed, used = [None, None], [None, None]

        def issue(k):
            host = self._host[order[k]]
            if used[k % 2] is not None:  # the update that read this buffer two parameters ago is done
                self._copy_stream.wait_event(used[k % 2])
            view = staging[host.dtype][k % 2][:host.size].reshape(host.shape)
            b.copy_async(view, host, stream=self._copy_stream)
            ev = b.event()
            ev.record(self._copy_stream)
            landed[k % 2] = ev
            return view

        views = [issue(0), None]
        for k, i in enumerate(order):
            if k + 1 < len(order):
                views[(k + 1) % 2] = issue(k + 1)
            b.stream().wait_event(landed[k % 2])
            yield i, views[k % 2]
            ev = b.event()
            ev.record(b.stream())
            used[k % 2] = ev
