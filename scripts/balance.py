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

``--md STEPS``: a moving interface. ``ar-interface`` (``--size``, default 10: 4,666
atoms) under Langevin at ``--temperature`` (default 160 K, above argon's critical
point, so the liquid evaporates into the box), ``balance="work"``. At every rebuild
it records the work imbalance the rebuild measured (``measured``), the one the kept
cuts would give by the atoms' weights where it had weighed them at the rebuild
before (``estimate``, before any re-cut), whether the atoms were cut again, and
two imbalances counted
with ASE's neighbour list: of the owners in force, and of count-balanced owners on
the same grid. ``--plot PNG`` draws them::

    OMP_NUM_THREADS=1 mpirun --oversubscribe -n 4 python scripts/balance.py --md 3000 \
        --json out.json --plot docs/img/balance-md.png
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


def moving_interface(size: int, steps: int, temperature: float) -> dict:
    """``steps`` Langevin steps of ``ar-interface``: one row per rebuild."""
    from ase.md.langevin import Langevin

    from ase_shard.partition import frame_coordinates, spatial_owners

    comm = MPI.COMM_WORLD
    atoms = SYSTEMS["ar-interface"].build(size, 0)
    model = MODELS["lj"]()
    MaxwellBoltzmannDistribution(atoms, temperature_K=temperature, rng=np.random.default_rng(1))
    atoms.calc = calc = ShardedCalculator(model)
    dynamics = Langevin(
        atoms,
        5.0 * units.fs,
        temperature_K=temperature,
        friction=0.01 / units.fs,
        rng=np.random.default_rng(2),
    )
    rows, seen = [], [0, 0]

    def record() -> None:
        if calc.rebuilds == seen[0]:
            return
        work_cuts = calc.layout.work_cuts
        coords = frame_coordinates(atoms.positions, atoms.cell.array, atoms.pbc)
        by_count = spatial_owners(coords, work_cuts.cuts.grid)
        centres = neighbor_list("i", atoms, float(model.cutoff))
        rows.append(
            {
                "step": dynamics.nsteps,
                "rebuild": calc.rebuilds,
                "measured": work_cuts.measured,
                "estimate": work_cuts.imbalance,
                "rebalanced": work_cuts.rebalances > seen[1],
                "pairs_max_over_mean": max_over_mean(
                    np.bincount(calc.decomposition.owners[centres], minlength=comm.size)
                ),
                "count_pairs_max_over_mean": max_over_mean(
                    np.bincount(by_count[centres], minlength=comm.size)
                ),
            }
        )
        seen[:] = [calc.rebuilds, work_cuts.rebalances]

    dynamics.attach(record, interval=1)
    dynamics.run(steps)
    return {"size": size, "atoms": len(atoms), "temperature_K": temperature, "rows": rows}


def plot_moving_interface(out: dict, path: str) -> None:
    """Imbalance against MD step: the work cuts', count cuts', and the rebalances."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = out["rows"][1:]  # the first build knows no edges yet
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(steps, [r["count_pairs_max_over_mean"] for r in rows], label="cut by count")
    ax.plot(steps, [r["pairs_max_over_mean"] for r in rows], label='cut by work (balance="work")')
    cut = [r for r in rows if r["rebalanced"]]
    ax.plot(
        [r["step"] for r in cut],
        [r["pairs_max_over_mean"] for r in cut],
        "o",
        color="C1",
        label="rebalanced at this rebuild",
    )
    ax.axhline(1.05, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("MD step (5 fs)")
    ax.set_ylabel("pairs per rank, max / mean")
    ax.set_title(
        f"{out['atoms']} Ar, liquid evaporating at {out['temperature_K']:.0f} K, "
        f"{out['ranks']} ranks: {len(cut)} rebalances in {len(rows)} rebuilds",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def node_cost(size: int, rounds: int = 4, steps: int = 15) -> dict:
    """``2 b / a`` from the step times of ``ar-liquid`` at two cutoffs (one process)."""
    from ase_shard.models import LennardJones

    atoms = SYSTEMS["ar-liquid"].build(size, 0)
    rng = np.random.default_rng(3)
    times: dict[float, list[float]] = {8.5: [], 6.0: []}
    pairs = {}
    for _ in range(rounds):
        for cutoff in times:
            model = LennardJones(sigma=3.4, epsilon=0.0104, rc=cutoff, smooth=True)
            copy = atoms.copy()
            copy.calc = calc = ShardedCalculator(model, balance="count")
            copy.get_forces()
            pairs[cutoff] = sum(calc.balance.edges)
            for _ in range(steps):
                copy.positions += rng.normal(scale=1e-4, size=copy.positions.shape)
                start = time.perf_counter()
                copy.get_forces()
                times[cutoff].append(time.perf_counter() - start)
    step = {cutoff: statistics.median(t) for cutoff, t in times.items()}
    per_pair = (step[8.5] - step[6.0]) / (pairs[8.5] - pairs[6.0])
    per_atom = (step[8.5] - per_pair * pairs[8.5]) / len(atoms)
    return {
        "atoms": len(atoms),
        "pairs": pairs,
        "step_s": step,
        "per_pair_s": per_pair,
        "per_atom_s": per_atom,
        "node_work": 2.0 * per_atom / per_pair,
    }


def show_node_cost(out: dict) -> None:
    print(
        f"{out['atoms']} atoms: step {out['step_s'][8.5] * 1e3:.1f} ms at 8.5 Å "
        f"({out['pairs'][8.5]} pairs), {out['step_s'][6.0] * 1e3:.1f} ms at 6 Å "
        f"({out['pairs'][6.0]}): {out['per_pair_s'] * 1e9:.1f} ns a pair, "
        f"{out['per_atom_s'] * 1e9:.0f} ns an atom; an atom weighs "
        f"{out['node_work']:.1f} of its neighbours"
    )


def show_moving_interface(out: dict) -> None:
    rows = out["rows"]
    cut = sum(r["rebalanced"] for r in rows[1:])
    print(f"{out['atoms']} atoms, {out['ranks']} ranks: {len(rows)} rebuilds, {cut} rebalances")
    for r in rows:
        print(
            f"step {r['step']:5d}  estimate {r['estimate'] or 0:.3f}  "
            f"{'re-cut' if r['rebalanced'] else '      '}  pairs max/mean: work "
            f"{r['pairs_max_over_mean']:.3f}, count {r['count_pairs_max_over_mean']:.3f}"
        )


def show_step_times(out: dict) -> None:
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


def show_work_per_rank(out: dict) -> None:
    mode = "distributed" if out["distributed"] else "replicated"
    print(f"{out['ranks']} ranks, {mode}; pairs centred on each rank's atoms (ASE's list)")
    for row in out["rows"]:
        print(
            f"{row['system']:13s} {row['atoms']:6d} atoms  {row['balance']:5s}  "
            f"max/mean {row['pairs_max_over_mean']:.3f}  rebalances {row['rebalances']}  "
            f"pairs/rank {row['pairs_per_rank']}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", nargs="+", default=list(HETEROGENEOUS))
    parser.add_argument("--size", type=int, help="system size N (default: the system's)")
    parser.add_argument("--distributed", action="store_true")
    parser.add_argument("--json", help="write the rows here (rank 0)")
    parser.add_argument("--time", type=int, metavar="STEPS", help="time STEPS MD steps")
    parser.add_argument("--md", type=int, metavar="STEPS", help="a moving interface")
    parser.add_argument("--temperature", type=float, default=160.0, help="K, with --md")
    parser.add_argument("--plot", help="with --md: draw the imbalance here (PNG)")
    parser.add_argument("--node-cost", action="store_true", help="an atom's cost in edges")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    if args.node_cost:
        out, show = node_cost(args.size or 20), show_node_cost
    elif args.md:
        out = moving_interface(args.size or 10, args.md, args.temperature)
        show = show_moving_interface
    elif args.time:
        name = args.systems[0] if args.systems != list(HETEROGENEOUS) else "ar-interface"
        out, show = step_times(name, args.size or 19, args.time), show_step_times
    else:
        rows = [
            work_per_rank(name, args.size, balance, args.distributed)
            for name in args.systems
            for balance in ("count", "work")
        ]
        out, show = {"distributed": args.distributed, "rows": rows}, show_work_per_rank
    out = {"ranks": comm.size, **out}
    if comm.rank == 0:
        show(out)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        if args.md and args.plot:
            plot_moving_interface(out, args.plot)


if __name__ == "__main__":
    main()
