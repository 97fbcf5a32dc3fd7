"""float32 against float64: what precision costs, for docs/models.md.

    .venv/bin/python scripts/report_precision.py

Evaluates the same systems with the same weights in both precisions through
``ShardedCalculator(model, dtype=...)`` and prints the differences: energy per
atom (eV/atom), the largest force component error (eV/Å, and relative to the
largest force) and the stress error relative to the largest stress component.
"""

import sys
from pathlib import Path

import numpy as np
import torch
from ase.build import bulk

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from sharded import results, serial_comm  # noqa: E402

from ase_shard import ShardedCalculator  # noqa: E402
from ase_shard.models import EMT  # noqa: E402
from ase_shard.random_models import random_sevennet  # noqa: E402


def systems():
    cu = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(4)
    cu.rattle(0.05, seed=1)
    alloy = bulk("Cu", "fcc", a=3.7, cubic=True).repeat(4)
    alloy.numbers[np.random.default_rng(2).choice(len(alloy), 128, replace=False)] = 79
    alloy.rattle(0.1, seed=2)
    hot = cu.copy()
    hot.rattle(0.25, seed=3)
    return {"Cu bulk, 256": cu, "CuAu alloy, 256": alloy, "Cu, 0.25 Å rattle": hot}


def compare(make_model, atoms) -> dict[str, float]:
    out = {}
    for dtype in (torch.float64, torch.float32):
        atoms = atoms.copy()
        atoms.calc = ShardedCalculator(make_model(atoms), dtype=dtype, comm=serial_comm())
        out[dtype] = results(atoms)
    ref, low = out[torch.float64], out[torch.float32]
    force_error = np.abs(low["forces"] - ref["forces"]).max()
    return {
        "energy eV/atom": abs(low["energy"] - ref["energy"]) / len(atoms),
        "force eV/Å": force_error,
        "force rel": force_error / np.abs(ref["forces"]).max(),
        "stress rel": np.abs(low["stress"] - ref["stress"]).max() / np.abs(ref["stress"]).max(),
    }


def main() -> None:
    torch.set_num_threads(1)
    models = {
        "EMT": lambda atoms: EMT(),
        "SevenNet (random, 3 layers)": lambda atoms: random_sevennet(
            [29, 79], cutoff=4.5, channels=16, num_layers=3
        ),
    }
    print("| model | system | energy (eV/atom) | force (eV/Å) | force, rel. | stress, rel. |")
    print("|---|---|---|---|---|---|")
    for name, make_model in models.items():
        for label, atoms in systems().items():
            d = compare(make_model, atoms)
            print(
                f"| {name} | {label} | {d['energy eV/atom']:.1e} | {d['force eV/Å']:.1e} | "
                f"{d['force rel']:.1e} | {d['stress rel']:.1e} |"
            )


if __name__ == "__main__":
    main()
