"""Who this process is in a run: rank, world size, local rank and the rendezvous address.

A run is started the way users start one (DESIGN.md, Distributed): `mpiexec -n N` (MPICH's PMI
or Open MPI's variables), torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT, also what `kiln launch` sets) or SLURM's (SLURM_PROCID, SLURM_NTASKS, ...).
`detect()` reads whichever is there; with none, the process is rank 0 of a world of 1.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kiln.errors import ConfigError

DEFAULT_PORT = 29500
# (rank, size, local rank, local size) variables of each MPI launcher: MPICH/Hydra, Open MPI, PMIx
_MPI_VARIABLES = (("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
                  ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                   "OMPI_COMM_WORLD_LOCAL_SIZE"),
                  ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE"))


@dataclass(frozen=True)
class Environment:
    """This process's place in the run and where the rendezvous store of rank 0 listens."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str  # "mpi" (mpiexec: MPI can connect the ranks), "torchrun", "slurm" or "single"
    # the launcher serves the store at MASTER_ADDR:MASTER_PORT (torchrun's and `kiln launch`'s
    # TORCHELASTIC_USE_AGENT_STORE=True): every rank, rank 0 too, is a client of that one store
    agent_store: bool = False

    @property
    def under_mpi(self) -> bool:
        return self.launcher == "mpi"


def _int(env, name: str, default=None) -> int:
    value = env.get(name)
    if value is None or value == "":
        if default is None:
            raise ConfigError(f"the environment variable {name} is not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"the environment variable {name}={value!r} is not an integer") from None


def detect(env=None) -> Environment:
    """Read the launcher's variables: torchrun's (also `kiln launch`'s), then MPI's, then SLURM's."""
    env = os.environ if env is None else env
    addr = env.get("MASTER_ADDR") or "127.0.0.1"
    port = _int(env, "MASTER_PORT", DEFAULT_PORT)
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, size = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local = _int(env, "LOCAL_RANK", rank)
        local_size = _int(env, "LOCAL_WORLD_SIZE", size)
        found = "torchrun"
    else:
        names = next((v for v in _MPI_VARIABLES if v[0] in env and v[1] in env), None)
        if names is not None:
            rank, size = _int(env, names[0]), _int(env, names[1])
            local, local_size = _int(env, names[2], rank), _int(env, names[3], size)
            found = "mpi"
        elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
            rank, size = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
            local = _int(env, "SLURM_LOCALID", 0)
            local_size = _int(env, "SLURM_NTASKS_PER_NODE", size) if env.get(
                "SLURM_NTASKS_PER_NODE", "").isdigit() else size
            addr = env.get("MASTER_ADDR") or env.get("SLURM_LAUNCH_NODE_IPADDR") or addr
            found = "slurm"
        else:
            rank, size, local, local_size, found = 0, 1, 0, 1, "single"
    if size < 1 or not 0 <= rank < size or not 0 <= local < max(local_size, 1):
        raise ConfigError(f"bad distributed environment ({found}): rank {rank}, world size {size}, "
                          f"local rank {local} of {local_size}; need 0 <= rank < world size")
    return Environment(rank, size, local, local_size, addr, port, found,
                       env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true")
