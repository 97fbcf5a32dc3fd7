"""Where the atoms live, one module per layout (see :mod:`ase_shard.layouts.base`)."""

from ase_shard.layouts.base import DecompositionView, Ghosts, Layout, Request
from ase_shard.layouts.distributed import DistributedLayout
from ase_shard.layouts.replicated import ReplicatedLayout
from ase_shard.layouts.root import RootLayout

__all__ = [
    "DecompositionView",
    "DistributedLayout",
    "Ghosts",
    "Layout",
    "ReplicatedLayout",
    "Request",
    "RootLayout",
]
