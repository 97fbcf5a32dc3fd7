"""Memory on each rank: its peak use, and an allocation failure that names the rank.

A rank that cannot allocate (numpy's ``MemoryError``, torch's
``OutOfMemoryError`` on a GPU, or on the host its ``RuntimeError`` from the
CPU allocator) raises :class:`OutOfMemory` instead, with what the rank held
and what to change; the calculator's vote then raises it on every rank
(:meth:`ase_shard.comm.Comm.agree`), so no rank waits for one that died and
no integrator goes on past the failed step.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass

import torch

# what torch's CPU allocator says when malloc fails (it raises a plain RuntimeError)
_CPU_ALLOCATOR_FAILURE = "DefaultCPUAllocator: can't allocate memory"


class OutOfMemory(MemoryError):
    """A rank could not allocate; raised on every rank, naming the rank."""


@dataclass(frozen=True)
class RankShare:
    """What one rank held when it ran out of memory (``edges`` ``None``: not listed yet)."""

    owned: int
    ghosts: int
    edges: int | None


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocation failure, on the host or a GPU."""
    if isinstance(error, (MemoryError, torch.OutOfMemoryError)):
        return True
    return isinstance(error, RuntimeError) and _CPU_ALLOCATOR_FAILURE in str(error)


def out_of_memory(error: BaseException, share: RankShare, where: str) -> OutOfMemory:
    """The :class:`OutOfMemory` for ``error`` on a rank holding ``share`` (the rank
    is added by the vote that raises it on every rank)."""
    held = f"{share.owned} owned atoms and {share.ghosts} ghosts"
    if share.edges is not None:
        held += f", {share.edges} edges"
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return OutOfMemory(
        f"out of memory {where}, holding {held} (peak resident memory "
        f"{peak_memory() / 2**20:.0f} MiB): {first_line}. Run on more ranks, with a "
        "smaller skin, or in float32 (ShardedCalculator(dtype=torch.float32))"
    )


def peak_memory() -> int:
    """This process's peak resident memory in bytes (on the host; ``ru_maxrss``)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux counts kilobytes, macOS bytes
    return int(peak if sys.platform == "darwin" else peak * 1024)
