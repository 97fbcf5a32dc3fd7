"""ASE dynamics and optimisers driven through ShardedCalculator.

Every rank runs the same ASE driver on the same Atoms (seeded random numbers),
as a user script under mpirun would. The references are conservation of
energy and ASE's own calculators, alone (checks along the way) or driving the
same ASE driver, which rank 0 runs alone and broadcasts; where ASE's EMT is too
slow for that, the same run with a one-rank calculator (``comm=serial_comm()``)
joins them on several ranks. Like test_sharded_physics.py, these tests run at
any rank count; the full-size figures come from scripts/md_acceptance.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from ase import Atoms, units
from ase.build import bulk, fcc111
from ase.calculators.emt import EMT as AseEMT
from ase.calculators.lj import LennardJones as AseLennardJones
from ase.filters import FrechetCellFilter
from ase.md.langevin import Langevin
from ase.md.nose_hoover_chain import IsotropicMTKNPT
from ase.md.nptberendsen import NPTBerendsen
from ase.md.velocitydistribution import thermalize_momenta
from ase.md.verlet import VelocityVerlet
from ase.optimize import BFGS, FIRE
from ase.parallel import DummyMPI
from oracles import ase_results, relative_errors
from sharded import (
    COMM,
    assert_identical_on_all_ranks,
    on_root,
    results,
    serial_comm,
    thermalised_cu,
)

from ase_shard import ShardedCalculator
from ase_shard.models import EMT, LennardJones

RTOL = 1e-10
ARGON = {"sigma": 3.4, "epsilon": 0.0104, "rc": 8.5, "smooth": True}
# ASE's drivers of the one-rank references talk to no other rank
ALONE = {"comm": DummyMPI()}

pytestmark = pytest.mark.timeout(120)


def test_nve_conserves_energy_and_equals_ase() -> None:
    """Energy is conserved, every 20th step's results are ASE's EMT's, and on several ranks
    the trajectory is one rank's (ASE's EMT is too slow for 61 calls on 500 atoms here)."""
    steps, skin = 60, 1.0
    start = thermalised_cu(5, 300.0, seed=11)
    atoms = start.copy()
    calc = ShardedCalculator(EMT(), skin=skin)
    atoms.calc = calc
    dyn = VelocityVerlet(atoms, timestep=2 * units.fs)
    totals, errors, ase_emt = [], [], AseEMT()

    def check() -> None:
        got = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces()}
        got["stress"] = atoms.get_stress()
        oracle = on_root(lambda: ase_results(ase_emt, atoms))
        errors.append(relative_errors(got, {key: oracle[key] for key in got}))

    dyn.attach(lambda: totals.append(atoms.get_total_energy()), interval=1)
    dyn.attach(check, interval=20)
    dyn.run(steps)

    # measured 3.2e-5 eV/atom (500 atoms, 60 steps of 2 fs, 1 and 3 ranks)
    drift = np.max(np.abs(np.array(totals) - totals[0])) / len(atoms)
    assert len(totals) == steps + 1
    assert drift < 2e-4, drift
    assert len(errors) == steps // 20 + 1
    assert all(max(error.values()) <= RTOL for error in errors), errors
    assert 1 <= calc.rebuilds <= steps // 10, calc.rebuilds
    assert_identical_on_all_ranks(results(atoms))
    if COMM.size == 1:
        return  # the one-rank trajectory below would be this one

    def serial() -> dict:
        ref = start.copy()
        ref.calc = ShardedCalculator(EMT(), skin=skin, comm=serial_comm())
        VelocityVerlet(ref, timestep=2 * units.fs, **ALONE).run(steps)
        return {"positions": ref.positions, "momenta": ref.get_momenta()}

    ref = on_root(serial)
    np.testing.assert_allclose(atoms.positions, ref["positions"], rtol=0, atol=1e-8)
    np.testing.assert_allclose(atoms.get_momenta(), ref["momenta"], rtol=0, atol=1e-8)


def test_hot_liquid_migrates_and_stays_exact() -> None:
    """Atoms diffuse across domains; the final forces equal ASE's from scratch."""
    steps, skin = 200, 1.0
    # fcc at reduced density 0.6, melted and held at ~4 epsilon/kB
    atoms = bulk("Ar", "fcc", a=6.4, cubic=True).repeat(4)
    atoms.new_array("ids", np.arange(len(atoms)))
    numbers = atoms.numbers.copy()
    thermalize_momenta(atoms, temperature_K=1000.0, rng=np.random.default_rng(5))
    start = atoms.positions.copy()
    calc = ShardedCalculator(LennardJones(**ARGON), skin=skin)
    atoms.calc = calc
    atoms.get_forces()  # the first decomposition, whose owners are compared at the end
    first_owners = calc.decomposition["owners"] if COMM.is_root else None
    dyn = Langevin(
        atoms,
        timestep=5 * units.fs,
        temperature_K=500.0,
        friction=0.01 / units.fs,
        fixcm=False,
        rng=np.random.default_rng(6),
    )
    dyn.run(steps)

    assert len(atoms) == len(numbers)
    assert (atoms.numbers == numbers).all()
    assert (atoms.arrays["ids"] == np.arange(len(atoms))).all()
    got = results(atoms)
    oracle = ase_results(AseLennardJones(**ARGON), atoms, stresses=True)
    errors = relative_errors(got, oracle)
    assert max(errors.values()) <= RTOL, errors
    assert_identical_on_all_ranks(got)
    # the mean atom left the first layout's halo margin: the run relied on migration
    moved = np.linalg.norm(atoms.positions - start, axis=1)
    assert moved.mean() > skin, moved.mean()
    assert calc.rebuilds > 1
    # and atoms changed owner rank (by moving or by the rebalanced split)
    changed = COMM.bcast(
        int((calc.decomposition["owners"] != first_owners).sum()) if COMM.is_root else None
    )
    assert changed > 0 or COMM.size == 1


def berendsen(atoms: Atoms) -> NPTBerendsen:
    """Berendsen NPT towards zero pressure, fast enough to move the cell in 100 fs."""
    return NPTBerendsen(
        atoms,
        timestep=2 * units.fs,
        temperature_K=300.0,
        pressure_au=0.0,
        taut=100 * units.fs,
        taup=100 * units.fs,
        compressibility_au=1.0 / (140.0 * units.GPa),
        fixcm=False,
    )


def mtk(atoms: Atoms) -> IsotropicMTKNPT:
    """Nose-Hoover chain MTK NPT towards zero pressure."""
    return IsotropicMTKNPT(
        atoms,
        timestep=2 * units.fs,
        temperature_K=300.0,
        pressure_au=0.0,
        tdamp=100 * units.fs,
        pdamp=1000 * units.fs,
    )


@pytest.mark.parametrize("make_dynamics", [berendsen, mtk], ids=["berendsen", "mtk"])
def test_npt_stress_matches_ase(make_dynamics) -> None:
    """A barostat driven by the sharded stress changes the cell; stress stays exact."""
    steps = 50
    atoms = thermalised_cu(3, 300.0, seed=21)
    atoms.set_cell(atoms.cell * 1.02, scale_atoms=True)  # under tension: the cell shrinks
    volume = atoms.get_volume()
    calc = ShardedCalculator(EMT(), skin=1.0)
    atoms.calc = calc
    dyn = make_dynamics(atoms)
    checks = []

    def check() -> None:
        got = results(atoms)
        errors = relative_errors(got, ase_results(AseEMT(), atoms))
        checks.append(max(errors.values()))
        assert_identical_on_all_ranks(got)

    dyn.attach(check, interval=10)
    dyn.run(steps)

    assert len(checks) == steps // 10 + 1
    assert max(checks) <= RTOL, checks
    assert abs(atoms.get_volume() / volume - 1.0) > 2e-3, atoms.get_volume() / volume
    assert calc.rebuilds < steps // 2


def test_fire_cell_relaxation_equals_ase() -> None:
    fmax = 1e-3
    start = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(2)
    strain = np.array([[1.02, 0.006, 0.0], [0.0, 0.99, -0.01], [0.006, 0.0, 1.004]])
    start.set_cell(start.cell.array @ strain, scale_atoms=True)
    start.rattle(stdev=0.05, seed=31)

    def relax(atoms: Atoms, calc, **driver) -> dict:
        atoms.calc = calc
        opt = FIRE(FrechetCellFilter(atoms), logfile=None, **driver)
        converged = opt.run(fmax=fmax, steps=1000)
        return {
            "converged": converged,
            "steps": opt.nsteps,
            "positions": atoms.positions.copy(),
            "cell": atoms.cell.array.copy(),
        }

    atoms = start.copy()
    got = relax(atoms, ShardedCalculator(EMT(), skin=0.5))
    ref = on_root(lambda: relax(start.copy(), AseEMT(), **ALONE))
    assert got["converged"] and ref["converged"]
    assert got["steps"] == ref["steps"]
    assert np.abs(got["cell"] - start.cell.array).max() > 0.1  # the cell did relax
    np.testing.assert_allclose(got["cell"], ref["cell"], rtol=0, atol=1e-8)
    np.testing.assert_allclose(got["positions"], ref["positions"], rtol=0, atol=1e-8)
    assert np.abs(atoms.get_stress()).max() < fmax
    assert_identical_on_all_ranks(results(atoms))


def test_bfgs_slab_equals_ase() -> None:
    fmax = 1e-3
    start = fcc111("Cu", size=(3, 3, 4), vacuum=6.0)
    start.rattle(stdev=0.1, seed=41)

    def relax(atoms: Atoms, calc, **driver) -> dict:
        atoms.calc = calc
        opt = BFGS(atoms, logfile=None, **driver)
        converged = opt.run(fmax=fmax, steps=500)
        return {"converged": converged, "steps": opt.nsteps, "positions": atoms.positions}

    atoms = start.copy()
    got = relax(atoms, ShardedCalculator(EMT()))
    ref = on_root(lambda: relax(start.copy(), AseEMT(), **ALONE))
    assert got["converged"] and ref["converged"]
    assert got["steps"] == ref["steps"]
    np.testing.assert_allclose(got["positions"], ref["positions"], rtol=0, atol=1e-8)
    assert np.linalg.norm(atoms.get_forces(), axis=1).max() < fmax
    assert_identical_on_all_ranks(results(atoms))
