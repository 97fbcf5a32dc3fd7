"""MatterSim adapter at any rank count: mattersim's own calculator as the oracle, and 1 rank.

Plain pytest runs one rank; ``mpirun -n P python -m pytest --with-mpi`` runs P. Every
rank builds the same tiny model (fixed seed); rank 0 computes the references
(mattersim's calculator in float64, and the adapter on ``MPI.COMM_SELF``) and broadcasts
them.
"""

from __future__ import annotations

import pytest

pytest.importorskip("mattersim")

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
from test_mattersim import (  # noqa: E402
    RTOL64,
    mattersim_results,
    mattersim_systems,
    tiny_m3gnet,
)

from ase_shard import ShardedCalculator  # noqa: E402
from ase_shard.models import MatterSim  # noqa: E402
from ase_shard.partition import PARTITIONS  # noqa: E402

# P ranks against one: the same network on the same graph, summed in other orders
RTOL_RANKS = 1e-10


@pytest.fixture(scope="module")
def tiny64():
    return tiny_m3gnet().double()


def without_box_stress(ref: dict, atoms) -> dict:
    """``ref`` without mattersim's stress where it is that of mattersim's own box (no
    periodic axis: see ``tests/test_mattersim.py``)."""
    if not atoms.pbc.any():
        ref = {key: value for key, value in ref.items() if key != "stress"}
    return ref


@pytest.mark.parametrize("partition", PARTITIONS)
@pytest.mark.parametrize("name", ["bulk", "triclinic", "slab", "molecule"])
def test_tiny_float64(tiny64, name: str, partition: str) -> None:
    """mattersim's calculator's results, and the one-rank adapter's to 1e-10."""
    atoms = mattersim_systems()[name]
    ref = on_root(lambda: mattersim_results(tiny64, atoms))
    serial = ShardedCalculator(MatterSim(tiny64), comm=serial_comm())
    one = on_root(lambda: ase_results(serial, atoms))
    got = ase_results(ShardedCalculator(MatterSim(tiny64), partition=partition), atoms)
    errors = relative_errors(got, without_box_stress(ref, atoms))
    assert all(err <= RTOL64 for err in errors.values()), errors
    assert_close_to(got, one, RTOL_RANKS)
    assert_identical_on_all_ranks(got)


@pytest.mark.parametrize("name", ["one", "two"])
def test_tiny_with_ranks_that_own_nothing(tiny64, name: str) -> None:
    """Fewer atoms than ranks: the empty ranks take part; the results are mattersim's."""
    atoms = fewer_atoms_than_ranks()[name]
    ref = on_root(lambda: mattersim_results(tiny64, atoms))
    calc = ShardedCalculator(MatterSim(tiny64))
    got = ase_results(calc, atoms)
    assert_ranks_own_nothing_iff_fewer_atoms(calc, len(atoms))
    assert_close_to(got, without_box_stress(ref, atoms), RTOL64)
    assert_identical_on_all_ranks(got)


@pytest.mark.rank_independent
@pytest.mark.parametrize("repeat", [2, 3])
def test_split_full_halo_blocks_sum_to_one_block(tiny64, repeat: int) -> None:
    """Three ranks' full-halo blocks in one process add up to one rank's, on periodic
    Cu: ghosts that are other images of one atom, edges through folded images whose two
    directions end on different nodes, and angles at ghosts one block away."""
    atoms = bulk("Cu", "fcc", a=3.7, cubic=True).repeat(repeat)
    atoms.rattle(0.1, seed=1)
    whole, _ = split_reuse_step(MatterSim(tiny64), atoms, 1)
    split, steps = split_reuse_step(MatterSim(tiny64), atoms, 3)
    assert all(block.n_nodes > block.n_owned for block, _ in steps)
    for rows in (slice(0, 1), slice(1, 4), slice(4, None)):  # energies, forces, virials
        assert rel_err(split[:, rows], whole[:, rows]) <= RTOL_RANKS
