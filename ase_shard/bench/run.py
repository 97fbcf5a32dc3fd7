"""What every benchmark run has: its step settings, its kinds of steps, the per-rank
phase breakdowns and layout of its calculator, and the report's header.

Both measurements, :func:`ase_shard.bench.harness.run_benchmark` and
:func:`ase_shard.bench.framework.run_framework`, time ``reuse`` and ``rebuild``
steps (:data:`KINDS`) under the same :class:`StepSettings`, record each rank's
seconds per phase of :data:`ase_shard.timing.PHASES` the same way (wall clock,
and CPU with MPI calls excluded: :data:`BREAKDOWNS`), and open their reports
with the same header (:func:`report_header`): where and how the run computed.
"""

from __future__ import annotations

import os
import platform
import socket
import time
from dataclasses import asdict, dataclass

import torch
from ase import Atoms

import ase_shard
from ase_shard.bench.machine import load_average, source_state, usable_cpus
from ase_shard.calculator import ShardedCalculator
from ase_shard.comm import Comm
from ase_shard.timing import PHASES, PhaseTimer

# the kinds of timed steps: they reuse the decomposition / rebuild it
KINDS = ("reuse", "rebuild")


@dataclass(frozen=True)
class StepSettings:
    """The timed steps and the calculator's options, common to both measurements.

    Attributes
    ----------
    reuse_steps, rebuild_steps : int
        Timed steps that reuse the decomposition / rebuild it.
    skin : float
        Neighbour-list skin (Å) of the calculator (and of the bare model).
    seed : int
        Seed of the random numbers (the same on every rank).
    calculator : dict
        Further keyword arguments of ``ShardedCalculator`` (``device``, ...).
    """

    reuse_steps: int = 5
    rebuild_steps: int = 3
    skin: float = 0.5
    seed: int = 0
    calculator: dict | None = None

    def __post_init__(self) -> None:
        if self.reuse_steps < 1 or self.rebuild_steps < 1:
            raise ValueError("reuse_steps and rebuild_steps must be >= 1")
        if self.skin < 0:
            raise ValueError(f"skin must be >= 0, not {self.skin}")


# ----------------------------------------------------------------------- breakdowns


# the breakdowns per phase: wall-clock seconds, and CPU seconds with MPI calls excluded
BREAKDOWNS = {"breakdown": "totals", "breakdown_cpu": "cpu"}


def phase_means(timer: PhaseTimer, steps: int) -> dict[str, dict[str, float]]:
    """This rank's seconds per phase and step: wall (``breakdown``) and CPU
    without MPI calls (``breakdown_cpu``), from ``timer``'s totals over ``steps``."""
    return {
        field: {phase: getattr(timer, totals)[phase] / steps for phase in PHASES}
        for field, totals in BREAKDOWNS.items()
    }


def phases_per_rank(ranks: list[dict]) -> dict[str, dict[str, list[float]]]:
    """Every rank's :func:`phase_means` as ``{field: {phase: [value per rank]}}``."""
    return {
        field: {phase: [r[field][phase] for r in ranks] for phase in PHASES}
        for field in BREAKDOWNS
    }


def layout_per_rank(calc: ShardedCalculator) -> list[list[int]] | None:
    """Rank 0: ``[rows, owned, nodes]`` per rank of the calculator's layout."""
    counts = calc.layout_counts
    return None if counts is None else [[int(n) for n in c] for c in counts]


# ----------------------------------------------------------------------- the report's header


@dataclass(frozen=True)
class RunContext:
    """Where a run computes, as rank 0 records it for the report.

    Attributes
    ----------
    ranks : int
    threads, cpus : list of int
        Each rank's torch threads and the CPUs its affinity allows.
    device : torch.device
    dtype : torch.dtype
        The calculator's.
    load_start : float or None
        The 1-minute load average at the start of the run.
    """

    ranks: int
    threads: list[int]
    cpus: list[int]
    device: torch.device
    dtype: torch.dtype
    load_start: float | None

    @classmethod
    def gather(
        cls, comm: Comm, calc: ShardedCalculator, load_start: float | None
    ) -> RunContext | None:
        """Every rank's threads and CPUs (collective); the context on rank 0, else ``None``."""
        threads, cpus = comm.gather(torch.get_num_threads()), comm.gather(usable_cpus())
        if not comm.is_root:
            return None
        return cls(comm.size, threads, cpus, calc.device, calc.dtype, load_start)


def report_header(
    atoms: Atoms,
    model: torch.nn.Module,
    settings: StepSettings,
    context: RunContext,
    labels: dict | None,
) -> dict:
    """What a report says about the run besides its results: labels, environment
    (with the load average at the start and now), ranks, threads, device, dtype,
    system, model and settings."""
    settings_json = asdict(settings)
    settings_json["calculator"] = {k: str(v) for k, v in (settings.calculator or {}).items()}
    return {
        "labels": dict(labels or {}),
        "environment": {
            "host": socket.gethostname(),
            # the machine's; a launcher that binds ranks to cores leaves each rank fewer
            "cpus": os.cpu_count(),
            "cpus_per_rank": context.cpus,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "ase_shard": ase_shard.__version__,
            "source": source_state(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            # 1-minute load averages: other jobs on a shared machine distort the timings
            "load_average": [context.load_start, load_average()],
        },
        "ranks": context.ranks,
        "threads_per_rank": context.threads,
        "device": str(context.device),
        "dtype": str(context.dtype).removeprefix("torch."),
        "system": {
            "n_atoms": len(atoms),
            "formula": atoms.get_chemical_formula(),
            "pbc": [bool(p) for p in atoms.pbc],
            "cell": atoms.cell.array.tolist(),
        },
        "model": {
            "class": type(model).__name__,
            "cutoff": float(model.cutoff),
            "num_layers": int(model.num_layers),
            "parameters": int(sum(p.numel() for p in model.parameters())),
        },
        "settings": settings_json,
    }
