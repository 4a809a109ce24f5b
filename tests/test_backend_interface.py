"""Both backends export exactly the names of kiln.backend.interface, and only the backend imports
the device library: the interface is a file, not three hand-kept lists."""

import inspect
import subprocess
import sys
import types

import pytest

from kiln.backend import interface


def defined_callables(mod) -> set:
    """The public callables a backend package defines itself (in it or its submodules), whether
    or not it lists them: what it really offers, to compare with the interface."""
    return {name for name, value in vars(mod).items()
            if not name.startswith("_") and callable(value) and not isinstance(value, types.ModuleType)
            and not inspect.isclass(value) and getattr(value, "__module__", "").startswith(mod.__name__)}


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_a_backend_exports_exactly_the_interface(kind):
    import importlib
    mod = importlib.import_module(f"kiln.backend.{kind}")  # cuda: imports without a GPU or CuPy
    want = set(interface.exports(mod.captures_graphs))
    assert len(want) == len(interface.exports(mod.captures_graphs)), "a name is declared twice"
    assert set(mod.__all__) == want | set(interface.FACTS)
    missing = {n for n in want if not callable(getattr(mod, n, None))}
    assert not missing, f"kiln.backend.{kind} lacks {sorted(missing)}"
    extra = defined_callables(mod) - want
    assert not extra, f"kiln.backend.{kind} defines {sorted(extra)}, which the interface does not declare"
    for fact in interface.FACTS:
        assert hasattr(mod, fact), f"kiln.backend.{kind} lacks {fact}"
    assert mod.name == kind


def test_cpu_and_cuda_agree_except_for_graph_capture():
    from kiln.backend import cpu, cuda
    assert not cpu.captures_graphs and cuda.captures_graphs
    assert set(cuda.__all__) - set(cpu.__all__) == set(interface.GRAPH_CAPTURE)


def test_the_profiler_wraps_every_kernel_including_autograds_sums():
    import numpy as np

    import kiln
    from kiln.profiler import Profiler
    a = kiln.tensor(np.random.default_rng().standard_normal((4, 3)).astype(np.float32), requires_grad=True)
    with Profiler(kiln.device("cpu")) as prof:
        (a * a + a).sum().backward()  # a's gradient is the sum of three: autograd's `add` kernel
    assert "add" in prof.summary()["kernels"]
    from kiln.backend import cpu
    assert all(getattr(cpu, name).__name__ != "timed" for name in interface.KERNELS)  # unwrapped after


def test_only_the_backend_imports_cupy():
    """No module outside kiln/backend/ imports cupy or cupyx (read from the source, and checked
    by importing kiln's packages with cupy made unimportable)."""
    from pathlib import Path

    import kiln
    root = Path(kiln.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        if "backend" in path.relative_to(root).parts[:1]:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            words = line.strip().split()
            if words[:1] in (["import"], ["from"]) and len(words) > 1 and words[1].split(".")[0] in ("cupy", "cupyx"):
                offenders.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    assert not offenders, offenders
    code = ("import sys; sys.modules['cupy'] = None; sys.modules['cupyx'] = None\n"
            "import kiln, kiln.train, kiln.cli, kiln.data.staging, kiln.checkpoint.async_save, kiln.profiler\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_op_without_a_cuda_kernel_for_its_arguments_says_it_runs_on_the_cpu(monkeypatch):
    """backend/cuda's CPU fallback (e.g. attention at head dim 16: the kernels take 32, 64, 128) warns:
    in silence a GPU run would be slow and its step uncapturable with no word why (the H200 recovery
    tests of 2026-12-04 ran so, unseen until their graph assertions failed)."""
    import numpy as np

    from kiln.backend.cuda import launch
    from kiln.backend.cuda.launch import cpu_fallback
    monkeypatch.setattr(launch.rt, "stream", lambda: None)  # no GPU here: kiln's stream is not needed

    def attention_fwd(q, scale):
        return q.shape[-1] * scale

    q = np.zeros((2, 4, 8, 16), np.float32)
    with pytest.warns(RuntimeWarning, match=r"attention_fwd has no CUDA kernel for these arguments "
                                            r"\(float32 \[2, 4, 8, 16\]\): it runs on the CPU"):
        assert cpu_fallback(attention_fwd, q, 2.0) == 32.0


def test_a_kernel_opts_in_to_dynamic_shared_memory_past_48_kib_once(monkeypatch):
    """cudaFuncSetAttribute(MaxDynamicSharedMemorySize) is set at the first launch that needs more
    than the default 48 KiB (attention_fwd_tma's 145-225 KiB), raised when a later launch needs more,
    and left alone otherwise."""
    from kiln.backend.cuda import device, launch
    from kiln.backend.cuda.launch import Kernel

    class Function:
        def __init__(self):
            self.attribute_sets, self.launches = [], []

        def __call__(self, grid, block, args, shared_mem, stream):
            self.launches.append(shared_mem)

    monkeypatch.setattr(launch, "set_max_dynamic_shared", lambda f, n: f.attribute_sets.append(n))
    monkeypatch.setattr(device, "stream", lambda: None)
    fn = Function()
    k = Kernel("attention.cu", "k", fn)
    for shared in (0, 48 * 1024, 148560, 148560, 100000, 230464):
        k((1,), (384,), (), shared_mem=shared)
    assert fn.launches == [0, 48 * 1024, 148560, 148560, 100000, 230464]
    assert fn.attribute_sets == [148560, 230464]


class _FakeStream:
    """A CuPy stream, by name, that a fake CuPy's copies log."""

    def __init__(self, name):
        self.name = name


class _FakeDeviceArray:
    def __init__(self, host, cuda):
        self.host, self.dtype, self.shape, self._cuda = host, host.dtype, host.shape, cuda

    def get(self):
        self._cuda.log.append(("to host", self._cuda.current.name))
        return self.host.copy()


class _FakeCupy:
    def __init__(self):
        self.log = []
        self.current = _FakeStream("legacy null")
        self.kiln = _FakeStream("kiln")

    def asarray(self, host):
        self.log.append(("to device", self.current.name))
        return _FakeDeviceArray(host, self)


@pytest.mark.parametrize("current", ["legacy null", "kiln"])
def test_the_cpu_fallback_copies_in_order_with_kilns_stream_whichever_stream_is_current(monkeypatch, current):
    """cpu_fallback makes kiln's stream current before its copies, as a kernel launch does: the host reads
    the arguments (a blocking copy) after kiln's queued work, and the results are uploaded on kiln's stream,
    ahead of the work that reads them, whichever stream was current (the legacy null stream, seen on the
    H200: the zeros of 2026-12-05's packed-views attention test)."""
    import numpy as np

    from kiln.backend.cuda import launch

    cp = _FakeCupy()
    if current == "kiln":
        cp.current = cp.kiln

    def stream():  # device.stream(): kiln's stream, made current
        cp.current = cp.kiln
        return cp.kiln

    monkeypatch.setattr(launch.rt, "cupy", lambda: cp)
    monkeypatch.setattr(launch.rt, "stream", stream)

    def attention_fwd(q, ks, scale):
        return q * scale, (q + ks[0]).sum(axis=-1)

    q, k = np.arange(6.0).reshape(2, 3), np.ones((2, 3))
    with pytest.warns(RuntimeWarning, match="attention_fwd has no CUDA kernel"):
        out, total = launch.cpu_fallback(attention_fwd, _FakeDeviceArray(q, cp), [_FakeDeviceArray(k, cp)], 2.0)
    assert np.array_equal(out.host, q * 2.0) and np.array_equal(total.host, (q + 1).sum(axis=-1))
    assert cp.log == [("to host", "kiln"), ("to host", "kiln"), ("to device", "kiln"), ("to device", "kiln")]
    assert cp.current is cp.kiln
