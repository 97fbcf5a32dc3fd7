"""The run of ``ase-shard md``: model, calculator, dynamics, output and summary.

:mod:`ase_shard.cli` parses the command line and calls :func:`run` on every
rank. All ranks build the same ``Atoms``, draw the same seeded momenta and
step the same ASE integrator; rank 0 alone writes the trajectory, the log,
the progress and the summary. Every decision that ends the run (a blow-up,
a stop signal) is taken from data that is identical on all ranks, or agreed
on collectively, so all ranks stop at the same step.

Output
------
- Trajectory (``--trajectory``): the format follows the file name as
  ``ase.io`` guesses it (``.traj``: ASE trajectory, ``.xyz``/``.extxyz``:
  extended XYZ, or any other format ``ase.io.write`` writes several images
  to), one frame every ``--interval`` steps, appended as it is made. Each
  frame holds positions, momenta, cell, the energy and forces (and stress
  when the dynamics computed it) and, in ``atoms.info``, ``md_step`` and
  ``md_time_fs`` and the physics of the run (:class:`Physics`: the model,
  its parameters, the modality, the target temperature and compressibility),
  which ``--restart`` reads: a restart runs the same model or refuses.
- Log (``--log``): a table every ``--interval`` steps; energies per atom.

With ``--distributed`` the ranks split the atoms after the momenta are drawn
(:func:`ase_shard.distributed.distribute`); each integrates its own, frames
are gathered to rank 0 every ``--interval`` steps, and the checks that end a
run are agreed on collectively.
- Summary: throughput and rebuilds; for NVE the total-energy drift, for the
  thermostats the mean and standard deviation of the temperature.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TextIO

import numpy as np
import torch
from ase import Atoms, units
from ase.calculators.emt import EMT as AseEMT
from ase.calculators.lj import LennardJones as AseLennardJones
from ase.calculators.morse import MorsePotential as AseMorse
from ase.calculators.singlepoint import SinglePointCalculator
from ase.constraints import FixCom
from ase.io import Trajectory, iread, write
from ase.io.formats import filetype, ioformats
from ase.md.bussi import Bussi
from ase.md.langevin import Langevin
from ase.md.md import MolecularDynamics
from ase.md.nptberendsen import NPTBerendsen
from ase.md.nvtberendsen import NVTBerendsen
from ase.md.velocitydistribution import Stationary, ZeroRotation, thermalize_momenta
from ase.md.verlet import VelocityVerlet
from ase.parallel import parprint, world

from ase_shard.balance import max_over_mean
from ase_shard.calculator import ShardedCalculator
from ase_shard.checkpoint import Saved, read_checkpoint, restore_dynamics, write_checkpoint
from ase_shard.comm import Comm
from ase_shard.distributed import GLOBAL_ID, DistributedAtoms, distribute
from ase_shard.dynamics import IsotropicMTKNPT, NoseHooverChainNVT
from ase_shard.io import ShardedTrajectory, cut_back_shards, is_sharded, read_frames
from ase_shard.memory import peak_memory
from ase_shard.models import EMT, LennardJones, Morse
from ase_shard.plan import Plan, plan
from ase_shard.presets import (
    ENSEMBLES,
    FILE_DEFAULTS,
    CLIError,
    Defaults,
    ModelSpec,
    load_system,
    read_structure,
    resolve_model,
    same_model,
)

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
THERMOSTATS = tuple(name for name in ENSEMBLES if name != "nve")
BAROSTATS = ("npt-mtk", "npt-berendsen")
# ensembles whose integrators run on DistributedAtoms (--distributed)
DISTRIBUTED_ENSEMBLES = ("nve", "langevin", "nvt-bussi", "nvt-nose-hoover", "npt-mtk")

# blow-up guard: a run stops when T exceeds TEMPERATURE_FACTOR times the reference
# (the target, or the initial T under NVE), the reference being at least
# TEMPERATURE_FLOOR so that a run started cold may still warm up
TEMPERATURE_FACTOR = 10.0
TEMPERATURE_FLOOR = 300.0  # K
# ... or when an atom is further outside the atoms' initial extent along a
# non-periodic axis than that extent, and at least ESCAPE_DISTANCE
ESCAPE_DISTANCE = 20.0  # Å

# the signals that stop a run at the end of the current step; Open MPI's mpirun
# forwards SIGUSR1 to the ranks, but answers SIGINT by terminating them
STOP_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGUSR1") if hasattr(signal, name)
)
EXIT_UNSTABLE = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report an interrupted command

# what a checkpoint records of the command line, for --resume (the model, its dtype and
# the thermostat's and barostat's targets are in its Physics)
RUN_OPTIONS = (
    "ensemble",
    "timestep",
    "seed",
    "friction",
    "taut",
    "taup",
    "pressure",
    "distributed",
    "trajectory",
    "log",
    "interval",
    "checkpoint_every",
    "checkpoint_keep",
)

STEP_KEY = "md_step"  # atoms.info of each frame: the MD step ...
TIME_KEY = "md_time_fs"  # ... and the simulated time, fs
MODEL_KEY = "md_model"  # ... and the run's Physics
PARAMETERS_KEY = "md_model_parameters"
MODALITY_KEY = "md_modality"
INTERACTION_RANGE_KEY = "md_interaction_range_A"
D3_KEY = "md_d3"
COULOMB_KEY = "md_coulomb"
DTYPE_KEY = "md_dtype"
TEMPERATURE_KEY = "md_temperature_K"
COMPRESSIBILITY_KEY = "md_compressibility_per_bar"


class Unstable(Exception):
    """The run blew up: non-finite results, runaway temperature or escaping atoms."""


@dataclass(frozen=True)
class Start:
    """Where the run starts: the step number and simulated time (fs) of its first frame."""

    step: int = 0
    time_fs: float = 0.0


@dataclass(frozen=True)
class Physics:
    """What every frame records (in ``atoms.info``) of the run that wrote it, so that
    ``--restart`` runs the same model and keeps the settings the command line left out.

    Attributes
    ----------
    model : str
        The ``--model`` value that finds the model again (:attr:`ModelSpec.argument`).
    parameters : str
        A built-in potential's parameters (``"epsilon=0.35, r0=2.55, rho0=4.0"``),
        or a model file's digest (:func:`model_parameters`); empty for EMT and
        models known by a name alone.
    modality : str or None
        ``--modality``.
    temperature : float
        K: the thermostat's target (and the initial draw's).
    compressibility : float
        1/bar: the barostat's.
    interaction_range : float or None
        Å: ``--interaction-range`` (a metatomic model's halo).
    d3 : str or None
        ``--d3``: the functional whose D3(BJ) dispersion is added to the model.
    coulomb : str or None
        ``--coulomb``: ``"ewald"`` or ``"pme"``, the electrostatics added to the model.
    dtype : str or None
        ``--dtype`` (``None``: the model's own).
    """

    model: str
    parameters: str
    modality: str | None
    temperature: float
    compressibility: float
    interaction_range: float | None = None
    d3: str | None = None
    coulomb: str | None = None
    dtype: str | None = None

    def info(self) -> dict[str, str | float]:
        """The ``atoms.info`` entries. Empty strings are left out: extended XYZ
        cannot hold them."""
        reach = self.interaction_range
        entries = {
            MODEL_KEY: self.model,
            PARAMETERS_KEY: self.parameters,
            MODALITY_KEY: self.modality or "",
            TEMPERATURE_KEY: self.temperature,
            COMPRESSIBILITY_KEY: self.compressibility,
            INTERACTION_RANGE_KEY: "" if reach is None else reach,
            D3_KEY: self.d3 or "",
            COULOMB_KEY: self.coulomb or "",
            DTYPE_KEY: self.dtype or "",
        }
        return {key: value for key, value in entries.items() if value != ""}

    @classmethod
    def from_info(cls, info: dict) -> Physics | None:
        """The record in a frame's ``atoms.info``; ``None`` for a frame without one."""
        if MODEL_KEY not in info:
            return None

        def optional(key: str, kind: type) -> str | float | None:
            """``info[key]`` as ``kind``; ``None`` where the run left it out."""
            value = info.get(key)
            return None if value is None else kind(value)

        return cls(
            model=str(info[MODEL_KEY]),
            parameters=str(info.get(PARAMETERS_KEY, "")),
            modality=optional(MODALITY_KEY, str),
            temperature=float(info[TEMPERATURE_KEY]),
            compressibility=float(info[COMPRESSIBILITY_KEY]),
            interaction_range=optional(INTERACTION_RANGE_KEY, float),
            d3=optional(D3_KEY, str),
            coulomb=optional(COULOMB_KEY, str),
            dtype=optional(DTYPE_KEY, str),
        )

    @property
    def defaults(self) -> Defaults:
        """The defaults of a run that continues this one."""
        return Defaults(self.model, self.temperature, self.compressibility)


def run(args: argparse.Namespace, spec: ModelSpec | None) -> int:
    """``ase-shard md`` on this rank; returns the exit code (see :func:`ase_shard.cli.main`)."""
    saved = None
    if args.resume is not None:
        saved = read_checkpoint(args.resume)
        resume_options(args, saved)
    writer_path = args.trajectory or args.restart
    check_trajectory_format(writer_path)
    if args.distributed and args.ensemble not in DISTRIBUTED_ENSEMBLES:
        raise CLIError(
            f"--distributed runs {', '.join(DISTRIBUTED_ENSEMBLES)}, not {args.ensemble}: "
            "the Berendsen integrators' centre-of-mass fix sums each rank's atoms only"
        )
    modality, reach, d3, coulomb = args.modality, args.interaction_range, args.d3, args.coulomb
    if args.restart is not None or saved is not None:
        if args.restart is not None:
            path, flag = args.restart, "--restart"
            atoms, start, recorded = read_restart(args.restart)
            defaults = FILE_DEFAULTS if recorded is None else recorded.defaults
        else:
            path, flag = args.resume, "--resume"
            atoms, recorded = saved.atoms, Physics.from_info(saved.record["physics"])
            start = Start(saved.step, float(saved.record["run"]["time_fs"]))
            defaults = recorded.defaults
        spec, modality = restart_model(path, recorded, spec, modality, flag=flag)
        # the parameters (a model file's digest) where recorded: restart_model found them
        # the model's, so a file is not read and hashed twice
        checked = recorded.parameters if recorded is not None else ""
        kept = partial(restart_option, path, recorded=recorded, flag=flag)
        reach = kept(option="interaction_range", given=reach)
        d3 = kept(option="d3", given=d3)
        coulomb = kept(option="coulomb", given=coulomb)
        args.dtype = kept(option="dtype", given=args.dtype)
        if saved is not None:
            for option in ("temperature", "compressibility"):
                kept(option=option, given=getattr(args, option))
        label = f"{path} from step {start.step}"
    else:
        (atoms, defaults, label), start = load_system(args), Start()
        spec = spec or resolve_model(defaults.model)
        checked = ""
    # the steps this command runs: with --upto (and --resume), those left before step --steps
    upto = args.upto or saved is not None
    steps = max(args.steps - start.step, 0) if upto else args.steps
    if upto and steps == 0:
        parprint(
            f"ase-shard md: {label}: step {args.steps} already reached (--upto), nothing to run",
            flush=True,
        )
        return 0
    if coulomb is not None and not atoms.get_initial_charges().any():
        raise CLIError(
            f"--coulomb {coulomb}: {label} holds no charges (its initial charges are all "
            "zero): give a structure with them, e.g. extended XYZ with initial_charges"
        )
    target = defaults.temperature if args.temperature is None else args.temperature
    physics = Physics(
        model=spec.argument,
        parameters=checked or model_parameters(spec),
        modality=modality,
        interaction_range=reach,
        d3=d3,
        coulomb=coulomb,
        dtype=args.dtype,
        temperature=target,
        compressibility=(
            defaults.compressibility if args.compressibility is None else args.compressibility
        ),
    )
    # the same numbers on every rank; a resumed run's generators take the checkpoint's
    # state (where it has one for them), else draw anew for the steps from here
    rng = np.random.default_rng(args.seed if saved is None else [args.seed, start.step])
    draw = args.restart is None and saved is None
    draw = draw and (args.temperature is not None or not atoms.get_momenta().any())
    if draw:
        thermalise(atoms, target, rng)
    calc = make_calculator(build_model(spec, modality, args.dtype, reach, d3, coulomb), args)
    if args.plan:
        calc.memory_plan = planned(atoms, calc, args)
    if args.distributed and saved is None:
        atoms = distribute(atoms)  # every rank holds the same atoms: each keeps its share
    atoms.calc = calc
    dyn = make_dynamics(atoms, args, physics, rng)
    if draw:
        set_temperature(atoms, target)  # after the dynamics' constraints remove their dof
    if saved is not None:
        restore_dynamics(dyn, saved)  # the integrator's own variables and noise
    dyn.nsteps = start.step  # observers run on absolute step numbers
    reference = target if args.ensemble in THERMOSTATS else atoms.get_temperature()
    warn_barostat_axes(atoms, args.ensemble)
    dtype = str(calc.dtype).removeprefix("torch.")
    parprint(
        f"ase-shard md: {label}, {atoms.get_global_number_of_atoms()} atoms, {spec.label} "
        f"({type(calc.model).__name__}) on {world.size} rank(s) ({calc.device}, {dtype}"
        f"{', distributed atoms' if args.distributed else ''}), {args.ensemble}, "
        f"{steps} x {args.timestep:g} fs",
        flush=True,
    )
    clock = partial(_time_fs, start=start, timestep=args.timestep)
    progress = None
    if world.rank == 0 and not args.no_progress:
        progress = Progress(steps, sys.stderr, live=sys.stderr.isatty())
    tracker = EnergyTracker(atoms, dyn, progress, start.step)
    guard = Guard(atoms, dyn, reference, steps + start.step)
    with contextlib.ExitStack() as stack:
        stop = stack.enter_context(StopSignals())
        if progress is not None:
            stack.callback(progress.close)  # ends the bar's line, also before a message
        dyn.attach(guard, interval=1)  # first: no frame of a blown-up step is written
        writer = None
        if saved is not None:  # what was written after the checkpoint goes

            def cut_back() -> None:
                if args.trajectory and os.path.exists(args.trajectory):
                    cut_back_frames(args.trajectory, start.step)
                if args.log and args.log != "-" and os.path.exists(args.log):
                    cut_back_rows(args.log, start.step)

            # on rank 0; an error there reaches every rank (none waits in the writer)
            Comm().decide(cut_back)
        if writer_path:
            append = args.restart is not None and _same_file(writer_path, args.restart)
            append = append or saved is not None
            writer = stack.enter_context(FrameWriter(writer_path, append, physics))
            dyn.attach(lambda: writer.write(atoms, dyn.nsteps, clock(dyn.nsteps)), args.interval)
        if args.log:
            barostat = args.ensemble in BAROSTATS
            continued = args.restart is not None or saved is not None
            logger = stack.enter_context(Logger(args.log, atoms, barostat, continued))
            dyn.attach(lambda: logger.write(dyn.nsteps, clock(dyn.nsteps)), args.interval)
        checkpoint = None
        if args.checkpoint:  # after the frame and the row of its step: none is missed

            def checkpoint() -> None:
                run = {name: getattr(args, name) for name in RUN_OPTIONS}
                run.update(steps=start.step + steps, time_fs=clock(dyn.nsteps))
                record = {"run": run, "physics": physics.info()}
                write_checkpoint(args.checkpoint, atoms, dyn, record, keep=args.checkpoint_keep)

            dyn.attach(checkpoint, interval=args.checkpoint_every)
        dyn.attach(tracker, interval=1)
        begin = time.perf_counter()
        if start.step:  # irun calls no observer before the first step of a restart
            guard()
            tracker()
        comm = Comm()
        try:
            for _ in dyn.irun(steps):
                if comm.any(stop.received is not None):
                    break
        except Unstable as exc:
            stack.close()
            parprint(f"ase-shard md: stopped: {exc}", file=sys.stderr, flush=True)
            return EXIT_UNSTABLE
        end = time.perf_counter()
        interrupted = dyn.nsteps < start.step + steps
        if interrupted and writer is not None and dyn.nsteps % args.interval:
            writer.write(atoms, dyn.nsteps, clock(dyn.nsteps))  # the step it stopped at
        if checkpoint is not None:
            checkpoint()  # the last step, done or stopped at (once: a step is written once)
    done = dyn.nsteps - start.step
    timing = Timing(wall=end - begin, first_call=tracker.first_call - begin)
    print_summary(atoms, done, timing, calc, tracker, args.ensemble)
    if interrupted:
        parprint(
            f"ase-shard md: interrupted at step {dyn.nsteps} of {start.step + steps}",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_INTERRUPTED
    return 0


def _time_fs(step: int, start: Start, timestep: float) -> float:
    """Simulated time (fs) at ``step``."""
    return start.time_fs + (step - start.step) * timestep


def _same_file(a: str, b: str) -> bool:
    return os.path.abspath(a) == os.path.abspath(b)


# ----------------------------------------------------------------------------- set-up


def build_model(
    spec: ModelSpec,
    modality: str | None,
    dtype: str | None = None,
    interaction_range: float | None = None,
    d3: str | None = None,
    coulomb: str | None = None,
) -> torch.nn.Module:
    """The torch model of a resolved ``--model`` (identical on every rank); ``dtype``
    (``--dtype``) for the models that are built in their precision (UMA);
    ``interaction_range`` (``--interaction-range``, Å) for metatomic models; ``d3``
    (``--d3 METHOD``): plus that functional's D3(BJ) dispersion with the three-body term
    (:class:`ase_shard.models.D3`); ``coulomb`` (``--coulomb ewald|pme``): plus the
    electrostatics of the initial charges (:class:`ase_shard.models.Coulomb`); with
    either, a :class:`ase_shard.models.Sum`."""
    from ase_shard.models import D3, Coulomb

    model = _built_model(spec, modality, dtype, interaction_range)
    if d3 is not None:
        try:
            model = model + D3(method=d3)
        except (KeyError, ValueError) as exc:
            raise CLIError(f"--d3 {d3}: {exc}") from None
    if coulomb is not None:
        model = model + Coulomb(method=coulomb)
    return model


@contextlib.contextmanager
def _option_error(spec: ModelSpec, word: str, option: str):
    """A model's ``ValueError`` that mentions ``word`` as a one-line ``CLIError`` naming the
    command-line ``option`` that set it; any other error as it is."""
    try:
        yield
    except ValueError as exc:
        if word not in str(exc):
            raise
        raise CLIError(f"--model {spec.label}: {exc} (option {option})") from None


def _built_model(
    spec: ModelSpec, modality: str | None, dtype: str | None, interaction_range: float | None
) -> torch.nn.Module:
    """:func:`build_model` without the dispersion term."""
    if modality is not None and spec.kind not in ("sevenn", "mace", "uma"):
        raise CLIError(f"--modality applies to SevenNet, MACE and UMA models, not {spec.label}")
    if interaction_range is not None and spec.kind != "metatomic":
        raise CLIError(f"--interaction-range applies to metatomic models, not {spec.label}")
    if spec.kind == "builtin":
        return MODELS[spec.source]()
    if spec.kind == "sevenn":
        from ase_shard.models import SevenNet

        with _option_error(spec, "modal", "--modality"):
            return SevenNet(spec.source, modal=modality)
    if spec.kind == "mace":
        from ase_shard.models import MACE

        return MACE(spec.source, head=modality)
    if spec.kind == "chgnet":
        from ase_shard.models import CHGNet

        return CHGNet(spec.source)
    if spec.kind == "metatomic":
        from ase_shard.models import Metatomic

        with _option_error(spec, "interaction_range", "--interaction-range"):
            return Metatomic(spec.source, interaction_range=interaction_range)
    if spec.kind == "uma":
        from ase_shard.models import UMA

        # fairchem builds its constant buffers in the model's precision
        precision = torch.float64 if dtype == "float64" else torch.float32
        with _option_error(spec, "task", "--modality"):
            return UMA(spec.source, task=modality, dtype=precision)
    if spec.kind == "orb":
        from ase_shard.models import Orb

        return Orb(spec.source)
    if spec.kind == "mattersim":
        from ase_shard.models import MatterSim

        return MatterSim(spec.source)
    from ase_shard.models import NequIP

    return NequIP(spec.source)


def make_calculator(model: torch.nn.Module, args: argparse.Namespace) -> ShardedCalculator:
    """``ShardedCalculator`` with the command line's skin, partition, balance, halo,
    device, dtype and compile options."""
    return ShardedCalculator(
        model,
        skin=args.skin,
        partition=args.partition,
        balance=args.balance,
        halo=args.halo,
        device=args.device,
        dtype=args.dtype,
        compile=args.compile,
    )


def planned(atoms: Atoms, calc: ShardedCalculator, args: argparse.Namespace) -> Plan:
    """``--plan``: the plan of this run (rank 0 plans for every rank), printed by rank 0."""
    if isinstance(atoms, DistributedAtoms):
        raise CLIError("--plan needs the whole structure: not with --resume of a distributed run")
    if args.partition != "spatial":
        raise CLIError("--plan plans the spatial partition: not with --partition contiguous")
    memory_plan = Comm().decide(
        lambda: plan(
            atoms,
            calc.model,
            world.size,
            device=calc.device,
            dtype=calc.dtype,
            distributed=args.distributed,
            skin=args.skin,
            halo=args.halo,
        )
    )
    parprint(f"ase-shard md: plan\n{memory_plan.table()}", flush=True)
    return memory_plan


def read_restart(path: str) -> tuple[Atoms, Start, Physics | None]:
    """The last frame of a trajectory written by ``ase-shard md``, without its
    calculator and constraints, the step and time it was written at, and the
    physics it records (``None`` for frames of a version that recorded none)."""
    if is_sharded(path):
        frames = read_frames(path, slice(-1, None))
        if not frames:
            raise CLIError(f"--restart {path}: no complete frame there")
        frame = frames[0]
    else:
        frame = read_structure(path, "--restart")
    if STEP_KEY not in frame.info:
        raise CLIError(f"--restart {path}: its last frame has no {STEP_KEY} (not ase-shard md's)")
    start = Start(int(frame.info[STEP_KEY]), float(frame.info.get(TIME_KEY, 0.0)))
    recorded = Physics.from_info(frame.info)
    atoms = frame.copy()
    atoms.calc = None
    atoms.constraints = []  # the dynamics adds its own (Langevin's FixCom)
    atoms.info = {}
    return atoms, start, recorded


def restart_model(
    path: str,
    recorded: Physics | None,
    spec: ModelSpec | None,
    modality: str | None,
    flag: str = "--restart",
) -> tuple[ModelSpec, str | None]:
    """The model and modality of ``--restart path`` (or ``--resume path``: ``flag``):
    those the frames (the checkpoint) record.

    ``spec`` and ``modality`` are the command line's (``None``: not given).

    Raises
    ------
    CLIError
        When the command line names another model or modality than the record, when
        the recorded model is not available here or its parameters have changed, and
        when the frames record no model and the command line names none either.
    """
    if recorded is None:
        if spec is None:
            raise CLIError(
                f"--restart {path}: its frames do not record which model wrote them "
                "(written before ase-shard md recorded it): give --model, the model "
                "that wrote them"
            )
        return spec, modality
    written = f"{flag} {path} was written with --model {recorded.model}"
    try:
        model = resolve_model(recorded.model)
    except CLIError as exc:
        raise CLIError(f"{written}, which is not available here: {exc}") from None
    if spec is not None and not same_model(spec, model):
        new_run = (
            f", or start a new run from its last frame (ase-shard md {path} --model "
            f"{spec.label})"
        )
        raise CLIError(
            f"{written}, not {spec.label}: a restart runs the model that wrote the "
            f"{'trajectory' if flag == '--restart' else 'checkpoint'}; leave --model out"
            + (new_run if flag == "--restart" else "")
        )
    # frames written before model files had their digest recorded hold none
    now = model_parameters(model)
    if recorded.parameters and now != recorded.parameters:
        if model.kind == "builtin":
            raise CLIError(
                f"{written} ({recorded.parameters}), but this version's {model.label} has "
                f"({now}): not the same potential"
            )
        raise CLIError(
            f"{written} ({recorded.parameters}), but the file now has ({now}): other "
            "weights, not the same model"
        )
    if modality is not None and modality != recorded.modality:
        raise CLIError(f"{written} and --modality {recorded.modality or '(none)'}, not {modality}")
    return model, recorded.modality


def restart_option(
    path: str,
    option: str,
    recorded: Physics | None,
    given: float | str | None,
    flag: str = "--restart",
) -> float | str | None:
    """A recorded option of ``--restart path`` (or ``--resume path``: ``flag``;
    ``option``: a :class:`Physics` field, e.g. ``"interaction_range"``, ``"d3"``,
    ``"coulomb"``, ``"dtype"``): the recorded value; ``given`` (the command line's)
    where nothing is recorded.

    Raises
    ------
    CLIError
        When the command line gives another value than the record.
    """
    if recorded is None:
        return given
    was = getattr(recorded, option)
    if given is not None and given != was:
        raise CLIError(
            f"{flag} {path} was written with --{option.replace('_', '-')} "
            f"{'(none)' if was is None else was}, not {given}"
        )
    return was


def resume_options(args: argparse.Namespace, saved: Saved) -> None:
    """Set ``args`` to the run ``--resume`` continues: the options its checkpoint records
    (:data:`RUN_OPTIONS`), ``--steps`` (the step to end at) unless given anew, and
    ``--checkpoint`` (the same directory) unless given.

    Raises
    ------
    CLIError
        When the command line gives one of :data:`RUN_OPTIONS` another value.
    """
    given = getattr(args, "given", frozenset())
    run = saved.record["run"]
    for option in RUN_OPTIONS:
        if option in given and getattr(args, option) != run[option]:
            flag = "--" + option.replace("_", "-")
            raise CLIError(
                f"--resume {args.resume} continues a run with {flag} {run[option]}, not "
                f"{getattr(args, option)}: leave {flag} out (or start a new run)"
            )
        setattr(args, option, run[option])
    if "steps" not in given:
        args.steps = run["steps"]
    if args.checkpoint is None:
        args.checkpoint = args.resume


def cut_back_frames(path: str, step: int) -> None:
    """Drop the frames a trajectory holds after ``step`` (a run resumed from that step's
    checkpoint writes them again), and a frame cut short by a kill: the frames up to
    the first with a later step or none readable are kept. The file is written anew
    (beside it, then renamed over it) only when a frame goes."""
    if is_sharded(path):
        cut_back_shards(path, lambda info: int(info.get(STEP_KEY, -1)) <= step)
        return
    frames, complete = [], True
    try:
        for image in iread(path, index=":", parallel=False):
            if int(image.info.get(STEP_KEY, -1)) > step:
                complete = False
                break
            frames.append(image)
    except Exception:  # the last frame, cut short by a kill
        complete = False
    if not complete:
        temporary = f"{path}.cut-{os.getpid()}"
        write(temporary, frames, format=filetype(path, read=False), parallel=False)
        os.replace(temporary, path)


def cut_back_rows(path: str, step: int) -> None:
    """:func:`cut_back_frames` for a ``--log`` table: its rows after ``step`` go, and a
    last row cut short."""
    with open(path) as handle:
        lines = handle.readlines()
    kept = [
        line
        for line in lines
        if line.endswith("\n") and (line.startswith("#") or int(line.split()[0]) <= step)
    ]
    if kept != lines:
        temporary = f"{path}.cut-{os.getpid()}"
        with open(temporary, "w") as handle:
            handle.writelines(kept)
        os.replace(temporary, path)


def model_parameters(spec: ModelSpec) -> str:
    """A built-in potential's parameters as ``name=value, ...``; a model file's digest
    (``sha256=`` and the first 16 hex digits of its bytes: the same path with other
    weights is another model); empty for EMT and for models known by a name alone."""
    if spec.kind == "builtin":
        keywords = getattr(MODELS[spec.source], "keywords", {})
        return ", ".join(f"{name}={value!r}" for name, value in keywords.items())
    if os.path.isfile(spec.source):
        with open(spec.source, "rb") as handle:
            return f"sha256={hashlib.file_digest(handle, 'sha256').hexdigest()[:16]}"
    return ""


def thermalise(atoms: Atoms, temperature: float, rng: np.random.Generator) -> None:
    """Maxwell-Boltzmann momenta at ``temperature`` K, no drift (nor spin if isolated)."""
    thermalize_momenta(atoms, temperature_K=temperature, rng=rng)
    Stationary(atoms)
    if not atoms.pbc.any():
        ZeroRotation(atoms)


def set_temperature(atoms: Atoms, temperature: float) -> None:
    """Scale the momenta so that ``atoms.get_temperature()`` is ``temperature`` K.

    A random draw has the target temperature only on average, and removing the
    drift (and spin) takes some kinetic energy away; ``get_temperature`` counts
    the degrees of freedom the constraints leave, so it is the reference.
    """
    current = atoms.get_temperature()
    if current > 0:
        factor = math.sqrt(temperature / current)
        atoms.set_momenta(atoms.get_momenta() * factor, apply_constraint=False)


def make_dynamics(
    atoms: Atoms, args: argparse.Namespace, physics: Physics, rng: np.random.Generator
) -> MolecularDynamics:
    """The ASE integrator of ``args.ensemble``, at ``physics``' temperature and
    compressibility."""
    temperature = physics.temperature
    timestep = args.timestep * units.fs
    if args.ensemble == "nve":
        return VelocityVerlet(atoms, timestep=timestep)
    if args.ensemble == "langevin":
        if isinstance(atoms, DistributedAtoms):
            # ASE's keeps per-atom arrays across the force call; no FixCom either:
            # constraints cannot follow migrating atoms
            from ase_shard.dynamics import Langevin as langevin
        else:
            langevin = Langevin
            atoms.constraints = [*atoms.constraints, FixCom()]  # ASE's advice over fixcm=True
        return langevin(
            atoms,
            timestep=timestep,
            temperature_K=temperature,
            friction=args.friction / units.fs,
            fixcm=False,
            rng=rng,
        )
    taut, taup = args.taut * units.fs, args.taup * units.fs
    if args.ensemble == "nvt-bussi":
        return Bussi(atoms, timestep=timestep, temperature_K=temperature, taut=taut, rng=rng)
    if args.ensemble == "nvt-nose-hoover":  # ASE's on plain atoms, bit for bit
        return NoseHooverChainNVT(atoms, timestep=timestep, temperature_K=temperature, tdamp=taut)
    if args.ensemble == "nvt-berendsen":
        return NVTBerendsen(atoms, timestep=timestep, temperature_K=temperature, taut=taut)
    if atoms.cell.rank != 3:
        raise CLIError(
            f"{args.ensemble} scales the cell, but this system's cell has rank "
            f"{atoms.cell.rank}, not 3; use nve or an nvt ensemble, or give it a cell"
        )
    if args.ensemble == "npt-mtk":
        return IsotropicMTKNPT(
            atoms,
            timestep=timestep,
            temperature_K=temperature,
            pressure_au=args.pressure * units.bar,
            tdamp=taut,
            pdamp=taup,
        )
    return NPTBerendsen(
        atoms,
        timestep=timestep,
        temperature_K=temperature,
        taut=taut,
        taup=taup,
        pressure_au=args.pressure * units.bar,
        compressibility_au=physics.compressibility / units.bar,
    )


def warn_barostat_axes(atoms: Atoms, ensemble: str) -> None:
    """Rank 0 warns when the barostat will scale the cell along a non-periodic axis."""
    if ensemble not in BAROSTATS or atoms.pbc.all():
        return
    axes = ", ".join("abc"[i] for i in range(3) if not atoms.pbc[i])
    parprint(
        f"ase-shard md: warning: {ensemble} scales all three cell vectors, also the "
        f"non-periodic {axes}: the vacuum there changes with the pressure",
        file=sys.stderr,
        flush=True,
    )


# ----------------------------------------------------------------------------- output


def check_trajectory_format(path: str | None) -> None:
    """Refuse a trajectory name whose format ``ase.io`` cannot write several images to."""
    if path is None or is_sharded(path):
        return
    name = filetype(path, read=False)
    io = ioformats.get(name)
    if io is None or not io.can_write or io.single:
        raise CLIError(
            f"--trajectory {path}: ase.io cannot append frames to format {name!r}; "
            "use .traj, .xyz/.extxyz or another multi-image format"
        )


def frame(atoms: Atoms, info: dict) -> Atoms:
    """A copy of ``atoms`` with the results already computed and ``info`` (the step,
    the time and the run's physics) as its ``atoms.info``."""
    copy = atoms.copy()
    copy.constraints = []
    results = {
        "energy": atoms.get_potential_energy(),
        "forces": atoms.get_forces(apply_constraint=False),  # the model's, not FixCom's
    }
    if "stress" in atoms.calc.results:  # computed by the barostat: no extra evaluation
        results["stress"] = atoms.get_stress()
    copy.calc = SinglePointCalculator(copy, **results)
    # only ours: a structure file's own metadata (a CIF's occupancies) would be
    # repeated in every frame
    copy.info = info
    return copy


def gathered_frame(atoms: DistributedAtoms, info: dict) -> Atoms | None:
    """:func:`frame` of distributed atoms, gathered on rank 0 (``None`` elsewhere)."""
    from ase_shard.io import _gathered_with_results

    whole = _gathered_with_results(atoms, root=0)
    if whole is not None:
        whole.info = info
    return whole


class FrameWriter:
    """Frames appended to ``path`` one by one, by rank 0, or for a ``.shards`` directory
    by every rank, its own atoms (:class:`~ase_shard.io.ShardedTrajectory`; a context
    manager).

    Parameters
    ----------
    path : str
        The file; :func:`check_trajectory_format` has accepted its format.
    append : bool
        Keep the frames already there (``--restart``), else start the file anew.
    physics : Physics
        What every frame records of the run.
    """

    def __init__(self, path: str, append: bool, physics: Physics):
        self.path = path
        self.physics = physics.info()
        self.trajectory = None
        self.shards = None
        if is_sharded(path):  # every rank writes its atoms, nothing gathered
            self.shards = ShardedTrajectory(path, "a" if append else "w")
            return
        self.format = filetype(path, read=False)
        if self.format == "traj":
            self.trajectory = Trajectory(path, "a" if append else "w")  # rank 0 writes
        elif world.rank == 0 and not append:
            open(path, "w").close()

    def write(self, atoms: Atoms, step: int, time_fs: float) -> None:
        """Append the current state (every rank calls this; rank 0 writes)."""
        info = {STEP_KEY: step, TIME_KEY: time_fs, **self.physics}
        if self.shards is not None:
            self.shards.write(atoms, info)
            return
        if isinstance(atoms, DistributedAtoms):
            image = gathered_frame(atoms, info)  # collective; None but on rank 0
            if image is None:
                return
        else:
            image = frame(atoms, info)  # every rank: reading results is collective-free
        if self.trajectory is not None:
            self.trajectory.write(image)
        elif world.rank == 0:
            write(self.path, image, format=self.format, append=True, parallel=False)

    def __enter__(self) -> FrameWriter:
        return self

    def __exit__(self, *exc) -> None:
        for writer in (self.trajectory, self.shards):
            if writer is not None:
                writer.close()


class Logger:
    """The ``--log`` table, on rank 0: step, time (ps), energies per atom (eV), T (K),
    and with a barostat the pressure (GPa, ideal-gas part included, as the barostat
    sees it) and the volume (Å³). ``-`` writes to stdout."""

    def __init__(self, path: str, atoms: Atoms, barostat: bool, continued: bool):
        self.atoms = atoms
        self.barostat = barostat
        self.stream: TextIO | None = None
        self.own = path != "-"
        if world.rank != 0:
            return
        if not self.own:
            self.stream = sys.stdout
        else:
            self.stream = open(path, "a" if continued else "w")
        if not (self.own and continued and self.stream.tell()):
            columns = "# step  time[ps]  Etot/N[eV]  Epot/N[eV]  Ekin/N[eV]      T[K]"
            self._line(columns + ("    P[GPa]     V[Å^3]" if barostat else ""))

    def write(self, step: int, time_fs: float) -> None:
        """One row (every rank computes it from cached results; rank 0 writes)."""
        atoms = self.atoms
        n = atoms.get_global_number_of_atoms()
        epot, ekin = atoms.get_potential_energy() / n, atoms.get_kinetic_energy() / n
        row = (
            f"{step:6d} {time_fs / 1000:9.4f} {epot + ekin:11.5f} {epot:11.5f} {ekin:11.5f} "
            f"{atoms.get_temperature():9.2f}"
        )
        if self.barostat:
            stress = atoms.get_stress(include_ideal_gas=True)
            pressure = -stress[:3].mean() / units.GPa
            row += f" {pressure:9.4f} {atoms.get_volume():10.2f}"
        self._line(row)

    def _line(self, text: str) -> None:
        if self.stream is not None:
            self.stream.write(text + "\n")
            self.stream.flush()  # rows and the progress on stderr appear in order

    def __enter__(self) -> Logger:
        return self

    def __exit__(self, *exc) -> None:
        if self.own and self.stream is not None:
            self.stream.close()


# ----------------------------------------------------------------------------- guards


class Guard:
    """MD observer (every step, every rank) that raises :class:`Unstable` when the run
    blows up: non-finite energy or forces, T above ``TEMPERATURE_FACTOR`` times
    ``max(reference, TEMPERATURE_FLOOR)``, or an atom escaping along a non-periodic axis.

    Parameters
    ----------
    atoms : Atoms
        The running system; its current positions set the box of the escape test.
    dyn : MolecularDynamics
        Its integrator, for the step number.
    reference : float
        K: the thermostat's target, or the initial temperature under NVE.
    last_step : int
        The step the run ends at, for the message.
    """

    def __init__(self, atoms: Atoms, dyn: MolecularDynamics, reference: float, last_step: int):
        self.atoms = atoms
        self.dyn = dyn
        self.last_step = last_step
        self.reference = max(reference, TEMPERATURE_FLOOR)
        self.limit = TEMPERATURE_FACTOR * self.reference
        self.axes = np.flatnonzero(~atoms.pbc)
        coordinates = atoms.positions[:, self.axes]
        low = coordinates.min(axis=0, initial=np.inf)
        high = coordinates.max(axis=0, initial=-np.inf)
        if isinstance(atoms, DistributedAtoms):  # the extent of all ranks' atoms
            extents = atoms.comm.allgather((low, high))
            low = np.min([extent[0] for extent in extents], axis=0)
            high = np.max([extent[1] for extent in extents], axis=0)
        margin = np.maximum(high - low, ESCAPE_DISTANCE)
        self.low, self.high = low - margin, high + margin

    def __call__(self) -> None:
        reason = self._reason()
        if isinstance(self.atoms, DistributedAtoms):
            # each rank sees its own atoms: all stop if one does
            reason = next(filter(None, self.atoms.comm.allgather(reason)), None)
        if reason is not None:
            self._stop(reason)

    def _reason(self) -> str | None:
        """Why the run must stop, judged from this rank's atoms; ``None``: it may go on."""
        atoms = self.atoms
        energy = atoms.get_potential_energy()
        forces = atoms.get_forces(apply_constraint=False)
        if not np.isfinite(energy) or not np.isfinite(forces).all():
            return "the energy or forces are not finite"
        temperature = atoms.get_temperature()
        if not temperature <= self.limit:
            return (
                f"T = {temperature:.4g} K exceeds {TEMPERATURE_FACTOR:g} x "
                f"{self.reference:g} K; try a smaller --timestep"
            )
        coordinates = atoms.positions[:, self.axes]
        outside = (coordinates < self.low) | (coordinates > self.high)
        if outside.any():
            atom, axis = np.argwhere(outside)[0]
            if isinstance(atoms, DistributedAtoms):
                atom = atoms.arrays[GLOBAL_ID][atom]
            return (
                f"atom {atom} left the box along non-periodic axis {'xyz'[self.axes[axis]]} "
                f"(more than {self.high[axis] - self.low[axis]:.0f} Å span)"
            )
        return None

    def _stop(self, reason: str) -> None:
        step = self.dyn.nsteps
        raise Unstable(f"the run is unstable at step {step} of {self.last_step}: {reason}")


class StopSignals:
    """Turn SIGINT, SIGTERM and SIGUSR1 into a request to stop after the current step
    (a context manager; ``received`` is the signal number). A second SIGINT raises
    ``KeyboardInterrupt`` at once. Outside the main thread it changes nothing."""

    def __init__(self):
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame) -> None:
        if signum == signal.SIGINT and self.received is not None:
            raise KeyboardInterrupt
        self.received = signum

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for number in STOP_SIGNALS:
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)


# ----------------------------------------------------------------------------- progress


class EnergyTracker:
    """MD observer (every step, every rank): total energy per atom and temperature,
    and the progress display.

    Its first call comes right after the run's first force call (ASE's ``irun``
    computes the forces, then calls the observers), which builds the decomposition
    and warms the model up: the progress' steps/s count from there
    (:attr:`first_call`, a ``time.perf_counter()``).
    """

    def __init__(
        self, atoms: Atoms, dyn: MolecularDynamics, progress: Progress | None, start: int
    ):
        self.atoms = atoms
        self.dyn = dyn
        self.progress = progress
        self.start_step = start
        self.totals: list[float] = []  # eV/atom
        self.temperatures: list[float] = []  # K
        self.first_call: float | None = None

    def __call__(self) -> None:
        now = time.perf_counter()
        if self.first_call is None:
            self.first_call = now
        atoms = self.atoms
        energy = atoms.get_potential_energy() + atoms.get_kinetic_energy()
        total = energy / atoms.get_global_number_of_atoms()
        self.totals.append(total)
        self.temperatures.append(atoms.get_temperature())
        if self.progress is not None:
            done = self.dyn.nsteps - self.start_step
            self.progress.update(done, total, now - self.first_call)


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
        """Show step ``done`` of ``total``, ``elapsed`` s after step 0's force call;
        ``total_energy`` in eV/atom."""
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


@dataclass(frozen=True)
class Timing:
    """Seconds of the run: ``wall`` in all, ``first_call`` of them until the end of the
    first force call (the decomposition's first build, the model's warm-up)."""

    wall: float
    first_call: float

    @property
    def steps_time(self) -> float:
        """Seconds after the first force call: what the steps took."""
        return self.wall - self.first_call


def balance_lines(calc: ShardedCalculator, work: Sequence[float]) -> list[str]:
    """The summary's load-balance lines: the edges each rank listed at the last
    rebuild, and ``work``, each rank's CPU seconds in the calculator with MPI excluded
    (what it computed itself), each as min / mean / max and max over mean."""
    lines = []
    balance = calc.balance
    if balance is not None:
        edges = np.array(balance.edges)
        lines.append(
            f"  edges/rank     {edges.min()} / {edges.mean():.0f} / {edges.max()} "
            f"(min / mean / max; max / mean {balance.imbalance:.3f}; "
            f"{balance.rebalances} rebalance(s) by work)"
        )
    seconds = np.array(work)
    lines.append(
        f"  work/rank      {seconds.min():.2f} / {seconds.mean():.2f} / {seconds.max():.2f} s "
        f"of CPU outside MPI (max / mean {max_over_mean(seconds) or 1.0:.3f})"
    )
    return lines


def memory_line(peaks: Sequence[int]) -> str:
    """Per-rank bytes as the summary prints them: min, mean and max in MiB."""
    mib = np.array(peaks, dtype=float) / 2**20
    return f"{mib.min():.0f} / {mib.mean():.0f} / {mib.max():.0f} MiB per rank (min / mean / max)"


def print_summary(
    atoms: Atoms,
    steps: int,
    timing: Timing,
    calc: ShardedCalculator,
    tracker: EnergyTracker,
    ensemble: str,
) -> None:
    """Rank 0: throughput (counted from the end of the first force call, as the
    progress), rebuilds, the load balance (edges per rank at the last rebuild, and
    each rank's CPU time in the calculator outside MPI), each rank's peak resident
    memory (and GPU memory) as min, mean and max, then for NVE the total-energy
    drift per atom and for the thermostats the temperature's mean and standard
    deviation; final T. Collective: every rank calls it."""
    n = atoms.get_global_number_of_atoms()
    rate = steps / timing.steps_time if timing.steps_time > 0 else float("nan")
    # one allgather: each rank's CPU work in the calculator and peak memory (host, GPU)
    device_peak = torch.cuda.max_memory_allocated() if torch.cuda.is_initialized() else None
    mine = (sum(calc.timer.cpu.values()), peak_memory(), device_peak)
    work, host_peaks, device_peaks = zip(*Comm().allgather(mine), strict=True)
    lines = [
        "ase-shard md summary",
        f"  atoms          {n}",
        f"  ranks          {world.size}",
        f"  steps          {steps}",
        f"  wall time      {timing.wall:.2f} s, of which {timing.first_call:.2f} s the first "
        "force call",
        f"  steps/s        {rate:.3f} after the first force call",
        f"  atom-steps/s   {rate * n:.4g} after the first force call",
        f"  rebuilds       {calc.rebuilds}",
        *balance_lines(calc, work),
        f"  peak memory    {memory_line(host_peaks)}",
    ]
    if None not in device_peaks:
        lines.append(f"  peak GPU mem.  {memory_line(device_peaks)} (torch's allocations)")
    if ensemble in THERMOSTATS:
        temperatures = np.array(tracker.temperatures)
        lines.append(
            f"  T              mean {temperatures.mean():.2f} K, standard deviation "
            f"{temperatures.std():.2f} K over {len(temperatures)} steps"
        )
    else:
        totals = np.array(tracker.totals)
        lines.append(
            f"  Etot drift     max |Etot - Etot0| = {np.abs(totals - totals[0]).max():.3e} "
            f"eV/atom, final - initial = {totals[-1] - totals[0]:+.3e} eV/atom"
        )
    lines.append(f"  final T        {atoms.get_temperature():.2f} K")
    parprint("\n".join(lines), flush=True)
