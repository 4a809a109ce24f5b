"""The GPU kiln runs on: availability check, kiln's own stream, the device's architecture.

CuPy is imported lazily, so `import kiln.backend.cuda` works on a machine with CuPy but no
driver (or no CuPy at all); only `ensure_available()` and the first device call fail there.
All work runs on one non-blocking stream per device, created at first use and made CuPy's
current stream, so CuPy's own elementwise ops, kiln's kernels and cuBLASLt are ordered on it.

CuPy keeps a per-thread stack of streams besides the current one (cupy/cuda/stream.pyx,
_ThreadLocal): `Stream.use()` sets the current stream and leaves the stack alone, and a
`with stream:` block, when it exits, makes the stack's previous entry current. CuPy runs such
blocks itself (`ndarray.get()` of a strided array, so every `to_host`/`asnumpy` of a view), so a
stream made current with `use()` alone gave way to the legacy null stream after the first one,
and CuPy's own work that followed (a CPU fallback's upload of its results, the copies after it)
ran unordered with kiln's non-blocking stream until kiln's next launch made its stream current
again. kiln's stream is therefore pushed onto that stack once per thread and device, and stays.
"""

from __future__ import annotations

import os
import threading

from kiln.errors import DeviceError

_streams: dict = {}
_lock = threading.Lock()
_current = threading.local()  # .stream: the stream `use_stream` made current in this thread, or None


def cupy():
    """The cupy module (imported at first use)."""
    import cupy as cp
    return cp


def ensure_available() -> None:
    """Raise DeviceError unless CuPy imports and a CUDA device answers."""
    try:
        import cupy as cp
    except ImportError as e:
        raise DeviceError("the cuda backend needs CuPy: pip install 'kiln[cuda]' (cupy-cuda13x); "
                          f"importing cupy failed: {e}") from e
    try:
        n = cp.cuda.runtime.getDeviceCount()
    except Exception as e:  # CUDARuntimeError without a driver, or a CuPy built for another CUDA
        raise DeviceError(f"no usable CUDA device: {e}") from e
    if n < 1:
        raise DeviceError("no CUDA device found (cudaGetDeviceCount returned 0)")


def device_id() -> int:
    return cupy().cuda.runtime.getDevice()


def stream():
    """The stream kiln's work goes to, made CuPy's current stream in this thread: kiln's stream on
    the current device, or the one a `use_stream` block in this thread named."""
    s = getattr(_current, "stream", None)
    if s is None:
        s = compute_stream()
    elif cupy().cuda.get_current_stream().ptr != s.ptr:
        s.use()
    return s


def compute_stream():
    """kiln's own stream on the current device (created at first use), made CuPy's current stream."""
    dev = device_id()
    s = _streams.get(dev)
    if s is None:
        with _lock:
            s = _streams.get(dev)
            if s is None:
                s = _first_use(dev)
    pushed = getattr(_current, "pushed", None)
    if pushed is None:
        pushed = _current.pushed = set()
    if dev not in pushed:  # onto this thread's CuPy stream stack, never popped: see the module's doc
        s.__enter__()
        pushed.add(dev)
    # Checked on every call, not once per thread: other code can make another stream current, and
    # CuPy work there races kiln's non-blocking stream.
    elif cupy().cuda.get_current_stream().ptr != s.ptr:
        s.use()
    return s


def _first_use(dev: int):
    cp = cupy()
    if os.environ.get("KILN_CUDA_ALLOCATOR", "kiln") != "cupy":
        from kiln.backend.cuda import allocator
        allocator.install()
    s = cp.cuda.Stream(non_blocking=True)
    _streams[dev] = s
    return s


def arch() -> str:
    """The NVRTC target of the current device: sm_90a on Hopper (wgmma-capable), else sm_XY."""
    cc = cupy().cuda.Device().compute_capability
    return "sm_90a" if cc == "90" else f"sm_{cc}"


_attributes: dict = {}


def attribute(name: str) -> int:
    """One of the current device's attributes, by CuPy's name (cached per device)."""
    key = (device_id(), name)
    n = _attributes.get(key)
    if n is None:
        n = _attributes[key] = int(cupy().cuda.Device(key[0]).attributes[name])
    return n


def sm_count() -> int:
    """The current device's number of SMs (the grid of a persistent kernel)."""
    return attribute("MultiProcessorCount")


def device_name() -> str:
    """The current device's name, e.g. "NVIDIA H200" (the key of the profiler's cached ceilings)."""
    name = cupy().cuda.runtime.getDeviceProperties(device_id())["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def _nvtx():
    """CuPy's NVTX module, or None when this CuPy build has no NVTX (then ranges are no-ops)."""
    try:
        from cupy.cuda import nvtx
    except ImportError:
        return None
    return nvtx if getattr(nvtx, "available", True) else None


def range_push(name: str) -> None:
    """Open an NVTX range (Nsight Systems shows it over the kernels it encloses)."""
    nvtx = _nvtx()
    if nvtx is not None:
        nvtx.RangePush(name)


def range_pop() -> None:
    """Close the innermost NVTX range."""
    nvtx = _nvtx()
    if nvtx is not None:
        nvtx.RangePop()


def synchronize() -> None:
    """Wait until everything queued on kiln's stream has run."""
    stream().synchronize()


def ptr(a) -> int:
    """The device address of a CuPy array's first element."""
    return a.data.ptr
