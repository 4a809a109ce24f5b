"""Process groups: collectives on kiln Tensors over NCCL (CUDA) or MPI (CPU), and the world group.

    import kiln.distributed as dist
    world = dist.init_process_group("auto")        # nccl on a GPU, else mpi; from the environment
    dist.all_reduce(t, op="avg")                   # in place, on the world group
    work = world.all_reduce(grads, async_op=True)  # returns a Work; work.wait() before reading

Collectives are in place on contiguous tensors, with torch.distributed's meaning; ranks given
to a group's calls are ranks in that group. A collective that does not finish within the
group's timeout (a peer died or stalled) raises DistributedError on every rank still running,
and the job is aborted when the process exits (never a hang). Paper §2.2, §4.
"""

from __future__ import annotations

import os
import sys
import time
import weakref

from kiln.distributed.environment import Environment, detect
from kiln.distributed.work import Work
from kiln.errors import (
    ConfigError,
    DeviceError,
    DistributedError,
    ShapeError,
)

OPS = ("sum", "avg", "max")
BACKENDS = ("auto", "nccl", "mpi")
DEFAULT_TIMEOUT = 300.0

_world: ProcessGroup | None = None
_engines: weakref.WeakSet = weakref.WeakSet()  # every live group's engine, for abort_communicators


class ProcessGroup:
    """A set of ranks that run collectives together. `rank`/`size` are this process's place in
    the group, `ranks` the members' world ranks. One engine: NCCL (tensors on cuda) or MPI (cpu)."""

    def __init__(self, engine, ranks: list[int], backend: str):
        self.engine, self.ranks, self.backend = engine, list(ranks), backend
        _engines.add(engine)

    @property
    def rank(self) -> int:
        return self.engine.rank

    @property
    def size(self) -> int:
        return self.engine.size

    @property
    def timeout(self) -> float:
        return self.engine.timeout

    def __repr__(self) -> str:
        return f"ProcessGroup({self.backend}, rank {self.rank} of {self.size}, world ranks {self.ranks})"

    # ------------------------------------------------------------------ checks
    def _array(self, t, name: str = "tensor"):
        if t.device.type != self.engine.device_type:
            raise DeviceError(f"a {self.backend} process group works on {self.engine.device_type} tensors; "
                              f"{name} is on {t.device}")
        if not t.data.flags.c_contiguous:
            raise ShapeError(f"collectives need contiguous tensors; {name} of shape {t.shape} is a "
                             "strided view: pass t.contiguous() and copy back")
        return t.data

    @staticmethod
    def _op(op: str, t) -> str:
        if op not in OPS:
            raise ConfigError(f"unknown reduce op {op!r}; allowed: {', '.join(OPS)}")
        if op == "avg" and not t.dtype.is_floating:
            raise ConfigError(f"op 'avg' needs a floating-point tensor, got {t.dtype}")
        return op

    def _peer(self, peer: int, name: str) -> int:
        if not isinstance(peer, int) or not 0 <= peer < self.size:
            raise ConfigError(f"{name}={peer!r} is not a rank of this group of {self.size}")
        return peer

    @staticmethod
    def _done(work: Work, async_op: bool, *changed):
        for t in changed:
            t._bump()
        if async_op:
            return work
        work.wait()
        return None

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor, op: str = "sum", async_op: bool = False):
        """tensor <- op over every rank's tensor (sum, avg or max), in place."""
        op = self._op(op, tensor)
        return self._done(self.engine.all_reduce(self._array(tensor), op), async_op, tensor)

    def reduce_scatter(self, output, input, op: str = "sum", async_op: bool = False):
        """output <- this rank's block of op over every rank's input; input.numel() == size * output.numel(),
        block r being input.reshape(size, -1)[r]."""
        op = self._op(op, input)
        if input.numel() != self.size * output.numel() or input.dtype is not output.dtype:
            raise ShapeError(f"reduce_scatter needs input of {self.size} x output's {output.numel()} elements "
                             f"and one dtype; got {input.numel()} {input.dtype} -> {output.numel()} {output.dtype}")
        work = self.engine.reduce_scatter(self._array(output, "output"), self._array(input, "input"), op)
        return self._done(work, async_op, output)

    def reduce_scatter_all_gather(self, tensor, op: str = "sum", async_op: bool = False):
        """tensor <- op over every rank's tensor, in place, as a reduce_scatter of its `size` equal
        blocks followed by an all-gather: each element is reduced exactly as reduce_scatter reduces
        it at that place, so DDP's all-reduced buckets equal ZeRO's reduce-scattered shards bit for
        bit. tensor.numel() must be a multiple of the group's size."""
        op = self._op(op, tensor)
        if tensor.numel() % self.size:
            raise ShapeError(f"reduce_scatter_all_gather needs a multiple of the group's {self.size} ranks "
                             f"in elements; got {tensor.numel()} (pad it)")
        work = self.engine.reduce_scatter_all_gather(self._array(tensor), op)
        return self._done(work, async_op, tensor)

    def all_gather(self, output, input, async_op: bool = False):
        """output <- every rank's input, concatenated in rank order (output.numel() == size * input.numel())."""
        if output.numel() != self.size * input.numel() or input.dtype is not output.dtype:
            raise ShapeError(f"all_gather needs output of {self.size} x input's {input.numel()} elements and "
                             f"one dtype; got {input.numel()} {input.dtype} -> {output.numel()} {output.dtype}")
        work = self.engine.all_gather(self._array(output, "output"), self._array(input, "input"))
        return self._done(work, async_op, output)

    def broadcast(self, tensor, src: int = 0, async_op: bool = False):
        """tensor <- rank src's tensor, in place on every rank."""
        work = self.engine.broadcast(self._array(tensor), self._peer(src, "src"))
        return self._done(work, async_op, tensor)

    def send(self, tensor, dst: int, async_op: bool = False):
        """Send tensor to rank dst, which calls recv with the same shape and dtype."""
        return self._done(self.engine.send(self._array(tensor), self._peer(dst, "dst")), async_op)

    def recv(self, tensor, src: int, async_op: bool = False):
        """tensor <- what rank src sends."""
        return self._done(self.engine.recv(self._array(tensor), self._peer(src, "src")), async_op, tensor)

    def send_recv(self, send, dst: int, recv, src: int, async_op: bool = False):
        """Send `send` to rank dst and receive rank src's into `recv`, as one operation: a ring
        step (every rank sends and receives at once) cannot deadlock. Context parallelism, §4.3."""
        work = self.engine.send_recv(self._array(send, "send"), self._peer(dst, "dst"),
                                     self._array(recv, "recv"), self._peer(src, "src"))
        return self._done(work, async_op, recv)

    def all_to_all(self, output, input, async_op: bool = False):
        """output's block j <- rank j's input block r (this rank r); blocks are the inputs' and
        output's reshape(size, -1) rows: Ulysses' head exchange (§4.3)."""
        if output.numel() != input.numel() or input.numel() % self.size or input.dtype is not output.dtype:
            raise ShapeError(f"all_to_all needs input and output of one size divisible by {self.size} "
                             f"and one dtype; got {input.numel()} {input.dtype} -> {output.numel()} {output.dtype}")
        work = self.engine.all_to_all(self._array(output, "output"), self._array(input, "input"))
        return self._done(work, async_op, output)

    def barrier(self) -> None:
        """Return once every rank of the group has reached it (the host blocks; never inside a step)."""
        self.engine.barrier().synchronize()

    # ------------------------------------------------------------------ sub-groups
    def split(self, color, key: int | None = None) -> ProcessGroup | None:
        """Collective over this group: ranks passing the same color (an int) form a new group,
        ordered by key (default: their rank here); color None joins none and gets None."""
        if color is not None and (not isinstance(color, int) or color < 0):
            raise ConfigError(f"split color must be an integer >= 0 or None, got {color!r}")
        key = self.rank if key is None else key
        everyone = self.engine.exchange([color, key])
        engine = self.engine.split(color, key)
        if engine is None:
            return None
        members = sorted((k, i) for i, (c, k) in enumerate(everyone) if c == color)  # as MPI_Comm_split
        return ProcessGroup(engine, [self.ranks[i] for _, i in members], self.backend)

    def new_group(self, ranks) -> ProcessGroup | None:
        """Collective over this group: a group of these ranks (of this group), in this order;
        None on the ranks outside it."""
        ranks = list(ranks)
        if not ranks or len(set(ranks)) != len(ranks) or any(not 0 <= r < self.size for r in ranks):
            raise ConfigError(f"new_group needs distinct ranks of this group of {self.size}, got {ranks}")
        inside = self.rank in ranks
        return self.split(0 if inside else None, ranks.index(self.rank) if inside else 0)

    def abort(self) -> None:
        """Tear down the communicator (and with MPI, the job) without waiting for peers."""
        self.engine.abort()


# ---------------------------------------------------------------------- the world
def init_process_group(backend: str = "auto", timeout: float | None = None,
                       env: Environment | None = None) -> ProcessGroup:
    """The world group of this run, from the launcher's environment (kiln.distributed.environment).

    backend: "nccl" (CUDA tensors; rank r drives GPU LOCAL_RANK), "mpi" (CPU tensors; ranks started
    by mpiexec, or by torchrun, srun or kiln launch, whose MPI kiln's PMI server wires up:
    kiln.distributed.pmi) or "auto" (nccl when a GPU is there, else mpi). timeout: seconds a
    collective may take before it is a DistributedError (default KILN_DIST_TIMEOUT or 300).
    World size 1 works with neither mpiexec nor a store. Calling it again returns the same group."""
    global _world
    if backend not in BACKENDS:
        raise ConfigError(f"unknown distributed backend {backend!r}; allowed: {', '.join(BACKENDS)}")
    if _world is not None:
        return _world
    env = env or detect()
    if timeout is None:
        timeout = float(os.environ.get("KILN_DIST_TIMEOUT", DEFAULT_TIMEOUT))
    if not timeout > 0:
        raise ConfigError(f"the distributed timeout must be > 0 seconds, got {timeout!r}")
    if backend == "auto":
        from kiln.backend import cuda_is_available
        backend = "nccl" if cuda_is_available() else "mpi"
    if backend == "mpi":
        engine = _mpi_world(env, timeout)
    else:
        engine = _nccl_world(env, timeout)
    _world = ProcessGroup(engine, list(range(env.world_size)), backend)
    if env.world_size > 1:
        _abort_on_uncaught_exceptions()
    return _world


def _abort_on_uncaught_exceptions() -> None:
    """A rank that dies of an exception aborts the job at once, rather than leaving the others to
    wait for it (in their next collective, until the timeout) or in MPI_Finalize (mpi4py's -m
    runner does the same)."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        previous(kind, value, tb)
        abort_job(f"{kind.__name__} on rank {get_rank()}")

    sys.excepthook = hook


_ABORT_GRACE_S = 0.2


def abort_job(reason: str) -> None:
    """Tear the whole run down now (MPI_Abort / ncclCommAbort), saying why on stderr: for a rank
    that must stop while the others may be inside a collective with it (the CLI on an error)."""
    if _world is None or _world.size == 1:
        return
    sys.stderr.write(f"kiln: aborting all {_world.size} ranks: {reason}\n")
    sys.stderr.flush()
    # mpiexec's proxy forwards a rank's stderr from a pipe; MPI_Abort right after the write lets it
    # kill the job before reading the last lines (1 run in 6 lost this one). A moment to read them:
    time.sleep(_ABORT_GRACE_S)
    _world.abort()


def abort_communicators() -> list[str]:
    """Tear down every communicator of this process's groups now, without waiting for peers
    (ncclCommAbort: its kernels stuck on a dead peer exit), and mark them broken; an MPI
    communicator ends with the process. For a rank that is about to exit because its gang is
    being torn down (kiln launch's abort through the store). Returns what it aborted, in words."""
    done = []
    for engine in list(_engines):
        engine.broken = True
        engine.abort(job=False)
        done.append(f"{type(engine).__name__.removesuffix('Engine').lower()} rank {engine.rank} of {engine.size}")
    return sorted(done)


def _mpi_world(env: Environment, timeout: float):
    from kiln.distributed.mpi_engine import MPIEngine, mpi
    if env.world_size > 1 and not env.under_mpi:  # torchrun, srun without PMI, kiln launch: no mpiexec
        from kiln.distributed.pmi import PMI_VARIABLES, serve_mpi_init
        serve_mpi_init(env, timeout)
        comm = mpi().COMM_WORLD  # MPI_Init, served by this rank's PMI server over the store
        for name in PMI_VARIABLES:  # not for this process's children
            os.environ.pop(name, None)
    comm = mpi().COMM_WORLD
    if comm.Get_size() != env.world_size or comm.Get_rank() != env.rank:
        raise DistributedError(f"MPI says rank {comm.Get_rank()} of {comm.Get_size()}, the environment "
                               f"rank {env.rank} of {env.world_size}: was mpi4py built for another MPI?")
    return MPIEngine(comm, timeout)


def _nccl_world(env: Environment, timeout: float):
    from kiln.backend import get_backend
    from kiln.distributed.nccl_engine import (
        MPIChannel,
        NCCLEngine,
        SelfChannel,
        StoreChannel,
    )
    get_backend("cuda")  # a DeviceError that names what is missing
    from kiln.backend.cuda import nccl
    nccl.use_device(env.local_rank)
    if env.under_mpi:
        from kiln.distributed.mpi_engine import mpi
        channel = MPIChannel(mpi().COMM_WORLD)
    elif env.world_size > 1:
        channel = StoreChannel(rendezvous_store(env, timeout), "kiln/world", env.rank, env.world_size, timeout)
    else:
        channel = SelfChannel()
    return NCCLEngine(channel, env.rank, env.world_size, timeout)


def rendezvous_store(env: Environment, timeout: float):
    """The run's one store: the launcher's when it serves one (kiln launch, torchrun), else rank 0's."""
    from kiln.distributed.store import TCPStore
    return TCPStore(env.master_addr, env.master_port, is_server=env.rank == 0 and not env.agent_store,
                    timeout=timeout)


def is_initialized() -> bool:
    return _world is not None


def get_world() -> ProcessGroup:
    """The world group; DistributedError before init_process_group."""
    if _world is None:
        raise DistributedError("no process group: call kiln.distributed.init_process_group() first")
    return _world


def get_rank() -> int:
    """This process's world rank (0 when no process group was made)."""
    return _world.rank if _world is not None else 0


def get_world_size() -> int:
    return _world.size if _world is not None else 1


def destroy_process_group() -> None:
    """Forget the world group (its communicators close when collected); init may be called again."""
    global _world
    _world = None


def new_group(ranks) -> ProcessGroup | None:
    """A group of these world ranks; every rank of the world calls it (None outside the group)."""
    return get_world().new_group(ranks)


def all_reduce(tensor, op: str = "sum", async_op: bool = False):
    return get_world().all_reduce(tensor, op, async_op)


def broadcast(tensor, src: int = 0, async_op: bool = False):
    return get_world().broadcast(tensor, src, async_op)


def barrier() -> None:
    get_world().barrier()
