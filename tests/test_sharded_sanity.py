"""Physical sanity checks and ASE's conventions, at any rank count.

Overlapping atoms raise one error on every rank; round-off differences between
the ranks' copies are re-synchronised from rank 0 instead of stopping a run;
every ASE optimiser and integrator that docs/running.md lists takes the same
steps as the same driver on a one-rank calculator; results hold only what ASE
asked for. Run plainly and under ``mpirun -n 2, 3, 4``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase import Atoms, units
from ase.build import bulk
from ase.calculators.calculator import compare_atoms
from ase.calculators.emt import EMT as AseEMT
from ase.filters import ExpCellFilter, FrechetCellFilter
from ase.io import read, write
from ase.md.andersen import Andersen
from ase.md.bussi import Bussi
from ase.md.langevin import Langevin
from ase.md.langevinbaoab import LangevinBAOAB
from ase.md.nose_hoover_chain import MTKNPT, IsotropicMTKNPT
from ase.md.npt import NPT
from ase.md.nptberendsen import Inhomogeneous_NPTBerendsen, NPTBerendsen
from ase.md.nvtberendsen import NVTBerendsen
from ase.md.verlet import VelocityVerlet
from ase.optimize import BFGS, FIRE, LBFGS, RFO, GPMin, MDMin
from ase.parallel import DummyMPI
from oracles import ase_results, rel_err, relative_errors
from sharded import (
    COMM,
    assert_identical_on_all_ranks,
    on_root,
    results,
    serial_comm,
    thermalised_cu,
)

from ase_shard import ShardedCalculator
from ase_shard.calculator import SYNC_TOLERANCE, _close
from ase_shard.models import EMT
from ase_shard.system import slice_bounds

pytestmark = pytest.mark.timeout(120)
LAST = COMM.size - 1


def _rattled_cu(repeat: int = 2) -> Atoms:
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(repeat)
    atoms.rattle(stdev=0.05, seed=7)
    return atoms


# -- overlapping atoms --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("first", "second", "offset"),
    [(5, 7, (0.0, 0.0, 0.0)), (3, 20, (0.1, -0.2, 0.05)), (0, 1, (-3.61 * 3 + 0.3, 0, 0))],
    ids=["coincident", "close", "across-the-boundary"],
)
def test_atoms_closer_than_min_distance_raise_everywhere(first, second, offset) -> None:
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(3)
    atoms.positions[first] = atoms.positions[second] + offset
    distance = atoms.get_distance(first, second, mic=True)
    assert distance < 0.5
    atoms.calc = ShardedCalculator(EMT(), min_distance=0.5)
    pair = f"atoms {min(first, second)} and {max(first, second)} are {distance:.4f} Å apart"
    with pytest.raises(ValueError, match=pair + ", closer than min_distance=0.5 Å"):
        atoms.get_forces()
    # the next call starts afresh; without a min_distance (the default) a close
    # contact is the model's to evaluate, as in ASE
    if distance == 0.0:
        return  # ASE's EMT, the oracle, is NaN there
    for calc in ShardedCalculator(EMT()), ShardedCalculator(EMT(), min_distance=0.5 * distance):
        atoms.calc = calc
        errors = relative_errors(results(atoms), ase_results(AseEMT(), atoms))
        assert max(errors.values()) <= 1e-10, errors


@pytest.mark.parametrize("distance", [0.0, 1e-9, 5e-5])
def test_coincident_atoms_raise_without_min_distance(distance: float) -> None:
    """Atoms at one point (to round-off) have no energy: an error on every rank, never a
    number (ASE's EMT gives NaN at 0 and a finite answer at 1e-9 Å)."""
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(3)
    atoms.positions[7] = atoms.positions[5] + (distance, 0.0, 0.0)
    atoms.calc = ShardedCalculator(EMT())
    with pytest.raises(ValueError, match=rf"atoms 5 and 7 are {distance:.2g} Å apart: coincident"):
        atoms.get_potential_energy()


def test_min_distance_is_validated() -> None:
    for bad in -1.0, float("nan"), "x":
        with pytest.raises(ValueError, match=r"min_distance must be a finite distance >= 0 Å"):
            ShardedCalculator(EMT(), min_distance=bad)


def test_unavailable_device_is_a_value_error() -> None:
    for device, text in [("gpu", "not a torch device"), ("cuda:99", "not available here")]:
        with pytest.raises(ValueError, match=rf"device '{device}' is {text}.*available.*cpu"):
            ShardedCalculator(EMT(), device=device)


@pytest.mark.rank_independent
def test_change_check_reports_what_ases_compare_atoms_reports() -> None:
    """The calculator settles positions and numbers without np.allclose: same verdicts."""
    atoms = _rattled_cu(2)
    atoms.calc = calc = ShardedCalculator(EMT(), comm=serial_comm())
    atoms.get_potential_energy()
    tol = 1e-15
    edits = {
        "nothing": lambda a: None,
        "below tol": lambda a: a.positions.__setitem__((3, 1), a.positions[3, 1] + 0.4 * tol),
        "above tol": lambda a: a.positions.__setitem__((3, 1), a.positions[3, 1] + 1e-12),
        "tiny then large": lambda a: a.positions.__iadd__(
            np.where(np.arange(len(a))[:, None] == 0, 0.4 * tol, 1e-3)
        ),
        "nan": lambda a: a.positions.__setitem__((0, 0), np.nan),
        "number": lambda a: a.numbers.__setitem__(5, 28),
        "atom added": lambda a: a.append("Cu"),
        "cell": lambda a: a.set_cell(1.01 * a.cell, scale_atoms=False),
        "magmoms": lambda a: a.set_initial_magnetic_moments(np.ones(len(a))),
    }
    for name, edit in edits.items():
        changed = atoms.copy()
        edit(changed)
        assert sorted(calc.check_state(changed, tol)) == sorted(
            compare_atoms(calc.atoms, changed, tol)
        ), name


@pytest.mark.rank_independent
def test_exact_first_comparison_agrees_with_allclose_across_chunks() -> None:
    """Differences anywhere in arrays longer than one compared chunk, within tol or not."""
    tol = 1e-15
    a = np.random.default_rng(3).random((100_000, 3))
    for name, index, step in [
        ("equal", None, 0.0),
        ("last chunk, beyond tol", (-1, 2), 1e-9),
        ("middle, within tol", (60_000, 1), 0.5 * tol),
        ("middle, nan", (60_000, 1), np.nan),
    ]:
        b = a.copy()
        if index is not None:
            b[index] = b[index] + step
        assert _close(a, b, tol) == np.allclose(a, b, rtol=0, atol=tol), name
    assert not _close(a, a[:-1], tol)


# -- round-off between the ranks' copies --------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_round_off_divergence_is_resynchronised_from_rank_0() -> None:
    atoms = _rattled_cu(3)
    atoms.calc = calc = ShardedCalculator(EMT())
    atoms.get_forces()
    for step, field in enumerate(["positions", "cell", "positions"]):
        atoms.positions[step] += 0.01  # a reuse step for every rank
        if COMM.rank == LAST:
            # an atom of the slice this rank checks at every call (system.check_slices)
            row = slice_bounds(len(atoms), COMM.size, LAST).start if field == "positions" else 2
            array = atoms.positions if field == "positions" else atoms.cell.array
            array[row, 1] += 0.5 * SYNC_TOLERANCE
        rebuilds = calc.rebuilds
        forces = atoms.get_forces()
        assert calc.rebuilds == rebuilds + 1
        reference = COMM.bcast(atoms.copy() if COMM.is_root else None)
        # every rank now holds rank 0's copy, bit for bit, and results of it
        assert (atoms.positions == reference.positions).all()
        assert (atoms.cell.array == reference.cell.array).all()
        assert (calc.atoms.positions == reference.positions).all()
        assert rel_err(forces, ase_results(AseEMT(), reference)["forces"]) <= 1e-10
        assert_identical_on_all_ranks({"forces": forces})


@pytest.mark.mpi(min_size=2)
def test_divergence_beyond_round_off_still_raises() -> None:
    atoms = _rattled_cu(3)
    atoms.calc = ShardedCalculator(EMT())
    atoms.get_forces()
    atoms.positions[0] += 0.01
    if COMM.rank == LAST:
        atoms.positions[slice_bounds(len(atoms), COMM.size, LAST).start, 0] += 1e-6
    with pytest.raises(ValueError, match=r"different Atoms.*positions.*by up to 1e-06 Å"):
        atoms.get_forces()


# -- ASE's drivers take the same steps as on one rank -------------------------------------

TEMPERATURE = 300.0
MD_STEPS = 8
OPTIMISER_STEPS = 8


def _md(kind, seeded: bool = False, takes_comm: bool = True, **kwargs):
    """``make(atoms, comm=None)``: ``kind`` at a 2 fs step, seeded if it draws noise.

    Drivers that take no communicator (NPT, NPTBerendsen) use none either.
    """

    def make(atoms: Atoms, comm=None):
        extra = {"rng": np.random.default_rng(5)} if seeded else {}
        if comm is not None and takes_comm:
            extra["comm"] = comm
        return kind(atoms, timestep=2 * units.fs, **kwargs, **extra)

    return make


BAROSTAT = {"pressure_au": 1e4 * units.bar, "taut": 50 * units.fs, "taup": 200 * units.fs}
MTK = {"pressure_au": 1e4 * units.bar, "tdamp": 50 * units.fs, "pdamp": 500 * units.fs}
T = {"temperature_K": TEMPERATURE}
DYNAMICS = {
    "VelocityVerlet": _md(VelocityVerlet),
    "NVTBerendsen": _md(NVTBerendsen, **T, taut=50 * units.fs),
    "NPTBerendsen": _md(
        NPTBerendsen, takes_comm=False, **T, **BAROSTAT, compressibility_au=7e-7 / units.bar
    ),
    "Inhomogeneous_NPTBerendsen": _md(
        Inhomogeneous_NPTBerendsen,
        takes_comm=False,
        **T,
        **BAROSTAT,
        compressibility_au=7e-7 / units.bar,
    ),
    "IsotropicMTKNPT": _md(IsotropicMTKNPT, **T, **MTK),
    "MTKNPT": _md(MTKNPT, **T, **MTK),
    "NPT": _md(
        NPT,
        takes_comm=False,
        **T,
        externalstress=1e4 * units.bar,
        ttime=25 * units.fs,
        pfactor=(75 * units.fs) ** 2 * 140 * units.GPa,
    ),
    "Langevin": _md(Langevin, seeded=True, **T, friction=0.02 / units.fs),
    "Bussi": _md(Bussi, seeded=True, **T, taut=50 * units.fs),
    "Andersen": _md(Andersen, seeded=True, **T, andersen_prob=0.05),
    "LangevinBAOAB": _md(
        LangevinBAOAB,
        seeded=True,
        **T,
        T_tau=50 * units.fs,
        externalstress=1e4 * units.bar,
        P_tau=500 * units.fs,
    ),
}
OPTIMISERS = {
    "BFGS": BFGS,
    "LBFGS": LBFGS,
    "FIRE": FIRE,
    "MDMin": MDMin,
    "GPMin": GPMin,
    "RFO": RFO,
    "BFGS+FrechetCellFilter": lambda atoms, **kw: BFGS(FrechetCellFilter(atoms), **kw),
    "FIRE+ExpCellFilter": lambda atoms, **kw: FIRE(ExpCellFilter(atoms), **kw),
}


def _trajectory(atoms: Atoms, run, serial: bool) -> dict:
    """Run ``run(atoms, driver_kwargs)`` on the sharded calculator, or (``serial``) on
    ASE's own EMT in one process: the oracle, not the same code on one rank."""
    atoms.calc = AseEMT() if serial else ShardedCalculator(EMT())
    steps = run(atoms, {"comm": DummyMPI()} if serial else {})
    return {
        "steps": steps,
        "positions": atoms.positions.copy(),
        "momenta": atoms.get_momenta(),
        "cell": atoms.cell.array.copy(),
    }


def _assert_same_steps(start: Atoms, run) -> None:
    got = _trajectory(start.copy(), run, serial=False)
    ref = on_root(lambda: _trajectory(start.copy(), run, serial=True))
    assert got["steps"] == ref["steps"]
    for name in ("positions", "momenta", "cell"):
        np.testing.assert_allclose(got[name], ref[name], rtol=0, atol=1e-8, err_msg=name)
    assert (got["positions"] != start.positions).any()  # it did move
    assert_identical_on_all_ranks({k: v for k, v in got.items() if k != "steps"})


@pytest.mark.parametrize("name", sorted(DYNAMICS))
def test_integrator_takes_the_same_steps_as_with_ases_emt(name: str) -> None:
    def run(atoms: Atoms, serial: dict) -> int:
        dyn = DYNAMICS[name](atoms, serial.get("comm"))
        dyn.run(MD_STEPS)
        return dyn.nsteps

    _assert_same_steps(thermalised_cu(2, TEMPERATURE, seed=3), run)


@pytest.mark.parametrize("name", sorted(OPTIMISERS))
def test_optimiser_takes_the_same_steps_as_with_ases_emt(name: str) -> None:
    def run(atoms: Atoms, serial: dict) -> int:
        opt = OPTIMISERS[name](atoms, logfile=None, **serial)
        opt.run(fmax=1e-4, steps=OPTIMISER_STEPS)
        return opt.nsteps

    start = _rattled_cu()
    start.set_cell(start.cell.array * 1.01, scale_atoms=True)  # a stress for the filters
    _assert_same_steps(start, run)


# -- results: what ASE asked for ------------------------------------------------------------


def test_extxyz_frames_carry_what_ases_own_calculator_writes(tmp_path) -> None:
    """Per-atom stresses exist only when asked for, so frames match ASE's EMT's."""
    arrays = {}
    for name, calc in [("ase", AseEMT()), ("sharded", ShardedCalculator(EMT()))]:
        atoms = _rattled_cu()
        atoms.calc = calc
        atoms.get_forces()
        atoms.get_stress()
        path = tmp_path / f"{name}-{COMM.rank}.xyz"
        write(path, atoms, format="extxyz", parallel=False)
        frame = read(path, parallel=False)
        arrays[name] = (sorted(frame.arrays), sorted(frame.calc.results))
    assert arrays["sharded"][0] == arrays["ase"][0]  # no extra per-atom columns
    assert set(arrays["sharded"][1]) <= set(arrays["ase"][1])  # ASE's EMT adds energies
    assert "stresses" not in arrays["sharded"][1]
    atoms.get_stresses()  # asked for: then they are there
    assert atoms.calc.results["stresses"].shape == (len(atoms), 6)


def test_the_callers_model_is_not_moved_or_cast() -> None:
    """The calculator evaluates a copy when it must cast; the caller's model stays."""
    model = EMT()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    atoms = _rattled_cu()
    atoms.calc = calc = ShardedCalculator(model, dtype=torch.float32)
    atoms.get_forces()
    assert calc.model is not model
    for name, tensor in model.state_dict().items():
        assert tensor.dtype == before[name].dtype, name
        torch.testing.assert_close(tensor, before[name], rtol=0, atol=0, equal_nan=True)
    assert ShardedCalculator(model).model is model  # nothing to move: no copy


@pytest.mark.parametrize("neighbor_list", ["vesin", "torch"])
def test_either_neighbour_search_gives_ases_results(neighbor_list: str) -> None:
    """The device path (torch cell list) runs on CPU too, with the same results."""
    atoms = _rattled_cu(3)
    atoms.calc = ShardedCalculator(EMT(), neighbor_list=neighbor_list)
    errors = relative_errors(results(atoms), ase_results(AseEMT(), atoms))
    assert max(errors.values()) <= 1e-10, errors
    with pytest.raises(ValueError, match="neighbor_list must be one of"):
        ShardedCalculator(EMT(), neighbor_list="kdtree")
