"""Orb-v3 adapter at any rank count: orb's own calculator as the oracle, and 1 rank.

Plain pytest runs one rank; ``mpirun -n P python -m pytest --with-mpi`` runs P. Rank 0
computes the references (ORBCalculator, and the adapter on ``MPI.COMM_SELF``) and
broadcasts them. Orb's energy reads the mean of all atoms' features, so every
evaluation sums the ranks' owned features (``LocalGraph.system_sum``).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("orb_models")

from ase.build import bulk  # noqa: E402
from oracles import ase_results, rel_err, relative_errors  # noqa: E402
from sharded import (  # noqa: E402
    COMM,
    assert_close_to,
    assert_identical_on_all_ranks,
    assert_ranks_own_nothing_iff_fewer_atoms,
    fewer_atoms_than_ranks,
    on_root,
    serial_comm,
)
from sync_count import rank_blocks  # noqa: E402
from test_orb import RTOL64, orb_results, orb_systems, tiny_direct, tiny_orb  # noqa: E402

from ase_shard import ShardedCalculator  # noqa: E402
from ase_shard.block import RESULT_COLUMNS  # noqa: E402
from ase_shard.graph import model_dtype  # noqa: E402
from ase_shard.models import Orb  # noqa: E402

# P ranks against one: the same network on the same graph, summed in other orders
RTOL_RANKS = 1e-10


# one interaction layer and a 3.5 Å radius (the fcc systems' first shell): a halo of
# 2 x 3.5 Å, small enough for the suite's time at 4 ranks on 2 cores
@pytest.fixture(scope="module")
def tiny64():
    return tiny_orb(steps=1, radius=3.5).double()


@pytest.fixture(scope="module")
def capped64():
    """At most 6 neighbours, fewer than the fcc systems' 12 nearest: which edges into
    a node exist depends on its neighbours' rankings (one hop further out)."""
    return tiny_orb(seed=1, cap=6, steps=1, radius=3.5).double()


@pytest.fixture(scope="module")
def direct64():
    """A direct model: forces and stress from its heads, not the energy's gradient."""
    return tiny_direct(steps=1, radius=3.5).double()


def assert_matches_orb_and_one_rank(network, atoms) -> None:
    """On every rank: ORBCalculator's results (float64), the one-rank adapter's, and the
    same on all ranks."""
    ref = on_root(lambda: orb_results(network, atoms))
    serial = ShardedCalculator(Orb(network), comm=serial_comm())
    one = on_root(lambda: ase_results(serial, atoms))
    got = ase_results(ShardedCalculator(Orb(network)), atoms)
    errors = relative_errors(got, ref)
    assert all(err <= RTOL64 for err in errors.values()), errors
    assert_close_to(got, one, RTOL_RANKS)
    assert_identical_on_all_ranks(got)


@pytest.mark.parametrize("name", ["bulk", "slab", "cluster", "molecule"])
def test_tiny_float64(tiny64, name: str) -> None:
    """ORBCalculator's results, and the one-rank adapter's (per-atom energies too)."""
    assert_matches_orb_and_one_rank(tiny64, orb_systems()[name])


@pytest.mark.parametrize("name", ["bulk", "slab", "cluster", "molecule"])
def test_direct_float64(direct64, name: str) -> None:
    """A direct model: the mean force (and for the cluster, without a cell, the net
    torque) removed over every rank's atoms, its stress read out of all of them."""
    assert_matches_orb_and_one_rank(direct64, orb_systems()[name])


@pytest.mark.parametrize("partition", ["spatial", "contiguous"])
def test_capped_float64(capped64, partition: str) -> None:
    """A binding neighbour cap on the triclinic bulk: still orb's results."""
    atoms = orb_systems()["bulk"]
    ref = on_root(lambda: orb_results(capped64, atoms))
    got = ase_results(ShardedCalculator(Orb(capped64), partition=partition), atoms)
    errors = relative_errors(got, ref)
    assert all(err <= RTOL64 for err in errors.values()), errors
    assert_identical_on_all_ranks(got)


@pytest.mark.parametrize("direct", [False, True], ids=["conservative", "direct"])
@pytest.mark.parametrize("name", ["one", "two"])
def test_tiny_with_ranks_that_own_nothing(tiny64, direct64, name: str, direct: bool) -> None:
    """Fewer atoms than ranks: the empty ranks join every system sum; orb's results."""
    atoms = fewer_atoms_than_ranks()[name]
    network = direct64 if direct else tiny64
    ref = on_root(lambda: orb_results(network, atoms))
    calc = ShardedCalculator(Orb(network))
    got = ase_results(calc, atoms)
    assert_ranks_own_nothing_iff_fewer_atoms(calc, len(atoms))
    assert_close_to(got, ref, RTOL64)
    assert_identical_on_all_ranks(got)


class FailsOnLastRank(Orb):
    """The adapter, raising on the last rank before its system sum."""

    def forward(self, graph):
        if COMM.rank == COMM.size - 1:
            raise ValueError("the last rank's model failed")
        return super().forward(graph)


def test_a_rank_failing_before_the_system_sum_stops_every_rank(tiny64) -> None:
    """The other ranks wait in no system sum: every rank raises the failing rank's error."""
    atoms = orb_systems()["bulk"]
    with pytest.raises(ValueError, match="the last rank's model failed"):
        ase_results(ShardedCalculator(FailsOnLastRank(tiny64)), atoms)


class SumInThisProcess:
    """``system_sum`` for blocks evaluated one after another in one process: a first
    pass records each block's partial sum, later ones return the total."""

    def __init__(self):
        self.partials: list = []
        self.total = None

    def __call__(self, partial):
        if self.total is None:
            self.partials.append(partial.detach().clone())
            return partial.detach()
        return self.total

    def close_first_pass(self) -> None:
        self.total = sum(self.partials[1:], self.partials[0])


def split_step(model, atoms, n_ranks: int) -> np.ndarray:
    """Per atom, its owner's energy and every block's forces and virials, summed."""
    summer = SumInThisProcess()
    blocks = rank_blocks(model, atoms, n_ranks, system_sum=summer)
    for block in blocks:
        block.evaluate(atoms.positions[block.ids], atoms.cell.array, model_dtype(model))
    summer.close_first_pass()
    results = np.zeros((len(atoms), RESULT_COLUMNS))
    for block in blocks:
        assert n_ranks == 1 or block.n_nodes > block.n_owned
        columns = block.evaluate(atoms.positions[block.ids], atoms.cell.array, model_dtype(model))
        np.add.at(results, block.ids, columns.T)
    return results


@pytest.mark.rank_independent
@pytest.mark.parametrize("direct", [False, True], ids=["conservative", "direct"])
def test_split_full_halo_blocks_sum_to_one_block(capped64, direct: bool) -> None:
    """Three ranks' full-halo blocks in one process add up to one rank's, on periodic
    Cu/Ag with a binding neighbour cap: ghosts that are other images of one atom."""
    atoms = bulk("Cu", "fcc", a=3.7, cubic=True).repeat((2, 2, 1))
    atoms.numbers[::5] = 47
    atoms.rattle(0.1, seed=1)
    model = Orb(tiny_direct(seed=1, cap=6, steps=1, radius=3.5).double() if direct else capped64)
    whole, split = split_step(model, atoms, 1), split_step(model, atoms, 3)
    for rows in (slice(0, 1), slice(1, 4), slice(4, None)):  # energies, forces, virials
        assert rel_err(split[:, rows], whole[:, rows]) <= RTOL_RANKS
