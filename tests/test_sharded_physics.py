"""Sharded results equal ASE's calculators and the one-graph periodic evaluation.

These tests run at whatever rank count they are started with: plain pytest
(one rank) and ``mpirun -n P python -m pytest --with-mpi`` (``make test`` runs
P = 2, 3, 4).
"""

from __future__ import annotations

import numpy as np
import pytest
from ase import Atoms
from ase.calculators.fd import calculate_numerical_stress
from ase.calculators.lj import LennardJones as AseLennardJones
from oracles import ase_results, evaluate_periodic_graph, relative_errors
from sharded import COMM, assert_identical_on_all_ranks, random_gas, results, serial_comm
from systems import CASES
from toy_models import ToyMessagePassing

from ase_shard import ShardedCalculator
from ase_shard.models import LennardJones
from ase_shard.partition import PARTITIONS

RTOL = 1e-10


def _assert_close(got: dict, ref: dict, rtol: float = RTOL) -> None:
    errors = relative_errors(got, ref)
    assert all(err <= rtol for err in errors.values()), errors


@pytest.mark.parametrize("partition", PARTITIONS)
@pytest.mark.parametrize("case_name", sorted(CASES))
def test_matches_ase(case_name: str, partition: str) -> None:
    case = CASES[case_name]
    atoms = case.make_atoms()
    before = atoms.copy()
    atoms.calc = ShardedCalculator(case.make_model(), partition=partition)
    got = results(atoms)

    _assert_close(got, ase_results(case.make_ase_calc(), atoms, case.has_stresses))
    assert_identical_on_all_ranks(got)
    # the caller's Atoms keep their order and values
    assert (atoms.positions == before.positions).all()
    assert (atoms.numbers == before.numbers).all()
    if "stress" in got:
        np.testing.assert_allclose(got["stresses"].sum(axis=0), got["stress"], atol=1e-14)
    else:
        assert atoms.cell.rank < 3


@pytest.mark.parametrize("case_name", ["ar_triclinic_lj_smooth", "pt111_slab_emt"])
def test_stress_matches_finite_differences(case_name: str) -> None:
    case = CASES[case_name]
    atoms = case.make_atoms()
    atoms.calc = ShardedCalculator(case.make_model())
    analytic = atoms.get_stress()
    numerical = calculate_numerical_stress(atoms, eps=1e-6)
    assert np.abs(analytic - numerical).max() <= 1e-6 * np.abs(analytic).max()


def test_explicit_grids_agree() -> None:
    case = CASES["cu_bulk_emt"]
    atoms = case.make_atoms()
    grids = {(COMM.size, 1, 1), (1, COMM.size, 1), (1, 1, COMM.size)}
    reference = ase_results(case.make_ase_calc(), atoms)
    for grid in sorted(grids):
        atoms.calc = ShardedCalculator(case.make_model(), grid=grid)
        _assert_close(results(atoms), reference)


@pytest.mark.parametrize("partition", PARTITIONS)
@pytest.mark.parametrize(
    "pbc", [(True, True, True), (True, True, False), (False, False, False)], ids=str
)
def test_message_passing_equals_the_periodic_graph(pbc, partition: str) -> None:
    """A 3-layer model is exact: the halo covers the receptive field."""
    atoms = random_gas(pbc)
    model = ToyMessagePassing(num_layers=3)
    oracle = evaluate_periodic_graph(model, atoms)
    atoms.calc = ShardedCalculator(model, partition=partition)
    got = results(atoms)
    assert set(got) == set(oracle)
    _assert_close(got, oracle)
    assert_identical_on_all_ranks(got)


@pytest.mark.mpi(min_size=2)
def test_halo_one_cutoff_too_thin_is_wrong() -> None:
    """A full halo one cutoff short of the receptive field gives wrong forces.

    Only atoms of other ranks are ghosts (images of owned atoms fold onto
    them), so this needs at least two ranks.
    """
    atoms = random_gas((True, True, True))
    oracle = evaluate_periodic_graph(ToyMessagePassing(num_layers=3), atoms)
    liar = ToyMessagePassing(num_layers=3)
    liar.num_layers = 2
    atoms.calc = ShardedCalculator(liar, skin=0.0, halo="full")
    errors = relative_errors(results(atoms), {"forces": oracle["forces"]})
    assert errors["forces"] > 1e-5


@pytest.mark.parametrize("halo", ["full", "layer"])
@pytest.mark.rank_independent
def test_one_rank_evaluates_no_ghosts(halo: str) -> None:
    """On one rank, periodic images are edges to owned atoms, not ghost atoms."""
    atoms = random_gas((True, True, True))
    model = ToyMessagePassing(num_layers=3)
    calc = ShardedCalculator(model, comm=serial_comm(), halo=halo)
    atoms.calc = calc
    got = results(atoms)
    ((rows, owned, nodes),) = calc.layout_counts
    assert nodes == owned == len(atoms) < rows
    _assert_close(got, evaluate_periodic_graph(model, atoms))


@pytest.mark.parametrize("partition", PARTITIONS)
@pytest.mark.parametrize("n_atoms", [1, 3])
def test_more_ranks_than_atoms(n_atoms: int, partition: str) -> None:
    """Ranks that own nothing take part and the result is still exact."""
    positions = [[0.0, 0.0, 0.0], [1.1, 0.0, 0.0], [0.3, 1.0, 0.2]][:n_atoms]
    for atoms in (
        Atoms("Ar" * n_atoms, positions=positions),
        Atoms("Ar" * n_atoms, positions=positions, cell=[2.5, 2.6, 2.7], pbc=True),
    ):
        params = {"sigma": 1.0, "epsilon": 1.0, "rc": 3.0}
        atoms.calc = ShardedCalculator(LennardJones(**params), partition=partition)
        got = results(atoms)
        _assert_close(got, ase_results(AseLennardJones(**params), atoms, stresses=True))
        assert_identical_on_all_ranks(got)


def test_decomposition_is_reused_within_the_skin() -> None:
    case = CASES["ar_triclinic_lj"]
    atoms = case.make_atoms()
    calc = ShardedCalculator(case.make_model(), skin=1.0)
    atoms.calc = calc
    ase_calc = case.make_ase_calc()
    rng = np.random.default_rng(42)
    for step in range(3):
        # each atom moves < skin / 2 from the first build
        atoms.positions += rng.uniform(-0.1, 0.1, atoms.positions.shape)
        _assert_close(results(atoms), ase_results(ase_calc, atoms, stresses=True))
        assert calc.rebuilds == 1, step
    atoms.positions[0] += [0.6, 0.0, 0.0]
    _assert_close(results(atoms), ase_results(ase_calc, atoms, stresses=True))
    assert calc.rebuilds == 2
    atoms.positions[1] += [0.3, 0.3, 0.3]  # 0.52 Å > skin / 2, 0.3 Å along each axis
    _assert_close(results(atoms), ase_results(ase_calc, atoms, stresses=True))
    assert calc.rebuilds == 3
    # a strain of the cell (as a barostat applies) changes pair distances by
    # about strain * cutoff: 2 % of 8.5 Å stays within the 1 Å skin, 20 % does not
    atoms.set_cell(atoms.cell.array * 1.02, scale_atoms=True)
    _assert_close(results(atoms), ase_results(ase_calc, atoms, stresses=True))
    assert calc.rebuilds == 3
    atoms.set_cell(atoms.cell.array * 1.2, scale_atoms=True)
    _assert_close(results(atoms), ase_results(ase_calc, atoms, stresses=True))
    assert calc.rebuilds == 4


def test_ase_world_is_the_mpi_world() -> None:
    from ase.parallel import world

    assert (world.rank, world.size) == (COMM.rank, COMM.size)


def test_trajectory_written_by_rank_zero(tmp_path) -> None:
    """Trajectory asks for cached results on rank 0 only: that must not block."""
    from ase.io import Trajectory, read

    path = COMM.bcast(str(tmp_path / "run.traj"))
    case = CASES["pt111_slab_emt"]
    atoms = case.make_atoms()
    atoms.calc = ShardedCalculator(case.make_model())
    forces = atoms.get_forces()
    with Trajectory(path, "w") as trajectory:
        trajectory.write(atoms)
    COMM.allgather(None)  # rank 0 has closed the file
    written = read(path)
    np.testing.assert_array_equal(written.get_forces(), forces)
    assert written.calc.parameters["partition"] == "spatial"
