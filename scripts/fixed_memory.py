"""The fixed part of a process's memory: resident memory after each import and the first call.

    OMP_NUM_THREADS=1 mpirun -n 2 python scripts/fixed_memory.py [--json FILE]

Imports, in order, what an ``ase_shard`` run loads (numpy, ASE, torch, mpi4py, which
initialises MPI, numba and its LLVM, the calculator and its models), then evaluates EMT
on 108 Cu atoms (the compiled kernels loaded from numba's cache, the block built), and
prints the resident memory (``VmRSS``) after each, in MiB, with the increments: the
per-process part that does not grow with the atoms (issue 31, "per byte").
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def resident_mib() -> tuple[float, float]:
    """This process's resident memory and its proportional share now, MiB."""
    fields = {}
    with open("/proc/self/smaps_rollup") as rollup:
        for line in rollup:
            name, _, rest = line.partition(":")
            if rest.strip().endswith("kB"):
                fields[name] = int(rest.split()[0])
    return fields["Rss"] / 1024, fields["Pss"] / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    steps = [("python", resident_mib())]
    import numpy  # noqa: F401

    steps.append(("numpy", resident_mib()))
    import ase.build

    steps.append(("ase (ase.build)", resident_mib()))
    import torch  # noqa: F401

    steps.append(("torch", resident_mib()))
    import mpi4py.MPI  # noqa: F401

    steps.append(("mpi4py (MPI initialised)", resident_mib()))
    import numba  # noqa: F401

    steps.append(("numba and llvmlite", resident_mib()))
    from ase_shard import ShardedCalculator
    from ase_shard.models import EMT

    steps.append(("ase_shard calculator and models", resident_mib()))
    atoms = ase.build.bulk("Cu", "fcc", a=3.6, cubic=True).repeat(3)
    atoms.calc = ShardedCalculator(EMT())
    atoms.get_forces()
    steps.append(("first EMT evaluation, 108 Cu", resident_mib()))
    previous = (0.0, 0.0)
    if mpi4py.MPI.COMM_WORLD.rank:
        return
    print(f"{'after':40s} {'resident MiB':>14s} {'share MiB':>13s}")
    for name, (resident, share) in steps:
        print(
            f"{name:40s} {resident:6.0f} {resident - previous[0]:+6.0f} "
            f"{share:6.0f} {share - previous[1]:+6.0f}"
        )
        previous = (resident, share)
    if args.json:
        report = {name: {"resident_MiB": r, "proportional_MiB": p} for name, (r, p) in steps}
        report["ranks"] = mpi4py.MPI.COMM_WORLD.size
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
