"""ASE drivers on DistributedAtoms whose atoms migrate inside every force call.

The calculator is tests/migrating.py's MigratingCalculator: ASE's EMT (or an
Einstein crystal, for thermostat statistics) on the whole system, with every
atom sent to a random rank in every calculation. The oracles are ASE's own
drivers on a plain Atoms with ASE's EMT, run by rank 0 alone, and the bath
temperature. Plain pytest runs one rank; ``mpirun -n P python -m pytest
--with-mpi`` runs P.
"""

from __future__ import annotations

import numpy as np
import pytest
from ase import Atoms, units
from ase.build import bulk
from ase.calculators.emt import EMT
from ase.io import read
from ase.md import MDLogger
from ase.md import langevin as ase_langevin
from ase.md import nose_hoover_chain as ase_nhc
from ase.md.bussi import Bussi
from ase.md.nvtberendsen import NVTBerendsen
from ase.md.velocitydistribution import Stationary, thermalize_momenta
from ase.md.verlet import VelocityVerlet
from ase.optimize import BFGS
from ase.optimize import FIRE as AseFIRE
from ase.parallel import DummyMPI
from migrating import Einstein, MigratingCalculator
from sharded import COMM, on_root, thermalised_cu

from ase_shard import ShardedCalculator
from ase_shard.distributed import GLOBAL_ID, DistributedAtoms, distribute, gather
from ase_shard.dynamics import FIRE, IsotropicMTKNPT, Langevin, NoseHooverChainNVT
from ase_shard.io import Trajectory
from ase_shard.models import EMT as TorchEMT
from ase_shard.noise import AtomNoise

pytestmark = pytest.mark.timeout(120)

DT = 2 * units.fs
# ASE's drivers for the one-rank references talk to no other rank
ALONE = {"comm": DummyMPI()}


def labelled_cu(seed: int) -> Atoms:
    """Thermalised, rattled Cu (32 atoms) with every kind of per-atom array."""
    atoms = thermalised_cu(2, 300.0, seed=seed)
    rng = np.random.default_rng(seed)
    atoms.set_tags(np.arange(len(atoms)) % 7)
    atoms.set_initial_charges(rng.normal(size=len(atoms)))
    atoms.set_initial_magnetic_moments(rng.normal(size=len(atoms)))
    atoms.set_masses(atoms.get_masses() * rng.uniform(0.9, 1.1, len(atoms)))
    atoms.new_array("label", rng.normal(size=(len(atoms), 2)))
    return atoms


def distributed(atoms: Atoms, seed: int, make=EMT, comm=None) -> DistributedAtoms:
    """``atoms`` (from rank 0) spread over the ranks, under a migrating calculator."""
    local = distribute(atoms if COMM.is_root or comm is not None else None, comm=comm)
    local.calc = MigratingCalculator(make, seed=seed)
    return local


def gathered(local: DistributedAtoms) -> Atoms:
    """The whole system, on every rank."""
    return COMM.bcast(gather(local))


def moved_atoms(local: DistributedAtoms) -> int:
    """Atoms that changed rank in the migrating calculator's calculations, all ranks."""
    return sum(COMM.allgather(local.calc.moved))


def assert_same_state(got: Atoms, ref: dict, atol: float = 1e-10) -> None:
    np.testing.assert_allclose(got.positions, ref["positions"], rtol=0, atol=atol)
    np.testing.assert_allclose(got.get_momenta(), ref["momenta"], rtol=0, atol=atol)
    np.testing.assert_allclose(got.cell.array, ref["cell"], rtol=0, atol=atol)


def state(atoms: Atoms) -> dict:
    """Copies of the positions (Å), momenta and cell of ``atoms``."""
    return {
        "positions": atoms.get_positions(),
        "momenta": atoms.get_momenta(),
        "cell": atoms.cell.array.copy(),
    }


def reference(start: Atoms, driver, steps: int) -> dict:
    """``driver(atoms)`` (ASE's) run ``steps`` on a plain copy of ``start`` with EMT, on rank 0."""

    def run() -> dict:
        atoms = start.copy()
        atoms.calc = EMT()
        driver(atoms).run(steps)
        return state(atoms)

    return on_root(run)


def test_velocity_verlet_with_migration_equals_one_rank() -> None:
    steps, start = 50, labelled_cu(seed=1)
    local = distributed(start, seed=2)
    VelocityVerlet(local, timestep=DT).run(steps)
    ref = reference(start, lambda atoms: VelocityVerlet(atoms, timestep=DT, **ALONE), steps)

    whole = gathered(local)
    assert len(whole) == len(start) == local.get_global_number_of_atoms()
    ids = np.sort(np.concatenate(COMM.allgather(local.arrays[GLOBAL_ID])))
    assert (ids == np.arange(len(start))).all()
    assert_same_state(whole, ref)
    for name in ("numbers", "tags", "initial_charges", "initial_magmoms", "masses", "label"):
        assert (whole.arrays[name] == start.arrays[name]).all(), name
    assert local.calc.calculations == steps + 1
    assert moved_atoms(local) > steps * len(start) // 4 or COMM.size == 1


def test_nose_hoover_chain_nvt_equals_ase() -> None:
    steps, start = 40, thermalised_cu(2, 600.0, seed=3)
    args = {"timestep": DT, "temperature_K": 300.0, "tdamp": 20 * DT}
    local = distributed(start, seed=4)
    dyn = NoseHooverChainNVT(local, **args)
    dyn.run(steps)
    ref = reference(start, lambda atoms: ase_nhc.NoseHooverChainNVT(atoms, **args, **ALONE), steps)
    assert_same_state(gathered(local), ref)
    # the thermostat acted (the crystal starts at 600 K, the bath is at 300 K)
    assert abs(dyn._thermostat._eta[0]) > 1e-2
    assert moved_atoms(local) > 0 or COMM.size == 1


def mtk_args() -> dict:
    """A fast barostat at 5 GPa, so the cell shrinks visibly within 40 steps."""
    return {
        "timestep": DT,
        "temperature_K": 300.0,
        "pressure_au": 5.0 * units.GPa,
        "tdamp": 20 * DT,
        "pdamp": 40 * DT,
    }


def test_isotropic_mtk_npt_equals_ase() -> None:
    steps, start = 40, thermalised_cu(2, 300.0, seed=5)
    local = distributed(start, seed=6)
    IsotropicMTKNPT(local, **mtk_args()).run(steps)
    ref = reference(
        start, lambda atoms: ase_nhc.IsotropicMTKNPT(atoms, **mtk_args(), **ALONE), steps
    )
    assert_same_state(gathered(local), ref)
    assert abs(np.linalg.det(ref["cell"]) / start.get_volume() - 1) > 1e-3  # the cell moved
    assert moved_atoms(local) > 0 or COMM.size == 1


FIXCM_DEPRECATED = "ignore:The implementation of `fixcm=True`:FutureWarning"


class KeyedNormals:
    """What ASE's ``Langevin`` asks of its ``rng``, answered with the noise that
    ``ase_shard.dynamics.Langevin`` draws on distributed atoms: the two draws of each
    step, for the atoms in their global order (ASE draws for every atom at once)."""

    def __init__(self, seed: int):
        self.noise = AtomNoise(seed)
        self.calls = 0

    def standard_normal(self, size: tuple[int, int]) -> np.ndarray:
        step, draw = divmod(self.calls, 2)
        self.calls += 1
        return self.noise.normals(np.arange(size[0]), step, draw)


@pytest.mark.filterwarnings(FIXCM_DEPRECATED)
@pytest.mark.parametrize("fixcm", [False, True])
def test_langevin_equals_ase_on_the_same_noise(fixcm: bool) -> None:
    """Each atom's noise is keyed by its id and the step: on any number of ranks, atoms
    migrating at random, the distributed run equals ASE's ``Langevin`` on the whole
    system drawing the same numbers (bit for bit on one rank)."""
    steps, start = 20, thermalised_cu(2, 300.0, seed=7)
    args = {"timestep": DT, "temperature_K": 500.0, "friction": 0.02 / units.fs, "fixcm": fixcm}
    local = distributed(start, seed=8)
    dyn = Langevin(local, rng=np.random.default_rng(9), **args)
    dyn.run(steps)
    seed = dyn.noise.seed
    assert seed == COMM.bcast(seed)  # one key on every rank
    ref = reference(
        start, lambda atoms: ase_langevin.Langevin(atoms, rng=KeyedNormals(seed), **args, **ALONE),
        steps,
    )
    assert_same_state(gathered(local), ref, atol=0.0 if COMM.size == 1 else 1e-10)
    assert moved_atoms(local) > 0 or COMM.size == 1


@pytest.mark.filterwarnings(FIXCM_DEPRECATED)
def test_langevin_fixcm_keeps_total_momentum_over_ranks() -> None:
    start = thermalised_cu(2, 300.0, seed=10)  # Stationary: zero total momentum
    local = distributed(start, seed=11)
    dyn = Langevin(
        local,
        DT,
        temperature_K=600.0,
        friction=0.05 / units.fs,
        fixcm=True,
        rng=np.random.default_rng(12),
    )
    dyn.run(20)
    total = local.sum_over_ranks(local.get_momenta().sum(axis=0))
    heated = local.get_kinetic_energy() / start.get_kinetic_energy()
    assert np.abs(total).max() < 1e-10, total
    assert heated > 1.05  # the 600 K bath heats the 300 K crystal (EMT alone cools it)


BATH_K, START_K, SPRING = 450.0, 150.0, 4.0  # K, K, eV/Å²


def einstein_crystal(seed: int) -> tuple[Atoms, np.ndarray]:
    """864 Cu atoms on springs around fcc sites, drawn at a third of the bath temperature.

    Returns the atoms and the sites (Å). Without a working thermostat they stay at 150 K.
    """
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(6)
    sites = atoms.positions.copy()
    atoms.rattle(stdev=np.sqrt(units.kB * START_K / SPRING), seed=seed)
    thermalize_momenta(atoms, temperature_K=START_K, rng=np.random.default_rng(seed))
    Stationary(atoms)
    return atoms, sites


def mean_temperature(local: DistributedAtoms, dyn, steps: int) -> float:
    """Mean temperature (K) over the second half of ``steps``."""
    temperatures = []
    dyn.attach(lambda: temperatures.append(local.get_temperature()), interval=1)
    dyn.run(steps)
    return float(np.mean(temperatures[steps // 2 :]))


# 300 steps of 5 fs: ASE's own Langevin (friction 0.05/fs) on this crystal, seeds 0-7,
# gives a mean over the second half of -0.7 % +- 0.6 % from the bath; Bussi (taut 50
# fs) -0.2 % +- 0.4 %
STEPS, TOLERANCE = 300, 0.03


def test_langevin_reaches_bath_temperature() -> None:
    start, sites = einstein_crystal(seed=13)
    local = distributed(start, seed=14, make=lambda: Einstein(sites, k=SPRING))
    dyn = Langevin(
        local,
        5 * units.fs,
        temperature_K=BATH_K,
        friction=0.05 / units.fs,
        fixcm=False,
        rng=np.random.default_rng(15),
    )
    temperature = mean_temperature(local, dyn, STEPS)
    assert abs(temperature / BATH_K - 1) < TOLERANCE, temperature


def test_bussi_equals_ase_and_reaches_bath_temperature() -> None:
    steps, start = 30, thermalised_cu(2, 300.0, seed=16)
    args = {"timestep": DT, "temperature_K": 500.0, "taut": 20 * DT}
    local = distributed(start, seed=17)
    Bussi(local, rng=np.random.default_rng(18), **args).run(steps)
    ref = reference(
        start, lambda atoms: Bussi(atoms, rng=np.random.default_rng(18), **args, **ALONE), steps
    )
    assert_same_state(gathered(local), ref)

    start, sites = einstein_crystal(seed=19)
    local = distributed(start, seed=20, make=lambda: Einstein(sites, k=SPRING))
    dyn = Bussi(
        local,
        5 * units.fs,
        temperature_K=BATH_K,
        taut=50 * units.fs,
        rng=np.random.default_rng(21),
    )
    temperature = mean_temperature(local, dyn, STEPS)
    assert abs(temperature / BATH_K - 1) < TOLERANCE, temperature


def test_fire_relaxes_as_ase(tmp_path) -> None:
    start = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(2)
    start.rattle(stdev=0.1, seed=22)
    local = distributed(start, seed=23)
    with Trajectory(tmp_path / "fire.traj") as traj:  # as ASE's drivers use a trajectory
        opt = FIRE(local, logfile=None, trajectory=traj)
        assert opt.run(fmax=0.01, steps=300)
        assert len(traj) == opt.nsteps + 1

    def run() -> dict:
        atoms = start.copy()
        atoms.calc = EMT()
        ase_opt = AseFIRE(atoms, logfile=None, **ALONE)
        ase_opt.run(fmax=0.01, steps=300)
        return {
            "positions": atoms.positions,
            "energy": atoms.get_potential_energy(),
            "nsteps": ase_opt.nsteps,
        }

    ref = on_root(run)
    whole = gathered(local)
    assert opt.nsteps == ref["nsteps"]
    np.testing.assert_allclose(whole.positions, ref["positions"], rtol=0, atol=1e-8)
    assert abs(local.get_potential_energy() - ref["energy"]) < 1e-8
    last = on_root(lambda: read(tmp_path / "fire.traj", parallel=False).positions)
    np.testing.assert_array_equal(last, whole.positions)
    assert moved_atoms(local) > 0 or COMM.size == 1


@pytest.mark.parametrize(
    "driver",
    [
        lambda atoms: BFGS(atoms, logfile=None),
        lambda atoms: AseFIRE(atoms, logfile=None),
        lambda atoms: ase_langevin.Langevin(
            atoms, DT, temperature_K=300.0, friction=0.01, fixcm=False
        ),
        lambda atoms: ase_nhc.NoseHooverChainNVT(atoms, DT, temperature_K=300.0, tdamp=0.1),
        lambda atoms: NVTBerendsen(atoms, DT, temperature_K=300.0, taut=0.1),
    ],
    ids=["BFGS", "ase-FIRE", "ase-Langevin", "ase-NoseHooverChainNVT", "NVTBerendsen"],
)
def test_unsafe_drivers_are_refused_on_every_rank(driver) -> None:
    local = distributed(thermalised_cu(2, 300.0, seed=24), seed=25)
    with pytest.raises(TypeError, match="cannot run on DistributedAtoms"):
        driver(local)


def test_fire_refuses_per_atom_options_on_distributed_atoms() -> None:
    local = distributed(thermalised_cu(2, 300.0, seed=26), seed=27)
    with pytest.raises(ValueError, match="downhill_check"):
        FIRE(local, logfile=None, downhill_check=True)


def test_md_logger_prints_the_whole_system(tmp_path) -> None:
    steps, start = 10, thermalised_cu(2, 300.0, seed=28)
    local = distributed(start, seed=29)
    dyn = VelocityVerlet(local, timestep=DT)
    dyn.attach(MDLogger(dyn, local, tmp_path / "md.log", stress=True, mode="w"), interval=5)
    dyn.run(steps)

    def run() -> tuple[str, str]:
        atoms = start.copy()
        atoms.calc = EMT()
        ref = VelocityVerlet(atoms, timestep=DT, **ALONE)
        ref.attach(
            MDLogger(ref, atoms, tmp_path / "ref.log", stress=True, mode="w", comm=DummyMPI()),
            interval=5,
        )
        ref.run(steps)
        return (tmp_path / "md.log").read_text(), (tmp_path / "ref.log").read_text()

    ours, ref = on_root(run)
    assert len(ref.splitlines()) == 1 + steps // 5 + 1
    assert ours == ref


def test_trajectory_writes_every_interval_and_restarts(tmp_path) -> None:
    steps, start = 20, labelled_cu(seed=30)
    local = distributed(start, seed=31)
    path = tmp_path / "md.traj"  # rank 0's path is the one written
    dyn = VelocityVerlet(local, timestep=DT)
    with Trajectory(path, "w", local) as traj:
        dyn.attach(traj.write, interval=10)
        dyn.run(steps)
        assert len(traj) == steps // 10 + 1

    def frames() -> list[dict]:
        atoms = start.copy()
        atoms.calc = EMT()
        refs = []

        def record() -> None:
            refs.append(
                {
                    **state(atoms),
                    "forces": atoms.get_forces(),
                    "energy": atoms.get_potential_energy(),
                    "stress": atoms.get_stress(),
                }
            )

        ref = VelocityVerlet(atoms, timestep=DT, **ALONE)
        ref.attach(record, interval=10)
        ref.run(steps)
        written = [
            {
                **state(frame),
                "forces": frame.get_forces(),
                "energy": frame.get_potential_energy(),
                "stress": frame.get_stress(),
                "arrays": dict(frame.arrays),
            }
            for frame in read(path, ":", parallel=False)
        ]
        return list(zip(written, refs, strict=True))

    pairs = on_root(frames)
    assert len(pairs) == 3
    for got, ref in pairs:
        np.testing.assert_allclose(got["positions"], ref["positions"], rtol=0, atol=1e-10)
        np.testing.assert_allclose(got["momenta"], ref["momenta"], rtol=0, atol=1e-10)
        np.testing.assert_allclose(got["forces"], ref["forces"], rtol=0, atol=1e-9)
        np.testing.assert_allclose(got["stress"], ref["stress"], rtol=0, atol=1e-12)
        assert abs(got["energy"] - ref["energy"]) < 1e-9
        for name in ("numbers", "tags", "initial_charges", "initial_magmoms", "masses"):
            assert (got["arrays"][name] == start.arrays[name]).all(), name

    # restart: the last frame, read on rank 0 and distributed, is the run's end state
    restarted = distribute(read(path, parallel=False) if COMM.is_root else None)
    for name in (
        "positions",
        "momenta",
        "numbers",
        "tags",
        "initial_charges",
        "initial_magmoms",
        "masses",
    ):
        np.testing.assert_array_equal(
            gathered(restarted).arrays[name], gathered(local).arrays[name], err_msg=name
        )


THROUGH_SHARDED = {
    "NoseHooverChainNVT": (
        lambda atoms: NoseHooverChainNVT(atoms, DT, temperature_K=300.0, tdamp=20 * DT),
        lambda atoms: ase_nhc.NoseHooverChainNVT(
            atoms, DT, temperature_K=300.0, tdamp=20 * DT, **ALONE
        ),
    ),
    "IsotropicMTKNPT": (
        lambda atoms: IsotropicMTKNPT(atoms, **mtk_args()),
        lambda atoms: ase_nhc.IsotropicMTKNPT(atoms, **mtk_args(), **ALONE),
    ),
    "Bussi": (
        lambda atoms: Bussi(
            atoms, DT, temperature_K=300.0, taut=20 * DT, rng=np.random.default_rng(32)
        ),
        lambda atoms: Bussi(
            atoms, DT, temperature_K=300.0, taut=20 * DT, rng=np.random.default_rng(32), **ALONE
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(THROUGH_SHARDED))
def test_drivers_through_sharded_calculator_equal_ase(name: str) -> None:
    """The real path: ShardedCalculator migrates distributed atoms at its rebuilds."""
    ours, ase_driver = THROUGH_SHARDED[name]
    steps, start = 30, thermalised_cu(3, 900.0, seed=33)
    local = distribute(start if COMM.is_root else None)
    calc = ShardedCalculator(TorchEMT(), skin=0.2)
    local.calc = calc
    ours(local).run(steps)
    ref = reference(start, ase_driver, steps)
    assert_same_state(gathered(local), ref, atol=1e-8)
    assert calc.rebuilds > 1


def test_fire_through_sharded_calculator_equals_ase() -> None:
    start = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(3)
    start.rattle(stdev=0.15, seed=34)
    local = distribute(start if COMM.is_root else None)
    calc = ShardedCalculator(TorchEMT(), skin=0.2)
    local.calc = calc
    opt = FIRE(local, logfile=None)
    assert opt.run(fmax=0.01, steps=300)

    def run() -> dict:
        atoms = start.copy()
        atoms.calc = EMT()
        ase_opt = AseFIRE(atoms, logfile=None, **ALONE)
        ase_opt.run(fmax=0.01, steps=300)
        return {"positions": atoms.get_positions(), "nsteps": ase_opt.nsteps}

    ref = on_root(run)
    assert opt.nsteps == ref["nsteps"]
    np.testing.assert_allclose(gathered(local).positions, ref["positions"], rtol=0, atol=1e-8)
    assert calc.rebuilds > 1


def test_trajectory_of_plain_atoms_is_written_by_rank_0_alone(tmp_path) -> None:
    """Replicated atoms (the same on every rank) are written once, as ASE's writer does."""
    atoms = thermalised_cu(2, 300.0, seed=35)
    atoms.calc = EMT()
    with Trajectory(tmp_path / "plain.traj", atoms=atoms) as traj:
        traj.write()
        atoms.positions[0, 0] += 0.1
        forces = atoms.get_forces()  # written: results current for the atoms
        traj.write()
    frames = on_root(lambda: read(tmp_path / "plain.traj", ":", parallel=False))
    assert len(frames) == 2
    np.testing.assert_array_equal(frames[1].positions, atoms.positions)
    np.testing.assert_array_equal(frames[1].get_forces(), forces)


LANGEVIN = {"temperature_K": 500.0, "friction": 0.02 / units.fs, "fixcm": False}
ON_PLAIN_ATOMS = {
    "Langevin": (
        lambda atoms: Langevin(atoms, DT, rng=np.random.default_rng(36), **LANGEVIN, **ALONE),
        lambda atoms: ase_langevin.Langevin(
            atoms, DT, rng=np.random.default_rng(36), **LANGEVIN, **ALONE
        ),
    ),
    **{name: THROUGH_SHARDED[name] for name in ("NoseHooverChainNVT", "IsotropicMTKNPT")},
    "FIRE": (
        lambda atoms: FIRE(atoms, logfile=None, **ALONE),
        lambda atoms: AseFIRE(atoms, logfile=None, **ALONE),
    ),
}


@pytest.mark.parametrize("name", sorted(ON_PLAIN_ATOMS))
@pytest.mark.rank_independent
def test_drivers_on_plain_atoms_equal_ase(name: str) -> None:
    """On an ordinary Atoms each driver is ASE's, bit for bit (rank 0 runs both)."""
    ours, ase_driver = ON_PLAIN_ATOMS[name]
    start = thermalised_cu(2, 600.0, seed=37)
    start.rattle(stdev=0.05, seed=38)
    ref = reference(start, ase_driver, 20)
    got = reference(start, ours, 20)
    for key, value in got.items():
        np.testing.assert_array_equal(value, ref[key], err_msg=key)
