"""Distributed atoms: each rank holds its own atoms; results equal ASE's and the periodic graph's.

Run at any rank count (plain pytest, and ``mpirun -n 2, 3, 4`` in ``make test``).
The oracles are ASE's own calculators and drivers, and the one-graph periodic
evaluation of tests/oracles.py, each run by rank 0 alone; the replicated
calculation on one rank joins them where it checks more (which keys are there).
"""

from __future__ import annotations

import numpy as np
import pytest
from ase import units
from ase.calculators.emt import EMT as AseEMT
from ase.calculators.lj import LennardJones as AseLennardJones
from ase.constraints import FixAtoms
from ase.md.velocitydistribution import Stationary
from ase.md.verlet import VelocityVerlet
from ase.parallel import DummyMPI
from oracles import ase_results, evaluate_periodic_graph, relative_errors
from sharded import COMM, on_root, random_gas, results, serial_comm, thermalised_cu
from systems import CASES, TINY_LJ
from toy_models import ToyMessagePassing

from ase_shard import ShardedCalculator
from ase_shard.distributed import DistributedAtoms, distribute, gather, migrate, stationary
from ase_shard.models import EMT
from ase_shard.partition import PARTITIONS

RTOL = 1e-10


def _local_results(atoms, **options) -> dict[str, np.ndarray]:
    """Results of the distributed system, per-atom ones gathered into the original order."""
    local = distribute(atoms if COMM.is_root else None)
    local.calc = ShardedCalculator(options.pop("model"), **options)
    got = results(local)
    ids = COMM.allgather(local.get_global_ids())
    order = np.argsort(np.concatenate(ids))
    for name in ("energies", "forces", "stresses"):
        if name in got:
            got[name] = np.concatenate(COMM.allgather(got[name]))[order]
    return got


def _replicated(atoms, model) -> dict[str, np.ndarray]:
    def compute():
        copy = atoms.copy()
        copy.calc = ShardedCalculator(model, comm=serial_comm())
        return results(copy)

    return on_root(compute)


def _assert_close(got: dict, ref: dict, rtol: float = RTOL) -> None:
    errors = relative_errors(got, ref)
    assert set(got) == set(ref)
    assert all(err <= rtol for err in errors.values()), errors


def _assert_matches_oracle(got: dict, oracle: dict) -> None:
    """``got`` equals ``oracle`` on every key the oracle has; per-atom stresses, which
    ASE's EMT does not give, at least add up to the stress."""
    _assert_close({name: got[name] for name in oracle}, oracle)
    if "stresses" in got and "stresses" not in oracle:
        np.testing.assert_allclose(got["stresses"].sum(axis=0), got["stress"], atol=1e-14)


@pytest.mark.parametrize("partition", PARTITIONS)
@pytest.mark.parametrize("case_name", sorted(CASES))
def test_matches_replicated_and_ase(case_name: str, partition: str) -> None:
    case = CASES[case_name]
    atoms = case.make_atoms()
    got = _local_results(atoms, model=case.make_model(), partition=partition)
    _assert_close(got, _replicated(atoms, case.make_model()))
    _assert_matches_oracle(got, ase_results(case.make_ase_calc(), atoms, case.has_stresses))


@pytest.mark.parametrize("halo", ["layer", "full"])
@pytest.mark.parametrize("pbc", [(True, True, True), (True, True, False), (False, False, False)])
def test_message_passing_both_halos(pbc, halo: str) -> None:
    """Three layers: ghosts three cutoffs deep (full) or features exchanged per layer."""
    atoms = random_gas(pbc, n_atoms=48, seed=5)
    model = ToyMessagePassing(cutoff=3.0, num_layers=3)
    got = _local_results(atoms, model=model, halo=halo)
    _assert_matches_oracle(got, on_root(lambda: evaluate_periodic_graph(model, atoms)))


def test_more_ranks_than_atoms() -> None:
    """Two atoms: on three or four ranks some own nothing, before and after migration."""
    atoms = CASES["two_atom_cell_lj"].make_atoms()
    local = distribute(atoms if COMM.is_root else None)
    assert local.get_global_number_of_atoms() == 2
    local.calc = calc = ShardedCalculator(CASES["two_atom_cell_lj"].make_model())
    energy = local.get_potential_energy()
    assert sum(COMM.allgather(len(local))) == 2
    owned = [owned for _, owned, _ in calc.layout_counts]
    assert (0 in owned) == (COMM.size > 2), owned
    oracle = ase_results(AseLennardJones(**TINY_LJ), atoms)
    assert energy == pytest.approx(oracle["energy"], rel=RTOL)
    forces = np.concatenate(COMM.allgather(local.get_forces()))
    ids = np.concatenate(COMM.allgather(local.get_global_ids()))
    _assert_close({"forces": forces[np.argsort(ids)]}, {"forces": oracle["forces"]})


def test_distribute_gather_round_trip() -> None:
    """Every per-atom array, cell, pbc and info survive; identical copies need no sending."""
    atoms = thermalised_cu(3, 300.0, seed=4)
    atoms.set_tags(np.arange(len(atoms)) % 7)
    atoms.set_initial_magnetic_moments(np.linspace(0.0, 1.0, len(atoms)))
    atoms.arrays["site"] = np.arange(2 * len(atoms), dtype=np.int32).reshape(-1, 2)
    atoms.info["label"] = "bulk"
    for passed in (atoms if COMM.is_root else None, atoms):
        local = distribute(passed)
        assert isinstance(local, DistributedAtoms)
        assert sum(COMM.allgather(len(local))) == len(atoms)
        assert local.get_kinetic_energy() == pytest.approx(atoms.get_kinetic_energy(), rel=1e-12)
        assert local.get_temperature() == pytest.approx(atoms.get_temperature(), rel=1e-12)
        np.testing.assert_allclose(
            local.get_center_of_mass(), atoms.get_center_of_mass(), rtol=1e-12
        )
        back = gather(local)
        if not COMM.is_root:
            assert back is None
            continue
        assert set(back.arrays) == set(atoms.arrays)
        for name, array in atoms.arrays.items():
            np.testing.assert_array_equal(back.arrays[name], array, err_msg=name)
        assert back.info == atoms.info
        np.testing.assert_array_equal(back.cell.array, atoms.cell.array)


def test_one_rank_migrates_in_place() -> None:
    """On one rank nothing moves: atoms in id order keep their arrays (no copies, 18 MB
    each at 256,000 atoms); out of order, they are put in order, as on several ranks."""
    atoms = distribute(thermalised_cu(2, 300.0, seed=5), comm=serial_comm())
    arrays = dict(atoms.arrays)
    stay = np.zeros(len(atoms), dtype=np.int64)
    assert np.array_equal(migrate(atoms, stay), np.arange(len(atoms)))
    assert all(atoms.arrays[name] is array for name, array in arrays.items())
    shuffled = np.random.default_rng(6).permutation(len(atoms))
    atoms.arrays = {name: array[shuffled] for name, array in arrays.items()}
    assert np.array_equal(migrate(atoms, stay), np.argsort(shuffled))
    for name, array in arrays.items():
        np.testing.assert_array_equal(atoms.arrays[name], array, err_msg=name)


def _rebuilds_due(trajectory: list[np.ndarray], skin: float) -> int:
    """Builds of a layout that is rebuilt when some atom moved more than ``skin / 2`` (Å)
    from where it was at the last build, along ``trajectory`` (positions per force call)."""
    built, builds = trajectory[0], 1
    for positions in trajectory[1:]:
        if np.linalg.norm(positions - built, axis=1).max() > skin / 2:
            built, builds = positions, builds + 1
    return builds


def test_nve_with_migration_matches_ase() -> None:
    """40 hot steps with a thin skin: many rebuilds, atoms change ranks, nothing is lost."""
    atoms = thermalised_cu(3, 2000.0, seed=2)
    atoms.arrays["label"] = np.arange(len(atoms)) * 10
    skin = 0.1

    def ase_run():
        copy = atoms.copy()
        copy.calc = AseEMT()
        dyn = VelocityVerlet(copy, 2 * units.fs, comm=DummyMPI())
        trajectory = []  # the positions of every force call: the first, then one per step
        dyn.attach(lambda: trajectory.append(copy.get_positions()), interval=1)
        dyn.run(40)
        return copy.positions, copy.get_momenta(), _rebuilds_due(trajectory, skin)

    positions, momenta, rebuilds = on_root(ase_run)
    local = distribute(atoms if COMM.is_root else None)
    local.calc = ShardedCalculator(EMT(), skin=skin)
    first = local.get_global_ids()
    VelocityVerlet(local, 2 * units.fs).run(40)
    assert local.calc.rebuilds == rebuilds > 5
    moved = COMM.allgather(not np.array_equal(first, local.get_global_ids()))
    assert COMM.size == 1 or any(moved), "no atom changed rank"
    back = gather(local)
    if COMM.is_root:
        np.testing.assert_allclose(back.positions, positions, rtol=0, atol=1e-9)
        np.testing.assert_allclose(back.get_momenta(), momenta, rtol=0, atol=1e-9)
        np.testing.assert_array_equal(back.arrays["label"], atoms.arrays["label"])
        np.testing.assert_array_equal(back.numbers, atoms.numbers)


def test_errors_reach_every_rank() -> None:
    """Bad input on one rank raises the same error on all, and the next call works."""
    atoms = thermalised_cu(2, 300.0, seed=1)
    local = distribute(atoms if COMM.is_root else None)
    local.calc = ShardedCalculator(EMT())
    local.get_potential_energy()
    if COMM.rank == COMM.size - 1 and len(local):
        local.positions[0] = np.nan
    with pytest.raises(ValueError, match="not finite"):
        local.get_forces()
    if len(local):
        local.positions[0] = 0.0 if COMM.rank == COMM.size - 1 else local.positions[0]
    # ranks that did not change their atoms still take part in the next calculation
    local.positions += 0.01
    assert np.isfinite(local.get_potential_energy())


def test_a_move_on_one_rank_recalculates_on_every_rank() -> None:
    """Only the owner of atom 0 sees it move; every rank's results are of the moved system."""
    atoms = thermalised_cu(2, 300.0, seed=1)
    local = distribute(atoms if COMM.is_root else None)
    local.calc = ShardedCalculator(EMT())
    local.get_forces()
    local.positions[local.get_global_ids() == 0] += [0.05, -0.02, 0.03]
    got = results(local)
    order = np.argsort(np.concatenate(COMM.allgather(local.get_global_ids())))
    for name in ("energies", "forces", "stresses"):
        got[name] = np.concatenate(COMM.allgather(got[name]))[order]
    atoms.positions[0] += [0.05, -0.02, 0.03]
    _assert_matches_oracle(got, on_root(lambda: ase_results(AseEMT(), atoms)))


def test_deleted_atoms_are_an_error() -> None:
    atoms = thermalised_cu(2, 300.0, seed=1)
    local = distribute(atoms if COMM.is_root else None)
    local.calc = ShardedCalculator(EMT())
    local.get_potential_energy()
    if COMM.is_root and len(local):
        del local[0]
    with pytest.raises(ValueError, match="added or deleted"):
        local.get_potential_energy()


def test_constraints_are_refused() -> None:
    atoms = thermalised_cu(2, 300.0, seed=1)
    atoms.set_constraint(FixAtoms(indices=[0]))
    with pytest.raises(ValueError, match="constraints"):
        distribute(atoms if COMM.is_root else None)


def test_calculator_on_other_ranks_is_an_error() -> None:
    if COMM.size == 1:
        pytest.skip("needs a communicator smaller than the atoms'")
    local = distribute(thermalised_cu(2, 300.0, seed=1))
    local.calc = ShardedCalculator(EMT(), comm=serial_comm())
    with pytest.raises(ValueError, match="give both the same communicator"):
        local.get_potential_energy()


def test_stationary_removes_the_total_momentum_of_all_ranks() -> None:
    """``stationary`` equals ASE's ``Stationary`` on the whole system."""
    atoms = thermalised_cu(3, 300.0, seed=6)
    atoms.set_momenta(atoms.get_momenta() + [1.0, -2.0, 0.5])  # a drift to remove
    local = distribute(atoms if COMM.is_root else None)
    stationary(local)
    whole = gather(local)
    if COMM.is_root:
        Stationary(atoms)
        np.testing.assert_allclose(whole.get_momenta(), atoms.get_momenta(), atol=1e-12)
        assert np.abs(whole.get_momenta().sum(axis=0)).max() < 1e-10


def test_distribute_and_gather_are_top_level_names() -> None:
    """Where users look for them, as for ``ShardedCalculator`` (one object, not a copy)."""
    import ase_shard
    import ase_shard.distributed as distributed

    assert ase_shard.distribute is distributed.distribute
    assert ase_shard.gather is distributed.gather
    assert ase_shard.DistributedAtoms is distributed.DistributedAtoms
