"""Load balance: where the spatial partition cuts, and when it cuts again (pure numpy).

Every step waits for its busiest rank. Cutting the rank grid so that each
rank owns as many atoms as the others (``balance="count"``) balances bulk,
but not a liquid beside its vapour, a slab with vacuum or a cluster in a
box: an atom in the liquid has dozens of neighbours, one in the gas almost
none, and a rank's work follows its edges. ``balance="work"`` weighs each
atom by what its rank spent on it: the edges the blocks listed at it at the
last rebuild (every term's, for a ``Sum``) plus :data:`NODE_WORK`, and cuts
the same grid at the same common histogram bins, by weight instead of by
count (:func:`ase_shard.partition.balanced_cuts`).

The weights of an atom do not depend on where the cuts fall (they are its
neighbours), so cutting by them converges at once instead of chasing the
ranks' timings. The cuts are kept from rebuild to rebuild, and cut again
only when the work they give the ranks drifts past :data:`REBALANCE_ABOVE`
times the mean (as LAMMPS's ``fix balance`` with a threshold): atoms then
migrate only as they cross the cuts, and domains do not move back and forth
at every rebuild. Each rebuild first measures the ranks' work, a number per
rank that the rebuild counts anyway; only when it is off balance are the
atoms weighed (a count per atom, sent to its owner), and the next partition
estimates the kept cuts' work from the weights and cuts again if needed.
Balanced systems (bulk) thus keep their first cuts at no cost per atom, and
a drift is cut away one rebuild after the rebuild that measured it. Where
the results are concerned the cuts are invisible: every rank evaluates the
same system whichever atoms it owns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ase_shard.partition import Cuts, OverRanks, balanced_cuts, owners_at

BALANCES = ("work", "count")
# most work on one rank over the mean beyond which the kept cuts are cut again
REBALANCE_ABOVE = 1.02
# an atom's own cost in the units of its edges (a pair counts at both of its atoms): its
# rows packed and sent, per-node terms, results gathered. A Lennard-Jones step of 32,000
# argon atoms is 15 ns a pair and 48-67 ns an atom, an atom 6.3 and 8.7 edges in two
# runs (scripts/balance.py --node-cost; docs/performance.md, "Balance between ranks")
NODE_WORK = 8


@dataclass(frozen=True)
class Balance:
    """Each rank's share of the work at the last rebuild (``calc.balance``).

    Attributes
    ----------
    owned : tuple of int
        Atoms each rank owns.
    ghosts : tuple of int
        Atoms of other ranks (or periodic images) each rank also evaluates.
    edges : tuple of int
        Edges each rank's blocks list (pairs within cutoff + skin; of a
        ``Sum``, every term's): a pair potential's or a message-passing model's
        work grows with them.
    rebalances : int
        Times the atoms were cut by their work so far (``balance="work"``;
        :class:`WorkCuts`).
    """

    owned: tuple[int, ...]
    ghosts: tuple[int, ...]
    edges: tuple[int, ...]
    rebalances: int = 0

    @property
    def imbalance(self) -> float:
        """Most edges on one rank over the mean (1 when balanced; as LAMMPS's
        ``%imbalance``, ``100 (imbalance - 1)``): every step waits for the busiest."""
        return max_over_mean(self.edges) or 1.0


def max_over_mean(values: Sequence[float]) -> float | None:
    """The largest of the ranks' ``values`` over their mean (1: balanced); ``None``
    when the mean is 0 (no rank had any)."""
    values = np.asarray(values, dtype=float)
    mean = values.mean()
    return float(values.max() / mean) if mean > 0 else None


class WorkCuts:
    """The cuts of ``balance="work"``, kept between rebuilds, and the atoms' weights.

    Attributes
    ----------
    measured : float or None
        Most work on one rank over the mean at the last rebuild
        (:meth:`measure`; the same on every rank); ``None`` before the first.
    weights : (n,) int64 array or None
        The work of each atom the partition will see next (every atom where
        every rank partitions all of them, else this rank's), from the last
        rebuild's edges (:meth:`record`); only where that rebuild was off
        balance, else ``None``.
    cuts : Cuts or None
        The cuts in force.
    rebalances : int
        Times the atoms were cut by their work.
    imbalance : float or None
        Most work on one rank over the mean that the cuts in force would give,
        estimated from the weights at the last partition (before any re-cut);
        ``None`` where it had no weights.
    """

    def __init__(self) -> None:
        self.measured: float | None = None
        self.weights: np.ndarray | None = None
        self.cuts: Cuts | None = None
        self.rebalances = 0
        self.imbalance: float | None = None

    def measure(self, edges: Sequence[int], owned: Sequence[int]) -> bool:
        """Take each rank's work at a rebuild: the ``edges`` its blocks list (a pair
        listed once counting at both its atoms, as in the weights) plus
        :data:`NODE_WORK` for each atom it ``owned``. Returns whether the atoms
        should be weighed (:meth:`record`) for the next partition: where the
        work is off balance, by more than :data:`REBALANCE_ABOVE`."""
        work = np.asarray(edges, dtype=np.int64) + NODE_WORK * np.asarray(owned, dtype=np.int64)
        self.measured = max_over_mean(work)
        self.weights = None
        return self.measured is not None and self.measured > REBALANCE_ABOVE

    def record(self, edges: np.ndarray) -> None:
        """The weights of the atoms the next partition sees: their ``edges`` (in the
        order the partition will see them) plus :data:`NODE_WORK`."""
        self.weights = np.asarray(edges, dtype=np.int64) + NODE_WORK

    def owners(
        self,
        s: np.ndarray,
        ids: np.ndarray,
        lo: np.ndarray,
        hi: np.ndarray,
        grid: tuple[int, int, int],
        over_ranks: OverRanks,
    ) -> np.ndarray:
        """Owner rank of each atom ``ids`` at frame coordinates ``s``: by the cuts in
        force while they balance the work, else by new cuts (collective where
        ``over_ranks`` is; the arguments as for
        :func:`ase_shard.partition.balanced_cuts`)."""
        kept = self.cuts is not None and self.cuts.grid == tuple(grid)
        self.imbalance = None
        weights = self.weights
        if weights is None:
            # every rank measured the same work: balanced at the last rebuild (keep
            # the cuts), or nothing known yet (cut by count, by work at a rebuild
            # that measures an imbalance)
            if kept and self.measured is not None:
                return owners_at(s, ids, self.cuts)
        # weighed on every rank; by weight only if every rank still has its atoms'
        # (one with atoms added or deleted would otherwise leave the others in
        # another collective)
        elif over_ranks.sum(np.array([len(weights) != len(s)], dtype=np.int64))[0]:
            weights = None
        elif kept:
            owners = owners_at(s, ids, self.cuts)
            ranks = int(np.prod(grid))
            work = over_ranks.sum(np.bincount(owners, weights, ranks).astype(np.int64))
            self.imbalance = max_over_mean(work)
            if self.imbalance is None or self.imbalance <= REBALANCE_ABOVE:
                return owners
        # no cuts yet, a new grid, or cuts that no longer balance
        balanced = balanced_cuts(s, ids, lo, hi, grid, over_ranks, weights)
        self.cuts = balanced.cuts
        if weights is not None:
            self.rebalances += 1
        return balanced.owners
