"""CapturedStep: fn(*inputs) recorded once as a CUDA graph, then replayed with no Python on the hot path.

DESIGN.md: the training step is static (same shapes, no host sync inside), so it can be
captured once. The first call records fn on the device's stream (nothing runs while it is
recorded) and then replays it; every later call copies its inputs into the static buffers the
graph reads, on the same stream, and replays. fn's outputs are the same Tensor objects after
every call, overwritten by each replay; read them (`.item()`) before the next call.
fn must queue device work only: no `.item()`, no host data uploaded, no shape that changes.
Host state that must advance every step (AdamW's step count and lr) registers a callback with
`before_each_replay` while it is recorded; CapturedStep runs the callbacks before each replay.
"""

from __future__ import annotations

from kiln.errors import DeviceError, GraphCaptureError, ShapeError  # noqa: F401  (re-exported by kiln.graph)
from kiln.tensor import Tensor

_recording: list | None = None  # the callbacks of the capture in progress


def capturing() -> bool:
    """True while a CapturedStep is recording its function."""
    return _recording is not None


def before_each_replay(fn) -> None:
    """Run fn() on the host before every replay of the graph being recorded now."""
    if _recording is None:
        raise GraphCaptureError("before_each_replay is only meaningful while a CapturedStep records; "
                                "call it from the function being captured")
    _recording.append(fn)


class CapturedStep:
    def __init__(self, fn):
        self.fn = fn
        self._graph = None
        self._inputs: list[Tensor] | None = None
        self._hooks: list = []

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def __call__(self, *inputs: Tensor):
        if self._graph is None:
            return self._capture(inputs)
        if len(inputs) != len(self._inputs):
            raise ShapeError(f"this captured step takes {len(self._inputs)} inputs, got {len(inputs)}")
        for static, new in zip(self._inputs, inputs):
            if new.shape != static.shape or new.dtype is not static.dtype:
                raise ShapeError(f"a captured step's inputs keep their shape and dtype: recorded "
                                 f"{static.shape} {static.dtype}, got {new.shape} {new.dtype}")
            static.data[...] = new.data
        return self._replay()

    def _replay(self):
        for hook in self._hooks:
            hook()
        self._graph.launch()
        return self._graph.result

    def _capture(self, inputs):
        if not inputs or any(not t.device.backend.captures_graphs for t in inputs):
            raise DeviceError("CapturedStep records CUDA graphs: its inputs must be tensors on a cuda device, "
                              f"got {[str(t.device) for t in inputs]}")
        global _recording
        if _recording is not None:
            raise GraphCaptureError("CapturedSteps do not nest: this step was called while another one records")
        backend = inputs[0].backend
        self._inputs = [Tensor._wrap(t.data.copy(), t.device) for t in inputs]
        _recording = hooks = []
        try:
            self._graph = backend.capture(lambda: self.fn(*self._inputs))
        finally:
            _recording = None
        self._hooks = hooks
        return self._replay()

    def release(self) -> None:
        """Drop the graph (its memory returns to the allocator); the next call records it again."""
        if self._graph is not None:
            self._graph.release()
        self._graph, self._inputs, self._hooks = None, None, []
