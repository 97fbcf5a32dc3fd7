"""Time per phase of the data path, per rank (for ``ase-shard bench``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

# The phases of one ShardedCalculator.calculate, in data-path order.
PHASES = (
    "validate",  # validation, rebuild vote and same-Atoms check over this rank's share
    "partition",  # rebuilds: frame coordinates, owners of every atom
    "halo",  # rebuilds: this rank's ghosts (every rank's in worker mode) and the exchange plan
    "scatter",  # this rank's node positions and inputs (from its own Atoms, or from rank 0)
    "neighbors",  # local neighbour list (rebuild steps only)
    "forward",  # model forward, halo exchanges included
    "backward",  # gradient w.r.t. edge vectors, reverse exchanges included
    "reverse",  # per-edge gradients summed into per-atom forces/virials
    "gather",  # ghost rows into their owners, owned results to every rank (or rank 0)
)


class PhaseTimer:
    """Seconds spent in each of :data:`PHASES`, accumulated over calls.

    Parameters
    ----------
    device : torch.device
        The device whose work is timed.
    synchronize : bool
        On a CUDA device, synchronise before each reading of the clock, so
        asynchronous kernels are charged to the phase that launched them
        (benchmarks). Off by default: a production step must not stall the
        GPU at every phase boundary for its timings.
    comm : ase_shard.comm.Comm, optional
        Its MPI time is kept apart: :attr:`cpu` excludes the CPU time spent
        inside MPI calls (Open MPI spin-waits there while other ranks work).

    Attributes
    ----------
    totals : dict of str to float
        Wall-clock seconds per phase, MPI included.
    cpu : dict of str to float
        CPU seconds of this process per phase, with the CPU time spent inside
        MPI calls excluded: the work this rank did itself.
    """

    def __init__(
        self, device: torch.device | None = None, comm: Any = None, synchronize: bool = False
    ):
        self.device = torch.device(device) if device is not None else None
        self.comm = comm
        self.synchronize = synchronize
        self.reset()

    def reset(self) -> None:
        """Zero every total."""
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.cpu = dict.fromkeys(PHASES, 0.0)

    def _mpi_cpu(self) -> float:
        return self.comm.mpi_cpu if self.comm is not None else 0.0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Charge the time spent in the ``with`` block to ``name``."""
        sync = self.synchronize and self.device is not None and self.device.type == "cuda"
        if sync:
            torch.cuda.synchronize(self.device)  # this rank's GPU, not GPU 0
        start, start_cpu, start_mpi = time.perf_counter(), time.process_time(), self._mpi_cpu()
        try:
            yield
        finally:
            if sync:
                torch.cuda.synchronize(self.device)
            self.totals[name] += time.perf_counter() - start
            mpi = self._mpi_cpu() - start_mpi
            self.cpu[name] += time.process_time() - start_cpu - mpi
