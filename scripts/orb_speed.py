"""One process: ShardedCalculator(Orb) against ORBCalculator, step by step.

Orb-v3 conservative, or with ``--direct`` Orb-v3 direct (orb's own builders at full
size, random weights, float32) on a rattled 108-atom Cu cell; run from the repository
root::

    OMP_NUM_THREADS=1 .venv/bin/python scripts/orb_speed.py [--direct]
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch
from ase.build import bulk
from orb_models.forcefield.atomic_system import SystemConfig
from orb_models.forcefield.pretrained import (
    orb_v3_conservative_architecture,
    orb_v3_direct_architecture,
)

from ase_shard import ShardedCalculator
from ase_shard.models import Orb

sys.path.insert(0, "tests")
from test_orb import orb_calculator  # noqa: E402


def main(steps: int = 5, direct: bool = False) -> None:
    torch.manual_seed(0)
    config = SystemConfig(radius=6.0, max_num_neighbors=120)
    build = orb_v3_direct_architecture if direct else orb_v3_conservative_architecture
    net = build(system_config=config, device="cpu").eval()
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(3)
    atoms.rattle(0.05, seed=0)
    calcs = {"orb": orb_calculator(net), "sharded": ShardedCalculator(Orb(net))}
    times: dict[str, list[float]] = {name: [] for name in calcs}
    rng = np.random.default_rng(0)
    for step in range(steps):
        positions = atoms.positions + rng.uniform(-0.01, 0.01, atoms.positions.shape)
        forces = {}
        for name, calc in calcs.items():
            moved = atoms.copy()
            moved.positions = positions
            moved.calc = calc
            start = time.perf_counter()
            forces[name] = moved.get_forces()
            times[name].append(time.perf_counter() - start)
        difference = np.abs(forces["orb"] - forces["sharded"]).max()
        print(f"step {step}: max force difference {difference:.2g} eV/Å")
    for name, values in times.items():
        rounded = [round(value, 2) for value in values]
        print(f"{name}: median after the first step {np.median(values[1:]):.2f} s {rounded}")


if __name__ == "__main__":
    main(direct="--direct" in sys.argv[1:])
