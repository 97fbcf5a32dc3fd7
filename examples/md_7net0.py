"""MD of a C60 molecule with the pretrained SevenNet 7net-0, on any number of ranks.

    mpirun -n 2 python examples/md_7net0.py
    mpirun -n 2 python examples/md_7net0.py --d3 pbe    # 7net-0 + D3(BJ) dispersion

7net-0 ships inside the ``sevenn`` wheel, so this runs offline
(in the clone: ``pip install -e ".[sevenn]"``). A molecule has no periodic images, so the
halo of this 5-layer model (25 Å) costs nothing beyond the molecule itself. ``--d3``
adds Grimme's D3(BJ) with the three-body term (``pip install -e ".[d3]"``): 7net-0 was
fitted to PBE without dispersion; the sum keeps each term's own cutoff.
"""

from __future__ import annotations

import argparse
import time

import ase_shard  # first: sets up MPI before ASE fixes ase.parallel.world

# isort: split

import numpy as np
from ase.build import molecule
from ase.md.verlet import VelocityVerlet
from ase.parallel import parprint
from ase.units import fs

from ase_shard.md import set_temperature, thermalise
from ase_shard.models import D3, SevenNet


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--temperature", type=float, default=300.0, help="K")
    parser.add_argument("--d3", metavar="METHOD", help="add D3(BJ) of this functional")
    args = parser.parse_args()

    atoms = molecule("C60")
    sevennet = SevenNet("7net-0")
    dispersion = None if args.d3 is None else D3(method=args.d3)
    calc = ase_shard.ShardedCalculator(sevennet if dispersion is None else sevennet + dispersion)
    atoms.calc = calc
    # Maxwell-Boltzmann momenta without drift or spin (as `ase-shard md` draws them),
    # scaled to exactly --temperature: the draw hits it only on average, and removing
    # the drift and spin takes kinetic energy away
    thermalise(atoms, args.temperature, np.random.default_rng(7))
    set_temperature(atoms, args.temperature)

    dyn = VelocityVerlet(atoms, timestep=1 * fs)
    e0 = atoms.get_total_energy()
    parprint(
        f"C60, 7net-0 (cutoff {sevennet.cutoff} Å, {sevennet.num_layers} layers)"
        f"{'' if dispersion is None else f' + D3(BJ) {args.d3}'}, {calc.comm.size} rank(s)"
    )
    parprint(f"{'step':>5} {'Epot (eV)':>12} {'Etot (eV)':>12} {'T (K)':>8}")

    def report() -> None:
        parprint(
            f"{dyn.nsteps:5d} {atoms.get_potential_energy():12.5f} "
            f"{atoms.get_total_energy():12.5f} {atoms.get_temperature():8.1f}"
        )

    dyn.attach(report, interval=5)
    start = time.perf_counter()
    dyn.run(args.steps)
    seconds = time.perf_counter() - start
    drift = (atoms.get_total_energy() - e0) / len(atoms)
    parprint(
        f"drift {drift:+.2e} eV/atom; {args.steps / seconds:.2f} steps/s; rebuilds {calc.rebuilds}"
    )


if __name__ == "__main__":
    main()
