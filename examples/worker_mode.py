"""Worker mode: rank 0 runs plain ASE, the other ranks only evaluate the model.

    mpirun -n 3 python examples/worker_mode.py

Every rank builds the calculator through ``ase_shard.serve``; ranks other
than 0 stay inside that call, serving, until rank 0 closes the calculator.
"""

from __future__ import annotations

import argparse

import numpy as np
from ase.build import bulk
from ase.md.velocitydistribution import thermalize_momenta
from ase.md.verlet import VelocityVerlet
from ase.optimize import BFGS
from ase.units import fs

import ase_shard
from ase_shard.models import EMT


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", type=int, default=4, help="repeats of the 4-atom Cu cell")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    calc = ase_shard.serve(EMT())
    if calc is None:
        return  # a serving rank: rank 0 has closed the calculator

    with calc:
        atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(args.size)
        atoms.rattle(0.05, seed=1)
        atoms.calc = calc
        # rank 0 alone runs ASE; its random numbers need no agreement with anyone
        BFGS(atoms, logfile=None).run(fmax=0.05, steps=10)
        thermalize_momenta(atoms, temperature_K=300, rng=np.random.default_rng(0))
        dyn = VelocityVerlet(atoms, timestep=2 * fs)
        e0 = atoms.get_total_energy()
        dyn.run(args.steps)
        drift = (atoms.get_total_energy() - e0) / len(atoms)
        print(
            f"ranks={calc.comm.size} atoms={len(atoms)} steps={args.steps} "
            f"energy={atoms.get_potential_energy():.6f} eV drift={drift:.2e} eV/atom "
            f"rebuilds={calc.rebuilds}"
        )


if __name__ == "__main__":
    main()
