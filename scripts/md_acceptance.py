"""Full-size MD and optimisation acceptance figures for ShardedCalculator.

    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
    mpirun --oversubscribe -n 3 .venv/bin/python scripts/md_acceptance.py --case nve
    mpirun --oversubscribe -n 2 .venv/bin/python scripts/md_acceptance.py --case all

Cases (``--case``):

- ``nve``: VelocityVerlet, 4,000-atom fcc Cu, EMT, 300 K, 2 fs, 500 steps: energy
  drift, rebuilds, steps/s; positions after 100 steps against a one-rank run.
- ``soak``: Langevin on a 2,048-atom hot Lennard-Jones (argon) fluid, 2,000 steps: atom
  count and ids conserved, owner changes counted, forces checked against ASE's
  LennardJones every 250 steps and against a fresh one-rank evaluation at the end.
- ``nve-soak``: VelocityVerlet on an 864-atom hot Lennard-Jones (argon) fluid, 10,000
  steps of 5 fs (``--soak-steps``): count and ids conserved, every rank bitwise equal
  at every step, energy conserved, results against ASE's LennardJones every 500 steps
  (``tests/soak.py``; run it on 3 ranks for docs/reliability.md); ``--distributed``
  runs it on DistributedAtoms.
- ``npt``: NPTBerendsen and IsotropicMTKNPT, 864-atom Cu under tension, 200 steps:
  volume change, rebuilds, stress against ASE's EMT and a fresh one-rank
  evaluation every 20 steps.
- ``relax``: FIRE + FrechetCellFilter on strained bulk Cu, and BFGS on a rattled
  Cu(111) slab, to fmax 1e-3, against the same relaxations on one rank.
- ``timing``: 32,000-atom Cu, EMT: time of a step that reuses the decomposition
  against one that rebuilds it.
- ``distributed``: DistributedAtoms (each rank holds its own atoms). VelocityVerlet,
  4,000 Cu, EMT, 1,200 K, 1 fs, 200 steps: gathered positions and every per-atom array
  against the replicated one-rank run, drift, atoms that changed rank; Langevin
  (ase_shard.dynamics) and ASE's Bussi to 600 K: mean T over the second half; ase_shard's
  IsotropicMTKNPT on 864 Cu under tension: volume against ASE's on one rank.

Every rank runs the same ASE driver on the same Atoms (seeded random numbers).
One-rank references are computed inside the same command: rank 0 alone runs
them with ``comm=MPI.COMM_SELF`` for the calculator and ``comm=DummyMPI()``
for the ASE driver, then broadcasts the result (no files, no second launch;
the price is that the other ranks wait meanwhile). Rank 0 prints a table;
the exit status is 1 if any check failed.
"""

import sys
from pathlib import Path

import ase_shard  # first: sets up MPI before ASE fixes ase.parallel.world

# isort: split

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import argparse
import sys
import time
from functools import partial

import numpy as np
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
from oracles import rel_err
from sharded import COMM, identical_on_all_ranks, on_root, serial_comm, thermalised_cu
from soak import run_nve_soak

from ase_shard import ShardedCalculator
from ase_shard.check import results
from ase_shard.distributed import distribute, gather
from ase_shard.models import EMT, LennardJones

RTOL = 1e-10
# NVE soak: max |Etot - Etot0| / N in eV/atom (about 0.3 % of kB T at 800 K)
NVE_TOLERANCE = 2e-4
ARGON = {"sigma": 3.4, "epsilon": 0.0104, "rc": 8.5, "smooth": True}


class Table:
    """Rows of (case, quantity, value, check) printed by rank 0."""

    def __init__(self):
        self.rows: list[tuple[str, str, str, str]] = []
        self.failed = False

    def add(self, case: str, quantity: str, value: str, ok: bool | None = None, rule: str = ""):
        """One figure; ``ok`` None means no pass/fail criterion."""
        verdict = "" if ok is None else ("ok " if ok else "FAIL ") + rule
        self.failed |= ok is False
        self.rows.append((case, quantity, value, verdict))
        if COMM.is_root:
            print(self.line(self.rows[-1]), flush=True)

    @staticmethod
    def line(row: tuple[str, str, str, str]) -> str:
        case, quantity, value, verdict = row
        return f"{case:6s} | {quantity:54s} | {value:>20s} | {verdict}"

    def print(self) -> None:
        if COMM.is_root:
            print(f"\n== summary, {COMM.size} MPI rank(s)")
            print("\n".join(self.line(row) for row in self.rows))


def worst_error(got: dict, ref: dict) -> float:
    """The largest relative error over the quantities in ``got``."""
    return max(rel_err(np.asarray(got[key]), np.asarray(ref[key])) for key in got)


def case_nve(table: Table, skin: float) -> None:
    steps, compare_at = 500, 100
    start = thermalised_cu(10, 300.0, seed=42)
    n = len(start)
    atoms = start.copy()
    calc = ShardedCalculator(EMT(), skin=skin)
    atoms.calc = calc
    dyn = VelocityVerlet(atoms, timestep=2 * units.fs)
    totals, snapshot = [], {}

    def observe() -> None:
        totals.append(atoms.get_total_energy())
        if dyn.nsteps == compare_at:
            snapshot["positions"] = atoms.positions.copy()

    dyn.attach(observe, interval=1)
    elapsed = time.perf_counter()
    dyn.run(steps)
    elapsed = time.perf_counter() - elapsed
    totals = np.array(totals)

    def serial() -> np.ndarray:
        ref = start.copy()
        ref.calc = ShardedCalculator(EMT(), skin=skin, comm=serial_comm())
        VelocityVerlet(ref, timestep=2 * units.fs, comm=DummyMPI()).run(compare_at)
        return ref.positions

    reference = on_root(serial)
    drift = np.abs(totals - totals[0]).max() / n
    deviation = np.abs(snapshot["positions"] - reference).max()
    table.add("nve", "atoms / steps of 2 fs / skin Å", f"{n} / {steps} / {skin:g}")
    table.add("nve", "max |Etot - Etot0| / N (eV/atom)", f"{drift:.2e}", drift < 5e-4, "< 5e-4")
    table.add("nve", "(Etot_end - Etot0) / N (eV/atom)", f"{(totals[-1] - totals[0]) / n:+.2e}")
    table.add("nve", "rebuilds", f"{calc.rebuilds}", calc.rebuilds <= steps // 10, "<= 10%")
    table.add("nve", "steps/s", f"{steps / elapsed:.2f}")
    table.add(
        "nve",
        f"max |r - r_1rank| after {compare_at} steps (Å)",
        f"{deviation:.1e}",
        deviation <= 1e-8,
        "<= 1e-8",
    )
    same = identical_on_all_ranks(atoms.get_forces(), atoms.positions)
    table.add("nve", "final forces bitwise equal on all ranks", str(same), same)


def case_soak(table: Table, skin: float) -> None:
    steps, check_every = 2000, 250
    # fcc argon at reduced density 0.6, melted at 1000 K and held at 500 K (~4 epsilon/kB);
    # rattled so that forces are non-zero from the first check
    atoms = bulk("Ar", "fcc", a=6.4, cubic=True).repeat(8)
    atoms.rattle(stdev=0.05, seed=4)
    n = len(atoms)
    ids = np.arange(n)
    numbers = atoms.numbers.copy()
    atoms.new_array("ids", ids.copy())
    thermalize_momenta(atoms, temperature_K=1000.0, rng=np.random.default_rng(5))
    start = atoms.positions.copy()
    calc = ShardedCalculator(LennardJones(**ARGON), skin=skin)
    atoms.calc = calc
    dyn = Langevin(
        atoms,
        timestep=5 * units.fs,
        temperature_K=500.0,
        friction=0.01 / units.fs,
        fixcm=False,
        rng=np.random.default_rng(6),
    )
    track = {"builds": 0, "owners": None, "migrations": 0, "errors": []}
    oracle = AseLennardJones(**ARGON)

    def observe() -> None:
        if COMM.is_root and calc.rebuilds != track["builds"]:
            track["builds"] = calc.rebuilds
            now = calc.decomposition.owners
            if track["owners"] is not None:
                track["migrations"] += int((now != track["owners"]).sum())
            track["owners"] = now
        if dyn.nsteps % check_every == 0:
            got = {"forces": atoms.get_forces(), "energy": np.array(atoms.get_potential_energy())}
            track["errors"].append(on_root(lambda: worst_error(got, results(atoms, oracle))))

    dyn.attach(observe, interval=1)
    elapsed = time.perf_counter()
    dyn.run(steps)
    elapsed = time.perf_counter() - elapsed
    track["migrations"] = COMM.bcast(track["migrations"])

    final = {"energy": np.array(atoms.get_potential_energy()), "forces": atoms.get_forces()}
    final["stress"] = atoms.get_stress()
    serial = on_root(
        lambda: results(atoms, ShardedCalculator(LennardJones(**ARGON), comm=serial_comm()))
    )
    vs_serial = worst_error(final, serial)
    vs_ase = on_root(lambda: worst_error(final, results(atoms, oracle)))
    conserved = (
        len(atoms) == n and (atoms.numbers == numbers).all() and (atoms.arrays["ids"] == ids).all()
    )
    moved = np.linalg.norm(atoms.positions - start, axis=1)
    left = (np.abs(atoms.get_scaled_positions(wrap=False) - 0.5) > 0.5).any(axis=1).sum()
    table.add("soak", "atoms / steps of 5 fs / skin Å", f"{n} / {steps} / {skin:g}")
    table.add("soak", "count, numbers and ids conserved", str(conserved), bool(conserved))
    table.add("soak", "temperature at the end (K)", f"{atoms.get_temperature():.0f}")
    table.add("soak", "mean / max displacement (Å)", f"{moved.mean():.1f} / {moved.max():.1f}")
    table.add("soak", "atoms outside the unwrapped cell at the end", f"{left}")
    table.add("soak", "rebuilds", f"{calc.rebuilds}", calc.rebuilds > 1, "> 1")
    table.add(
        "soak",
        "owner changes over rebuilds (moves + rebalancing)",
        f"{track['migrations']}",
        track["migrations"] > 0 or COMM.size == 1,
        "> 0",
    )
    table.add(
        "soak",
        f"max rel err vs ASE LJ, every {check_every} steps",
        f"{max(track['errors']):.1e}",
        max(track["errors"]) <= RTOL,
        f"<= {RTOL:g}",
    )
    table.add("soak", "final rel err vs ASE LJ (E, F, stress)", f"{vs_ase:.1e}", vs_ase <= RTOL)
    table.add(
        "soak",
        "final rel err vs fresh 1-rank (E, F, stress)",
        f"{vs_serial:.1e}",
        vs_serial <= RTOL,
    )
    same = identical_on_all_ranks(final["forces"], final["stress"])
    table.add("soak", "final forces bitwise equal on all ranks", str(same), same)
    table.add("soak", "steps/s", f"{steps / elapsed:.2f}")


def case_nve_soak(
    table: Table, skin: float, steps: int = 10_000, distributed: bool = False
) -> None:
    figures = run_nve_soak(
        repeat=6, steps=steps, oracle_every=500, skin=skin, distributed=distributed
    )
    drift, error = figures["max_drift"], figures["oracle_error"]
    table.add(
        "nve-soak", "atoms / steps of 5 fs / skin Å", f"{figures['atoms']} / {steps} / {skin:g}"
    )
    table.add(
        "nve-soak",
        "count, numbers and ids conserved",
        str(figures["conserved"]),
        figures["conserved"],
    )
    table.add(
        "nve-soak",
        "E, Etot, stress bitwise equal on all ranks, every step"
        if distributed
        else "r, p, E_i, F bitwise equal on all ranks, every step",
        str(figures["in_step"]),
        figures["in_step"],
    )
    table.add(
        "nve-soak",
        "every atom owned (non-zero energy), every step",
        str(figures["all_owned"]),
        figures["all_owned"],
    )
    table.add(
        "nve-soak",
        "max |Etot - Etot0| / N (eV/atom)",
        f"{drift:.2e}",
        drift <= NVE_TOLERANCE,
        f"<= {NVE_TOLERANCE:g}",
    )
    table.add("nve-soak", "(Etot_end - Etot0) / N (eV/atom)", f"{figures['end_drift']:+.2e}")
    table.add(
        "nve-soak",
        f"max rel err vs ASE LJ ({figures['oracle_checks']} checks, E, F, stress)",
        f"{error:.1e}",
        error <= RTOL,
        f"<= {RTOL:g}",
    )
    table.add("nve-soak", "rebuilds", f"{figures['rebuilds']}", figures["rebuilds"] > 1, "> 1")
    table.add(
        "nve-soak",
        "owner changes over rebuilds (moves + rebalancing)",
        f"{figures['owner_changes']}",
        figures["owner_changes"] > 0 or COMM.size == 1,
        "> 0",
    )
    table.add("nve-soak", "temperature at the end (K)", f"{figures['temperature']:.0f}")
    table.add("nve-soak", "mean displacement (Å)", f"{figures['mean_displacement']:.1f}")
    table.add("nve-soak", "steps/s (incl. checks)", f"{steps / figures['seconds']:.2f}")


def barostats() -> dict:
    """Stress-driven NPT integrators of ase.md, towards zero pressure at 300 K."""
    return {
        "berendsen": lambda atoms: NPTBerendsen(
            atoms,
            timestep=2 * units.fs,
            temperature_K=300.0,
            pressure_au=0.0,
            taut=100 * units.fs,
            taup=200 * units.fs,
            compressibility_au=1.0 / (140.0 * units.GPa),
            fixcm=False,
        ),
        "mtk": lambda atoms: IsotropicMTKNPT(
            atoms,
            timestep=2 * units.fs,
            temperature_K=300.0,
            pressure_au=0.0,
            tdamp=100 * units.fs,
            pdamp=1000 * units.fs,
        ),
    }


def case_npt(table: Table, skin: float) -> None:
    steps, check_every = 200, 20
    for name, make_dynamics in barostats().items():
        atoms = thermalised_cu(6, 300.0, seed=7)
        atoms.set_cell(atoms.cell * 1.02, scale_atoms=True)  # under tension: it shrinks
        volume = atoms.get_volume()
        calc = ShardedCalculator(EMT(), skin=skin)
        atoms.calc = calc
        dyn = make_dynamics(atoms)
        errors = {"ase": [], "serial": [], "same": []}

        def check(atoms=atoms, errors=errors) -> None:
            got = {"stress": atoms.get_stress(), "forces": atoms.get_forces()}
            errors["same"].append(identical_on_all_ranks(got["stress"], got["forces"]))
            serial = on_root(
                lambda: results(atoms, ShardedCalculator(EMT(), comm=serial_comm()))
            )
            errors["serial"].append(worst_error(got, serial))
            errors["ase"].append(on_root(lambda: worst_error(got, results(atoms, AseEMT()))))

        dyn.attach(check, interval=check_every)
        elapsed = time.perf_counter()
        dyn.run(steps)
        elapsed = time.perf_counter() - elapsed
        ratio = atoms.get_volume() / volume
        table.add("npt", f"{name}: atoms / steps of 2 fs", f"{len(atoms)} / {steps}")
        table.add("npt", f"{name}: V_end / V_0", f"{ratio:.4f}", abs(ratio - 1) > 1e-3, "!= 1")
        table.add("npt", f"{name}: rebuilds", f"{calc.rebuilds}", calc.rebuilds < steps // 4)
        for key, label in (("ase", "ASE EMT"), ("serial", "fresh 1-rank")):
            worst = max(errors[key])
            table.add(
                "npt",
                f"{name}: max rel err stress+F vs {label} ({len(errors[key])}x)",
                f"{worst:.1e}",
                worst <= RTOL,
                f"<= {RTOL:g}",
            )
        same = all(errors["same"])
        table.add("npt", f"{name}: stress bitwise equal on all ranks", str(same), same)
        table.add("npt", f"{name}: steps/s (incl. checks)", f"{steps / elapsed:.2f}")


def relax(start: Atoms, optimizer, cell: bool, skin: float, serial: bool) -> dict:
    """Relax a copy of ``start`` to fmax 1e-3; sharded over all ranks or on this one alone."""
    atoms = start.copy()
    atoms.calc = ShardedCalculator(EMT(), skin=skin, comm=serial_comm() if serial else None)
    driver = {"comm": DummyMPI()} if serial else {}
    target = FrechetCellFilter(atoms) if cell else atoms
    opt = optimizer(target, logfile=None, **driver)
    elapsed = time.perf_counter()
    converged = opt.run(fmax=1e-3, steps=2000)
    return {
        "converged": bool(converged),
        "steps": opt.nsteps,
        "positions": atoms.positions.copy(),
        "cell": atoms.cell.array.copy(),
        "seconds": time.perf_counter() - elapsed,
    }


def case_relax(table: Table, skin: float) -> None:
    strained = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(4)
    strain = np.array([[1.02, 0.006, 0.0], [0.0, 0.99, -0.01], [0.006, 0.0, 1.004]])
    strained.set_cell(strained.cell.array @ strain, scale_atoms=True)
    strained.rattle(stdev=0.05, seed=31)
    slab = fcc111("Cu", size=(4, 4, 6), vacuum=6.0)
    slab.rattle(stdev=0.1, seed=41)
    for name, start, optimizer, cell in (
        ("FIRE+FrechetCellFilter", strained, FIRE, True),
        ("BFGS slab", slab, BFGS, False),
    ):
        got = relax(start, optimizer, cell, skin, serial=False)
        ref = on_root(partial(relax, start, optimizer, cell, skin, serial=True))
        dcell = np.abs(got["cell"] - ref["cell"]).max()
        dpos = np.abs(got["positions"] - ref["positions"]).max()
        converged = got["converged"] and ref["converged"]
        table.add("relax", f"{name}: atoms", f"{len(start)}")
        table.add(
            "relax",
            f"{name}: converged; steps (P ranks, 1 rank)",
            f"{converged} / {got['steps']}, {ref['steps']}",
            converged and got["steps"] == ref["steps"],
        )
        if cell:
            moved = np.abs(got["cell"] - start.cell.array).max()
            table.add("relax", f"{name}: max |cell change| (Å)", f"{moved:.3f}")
            table.add(
                "relax", f"{name}: max |cell - cell_1rank| (Å)", f"{dcell:.1e}", dcell <= 1e-8
            )
        table.add(
            "relax", f"{name}: max |r - r_1rank| (Å)", f"{dpos:.1e}", dpos <= 1e-8, "<= 1e-8"
        )
        table.add(
            "relax",
            f"{name}: seconds (P ranks, 1 rank)",
            f"{got['seconds']:.1f}, {ref['seconds']:.1f}",
        )


def case_timing(table: Table, skin: float) -> None:
    repeats = 5
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(20)
    base = atoms.positions.copy()
    rng = np.random.default_rng(3)
    calc = ShardedCalculator(EMT(), skin=skin)
    atoms.calc = calc

    def step(kick: float) -> float:
        """One force evaluation after moving atoms < 0.1 Å from ``base`` (atom 0 by ``kick``)."""
        atoms.positions = base + rng.uniform(-0.05, 0.05, base.shape)
        atoms.positions[0, 0] += kick
        COMM.allgather(None)
        start = time.perf_counter()
        atoms.get_forces()
        return COMM.bcast(time.perf_counter() - start)

    first = step(0.0)
    builds = calc.rebuilds
    reuse = [step(0.0) for _ in range(repeats)]
    reused = calc.rebuilds == builds
    # atom 0 jumps by +-skin each call: more than skin/2 from the last build
    rebuild = [step(skin * (-1) ** k) for k in range(repeats)]
    rebuilt = calc.rebuilds == builds + repeats
    table.add("timing", "atoms / skin Å / calls timed", f"{len(atoms)} / {skin:g} / {repeats}")
    table.add("timing", "first call (build + evaluate) s", f"{first:.2f}")
    table.add("timing", "reuse step s (median)", f"{np.median(reuse):.3f}", reused, "no rebuild")
    table.add(
        "timing",
        "rebuild step s (median)",
        f"{np.median(rebuild):.3f}",
        rebuilt,
        "rebuilt each call",
    )
    table.add(
        "timing", "rebuild / reuse time ratio", f"{np.median(rebuild) / np.median(reuse):.2f}"
    )


def case_distributed(table: Table, skin: float) -> None:
    from ase.md.bussi import Bussi

    from ase_shard import dynamics

    start = thermalised_cu(10, 1200.0, seed=3)
    start.set_tags(np.arange(len(start)) % 11)
    start.arrays["label"] = np.arange(len(start)) * 3
    n = len(start)

    def replicated() -> np.ndarray:
        atoms = start.copy()
        atoms.calc = ShardedCalculator(EMT(), skin=skin, comm=serial_comm())
        VelocityVerlet(atoms, units.fs).run(200)
        return atoms.positions

    positions = on_root(replicated)
    atoms = distribute(start)
    atoms.calc = calc = ShardedCalculator(EMT(), skin=skin)
    dyn = VelocityVerlet(atoms, units.fs)
    totals, arrived, held = [], [0], [atoms.get_global_ids()]

    def observe() -> None:
        totals.append(atoms.get_total_energy())
        ids = atoms.get_global_ids()
        arrived[0] += sum(COMM.allgather(np.setdiff1d(ids, held[0]).size))
        held[0] = ids

    dyn.attach(observe, interval=1)
    elapsed = time.perf_counter()
    dyn.run(200)
    elapsed = time.perf_counter() - elapsed
    whole = gather(atoms)
    drift = float(np.abs(np.array(totals) - totals[0]).max() / n)
    table.add("dist", "NVE: atoms / steps of 1 fs / skin Å", f"{n} / 200 / {skin:g}")
    if COMM.is_root:
        error = float(np.abs(whole.positions - positions).max())
        kept = all(
            np.array_equal(whole.arrays[k], start.arrays[k]) for k in ("numbers", "tags", "label")
        )
        kept &= len(whole) == n and set(whole.arrays) == set(start.arrays)
    error, kept = COMM.bcast((error, kept) if COMM.is_root else None)
    table.add(
        "dist",
        "NVE: max |r - r(1 rank, replicated)| (Å)",
        f"{error:.1e}",
        error <= 1e-8,
        "<= 1e-8",
    )
    table.add("dist", "NVE: count, ids, numbers, tags, custom array", str(kept), kept)
    table.add(
        "dist", "NVE: max |Etot - Etot0| / N (eV/atom)", f"{drift:.2e}", drift <= 1e-4, "<= 1e-4"
    )
    table.add(
        "dist",
        "NVE: rebuilds / atoms that changed rank",
        f"{calc.rebuilds} / {arrived[0]}",
        calc.rebuilds > 1 and (arrived[0] > 0 or COMM.size == 1),
        "> 1 / > 0",
    )
    table.add("dist", "NVE: steps/s", f"{200 / elapsed:.2f}")

    target, steps = 600.0, 400
    thermostats = {
        "Langevin": lambda a: dynamics.Langevin(
            a,
            2 * units.fs,
            temperature_K=target,
            friction=0.02 / units.fs,
            rng=np.random.default_rng(5),
        ),
        "Bussi": lambda a: Bussi(
            a,
            2 * units.fs,
            temperature_K=target,
            taut=50 * units.fs,
            rng=np.random.default_rng(5),
        ),
    }
    for name, make in thermostats.items():
        atoms = distribute(thermalised_cu(10, 300.0, seed=4))
        atoms.calc = ShardedCalculator(EMT(), skin=skin)
        temperatures = []
        dyn = make(atoms)
        dyn.attach(lambda a=atoms, t=temperatures: t.append(a.get_temperature()), 1)
        dyn.run(steps)
        mean = float(np.mean(temperatures[len(temperatures) // 2 :]))
        off = abs(mean / target - 1)
        table.add(
            "dist",
            f"{name}: mean T, 2nd half of {steps} steps (K)",
            f"{mean:.1f} ({off:.1%} off)",
            off <= 0.02,
            f"{target:g} ± 2 %",
        )

    npt = {
        "timestep": 2 * units.fs,
        "temperature_K": 300.0,
        "pressure_au": 0.0,
        "tdamp": 100 * units.fs,
        "pdamp": 1000 * units.fs,
    }

    squeezed = thermalised_cu(6, 300.0, seed=7)
    squeezed.set_cell(squeezed.cell * 1.02, scale_atoms=True)

    def replicated_npt() -> list:
        atoms = squeezed.copy()
        atoms.calc = ShardedCalculator(EMT(), skin=skin, comm=serial_comm())
        volumes = []
        dyn = IsotropicMTKNPT(atoms, **npt, comm=DummyMPI())
        dyn.attach(lambda: volumes.append(atoms.get_volume()), 10)
        dyn.run(200)
        return volumes

    reference = on_root(replicated_npt)
    atoms = distribute(squeezed)
    atoms.calc = ShardedCalculator(EMT(), skin=skin)
    volumes = []
    dyn = dynamics.IsotropicMTKNPT(atoms, **npt)
    dyn.attach(lambda: volumes.append(atoms.get_volume()), 10)
    dyn.run(200)
    worst = float(np.max(np.abs(np.array(volumes) / np.array(reference) - 1)))
    table.add(
        "dist",
        "MTK NPT: V_end / V_0 (distributed; replicated 1 rank)",
        f"{volumes[-1] / volumes[0]:.4f}; {reference[-1] / reference[0]:.4f}",
    )
    table.add(
        "dist",
        "MTK NPT: max |V / V(1 rank) - 1| over 200 steps",
        f"{worst:.1e}",
        worst <= 1e-8,
        "<= 1e-8",
    )


RUNNERS = {
    "nve": case_nve,
    "soak": case_soak,
    "nve-soak": case_nve_soak,
    "npt": case_npt,
    "relax": case_relax,
    "timing": case_timing,
    "distributed": case_distributed,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=(*RUNNERS, "all"), default="all")
    parser.add_argument("--skin", type=float, default=1.0, help="ShardedCalculator skin in Å")
    parser.add_argument(
        "--soak-steps", type=int, default=10_000, help="MD steps of the nve-soak case"
    )
    parser.add_argument(
        "--distributed",
        action="store_true",
        help="nve-soak on DistributedAtoms (each rank holds its own atoms)",
    )
    args = parser.parse_args()
    RUNNERS["nve-soak"] = partial(
        case_nve_soak, steps=args.soak_steps, distributed=args.distributed
    )
    if COMM.is_root:
        print(f"ase_shard {ase_shard.__version__}, {COMM.size} MPI rank(s)", flush=True)
    table = Table()
    for name in RUNNERS if args.case == "all" else (args.case,):
        start = time.perf_counter()
        RUNNERS[name](table, args.skin)
        table.add(name, "wall time of the case (s)", f"{time.perf_counter() - start:.1f}")
    table.print()
    sys.exit(1 if table.failed else 0)


if __name__ == "__main__":
    main()
