"""Wall-clock time per phase of the data path, per rank (for ``ase-shard bench``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

# The phases of one ShardedCalculator.calculate, in data-path order.
PHASES = (
    "validate",  # rank 0: validate + fingerprint agreement (one allgather)
    "partition",  # rank 0: frame coordinates, owners
    "halo",  # rank 0: ghost rows, folding, exchange plan
    "scatter",  # rows/positions from rank 0 to every rank
    "neighbors",  # local neighbour list (rebuild steps only)
    "forward",  # model forward, halo exchanges included
    "backward",  # gradient w.r.t. edge vectors, reverse exchanges included
    "reverse",  # per-edge gradients summed into per-atom forces/virials
    "gather",  # rows to rank 0, assembly, broadcast of the results
)


class PhaseTimer:
    """Seconds spent in each of :data:`PHASES`, accumulated over calls.

    Parameters
    ----------
    device : torch.device
        On a CUDA device each phase synchronises before reading the clock, so
        asynchronous kernels are charged to the phase that launched them.
    """

    def __init__(self, device: torch.device | None = None):
        self.synchronize = device is not None and torch.device(device).type == "cuda"
        self.totals = dict.fromkeys(PHASES, 0.0)

    def reset(self) -> None:
        """Zero every total."""
        self.totals = dict.fromkeys(PHASES, 0.0)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Charge the time spent in the ``with`` block to ``name``."""
        if self.synchronize:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.synchronize:
                torch.cuda.synchronize()
            self.totals[name] += time.perf_counter() - start
