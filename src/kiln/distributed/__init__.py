"""kiln.distributed: process groups over NCCL (CUDA) and MPI (CPU), DeviceMesh, data, tensor and
context parallelism.

    import kiln.distributed as dist
    world = dist.init_process_group()             # mpiexec, torchrun's or SLURM's environment
    model = dist.DistributedDataParallel(model)    # Algorithm 1 (paper §4.1)
    zero = dist.ZeroDataParallel(model, AdamW(...), stage=2)      # or stage=1: ZeRO's shards
    fsdp = dist.FullyShardedDataParallel(model, AdamW(...))       # ZeRO-3: parameters sharded too
    run = dist.ModelParallel(GPT(cfg), dist.DeviceMesh({"dp": -1, "cp": 2, "tp": 2}))  # §4.2, §4.3
    run = dist.ModelParallel(GPT(cfg), mesh, parallel="fsdp", optimizer=lambda m: AdamW(...))  # and ZeRO/FSDP

Engines, not hand-written collectives (DESIGN.md, Distributed): NCCL through the backend's
`cupy.cuda.nccl` wrapper, MPI through mpi4py. See process_group.py for the collectives' meaning.
"""

from kiln.distributed.buckets import Bucket, GradientBuckets
from kiln.distributed.context_parallel import context_parallel_attention, parallelize_context
from kiln.distributed.ddp import DistributedDataParallel
from kiln.distributed.environment import Environment, detect
from kiln.distributed.fsdp import FullyShardedDataParallel
from kiln.distributed.mesh import DeviceMesh
from kiln.distributed.model_parallel import ModelParallel
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
from kiln.distributed.shards import FlatShard, ShardedAdamW
from kiln.distributed.store import StoreServer, TCPStore
from kiln.distributed.tensor_parallel import parallelize_tensor
from kiln.distributed.work import Work
from kiln.distributed.zero import ZeroDataParallel
from kiln.errors import DistributedError

__all__ = [
    "Bucket",
    "DeviceMesh",
    "DistributedDataParallel",
    "DistributedError",
    "Environment",
    "FlatShard",
    "FullyShardedDataParallel",
    "GradientBuckets",
    "ModelParallel",
    "ProcessGroup",
    "ShardedAdamW",
    "StoreServer",
    "TCPStore",
    "Work",
    "ZeroDataParallel",
    "abort_job",
    "all_reduce",
    "barrier",
    "broadcast",
    "context_parallel_attention",
    "destroy_process_group",
    "detect",
    "get_rank",
    "get_world",
    "get_world_size",
    "init_process_group",
    "is_initialized",
    "new_group",
    "parallelize_context",
    "parallelize_tensor",
]
