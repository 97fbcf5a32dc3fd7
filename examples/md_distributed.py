"""Langevin MD of fcc copper with distributed atoms: each rank holds only the atoms it owns.

    mpirun -n 4 python examples/md_distributed.py             # 4 ranks
    python examples/md_distributed.py --size 4 --steps 20     # one rank

Rank 0 builds the crystal and `distribute` hands each rank a share; ShardedCalculator
moves atoms to the rank whose domain holds them inside the force call, so ASE's
integrator loop (here ase_shard.dynamics.Langevin) runs on each rank's own atoms. Kinetic
energy, temperature and the log are those of the whole system; the trajectory is
gathered to rank 0 every --write-every steps only. Set OMP_NUM_THREADS=1 when ranks
share a small machine.
"""

import ase_shard  # noqa: F401  (first: sets up MPI before ASE fixes ase.parallel.world)

# isort: split

import argparse

import numpy as np
from ase import units
from ase.build import bulk
from ase.md import MDLogger
from ase.md.velocitydistribution import Stationary, thermalize_momenta
from ase.parallel import DummyMPI, parprint

from ase_shard import ShardedCalculator, distribute
from ase_shard.comm import Comm
from ase_shard.dynamics import Langevin
from ase_shard.io import Trajectory
from ase_shard.models import EMT


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--size", type=int, default=10, help="repeat the 4-atom cubic cell N x N x N (default 10)"
    )
    parser.add_argument("--steps", type=int, default=100, help="MD steps of 2 fs (default 100)")
    parser.add_argument(
        "--temperature", type=float, default=300.0, help="bath temperature in K (default 300)"
    )
    parser.add_argument(
        "--write-every", type=int, default=10, help="steps between log lines and frames (10)"
    )
    parser.add_argument("--trajectory", default="md_distributed.traj", help="output file")
    parser.add_argument("--seed", type=int, default=42, help="random seed")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    whole = None
    comm = Comm()
    if comm.is_root:  # only rank 0 ever holds the whole system
        whole = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(args.size)
        # ASE broadcasts the velocities from rank 0 by default; here rank 0 is alone
        thermalize_momenta(
            whole,
            temperature_K=args.temperature,
            rng=np.random.default_rng(args.seed),
            comm=DummyMPI(),
        )
        Stationary(whole)
    atoms = distribute(whole)
    atoms.calc = ShardedCalculator(EMT())
    parprint(
        f"Langevin MD of {atoms.get_global_number_of_atoms()} Cu atoms (EMT), distributed "
        f"over {comm.size} MPI rank(s); {args.steps} steps of 2 fs at {args.temperature:g} K"
    )

    # each atom's noise is keyed by its id and the step (ase_shard.noise.AtomNoise):
    # the run is the same on any number of ranks
    dyn = Langevin(
        atoms,
        timestep=2 * units.fs,
        temperature_K=args.temperature,
        friction=0.01 / units.fs,
        fixcm=False,
        rng=np.random.default_rng(args.seed),
    )
    dyn.attach(MDLogger(dyn, atoms, "-", peratom=True), interval=args.write_every)
    with Trajectory(args.trajectory, "w", atoms) as trajectory:
        dyn.attach(trajectory.write, interval=args.write_every)
        dyn.run(args.steps)
        frames = len(trajectory)

    counts = comm.allgather(len(atoms))
    parprint(f"atoms per rank at the end: {counts} (total {sum(counts)})")
    parprint(f"{frames} frame(s) written to {args.trajectory}")


if __name__ == "__main__":
    main()
