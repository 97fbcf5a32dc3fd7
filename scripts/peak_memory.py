"""Peak resident memory per atom of one process's MD, beyond the fixed part (issue 31).

    OMP_NUM_THREADS=1 python scripts/peak_memory.py [--models emt lj] [--repeats 20 32]
        [--json FILE]

For each model and each size (fcc cubic cells repeated ``--repeats`` times along each
axis: Cu for EMT, Ar for Lennard-Jones at 8.5 Å), a fresh process builds the atoms and
the calculator, resets its high-water mark (``/proc/self/clear_refs``), then runs 10
``VelocityVerlet`` steps of 5 fs with one forced rebuild (the atoms moved by 0.3 Å, past
the skin) and reports its peak resident memory (``VmHWM``) above the resident memory
before the first call. The marginal cost per atom is the difference between the two
sizes' peaks over the difference of their atoms: the fixed part (imports, compiled
kernels) cancels. Run another revision's tree with ``PYTHONPATH=TREE``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def status_mib(field: str) -> float:
    """A ``/proc/self/status`` field (``VmRSS``, ``VmHWM``) in MiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def child(model_name: str, repeat: int) -> None:
    """One run; prints a JSON line: atoms, edges, MiB before and at the peak."""
    from ase import units
    from ase.build import bulk
    from ase.md.verlet import VelocityVerlet

    from ase_shard import ShardedCalculator
    from ase_shard.models import EMT, LennardJones

    if model_name == "emt":
        atoms, model = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(repeat), EMT()
    else:
        atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat(repeat)
        model = LennardJones(epsilon=0.0104, sigma=3.4, rc=8.5)
    atoms.rattle(0.05, seed=1)
    calc = ShardedCalculator(model)
    atoms.calc = calc
    Path("/proc/self/clear_refs").write_text("5")
    before = status_mib("VmRSS")
    dyn = VelocityVerlet(atoms, 5 * units.fs)
    dyn.run(5)
    atoms.positions += 0.3  # past the skin: the second block is built beside the atoms
    dyn.run(5)
    print(
        json.dumps(
            {
                "model": model_name,
                "atoms": len(atoms),
                "edges": int(sum(calc.balance.edges)),
                "rebuilds": calc.rebuilds,
                "before_mib": before,
                "peak_mib": status_mib("VmHWM"),
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["emt", "lj"], choices=["emt", "lj"])
    parser.add_argument("--repeats", nargs=2, type=int, default=[20, 32])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]))
        return
    report = []
    for model in args.models:
        runs = []
        for repeat in args.repeats:
            out = subprocess.run(
                [sys.executable, __file__, "--child", model, str(repeat)],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            runs.append(json.loads(out.strip().splitlines()[-1]))
        small, large = runs
        extra = [run["peak_mib"] - run["before_mib"] for run in runs]
        per_atom = (extra[1] - extra[0]) * 2**20 / (large["atoms"] - small["atoms"])
        per_edge = (extra[1] - extra[0]) * 2**20 / (large["edges"] - small["edges"])
        report.append({"runs": runs, "bytes_per_atom": per_atom, "bytes_per_edge": per_edge})
        print(
            f"{model}: {small['atoms']} / {large['atoms']} atoms, peak beyond start "
            f"{extra[0]:.0f} / {extra[1]:.0f} MiB: {per_atom / 1000:.2f} kB per atom "
            f"({per_edge:.0f} B per listed edge, {large['edges'] / large['atoms']:.1f} edges "
            "per atom)"
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
