"""Work per rank on heterogeneous systems, balanced by count and by work (issue 32).

Under ``mpirun -n P``: for each built-in heterogeneous system (``ar-interface``,
``cu-slab-gas``, ``cu-particle``, each with its default model) and each
``balance`` mode, the calculator evaluates the system, is told to rebuild (the
second build is the first that knows the atoms' edges) and evaluates again.
The work of each rank is then counted without the calculator: ASE's neighbour
list of the whole system at the model's cutoff, the pairs centred on the atoms
each rank owns (``calc.decomposition.owners``), as issue 32 counts it.

    OMP_NUM_THREADS=1 mpirun -n 4 python scripts/balance.py --json out.json

Distributed atoms (``--distributed``): the owners are the ranks holding each
global id after the second build.

``--time STEPS``: wall time instead, paired in one run. Two copies of one system
(default ``ar-interface`` at ``--size 19``: 27,436 liquid and 4,572 vapour atoms),
thermalised alike, each with its calculator (``count``, ``work``), take NVE
steps in turns, one each, every step timed between barriers; rebuilds happen
as the atoms move, in both. Prints each mode's median and mean step (the mean
includes the rebuilds) and their ratio, work / count::

    OMP_NUM_THREADS=1 mpirun -n 2 python scripts/balance.py --time 200 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from ase import units
from ase.md.velocitydistribution import MaxwellBoltzmannDistribution, Stationary
from ase.md.verlet import VelocityVerlet
from ase.neighborlist import neighbor_list
from mpi4py import MPI

from ase_shard import ShardedCalculator, distribute
from ase_shard.balance import max_over_mean
from ase_shard.distributed import GLOBAL_ID
from ase_shard.md import MODELS
from ase_shard.presets import SYSTEMS

HETEROGENEOUS = ("ar-interface", "cu-slab-gas", "cu-particle")


def work_per_rank(name: str, size: int | None, balance: str, distributed: bool) -> dict:
    """One system under one ``balance``: the independent pair counts per rank and what
    the calculator reports."""
    comm = MPI.COMM_WORLD
    system = SYSTEMS[name]
    atoms = system.build(system.size if size is None else size, 0)
    model = MODELS[system.defaults.model]()
    calc = ShardedCalculator(model, balance=balance)
    local = distribute(atoms if comm.rank == 0 else None) if distributed else atoms
    local.calc = calc
    local.get_forces()
    calc.request_rebuild()
    local.get_forces()
    if distributed:
        owners = np.empty(len(atoms), dtype=np.int64)
        ids = comm.allgather(local.arrays[GLOBAL_ID])
        for rank, held in enumerate(ids):
            owners[held] = rank
    else:
        owners = calc.decomposition.owners
    centres = neighbor_list("i", atoms, float(model.cutoff))
    pairs = np.bincount(owners[centres], minlength=comm.size)
    balance_report = calc.balance
    return {
        "system": name,
        "atoms": len(atoms),
        "model": system.defaults.model,
        "balance": balance,
        "pairs_per_rank": pairs.tolist(),
        "pairs_max_over_mean": max_over_mean(pairs),
        "owned": list(balance_report.owned),
        "edges": list(balance_report.edges),
        "edges_max_over_mean": balance_report.imbalance,
        "rebalances": balance_report.rebalances,
    }


def step_times(name: str, size: int, steps: int) -> dict:
    """``steps`` NVE steps of two copies of ``name``, one by count and one by work, in
    turns: each mode's step times (s, the slowest rank's)."""
    comm = MPI.COMM_WORLD
    system = SYSTEMS[name]
    atoms = system.build(size, 0)
    MaxwellBoltzmannDistribution(
        atoms, temperature_K=system.defaults.temperature, rng=np.random.default_rng(1)
    )
    Stationary(atoms)
    runs = {}
    for balance in ("count", "work"):
        copy = atoms.copy()
        copy.calc = ShardedCalculator(MODELS[system.defaults.model](), balance=balance)
        copy.get_forces()
        copy.calc.request_rebuild()  # work: the first cut by the atoms' edges
        runs[balance] = (copy, VelocityVerlet(copy, timestep=5.0 * units.fs), [])
    for _ in range(steps):
        for _, dynamics, times in runs.values():
            comm.Barrier()
            start = time.perf_counter()
            dynamics.run(1)
            comm.Barrier()
            times.append(time.perf_counter() - start)
    out = {"system": name, "atoms": len(atoms), "steps": steps}
    for balance, (copy, _, times) in runs.items():
        out[balance] = {
            "median_s": statistics.median(times),
            "mean_s": statistics.fmean(times),
            "rebuilds": copy.calc.rebuilds,
            "rebalances": copy.calc.balance.rebalances,
            "edges": list(copy.calc.balance.edges),
            "owned": list(copy.calc.balance.owned),
            "ghosts": list(copy.calc.balance.ghosts),
            # each rank's CPU seconds per phase, MPI waits excluded
            "cpu_s": comm.allgather(dict(copy.calc.timer.cpu)),
            "samples_s": times,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", nargs="+", default=list(HETEROGENEOUS))
    parser.add_argument("--size", type=int, help="system size N (default: the system's)")
    parser.add_argument("--distributed", action="store_true")
    parser.add_argument("--json", help="write the rows here (rank 0)")
    parser.add_argument("--time", type=int, metavar="STEPS", help="time STEPS MD steps")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    if args.time:
        name = args.systems[0] if args.systems != list(HETEROGENEOUS) else "ar-interface"
        out = step_times(name, args.size or 19, args.time)
        if comm.rank == 0:
            for balance in ("count", "work"):
                run = out[balance]
                print(
                    f"{balance:5s} median {run['median_s'] * 1e3:.1f} ms, mean "
                    f"{run['mean_s'] * 1e3:.1f} ms, rebuilds {run['rebuilds']}, rebalances "
                    f"{run['rebalances']}, edges/rank {run['edges']}"
                )
            for balance in ("count", "work"):
                for rank, phases in enumerate(out[balance]["cpu_s"]):
                    shown = ", ".join(f"{k} {v:.2f}" for k, v in phases.items() if v > 0.01)
                    print(f"{balance:5s} rank {rank} CPU s: {shown}")
            for key in ("median_s", "mean_s"):
                print(f"work / count ({key[:-2]}): {out['work'][key] / out['count'][key]:.3f}")
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"ranks": comm.size, **out}, f, indent=1)
        return
    rows = [
        work_per_rank(name, args.size, balance, args.distributed)
        for name in args.systems
        for balance in ("count", "work")
    ]
    if comm.rank == 0:
        mode = "distributed" if args.distributed else "replicated"
        print(f"{comm.size} ranks, {mode}; pairs centred on each rank's atoms (ASE's list)")
        for row in rows:
            print(
                f"{row['system']:13s} {row['atoms']:6d} atoms  {row['balance']:5s}  "
                f"max/mean {row['pairs_max_over_mean']:.3f}  rebalances {row['rebalances']}  "
                f"pairs/rank {row['pairs_per_rank']}"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {"ranks": comm.size, "distributed": args.distributed, "rows": rows},
                    f,
                    indent=1,
                )


if __name__ == "__main__":
    main()
