"""NVE molecular dynamics of fcc copper with EMT, one system spread over MPI ranks.

    python examples/md_cu.py                    # one rank
    mpirun -n 2 python examples/md_cu.py        # two ranks, same numbers to round-off

Set OMP_NUM_THREADS=1 (as `make demo` does) when ranks share a small machine: torch's
own threads otherwise compete with the other ranks and with each other.

Every rank runs this same script on the same Atoms; ShardedCalculator splits
the work and hands identical results back to every rank, so ASE's
VelocityVerlet needs no changes. Only rank 0 prints.

The crystal starts on perfect lattice sites with Maxwell-Boltzmann velocities
at --temperature; about half of that kinetic energy flows into potential
energy within the first ~100 fs (equipartition), so the temperature settles
near half the starting value. The total energy must stay constant: the final
drift line measures how well it does.
"""

import ase_shard  # first: sets up MPI before ASE fixes ase.parallel.world

# isort: split

import argparse
import time

import numpy as np
from ase import units
from ase.build import bulk
from ase.md.verlet import VelocityVerlet
from ase.parallel import parprint, world

from ase_shard import ShardedCalculator
from ase_shard.md import set_temperature, thermalise
from ase_shard.models import EMT


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--size", type=int, default=9, help="repeat the 4-atom cubic cell N x N x N (default 9)"
    )
    parser.add_argument("--steps", type=int, default=200, help="MD steps of 2 fs (default 200)")
    parser.add_argument(
        "--temperature", type=float, default=300.0, help="initial temperature in K (default 300)"
    )
    parser.add_argument("--seed", type=int, default=42, help="velocity random seed")
    parser.add_argument(
        "--print-every", type=int, default=None, help="steps between lines (default steps/10)"
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(args.size)
    # Every rank must hold the same Atoms: seed the velocities identically. Maxwell-
    # Boltzmann momenta without centre-of-mass drift (as `ase-shard md` draws them),
    # scaled to exactly --temperature (the draw hits it only on average)
    thermalise(atoms, args.temperature, np.random.default_rng(args.seed))
    set_temperature(atoms, args.temperature)

    calc = ShardedCalculator(EMT())
    atoms.calc = calc
    n = len(atoms)
    every = args.print_every or max(1, args.steps // 10)
    timestep = 2.0 * units.fs

    parprint(
        f"ase_shard {ase_shard.__version__}: NVE MD of fcc Cu, {n} atoms on {world.size} "
        f"MPI rank(s), model {type(calc.model).__name__}, device {calc.device}, "
        f"{str(calc.dtype).replace('torch.', '')}"
    )
    parprint(f"{args.steps} steps of 2 fs, T0 = {args.temperature:g} K, seed {args.seed}")
    parprint(
        f"{'step':>6} {'time/fs':>8} {'Epot/eV':>11} {'Ekin/eV':>10} {'Etot/eV':>11} "
        f"{'T/K':>7}   (energies per atom)"
    )

    dyn = VelocityVerlet(atoms, timestep=timestep)
    totals = []

    def report() -> None:
        epot = atoms.get_potential_energy() / n
        ekin = atoms.get_kinetic_energy() / n
        totals.append(epot + ekin)
        parprint(
            f"{dyn.nsteps:6d} {dyn.nsteps * 2.0:8.1f} {epot:11.6f} {ekin:10.6f} "
            f"{epot + ekin:11.6f} {atoms.get_temperature():7.1f}"
        )

    dyn.attach(report, interval=every)
    start = time.perf_counter()
    dyn.run(args.steps)
    elapsed = time.perf_counter() - start
    if dyn.nsteps % every:
        report()  # always end on the last step

    drift = totals[-1] - totals[0]
    spread = max(totals) - min(totals)
    parprint(
        f"energy drift: {drift:+.2e} eV/atom over {args.steps * 2.0:g} fs "
        f"(max - min of Etot: {spread:.2e} eV/atom)"
    )
    parprint(
        f"performance: {args.steps / elapsed:.2f} steps/s, {elapsed:.1f} s wall, "
        f"{world.size} rank(s), {calc.rebuilds} decomposition rebuild(s)"
    )


if __name__ == "__main__":
    main()
