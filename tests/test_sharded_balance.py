"""``calc.balance``: each rank's owned atoms, ghost atoms and listed edges, against counts
made without the calculator (the owners' histogram, the ghost rows' distinct foreign
atoms, ASE's neighbour list). Run plainly and under ``mpirun -n 2, 3, 4``."""

from __future__ import annotations

import numpy as np
import pytest
from ase.build import bulk
from ase.neighborlist import neighbor_list
from sharded import COMM

from ase_shard import ShardedCalculator, distribute
from ase_shard.models import EMT, LennardJones

SKIN = 0.5  # Å, ShardedCalculator's default


def _atoms():
    """500 rattled Cu atoms in an 18 Å cube: wider than twice any reach here, so no
    pair is listed twice as an atom's own periodic image."""
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(5)
    atoms.rattle(0.05, seed=3)
    return atoms


@pytest.mark.parametrize("make", [EMT, lambda: LennardJones(sigma=2.3, epsilon=0.4, rc=6.0)])
def test_balance_counts_each_ranks_work(make) -> None:
    atoms = _atoms()
    model = make()
    calc = ShardedCalculator(model, skin=SKIN)
    atoms.calc = calc
    atoms.get_forces()
    balance = calc.balance
    owners = calc.decomposition.owners
    assert balance.owned == tuple(np.bincount(owners, minlength=COMM.size))
    # a ghost is an atom of another rank that this rank evaluates (its images fold
    # onto it): the distinct foreign atoms among this rank's ghost rows
    rows = calc.decomposition.ghosts[COMM.rank].ids
    assert balance.ghosts[COMM.rank] == len(np.unique(rows[owners[rows] != COMM.rank]))
    # the built-in potentials list every pair within the reach once, on one rank
    pairs = len(neighbor_list("i", atoms, float(model.cutoff) + SKIN)) // 2
    assert sum(balance.edges) == pairs
    assert balance.imbalance == max(balance.edges) / np.mean(balance.edges)
    assert len(set(COMM.allgather(balance))) == 1  # every rank knows every rank's


def test_balance_with_distributed_atoms() -> None:
    atoms = _atoms()
    local = distribute(atoms if COMM.is_root else None)
    calc = ShardedCalculator(EMT(), skin=SKIN)
    local.calc = calc
    local.get_forces()
    balance = calc.balance
    assert balance.owned == tuple(COMM.allgather(len(local)))
    pairs = len(neighbor_list("i", atoms, float(EMT().cutoff) + SKIN)) // 2
    assert sum(balance.edges) == pairs
