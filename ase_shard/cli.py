"""The ``ase-shard`` command line.

::

    ase-shard md [STRUCTURE] [options]     molecular dynamics of a file or a built-in system
    ase-shard bench [STRUCTURE] [options]  time the bare model and ShardedCalculator
    ase-shard info [--models]              MPI library, ranks, devices, versions, models
    ase-shard check --model MODEL          a model on P ranks vs 1 rank vs its own calculator
    mpirun -n 4 ase-shard md ...           the same, on 4 ranks

Every rank runs the same command (SPMD): all ranks read the same file, build
the same ``Atoms``, draw the same seeded random numbers and drive the same ASE
dynamics; :class:`ShardedCalculator` hands identical results to all of them.
Only rank 0 prints and writes files.

This module only parses arguments and resolves names, so that ``--help`` and
usage errors answer at once: torch, the calculator and the models are imported
inside the subcommands that run them (the MD driver lives in
:mod:`ase_shard.md`). Each subcommand is a function ``add_<name>(subparsers)``
that declares its arguments and sets ``run`` to a function ``(args) -> exit
code``; :func:`build_parser` registers them.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import math
import os
import platform
import socket
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

import ase_shard  # first: under a launcher it initialises MPI before ASE picks its world

# isort: split

from ase.parallel import parprint, world

if TYPE_CHECKING:
    from ase import Atoms

from ase_shard.presets import (
    ADAPTER_PACKAGES,
    BENCH_MODELS,
    BUILTIN_MODELS,
    CHGNET_MODELS,
    ENSEMBLES,
    MATTERSIM_CHECKPOINTS,
    MATTERSIM_FOLDER,
    MODEL_FILES,
    NO_EDGE,
    ORB_MODELS,
    PREFIXED_FILES,
    SEVENN_CHECKPOINTS,
    SYSTEMS,
    CLIError,
    ModelSpec,
    downloaded_mattersim,
    load_system,
    resolve_model,
    shipped_checkpoints,
)

# choices spelled out here, not imported, so that parsing needs no torch;
# tests/test_cli_start.py checks them against the modules that define them
PEERS = ("lammps", "asap3", "torchsim")  # ase_shard.peers.PEERS
HALOS = ("layer", "full")  # ase_shard.settings.HALOS
PARTITIONS = ("spatial", "contiguous")  # ase_shard.partition.PARTITIONS
BALANCES = ("work", "count")  # ase_shard.balance.BALANCES
DTYPES = ("float64", "float32")


@dataclass(frozen=True)
class Number:
    """An argparse ``type`` for a numeric option: a ``kind`` (int or float) that is
    finite and at least ``minimum`` (above it, with ``strict``). argparse reports a
    refusal as ``argument --OPTION: must be ..., not 'VALUE'`` and exits with status 2,
    before anything runs."""

    kind: type
    minimum: float | None = None
    strict: bool = False

    def __call__(self, text: str) -> int | float:
        try:
            value = self.kind(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or (self.minimum is not None and not self._above(value)):
            raise argparse.ArgumentTypeError(f"must be {self}, not {text!r}")
        return value

    def _above(self, value: float) -> bool:
        return value > self.minimum if self.strict else value >= self.minimum

    def __str__(self) -> str:
        what = "an integer" if self.kind is int else "a finite number"
        if self.minimum is None:
            return what
        return f"{what} {'>' if self.strict else '>='} {self.minimum:g}"


FINITE = Number(float)
POSITIVE = Number(float, 0, strict=True)
NON_NEGATIVE = Number(float, 0)
POSITIVE_INT = Number(int, 1)
NON_NEGATIVE_INT = Number(int, 0)


def main(argv: list[str] | None = None) -> int:
    """Run ``ase-shard`` with ``argv`` (default ``sys.argv[1:]``); return the exit code.

    Exit codes: 0 done, 1 the MD run became unstable (:class:`ase_shard.md.Unstable`),
    2 a usage or input error, 130 interrupted (SIGINT, SIGTERM or SIGUSR1).
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error already reported
        return int(exc.code or 0)
    if args.command == "md":  # for --resume, which options the command line gave
        args.given = given_options(sys.argv[1:] if argv is None else argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:  # a second Ctrl-C, or one outside the MD loop
        parprint(f"ase-shard {args.command}: interrupted", file=sys.stderr, flush=True)
        return 130
    except Exception as exc:
        # ShardedCalculator raises the same error on every rank, so all ranks get here
        message = str(exc) if isinstance(exc, CLIError) else f"{type(exc).__name__}: {exc}"
        parprint(f"ase-shard {args.command}: error: {' '.join(message.split())}", file=sys.stderr)
        return 2


def given_options(argv: list[str]) -> frozenset[str]:
    """The options ``argv`` gives (their ``dest``), not those left at their defaults:
    ``argv`` parsed again with every default of every command suppressed."""
    parser = build_parser()
    # argparse keeps a parser's commands on its subparsers action only
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for command in commands.choices.values():
        command._defaults.clear()
        for action in command._actions:
            action.default = argparse.SUPPRESS
    return frozenset(vars(parser.parse_args(argv))) - {"command"}


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
    add_check(subparsers)
    add_convert(subparsers)
    add_plan(subparsers)
    return parser


# ----------------------------------------------------------------------------- models


def _add_model_options(
    parser: argparse.ArgumentParser, bench: bool, dispersion: bool = True
) -> None:
    """``--model``, ``--modality``, ``--interaction-range`` and (``dispersion``) ``--d3``,
    shared by ``md``, ``bench`` and ``check`` (which compares a model with its package's
    own calculator: no ``--d3``)."""
    more = (
        f"; {', '.join(BENCH_MODELS)}: random-weight models of the real architectures; "
        f"{NO_EDGE}: no pairs (--framework only)"
        if bench
        else ""
    )
    parser.add_argument(
        "--model",
        metavar="MODEL",
        help="potential: emt, lj (argon), morse (copper-like), a pretrained SevenNet "
        "checkpoint shipped with sevenn (7net-0, 7net-l3i5, 7net-mf-0, ...: see "
        "`ase-shard info --models`), CHGNet (chgnet, chgnet-0.2.0, ...), or a model file: "
        "SevenNet .pth, MACE .model, NequIP/Allegro .nequip.zip or .ckpt, or KIND:PATH "
        "(sevenn, mace, nequip, metatomic, uma, mattersim: e.g. metatomic:pet-mad.pt), or "
        "Orb-v3 as "
        "orb:FILE.ckpt or orb:NAME (default: the "
        f"system's; emt for files){more}",
    )
    parser.add_argument(
        "--modality",
        help="fidelity of a multi-fidelity SevenNet model (7net-mf-0: PBE or R2SCAN), or "
        "the head of a multi-head MACE model, or the task of a UMA model (omat, omol, oc20, "
        "odac, omc)",
    )
    parser.add_argument(
        "--interaction-range",
        type=POSITIVE,
        metavar="Å",
        help="a metatomic model's reach when it is longer than the model declares, which "
        "sets the halo (PET with metatrain's feedforward featurizer: (num_gnn_layers + 1) x "
        "cutoff; see docs/models.md)",
    )
    if not dispersion:
        return
    parser.add_argument(
        "--d3",
        metavar="METHOD",
        help="add Grimme's D3(BJ) dispersion with the three-body term, with the damping "
        "parameters of this functional (pbe, r2scan, b3lyp, ...; as the dftd3 package)",
    )


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
        "prints and writes. Built-in systems: " + systems + ". Exit codes: 0 done, 1 the "
        "run blew up (non-finite energy or forces, T above 10 x max(target or initial T, "
        "300 K), an atom far outside the box along a non-periodic axis), 2 usage or input "
        "error, 130 interrupted (Ctrl-C, SIGTERM, SIGUSR1: stops at the end of the step "
        "and writes that step's frame).",
    )
    md.add_argument(
        "structure",
        nargs="?",
        metavar="STRUCTURE",
        help="structure file in any format ase.io.read reads (its last image); momenta in "
        "the file are kept unless --temperature is given",
    )
    md.add_argument("--system", choices=SYSTEMS, help="built-in system (default cu-bulk)")
    md.add_argument("--size", type=POSITIVE_INT, help="size N of the built-in system (see above)")
    md.add_argument(
        "--restart",
        metavar="TRAJ",
        help="continue from the last frame of a trajectory written by ase-shard md "
        "(positions, momenta, cell, step, time) with the model its frames record (another "
        "--model is refused), and append to it",
    )
    _add_model_options(md, bench=False)
    md.add_argument(
        "--coulomb",
        choices=("ewald", "pme"),
        help="add the electrostatic energy of the structure's initial charges (e.g. an "
        "extended XYZ file's initial_charges), by Ewald or PME with torch-pme's kernels: 8 Å "
        "real-space cutoff, accuracy 1e-6 (docs/models.md); the cell must be periodic along "
        "all three axes",
    )
    md.add_argument("--ensemble", choices=ENSEMBLES, default="nve", help="default nve")
    md.add_argument("--steps", type=NON_NEGATIVE_INT, default=100, help="MD steps (default 100)")
    md.add_argument(
        "--upto",
        action="store_true",
        help="--steps is the step to end at, counted from the start of the whole run (as "
        "LAMMPS's run N upto): a --restart runs the steps that remain, and exits 0 at once "
        "when none do, so that a job script resubmitted with the same command finishes",
    )
    md.add_argument("--timestep", type=POSITIVE, default=2.0, help="fs (default 2)")
    md.add_argument(
        "--temperature",
        type=NON_NEGATIVE,
        help="K: thermostat target, and initial Maxwell-Boltzmann momenta rescaled so that "
        "the run starts at exactly this temperature (default: the system's; 300 K for files)",
    )
    md.add_argument("--seed", type=NON_NEGATIVE_INT, default=42, help="random seed (default 42)")
    md.add_argument("--friction", type=NON_NEGATIVE, default=0.01, help="Langevin, 1/fs (0.01)")
    md.add_argument(
        "--taut",
        type=POSITIVE,
        default=100.0,
        help="thermostat time constant, fs: Berendsen and Bussi coupling, Nose-Hoover and "
        "MTK damping (100)",
    )
    md.add_argument(
        "--taup",
        type=POSITIVE,
        default=1000.0,
        help="barostat time constant, fs: Berendsen coupling, MTK damping (1000)",
    )
    md.add_argument("--pressure", type=FINITE, default=1.0, help="barostats, bar (1)")
    md.add_argument(
        "--compressibility", type=POSITIVE, help="npt-berendsen, 1/bar (default: the system's)"
    )
    _add_calculator_options(md)
    md.add_argument(
        "--trajectory",
        metavar="FILE",
        help="frames every --interval steps, format from the name (.traj: ASE trajectory; "
        ".xyz/.extxyz: extended XYZ with energy and forces; any multi-image format of "
        "ase.io.write), appended frame by frame by rank 0; NAME.shards: a directory every "
        "rank writes its own atoms to, nothing gathered (ase-shard convert writes it as "
        ".traj or extended XYZ)",
    )
    md.add_argument(
        "--log",
        metavar="FILE",
        help="table every --interval steps ('-': stdout): step, time, energies per atom, "
        "T, and pressure and volume with npt-berendsen",
    )
    md.add_argument("--interval", type=POSITIVE_INT, default=10, help="steps between frames (10)")
    md.add_argument(
        "--distributed",
        action="store_true",
        help="each rank holds and integrates only its own atoms (nve, langevin); frames "
        "and log rows are gathered to rank 0 every --interval steps",
    )
    md.add_argument("--no-progress", action="store_true", help="no progress output on stderr")
    md.add_argument(
        "--plan",
        action="store_true",
        help="print each rank's planned atoms, ghosts, edges, halo bytes and peak memory "
        "before the run (as `ase-shard plan` does for this run's rank count, calibrating "
        "on rank 0); an out-of-memory error then quotes the rank's estimate",
    )
    md.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="write the run's whole state to DIR every --checkpoint-every steps, at the "
        "end, and when stopped by a signal: the atoms with every array, the integrator's "
        "variables and random state, the model and these options (each rank its own "
        "atoms with --distributed); written atomically, the last --checkpoint-keep kept",
    )
    md.add_argument(
        "--checkpoint-every", type=POSITIVE_INT, default=1000, help="steps (default 1000)"
    )
    md.add_argument(
        "--checkpoint-keep", type=POSITIVE_INT, default=2, help="checkpoints kept (default 2)"
    )
    md.add_argument(
        "--resume",
        metavar="DIR",
        help="continue the run whose checkpoints are in DIR from the newest: the same "
        "system, model, ensemble, options and random numbers, to the step it was to end "
        "at (or --steps); frames and log rows written after the checkpoint are dropped "
        "and written again; exits 0 at once when the run is complete. Any number of "
        "ranks; options that change the run are refused",
    )
    md.set_defaults(run=run_md)


def _add_calculator_options(parser: argparse.ArgumentParser) -> None:
    """The ShardedCalculator options ``md`` and ``bench`` share."""
    parser.add_argument("--skin", type=NON_NEGATIVE, default=0.5, help="neighbour skin, Å (0.5)")
    parser.add_argument("--partition", choices=PARTITIONS, default="spatial")
    parser.add_argument(
        "--balance",
        choices=BALANCES,
        default="work",
        help="what the spatial cuts balance: each atom's edges (work) or atoms (count)",
    )
    parser.add_argument(
        "--halo", choices=HALOS, help="ghost scheme (default: layer where the model supports it)"
    )
    parser.add_argument("--device", help="torch device, e.g. cpu, cuda (default: one GPU a rank)")
    parser.add_argument("--dtype", choices=DTYPES, help="default: the model's")
    parser.add_argument(
        "--compile",
        nargs="?",
        const=True,
        default=False,
        metavar="BACKEND",
        help="run the model through torch.compile (backend inductor unless given)",
    )


def run_md(args: argparse.Namespace) -> int:
    """``ase-shard md``: check the arguments, then :func:`ase_shard.md.run`."""
    if args.restart is not None and (args.structure or args.system or args.size):
        raise CLIError("--restart continues a trajectory: give no STRUCTURE, --system or --size")
    if args.resume is not None and (args.structure or args.system or args.size or args.restart):
        raise CLIError(
            "--resume continues a checkpointed run: give no STRUCTURE, --system, --size or "
            "--restart"
        )
    check_system_args(args)
    spec = None if args.model is None else resolve_model(args.model)
    from ase_shard import md  # torch and the calculator: only now

    return md.run(args, spec)


def check_system_args(args: argparse.Namespace) -> None:
    """Refuse STRUCTURE together with ``--system``/``--size``."""
    if args.structure is not None and (args.system is not None or args.size is not None):
        raise CLIError("give a STRUCTURE file or --system/--size, not both")


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
    bench.add_argument("--size", type=POSITIVE_INT, help="size N of the built-in system")
    _add_model_options(bench, bench=True)
    bench.add_argument("--ml-cutoff", type=POSITIVE, default=5.0, help="ML models, Å (5)")
    bench.add_argument(
        "--ml-channels", type=POSITIVE_INT, default=32, help="ML models' width (32)"
    )
    bench.add_argument(
        "--ml-layers",
        type=POSITIVE_INT,
        help="ML interaction layers (sevennet 3, mace 2, nequip 3)",
    )
    # >= 1 each for the benchmark (run_bench checks); --peer runs their sum
    bench.add_argument(
        "--reuse-steps", type=NON_NEGATIVE_INT, default=5, help="timed reuse steps (5)"
    )
    bench.add_argument(
        "--rebuild-steps", type=NON_NEGATIVE_INT, default=3, help="timed rebuild steps (3)"
    )
    _add_calculator_options(bench)
    bench.add_argument(
        "--threads",
        type=POSITIVE_INT,
        help="torch threads per rank (default: OMP_NUM_THREADS, else "
        "the calculator's share of the node's cores)",
    )
    bench.add_argument(
        "--seed",
        type=NON_NEGATIVE_INT,
        default=42,
        help="displacements, weights, --framework momenta (42)",
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
        "--ceiling-seconds", type=POSITIVE, default=0.5, help="length of the ceiling loop (0.5 s)"
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
    bench.add_argument(
        "--peer",
        choices=PEERS,
        help="instead: another code's MD step next to ase_shard's on one rank, one thread "
        "each, taking turns step by step (lammps and torchsim: LJ argon, default system "
        "ar-liquid; asap3: EMT, cu-bulk), --reuse-steps + --rebuild-steps steps; prints "
        "the median of the per-step ratios and writes JSON (default ase-shard-peer.json). "
        "Optional packages: pip install 'ase-shard[peers]'",
    )
    bench.set_defaults(run=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    """``ase-shard bench``: measure, then rank 0 prints and writes the report."""
    if args.peer is not None:
        return _run_peer(args)
    if args.ase_reference and args.framework:
        raise CLIError("--ase-reference does not apply to --framework")
    for option, value in (
        ("--reuse-steps", args.reuse_steps),
        ("--rebuild-steps", args.rebuild_steps),
    ):
        if value < 1:  # parsed as >= 0: --peer runs their sum
            raise CLIError(f"{option} must be >= 1 (the benchmark times both kinds), not {value}")
    check_system_args(args)
    if args.model is not None:
        spec = resolve_model(args.model, bench=True)
    else:
        spec = ModelSpec("bench", NO_EDGE, NO_EDGE, NO_EDGE) if args.framework else None
    if spec is not None and spec.source == NO_EDGE and not args.framework:
        raise CLIError(f"--model {NO_EDGE} is for --framework only")
    import json

    import torch

    from ase_shard import bench, md

    if args.threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the calculator keeps it
        torch.set_num_threads(args.threads)
    atoms, defaults, label = load_system(args)
    if spec is None:
        spec = resolve_model(defaults.model)
    if args.ase_reference and spec.source not in md.ASE_CALCULATORS:
        names = ", ".join(md.ASE_CALCULATORS)
        raise CLIError(f"--ase-reference needs one of {names}, not {spec.label}")
    model = _bench_model(spec, atoms, args)
    steps = {
        "reuse_steps": args.reuse_steps,
        "rebuild_steps": args.rebuild_steps,
        "skin": args.skin,
        "seed": args.seed,
        "calculator": {
            "partition": args.partition,
            "balance": args.balance,
            "halo": args.halo,
            "device": args.device,
            "compile": args.compile,
        },
    }
    if args.framework:
        settings = bench.FrameworkSettings(**steps)
    else:
        settings = bench.BenchSettings(
            **steps,
            serial_reference=not args.no_serial_reference,
            ceiling_seconds=args.ceiling_seconds,
        )
    mode = " --framework" if args.framework else ""
    # the summary's first line repeats the system; this one says that measuring began
    parprint(
        f"ase-shard bench{mode}: measuring {spec.label} on {world.size} rank(s)...", flush=True
    )
    arguments = {k: v for k, v in vars(args).items() if k != "run"}
    labels = {"system": label, "model": spec.label, "arguments": arguments}
    dtype = getattr(torch, args.dtype) if args.dtype else None
    if args.framework:
        report = bench.run_framework(atoms, model, settings, dtype=dtype, labels=labels)
    else:
        report = bench.run_benchmark(
            atoms,
            model,
            settings,
            dtype=dtype,
            ase_calculator=md.ASE_CALCULATORS[spec.source] if args.ase_reference else None,
            labels=labels,
        )
    if report is None:
        return 0
    path = args.json or ("ase-shard-framework.json" if args.framework else "ase-shard-bench.json")
    with open(path, "w") as file:
        json.dump(report, file, indent=1)
    outputs = [path]
    if args.framework:
        summary = bench.format_framework_summary(report)
    else:
        summary = bench.format_summary(report)
        if not args.no_plot:
            bench.plot_report(report, args.plot)
            outputs.append(args.plot)
    print(summary + "\n\n  wrote " + ", ".join(outputs), flush=True)
    return 0


def _run_peer(args: argparse.Namespace) -> int:
    """``ase-shard bench --peer``: :func:`ase_shard.peers.run_peer` on one rank."""
    if world.size > 1:
        raise CLIError("--peer runs on one rank: start it without mpirun")
    if args.framework or args.ase_reference:
        raise CLIError("--peer does not combine with --framework or --ase-reference")
    check_system_args(args)
    import json

    import torch

    from ase_shard import peers

    physics = peers.PEERS[args.peer].model
    if args.model is not None and args.model != physics:
        raise CLIError(f"--peer {args.peer} compares {physics}, not {args.model}")
    try:
        peers.check_installed(args.peer)
    except peers.PeerUnavailable as exc:
        raise CLIError(str(exc)) from None
    if args.structure is None and args.system is None:
        args.system = "ar-liquid" if physics == "lj" else "cu-bulk"
    threads = args.threads or 1
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    atoms, _, label = load_system(args)
    print(f"ase-shard bench --peer {args.peer}: measuring {label}...", flush=True)
    try:
        report = peers.run_peer(
            atoms, args.peer, args.reuse_steps + args.rebuild_steps, skin=args.skin, seed=args.seed
        )
    except peers.PeerUnavailable as exc:
        raise CLIError(str(exc)) from None
    path = args.json or "ase-shard-peer.json"
    with open(path, "w") as file:
        json.dump({**report, "labels": {"system": label}}, file, indent=1)
    print(peers.format_peer_summary(report, label) + f"\n\n  wrote {path}", flush=True)
    return 0


def _bench_model(spec: ModelSpec, atoms: Atoms, args: argparse.Namespace):
    """The model of ``ase-shard bench``, built identically on every rank."""
    from ase_shard import md, random_models

    if spec.source == NO_EDGE:
        return random_models.no_edge_model()
    if spec.kind == "bench":
        layers = {} if args.ml_layers is None else {"num_layers": args.ml_layers}
        return random_models.ML_MODELS[spec.source](
            atoms.numbers,
            cutoff=args.ml_cutoff,
            channels=args.ml_channels,
            seed=args.seed,
            **layers,
        )
    return md.build_model(spec, args.modality, args.dtype, args.interaction_range, args.d3)


# ----------------------------------------------------------------------------- plan


def add_plan(subparsers: argparse._SubParsersAction) -> None:
    """Declare ``ase-shard plan``."""
    plan = subparsers.add_parser(
        "plan",
        help="what a run needs per rank, before it runs: atoms, ghosts, edges, halo "
        "bytes, peak memory",
        description="In one process, before any rank allocates: the structure "
        "partitioned as P ranks would at their first step, each rank's owned atoms, "
        "ghosts, listed edges and halo bytes per step (exact), and its peak memory "
        "estimated from a calibration on this machine and --device (two blocks cut from "
        "the structure, built and evaluated: per node and per edge). Then, per rank "
        "count, the largest system of this kind that fits --memory per rank, and the "
        "projected parallel efficiency (docs/performance.md, 'Planning a run'). Systems "
        "and --size as for `md`.",
    )
    plan.add_argument("structure", nargs="?", metavar="STRUCTURE", help="structure file")
    plan.add_argument("--system", choices=SYSTEMS, help="built-in system (default cu-bulk)")
    plan.add_argument("--size", type=POSITIVE_INT, help="size N of the built-in system")
    plan.add_argument("--seed", type=NON_NEGATIVE_INT, default=42, help="random seed (42)")
    _add_model_options(plan, bench=False)
    plan.add_argument(
        "--ranks",
        type=POSITIVE_INT,
        nargs="+",
        default=[1, 2, 4],
        help="rank counts to plan (1 2 4)",
    )
    plan.add_argument(
        "--distributed",
        action="store_true",
        help="each rank holds its own atoms (ase_shard.distribute), not every atom",
    )
    plan.add_argument("--skin", type=NON_NEGATIVE, default=0.5, help="neighbour skin, Å (0.5)")
    plan.add_argument(
        "--halo", choices=HALOS, help="ghost scheme (default: layer where the model supports it)"
    )
    plan.add_argument("--device", help="torch device to calibrate on (default cpu)")
    plan.add_argument("--dtype", choices=DTYPES, help="default: the model's")
    plan.add_argument(
        "--memory",
        type=POSITIVE,
        metavar="GiB",
        help="memory per rank: the largest system of this kind that fits it, per rank count",
    )
    plan.add_argument(
        "--calibration-atoms",
        type=POSITIVE_INT,
        help="atoms of the calibration blocks (8000 for EMT, LJ and Morse on a CPU, else 300)",
    )
    plan.add_argument("--json", metavar="FILE", help="write the plans as JSON")
    plan.set_defaults(run=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    """``ase-shard plan``: :func:`ase_shard.plan.plan` per rank count; rank 0 prints."""
    check_system_args(args)
    atoms, defaults, label = load_system(args)
    spec = resolve_model(args.model or defaults.model)
    from ase_shard import md
    from ase_shard.comm import Comm
    from ase_shard.plan import report

    model = md.build_model(spec, args.modality, args.dtype, args.interaction_range, args.d3)
    # under mpirun rank 0 plans (its calibration measures one process, undisturbed)
    text, plans = Comm().decide(
        lambda: report(
            atoms,
            model,
            args.ranks,
            device=args.device,
            dtype=args.dtype,
            distributed=args.distributed,
            skin=args.skin,
            halo=args.halo,
            memory_per_rank=None if args.memory is None else args.memory * 2**30,
            calibration_atoms=args.calibration_atoms,
        )
    )
    parprint(f"ase-shard plan: {label}, {spec.label}\n{text}", flush=True)
    if args.json and world.rank == 0:
        import json

        with open(args.json, "w") as out:
            json.dump(plans, out, indent=1)
    return 0


# ----------------------------------------------------------------------------- info


def add_convert(subparsers: argparse._SubParsersAction) -> None:
    """Declare ``ase-shard convert``."""
    convert = subparsers.add_parser(
        "convert",
        help="write a trajectory's frames in another format (e.g. a .shards directory to "
        ".traj or extended XYZ)",
        description="Read every frame of SOURCE (a NAME.shards directory that ranks wrote "
        "their own atoms to, or any file ase.io reads) and write them to DEST in the format "
        "its name says (.traj, .xyz/.extxyz, or any multi-image format of ase.io.write), "
        "with the energies, forces and stresses written with them, for ASE, OVITO and "
        "MDAnalysis. Rank 0 works.",
    )
    convert.add_argument("source", metavar="SOURCE")
    convert.add_argument("dest", metavar="DEST")
    convert.set_defaults(run=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    """``ase-shard convert``: rank 0 reads the frames and writes them."""
    from ase.io import read, write

    from ase_shard.io import is_sharded, read_frames

    if world.rank == 0:
        if is_sharded(args.source):
            frames = read_frames(args.source)
        else:
            frames = read(args.source, ":", parallel=False)
        write(args.dest, frames, parallel=False)
        print(f"ase-shard convert: {len(frames)} frame(s) to {args.dest}", flush=True)
    return 0


def add_info(subparsers: argparse._SubParsersAction) -> None:
    """Declare ``ase-shard info``."""
    info = subparsers.add_parser(
        "info",
        help="MPI library, ranks, hosts, devices, versions and models",
        description="What this job runs on: MPI library, ranks with their hosts and devices, "
        "and the versions of torch, ase, numpy, numba, vesin and mpi4py. Rank 0 prints.",
    )
    info.add_argument(
        "--models",
        action="store_true",
        help="list the models --model takes here instead: built-ins and the pretrained "
        "models found, each with its cutoff, layers, elements and heads, and which "
        "model-file adapters import",
    )
    info.add_argument(
        "--model",
        metavar="MODEL",
        help="describe one model instead (a name or a file, as md's --model takes): "
        "cutoff, layers, elements, heads",
    )
    info.set_defaults(run=run_info)


def run_info(args: argparse.Namespace) -> int:
    """``ase-shard info``: what this job runs on (rank 0 prints)."""
    if args.models:
        parprint("\n".join(models_report()), flush=True)
        return 0
    if args.model is not None:
        spec = resolve_model(args.model)
        from ase_shard.catalog import describe

        parprint(f"{spec.label}: {describe(spec)}", flush=True)
        return 0
    import torch

    from ase_shard.calculator import ShardedCalculator
    from ase_shard.comm import Comm, cuda_aware_mpi
    from ase_shard.models import EMT

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
    cuda_aware = cuda_aware_mpi()
    lines = [
        f"ase_shard      {ase_shard.__version__}",
        f"python         {platform.python_version()}",
        f"MPI            {library}",
        "CUDA-aware MPI "
        + (
            "yes (GPU halo rows go to MPI from device memory)"
            if cuda_aware
            else "no (GPU halo rows go through pinned host buffers)"
        ),
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
    packages = ("ase", "numpy", "numba", "vesin", "mpi4py")
    lines += [f"{name:<15}{_version(name)}" for name in packages]
    print("\n".join(lines), flush=True)
    return 0


# ----------------------------------------------------------------------------- check


def add_check(subparsers: argparse._SubParsersAction) -> None:
    """Declare ``ase-shard check``."""
    check = subparsers.add_parser(
        "check",
        help="is a model exact here: P ranks vs 1 rank vs the model's own ASE calculator",
        description="On four small geometries of the model's elements (periodic cubic and "
        "triclinic bulk, a slab, a cluster): one rank of ShardedCalculator against the "
        "model's own ASE calculator (rank 0), and all ranks of this job against one rank. "
        "Rank 0 prints the relative differences of energy, forces and stress. Run it under "
        "mpirun with the rank count to check. Exit codes: 0 all within the tolerance of "
        "the dtype (1e-8 float64, 1e-5 float32), 1 some difference above it, 2 usage or "
        "input error.",
    )
    _add_model_options(check, bench=False, dispersion=False)
    check.add_argument(
        "--elements",
        metavar="A,B",
        help="elements of the geometries, comma-separated (default: two of the model's, "
        "common metals first)",
    )
    _add_calculator_options(check)
    check.set_defaults(run=run_check)


def run_check(args: argparse.Namespace) -> int:
    """``ase-shard check``: :func:`ase_shard.check.run`."""
    spec = resolve_model(args.model or "emt")
    from ase_shard import check  # torch, the calculator and the model: only now

    return check.run(args, spec)


def models_report() -> list[str]:
    """``info --models``: built-ins, pretrained models found (each with its reach,
    elements and heads: :func:`ase_shard.catalog.describe`) and the model-file kinds
    whose adapters import here."""
    from ase_shard.catalog import describe  # builds the models: torch, only now

    seen: dict[tuple[str, str], str] = {}  # aliases (chgnet, chgnet-0.3.0) built once

    def described(name: str) -> str:
        spec = resolve_model(name)
        key = (spec.kind, spec.source)
        if key not in seen:
            try:
                seen[key] = describe(spec)
            except Exception as exc:  # a broken package: say so, list the rest
                seen[key] = f"cannot be built here: {type(exc).__name__}: {exc}"
        return seen[key]

    # first: torch-pme's TorchScript fails to compile once torch_geometric (which
    # mattersim imports) has replaced torch.index_select
    d3 = _package_state("tad_dftd3", "tad-dftd3")
    coulomb = _package_state("torchpme", "torch-pme")
    lines = ["built-in       " + ", ".join(BUILTIN_MODELS)]
    lines += [f"  {name:<17} {described(name)}" for name in BUILTIN_MODELS]
    shipped = shipped_checkpoints()
    lines.append("pretrained     " + (", ".join(shipped) or "none (sevenn not installed)"))
    for name, path in shipped.items():
        lines += [f"  {name:<17} {described(name)}", f"  {'':<17} {path}"]
    missing = [name for name in SEVENN_CHECKPOINTS if name not in shipped]
    if missing:
        lines.append(f"  {'not here':<17} " + ", ".join(missing) + " (sevenn downloads them)")
    lines.append(
        "orb            orb:FILE.ckpt (an Orb-v3 conservative or direct checkpoint under orb's "
        "own file name, e.g. orb-v3-conservative-inf-omat-20250404.ckpt), or orb:NAME from orb's "
        f"download cache ({', '.join(ORB_MODELS)}): {_adapter_state('orb')}"
    )
    downloaded = downloaded_mattersim()
    names = ", ".join(
        f"{name} ({'downloaded' if name in downloaded else 'not here'})"
        for name in MATTERSIM_CHECKPOINTS
    )
    lines.append(
        f"mattersim      {names} in {MATTERSIM_FOLDER} (mattersim downloads them), any "
        f"checkpoint as --model mattersim:FILE: {_adapter_state('mattersim')}"
    )
    state = _adapter_state("chgnet")
    lines.append(f"chgnet         shipped in the chgnet wheel: {state}")
    for name, version in CHGNET_MODELS.items():
        about = described(name) if state.startswith("yes") else "not installed"
        lines.append(f"  {name:<17} {version}: {about}")
    lines.append("added terms    (`ase-shard md` adds them to any --model)")
    lines.append(
        f"  {'--d3 METHOD':<17} D3 dispersion, BJ damping with the three-body term, a "
        f"functional's parameters (pbe, r2scan, b3lyp, ...): {d3}"
    )
    lines.append(
        f"  {'--coulomb KIND':<17} Ewald or PME electrostatics of the initial charges: "
        f"{coulomb}"
    )
    lines.append("model files    (`ase-shard info --model FILE` describes one)")
    for ending, (kind, what) in MODEL_FILES.items():
        lines.append(f"  {ending:<17} {what}: {_adapter_state(kind)}")
    for kind, what in PREFIXED_FILES.items():
        lines.append(f"  {kind + ':PATH':<17} {what}: {_adapter_state(kind)}")
    return lines


def _adapter_state(kind: str) -> str:
    """Whether the package an adapter needs imports here, and its version."""
    return _package_state(*ADAPTER_PACKAGES[kind])


def _package_state(module: str, distribution: str) -> str:
    """Whether ``module`` imports here, and ``distribution``'s version."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # not installed, or broken: either way the adapter cannot load
        return f"no ({distribution}: {type(exc).__name__}: {exc})"
    return f"yes ({distribution} {_version(distribution)})"


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


if __name__ == "__main__":
    sys.exit(main())
