"""ase_shard: one ASE system, many MPI ranks, any torch potential."""

from ase_shard.comm import abort_job_on_uncaught_exception, check_ase_world, init_mpi

init_mpi()  # before ASE fixes ase.parallel.world
check_ase_world()  # too late if the script used it already: say so
abort_job_on_uncaught_exception()  # one rank's uncaught exception ends the job, no hang

# the package-level names import torch: loaded on first use (PEP 562), so that
# `ase-shard --help` and other torch-free imports stay fast
_LAZY = {
    "ShardedCalculator": "ase_shard.calculator",
    "CollectiveError": "ase_shard.comm",
    "LocalGraph": "ase_shard.graph",
    "OutOfMemory": "ase_shard.memory",
    "ShardModel": "ase_shard.graph",
    "DistributedAtoms": "ase_shard.distributed",
    "distribute": "ase_shard.distributed",
    "gather": "ase_shard.distributed",
    "serve": "ase_shard.worker",
    "spawn": "ase_shard.worker",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ase_shard' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [
    "CollectiveError",
    "DistributedAtoms",
    "LocalGraph",
    "OutOfMemory",
    "ShardModel",
    "ShardedCalculator",
    "distribute",
    "gather",
    "serve",
    "spawn",
]
__version__ = "0.1.0"
