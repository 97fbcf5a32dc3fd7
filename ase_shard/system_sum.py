"""Sums over every rank's owned atoms within one evaluation (``LocalGraph.system_sum``).

Most models' energies are sums of per-atom terms, which the calculator adds
up itself. A model whose energy reads the whole system at once (Orb-v3's
energy head reads out the mean of all atoms' features) needs that mean before
it can give its owned atoms their energies: each rank adds up its owned
nodes' features and :class:`SystemSum` adds the ranks' partial sums.
"""

from __future__ import annotations

import torch

from ase_shard.comm import Comm
from ase_shard.exchange import check_status


class SystemSum:
    """``graph.system_sum``: a rank's tensor added over all ranks (collective).

    Each call starts with the calculator's status vote, like a halo exchange,
    so that a rank whose model raised before reaching it stops the others
    instead of leaving them waiting (:class:`ase_shard.exchange.PeerFailure`).
    The partial sums are gathered to every rank and added in rank order in
    float64, so that every rank holds the same bits (an ``Allreduce`` need not
    give them). The result is detached: a model differentiates through its own
    owned nodes' part only (see :mod:`ase_shard.models.orb`).
    """

    def __init__(self, comm: Comm):
        self.comm = comm

    def __call__(self, partial: torch.Tensor) -> torch.Tensor:
        comm = self.comm
        if comm.mpi is None or comm.size == 1:
            return partial.detach()
        check_status(*comm.status(False), "during a system sum")
        mine = partial.detach().to("cpu", torch.float64).numpy().reshape(1, -1)
        every = comm.allgather_rows(mine, [1] * comm.size)  # (ranks, partial.numel())
        total = every.sum(axis=0).reshape(partial.shape)
        return torch.as_tensor(total, dtype=partial.dtype, device=partial.device)
