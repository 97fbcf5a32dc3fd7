"""Memory on each rank: its peak use, freed memory given back, and an allocation failure
that names the rank.

A rank that cannot allocate (numpy's ``MemoryError``, torch's
``OutOfMemoryError`` on a GPU, or on the host its ``RuntimeError`` from the
CPU allocator) raises :class:`OutOfMemory` instead, with what the rank held
and what to change; the calculator's votes then raise it on every rank
(:meth:`ase_shard.comm.Comm.agree` and the evaluation's status vote), so no
rank waits for one that failed and no integrator goes on past the failed
step. Imports no torch (``ase_shard.comm`` uses it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import resource
import sys
from dataclasses import dataclass

# what torch's CPU allocator says when malloc fails (it raises a plain RuntimeError)
_CPU_ALLOCATOR_FAILURE = "DefaultCPUAllocator: can't allocate memory"


class OutOfMemory(MemoryError):
    """A rank could not allocate; raised on every rank, naming the rank."""


@dataclass(frozen=True)
class RankShare:
    """What one rank held when it ran out of memory (``None``: not decided or listed yet),
    and the peak memory a plan estimated for it (bytes; ``None``: no plan given,
    ``calc.memory_plan``)."""

    owned: int | None
    ghosts: int | None
    edges: int | None
    planned: int | None = None


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocation failure, on the host or a GPU."""
    if isinstance(error, MemoryError):
        return True
    torch = sys.modules.get("torch")  # not imported: no torch error to look for
    if torch is not None and isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and _CPU_ALLOCATOR_FAILURE in str(error)


def out_of_memory(error: BaseException, where: str, share: RankShare | None = None) -> OutOfMemory:
    """The :class:`OutOfMemory` for ``error`` raised ``where`` (e.g. "in its
    evaluation") on a rank holding ``share``; the vote that raises it on every rank
    adds the rank."""
    held = ""
    if share is not None:
        held = (
            ", with no share of the atoms yet"
            if share.owned is None
            else f", holding {share.owned} owned atoms and {share.ghosts} ghosts"
        )
        if share.edges is not None:
            held += f", {share.edges} edges"
        if share.planned is not None:
            held += f", {share.planned / 2**20:.0f} MiB planned"
    text = str(error).strip()
    first_line = text.splitlines()[0] if text else type(error).__name__
    return OutOfMemory(
        f"out of memory {where}{held} (peak resident memory {peak_memory() / 2**20:.0f} "
        f"MiB): {first_line}. Run on more ranks, with a smaller skin, or in float32 "
        "(ShardedCalculator(dtype=torch.float32)); `ase-shard plan` says what fits"
    )


def peak_memory() -> int:
    """This process's peak resident memory in bytes (on the host; ``ru_maxrss``)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux counts kilobytes, macOS bytes
    return int(peak if sys.platform == "darwin" else peak * 1024)


def release_free_memory() -> bool:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``).

    A rebuild's search frees its temporaries (tens of MB per 100,000 atoms);
    glibc keeps much of that in its heap, where each MD step's temporaries then
    land beside it, and the resident memory stays at the rebuild's peak plus the
    steps'. Given back after the search, the peak of 256,000 atoms, one rank, fell
    from 464 to 428 MiB (EMT) and from 292 to 268 MiB (Lennard-Jones); the pages
    the next allocations touch are then faulted in again, 3.3 ms (Lennard-Jones)
    and 5.6 ms (EMT) more a rebuild of 32,000 atoms (given back before the search
    too: 8 and 12 ms, for no lower peak). A no-op (``False``) where the C library
    has no ``malloc_trim`` (not glibc).
    """
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim(0)
    return True


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    return None if name is None else ctypes.CDLL(name)
