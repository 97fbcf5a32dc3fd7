"""ase_shard: one ASE system, many MPI ranks, any torch potential."""

from ase_shard.comm import abort_job_on_uncaught_exception, init_mpi

init_mpi()  # before ASE fixes ase.parallel.world
abort_job_on_uncaught_exception()  # one rank's uncaught exception ends the job, no hang

from ase_shard.calculator import ShardedCalculator  # noqa: E402
from ase_shard.comm import CollectiveError  # noqa: E402
from ase_shard.graph import LocalGraph, ShardModel  # noqa: E402
from ase_shard.worker import serve, spawn  # noqa: E402

__all__ = [
    "CollectiveError",
    "LocalGraph",
    "ShardModel",
    "ShardedCalculator",
    "serve",
    "spawn",
]
__version__ = "0.1.0"
