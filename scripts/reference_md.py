"""NVE from a trajectory's first frame with a model's own ASE calculator, in one process.

The other half of an ``ase-shard md`` acceptance figure: ``ase-shard md`` under mpirun
writes a trajectory whose first frame holds the starting positions and momenta; this
replays that start with the package's own calculator (no ase_shard in the force path)
and prints the same per-step columns and total-energy drift as ``ase-shard md``'s
summary, so the two drifts (and the first energies) can be read side by side::

    mpirun -n 2 .venv/bin/ase-shard md --system cu-bulk --size 7 --model chgnet \\
        --ensemble nve --steps 100 --timestep 1 --temperature 300 --seed 1 \\
        --trajectory md.extxyz --interval 10
    .venv/bin/python scripts/reference_md.py md.extxyz --calculator chgnet \\
        --steps 100 --timestep 1 --interval 10

``--calculator``: ``chgnet`` (CHGNet 0.3.0 as shipped in the chgnet wheel,
``CHGNetCalculator``; float32 as ``ase-shard md``'s default) or ``emt`` (ASE's EMT).
Energies in eV per atom, time in ps, temperatures in K.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from ase import units
from ase.calculators.calculator import Calculator
from ase.io import read
from ase.md.verlet import VelocityVerlet


def own_calculator(name: str) -> Calculator:
    """The package's own ASE calculator for ``name``."""
    if name == "chgnet":
        from chgnet.model import CHGNet, CHGNetCalculator

        return CHGNetCalculator(CHGNet.load(model_name="0.3.0"), use_device="cpu")
    from ase.calculators.emt import EMT

    return EMT()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trajectory", help="a trajectory written by ase-shard md")
    parser.add_argument("--calculator", choices=("chgnet", "emt"), required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--timestep", type=float, required=True, help="fs")
    parser.add_argument("--interval", type=int, default=10, help="steps between lines")
    args = parser.parse_args()

    atoms = read(args.trajectory, 0)  # positions and momenta at step 0
    atoms.calc = own_calculator(args.calculator)
    n = len(atoms)
    totals: list[float] = []
    print("# step  time[ps]  Etot/N[eV]  Epot/N[eV]  Ekin/N[eV]      T[K]")

    dynamics = VelocityVerlet(atoms, timestep=args.timestep * units.fs)

    def record() -> None:  # ASE calls it at step 0 too
        epot, ekin = atoms.get_potential_energy() / n, atoms.get_kinetic_energy() / n
        totals.append(epot + ekin)
        if dynamics.nsteps % args.interval == 0:
            print(
                f"{dynamics.nsteps:6d} {dynamics.nsteps * args.timestep / 1000:9.4f} "
                f"{epot + ekin:11.6f} {epot:11.6f} {ekin:11.6f} {atoms.get_temperature():9.2f}",
                flush=True,
            )

    dynamics.attach(record, interval=1)
    start = time.perf_counter()
    dynamics.run(args.steps)
    wall = time.perf_counter() - start
    drift = np.abs(np.array(totals) - totals[0]).max()
    print(
        f"{args.calculator} in one process: {n} atoms, {args.steps} steps in {wall:.1f} s "
        f"({args.steps / wall:.3f} steps/s)\n"
        f"  Etot drift     max |Etot - Etot0| = {drift:.3e} eV/atom, "
        f"final - initial = {totals[-1] - totals[0]:+.3e} eV/atom"
    )


if __name__ == "__main__":
    main()
