"""The harness of ``ase-shard bench``: the bare model against ``ShardedCalculator``, in one run.

One run (:func:`run_benchmark`) measures, for one model and one system, under
whatever rank count it was started with (``P``):

- ``bare``: the model evaluated directly on the whole system as one periodic
  graph (:class:`~ase_shard.bench.bare.BareModel`): the same neighbour-list
  library (``vesin``) with the same skin, the neighbour list reused between
  rebuilds, but no partition, halo or MPI. Rank 0 alone; the other ranks wait.
- ``sharded_1`` (only when ``P > 1``): ``ShardedCalculator`` on a one-rank
  communicator, rank 0 alone.
- ``sharded``: ``ShardedCalculator`` on all ``P`` ranks.
- ``ase`` (optional): the model's own ASE calculator (EMT, LJ, Morse), rank 0
  alone.
- ``ceiling``: the machine's own limit for the speed-up
  (:class:`~ase_shard.bench.machine.Ceiling`), sampled after every round of
  steps.

Every subject evaluates the same sequence of positions: small random
displacements of the input structure, so that ``reuse`` steps keep the
decomposition (and neighbour list) and ``rebuild`` steps rebuild it on every
call. The subjects take turns step by step, so a shared machine's changing load
hits them alike. A timed step starts on all ranks together (a barrier) and ends
when the slowest rank is done, so rank-0-only and all-rank work are timed the
same way. Each subject's first call (a build) runs alone and records the peak
memory per rank; ``ShardedCalculator`` also reports the per-rank breakdown of
:data:`ase_shard.timing.PHASES` (wall clock, and CPU time with MPI calls
excluded) and its layout sizes.

The settings, kinds of steps, phase breakdowns and report header it shares with
the framework-cost run are in :mod:`ase_shard.bench.run`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from ase import Atoms
from ase.calculators.calculator import Calculator

from ase_shard.bench.bare import BareModel
from ase_shard.bench.machine import Ceiling, PeakMemory, load_average, on_root
from ase_shard.bench.run import (
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

# displacement index of the untimed step after each first call
_WARM_UP_STEP = 2**31


@dataclass(frozen=True)
class BenchSettings(StepSettings):
    """What one benchmark run does (:func:`run_benchmark`).

    Attributes
    ----------
    serial_reference : bool
        With ``P > 1`` ranks, also time ``ShardedCalculator`` on rank 0 alone.
    ceiling_seconds : float
        Duration of the ceiling's single-rank loop (one after every step).

    The others, and ``seed`` (of the displacements), as in :class:`StepSettings`.
    """

    serial_reference: bool = True
    ceiling_seconds: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ceiling_seconds <= 0:
            raise ValueError(f"ceiling_seconds must be > 0, not {self.ceiling_seconds}")

    @property
    def amplitude(self) -> float:
        """Largest displacement per axis (Å): any two steps differ by < ``skin / 2``."""
        return self.skin / 12 if self.skin > 0 else 1e-3


# ----------------------------------------------------------------------- the subjects


class Displacements:
    """The positions of step ``k``: the input structure moved by a seeded random amount.

    Every rank computes the same positions. Any two steps differ by less than
    ``skin / 2`` per atom, so a decomposition built at one step stays valid
    for all others.
    """

    def __init__(self, atoms: Atoms, amplitude: float, seed: int):
        self.base = atoms.positions.copy()
        self.amplitude = amplitude
        self.seed = seed

    def __call__(self, step: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, step])
        return self.base + rng.uniform(-self.amplitude, self.amplitude, self.base.shape)


class _ShardedSubject:
    """``ShardedCalculator`` as a benchmark subject."""

    def __init__(self, calc: ShardedCalculator, atoms: Atoms):
        self.calc = calc
        self.atoms = atoms
        atoms.calc = calc
        self.timer = calc.timer
        self.timer.synchronize = True  # per-phase times, at the cost of GPU stalls

    def evaluate(self, rebuild: bool) -> tuple[float, np.ndarray]:
        if rebuild:
            self.calc.request_rebuild()
        forces = self.atoms.get_forces()
        return self.atoms.get_potential_energy(), forces

    def rebuilds(self) -> int:
        return self.calc.rebuilds


class _BareSubject:
    """:class:`BareModel` as a benchmark subject; a rebuild rebuilds its neighbour list."""

    def __init__(self, bare: BareModel, atoms: Atoms):
        self.bare = bare
        self.atoms = atoms
        self.timer = bare.timer
        self.builds = 0

    def evaluate(self, rebuild: bool) -> tuple[float, np.ndarray]:
        if rebuild or self.bare.pairs is None:
            self.bare.build(self.atoms)
            self.builds += 1
        out = self.bare.evaluate(self.atoms)
        return float(out["energy"]), out["forces"]

    def rebuilds(self) -> int:
        return self.builds


class _AseSubject:
    """An ASE calculator (it keeps its own neighbour list) as a benchmark subject."""

    timer = None

    def __init__(self, calc: Calculator, atoms: Atoms):
        self.atoms = atoms
        atoms.calc = calc

    def evaluate(self, rebuild: bool) -> tuple[float, np.ndarray]:
        forces = self.atoms.get_forces()
        return self.atoms.get_potential_energy(), forces

    def rebuilds(self) -> int:
        return 0


# ----------------------------------------------------------------------- the timed steps


@dataclass
class _Entry:
    """One subject of the run: ``subject`` is ``None`` on ranks that do not run it."""

    name: str
    subject: Any
    everyone: bool  # all ranks evaluate it together; else rank 0 alone
    kinds: tuple[str, ...] = KINDS


def _step(comm: Comm, entry: _Entry, positions: np.ndarray, rebuild: bool) -> tuple | None:
    """One timed evaluation at ``positions``: ``(seconds, energy, forces)`` on rank 0.

    A step of a subject that all ranks evaluate starts at a barrier and lasts
    until the slowest rank is done; a rank-0 subject runs while the others wait.
    """

    def run() -> tuple[float, float, np.ndarray]:
        entry.subject.atoms.positions = positions
        if entry.everyone:
            comm.allgather(None)  # all ranks start together
        start = time.perf_counter()
        energy, forces = entry.subject.evaluate(rebuild)
        elapsed = time.perf_counter() - start
        if entry.everyone:
            elapsed = max(comm.allgather(elapsed))
        return elapsed, energy, forces

    if entry.everyone:
        out = run()
        return out if comm.is_root else None
    return on_root(comm, run)


def _first_calls(comm: Comm, entries: list[_Entry], moves: Displacements, device) -> dict:
    """Each subject's first call (a build) and one untimed warm-up step, alone, with
    the peak memory per rank.

    Subjects already built stay resident, so ``peak_rss_delta_mb`` (the peak
    above the resident memory at the call's start) is the subject's own need.
    """
    memory = PeakMemory(device)
    out = {}
    for entry in entries:
        if entry.subject is not None:
            memory.start()
        first = _step(comm, entry, moves(0), rebuild=True)
        _step(comm, entry, moves(_WARM_UP_STEP), rebuild=False)
        if entry.everyone:
            used = comm.gather(memory.stop())
        else:
            used = [memory.stop()] if comm.is_root else None
        if comm.is_root:
            out[entry.name] = {"first_call_s": first[0], "memory": used}
    return out


def _timed_steps(
    comm: Comm,
    entries: list[_Entry],
    moves: Displacements,
    settings: BenchSettings,
    ceiling: Ceiling,
) -> dict:
    """The reuse steps, then the rebuild steps, of all subjects interleaved step by step.

    Interleaving puts every subject under the same load of a shared machine;
    ``ceiling`` takes a sample after every round.
    Returns on rank 0, per subject and kind: median step time, samples,
    energies, rebuild count, the phase breakdowns per step (wall and CPU, a
    list per rank, see :func:`phase_means`) and the last step's forces
    (``"forces"``, an array).
    """
    counts = {"reuse": settings.reuse_steps, "rebuild": settings.rebuild_steps}
    results: dict[str, dict] = {entry.name: {} for entry in entries}
    step = 0
    for kind in KINDS:
        active = [entry for entry in entries if kind in entry.kinds]
        records = {entry.name: ([], [], None) for entry in active}
        builds = {}
        for entry in active:
            if entry.subject is not None:
                if entry.subject.timer is not None:
                    entry.subject.timer.reset()
                builds[entry.name] = entry.subject.rebuilds()
        for _ in range(counts[kind]):
            step += 1
            positions = moves(step)
            for entry in active:
                out = _step(comm, entry, positions, rebuild=kind == "rebuild")
                if out is not None:
                    samples, energies, _ = records[entry.name]
                    samples.append(out[0])
                    energies.append(float(out[1]))
                    records[entry.name] = (samples, energies, out[2])
            ceiling.sample()
        for entry in active:
            timer = entry.subject.timer if entry.subject is not None else None
            mine = None if timer is None else phase_means(timer, counts[kind])
            ranks = comm.gather(mine) if entry.everyone else [mine]
            if not comm.is_root:
                continue
            samples, energies, forces = records[entry.name]
            result = {
                "step_s": float(np.median(samples)),
                "samples_s": samples,
                "energies": energies,
                "rebuilds": entry.subject.rebuilds() - builds[entry.name],
                "forces": forces,
            }
            if ranks[0] is not None:
                result.update(phases_per_rank(ranks))
            results[entry.name][kind] = result
    return results


# ----------------------------------------------------------------------- one run


def run_benchmark(
    atoms: Atoms,
    model: torch.nn.Module,
    settings: BenchSettings,
    *,
    dtype: torch.dtype | None = None,
    ase_calculator: Callable[[], Calculator] | None = None,
    labels: dict | None = None,
) -> dict | None:
    """Measure the bare model, ``ShardedCalculator`` and the ceiling in one run.

    Every rank of ``MPI.COMM_WORLD`` (or the one process) calls this with the
    same ``atoms`` and an identically built ``model``.

    Parameters
    ----------
    atoms : ase.Atoms
        The system; not modified (each subject works on a copy).
    model : torch.nn.Module
        A ``ShardModel``; ``ShardedCalculator`` casts it to its device and dtype.
    settings : BenchSettings
    dtype : torch.dtype, optional
        Precision of the model; default its own.
    ase_calculator : callable, optional
        Builds the model's own ASE calculator, timed on rank 0 over the reuse
        steps' positions.
    labels : dict, optional
        Stored as is under ``"labels"`` (system and model names, command line).

    Returns
    -------
    dict or None
        The report (JSON-encodable) on rank 0, ``None`` on the other ranks.
    """
    comm = Comm()
    load_start = load_average()
    moves = Displacements(atoms, settings.amplitude, settings.seed)
    calc = ShardedCalculator(model, skin=settings.skin, dtype=dtype, **(settings.calculator or {}))
    context = RunContext.gather(comm, calc, load_start)
    entries, alone = _subjects(comm, calc, model, atoms, settings, ase_calculator)
    first_calls = _first_calls(comm, entries, moves, calc.device)
    ceiling = Ceiling(comm, settings.ceiling_seconds)
    results = _timed_steps(comm, entries, moves, settings, ceiling)
    layouts = {
        e.name: layout_per_rank(e.subject.calc)
        for e in entries
        if e.name.startswith("sharded") and e.subject is not None
    }
    del calc, entries  # the calculators go before the one-rank communicator they use
    if alone is not None:
        alone.Free()
    if not comm.is_root:
        return None

    for name, result in results.items():
        result.update(first_calls[name])
        if name in layouts:
            result["layout"] = layouts[name]
    # the last step's forces of each kind, for the agreement (not in the report)
    forces = {
        name: {kind: result[kind].pop("forces") for kind in KINDS if kind in result}
        for name, result in results.items()
    }
    report = {
        "schema": "ase-shard-bench/1",
        **report_header(atoms, model, settings, context, labels),
        "agreement": _agreement(results, forces),
        "results": results,
        "ceiling": ceiling.result(),
    }
    report["ratios"] = _ratios(report)
    return report


def _subjects(
    comm: Comm,
    calc: ShardedCalculator,
    model: torch.nn.Module,
    atoms: Atoms,
    settings: BenchSettings,
    ase_calculator: Callable[[], Calculator] | None,
) -> tuple[list[_Entry], Any]:
    """The subjects of :func:`run_benchmark`, each on its own copy of ``atoms``, and the
    one-rank communicator of ``sharded_1`` (``None`` without it; the caller frees it).

    ``calc`` is the ``P``-rank calculator; the others are built on rank 0 alone, the
    bare model in ``calc``'s device and dtype.
    """
    entries = [_Entry("sharded", _ShardedSubject(calc, atoms.copy()), everyone=True)]
    options = dict(settings.calculator or {})
    alone = None
    if comm.size > 1 and settings.serial_reference:
        alone = comm.split_self()

        def sharded_alone() -> _ShardedSubject:
            one = ShardedCalculator(
                model, skin=settings.skin, dtype=calc.dtype, comm=alone, **options
            )
            return _ShardedSubject(one, atoms.copy())

        entries.append(_Entry("sharded_1", on_root(comm, sharded_alone), everyone=False))

    def bare() -> _BareSubject:
        return _BareSubject(BareModel(model, settings.skin, calc.dtype, calc.device), atoms.copy())

    entries.append(_Entry("bare", on_root(comm, bare), everyone=False))
    if ase_calculator is not None:
        subject = on_root(comm, lambda: _AseSubject(ase_calculator(), atoms.copy()))
        entries.append(_Entry("ase", subject, everyone=False, kinds=("reuse",)))
    return entries, alone


def _agreement(results: dict, forces: dict) -> dict:
    """Largest relative differences from the bare model over the steps all subjects ran.

    Energies: max |E - E_bare| / max |E_bare| over the steps; forces: max
    |F - F_bare| / max |F_bare| at the last step of each kind.
    """
    bare = results["bare"]
    out = {}
    for name, result in results.items():
        if name == "bare":
            continue
        energy, force = 0.0, 0.0
        for kind in KINDS:
            if kind not in result:
                continue
            e, e_bare = np.array(result[kind]["energies"]), np.array(bare[kind]["energies"])
            energy = max(energy, float(np.abs(e - e_bare).max() / np.abs(e_bare).max()))
            f, f_bare = forces[name][kind], forces["bare"][kind]
            force = max(force, float(np.abs(f - f_bare).max() / np.abs(f_bare).max()))
        out[name] = {"energy": energy, "forces": force}
    return out


def paired_ratio(results: dict, a: str, b: str, kind: str) -> float:
    """Median over steps of ``a``'s step time over ``b``'s at the same step.

    The subjects took turns, so each pair ran under nearly the same load; the
    median of these ratios is steadier than the ratio of the medians.
    """
    times_a = np.array(results[a][kind]["samples_s"])
    times_b = np.array(results[b][kind]["samples_s"])
    return float(np.median(times_a / times_b))


def _ratios(report: dict) -> dict:
    """Step-time ratios of one run (per kind), the ceiling and the memory ratio.

    ``speedup`` is the one-rank ``ShardedCalculator`` step over the ``P``-rank
    one, ``efficiency`` that over ``P``; ``speedup_vs_bare`` uses the bare
    model's step instead; ``sharded_1_over_bare`` is the one-rank overhead;
    ``ase_over_sharded`` compares ASE's own calculator. Each is a
    :func:`paired_ratio`.
    """
    results, size = report["results"], report["ranks"]
    one = "sharded" if size == 1 else "sharded_1" if "sharded_1" in results else None
    out: dict[str, Any] = {"ceiling": report["ceiling"]["speedup"]}
    for kind in KINDS:
        speedup_vs_bare = paired_ratio(results, "bare", "sharded", kind)
        entry = {"speedup_vs_bare": speedup_vs_bare, "efficiency_vs_bare": speedup_vs_bare / size}
        if one is not None:
            speedup = paired_ratio(results, one, "sharded", kind)
            entry.update(
                sharded_1_over_bare=paired_ratio(results, one, "bare", kind),
                speedup=speedup,
                efficiency=speedup / size,
            )
        out[kind] = entry
    if "ase" in results:
        out["ase_over_sharded"] = paired_ratio(results, "ase", "sharded", "reuse")
        if one is not None and one != "sharded":
            out["ase_over_sharded_1"] = paired_ratio(results, "ase", one, "reuse")
    if one is not None and size > 1:
        # what a first call (build + evaluation) adds to the process, and the whole process
        for key, field in (
            ("memory_ratio", "peak_rss_delta_mb"),
            ("rss_ratio", "peak_rss_mb"),
            ("cuda_memory_ratio", "cuda_peak_delta_mb"),  # GPU runs only
        ):
            peaks = [m.get(field) for m in results["sharded"]["memory"]]
            reference = results[one]["memory"][0].get(field)
            if None not in peaks and reference:
                out[key] = max(peaks) / reference
    return out
