"""An older revision of ase_shard against this tree, both in one process, rebuild by rebuild.

``scripts/ab_compare.py`` runs the two trees in alternating processes; on this VM
one process's step differs from the next one's by 10-30 %, and a few per cent
hide in that. Here the older revision is extracted from git (``git archive``)
as a package named ``ase_shard_old`` and imported beside ``ase_shard``: two
copies of 32,000 Cu atoms (fcc, 20^3 cubic cells; with ``--model lj`` liquid
argon, ``ase-shard bench``'s ``ar-liquid``), each with one calculator (EMT or
Lennard-Jones at 8.5 Å, the revision's own), take the same random moves of
1e-3 Å per atom, and each is asked to rebuild and evaluate (with ``--reuse``,
only to evaluate: the kernels' share), in turns (ABBA), every evaluation timed
between barriers. Drift of the machine then falls on both alike.

    OMP_NUM_THREADS=1 python scripts/ab_in_process.py --old ad69707 --ranks 2 \\
        --steps 40 --balance work --json out.json
    OMP_NUM_THREADS=1 python scripts/ab_in_process.py --old 7f996bb --ranks 1 \\
        --model lj --reuse

Prints the median evaluation of each and their ratio, new / old (and the median
of the per-turn ratios), the largest difference of their forces, and rank 0's
time per evaluation in each of the calculators' phases.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
OLD = "ase_shard_old"


def extract(revision: str, into: Path) -> None:
    """``ase_shard`` at ``revision`` as the package ``ase_shard_old`` under ``into``."""
    archive = into / "old.tar"
    subprocess.run(
        ["git", "-C", str(ROOT), "archive", "-o", str(archive), revision, "ase_shard"],
        check=True,
    )
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    (into / "ase_shard").rename(into / OLD)
    word = re.compile(r"\base_shard\b")
    for path in (into / OLD).rglob("*.py"):
        path.write_text(word.sub(OLD, path.read_text()))


def child(steps: int, balance: str, model: str, reuse: bool) -> None:
    """Time both revisions' rebuilds (or reuse steps) in this process; rank 0 prints JSON."""
    import ase_shard_old  # noqa: I001 (extracted beside the tree at run time)
    import numpy as np
    from ase.build import bulk
    from mpi4py import MPI

    import ase_shard
    from ase_shard.peers import ARGON
    from ase_shard.presets import SYSTEMS

    comm = MPI.COMM_WORLD
    if model == "lj":
        base = SYSTEMS["ar-liquid"].build(20, 0)
    else:
        base = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(20)
    runs = {}
    for name, package, options in (
        ("old", ase_shard_old, {}),
        ("new", ase_shard, {"balance": balance}),
    ):
        atoms = base.copy()
        models = importlib.import_module(f"{package.__name__}.models")
        potential = models.LennardJones(**ARGON) if model == "lj" else models.EMT()
        atoms.calc = package.ShardedCalculator(potential, **options)
        atoms.get_forces()
        runs[name] = atoms
    rng = np.random.default_rng(7)
    times = {name: [] for name in runs}
    for atoms in runs.values():
        atoms.calc.timer.reset()
    for turn in range(steps):
        move = rng.normal(scale=1e-3 / 3**0.5, size=base.positions.shape)
        for name in ("old", "new") if turn % 2 else ("new", "old"):
            atoms = runs[name]
            atoms.positions += move
            if not reuse:
                atoms.calc.request_rebuild()
            comm.Barrier()
            start = time.perf_counter()
            atoms.get_forces()
            comm.Barrier()
            times[name].append(time.perf_counter() - start)
    # rank 0's seconds per evaluation in each calculator phase (partition, halo, ...)
    phases = {
        name: {phase: t / steps for phase, t in atoms.calc.timer.totals.items() if t}
        for name, atoms in runs.items()
    }
    difference = float(np.abs(runs["old"].get_forces() - runs["new"].get_forces()).max())
    if comm.rank == 0:
        old, new = (statistics.median(times[name]) for name in ("old", "new"))
        print(
            json.dumps(
                {
                    "ranks": comm.size,
                    "model": model,
                    "reuse": reuse,
                    "balance": balance,
                    "steps": steps,
                    "old_s": old,
                    "new_s": new,
                    "ratio": new / old,
                    "median_turn_ratio": statistics.median(
                        b / a for a, b in zip(times["old"], times["new"], strict=True)
                    ),
                    "max_force_difference_eV_per_A": difference,
                    "phases_s": phases,
                    "samples_s": times,
                }
            )
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", default="ad69707", help="git revision (default ad69707)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40, help="rebuilds of each (default 40)")
    parser.add_argument("--balance", default="work", help="this tree's balance= (work)")
    parser.add_argument("--model", choices=("emt", "lj"), default="emt")
    parser.add_argument("--reuse", action="store_true", help="time steps without a rebuild")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.steps, args.balance, args.model, args.reuse)
        return
    with tempfile.TemporaryDirectory() as scratch:
        extract(args.old, Path(scratch))
        path = os.pathsep.join([scratch, str(ROOT)])
        env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
        mpirun = str(Path(sys.executable).parent / "mpirun")
        launcher = [mpirun, "--oversubscribe", "-n", str(args.ranks)]
        command = [*launcher, sys.executable, str(HERE), "--child"]
        command += ["--steps", str(args.steps), "--balance", args.balance, "--model", args.model]
        command += ["--reuse"] if args.reuse else []
        done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"the timed run failed (exit {done.returncode}):\n{done.stderr}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["old_revision"] = args.old
    print(
        f"{args.ranks} rank(s), {args.model}{', reuse' if args.reuse else ''}, "
        f"balance={args.balance}: old {result['old_s'] * 1e3:.1f} ms, "
        f"new {result['new_s'] * 1e3:.1f} ms, new/old {result['ratio']:.3f} (per turn "
        f"{result['median_turn_ratio']:.3f}); forces differ by at most "
        f"{result['max_force_difference_eV_per_A']:.1e} eV/Å"
    )
    old, new = result["phases_s"]["old"], result["phases_s"]["new"]
    for phase in new:
        print(f"  {phase:10s} old {old.get(phase, 0) * 1e3:7.2f}  new {new[phase] * 1e3:7.2f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
