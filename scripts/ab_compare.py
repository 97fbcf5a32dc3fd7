"""Two source trees of ase_shard in turns: the MD step time of each, round by round.

A change's cost is smaller than this machine's drift from one minute to the
next, so the two trees run in alternating processes (ABBA order, one process
per tree and round, the same seed) and each round gives one ratio B/A; the
median over rounds is the comparison. Each process imports its tree through
``PYTHONPATH``.

Cases (each times ``atoms.get_forces()`` after a 1e-3 Å move of every atom,
a step that reuses the decomposition, as MD steps do):

- ``emt``: 32,000 Cu atoms (fcc, 20^3 cubic cells), ``ase_shard.models.EMT``;
- ``lj``: 32,000 Ar atoms (fcc, a = 5.26 Å, rattled), Lennard-Jones
  (sigma 3.4 Å, epsilon 0.0104 eV, cut at 8.5 Å);
- ``framework``: ``ase-shard bench --framework`` on 1,000,188 Cu atoms with the
  no-edge model (the calculator's own cost per MD step, no pairs);
- ``emt-rebuild``, ``lj-rebuild``: ``emt`` and ``lj`` with a rebuild at every
  timed step (``calc.request_rebuild()``): what the partition, the halo and the
  neighbour lists cost;
- ``emt-md``: ``emt`` as MD (velocity Verlet, 5 fs, from 600 K): the mean of every
  step, the rebuilds that come as the atoms move included.

Usage::

    python scripts/ab_compare.py --trees OLD_TREE NEW_TREE --cases emt lj \\
        --ranks 1 2 --rounds 6 --json ab.json

Prints, per case and rank count, each round's times and ratio, and the median
ratio; beside them the same ratio of rank 0's time inside the calculator's timed
phases (``calc.timer``: partition, halo, neighbour lists, kernel, exchanges),
which leaves out what lies between the phases (ASE, the test harness) and
varies less. Writes them all to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
STEP_MOVE = 1e-3  # Å per step: far below any skin, so every timed step reuses the layout
CHILD_CASES = ("emt", "lj", "emt-rebuild", "lj-rebuild", "emt-md")  # timed by _child


def _child(case: str, steps: int) -> None:
    """Time ``steps`` reuse steps of ``case`` in this process's tree; rank 0 prints JSON."""
    import numpy as np
    from ase.build import bulk

    import ase_shard
    from ase_shard import ShardedCalculator
    from ase_shard.models import EMT, LennardJones

    rebuild, md = case.endswith("-rebuild"), case.endswith("-md")
    case = case.removesuffix("-rebuild").removesuffix("-md")
    if case == "emt":
        atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(20)
        model = EMT()
    else:
        atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat(20)
        atoms.rattle(0.05, seed=1)
        model = LennardJones(sigma=3.4, epsilon=0.0104, rc=8.5)
    atoms.calc = calc = ShardedCalculator(model)
    atoms.get_forces()
    rng = np.random.default_rng(7)
    times = []
    calc.timer.reset()  # the timed steps' phases only

    def report(step_s: float, **extra) -> None:
        """Rank 0 prints the step time and the calculator's phases, per step."""
        phases = {name: total / steps for name, total in calc.timer.totals.items() if total}
        if calc.comm.rank == 0:
            print(json.dumps({"step_s": step_s, "samples_s": times, "phases_s": phases,
                              "source": os.path.dirname(ase_shard.__file__), **extra}))

    if md:
        from ase import units
        from ase.md.velocitydistribution import MaxwellBoltzmannDistribution
        from ase.md.verlet import VelocityVerlet

        MaxwellBoltzmannDistribution(atoms, temperature_K=600, rng=rng)
        dynamics = VelocityVerlet(atoms, timestep=5 * units.fs)
        for _ in range(steps):
            start = time.perf_counter()
            dynamics.run(1)
            times.append(time.perf_counter() - start)
        report(statistics.fmean(times), rebuilds=calc.rebuilds)
        return
    for _ in range(steps):
        atoms.positions += rng.normal(scale=STEP_MOVE / 3**0.5, size=atoms.positions.shape)
        start = time.perf_counter()
        if rebuild:
            calc.request_rebuild()
        atoms.get_forces()
        times.append(time.perf_counter() - start)
    assert calc.rebuilds == 1 + rebuild * steps, calc.rebuilds
    report(statistics.median(times))


def _run(tree: str, case: str, ranks: int, steps: int) -> dict:
    """One process (``ranks`` MPI ranks) of ``case`` with ``tree`` first on the path."""
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
    launcher = []
    if ranks > 1:
        mpirun = Path(sys.executable).parent / "mpirun"
        launcher = [str(mpirun), "--oversubscribe", "-n", str(ranks)]
    if case == "framework":
        with tempfile.TemporaryDirectory() as scratch:
            report = os.path.join(scratch, "framework.json")
            command = [*launcher, sys.executable, "-m", "ase_shard.cli", "bench", "--framework",
                       "--size", "63", "--reuse-steps", str(steps), "--rebuild-steps", "1",
                       "--threads", "1", "--json", report]
            subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
            with open(report) as handle:
                reuse = json.load(handle)["results"]["reuse"]
            return {"step_s": reuse["framework_s"], "samples_s": reuse["framework_samples_s"]}
    command = [*launcher, sys.executable, str(HERE), "--child", case, "--steps", str(steps)]
    done = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs=2, metavar=("A", "B"), help="two source trees")
    parser.add_argument("--cases", nargs="+", choices=(*CHILD_CASES, "framework"),
                        default=["emt", "lj"])
    parser.add_argument("--ranks", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per process")
    parser.add_argument("--json", help="write every round here")
    parser.add_argument("--child", choices=CHILD_CASES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.steps)
        return
    trees = [str(Path(tree).resolve()) for tree in args.trees]
    report = {"trees": trees, "rounds": args.rounds, "steps": args.steps, "cases": []}
    for case in args.cases:
        for ranks in args.ranks:
            rounds = []
            for round_ in range(args.rounds):
                order = (0, 1) if round_ % 2 == 0 else (1, 0)  # ABBA: drift cancels
                runs = {which: _run(trees[which], case, ranks, args.steps) for which in order}
                times = {which: run["step_s"] for which, run in runs.items()}
                # rank 0's time inside the calculator's phases (framework: none reported)
                phases = {w: sum(run.get("phases_s", {}).values()) for w, run in runs.items()}
                rounds.append({"a_s": times[0], "b_s": times[1], "ratio": times[1] / times[0],
                               "a_phases_s": runs[0].get("phases_s"),
                               "b_phases_s": runs[1].get("phases_s"),
                               "phases_ratio": phases[1] / phases[0] if phases[0] else None})
                line = (f"{case} {ranks} rank(s) round {round_ + 1}: A {times[0] * 1e3:.2f} ms, "
                        f"B {times[1] * 1e3:.2f} ms, B/A {times[1] / times[0]:.3f}")
                if phases[0]:
                    line += f"; phases B/A {phases[1] / phases[0]:.3f}"
                print(line, flush=True)
            median = statistics.median(r["ratio"] for r in rounds)
            line = f"{case} {ranks} rank(s): median B/A {median:.3f}"
            phase_ratios = [r["phases_ratio"] for r in rounds if r["phases_ratio"]]
            phases_median = statistics.median(phase_ratios) if phase_ratios else None
            if phases_median:
                line += f"; phases B/A {phases_median:.3f}"
            print(line, flush=True)
            report["cases"].append({"case": case, "ranks": ranks, "rounds": rounds,
                                    "median_ratio": median,
                                    "phases_median_ratio": phases_median})
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
