"""The plan against the run: each rank's peak memory, atoms, ghosts, edges and halo bytes.

    OMP_NUM_THREADS=1 python scripts/plan_memory.py [--models emt lj 7net-0]
        [--ranks 1 2 4] [--modes replicated distributed] [--json FILE]
    OMP_NUM_THREADS=1 .venv-mace/bin/python scripts/plan_memory.py --models mace ...

For each model, rank count and mode, a fresh serial process plans the run
(:func:`ase_shard.plan.plan`, calibration included), then a fresh ``mpirun -n P``
job runs it: the first force call, a step that reuses the decomposition (its
received bytes counted), then ten steps that move every atom by up to 0.01 Å
along each axis, and one that moves them past the skin (a rebuild). Each rank
reports its peak resident memory (``VmHWM``) over its whole life, the first
call's ``calc.balance`` and the reuse step's bytes. The report gives, per
rank, the plan's estimate over the measured peak, and whether the geometry
and the halo bytes are the plan's exactly.

Models: ``emt`` (Cu, ``--atoms`` default 32,000), ``lj`` (Ar at 8.5 Å, 32,000),
``7net-0`` (SevenNet's shipped checkpoint, Cu, 500), ``mace`` (a random-weight
MACE of 2 layers, 32 channels, 5 Å, Cu, 500; needs the MACE environment).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

SIZES = {"emt": 32000, "lj": 32000, "7net-0": 500, "mace": 500}


def structure(model_name: str, atoms_wanted: int):
    """fcc Cu (Ar for ``lj``), cubic cells repeated to about ``atoms_wanted`` atoms."""
    from ase.build import bulk

    repeat = max(1, round((atoms_wanted / 4) ** (1 / 3)))
    if model_name == "lj":
        atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat(repeat)
    else:
        atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(repeat)
    atoms.rattle(0.05, seed=1)
    return atoms


def model_of(model_name: str, atoms):
    from ase_shard.models import EMT, LennardJones

    if model_name == "emt":
        return EMT()
    if model_name == "lj":
        return LennardJones(epsilon=0.0104, sigma=3.4, rc=8.5)
    if model_name == "mace":
        from ase_shard.random_models import random_mace

        return random_mace(atoms.numbers)
    from ase_shard.md import build_model
    from ase_shard.presets import resolve_model

    return build_model(resolve_model(model_name), None)


def child_plan(model_name: str, size: int, ranks: int, distributed: bool) -> dict:
    from ase_shard.plan import plan

    atoms = structure(model_name, size)
    planned = plan(atoms, model_of(model_name, atoms), ranks, distributed=distributed)
    return {
        "grid": planned.grid,
        "fixed": planned.calibration.fixed_bytes,
        "node_bytes": planned.calibration.node_bytes,
        "edge_bytes": planned.calibration.edge_bytes,
        "held_bytes": planned.held_bytes,
        "calibration_blocks": planned.calibration.blocks,
        "ranks": [vars(rank) for rank in planned.per_rank],
        "table": planned.table(),
    }


def child_run(model_name: str, size: int, distributed: bool) -> list | None:
    import numpy as np
    import torch

    from ase_shard import ShardedCalculator, distribute
    from ase_shard.bench.machine import PeakMemory
    from ase_shard.comm import Comm

    comm = Comm()
    atoms = structure(model_name, size)
    model = model_of(model_name, atoms)
    # the plan's fixed part: the model placed, its kernels loaded (one call on a unit cell
    # in this process alone), what the allocator holds free given back
    unit = structure(model_name, 1)
    unit.calc = ShardedCalculator(model, comm=_self())
    unit.get_forces()
    del unit
    meter = PeakMemory(torch.device("cpu"))
    meter.start()  # the allocator's free memory given back, the high-water mark reset
    if distributed:
        atoms = distribute(atoms)
    calc = ShardedCalculator(model)
    atoms.calc = calc
    atoms.get_forces()
    balance = calc.balance
    rng = np.random.default_rng(comm.rank if distributed else 0)  # replicated: the same moves
    halo_before, before = calc.halo.plan.received_bytes, calc.comm.received_bytes
    atoms.positions = atoms.positions + rng.uniform(-1e-4, 1e-4, atoms.positions.shape)
    atoms.get_forces()
    halo_bytes = calc.halo.plan.received_bytes - halo_before
    received = calc.comm.received_bytes - before
    reused = calc.rebuilds == 1
    for step in range(11):
        move = 0.3 if step == 5 else 0.01  # past the skin once: a rebuild
        atoms.positions = atoms.positions + rng.uniform(-move, move, atoms.positions.shape)
        atoms.get_forces()
    memory = meter.stop()
    mine = {
        "peak": round(memory["peak_rss_mb"] * 2**20),
        "baseline": round(memory["start_rss_mb"] * 2**20),
        "owned": balance.owned[comm.rank],
        "ghosts": balance.ghosts[comm.rank],
        "edges": balance.edges[comm.rank],
        "halo_bytes": halo_bytes,
        "received_bytes": received,
        "reused": reused,
        "rebuilds": calc.rebuilds,
    }
    return comm.gather(mine)


def _self():
    from mpi4py import MPI

    return MPI.COMM_SELF


def run_case(model_name: str, size: int, ranks: int, mode: str) -> dict:
    script = str(Path(__file__).resolve())
    planned = json.loads(
        subprocess.run(
            [sys.executable, script, "--child-plan", model_name, str(size), str(ranks), mode],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.splitlines()[-1]
    )
    mpirun = Path(sys.executable).parent / "mpirun"
    out = subprocess.run(
        [str(mpirun), "--oversubscribe", "-n", str(ranks), sys.executable, script]
        + ["--child-run", model_name, str(size), mode],
        check=True,
        capture_output=True,
        text=True,
        timeout=900,
    ).stdout
    measured = json.loads(out.splitlines()[-1])
    rows = []
    for plan_rank, run_rank in zip(planned["ranks"], measured, strict=True):
        rows.append(
            {
                "planned_mib": plan_rank["memory"] / 2**20,
                "measured_mib": run_rank["peak"] / 2**20,
                "ratio": plan_rank["memory"] / run_rank["peak"],
                "marginal_ratio": (plan_rank["memory"] - planned["fixed"])
                / (run_rank["peak"] - run_rank["baseline"]),
                "geometry_exact": all(
                    plan_rank[key] == run_rank[key] for key in ("owned", "ghosts", "edges")
                )
                and run_rank["reused"],
                "halo_bytes_exact": plan_rank["halo_bytes"] == run_rank["halo_bytes"],
                "received_bytes_exact": plan_rank["halo_bytes"] + plan_rank["result_bytes"]
                == run_rank["received_bytes"],
                "plan": plan_rank,
                "run": run_rank,
            }
        )
    return {"model": model_name, "atoms": size, "ranks": ranks, "mode": mode,
            "plan": {k: v for k, v in planned.items() if k != "ranks"}, "per_rank": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["emt", "lj", "7net-0"],
                        choices=list(SIZES))
    parser.add_argument("--atoms", type=int, help="atoms wanted (default: per model)")
    parser.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--modes", nargs="+", default=["replicated", "distributed"],
                        choices=["replicated", "distributed"])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child-plan", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--child-run", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_plan:
        name, size, ranks, mode = args.child_plan
        print(json.dumps(child_plan(name, int(size), int(ranks), mode == "distributed")))
        return
    if args.child_run:
        name, size, mode = args.child_run
        gathered = child_run(name, int(size), mode == "distributed")
        if gathered is not None:
            print(json.dumps(gathered))
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    report = []
    for name in args.models:
        for mode in args.modes:
            for ranks in args.ranks:
                case = run_case(name, args.atoms or SIZES[name], ranks, mode)
                report.append(case)
                ratios = [row["ratio"] for row in case["per_rank"]]
                marginal = [row["marginal_ratio"] for row in case["per_rank"]]
                exact = all(
                    row["geometry_exact"] and row["received_bytes_exact"]
                    and row["halo_bytes_exact"]
                    for row in case["per_rank"]
                )
                print(
                    f"{name:7} {mode:11} {ranks} rank(s): plan / measured peak "
                    f"{min(ratios):.2f}-{max(ratios):.2f}, beyond the fixed part "
                    f"{min(marginal):.2f}-{max(marginal):.2f} "
                    f"(measured {max(r['measured_mib'] for r in case['per_rank']):.0f} MiB), "
                    f"geometry and bytes {'exact' if exact else 'DIFFER'}",
                    flush=True,
                )
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
