"""Long-range terms under mpirun: NVE energy drift, and step cost against the machine's ceiling.

    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
    mpirun --oversubscribe -n 2 .venv/bin/python scripts/long_range_md.py --case all

Cases (``--case``):

- ``nve-coulomb``: 216-atom rocksalt NaCl (formal charges), a Lennard-Jones wall +
  ``Coulomb(method="ewald")``, VelocityVerlet, 1 fs, 1,000 steps from 600 K: the
  largest ``|E - E0|`` per atom.
- ``nve-d3``: 108-atom Cu, EMT + D3(PBE, BJ, three-body; cutoffs ``--d3-cutoffs``,
  9.7 / 7.9 / 5.3 Å by default), VelocityVerlet, 1 fs, 1,000 steps from 300 K.
- ``cost``: time of one energy + forces + stress evaluation (median of ``--repeats``
  after a warm-up; positions moved a little each time, the decomposition reused) on
  rank 0 alone and on all ranks, for EMT, D3 and EMT + D3 on 864 Cu, for Ewald and
  PME on 512-atom NaCl and PME with a 10 Å cutoff on 4,096-atom NaCl, each with its
  speed-up and the machine's ceiling sampled in the same run
  (``ase_shard.bench.machine.Ceiling``), ``--rounds`` times over the cases in turn (a
  case's speed-up is the median of its rounds'); ``--mlip 7net-0`` adds that SevenNet
  model with and without D3 on 256 Cu.
- ``d3-cost``: D3's compiled kernel beside EMT (docs/models.md, "D3"): EMT, D3 (BJ, ATM,
  the tests' 9.7 / 7.9 / 5.3 Å) and EMT + D3 on ``4 * --cu-repeat**3`` fcc Cu (32,000
  by default) timed as in ``cost``; then on rank 0, 108 Cu: D3 by its kernel, by its
  torch model (autograd, which the full halo takes) and ``dftd3.ase.DFTD3``, at the
  tests' cutoffs and at s-dftd3's defaults without the ATM term, with the edges per
  atom within the largest cutoff. Not part of ``all`` (minutes, and 32,000 atoms).

Rank 0 prints a Markdown table; ``--json`` writes the numbers.
"""


# isort: split

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from ase import Atoms, units
from ase.build import bulk
from ase.md.velocitydistribution import Stationary, thermalize_momenta
from ase.md.verlet import VelocityVerlet

from ase_shard import ShardedCalculator
from ase_shard.bench.machine import Ceiling, on_root
from ase_shard.comm import Comm
from ase_shard.models import D3, EMT, Coulomb, LennardJones

COMM = Comm()
# Å and eV: a repulsive wall for NaCl (sigma ~ the Na-Cl contact), as in the tests
REPULSION = {"epsilon": 0.05, "sigma": 2.6, "rc": 6.0}
D3_CUTOFFS = {"cutoff": 9.7, "cn_cutoff": 7.9, "atm_cutoff": 5.3}


def nacl(repeat: int) -> Atoms:
    atoms = bulk("NaCl", "rocksalt", a=5.64, cubic=True).repeat(repeat)
    atoms.set_initial_charges(np.where(atoms.numbers == 11, 1.0, -1.0))
    return atoms


def copper(repeat: int) -> Atoms:
    return bulk("Cu", "fcc", a=3.6, cubic=True).repeat(repeat)


def nve(atoms: Atoms, model, temperature_k: float, steps: int) -> dict:
    """VelocityVerlet from ``temperature_k`` (seeded): drift and time per step."""
    thermalize_momenta(atoms, temperature_K=temperature_k, rng=np.random.default_rng(1))
    Stationary(atoms)
    atoms.calc = ShardedCalculator(model)
    dynamics = VelocityVerlet(atoms, timestep=1.0 * units.fs)
    energies = []
    dynamics.attach(lambda: energies.append(atoms.get_total_energy()), interval=10)
    start = time.perf_counter()
    dynamics.run(steps)
    elapsed = time.perf_counter() - start
    energies = np.array(energies)
    # the trend: a straight line through E(t), over the run
    slope = np.polyfit(np.arange(len(energies)), energies, 1)[0]
    return {
        "atoms": len(atoms),
        "steps": steps,
        "fitted_drift_eV_per_atom": float(slope * (len(energies) - 1) / len(atoms)),
        "max_drift_eV_per_atom": float(np.abs(energies - energies[0]).max() / len(atoms)),
        "end_drift_eV_per_atom": float((energies[-1] - energies[0]) / len(atoms)),
        "s_per_step": elapsed / steps,
        "rebuilds": atoms.calc.rebuilds,
    }


def step_time(atoms: Atoms, model, repeats: int, comm=None, **options) -> float:
    """Median seconds of an energy + forces + stress evaluation (after a warm-up)."""
    return evaluation_time(atoms, ShardedCalculator(model, comm=comm, **options), repeats)


def evaluation_time(atoms: Atoms, calc, repeats: int) -> float:
    """:func:`step_time` of any ASE calculator."""
    atoms = atoms.copy()
    atoms.calc = calc
    rng = np.random.default_rng(0)
    times = []
    for k in range(repeats + 1):
        atoms.positions += rng.normal(scale=0.002, size=atoms.positions.shape)
        start = time.perf_counter()
        atoms.get_forces()
        atoms.get_stress()
        if k:
            times.append(time.perf_counter() - start)
    return float(np.median(times))


def serial_comm():
    """The communicator of rank 0 alone under mpirun (``None`` in one process)."""
    if COMM.size == 1:
        return None
    from mpi4py import MPI

    return MPI.COMM_SELF


def cost(repeats: int, rounds: int, mlip: str | None) -> list[dict]:
    """Each model's step time on rank 0 alone and on all ranks, with the ceiling."""
    cases: list[tuple[str, Atoms, Callable[[], object]]] = [
        ("EMT", copper(6), EMT),
        ("D3 (BJ, ATM)", copper(6), lambda: D3(**D3_CUTOFFS)),
        ("EMT + D3", copper(6), lambda: EMT() + D3(**D3_CUTOFFS)),
        ("Ewald", nacl(4), lambda: Coulomb(method="ewald")),
        ("PME", nacl(4), lambda: Coulomb(method="pme")),
        # the real-space sum's share as a run would tune it: a longer cutoff, the
        # same 128^3 mesh for eight times the atoms
        ("PME, 10 Å cutoff", nacl(8), lambda: Coulomb(method="pme", cutoff=10.0)),
    ]
    if mlip:
        from ase_shard.models import SevenNet

        cases += [
            (mlip, copper(4), lambda: SevenNet(mlip)),
            (f"{mlip} + D3", copper(4), lambda: SevenNet(mlip) + D3(**D3_CUTOFFS)),
        ]
    return scaling(cases, repeats, rounds)


def scaling(
    cases: list[tuple[str, Atoms, Callable[[], object]]], repeats: int, rounds: int = 1
) -> list[dict]:
    """Each case's step time on rank 0 alone and on all ranks, with the ceiling.

    ``rounds`` times over all cases in turn, the ceiling sampled after each case; a
    case's speed-up is the median over rounds of its one-rank time over its all-ranks
    time in that round (this VM's speed drifts within minutes), its times the medians.
    """
    serial = serial_comm()
    ceiling = Ceiling(COMM, seconds=1.0)
    rows = [
        {"model": name, "atoms": len(atoms), "rounds_one_rank_s": [], "rounds_ranks_s": []}
        for name, atoms, _ in cases
    ]
    for _ in range(rounds):
        for row, (_, atoms, make) in zip(rows, cases, strict=True):

            def alone(atoms: Atoms = atoms, make: Callable[[], object] = make) -> float:
                """The one-rank time, its model built on rank 0 alone."""
                return step_time(atoms, make(), repeats, serial)

            one = COMM.bcast(on_root(COMM, alone))
            # in one process the one-rank time is the all-ranks time
            every = one if COMM.size == 1 else step_time(atoms, make(), repeats)
            ceiling.sample()
            row["rounds_one_rank_s"].append(one)
            row["rounds_ranks_s"].append(every)
    limit = ceiling.result()["speedup"]
    for row in rows:
        one, every = np.array(row["rounds_one_rank_s"]), np.array(row["rounds_ranks_s"])
        row["one_rank_s"] = float(np.median(one))
        row["ranks_s"] = float(np.median(every))
        row["rounds_speedup"] = (one / every).tolist()
        row["speedup"] = float(np.median(one / every))
        row["ceiling"] = limit
    return rows


def d3_cost(repeats: int, cu_repeat: int) -> dict:
    """D3's kernel beside EMT on large Cu, and against autograd and dftd3 on 108 Cu."""
    cases: list[tuple[str, Atoms, Callable[[], object]]] = [
        ("EMT", copper(cu_repeat), EMT),
        ("D3 (BJ, ATM)", copper(cu_repeat), lambda: D3(**D3_CUTOFFS)),
        ("EMT + D3", copper(cu_repeat), lambda: EMT() + D3(**D3_CUTOFFS)),
    ]
    return {"scaling": scaling(cases, repeats), "small": on_root(COMM, lambda: d3_small(repeats))}


def d3_small(repeats: int) -> list[dict]:
    """108 Cu: D3 by its kernel, by autograd (the full halo) and by ``dftd3``, one rank."""
    from ase.neighborlist import neighbor_list
    from dftd3.ase import DFTD3

    atoms = copper(3)
    names = {"cutoff": "disp2", "cn_cutoff": "cn", "atm_cutoff": "disp3"}
    rows = []
    for label, cutoffs, atm in (("tests'", D3_CUTOFFS, True), ("default", {}, False)):
        model = D3(atm=atm, **cutoffs)
        reference = DFTD3(
            method="pbe",
            damping="d3bj",
            params_tweaks={"method": "pbe", "atm": atm},
            realspace_cutoff={names[key]: value for key, value in cutoffs.items()},
        )
        edges = len(neighbor_list("i", atoms, model.cutoff))
        rows.append(
            {
                "cutoffs": label,
                "atm": atm,
                "atoms": len(atoms),
                "edges_per_atom": edges / len(atoms),
                "kernel_s": step_time(atoms, model, repeats, serial_comm()),
                "autograd_s": step_time(atoms, model, repeats, serial_comm(), halo="full"),
                "dftd3_s": evaluation_time(atoms, reference, repeats),
            }
        )
    return rows


def print_scaling(rows: list[dict]) -> None:
    """The Markdown table of :func:`scaling`'s rows."""
    print(
        f"\n| model | atoms | 1 rank (ms) | {COMM.size} ranks (ms) | speed-up | ceiling | "
        "speed-up / ceiling |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['model']} | {row['atoms']} | {row['one_rank_s'] * 1e3:.1f} | "
            f"{row['ranks_s'] * 1e3:.1f} | {row['speedup']:.2f} | {row['ceiling']:.2f} | "
            f"{row['speedup'] / row['ceiling']:.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--case", choices=("nve-coulomb", "nve-d3", "cost", "d3-cost", "all"), default="all"
    )
    parser.add_argument("--cu-repeat", type=int, default=20, help="d3-cost: fcc Cu cells")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--rounds", type=int, default=3, help="cost: times over the cases, in turns"
    )
    parser.add_argument("--mlip", help="also time this model with and without D3 (e.g. 7net-0)")
    parser.add_argument(
        "--d3-cutoffs",
        nargs=3,
        type=float,
        metavar=("PAIR", "CN", "ATM"),
        default=[D3_CUTOFFS[key] for key in ("cutoff", "cn_cutoff", "atm_cutoff")],
        help="Å: D3's cutoffs in nve-d3 (default 9.7 7.9 5.3)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    report: dict = {"ranks": COMM.size}
    if args.case in ("nve-coulomb", "all"):
        model = LennardJones(**REPULSION) + Coulomb(method="ewald")
        report["nve-coulomb"] = nve(nacl(3), model, 600.0, args.steps)
    if args.case in ("nve-d3", "all"):
        cutoffs = dict(zip(("cutoff", "cn_cutoff", "atm_cutoff"), args.d3_cutoffs, strict=True))
        report["nve-d3"] = nve(copper(3), EMT() + D3(**cutoffs), 300.0, args.steps)
        report["nve-d3"]["d3_cutoffs_A"] = args.d3_cutoffs
    if args.case in ("cost", "all"):
        report["cost"] = cost(args.repeats, args.rounds, args.mlip)
    if args.case == "d3-cost":
        report["d3-cost"] = d3_cost(args.repeats, args.cu_repeat)
    if not COMM.is_root:
        return
    for case in ("nve-coulomb", "nve-d3"):
        if case in report:
            run = report[case]
            print(
                f"{case}: {run['atoms']} atoms, {run['steps']} steps of 1 fs on {COMM.size} "
                f"rank(s): drift (fitted line) {run['fitted_drift_eV_per_atom']:+.2e} eV/atom, "
                f"end {run['end_drift_eV_per_atom']:+.2e}, max |E - E0| "
                f"{run['max_drift_eV_per_atom']:.2e} eV/atom, {run['s_per_step'] * 1e3:.1f} "
                f"ms/step, {run['rebuilds']} rebuilds"
            )
    if "cost" in report:
        print_scaling(report["cost"])
    if "d3-cost" in report:
        print_scaling(report["d3-cost"]["scaling"])
        print(
            "\n| 108 Cu | ATM | edges per atom | kernel (ms) | autograd (ms) | dftd3 (ms) |"
            "\n|---|---|---|---|---|---|"
        )
        for row in report["d3-cost"]["small"]:
            print(
                f"| {row['cutoffs']} cutoffs | {'yes' if row['atm'] else 'no'} | "
                f"{row['edges_per_atom']:,.0f} | {row['kernel_s'] * 1e3:.1f} | "
                f"{row['autograd_s'] * 1e3:.1f} | {row['dftd3_s'] * 1e3:.1f} |"
            )
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    sys.exit(main())
