"""CHGNet adapter at any rank count: CHGNet's own calculator as the oracle, and 1 rank.

Plain pytest runs one rank; ``mpirun -n P python -m pytest --with-mpi`` runs P. Rank 0
computes the references (CHGNet's calculator, and the adapter on ``MPI.COMM_SELF``) and
broadcasts them.
"""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("chgnet")

from ase.build import bulk  # noqa: E402
from oracles import ase_results, rel_err, relative_errors  # noqa: E402
from sharded import (  # noqa: E402
    assert_close_to,
    assert_identical_on_all_ranks,
    assert_ranks_own_nothing_iff_fewer_atoms,
    fewer_atoms_than_ranks,
    on_root,
    serial_comm,
)
from sync_count import split_reuse_step  # noqa: E402
from test_chgnet import (  # noqa: E402
    RTOL64,
    chgnet_results,
    chgnet_systems,
    tiny_chgnet,
)

from ase_shard import ShardedCalculator  # noqa: E402
from ase_shard.models import CHGNet  # noqa: E402
from ase_shard.partition import PARTITIONS  # noqa: E402

# P ranks against one: the same network on the same graph, summed in other orders
RTOL_RANKS = 1e-10


@pytest.fixture(scope="module")
def tiny64():
    return tiny_chgnet().double()


@pytest.mark.parametrize("partition", PARTITIONS)
@pytest.mark.parametrize("name", ["bulk", "triclinic", "slab", "molecule"])
def test_tiny_float64(tiny64, name: str, partition: str) -> None:
    """CHGNet's calculator's results, and the one-rank adapter's to 1e-10."""
    atoms = chgnet_systems()[name]
    ref = on_root(lambda: chgnet_results(tiny64, atoms))
    serial = ShardedCalculator(CHGNet(tiny64), comm=serial_comm())
    one = on_root(lambda: ase_results(serial, atoms))
    got = ase_results(ShardedCalculator(CHGNet(tiny64), partition=partition), atoms)
    errors = relative_errors(got, ref)
    assert all(err <= RTOL64 for err in errors.values()), errors
    assert_close_to(got, one, RTOL_RANKS)
    assert_identical_on_all_ranks(got)


@pytest.mark.parametrize("name", ["one", "two"])
def test_tiny_with_ranks_that_own_nothing(tiny64, name: str) -> None:
    """Fewer atoms than ranks: the empty ranks take part; the results are CHGNet's."""
    atoms = fewer_atoms_than_ranks()[name]
    ref = on_root(lambda: chgnet_results(tiny64, atoms))
    calc = ShardedCalculator(CHGNet(tiny64))
    got = ase_results(calc, atoms)
    assert_ranks_own_nothing_iff_fewer_atoms(calc, len(atoms))
    assert_close_to(got, ref, RTOL64)
    assert_identical_on_all_ranks(got)


def test_shipped_030_float64_molecule() -> None:
    """The pretrained 0.3.0, cast to float64 once for both sides, on ethanol."""
    network = CHGNet("0.3.0").model.double()
    atoms = chgnet_systems()["molecule"]
    ref = on_root(lambda: chgnet_results(copy.deepcopy(network), atoms))
    got = ase_results(ShardedCalculator(CHGNet(network)), atoms)
    errors = relative_errors(got, ref)
    assert all(err <= RTOL64 for err in errors.values()), errors
    assert_identical_on_all_ranks(got)


@pytest.mark.rank_independent
@pytest.mark.parametrize("repeat", [2, 3])
def test_split_full_halo_blocks_sum_to_one_block(tiny64, repeat: int) -> None:
    """Three ranks' full-halo blocks in one process add up to one rank's, on periodic
    Cu: ghosts that are other images of one atom, bonds through folded images whose
    two directions end on different nodes (and are opposite only to round-off).

    (CHGNet's graphs have data-dependent sizes, and chgnet's own aggregation
    syncs: unlike SevenNet's, these steps are not free of device syncs.)
    """
    atoms = bulk("Cu", "fcc", a=3.7, cubic=True).repeat(repeat)
    atoms.rattle(0.1, seed=1)
    whole, _ = split_reuse_step(CHGNet(tiny64), atoms, 1)
    split, steps = split_reuse_step(CHGNet(tiny64), atoms, 3)
    assert all(block.n_nodes > block.n_owned for block, _ in steps)
    for rows in (slice(0, 1), slice(1, 4), slice(4, None)):  # energies, forces, virials
        assert rel_err(split[:, rows], whole[:, rows]) <= RTOL_RANKS
