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
waiting for other ranks does not count).

On more than one rank, rank 0 also runs the same system alone (its own copy, on
``MPI.COMM_SELF``) while the other ranks wait asleep, taking turns with the
distributed run step by step: the per-rank cost ratios (``*_over_one_rank``) are
medians of per-step ratios measured in the same minutes, so the host's changing load
cancels. Two ceilings are sampled after every pair of steps: the same single-thread work split
over the ranks (:class:`ase_shard.bench.machine.Ceiling`, in cache) and the same memory-bound
numpy passes split over them (:class:`MemoryCeiling`).

Memory per rank: the resident size after start-up (imports, model, a small warm-up
calculation: the fixed per-process part) and the peak after the first call and one
warm-up step of each kind, before rank 0's one-rank copy exists; compare it with a
separate ``-n 1`` run. With ``--steps`` the run is plain MD for that many steps
instead, optionally writing ``--trajectory`` every ``--interval`` steps through
:class:`ase_shard.io.Trajectory`.
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
from ase_shard.bench.machine import Ceiling, rss_mb
from ase_shard.comm import Comm
from ase_shard.distributed import distribute
from ase_shard.models import EMT, LennardJones
from ase_shard.random_models import no_edge_model

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


class _Run:
    """``VelocityVerlet`` on distributed atoms, timed one step at a time."""

    def __init__(self, atoms, model: str, comm: Comm):
        self.comm = comm
        self.atoms = atoms
        self.calc = atoms.calc = ShardedCalculator(MODELS[model][0](), comm=comm.mpi)
        self.dyn = VelocityVerlet(atoms, timestep=1.0 * units.fs)

    def step(self, kind: str) -> tuple[float, float]:
        """This rank's wall and CPU seconds (MPI excluded) of one step of ``kind``."""
        if kind == "rebuild":
            self.calc.request_rebuild()
        wall, cpu, mpi = time.perf_counter(), time.process_time(), self._mpi_cpu()
        self.dyn.run(1)
        return time.perf_counter() - wall, time.process_time() - cpu - (self._mpi_cpu() - mpi)

    def _mpi_cpu(self) -> float:
        return self.calc.comm.mpi_cpu + self.atoms.comm.mpi_cpu


class MemoryCeiling:
    """The machine's speed-up limit for memory-bound work on ``comm.size`` ranks.

    :class:`ase_shard.bench.machine.Ceiling` runs work that stays in a core's cache. An
    MD step on a million atoms is mostly numpy passes over arrays larger than
    the caches, and both ranks then share the memory bus. Here the same passes
    (as an integrator's: temporaries, products, a comparison, a copy) run over
    ``(n_atoms, 3)`` float64 arrays on rank 0 alone while the other ranks wait,
    then over ``n_atoms / size`` rows on every rank from a common start.
    ``speedup`` is the median over samples of alone time / split time.
    """

    def __init__(self, comm: Comm, n_atoms: int):
        self.comm, self.n_atoms = comm, n_atoms
        self.ratios: list[float] = []

    @staticmethod
    def _passes(rows: int) -> float:
        a, b = np.full((rows, 3), 0.5), np.full((rows, 3), 0.25)
        for repeats in (1, 5):  # the first, untimed, faults the temporaries' pages in
            start = time.perf_counter()
            for _ in range(repeats):
                c = a + 0.5 * b
                c *= 2.0
                bool((c != a).any())
                a = c.copy()
        return time.perf_counter() - start

    def sample(self) -> None:
        comm = self.comm
        alone = self._passes(self.n_atoms) if comm.is_root else 0.0
        comm.rendezvous(None, "finish rank 0's memory-bound run")
        split = max(comm.allgather(self._passes(self.n_atoms // comm.size)))
        self.ratios.append(comm.bcast(alone) / split)

    def speedup(self) -> float:
        return float(np.median(self.ratios))


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

    # the fixed per-process part: imports, a model, a small calculation (compiles)
    warm = distribute(_system(args.model, 2) if comm.is_root else None)
    warm.calc = ShardedCalculator(MODELS[args.model][0]())
    warm.get_forces()
    del warm
    fixed_mb = rss_mb()

    run = _Run(
        distribute(_system(args.model, args.size) if comm.is_root else None), args.model, comm
    )
    start = time.perf_counter()
    run.atoms.get_forces()  # the first rebuild: domains cut, atoms migrate from their blocks
    first_s = max(comm.allgather(time.perf_counter() - start))
    figures = {
        "ranks": comm.size,
        "atoms": run.atoms.get_global_number_of_atoms(),
        "model": args.model,
        "first_call_s": first_s,
    }

    if args.steps:
        trajectory = None
        if args.trajectory:
            from ase_shard.io import Trajectory

            trajectory = Trajectory(args.trajectory, "w", run.atoms)
            run.dyn.attach(trajectory.write, interval=args.interval)
        start = time.perf_counter()
        run.dyn.run(args.steps)
        figures["md_wall_s"] = max(comm.allgather(time.perf_counter() - start))
        figures["steps"] = args.steps
        if trajectory is not None:
            trajectory.close()
        peak_mb = _peak_mb()
    else:
        for kind in ("rebuild", "reuse"):
            run.step(kind)
        peak_mb = _peak_mb()
        figures.update(_timed(run, args, comm))
    figures["rebuilds"] = run.calc.rebuilds
    figures["owned_per_rank"] = comm.allgather(len(run.atoms))
    figures["fixed_rss_mb_per_rank"] = comm.allgather(fixed_mb)
    figures["peak_rss_mb_per_rank"] = comm.allgather(peak_mb)
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


def _timed(run: _Run, args: argparse.Namespace, comm: Comm) -> dict:
    """The timed steps, each followed on more than one rank by the same step on rank 0 alone."""
    one_rank = None
    if comm.size > 1 and comm.is_root:
        from mpi4py import MPI

        alone = Comm(MPI.COMM_SELF)
        one_rank = _Run(
            distribute(_system(args.model, args.size), comm=alone.mpi), args.model, alone
        )
        one_rank.atoms.get_forces()
        for kind in ("rebuild", "reuse"):
            one_rank.step(kind)
    ceiling = Ceiling(comm, 0.3)
    memory_ceiling = MemoryCeiling(comm, run.atoms.get_global_number_of_atoms())
    figures = {}
    for kind, count in (("reuse", args.reuse_steps), ("rebuild", args.rebuild_steps)):
        walls, cpus, alone_walls, alone_cpus = [], [], [], []
        for _ in range(count):
            comm.allgather(None)
            wall, cpu = run.step(kind)
            walls.append(max(comm.allgather(wall)))
            cpus.append(comm.allgather(cpu))
            if comm.size > 1:
                # the other ranks sleep meanwhile (sleeping polls, see Comm.rendezvous)
                alone = one_rank.step(kind) if one_rank is not None else (np.nan, np.nan)
                comm.rendezvous(None, "finish rank 0's one-rank step")
                alone_walls.append(comm.bcast(alone[0]))
                alone_cpus.append(comm.bcast(alone[1]))
            ceiling.sample()
            memory_ceiling.sample()
        figures[f"{kind}_wall_s"] = float(np.median(walls))
        figures[f"{kind}_cpu_s_per_rank"] = np.median(cpus, axis=0).tolist()
        if comm.size > 1:
            walls, cpus = np.array(walls), np.array(cpus)
            figures[f"{kind}_one_rank_wall_s"] = float(np.median(alone_walls))
            figures[f"{kind}_one_rank_cpu_s"] = float(np.median(alone_cpus))
            figures[f"{kind}_wall_over_one_rank"] = float(np.median(walls / alone_walls))
            figures[f"{kind}_cpu_over_one_rank_per_rank"] = np.median(
                cpus / np.array(alone_cpus)[:, None], axis=0
            ).tolist()
    figures["ceiling"] = ceiling.result()["speedup"]
    figures["memory_bound_ceiling"] = memory_ceiling.speedup()
    return figures


if __name__ == "__main__":
    main()
