"""kiln.distributed: process groups over NCCL (CUDA) and MPI (CPU), DeviceMesh, data parallelism.

    import kiln.distributed as dist
    world = dist.init_process_group()             # mpiexec, torchrun's or SLURM's environment
    model = dist.DistributedDataParallel(model)    # Algorithm 1 (paper §4.1)

Engines, not hand-written collectives (DESIGN.md, Distributed): NCCL through the backend's
`cupy.cuda.nccl` wrapper, MPI through mpi4py. See process_group.py for the collectives' meaning.
"""

from kiln.distributed.buckets import Bucket, GradientBuckets
from kiln.distributed.ddp import DistributedDataParallel
from kiln.distributed.environment import Environment, detect
from kiln.distributed.mesh import DeviceMesh
from kiln.distributed.process_group import (
    ProcessGroup,
    abort_job,
    all_reduce,
    barrier,
    broadcast,
    destroy_process_group,
    get_rank,
    get_world,
    get_world_size,
    init_process_group,
    is_initialized,
    new_group,
)
from kiln.distributed.store import StoreServer, TCPStore
from kiln.distributed.work import Work
from kiln.errors import DistributedError

__all__ = [
    "Bucket",
    "DeviceMesh",
    "DistributedDataParallel",
    "DistributedError",
    "Environment",
    "GradientBuckets",
    "ProcessGroup",
    "StoreServer",
    "TCPStore",
    "Work",
    "abort_job", "all_reduce",
    "barrier",
    "broadcast",
    "destroy_process_group",
    "detect",
    "get_rank",
    "get_world",
    "get_world_size",
    "init_process_group",
    "is_initialized",
    "new_group",
]
