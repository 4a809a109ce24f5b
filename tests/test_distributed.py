"""kiln.distributed: the environment, the rendezvous store, and collectives on real MPI ranks."""

import threading
import time

import numpy as np
import pytest

import kiln
import kiln.distributed as dist
from kiln.distributed.environment import detect
from kiln.errors import ConfigError, DistributedError
from tests.mpi_runner import run_ranks


# ---------------------------------------------------------------------- environment
def test_detect_reads_each_launcher():
    e = detect({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                "MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "1234"})
    assert (e.rank, e.world_size, e.local_rank, e.local_world_size, e.master_addr, e.master_port,
            e.launcher) == (3, 8, 1, 4, "10.0.0.2", 1234, "torchrun")
    e = detect({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"})
    assert (e.rank, e.world_size, e.local_rank, e.launcher, e.under_mpi) == (1, 2, 1, "mpi", True)
    e = detect({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "6", "OMPI_COMM_WORLD_LOCAL_RANK": "1"})
    assert (e.rank, e.world_size, e.local_rank, e.launcher) == (5, 6, 1, "mpi")
    e = detect({"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0",
                "SLURM_LAUNCH_NODE_IPADDR": "10.1.1.1"})
    assert (e.rank, e.world_size, e.master_addr, e.launcher) == (2, 4, "10.1.1.1", "slurm")
    e = detect({})
    assert (e.rank, e.world_size, e.launcher, e.master_port) == (0, 1, "single", 29500)


@pytest.mark.parametrize("env", [{"RANK": "4", "WORLD_SIZE": "4"}, {"RANK": "x", "WORLD_SIZE": "2"},
                                 {"RANK": "0", "WORLD_SIZE": "0"}])
def test_detect_rejects_a_bad_environment(env):
    with pytest.raises(ConfigError, match="RANK|rank"):
        detect(env)


# ---------------------------------------------------------------------- store
def test_store_set_get_add_wait_delete_keys_across_clients():
    server = dist.TCPStore("127.0.0.1", 0, is_server=True, timeout=5)
    other = dist.TCPStore("127.0.0.1", server.port, timeout=5)
    try:
        got = {}
        reader = threading.Thread(target=lambda: got.setdefault("v", other.get("late", timeout=5)))
        reader.start()
        time.sleep(0.2)
        server.set("late", b"\x00\xffbytes")  # the blocked get returns it
        reader.join(5)
        assert got["v"] == b"\x00\xffbytes"
        values = []
        threads = [threading.Thread(target=lambda c=c: values.extend(c.add("n", 3) for _ in range(20)))
                   for c in (server, other)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(values) == list(range(3, 121, 3))  # atomic: every sum seen once
        assert other.try_get("missing") is None and other.try_get("n") == b"120"
        other.set("hb/1", "1.5")
        other.set("hb/0", "2.5")
        assert server.keys("hb/") == ["hb/0", "hb/1"]
        server.wait(["hb/0", "hb/1"], timeout=1)
        assert other.delete("hb/0") and not other.delete("hb/0")
        t0 = time.monotonic()
        with pytest.raises(DistributedError, match=r"\['hb/0'\].*within 0.3"):
            other.wait(["hb/0", "hb/1"], timeout=0.3)
        with pytest.raises(DistributedError, match="'nope' was not set within 0.2"):
            other.get("nope", timeout=0.2)
        assert time.monotonic() - t0 < 3
    finally:
        other.close()
        server.close()


def test_store_client_without_a_server_fails_clearly():
    with pytest.raises(DistributedError, match="no rendezvous store answered at 127.0.0.1:1 within"):
        dist.TCPStore("127.0.0.1", 1, timeout=0.3)


# ---------------------------------------------------------------------- world size 1, in process
def test_world_of_one_without_mpiexec():
    world = dist.init_process_group("mpi", timeout=10)
    try:
        assert (world.rank, world.size, dist.get_rank(), dist.get_world_size()) == (0, 1, 0, 1)
        x = np.random.default_rng(0).standard_normal((3, 4))
        t = kiln.tensor(x)
        world.all_reduce(t, "avg")
        np.testing.assert_array_equal(t.numpy(), x)
        out = kiln.zeros(3, 4, dtype="float64")
        world.all_gather(out, t)
        np.testing.assert_array_equal(out.numpy(), x)
        with pytest.raises(ConfigError, match="unknown reduce op 'prod'"):
            world.all_reduce(t, "prod")
        with pytest.raises(kiln.KilnError, match="contiguous"):
            world.all_reduce(kiln.tensor(x).transpose(0, 1))
        with pytest.raises(kiln.KilnError, match="all_gather needs output of 1 x input's 12 elements"):
            world.all_gather(kiln.zeros(5, dtype="float64"), t)
    finally:
        dist.destroy_process_group()


def test_init_rejects_an_unknown_backend():
    with pytest.raises(ConfigError, match="unknown distributed backend 'gloo'; allowed: auto, nccl, mpi"):
        dist.init_process_group("gloo")


# ---------------------------------------------------------------------- real ranks
@pytest.mark.dist
@pytest.mark.parametrize("n, launcher", [(2, "mpiexec"), (4, "mpiexec"), (3, "torchrun")])
def test_collectives_match_numpy(n, launcher, tmp_path):
    # torchrun: no mpiexec and no PMI; each rank's MPI learns its peers from kiln's own PMI server
    results, _, _ = run_ranks("collectives.py", n, tmp_path, launcher=launcher)
    for r, res in enumerate(results):
        assert res["world_size"] == n
        errors = res["errors"]
        assert len(errors) >= 24, sorted(errors)
        for name, err in errors.items():
            tol = 5e-7 if "float32" in name else 1e-15 * n
            assert err <= tol, (r, name, err)


@pytest.mark.dist
@pytest.mark.parametrize("launcher", ["mpiexec", "torchrun"])
@pytest.mark.parametrize("mode", ["stall", "kill", "raise"])
def test_a_dead_or_stalled_rank_fails_every_rank_within_the_timeout(mode, launcher, tmp_path):
    # torchrun: no mpiexec tears the job down; kiln's PMI servers do (kiln.distributed.pmi)
    timeout = 60.0 if mode == "raise" else 3.0
    results, proc, seconds = run_ranks("fault.py", 4, tmp_path, mode, timeout, timeout=60, expect_ok=False,
                                       launcher=launcher)
    assert proc.returncode != 0
    assert seconds < min(timeout + 20, 30), seconds  # torn down, not hung
    if mode == "stall":  # the live ranks report the timeout; rank 1 is aborted with the job
        for r in (0, 2, 3):
            assert results[r] is not None, (r, proc.stderr)
            assert "did not complete within 3 s: a peer rank is dead or stalled" in results[r]["error"]
            assert timeout - 0.5 < results[r]["seconds"] < timeout + 5
        assert results[1] is None
        assert "kiln: distributed error: rank" in proc.stderr
    elif mode == "raise":  # long before the (60 s) timeout: the raising rank aborts the job
        assert "RuntimeError: rank 1 broke" in proc.stderr and "kiln: aborting all 4 ranks" in proc.stderr
    else:  # mpiexec (or the killed rank's PMI server) sees the killed rank and tears every other rank down
        assert all(res is None or res["error"] for res in results), results
        seen = proc.stdout + proc.stderr
        assert "Killed" in seen or "signal 9" in seen or "the job was aborted (rank 1 ended without MPI_Finalize)" in seen


def test_store_channel_exchanges_among_threads_as_ranks():
    """The host channel the NCCL engine uses without MPI: every rank gets every rank's object."""
    from kiln.distributed.nccl_engine import StoreChannel
    server = dist.TCPStore("127.0.0.1", 0, is_server=True, timeout=5)
    clients = [dist.TCPStore("127.0.0.1", server.port, timeout=5) for _ in range(3)]
    got = {}

    def rank(r):
        ch = StoreChannel(clients[r], "kiln/world", r, 3, 5)
        first = ch.exchange({"r": r})
        sub = ch.sub("s1c0", r, 3).exchange(r * 10)
        got[r] = (first, sub)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    try:
        assert got == {r: ([{"r": 0}, {"r": 1}, {"r": 2}], [0, 10, 20]) for r in range(3)}
    finally:
        for c in clients:
            c.close()
        server.close()


class _FakeCommunicator:
    """The backend's NCCL communicator: every collective queues nothing and returns its 'done' event."""

    def __init__(self, uid, size, rank):
        self.events = []

    def async_error(self):
        return None

    def __getattr__(self, verb):
        def launch(*operands):
            self.events.append({"done": False})
            return self.events[-1]
        return launch


@pytest.mark.parametrize("how", ["wait", "is_completed", "synchronize"])
def test_an_nccl_collective_keeps_its_operands_until_it_is_waited_on(monkeypatch, how):
    """NCCL reads and writes a collective's buffers on its own stream after the call returns: dropped
    before the Work is waited on, a buffer went back to the caching allocator, which gave it to the
    compute stream's next request while NCCL still wrote into it."""
    import weakref

    from kiln.backend.cuda import nccl
    from kiln.distributed.nccl_engine import NCCLEngine, SelfChannel
    monkeypatch.setattr(nccl, "Communicator", _FakeCommunicator)
    monkeypatch.setattr(nccl, "unique_id", lambda: bytes(128))
    monkeypatch.setattr(nccl, "event_done", lambda event: event["done"])
    monkeypatch.setattr(nccl, "wait_event", lambda event: None)  # the compute stream waits on it
    engine = NCCLEngine(SelfChannel(), 0, 1, timeout=5)
    send, recv = np.ones(4, np.float32), np.zeros(4, np.float32)
    alive = [weakref.ref(send), weakref.ref(recv)]
    work = engine.send_recv(send, 0, recv, 0)
    del send, recv
    assert all(ref() is not None for ref in alive)
    assert not work.is_completed() and all(ref() is not None for ref in alive)
    engine.comm.events[-1]["done"] = how != "wait"  # wait() orders the compute stream, done or not
    getattr(work, how)()
    assert all(ref() is None for ref in alive)
