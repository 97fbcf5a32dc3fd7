"""MD under ``torch.compile``: equal to eager, and how often the model recompiles.

    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
    mpirun --oversubscribe -n 2 .venv/bin/python scripts/compile_md.py --steps 200

Runs Langevin MD of hot liquid Cu (EMT, 1,500 K, 5 fs steps, skin 0.3 Å: the
decomposition is rebuilt and atoms migrate between ranks every few steps)
driven by an eager ``ShardedCalculator``. At every step the same positions are
also evaluated by a compiled one, and the largest relative difference of
energy, forces and stress is reported, with the number of graphs dynamo
compiled. ``--padding off`` compiles the model without ase_shard's padding
(``ShardedCalculator(torch.compile(model))``), for comparison: then every new
shape recompiles, until dynamo's recompile limit (8) makes it run eagerly.
"""

import ase_shard  # first: sets up MPI before ASE fixes ase.parallel.world

# isort: split

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch._dynamo.utils
from ase import units
from ase.md.langevin import Langevin

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from oracles import relative_errors  # noqa: E402
from sharded import COMM, results, thermalised_cu  # noqa: E402

from ase_shard.models import EMT  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=5, help="cubic Cu cells per axis (5)")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--padding", choices=("on", "off"), default="on")
    args = parser.parse_args()

    atoms = thermalised_cu(args.repeat, 3000.0, seed=1)
    atoms.calc = ase_shard.ShardedCalculator(EMT(), skin=0.3)
    if args.padding == "on":
        compiled = ase_shard.ShardedCalculator(EMT(), skin=0.3, compile=args.backend)
    else:
        compiled = ase_shard.ShardedCalculator(
            torch.compile(EMT(), backend=args.backend, dynamic=False), skin=0.3
        )
    dyn = Langevin(
        atoms,
        5 * units.fs,
        temperature_K=1500,
        friction=0.02,
        fixcm=False,
        rng=np.random.default_rng(7),
    )
    worst, seconds = {}, []

    def compare() -> None:
        twin = atoms.copy()
        twin.calc = compiled
        start = time.perf_counter()
        got = results(twin)
        seconds.append(time.perf_counter() - start)
        for key, err in relative_errors(got, results(atoms)).items():
            worst[key] = max(worst.get(key, 0.0), err)

    dyn.attach(compare, interval=1)
    start = time.perf_counter()
    dyn.run(args.steps)
    counters = torch._dynamo.utils.counters
    graphs = COMM.allgather(counters["stats"]["unique_graphs"])
    if COMM.is_root:
        print(
            f"{args.steps} steps of {len(atoms)} Cu on {COMM.size} rank(s), backend "
            f"{args.backend}, padding {args.padding}: {atoms.calc.rebuilds} rebuilds"
        )
        print(
            "max relative difference compiled vs eager: "
            + ", ".join(f"{k} {v:.1e}" for k, v in worst.items())
        )
        print(
            f"graphs compiled per rank: {graphs}; recompiles on rank 0: {counters['recompiles']}"
        )
        print(
            f"compiled evaluation: first {seconds[0]:.1f} s, median after "
            f"{np.median(seconds[1:]) * 1e3:.1f} ms; wall {time.perf_counter() - start:.0f} s"
        )
    return 0 if max(worst.values()) < 1e-10 else 1


if __name__ == "__main__":
    sys.exit(main())
