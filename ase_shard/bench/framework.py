"""``ase-shard bench --framework``: what ``ShardedCalculator`` costs per MD step.

:func:`run_framework` sets it next to ASE's own ``VelocityVerlet`` step: both run
on every rank's copy of the system, ASE's step with a calculator that returns
zeros (:class:`ZeroCalculator`), the sharded one with a model that has no pairs
(:func:`ase_shard.random_models.no_edge_model`) or any other, and each rank's
CPU time per phase. The phases split into the model's own
(:data:`MODEL_PHASES`) and the framework's (:data:`FRAMEWORK_PHASES`), whose
CPU per rank should be balanced within :data:`FRAMEWORK_BALANCE`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from ase import Atoms, units
from ase.calculators.calculator import Calculator, all_changes
from ase.md.velocitydistribution import thermalize_momenta
from ase.md.verlet import VelocityVerlet

from ase_shard.bench.machine import PeakMemory, load_average
from ase_shard.bench.run import (
    BREAKDOWNS,
    KINDS,
    RunContext,
    StepSettings,
    layout_per_rank,
    phase_means,
    phases_per_rank,
    report_header,
)
from ase_shard.calculator import ShardedCalculator
from ase_shard.comm import Comm
from ase_shard.timing import PHASES, PhaseTimer

# the phases of the model's work (its neighbour list, evaluation and gradient sum); the
# others are the framework's own (ShardedCalculator's): their CPU is the "framework CPU"
MODEL_PHASES = ("neighbors", "forward", "backward", "reverse")
FRAMEWORK_PHASES = tuple(phase for phase in PHASES if phase not in MODEL_PHASES)
# the project's bound on the largest framework CPU of a rank over the smallest one's
FRAMEWORK_BALANCE = 1.10


class ZeroCalculator(Calculator):
    """Zero energy, forces and stress: ASE's own dynamics with nothing to evaluate."""

    implemented_properties = ["energy", "free_energy", "forces", "stress"]

    def calculate(
        self,
        atoms: Atoms | None = None,
        properties: Sequence[str] = ("energy",),
        system_changes: Sequence[str] = all_changes,
    ) -> None:
        super().calculate(atoms, properties, system_changes)
        self.results = {
            "energy": 0.0,
            "free_energy": 0.0,
            "forces": np.zeros((len(self.atoms), 3)),
            "stress": np.zeros(6),
        }


@dataclass(frozen=True)
class FrameworkSettings(StepSettings):
    """What one framework-cost run does (:func:`run_framework`).

    Attributes
    ----------
    temperature : float
        Maxwell-Boltzmann momenta at this temperature (K), drawn with ``seed``.
    timestep : float
        VelocityVerlet's time step (fs).

    The others as in :class:`StepSettings`; a rebuild step asks for a rebuild
    (``calc.request_rebuild()``) before it starts.
    """

    temperature: float = 300.0
    timestep: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.temperature < 0 or self.timestep <= 0:
            raise ValueError("temperature must be >= 0 K and timestep > 0 fs")


class _Dynamics:
    """ASE's ``VelocityVerlet`` on its own copy of ``atoms``, one step at a time.

    The instance's ``calc.calculate`` is wrapped to add its wall time to
    :attr:`inside`: the calculator's own time, without ASE's.
    """

    def __init__(self, atoms: Atoms, calc: Calculator, timestep: float):
        self.atoms = atoms.copy()
        self.atoms.calc = calc
        self.calc = calc
        self.dyn = VelocityVerlet(self.atoms, timestep=timestep * units.fs)
        self.inside = 0.0
        calculate = calc.calculate

        def timed(*args: Any, **kwargs: Any) -> None:
            start = time.perf_counter()
            try:
                calculate(*args, **kwargs)
            finally:
                self.inside += time.perf_counter() - start

        calc.calculate = timed

    def step(self, comm: Comm, rebuild: bool) -> tuple[float, float]:
        """One ``VelocityVerlet.step()``, started on all ranks together.

        Returns this rank's wall seconds of the whole step and of the time in
        ``calculate`` (one call, at the new positions). ``rebuild`` asks the
        calculator for a rebuild first; the step then gets the last step's
        forces passed in, as the request drops the cached ones.
        """
        forces = None
        if rebuild:
            forces = self.atoms.get_forces(md=True)
            self.calc.request_rebuild()
        self.inside = 0.0
        comm.allgather(None)  # all ranks start together
        start = time.perf_counter()
        self.dyn.step(forces)
        return time.perf_counter() - start, self.inside


def _schedule(reuse_steps: int, rebuild_steps: int) -> list[str]:
    """The kinds of the timed steps in order: each rebuild step followed by its share
    of the reuse steps, so that atoms in free flight (zero forces) stay within the
    skin of the last build and reuse steps do not rebuild on their own."""
    kinds = []
    for i in range(rebuild_steps):
        share = (i + 1) * reuse_steps // rebuild_steps - i * reuse_steps // rebuild_steps
        kinds += ["rebuild"] + ["reuse"] * share
    return kinds


def _accumulate(into: PhaseTimer, timer: PhaseTimer) -> None:
    """Add ``timer``'s wall and CPU seconds per phase to ``into``'s."""
    for totals in BREAKDOWNS.values():
        for phase in PHASES:
            getattr(into, totals)[phase] += getattr(timer, totals)[phase]


def run_framework(
    atoms: Atoms,
    model: torch.nn.Module,
    settings: FrameworkSettings,
    *,
    dtype: torch.dtype | None = None,
    labels: dict | None = None,
) -> dict | None:
    """What ``ShardedCalculator`` costs per MD step next to ASE's own step.

    Every rank of ``MPI.COMM_WORLD`` (or the one process) calls this with the
    same ``atoms`` and an identically built ``model``, and holds the whole
    system (SPMD). Two subjects start from the same Maxwell-Boltzmann momenta
    and run ASE's ``VelocityVerlet``, taking turns step by step, each step
    started on all ranks together:

    - ``baseline``: a :class:`ZeroCalculator`, timed as the whole
      ``dyn.step()`` (what ASE's step costs without a potential);
    - ``sharded``: ``ShardedCalculator(model)`` on all ranks, timed as the
      wall time inside ``calculate`` (the framework's and the model's own
      time), with the per-rank phase breakdown, wall and CPU without MPI.

    With :func:`ase_shard.random_models.no_edge_model` the model has no pairs,
    so the sharded time is the framework's own cost. After each subject's first
    call and one warm-up step, the timed steps follow :func:`_schedule`.

    Parameters
    ----------
    atoms : ase.Atoms
        The system; not modified (each subject works on a copy).
    model : torch.nn.Module
        A ``ShardModel``; ``ShardedCalculator`` casts it to its device and dtype.
    settings : FrameworkSettings
    dtype : torch.dtype, optional
        Precision of the model; default its own.
    labels : dict, optional
        Stored as is under ``"labels"`` (system and model names, command line).

    Returns
    -------
    dict or None
        The report (JSON-encodable) on rank 0, ``None`` on the other ranks.
    """
    comm = Comm()
    load_start = load_average()
    atoms = atoms.copy()
    rng = np.random.default_rng(settings.seed)  # the same momenta on every rank
    thermalize_momenta(atoms, temperature_K=settings.temperature, rng=rng)
    calc = ShardedCalculator(model, skin=settings.skin, dtype=dtype, **(settings.calculator or {}))
    calc.timer.synchronize = True
    context = RunContext.gather(comm, calc, load_start)
    memory = PeakMemory(calc.device)
    memory.start()
    baseline = _Dynamics(atoms, ZeroCalculator(), settings.timestep)
    sharded = _Dynamics(atoms, calc, settings.timestep)
    for subject in (baseline, sharded):  # the first call (a build) and a warm-up step
        subject.atoms.get_forces()
        subject.step(comm, rebuild=False)

    schedule = _schedule(settings.reuse_steps, settings.rebuild_steps)
    samples, sums, rebuilds = _timed_md_steps(comm, baseline, sharded, schedule)
    used = comm.gather(memory.stop())
    ranks = comm.gather(
        {
            kind: {"samples": samples[kind], **phase_means(sums[kind], len(samples[kind]))}
            for kind in KINDS
        }
    )
    if not comm.is_root:
        return None
    return {
        "schema": "ase-shard-bench-framework/1",
        **report_header(atoms, model, settings, context, labels),
        "schedule": schedule,
        "rebuilds": calc.rebuilds,  # the first call's build included
        "max_force": float(np.abs(sharded.atoms.get_forces()).max(initial=0.0)),
        "layout": layout_per_rank(calc),
        "memory": used,
        "results": {kind: _framework_result(ranks, kind, rebuilds[kind]) for kind in KINDS},
    }


def _timed_md_steps(
    comm: Comm, baseline: _Dynamics, sharded: _Dynamics, schedule: list[str]
) -> tuple[dict[str, list], dict[str, PhaseTimer], dict[str, int]]:
    """The steps of ``schedule``, ``baseline`` and ``sharded`` taking turns.

    Returns, per kind of step: this rank's ``(baseline step, inside calculate,
    sharded step)`` seconds per step, the sharded calculator's phase times summed
    over the steps, and the rebuilds those steps made.
    """
    calc = sharded.calc
    samples: dict[str, list[tuple[float, float, float]]] = {kind: [] for kind in KINDS}
    sums = {kind: PhaseTimer() for kind in KINDS}
    rebuilds = dict.fromkeys(KINDS, 0)
    for kind in schedule:
        baseline_s, _ = baseline.step(comm, rebuild=False)
        calc.timer.reset()
        builds = calc.rebuilds
        step_s, inside_s = sharded.step(comm, rebuild=kind == "rebuild")
        rebuilds[kind] += calc.rebuilds - builds
        samples[kind].append((baseline_s, inside_s, step_s))
        _accumulate(sums[kind], calc.timer)
    return samples, sums, rebuilds


def _framework_result(ranks: list[dict], kind: str, rebuilds: int) -> dict:
    """One kind of step of :func:`run_framework` from every rank's samples and sums.

    Samples are listed per step, one value per rank. Medians are over steps,
    of rank 0's time (``baseline_s``) or of the slowest rank's at each step
    (``*_max_s``, ``framework_s``, ``sharded_step_s``); the ratios are medians
    of per-step ratios. Per rank: the phase breakdowns (mean seconds per
    step), the wall time in ``calculate`` and the framework CPU, the CPU
    seconds of :data:`FRAMEWORK_PHASES`, with their max / min over ranks.
    """
    # (rank, step, [baseline step, inside calculate, sharded step])
    samples = np.array([r[kind]["samples"] for r in ranks], dtype=float).reshape(len(ranks), -1, 3)
    baseline, framework, step = samples[..., 0], samples[..., 1], samples[..., 2]
    baseline_max, framework_max = baseline.max(axis=0), framework.max(axis=0)
    per_rank = phases_per_rank([r[kind] for r in ranks])
    cpu = per_rank["breakdown_cpu"]
    framework_cpu = [
        float(sum(cpu[phase][rank] for phase in FRAMEWORK_PHASES)) for rank in range(len(ranks))
    ]
    return {
        "steps": samples.shape[1],
        "rebuilds": rebuilds,
        "baseline_samples_s": baseline.T.tolist(),
        "framework_samples_s": framework.T.tolist(),
        "sharded_step_samples_s": step.T.tolist(),
        "baseline_s": float(np.median(baseline[0])),
        "baseline_max_s": float(np.median(baseline_max)),
        "framework_s": float(np.median(framework_max)),
        "sharded_step_s": float(np.median(step.max(axis=0))),
        "framework_over_baseline": float(np.median(framework_max / baseline_max)),
        "framework_over_baseline_rank0": float(np.median(framework_max / baseline[0])),
        **per_rank,
        "calculate_s": framework.mean(axis=1).tolist(),
        "framework_cpu_s": framework_cpu,
        "framework_cpu_max_over_min": (
            max(framework_cpu) / min(framework_cpu) if min(framework_cpu) > 0 else None
        ),
    }
