"""The ``ase-shard`` command line.

::

    ase-shard md [STRUCTURE] [options]     molecular dynamics of a file or a built-in system
    ase-shard bench [STRUCTURE] [options]  time the bare model and ShardedCalculator
    ase-shard info                         MPI library, ranks, devices, versions
    mpirun -n 4 ase-shard md ...           the same, on 4 ranks

Every rank runs the same command (SPMD): all ranks read the same file, build
the same ``Atoms``, draw the same seeded random numbers and drive the same ASE
dynamics; :class:`ShardedCalculator` hands identical results to all of them.
Only rank 0 prints and writes files.

Each subcommand is a function ``add_<name>(subparsers)`` that declares its
arguments and sets ``run`` to a function ``(args) -> exit code``;
:func:`build_parser` registers them.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TextIO

import numpy as np
import torch
from ase import Atoms, units
from ase.build import bulk
from ase.calculators.emt import EMT as AseEMT
from ase.calculators.lj import LennardJones as AseLennardJones
from ase.calculators.morse import MorsePotential as AseMorse
from ase.cluster import Icosahedron
from ase.constraints import FixCom
from ase.io import Trajectory, read
from ase.md.langevin import Langevin
from ase.md.logger import MDLogger
from ase.md.md import MolecularDynamics
from ase.md.nptberendsen import NPTBerendsen
from ase.md.nvtberendsen import NVTBerendsen
from ase.md.velocitydistribution import Stationary, ZeroRotation, thermalize_momenta
from ase.md.verlet import VelocityVerlet
from ase.parallel import parprint, world

import ase_shard
from ase_shard.bench import (
    ML_MODELS,
    NO_EDGE,
    BenchSettings,
    FrameworkSettings,
    format_framework_summary,
    format_summary,
    no_edge_model,
    plot_report,
    run_benchmark,
    run_framework,
)
from ase_shard.calculator import HALOS, ShardedCalculator
from ase_shard.comm import Comm
from ase_shard.models import EMT, LennardJones, Morse
from ase_shard.partition import PARTITIONS

MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "emt": EMT,
    # argon
    "lj": partial(LennardJones, sigma=3.4, epsilon=0.0104, rc=8.5, smooth=True),
    # copper-like, nearest neighbours at r0 = 2.55 Å
    "morse": partial(Morse, epsilon=0.35, r0=2.55, rho0=4.0),
}
# ASE's own calculators with the parameters of MODELS, for `bench --ase-reference`
ASE_CALCULATORS: dict[str, Callable[[], object]] = {
    "emt": AseEMT,
    "lj": partial(AseLennardJones, sigma=3.4, epsilon=0.0104, rc=8.5, smooth=True),
    "morse": partial(AseMorse, epsilon=0.35, r0=2.55, rho0=4.0),
}
ENSEMBLES = ("nve", "langevin", "nvt-berendsen", "npt-berendsen")
# fcc argon at the density of the liquid near its boiling point, 1.40 g/cm³
ARGON_LIQUID_A = 5.74


@dataclass(frozen=True)
class Defaults:
    """What suits a kind of system when the command line does not say."""

    model: str
    temperature: float  # K
    compressibility: float  # 1/bar, for the Berendsen barostat


@dataclass(frozen=True)
class System:
    """A built-in system: ``build(size, seed)``, its default size and defaults."""

    build: Callable[[int, int], Atoms]
    size: int
    size_help: str
    defaults: Defaults


def _cu_bulk(size: int, seed: int) -> Atoms:
    return bulk("Cu", "fcc", a=3.61, cubic=True).repeat(size)


def _cu_cluster(size: int, seed: int) -> Atoms:
    return Icosahedron("Cu", noshells=size, latticeconstant=3.61)


def _ar_liquid(size: int, seed: int) -> Atoms:
    atoms = bulk("Ar", "fcc", a=ARGON_LIQUID_A, cubic=True).repeat(size)
    atoms.rattle(stdev=0.2, seed=seed)
    return atoms


COPPER = Defaults("emt", 300.0, 7e-7)
SYSTEMS = {
    "cu-bulk": System(_cu_bulk, 10, "4 N^3 atoms of fcc Cu", COPPER),
    "cu-cluster": System(_cu_cluster, 11, "Cu icosahedron of N shells", COPPER),
    "ar-liquid": System(_ar_liquid, 10, "4 N^3 Ar atoms", Defaults("lj", 180.0, 2e-4)),
}
FILE_DEFAULTS = COPPER  # EMT, 300 K, a metal's compressibility


class CLIError(Exception):
    """A user error: reported as one line, exit code 2."""


def main(argv: list[str] | None = None) -> int:
    """Run ``ase-shard`` with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error already reported
        return int(exc.code or 0)
    try:
        return args.run(args)
    except Exception as exc:
        # ShardedCalculator raises the same error on every rank, so all ranks get here
        message = str(exc) if isinstance(exc, CLIError) else f"{type(exc).__name__}: {exc}"
        parprint(f"ase-shard {args.command}: error: {' '.join(message.split())}", file=sys.stderr)
        return 2


class _Parser(argparse.ArgumentParser):
    """An argument parser that prints usage and errors on rank 0 only."""

    def _print_message(self, message: str, file: TextIO | None = None) -> None:
        if world.rank == 0:
            super()._print_message(message, file)


def build_parser() -> argparse.ArgumentParser:
    """The ``ase-shard`` parser with one subparser per command."""
    parser = _Parser(
        prog="ase-shard",
        description="Run one ASE system across MPI ranks with a PyTorch potential.",
    )
    parser.add_argument("--version", action="version", version=ase_shard.__version__)
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    add_md(subparsers)
    add_bench(subparsers)
    add_info(subparsers)
    return parser


# ----------------------------------------------------------------------------- md


def add_md(subparsers: argparse._SubParsersAction) -> None:
    """Declare ``ase-shard md``."""
    systems = "; ".join(
        f"{name}: {s.size_help} (default N={s.size}), {s.defaults.model}, "
        f"{s.defaults.temperature:g} K"
        for name, s in SYSTEMS.items()
    )
    md = subparsers.add_parser(
        "md",
        help="molecular dynamics of a structure file or a built-in system",
        description="Molecular dynamics with ShardedCalculator; every rank runs it, rank 0 "
        "prints and writes. Built-in systems: " + systems + ".",
    )
    md.add_argument(
        "structure",
        nargs="?",
        metavar="STRUCTURE",
        help="structure file in any format ase.io.read reads (its last image); momenta in "
        "the file are kept unless --temperature is given",
    )
    md.add_argument("--system", choices=SYSTEMS, help="built-in system (default cu-bulk)")
    md.add_argument("--size", type=int, help="size N of the built-in system (see above)")
    md.add_argument(
        "--model", choices=MODELS, help="potential (default: the system's; emt for files)"
    )
    md.add_argument("--ensemble", choices=ENSEMBLES, default="nve", help="default nve")
    md.add_argument("--steps", type=int, default=100, help="MD steps (default 100)")
    md.add_argument("--timestep", type=float, default=2.0, help="fs (default 2)")
    md.add_argument(
        "--temperature",
        type=float,
        help="K: initial Maxwell-Boltzmann velocities and thermostat target "
        "(default: the system's; 300 K for files)",
    )
    md.add_argument("--seed", type=int, default=42, help="random seed (default 42)")
    md.add_argument("--friction", type=float, default=0.01, help="Langevin, 1/fs (0.01)")
    md.add_argument("--taut", type=float, default=100.0, help="Berendsen T coupling, fs (100)")
    md.add_argument("--taup", type=float, default=1000.0, help="Berendsen P coupling, fs (1000)")
    md.add_argument("--pressure", type=float, default=1.0, help="npt-berendsen, bar (1)")
    md.add_argument(
        "--compressibility", type=float, help="npt-berendsen, 1/bar (default: the system's)"
    )
    md.add_argument("--skin", type=float, default=0.5, help="neighbour skin, Å (0.5)")
    md.add_argument("--partition", choices=PARTITIONS, default="spatial")
    md.add_argument("--trajectory", metavar="FILE", help="ASE trajectory, every --interval")
    md.add_argument("--log", metavar="FILE", help="MDLogger file, every --interval steps")
    md.add_argument("--interval", type=int, default=10, help="steps between frames (10)")
    md.add_argument("--no-progress", action="store_true", help="no progress output on stderr")
    md.set_defaults(run=run_md)


def run_md(args: argparse.Namespace) -> int:
    """``ase-shard md``: build, thermalise, run and summarise."""
    if args.steps < 0 or args.interval < 1 or args.timestep <= 0:
        raise CLIError("--steps must be >= 0, --interval >= 1 and --timestep > 0")
    atoms, defaults, label = load_system(args)
    rng = np.random.default_rng(args.seed)  # the same numbers on every rank
    target = defaults.temperature if args.temperature is None else args.temperature
    if args.temperature is not None or not atoms.get_momenta().any():
        thermalise(atoms, target, rng)

    calc = ShardedCalculator(
        MODELS[args.model or defaults.model](), skin=args.skin, partition=args.partition
    )
    atoms.calc = calc
    dyn = make_dynamics(atoms, args, target, defaults, rng)
    dtype = str(calc.dtype).removeprefix("torch.")
    parprint(
        f"ase-shard md: {label}, {len(atoms)} atoms, {type(calc.model).__name__} on "
        f"{world.size} rank(s) ({calc.device}, {dtype}), {args.ensemble}, "
        f"{args.steps} x {args.timestep:g} fs",
        flush=True,
    )

    progress = None
    if world.rank == 0 and not args.no_progress:
        progress = Progress(args.steps, sys.stderr, live=sys.stderr.isatty())
    tracker = EnergyTracker(atoms, dyn, progress)
    with contextlib.ExitStack() as files:
        if progress is not None:
            files.callback(progress.close)  # ends the bar's line, also before an error message
        if args.trajectory:
            trajectory = files.enter_context(Trajectory(args.trajectory, "w", atoms))
            dyn.attach(trajectory.write, interval=args.interval)
        if args.log:
            logger = files.enter_context(MDLogger(dyn, atoms, args.log, peratom=True, mode="w"))
            dyn.attach(logger, interval=args.interval)
        dyn.attach(tracker, interval=1)
        start = time.perf_counter()
        dyn.run(args.steps)
        wall = time.perf_counter() - start
    print_summary(atoms, args.steps, wall, calc.rebuilds, np.array(tracker.totals))
    return 0


def load_system(args: argparse.Namespace) -> tuple[Atoms, Defaults, str]:
    """The ``Atoms`` to run (identical on every rank), their defaults and a label."""
    if args.structure is not None:
        if args.system is not None or args.size is not None:
            raise CLIError("give a STRUCTURE file or --system/--size, not both")
        return read(args.structure), FILE_DEFAULTS, args.structure
    name = args.system or "cu-bulk"
    system = SYSTEMS[name]
    size = system.size if args.size is None else args.size
    if size < 1:
        raise CLIError(f"--size must be >= 1, not {size}")
    return system.build(size, args.seed), system.defaults, f"{name} N={size}"


def thermalise(atoms: Atoms, temperature: float, rng: np.random.Generator) -> None:
    """Maxwell-Boltzmann momenta at ``temperature`` K, no drift (nor spin if isolated)."""
    thermalize_momenta(atoms, temperature_K=temperature, rng=rng)
    Stationary(atoms)
    if not atoms.pbc.any():
        ZeroRotation(atoms)


def make_dynamics(
    atoms: Atoms,
    args: argparse.Namespace,
    temperature: float,
    defaults: Defaults,
    rng: np.random.Generator,
) -> MolecularDynamics:
    """The ASE integrator of ``args.ensemble``."""
    timestep = args.timestep * units.fs
    if args.ensemble == "nve":
        return VelocityVerlet(atoms, timestep=timestep)
    if args.ensemble == "langevin":
        atoms.constraints = [*atoms.constraints, FixCom()]  # ASE's advice over fixcm=True
        return Langevin(
            atoms,
            timestep=timestep,
            temperature_K=temperature,
            friction=args.friction / units.fs,
            fixcm=False,
            rng=rng,
        )
    if args.ensemble == "nvt-berendsen":
        return NVTBerendsen(
            atoms, timestep=timestep, temperature_K=temperature, taut=args.taut * units.fs
        )
    if atoms.cell.rank != 3:
        raise CLIError(
            f"npt-berendsen scales the cell, but this system's cell has rank "
            f"{atoms.cell.rank}, not 3; use nve, langevin or nvt-berendsen, or give it a cell"
        )
    compressibility = (
        defaults.compressibility if args.compressibility is None else args.compressibility
    )
    return NPTBerendsen(
        atoms,
        timestep=timestep,
        temperature_K=temperature,
        taut=args.taut * units.fs,
        taup=args.taup * units.fs,
        pressure_au=args.pressure * units.bar,
        compressibility_au=compressibility / units.bar,
    )


class EnergyTracker:
    """MD observer (every step, every rank): total energy per atom, and the progress display."""

    def __init__(self, atoms: Atoms, dyn: MolecularDynamics, progress: Progress | None):
        self.atoms = atoms
        self.dyn = dyn
        self.progress = progress
        self.totals: list[float] = []
        self.start = time.perf_counter()

    def __call__(self) -> None:
        atoms = self.atoms
        total = (atoms.get_potential_energy() + atoms.get_kinetic_energy()) / len(atoms)
        self.totals.append(total)
        if self.progress is not None:
            self.progress.update(self.dyn.nsteps, total, time.perf_counter() - self.start)


class Progress:
    """Progress on ``stream``: a bar redrawn in place on a terminal, else a line every 10 %.

    Parameters
    ----------
    total : int
        Number of steps.
    stream : file
        Where to write (rank 0's stderr).
    live : bool
        Redraw one line with ``\\r`` (at most 10 times a second).
    """

    WIDTH = 30

    def __init__(self, total: int, stream: TextIO, live: bool):
        self.total = total
        self.stream = stream
        self.live = live
        self.shown = -1  # last tenth (or redraw time) shown
        self.last_draw = 0.0

    def update(self, done: int, total_energy: float, elapsed: float) -> None:
        """Show step ``done`` of ``total`` after ``elapsed`` s; ``total_energy`` in eV/atom."""
        fraction = done / self.total if self.total else 1.0
        if self.live:
            if done < self.total and elapsed - self.last_draw < 0.1:
                return
            self.last_draw = elapsed
        else:
            tenth = int(10 * fraction)
            if tenth == self.shown:
                return
            self.shown = tenth
        rate = done / elapsed if done and elapsed > 0 else 0.0
        eta = f"{_clock((self.total - done) / rate)}" if rate else "--:--"
        text = (
            f"{done:>{len(str(self.total))}}/{self.total} steps  {rate:7.2f} steps/s  "
            f"ETA {eta}  Etot {total_energy:.6f} eV/atom"
        )
        if self.live:
            filled = int(self.WIDTH * fraction)
            bar = "#" * filled + "-" * (self.WIDTH - filled)
            self.stream.write(f"\r[{bar}] {text}")
        else:
            self.stream.write(f"{100 * fraction:3.0f}% {text}\n")
        self.stream.flush()

    def close(self) -> None:
        """End the redrawn line."""
        if self.live:
            self.stream.write("\n")
            self.stream.flush()


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes:02d}:{seconds:02d}"


def print_summary(
    atoms: Atoms, steps: int, wall: float, rebuilds: int, totals: np.ndarray
) -> None:
    """Rank 0: throughput, rebuilds, total-energy drift per atom and final temperature."""
    n = len(atoms)
    rate = steps / wall if wall > 0 else float("nan")
    lines = [
        "ase-shard md summary",
        f"  atoms          {n}",
        f"  ranks          {world.size}",
        f"  steps          {steps}",
        f"  wall time      {wall:.2f} s",
        f"  steps/s        {rate:.3f}",
        f"  atom-steps/s   {rate * n:.4g}",
        f"  rebuilds       {rebuilds}",
        f"  Etot drift     max |Etot - Etot0| = {np.abs(totals - totals[0]).max():.3e} eV/atom, "
        f"final - initial = {totals[-1] - totals[0]:+.3e} eV/atom",
        f"  final T        {atoms.get_temperature():.2f} K",
    ]
    parprint("\n".join(lines), flush=True)


# ----------------------------------------------------------------------------- bench


def add_bench(subparsers: argparse._SubParsersAction) -> None:
    """Declare ``ase-shard bench``."""
    bench = subparsers.add_parser(
        "bench",
        help="time the bare model and ShardedCalculator on this run's ranks",
        description="In one run: the bare model (the whole system as one graph, same "
        "neighbour-list library, rank 0 alone), ShardedCalculator on one rank (rank 0 alone) "
        "and on all ranks of the run, optionally ASE's own calculator, and the machine's "
        "speed-up ceiling (a fixed single-thread loop, alone and split over the ranks). "
        "Each over steps that reuse the decomposition and steps that rebuild it. Rank 0 "
        "prints a summary and writes JSON and a PNG. Systems and --size as for `md`. "
        "With --framework: what ShardedCalculator costs per MD step next to ASE's own "
        "step. Every rank runs ASE's VelocityVerlet (1 fs, Maxwell-Boltzmann momenta at "
        "300 K drawn with --seed) on the whole system twice, taking turns step by step: "
        "with a calculator returning zeros (the baseline, timed as the whole step) and "
        "with ShardedCalculator on all ranks (timed inside its calculate), on --reuse-steps "
        "steps and --rebuild-steps steps that request a rebuild first. The model is "
        f"'{NO_EDGE}' unless --model says otherwise: Lennard-Jones cut off at 0.3 Å, which "
        "has no pairs, so the sharded time is the framework's own. Rank 0 prints the "
        "medians, their ratio and each rank's CPU time per phase with MPI excluded, and "
        "writes JSON (no PNG).",
    )
    bench.add_argument("structure", nargs="?", metavar="STRUCTURE", help="structure file")
    bench.add_argument("--system", choices=SYSTEMS, help="built-in system (default cu-bulk)")
    bench.add_argument("--size", type=int, help="size N of the built-in system")
    bench.add_argument(
        "--model",
        choices=[*MODELS, *ML_MODELS, NO_EDGE],
        help="potential (default: the system's; with --framework no-edge); sevennet, mace and "
        "nequip are random-weight models of the real architectures (packages sevenn / "
        f"mace-torch / nequip); {NO_EDGE} has no pairs (0.3 Å cutoff; --framework only)",
    )
    bench.add_argument("--dtype", choices=("float64", "float32"), help="default: the model's")
    bench.add_argument("--ml-cutoff", type=float, default=5.0, help="ML models, Å (5)")
    bench.add_argument("--ml-channels", type=int, default=32, help="ML models' width (32)")
    bench.add_argument(
        "--ml-layers", type=int, help="ML interaction layers (sevennet 3, mace 2, nequip 3)"
    )
    bench.add_argument("--reuse-steps", type=int, default=5, help="timed reuse steps (5)")
    bench.add_argument("--rebuild-steps", type=int, default=3, help="timed rebuild steps (3)")
    bench.add_argument("--skin", type=float, default=0.5, help="neighbour skin, Å (0.5)")
    bench.add_argument("--partition", choices=PARTITIONS, default="spatial")
    bench.add_argument(
        "--halo", choices=HALOS, help="ghost scheme (default: layer where the model supports it)"
    )
    bench.add_argument("--device", help="torch device (default: the calculator's choice)")
    bench.add_argument(
        "--threads",
        type=int,
        help="torch threads per rank (default: OMP_NUM_THREADS, else "
        "the calculator's share of the node's cores)",
    )
    bench.add_argument(
        "--seed", type=int, default=42, help="displacements, weights, --framework momenta (42)"
    )
    bench.add_argument(
        "--ase-reference", action="store_true", help="also time ASE's own EMT/LJ/Morse"
    )
    bench.add_argument(
        "--no-serial-reference",
        action="store_true",
        help="on several ranks, skip ShardedCalculator on rank 0 alone",
    )
    bench.add_argument(
        "--ceiling-seconds", type=float, default=0.5, help="length of the ceiling loop (0.5 s)"
    )
    bench.add_argument(
        "--framework",
        action="store_true",
        help="measure the framework's cost per MD step against ASE's VelocityVerlet step "
        "instead (see above); --ase-reference, --no-serial-reference, --ceiling-seconds "
        "and the PNG do not apply",
    )
    bench.add_argument(
        "--json",
        help="report file (default ase-shard-bench.json; with --framework "
        "ase-shard-framework.json)",
    )
    bench.add_argument("--plot", default="ase-shard-bench.png", help="PNG (needs matplotlib)")
    bench.add_argument("--no-plot", action="store_true", help="write no PNG")
    bench.set_defaults(run=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    """``ase-shard bench``: measure, then rank 0 prints and writes the report."""
    if args.threads is not None:
        if args.threads < 1:
            raise CLIError(f"--threads must be >= 1, not {args.threads}")
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the calculator keeps it
        torch.set_num_threads(args.threads)
    atoms, defaults, label = load_system(args)
    name = args.model or (NO_EDGE if args.framework else defaults.model)
    if args.ase_reference and args.framework:
        raise CLIError("--ase-reference does not apply to --framework")
    if args.ase_reference and name not in ASE_CALCULATORS:
        raise CLIError(f"--ase-reference needs one of {', '.join(ASE_CALCULATORS)}, not {name}")
    if name == NO_EDGE and not args.framework:
        raise CLIError(f"--model {NO_EDGE} is for --framework only")
    model = bench_model(name, atoms, args)
    steps = {
        "reuse_steps": args.reuse_steps,
        "rebuild_steps": args.rebuild_steps,
        "skin": args.skin,
        "seed": args.seed,
        "calculator": {"partition": args.partition, "halo": args.halo, "device": args.device},
    }
    try:
        if args.framework:
            settings = FrameworkSettings(**steps)
        else:
            settings = BenchSettings(
                **steps,
                serial_reference=not args.no_serial_reference,
                ceiling_seconds=args.ceiling_seconds,
            )
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    mode = " --framework" if args.framework else ""
    parprint(
        f"ase-shard bench{mode}: {label}, {len(atoms)} atoms, {name} on {world.size} rank(s)",
        flush=True,
    )
    arguments = {k: v for k, v in vars(args).items() if k != "run"}
    labels = {"system": label, "model": name, "arguments": arguments}
    dtype = getattr(torch, args.dtype) if args.dtype else None
    if args.framework:
        report = run_framework(atoms, model, settings, dtype=dtype, labels=labels)
    else:
        report = run_benchmark(
            atoms,
            model,
            settings,
            dtype=dtype,
            ase_calculator=ASE_CALCULATORS[name] if args.ase_reference else None,
            labels=labels,
        )
    if report is None:
        return 0
    path = args.json or ("ase-shard-framework.json" if args.framework else "ase-shard-bench.json")
    with open(path, "w") as file:
        json.dump(report, file, indent=1)
    outputs = [path]
    if args.framework:
        summary = format_framework_summary(report)
    else:
        summary = format_summary(report)
        if not args.no_plot:
            plot_report(report, args.plot)
            outputs.append(args.plot)
    print(summary + "\n\n  wrote " + ", ".join(outputs), flush=True)
    return 0


def bench_model(name: str, atoms: Atoms, args: argparse.Namespace) -> torch.nn.Module:
    """The model ``name`` of ``ase-shard bench``, built identically on every rank."""
    if name == NO_EDGE:
        return no_edge_model()
    if name in ML_MODELS:
        layers = {} if args.ml_layers is None else {"num_layers": args.ml_layers}
        return ML_MODELS[name](
            atoms.numbers,
            cutoff=args.ml_cutoff,
            channels=args.ml_channels,
            seed=args.seed,
            **layers,
        )
    return MODELS[name]()


# ----------------------------------------------------------------------------- info


def add_info(subparsers: argparse._SubParsersAction) -> None:
    """Declare ``ase-shard info``."""
    info = subparsers.add_parser(
        "info",
        help="MPI library, ranks, hosts, devices and versions",
        description="What this job runs on: MPI library, ranks with their hosts and devices, "
        "and the versions of torch, ase, numpy, vesin and mpi4py. Rank 0 prints.",
    )
    info.set_defaults(run=run_info)


def run_info(args: argparse.Namespace) -> int:
    """``ase-shard info``: what this job runs on (rank 0 prints)."""
    comm = Comm()
    # the device and thread count that `ase-shard md` would use on this rank
    device = ShardedCalculator(EMT()).device
    ranks = comm.gather((socket.gethostname(), str(device), torch.get_num_threads()))
    if not comm.is_root:
        return 0
    mpi = sys.modules.get("mpi4py.MPI")
    library = (
        mpi.Get_library_version().strip().splitlines()[0]
        if mpi is not None
        else "no MPI (serial: not started by an MPI launcher)"
    )
    cuda = torch.cuda.is_available()
    lines = [
        f"ase_shard      {ase_shard.__version__}",
        f"python         {platform.python_version()}",
        f"MPI            {library}",
        f"ranks          {comm.size}",
    ]
    lines += [
        f"  rank {rank:<4}    host {host}, device {dev}, {threads} torch thread(s)"
        for rank, (host, dev, threads) in enumerate(ranks)
    ]
    lines += [
        f"torch          {torch.__version__}",
        f"CUDA           {'available' if cuda else 'not available'}"
        + (f", {torch.cuda.device_count()} device(s), CUDA {torch.version.cuda}" if cuda else ""),
    ]
    lines += [f"{name:<15}{_version(name)}" for name in ("ase", "numpy", "vesin", "mpi4py")]
    print("\n".join(lines), flush=True)
    return 0


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


if __name__ == "__main__":
    sys.exit(main())
