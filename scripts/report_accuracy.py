"""Print the worst relative error of every acceptance case against ASE.

Usage: ``mpirun -n P python scripts/report_accuracy.py`` (or plain ``python``).
The same comparisons are asserted by ``test_sharded_physics.py``; this script
only prints the figures quoted in the docs and issue notes.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from oracles import ase_results, relative_errors  # noqa: E402
from sharded import COMM, results  # noqa: E402
from systems import CASES  # noqa: E402

from ase_shard import ShardedCalculator  # noqa: E402
from ase_shard.partition import PARTITIONS  # noqa: E402


def main() -> None:
    if COMM.is_root:
        print(f"ranks={COMM.size}  max relative error vs ASE (energy, energies, forces, stress)")
    for name, case in sorted(CASES.items()):
        atoms = case.make_atoms()
        ref = ase_results(case.make_ase_calc(), atoms, case.has_stresses)
        row = []
        for partition in PARTITIONS:
            atoms.calc = ShardedCalculator(case.make_model(), partition=partition)
            row.append(max(relative_errors(results(atoms), ref).values()))
        if COMM.is_root:
            cells = "  ".join(f"{p}={e:.1e}" for p, e in zip(PARTITIONS, row, strict=True))
            print(f"{name:26s} {len(atoms):4d} atoms  {cells}")


if __name__ == "__main__":
    main()
