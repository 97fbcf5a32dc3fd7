"""Per-rank cost and memory of MD on DistributedAtoms (issue 16's scaling figures).

    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
    mpirun -n 1 .venv/bin/python scripts/distributed_bench.py --size 63 --json p1.json
    mpirun -n 2 .venv/bin/python scripts/distributed_bench.py --size 63 --json p2.json
    mpirun --oversubscribe -n 4 .venv/bin/python scripts/distributed_bench.py \\
        --model lj --size 79 --steps 20 --trajectory /tmp/ar.traj --interval 10

Rank 0 builds fcc Cu (``--model no-edge`` or ``emt``) or fcc argon (``lj``, rc 8.5 Å)
of ``4 * size**3`` atoms with 300 K momenta, :func:`ase_shard.distributed.distribute`
spreads it, and ASE's ``VelocityVerlet`` runs on each rank's own atoms. Reuse steps
and rebuild steps (a rebuild forced with ``request_rebuild``: domains re-cut, atoms
migrate, ghosts found again) are timed one by one: wall time of the slowest rank, and
each rank's CPU time with the time inside MPI calls excluded (``Comm.mpi_cpu``, so
waiting for other ranks does not count). Memory per rank: the resident size after
start-up (imports, model, a small warm-up calculation: the fixed per-process part)
and the peak over the run. With ``--steps`` the run is plain MD for that many steps
instead, optionally writing ``--trajectory`` every ``--interval`` steps through
:class:`ase_shard.io.Trajectory`. The ceiling (the same single-thread work split over
the ranks, :class:`ase_shard.bench.Ceiling`) is sampled after every timed step.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import numpy as np
from ase import units
from ase.build import bulk
from ase.md.velocitydistribution import Stationary, thermalize_momenta
from ase.md.verlet import VelocityVerlet
from ase.parallel import DummyMPI

from ase_shard import ShardedCalculator
from ase_shard.bench import Ceiling, _rss_mb, no_edge_model
from ase_shard.comm import Comm
from ase_shard.distributed import distribute
from ase_shard.models import EMT, LennardJones

MODELS = {
    "no-edge": (no_edge_model, "Cu", 3.61),
    "emt": (EMT, "Cu", 3.61),
    "lj": (lambda: LennardJones(sigma=3.4, epsilon=0.0104, rc=8.5), "Ar", 5.26),
}


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _system(model: str, size: int, seed: int = 1):
    _, symbol, a = MODELS[model]
    atoms = bulk(symbol, "fcc", a=a, cubic=True).repeat(size)
    # on rank 0 alone: ASE would broadcast the momenta from rank 0 over every rank
    thermalize_momenta(
        atoms, temperature_K=300.0, rng=np.random.default_rng(seed), comm=DummyMPI()
    )
    Stationary(atoms)
    return atoms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="no-edge")
    parser.add_argument("--size", type=int, default=63, help="4 size^3 atoms (63: 1,000,188)")
    parser.add_argument("--reuse-steps", type=int, default=8)
    parser.add_argument("--rebuild-steps", type=int, default=3)
    parser.add_argument("--steps", type=int, help="plain MD steps instead of the timed ones")
    parser.add_argument("--trajectory", help="with --steps: write frames here")
    parser.add_argument("--interval", type=int, default=10, help="steps between frames")
    parser.add_argument("--json", help="write the figures here (rank 0)")
    args = parser.parse_args()
    comm = Comm()
    make_model = MODELS[args.model][0]

    # the fixed per-process part: imports, a model, a small calculation (compiles)
    warm = distribute(_system(args.model, 2) if comm.is_root else None)
    warm.calc = ShardedCalculator(make_model())
    warm.get_forces()
    del warm
    fixed_mb = _rss_mb()

    atoms = distribute(_system(args.model, args.size) if comm.is_root else None)
    calc = atoms.calc = ShardedCalculator(make_model())
    dyn = VelocityVerlet(atoms, timestep=1.0 * units.fs)
    start = time.perf_counter()
    atoms.get_forces()  # the first rebuild: domains cut, atoms migrate from their blocks
    first_s = max(comm.allgather(time.perf_counter() - start))
    figures = {"ranks": comm.size, "atoms": atoms.get_global_number_of_atoms(),
               "model": args.model, "first_call_s": first_s}

    def mpi_cpu() -> float:
        return calc.comm.mpi_cpu + atoms.comm.mpi_cpu

    if args.steps:
        trajectory = None
        if args.trajectory:
            from ase_shard.io import Trajectory

            trajectory = Trajectory(args.trajectory, "w", atoms)
            dyn.attach(trajectory.write, interval=args.interval)
        start = time.perf_counter()
        dyn.run(args.steps)
        figures["md_wall_s"] = max(comm.allgather(time.perf_counter() - start))
        figures["steps"] = args.steps
        if trajectory is not None:
            trajectory.close()
    else:
        ceiling = Ceiling(comm, 0.3)
        for kind, count in (("reuse", args.reuse_steps), ("rebuild", args.rebuild_steps)):
            walls, cpus = [], []
            for _ in range(count):
                if kind == "rebuild":
                    calc.request_rebuild()
                comm.allgather(None)
                wall, cpu, mpi = time.perf_counter(), time.process_time(), mpi_cpu()
                dyn.run(1)
                cpu = time.process_time() - cpu - (mpi_cpu() - mpi)
                walls.append(max(comm.allgather(time.perf_counter() - wall)))
                cpus.append(comm.allgather(cpu))
                ceiling.sample()
            figures[f"{kind}_wall_s"] = float(np.median(walls))
            figures[f"{kind}_cpu_s_per_rank"] = np.median(cpus, axis=0).tolist()
        figures["ceiling"] = ceiling.result()["speedup"]
    figures["rebuilds"] = calc.rebuilds
    figures["owned_per_rank"] = comm.allgather(len(atoms))
    figures["fixed_rss_mb_per_rank"] = comm.allgather(fixed_mb)
    figures["peak_rss_mb_per_rank"] = comm.allgather(_peak_mb())
    figures["beyond_fixed_mb_per_rank"] = [
        peak - fixed
        for peak, fixed in zip(
            figures["peak_rss_mb_per_rank"], figures["fixed_rss_mb_per_rank"], strict=True
        )
    ]
    if comm.is_root:
        print(json.dumps(figures, indent=1))
        if args.json:
            with open(args.json, "w") as out:
                json.dump(figures, out, indent=1)


if __name__ == "__main__":
    main()
