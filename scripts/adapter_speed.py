"""Time each ML adapter on one rank against the package's own ASE calculator.

For every family whose package is installed in the running environment
(SevenNet, NequIP, Allegro, MatterSim, CHGNet, UMA, Orb-v3 conservative and direct,
and metatrain's PET through metatomic, in ``.venv``; MACE in ``.venv-mace``), the
script builds a float64 model of a realistic size (random weights, with the builders
of the tests, ``tests/test_<family>.py``; CHGNet's shipped 0.3.0 weights), and a
periodic fcc alloy of a few hundred atoms (and, with ``--systems bulk cluster``, a
non-periodic icosahedral cluster). It then evaluates the same sequence of geometries with

- ``own``: the package's calculator (``SevenNetCalculator``, ``MACECalculator``,
  nequip's ``NequIPCalculator``, ``MatterSimCalculator``, ``CHGNetCalculator``,
  ``FAIRChemCalculator``, ``ORBCalculator``, ``MetatomicCalculator``), and
- ``sharded``: ``ShardedCalculator(adapter, comm=MPI.COMM_SELF)`` (its default
  halo, or ``--halo``),

taking turns step by step (the order swaps every step), so that the changing
load of a shared machine hits both alike. Every step moves each atom by a small
random displacement from the starting geometry, so both recompute; the sharded
calculator keeps its neighbour list within its skin (as in MD), the package
calculators build theirs on every call. ``--rebuild`` makes the sharded
calculator rebuild its decomposition and neighbour list on every call instead.
Both run with one torch thread. Each step's energies and forces are compared,
and the script exits with status 1 if any relative difference (max abs
difference over max abs value) exceeds ``--rtol``::

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python scripts/adapter_speed.py
    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv-mace/bin/python scripts/adapter_speed.py \\
        --json mace.json

Prints a Markdown table: the median wall time per evaluation of each
calculator; the median over steps of the ratio sharded / own of the two
evaluations of a step, in wall time and in CPU time (process time, less
sensitive than wall time to other jobs on a shared machine); and the worst
energy and force differences over all steps. ``--json`` also writes every
step's times.
"""

from __future__ import annotations

import ase_shard  # first: initialises MPI before ASE touches ase.parallel.world

# isort: split

import argparse
import gc
import importlib.util
import json
import os
import platform
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
from ase import Atoms
from ase.build import bulk
from ase.calculators.calculator import Calculator
from ase.cluster import Icosahedron

from ase_shard import ShardedCalculator

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from oracles import rel_err  # noqa: E402

# what each family needs installed, and the elements its test builder knows
REQUIRES = {
    "sevennet": ("sevenn",),
    "nequip": ("nequip",),
    "allegro": ("nequip", "allegro"),
    "mace": ("mace",),
    "mattersim": ("mattersim",),
    "chgnet": ("chgnet",),
    "uma": ("fairchem.core",),
    "orb": ("orb_models",),
    "orb-direct": ("orb_models",),
    "pet": ("metatrain", "metatomic_ase"),
}
ELEMENTS = {
    "sevennet": (29, 47, 79),
    "nequip": (29, 47, 79),
    "allegro": (29, 47, 79),
    "mace": (29, 13, 47),
    "mattersim": (29, 47, 79),
    "chgnet": (29, 47, 79),
    "uma": (29, 47, 79),
    "orb": (29, 47, 79),
    "orb-direct": (29, 47, 79),
    "pet": (29, 47, 79),
}


@dataclass
class Subjects:
    """One family's two calculators on the same weights."""

    description: str
    own: Calculator
    adapter: torch.nn.Module


def _sevennet(workdir: Path) -> Subjects:
    from test_sevenn import reference_calculator, tiny_sevennet

    from ase_shard.models.sevenn import SevenNet

    network = tiny_sevennet(cutoff=4.5, num_layers=3, channels=32)
    return Subjects(
        "SevenNet, 3 layers, 32 channels, lmax 2, cutoff 4.5 Å",
        reference_calculator(network),
        SevenNet(network),
    )


def _mace(workdir: Path) -> Subjects:
    from mace.calculators import MACECalculator
    from test_mace import make_mace, save_model

    from ase_shard.models.mace import MACE

    network = make_mace("scale_shift", r_max=4.5, channels=64, max_ell=2)
    path = save_model(network, workdir / "mace.model")
    own = MACECalculator(model_paths=path, device="cpu", default_dtype="float64")
    return Subjects(
        "ScaleShiftMACE, 2 layers, 64x0e+64x1o, max_ell 2, correlation 3, r_max 4.5 Å",
        own,
        MACE(network),
    )


def _nequip_family(kind: str, workdir: Path) -> Subjects:
    from test_nequip import BUILDERS, nequip_calculator

    build, adapter = BUILDERS[kind]
    if kind == "nequip":
        size = {"num_layers": 3, "num_features": 32, "l_max": 2, "radial_mlp_width": 64}
        description = "NequIP, 3 layers, 32 features, l_max 2, r_max 4.5 Å"
    else:
        size = {
            "num_layers": 2,
            "l_max": 2,
            "num_scalar_features": 32,
            "num_tensor_features": 16,
            "allegro_mlp_hidden_layers_width": 64,
            "readout_mlp_hidden_layers_width": 32,
        }
        description = "Allegro, 2 layers, 32 scalar / 16 tensor features, l_max 2, r_max 4.5 Å"
    # two builds with the same seed: the same weights, as in tests/test_nequip.py
    return Subjects(
        description,
        nequip_calculator(build(r_max=4.5, **size)),
        adapter(build(r_max=4.5, **size)),
    )


def _mattersim(workdir: Path) -> Subjects:
    from test_mattersim import reference_calculator, tiny_m3gnet

    from ase_shard.models.mattersim import MatterSim

    # MatterSim-v1's sizes (mattersim's defaults), random weights, float64
    network = tiny_m3gnet(
        units=128, num_blocks=4, max_l=4, max_n=4, cutoff=5.0, threebody_cutoff=4.0
    ).double()
    return Subjects(
        "MatterSim (M3GNet), 4 blocks, 128 units, max_l = max_n = 4, cutoffs 5 and 4 Å",
        reference_calculator(network),
        MatterSim(network),
    )


def _chgnet(workdir: Path) -> Subjects:
    from chgnet.model import CHGNet as ChgnetModel
    from test_chgnet import reference_calculator

    from ase_shard.models.chgnet import CHGNet

    # the pretrained 0.3.0 shipped in chgnet's wheel, in float64
    network = ChgnetModel.load(model_name="0.3.0", use_device="cpu", verbose=False).double()
    return Subjects(
        "CHGNet 0.3.0 (shipped weights), float64, atom graph 6 Å, bond graph 3 Å",
        reference_calculator(network),
        CHGNet(network),
    )


def _uma(workdir: Path) -> Subjects:
    from fairchem.core.calculate.ase_calculator import FAIRChemCalculator
    from test_uma import predict_unit, write_tiny_uma

    from ase_shard.models.uma import UMA

    # UMA-S's sizes (docs/models.md), random weights, float64, the omat task
    sizes = {"sphere_channels": 128, "hidden_channels": 128, "edge_channels": 128}
    sizes |= {"num_distance_basis": 64, "num_layers": 4, "cutoff": 6.0, "num_experts": 32}
    path = write_tiny_uma(str(workdir / "uma.pt"), **sizes)
    return Subjects(
        "UMA (eSCN-MD, MoLE), UMA-S sizes: 4 layers, 128 channels, 32 experts, cutoff 6 Å",
        FAIRChemCalculator(predict_unit(path), task_name="omat"),
        UMA(path, task="omat", dtype=torch.float64),
    )


def _orb(direct: bool, workdir: Path) -> Subjects:
    from orb_models.forcefield.atomic_system import SystemConfig
    from orb_models.forcefield.pretrained import (
        orb_v3_conservative_architecture,
        orb_v3_direct_architecture,
    )
    from test_orb import orb_calculator

    from ase_shard.models.orb import Orb

    # Orb-v3 at its pretrained size, random weights, float64
    torch.manual_seed(0)
    config = SystemConfig(radius=6.0, max_num_neighbors=120)
    build = orb_v3_direct_architecture if direct else orb_v3_conservative_architecture
    network = build(system_config=config, device="cpu").double()
    kind = "direct" if direct else "conservative"
    return Subjects(
        f"Orb-v3 {kind}, pretrained sizes: 5 steps, 256 latent, radius 6 Å, cap 120",
        orb_calculator(network),
        Orb(network),
    )


def _pet(workdir: Path) -> Subjects:
    from metatomic_ase import MetatomicCalculator
    from pet_models import LAYERS, tiny_pet

    from ase_shard.models.metatomic import Metatomic

    # metatrain's default PET sizes (PET-MAD's architecture), random weights, float64,
    # the feedforward featurizer, whose reach is one cutoff past the declared one
    cutoff = 4.5
    model = tiny_pet(
        "feedforward",
        cutoff=cutoff,
        d_pet=128,
        d_head=128,
        d_node=256,
        d_feedforward=256,
        num_heads=8,
        num_attention_layers=2,
    )
    return Subjects(
        "PET (metatrain), default sizes: 2 GNN layers, d_pet 128, cutoff 4.5 Å, feedforward",
        MetatomicCalculator(model),
        Metatomic(model, interaction_range=(LAYERS + 1) * cutoff),
    )


FAMILIES: dict[str, Callable[[Path], Subjects]] = {
    "sevennet": _sevennet,
    "nequip": partial(_nequip_family, "nequip"),
    "allegro": partial(_nequip_family, "allegro"),
    "mace": _mace,
    "mattersim": _mattersim,
    "chgnet": _chgnet,
    "uma": _uma,
    "orb": partial(_orb, False),
    "orb-direct": partial(_orb, True),
    "pet": _pet,
}


def _alloy(atoms: Atoms, elements: tuple[int, ...], seed: int) -> Atoms:
    """``atoms`` with 60/25/15 % of ``elements``, rattled by 0.1 Å."""
    rng = np.random.default_rng(seed)
    atoms.numbers = rng.choice(elements, len(atoms), p=[0.6, 0.25, 0.15])
    atoms.rattle(stdev=0.1, seed=seed)
    return atoms


def make_system(name: str, elements: tuple[int, ...]) -> Atoms:
    """``bulk``: 256-atom periodic fcc alloy (4x4x4 cubic cells, a = 3.8 Å);
    ``cluster``: 309-atom icosahedron, no cell."""
    if name == "bulk":
        atoms = bulk("Cu", "fcc", a=3.8, cubic=True).repeat(4)
    else:
        atoms = Icosahedron("Cu", noshells=5, latticeconstant=3.8)
        atoms.cell = np.zeros((3, 3))
        atoms.pbc = False
    return _alloy(atoms, elements, seed=1)


def available(family: str) -> bool:
    """Whether the packages ``family`` needs are importable here."""
    return all(_importable(name) for name in REQUIRES[family])


def _importable(name: str) -> bool:
    """Whether module ``name`` is found (for ``a.b``, ``find_spec`` raises without ``a``)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def _serial_comm():
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi.COMM_SELF if mpi is not None else None


def _evaluate(atoms: Atoms, positions: np.ndarray, before=None) -> tuple[float, float, dict]:
    """Wall and CPU seconds of one energy + forces (+ stress) evaluation, and its results."""
    atoms.positions = positions
    if before is not None:
        before()
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    forces = atoms.get_forces()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return wall, cpu, {"energy": np.asarray(atoms.get_potential_energy()), "forces": forces}


def measure(
    family: str,
    system: str,
    subjects: Subjects,
    *,
    steps: int,
    warmup: int,
    amplitude: float,
    rebuild: bool,
    halo: str | None = None,
    seed: int = 0,
) -> dict:
    """Time ``own`` and ``sharded`` in turns on the same geometries."""
    start = make_system(system, ELEMENTS[family])
    own, sharded = start.copy(), start.copy()
    own.calc = subjects.own
    sharded.calc = ShardedCalculator(subjects.adapter, comm=_serial_comm(), halo=halo)
    before = sharded.calc.request_rebuild if rebuild else None
    rng = np.random.default_rng(seed)
    times: dict[str, list[float]] = {"own": [], "sharded": []}
    cpu_times: dict[str, list[float]] = {"own": [], "sharded": []}
    errors = {"energy": 0.0, "forces": 0.0}
    for step in range(warmup + steps):
        positions = start.positions + rng.normal(0.0, amplitude, start.positions.shape)
        turns = [("own", own, None), ("sharded", sharded, before)]
        out = {}
        for name, atoms, hook in turns if step % 2 == 0 else turns[::-1]:
            wall, cpu, out[name] = _evaluate(atoms, positions, hook)
            if step >= warmup:
                times[name].append(wall)
                cpu_times[name].append(cpu)
        for key in errors:
            errors[key] = max(errors[key], rel_err(out["sharded"][key], out["own"][key]))
    median = {name: float(np.median(values)) for name, values in times.items()}
    median_cpu = {name: float(np.median(values)) for name, values in cpu_times.items()}
    ratios = np.divide(times["sharded"], times["own"])
    cpu_ratios = np.divide(cpu_times["sharded"], cpu_times["own"])
    return {
        "family": family,
        "model": subjects.description,
        "system": system,
        "atoms": len(start),
        "halo": sharded.calc.parameters["halo"],
        "rebuilds": sharded.calc.rebuilds,
        "steps": steps,
        "times_s": times,
        "cpu_times_s": cpu_times,
        "median_ms": {name: 1e3 * value for name, value in median.items()},
        "median_cpu_ms": {name: 1e3 * value for name, value in median_cpu.items()},
        "ratio": float(np.median(ratios)),
        "cpu_ratio": float(np.median(cpu_ratios)),
        "max_rel_diff": errors,
    }


def format_table(rows: list[dict]) -> str:
    """Markdown table of the measurements."""
    lines = [
        "| family | system | atoms | own (ms) | sharded (ms) | sharded / own "
        "| CPU time sharded / own | max rel. diff. E | max rel. diff. F |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ms = row["median_ms"]
        diff = row["max_rel_diff"]
        lines.append(
            f"| {row['family']} | {row['system']} | {row['atoms']} | {ms['own']:.0f} "
            f"| {ms['sharded']:.0f} | {row['ratio']:.2f} | {row['cpu_ratio']:.2f} "
            f"| {diff['energy']:.1e} | {diff['forces']:.1e} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--families",
        nargs="+",
        choices=sorted(FAMILIES),
        help="default: every family installed here",
    )
    parser.add_argument("--systems", nargs="+", choices=["bulk", "cluster"], default=["bulk"])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per calculator")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument(
        "--amplitude", type=float, default=0.02, help="displacement stdev per step (Å)"
    )
    parser.add_argument(
        "--rebuild", action="store_true", help="sharded: rebuild the decomposition every call"
    )
    parser.add_argument(
        "--halo", choices=["layer", "full"], help="sharded: the halo (default: the calculator's)"
    )
    parser.add_argument("--rtol", type=float, default=1e-10, help="agreement required")
    parser.add_argument("--json", help="write the measurements (per-step times too) here")
    args = parser.parse_args(argv)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download weights
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")  # the packages' deprecation and accelerator notices
    families = args.families or [f for f in FAMILIES if available(f)]
    load = {"start": os.getloadavg()[0]}
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for family in families:
            subjects = FAMILIES[family](Path(workdir))
            print(f"{family}: {subjects.description}", flush=True)
            for system in args.systems:
                row = measure(
                    family,
                    system,
                    subjects,
                    steps=args.steps,
                    warmup=args.warmup,
                    amplitude=args.amplitude,
                    rebuild=args.rebuild,
                    halo=args.halo,
                )
                rows.append(row)
                print(format_table([row]).splitlines()[-1], flush=True)
    load["end"] = os.getloadavg()[0]
    print(f"\nload average (1 min) at start {load['start']:.1f}, at end {load['end']:.1f}")
    print(format_table(rows))
    failed = [
        f"{row['family']}/{row['system']}"
        for row in rows
        if max(row["max_rel_diff"].values()) > args.rtol
    ]
    if failed:
        print(f"results differ by more than {args.rtol:g}: {', '.join(failed)}")
    if args.json:
        report = {
            "torch": torch.__version__,
            "ase_shard": ase_shard.__version__,
            "python": platform.python_version(),
            "threads": torch.get_num_threads(),
            "load_average": load,
            "rebuild_every_call": args.rebuild,
            "amplitude": args.amplitude,
            "rows": rows,
        }
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
