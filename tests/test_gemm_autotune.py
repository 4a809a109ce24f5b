"""GEMM algorithm tuning (gemm_autotune.py, cublaslt.select): which candidate wins, when nothing is timed,
the per-machine file and its key, a torn or rejected entry, two writers; then, on a GPU, every epilogue
run with every candidate against float64 NumPy, two processes agreeing through the file, and a graph
captured after tuning running the tuned algorithm.

On the CPU cuBLASLt is a fake (FakeLt): it hands out candidates, accepts or rejects stored algorithms and
records which algorithm each launch ran; the device timing is replaced by given times.
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing
import os
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

import kiln
from kiln.backend.cuda import cublaslt, gemm_autotune as tune
from kiln.errors import ConfigError

BF16 = np.dtype(ml_dtypes.bfloat16)
ROOT = Path(__file__).resolve().parents[1]


def algo(i):
    return [i, 100 + i, 0, 0, 0, 0, 0, 7]


class FakeLt:
    """The cuBLASLt calls a plan makes, answered in Python: `candidates` are (algo, workspace, state)."""

    def __init__(self, candidates, version=130100):
        self.candidates, self.version = candidates, version
        self.accepted = {tuple(a) for a, _, st in candidates if st == 0}
        self.requested = []
        self.launches = []  # (algo, C pointer)

    def __getattr__(self, name):  # descriptor and layout attributes, the preference: accepted
        if name.endswith(("SetAttribute", "Destroy")):
            return lambda *args: 0
        raise AttributeError(name)

    def _handle(self, ref, *args):
        ref._obj.value = 1
        return 0

    cublasLtMatmulDescCreate = cublasLtMatrixLayoutCreate = cublasLtMatmulPreferenceCreate = _handle

    def cublasLtMatmulAlgoGetHeuristic(self, handle, desc, la, lb, lc, ld, pref, count, results, found):
        self.requested.append(count)
        n = min(count, len(self.candidates))
        for r, (a, ws, st) in zip(results, self.candidates[:n]):
            r.algo[:] = a
            r.workspaceSize, r.state = ws, st
        found._obj.value = n
        return 0

    def cublasLtMatmulAlgoCheck(self, handle, desc, la, lb, lc, ld, algo_ref, result_ref):
        ok = tuple(algo_ref._obj) in self.accepted
        result_ref._obj.state = 0 if ok else 15
        return 0 if ok else 15

    def cublasLtMatmul(self, handle, desc, alpha, b, la, a, lb, beta, c, lc, d, ld, algo_ref, ws, wss, stream):
        self.launches.append((list(algo_ref._obj), c.value))
        return 0

    def cublasLtGetVersion(self):
        return self.version


class FakeArray:
    def __init__(self, ptr, dtype=np.float32):
        self.ptr, self.dtype = ptr, np.dtype(dtype)


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """cublaslt over FakeLt on a fake device; the kernel cache (and the algorithm file) in tmp_path.
    fake.times: the median ms the device timing reports per candidate; fake.timed: plans it timed."""
    state = SimpleNamespace(lib=FakeLt([(algo(i), 1 << 20, 0) for i in range(4)]), times=[1.0, 0.6, 0.9, 0.8],
                            timed=[], capturing=False, device_id=0, tmp=tmp_path)
    monkeypatch.setenv("KILN_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv(tune.ENV, "1")
    monkeypatch.setattr(tune, "MIN_FLOP", 2 * 64 * 32 * 16)  # run_gemm's default shape is just tuned
    stream = SimpleNamespace(ptr=5, is_capturing=lambda: state.capturing)
    monkeypatch.setattr(cublaslt, "rt", SimpleNamespace(
        device_id=lambda: state.device_id, device_name=lambda: "Fake GPU 9000", ptr=lambda a: a.ptr,
        stream=lambda: stream))
    monkeypatch.setattr(cublaslt, "_load_library", lambda: state.lib)
    ctx = SimpleNamespace(handle=ctypes.c_void_p(3), workspace=SimpleNamespace(data=SimpleNamespace(ptr=1 << 30)))
    monkeypatch.setattr(cublaslt, "_context", lambda: ctx)

    def time_candidates(plan, ops):
        state.timed.append(plan)
        return list(state.times[:len(plan.candidates)])
    monkeypatch.setattr(cublaslt, "_time_candidates", time_candidates)
    fresh_process(monkeypatch)
    return state


def fresh_process(monkeypatch):
    """cublaslt's in-process state as a new process has it (no plans, no file read, no warning given)."""
    monkeypatch.setattr(cublaslt, "_plans", {})
    monkeypatch.setattr(cublaslt, "_algo_caches", {})
    monkeypatch.setattr(cublaslt, "_tune_stats", dict.fromkeys(cublaslt._tune_stats, 0))
    monkeypatch.setattr(cublaslt, "_warned", set())


def run_gemm(m=64, n=32, k=16, c_ptr=1 << 24, **kw):
    """One fake gemm (A at 1 << 20, B at 1 << 22, C at c_ptr); the algorithm it launched."""
    lib = cublaslt._load_library()
    cublaslt.gemm(FakeArray(1 << 20), FakeArray(1 << 22), FakeArray(c_ptr), m=m, n=n, k=k, **kw)
    return lib.launches[-1][0]


def the_file(state) -> dict:
    files = list(state.tmp.glob("gemm-algos-*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


# ---------------------------------------------------------------- the choice


def test_the_fastest_candidate_wins_by_more_than_the_margin():
    assert tune.choose([1.0, 0.6, 0.9, 0.7]) == 1
    assert tune.choose([1.0, 1.2, 0.9]) == 2
    assert tune.choose([1.0, 0.99, 1.5]) == 0            # within 2%: the heuristic's pick stays
    assert tune.choose([1.0, 0.97], margin=0.02) == 1
    assert tune.choose([1.0, float("inf"), 0.5]) == 2     # a candidate cuBLASLt refused never wins
    assert tune.choose([float("inf"), 2.0, 3.0]) == 1    # nor does a refused first pick stay
    assert tune.choose([float("inf")] * 3) == 0
    assert tune.choose([1.0, float("nan"), 0.4]) == 2


def test_the_switch_takes_one_and_zero_only(monkeypatch):
    monkeypatch.delenv(tune.ENV, raising=False)
    assert not tune.enabled()  # off until measured on a GPU
    monkeypatch.setenv(tune.ENV, "1")
    assert tune.enabled() and tune.candidate_count(tune.MIN_FLOP) == tune.CANDIDATES
    assert tune.candidate_count(tune.MIN_FLOP - 1) == 1
    monkeypatch.setenv(tune.ENV, "0")
    assert not tune.enabled() and tune.candidate_count(1 << 40) == 1
    monkeypatch.setenv(tune.ENV, "yes")
    with pytest.raises(ConfigError, match="KILN_GEMM_AUTOTUNE='yes'"):
        tune.enabled()


def test_a_plan_keeps_the_candidates_that_succeed_and_fit_the_workspace(fake):
    fake.lib = FakeLt([(algo(0), 1 << 20, 0), (algo(1), cublaslt.WORKSPACE_BYTES + 1, 0), (algo(2), 0, 15),
                       (algo(3), cublaslt.WORKSPACE_BYTES, 0)])
    fake.times = [1.0, 0.5]
    assert run_gemm() == algo(3)   # the candidates timed were algo(0) and algo(3), in the heuristic's order
    plan, = cublaslt._plans.values()
    assert [list(c.algo) for c in plan.candidates] == [algo(0), algo(3)]
    assert fake.lib.requested == [tune.CANDIDATES]


def test_no_usable_candidate_is_an_error_that_names_the_gemm(fake):
    fake.lib = FakeLt([(algo(0), cublaslt.WORKSPACE_BYTES + 1, 0), (algo(1), 0, 15)])
    with pytest.raises(cublaslt.CublasError, match="no algorithm for float32 GEMM m=64 n=32 k=16"):
        run_gemm()


def test_the_first_use_times_the_candidates_and_the_plan_keeps_the_fastest(fake):
    assert run_gemm() == algo(1)
    assert len(fake.timed) == 1
    fake.times = [0.1, 2.0, 2.0, 2.0]  # timing again would now pick algo(0): it is not timed again
    assert run_gemm() == algo(1) and run_gemm(c_ptr=1 << 25) == algo(1)
    assert len(fake.timed) == 1
    assert cublaslt.autotune_stats()["plans_tuned"] == 1
    entry, = the_file(fake)["algos"].values()
    assert entry["algo"] == algo(1) and entry["index"] == 1 and entry["median_ms"] == [1.0, 0.6, 0.9, 0.8]


def test_a_gemm_first_met_inside_a_capture_is_never_timed_and_keeps_the_heuristics_pick(fake):
    fake.capturing = True
    with pytest.warns(RuntimeWarning, match="inside a CUDA graph capture") as caught:
        assert run_gemm() == algo(0)
        assert run_gemm(n=48) == algo(0)  # a second shape: no second warning
    assert len([w for w in caught if "capture" in str(w.message)]) == 1
    assert fake.timed == [] and cublaslt.autotune_stats()["plans_untuned_in_capture"] == 2
    assert not list(fake.tmp.glob("gemm-algos-*.json"))  # nothing untimed is written
    fake.capturing = False  # the same plan outside the capture: it keeps what the graph runs
    assert run_gemm() == algo(0) and fake.timed == []


def test_a_capture_uses_the_cached_choice(fake, monkeypatch):
    run_gemm()
    fresh_process(monkeypatch)
    fake.capturing = True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert run_gemm() == algo(1)
    assert fake.timed[1:] == []


def test_tuning_off_asks_for_one_algorithm_times_nothing_and_writes_nothing(fake, monkeypatch):
    monkeypatch.setenv(tune.ENV, "0")
    assert run_gemm() == algo(0)
    assert fake.lib.requested == [1] and fake.timed == []
    assert not list(fake.tmp.glob("gemm-algos-*.json"))


def test_a_gemm_below_the_size_worth_tuning_keeps_the_heuristics_pick_untimed_and_unwritten(fake):
    assert run_gemm(k=8) == algo(0)
    assert fake.lib.requested == [1] and fake.timed == []
    assert not list(fake.tmp.glob("gemm-algos-*.json"))
    assert run_gemm(k=16) == algo(1) and fake.lib.requested == [1, tune.CANDIDATES]


def test_without_memory_for_the_scratch_the_heuristics_pick_runs_untimed_and_unwritten(fake, monkeypatch):
    monkeypatch.setattr(cublaslt, "_time_candidates", lambda plan, ops: fake.timed.append(plan))
    with pytest.warns(RuntimeWarning, match="no device memory") as caught:
        assert run_gemm(accumulate=True) == algo(0)
        assert run_gemm(n=48, accumulate=True) == algo(0)
    assert len([w for w in caught if "no device memory" in str(w.message)]) == 1
    assert len(fake.timed) == 2 and cublaslt.autotune_stats()["plans_untuned_no_memory"] == 2
    assert not list(fake.tmp.glob("gemm-algos-*.json"))


def test_a_numpy_integer_in_a_key_is_stored_as_its_number():
    key = (0, "float32", 68, np.int64(64), 32, 16, False, True, 16, 16, 32, 1, (0, 0, 0), "default", (256,) * 3)
    assert json.loads(tune.disk_key(key))[2:6] == [64, 32, 16, False]


def test_a_single_candidate_is_kept_without_timing(fake):
    fake.lib = FakeLt([(algo(5), 0, 0)])
    assert run_gemm() == algo(5) and fake.timed == []
    assert list(the_file(fake)["algos"].values())[0]["algo"] == algo(5)


# ---------------------------------------------------------------- the file


def test_a_second_process_runs_the_first_ones_choice_without_timing(fake, monkeypatch):
    assert run_gemm(epilogue="bias", bias=FakeArray(1 << 26)) == algo(1)
    fresh_process(monkeypatch)
    fake.device_id = 1          # another device of the same name: the same file, the same key
    fake.times = [0.1, 2.0, 2.0, 2.0]
    assert run_gemm(epilogue="bias", bias=FakeArray(1 << 26)) == algo(1)
    assert len(fake.timed) == 1 and cublaslt.autotune_stats()["plans_from_cache"] == 1
    data = the_file(fake)
    assert data["device"] == "Fake GPU 9000" and data["cublaslt_version"] == 130100
    key, = data["algos"]
    assert json.loads(key)[:5] == ["float32", cublaslt.CUBLAS_COMPUTE_32F, 64, 32, 16] and "bias" in key
    assert list(fake.tmp.glob("gemm-algos-*.json"))[0].name == "gemm-algos-Fake_GPU_9000-cublasLt130100.json"


def test_the_key_separates_shapes_layouts_epilogues_and_accumulation(fake):
    run_gemm()
    run_gemm(n=48)
    run_gemm(trans_a=True)
    run_gemm(ldc=40)
    run_gemm(accumulate=True)
    run_gemm(c_ptr=(1 << 24) + 16)  # another alignment of C
    assert len(the_file(fake)["algos"]) == 6 and len(fake.timed) == 6


def test_another_cublaslt_version_or_device_has_its_own_file(fake, monkeypatch):
    run_gemm()
    fresh_process(monkeypatch)
    fake.lib = FakeLt(fake.lib.candidates, version=130200)
    run_gemm()
    assert len(fake.timed) == 2
    assert sorted(p.name for p in fake.tmp.glob("gemm-algos-*.json")) == [
        "gemm-algos-Fake_GPU_9000-cublasLt130100.json", "gemm-algos-Fake_GPU_9000-cublasLt130200.json"]


@pytest.mark.parametrize("content", ["{not json", json.dumps([1, 2]), "",
                                     json.dumps({"format": 1, "device": "Other GPU", "cublaslt_version": 130100,
                                                 "algos": {}})])
def test_a_torn_or_foreign_file_is_tuned_over_and_rewritten(fake, content):
    path = tune.cache_path("Fake GPU 9000", 130100)
    path.write_text(content)
    assert run_gemm() == algo(1) and len(fake.timed) == 1
    assert list(the_file(fake)["algos"].values())[0]["algo"] == algo(1)


def test_malformed_or_rejected_entries_are_tuned_again_and_replaced(fake, monkeypatch):
    run_gemm()
    run_gemm(n=48)
    path = tune.cache_path("Fake GPU 9000", 130100)
    data = json.loads(path.read_text())
    k1, k2 = sorted(data["algos"])
    data["algos"][k1]["algo"] = [1, 2, 3]                 # not 8 uint64
    data["algos"][k2]["algo"] = algo(42)                  # 8 uint64 that cuBLASLt's check refuses
    path.write_text(json.dumps(data))
    fresh_process(monkeypatch)
    fake.times = [1.0, 1.0, 0.5, 1.0]
    assert run_gemm() == algo(2) and run_gemm(n=48) == algo(2)
    assert len(fake.timed) == 4
    assert [e["algo"] for e in the_file(fake)["algos"].values()] == [algo(2), algo(2)]


def test_an_entry_another_process_wrote_first_wins(fake, monkeypatch):
    """Ranks tuning at once: the one that writes first is run by the others, which time in vain."""
    def other_rank_first(plan, ops):
        fake.timed.append(plan)
        other = tune.AlgoCache(tune.cache_path("Fake GPU 9000", 130100), "Fake GPU 9000", 130100)
        other.put(tune.disk_key(plan_key()), {"algo": algo(3)})
        return [1.0, 0.6, 0.9, 0.8]
    plan_key = lambda: next(iter(cublaslt._plans))  # noqa: E731
    monkeypatch.setattr(cublaslt, "_time_candidates", other_rank_first)
    assert run_gemm() == algo(3)
    assert list(the_file(fake)["algos"].values())[0]["algo"] == algo(3)


def _writer(path, tag, keys, queue):
    cache = tune.AlgoCache(Path(path), "Fake GPU 9000", 130100)
    kept = [cache.put(f"shape-{i}", {"algo": algo(tag)})["algo"] for i in range(keys)]
    kept.append(cache.put("shared", {"algo": algo(tag)})["algo"])
    queue.put((tag, kept))


def test_two_writers_at_once_lose_nothing_and_agree_on_a_shared_key(tmp_path):
    path = tmp_path / "gemm-algos-Fake_GPU_9000-cublasLt130100.json"
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(str(path), tag, 40, queue)) for tag in (1, 2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    data = json.loads(path.read_text())
    assert len(data["algos"]) == 41
    assert results[1][-1] == results[2][-1] == data["algos"]["shared"]["algo"]
    # each per-shape key holds one writer's entry, whole; the one both wrote is the first writer's
    assert all(e["algo"] in (algo(1), algo(2)) for e in data["algos"].values())
    assert not list(tmp_path.glob("*.tmp"))


def test_an_unwritable_cache_folder_warns_once_and_tuning_still_runs(fake, monkeypatch):
    blocker = fake.tmp / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("KILN_KERNEL_CACHE", str(blocker / "kernels"))
    with pytest.warns(RuntimeWarning, match="cannot be kept") as caught:
        assert run_gemm() == algo(1)
        assert run_gemm(n=48) == algo(1)
    assert len([w for w in caught if "cannot be kept" in str(w.message)]) == 1


# ---------------------------------------------------------------- scratch


def test_timing_writes_into_scratch_when_accumulating_or_when_an_output_overlaps_an_input():
    a, b = cublaslt.span(0, 64, 16, 16, 4), cublaslt.span(10_000, 16, 32, 32, 4)
    c = cublaslt.span(20_000, 64, 32, 40, 4)
    assert c == (20_000, 20_000 + (63 * 40 + 32) * 4)
    assert cublaslt.span(0, 2, 3, 5, 2, batch=3, stride=100) == (0, (200 + 5 + 3) * 2)
    ops = cublaslt.Operands(0, 10_000, 20_000, c, a, b)
    assert not cublaslt.needs_scratch(False, ops)
    assert cublaslt.needs_scratch(True, ops)
    inplace = cublaslt.Operands(0, 10_000, 0, cublaslt.span(0, 64, 32, 32, 4), a, b)
    assert cublaslt.needs_scratch(False, inplace)
    aux_on_bias = cublaslt.Operands(0, 10_000, 20_000, c, a, b, reads=[(40_000, 40_128)],
                                    writes=[(11, 39_000, (39_000, 40_001))])
    assert cublaslt.needs_scratch(False, aux_on_bias)
    beside = cublaslt.Operands(0, 10_000, 20_000, c, a, b, reads=[(40_000, 40_128)],
                               writes=[(8, 40_128, (40_128, 40_256))])  # a bias gradient just past the aux read
    assert not cublaslt.needs_scratch(False, beside)


class FakeDevice:
    """The CuPy calls _time_candidates makes, over a clock that each launch advances by its algorithm's time."""

    def __init__(self, durations, monkeypatch):
        self.now, self.durations, self.syncs, self.copies, self.allocs = 0.0, durations, 0, [], []
        dev = self

        class Event:
            def record(self, stream):
                self.t = dev.now
        self.cuda = SimpleNamespace(Event=Event, get_elapsed_time=lambda a, b: b.t - a.t, runtime=SimpleNamespace(
            memcpyDeviceToDevice=3, memcpyAsync=lambda dst, src, size, kind, stream: dev.copies.append((dst, src, size))))
        stream = SimpleNamespace(ptr=5, synchronize=lambda: setattr(dev, "syncs", dev.syncs + 1))
        monkeypatch.setattr(cublaslt, "rt", SimpleNamespace(cupy=lambda: dev, stream=lambda: stream))

    def empty(self, shape, dtype):
        if self.durations == "full":
            raise MemoryError("out of memory")
        block = SimpleNamespace(data=SimpleNamespace(ptr=(9 + len(self.allocs)) << 28), nbytes=shape[0])
        self.allocs.append(block)
        return block


def fake_plan(accumulate, durations, launches, pointers):
    """A plan whose launch of candidate i takes durations[i][call] ms (None: cuBLASLt refuses it)."""
    calls = {i: 0 for i in durations}

    def launch_status(algo_, a_ptr, b_ptr, c_ptr):
        i = algo_[0]
        t = durations[i][min(calls[i], len(durations[i]) - 1)]
        calls[i] += 1
        launches.append((i, c_ptr))
        if t is None:
            return 15
        cublaslt.rt.cupy().now += t
        return 0
    return SimpleNamespace(candidates=[SimpleNamespace(algo=algo(i)) for i in durations], accumulate=accumulate,
                           launch_status=launch_status, set_pointer=lambda attr, ptr: pointers.append((attr, ptr)))


@pytest.mark.parametrize("accumulate", [False, True])
def test_candidates_are_timed_in_rounds_by_the_median_of_their_launches(monkeypatch, accumulate):
    monkeypatch.setattr(cublaslt, "_tune_stats", dict.fromkeys(cublaslt._tune_stats, 0))
    dev = FakeDevice(None, monkeypatch)
    launches, pointers = [], []
    warm = [9.0] * tune.WARMUP  # slow warm-up launches: not counted
    durations = {0: warm + [1.0] * tune.TIMED, 1: warm + [0.5] * (tune.TIMED - 1) + [50.0],  # one outlier
                 2: [None], 3: warm + [0.7, 0.2] + [0.7] * tune.TIMED}
    plan = fake_plan(accumulate, durations, launches, pointers)
    c_span = (1 << 24, (1 << 24) + 4096)
    aux_attr = cublaslt.CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER
    ops = cublaslt.Operands(1 << 20, 1 << 22, 1 << 24, c_span, (1 << 20, (1 << 20) + 64), (1 << 22, (1 << 22) + 64),
                            writes=[(aux_attr, 1 << 26, (1 << 26, (1 << 26) + 2048))])
    times = cublaslt._time_candidates(plan, ops)
    assert times == [pytest.approx(1.0), pytest.approx(0.5), float("inf"), pytest.approx(0.7)]
    assert dev.syncs == 1
    assert [i for i, _ in launches] == [0, 1, 2, 3] + [0, 1, 3] * (tune.WARMUP - 1 + tune.TIMED)  # rounds
    if accumulate:  # every launch into a copy of C (and aux into scratch, its pointer put back after)
        d, aux = dev.allocs
        assert d.nbytes == 4096 and aux.nbytes == 2048
        assert dev.copies == [(d.data.ptr, 1 << 24, 4096)]
        assert {c for _, c in launches} == {d.data.ptr}
        assert pointers == [(aux_attr, aux.data.ptr), (aux_attr, 1 << 26)]
        assert cublaslt.autotune_stats()["scratch_bytes_peak"] == 4096 + 2048
    else:  # beta = 0: into D itself, rewritten by the chosen algorithm afterwards
        assert dev.allocs == [] and dev.copies == [] and pointers == []
        assert {c for _, c in launches} == {1 << 24}


def test_no_memory_for_the_scratch_means_no_timing(monkeypatch):
    dev = FakeDevice("full", monkeypatch)
    launches, pointers = [], []
    plan = fake_plan(True, {0: [1.0], 1: [0.5]}, launches, pointers)
    ops = cublaslt.Operands(1 << 20, 1 << 22, 1 << 24, (1 << 24, (1 << 24) + 4096), (1 << 20, (1 << 20) + 64),
                            (1 << 22, (1 << 22) + 64))
    assert cublaslt._time_candidates(plan, ops) is None
    assert launches == [] and dev.copies == [] and dev.syncs == 0 and pointers == []


# ---------------------------------------------------------------- on a GPU

def gpu(test):
    return pytest.mark.cuda(pytest.mark.skipif(not kiln.cuda_is_available(), reason="needs an NVIDIA GPU and CuPy")(test))


@pytest.fixture
def fresh_gpu(monkeypatch, tmp_path):
    """The CUDA backend with no GEMM plan made yet in this process, the algorithm file in tmp_path (the kernel
    cache stays where it is), every GEMM tuned however small."""
    monkeypatch.setenv(tune.ENV, "1")
    monkeypatch.setattr(tune, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(tune, "MIN_FLOP", 0)  # the small GEMMs below are tuned too
    fresh_process(monkeypatch)
    return kiln.backend.get_backend("cuda")


EPILOGUE_CASES = ["default", "bias", "gelu_aux_bias", "dgelu", "accumulate"]


@gpu
@pytest.mark.parametrize("mode", ["bf16", "fp32", "tf32"])
@pytest.mark.parametrize("epilogue", EPILOGUE_CASES)
def test_every_candidate_a_tuning_may_keep_matches_numpy(fresh_gpu, monkeypatch, mode, epilogue):
    """Each candidate kept in turn (the device timing runs, its pick overridden): the GEMM against float64;
    accumulating, C ends as C + A B once (the candidates added into a scratch copy, not into C)."""
    if epilogue in ("gelu_aux_bias", "dgelu") and mode != "bf16":
        pytest.skip("kiln runs the GELU epilogues for bf16/fp16 only")
    backend = fresh_gpu
    backend.set_matmul_precision(mode)
    dtype, tol = {"bf16": (BF16, 1e-2), "fp32": (np.float32, 1e-5), "tf32": (np.float32, 1e-3)}[mode]
    rng = np.random.default_rng()
    m, n, k = 512, 384, 1024
    a, b, bias = (rng.standard_normal(s).astype(dtype) for s in ((m, k), (k, n), (n,)))
    start = rng.standard_normal((m, n)).astype(np.float32)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    count = None
    i = 0
    while count is None or i < count:
        monkeypatch.setattr(tune, "choose", lambda times, pick=i: min(pick, len(times) - 1))
        fresh_process(monkeypatch)
        for f in tune.cache_dir().glob("gemm-algos-*"):  # else the last pass's choice is read, not tuned
            f.unlink()
        da, db = backend.asarray(a), backend.asarray(b)
        if epilogue == "accumulate":
            out = backend.asarray(start)
            cublaslt.gemm(da, db, out, m=m, n=n, k=k, accumulate=True)
            got, want = backend.to_numpy(out), start + ref
        elif epilogue == "bias":
            out = backend.asarray(np.full((m, n), np.nan, dtype))
            cublaslt.gemm(da, db, out, m=m, n=n, k=k, bias=backend.asarray(bias), epilogue="bias")
            got, want = backend.to_numpy(out), ref + bias.astype(np.float64)
        elif epilogue == "gelu_aux_bias":
            from kiln.backend import cpu
            out, aux = (backend.asarray(np.full((m, n), np.nan, dtype)) for _ in range(2))
            cublaslt.gemm(da, db, out, m=m, n=n, k=k, bias=backend.asarray(bias), epilogue="gelu_aux_bias",
                          aux=aux, aux_ld=n)
            pre = ref + bias.astype(np.float64)
            assert _rel(backend.to_numpy(aux), pre) <= tol
            got, want = backend.to_numpy(out), cpu.gelu_fwd(pre)
        elif epilogue == "dgelu":  # aux is read
            from kiln.backend import cpu
            pre = rng.standard_normal((m, n)).astype(dtype)
            out = backend.asarray(np.full((m, n), np.nan, dtype))
            cublaslt.gemm(da, db, out, m=m, n=n, k=k, epilogue="dgelu", aux=backend.asarray(pre), aux_ld=n)
            want = cpu.gelu_bwd(ref, pre.astype(np.float64))
            got = backend.to_numpy(out)
        else:
            out = backend.asarray(np.full((m, n), np.nan, dtype))
            cublaslt.gemm(da, db, out, m=m, n=n, k=k)
            got, want = backend.to_numpy(out), ref
        plan, = cublaslt._plans.values()
        count = len(plan.candidates)
        assert list(plan.algo) == list(plan.candidates[min(i, count - 1)].algo)
        assert _rel(got, want) <= (1e-5 if epilogue == "accumulate" and mode != "tf32" else tol), (i, count)
        i += 1
    assert count > 1, "the heuristic offered one algorithm: nothing was tuned"
    assert cublaslt.autotune_stats()["scratch_bytes_peak"] == (m * n * 4 if epilogue == "accumulate" else 0)


def _rel(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(got).all(), "non-finite values (an unwritten element?)"
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


_CHILD = """
import json, sys
import numpy as np
import kiln
from kiln.backend.cuda import cublaslt
be = kiln.backend.get_backend("cuda")
be.set_matmul_precision("bf16")
import ml_dtypes
rng = np.random.default_rng(0)
a, b = (be.asarray(rng.standard_normal(s).astype(ml_dtypes.bfloat16)) for s in ((4096, 768), (768, 3072)))
out = be.empty((4096, 3072), ml_dtypes.bfloat16)
cublaslt.gemm(a, b, out, m=4096, n=3072, k=768)
plan, = cublaslt._plans.values()
print("RESULT " + json.dumps({"algo": list(plan.algo), "stats": cublaslt.autotune_stats()}))
"""


@gpu
def test_two_processes_run_the_algorithm_the_file_holds(tmp_path):
    env = dict(os.environ, KILN_KERNEL_CACHE=str(tmp_path), PYTHONPATH=str(ROOT / "src"))
    env[tune.ENV] = "1"  # tuning is opt-in
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        runs.append(json.loads([ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")][0][7:]))
    first, second = runs
    assert first["stats"]["plans_tuned"] == 1 and second["stats"]["plans_from_cache"] == 1
    assert second["stats"]["plans_tuned"] == 0 and first["algo"] == second["algo"]
    data = json.loads(next(tmp_path.glob("gemm-algos-*.json")).read_text())
    assert [e["algo"] for e in data["algos"].values()] == [first["algo"]]


@gpu
def test_a_step_captured_after_tuning_runs_the_tuned_algorithms(fresh_gpu, monkeypatch):
    """Two eager steps (as the Trainer) tune every GEMM, each pick forced to the heuristic's last candidate so
    that it differs from the untuned one; the captured step launches exactly the plans' algorithms, warns of
    nothing untuned, and replays the eager losses bit for bit."""
    from kiln.graph import CapturedStep
    from kiln.nn import GPT, GPTConfig
    from kiln.optim import AdamW, gpt_param_groups
    from kiln.train import apply_precision, plain_step
    monkeypatch.setattr(tune, "choose", lambda times: len(times) - 1)
    launched = []
    real = cublaslt._Plan.launch_status

    def spy(plan, algo_, *ptrs):
        launched.append((plan, list(algo_)))
        return real(plan, algo_, *ptrs)
    monkeypatch.setattr(cublaslt._Plan, "launch_status", spy)
    cfg = GPTConfig(vocab_size=512, block_size=128, n_layer=2, n_head=4, n_embd=128)
    rng = np.random.default_rng(0)
    batches = [tuple(kiln.tensor(rng.integers(0, 512, (4, 128)), device="cuda") for _ in range(2)) for _ in range(4)]
    losses = {}
    for graph in (False, True):  # the graph run reuses the eager run's plans: the same algorithms
        model = GPT(cfg, generator=kiln.Generator(7))
        dev = kiln.device("cuda")
        model.to(dev)
        apply_precision(model, "bf16", dev)
        opt = AdamW(gpt_param_groups(model, 0.1), lr=1e-3)
        step = plain_step(model, opt)
        captured = CapturedStep(step)
        out = []
        for i, (x, y) in enumerate(batches):
            if graph and i >= 2:
                launched.clear()
                with warnings.catch_warnings():
                    warnings.simplefilter("error")
                    loss = captured(x, y)
                if i == 2:
                    assert any(len(p.candidates) > 1 for p, _ in launched), "no GEMM in the capture had a choice"
                    assert all(a == list(p.algo) for p, a in launched)
                    assert all(len(p.candidates) == 1 or a == list(p.candidates[-1].algo) for p, a in launched)
            else:
                loss = step(x, y)
            out.append(float(loss.item()))
        losses[graph] = out
    stats = cublaslt.autotune_stats()
    assert stats["plans_untuned_in_capture"] == 0 and stats["plans_tuned"] > 0
    assert losses[True] == losses[False]
