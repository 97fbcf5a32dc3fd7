"""``ase-shard bench``: the bare model against ``ShardedCalculator``, in one run.

One run measures, for one model and one system, under whatever rank count it
was started with (``P``):

- ``bare``: the model evaluated directly on the whole system as one periodic
  graph: the same neighbour-list library (``vesin``) with the same skin, the
  neighbour list reused between rebuilds, but no partition, halo or MPI. Rank 0
  alone; the other ranks wait.
- ``sharded_1`` (only when ``P > 1``): ``ShardedCalculator`` on a one-rank
  communicator, rank 0 alone.
- ``sharded``: ``ShardedCalculator`` on all ``P`` ranks.
- ``ase`` (optional): the model's own ASE calculator (EMT, LJ, Morse), rank 0
  alone.
- ``ceiling``: the machine's own limit for the speed-up, a fixed single-thread
  tanh/matmul loop on rank 0 alone and the same loop split over the ``P``
  ranks, sampled after every round of steps.

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

:func:`run_framework` (``ase-shard bench --framework``) measures instead what
``ShardedCalculator`` costs per MD step next to ASE's own ``VelocityVerlet``
step: both run on every rank's copy of the system, ASE's step with a
calculator that returns zeros, the sharded one with a model that has no pairs
(:func:`no_edge_model`) or any other, and each rank's CPU time per phase.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import ctypes.util
import gc
import math
import os
import platform
import resource
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import vesin
from ase import Atoms, units
from ase.calculators.calculator import Calculator, all_changes
from ase.data import chemical_symbols
from ase.md.velocitydistribution import thermalize_momenta
from ase.md.verlet import VelocityVerlet

import ase_shard
from ase_shard.block import RESULT_COLUMNS, edge_images, sum_edge_gradients
from ase_shard.calculator import ShardedCalculator
from ase_shard.comm import Comm
from ase_shard.graph import EdgeList, LocalGraph, direct_forces, takes_pairs_once
from ase_shard.models import LennardJones
from ase_shard.timing import PHASES, PhaseTimer

# rows x width of the ceiling's tanh/matmul loop: small enough for the L2 cache
_CEILING_SHAPE = (256, 64)
# largest relative difference from the bare model that is round-off, per dtype
AGREEMENT_TOLERANCE = {"float64": 1e-8, "float32": 1e-3}
# displacement index of the untimed step after each first call
_WARM_UP_STEP = 2**31
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


# ----------------------------------------------------------------------- the bare model


class BareModel:
    """A model evaluated on the whole system as one periodic graph, without decomposition.

    The neighbour list (``vesin``, periodic, radius ``cutoff + skin``) is built
    by :meth:`build` and reused by :meth:`evaluate` until the next build, as
    ``ShardedCalculator`` reuses its local lists. Each evaluation forms the
    edge vectors in float64, keeps those within ``cutoff``, runs the model and
    one backward pass, and sums forces and per-atom virials, so it delivers what
    ``ShardedCalculator`` delivers. A model with its own compiled forces
    (:class:`ase_shard.graph.DirectForces`: the built-in potentials) is
    evaluated through them on a CPU in float64, as ``ShardedCalculator`` does.

    Parameters
    ----------
    model : torch.nn.Module
        A ``ShardModel``, already on ``device`` in ``dtype``.
    skin : float
        Extra neighbour-list radius (Å).
    dtype : torch.dtype
    device : torch.device
    """

    def __init__(
        self, model: torch.nn.Module, skin: float, dtype: torch.dtype, device: torch.device
    ):
        self.model = model
        self.skin = skin
        self.dtype = dtype
        self.device = torch.device(device)
        self.timer = PhaseTimer(self.device, synchronize=True)
        self.pairs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.images: tuple[np.ndarray, np.ndarray] | None = None  # see block.edge_images

    def build(self, atoms: Atoms) -> None:
        """The periodic neighbour list of ``atoms`` within ``cutoff + skin``."""
        with self.timer.phase("neighbors"):
            periodic = atoms.pbc.any()
            box = atoms.cell.array if periodic else np.zeros((3, 3))
            nl = vesin.NeighborList(cutoff=float(self.model.cutoff) + self.skin, full_list=True)
            i, j, shifts = nl.compute(atoms.positions, box, periodic=atoms.pbc, quantities="ijS")
            if takes_pairs_once(self.model):
                # one edge per pair (both of a self-image pair), as LocalBlock lists them
                once = j >= i
                i, j, shifts = i[once], j[once], shifts[once]
            self.pairs = tuple(
                torch.as_tensor(a.astype(np.int64), device=self.device) for a in (i, j, shifts)
            )
            shifted = np.flatnonzero(shifts.any(axis=1))
            self.images = edge_images(len(i), shifted, shifts[shifted].astype(np.float64))

    def evaluate(self, atoms: Atoms) -> dict[str, np.ndarray]:
        """Energy, per-atom energies, forces and virial (eV, eV/Å, eV) of ``atoms``."""
        direct = direct_forces(self.model)
        if direct is not None and self.device.type == "cpu" and self.dtype == torch.float64:
            return self._evaluate_direct(direct, atoms)
        timer, device = self.timer, self.device
        with timer.phase("forward"):
            i, j, shifts = self.pairs
            positions = torch.as_tensor(atoms.positions, device=device)
            cell = torch.as_tensor(atoms.cell.array, device=device)
            vectors64 = positions[j] - positions[i] + shifts.to(torch.float64) @ cell
            within = (vectors64 * vectors64).sum(dim=1) < float(self.model.cutoff) ** 2
            i, j, d = i[within], j[within], vectors64[within]
            vectors = d.to(self.dtype).detach().requires_grad_(True)
            numbers = torch.as_tensor(atoms.numbers, dtype=torch.int64, device=device)
            graph = LocalGraph(numbers, torch.stack([i, j]), vectors, len(atoms))
            energies = self.model(graph)
        with timer.phase("backward"):
            (grad,) = torch.autograd.grad(energies.sum(), vectors)
            grad = grad.to(torch.float64)
        with timer.phase("reverse"):
            rows = sum_edge_gradients(i, j, d, grad, len(atoms))
            energies = energies.detach().to(torch.float64)
            out = {
                "energy": energies.sum().cpu().numpy(),
                "energies": energies.cpu().numpy(),
                "forces": rows[:, :3].cpu().numpy(),
                "virial": rows[:, 3:].sum(dim=0).cpu().numpy(),
            }
        return out

    def _evaluate_direct(self, model, atoms: Atoms) -> dict[str, np.ndarray]:
        """:meth:`evaluate` by the model's compiled kernel, on the host."""
        with self.timer.phase("forward"):
            i, j = self.pairs[0].numpy(), self.pairs[1].numpy()
            image, table = self.images
            numbers = atoms.numbers.astype(np.int64)
            cell = atoms.cell.array
            edges = EdgeList(
                atoms.positions, numbers, i, j, image, table @ cell, len(atoms), self.model.cutoff
            )
            rows = np.zeros((RESULT_COLUMNS, len(atoms)))
            model.energy_forces(edges, rows)
        return {
            "energy": rows[0].sum(),
            "energies": rows[0],
            "forces": rows[1:4].T,
            "virial": rows[4:].sum(axis=1),
        }


# ----------------------------------------------------------------------- random ML models


def _symbols(numbers: Sequence[int]) -> list[str]:
    """The distinct elements of ``numbers``, as sorted chemical symbols."""
    return sorted(chemical_symbols[z] for z in np.unique(numbers))


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """torch's default dtype set to ``dtype`` inside, restored afterwards."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def random_sevennet_network(
    symbols: Sequence[str],
    *,
    cutoff: float,
    channels: int,
    num_layers: int,
    seed: int = 0,
    config: dict | None = None,
) -> torch.nn.Module:
    """A random-weight SevenNet ``AtomGraphSequential`` (``lmax`` 2), as built (float32).

    ``symbols`` in sorted order; ``config`` overrides entries of sevenn's default
    model configuration (keys from ``sevenn._keys``). Needs the ``sevenn``
    package; the same ``seed`` gives the same weights on every rank.
    """
    import sevenn._const as const
    import sevenn._keys as KEY
    import sevenn.util
    from sevenn.model_build import build_E3_equivariant_model

    settings = copy.deepcopy(const.DEFAULT_E3_EQUIVARIANT_MODEL_CONFIG)
    settings.update(sevenn.util.chemical_species_preprocess(list(symbols)))
    settings.update(
        {
            KEY.CUTOFF: cutoff,
            KEY.NODE_FEATURE_MULTIPLICITY: channels,
            KEY.LMAX: 2,
            KEY.IS_PARITY: False,
            KEY.NUM_CONVOLUTION: num_layers,
            KEY.USE_SPECIES_WISE_SHIFT_SCALE: True,
            **(config or {}),
        }
    )
    torch.manual_seed(seed)
    return build_E3_equivariant_model(settings)


def random_sevennet(
    numbers: Sequence[int],
    *,
    cutoff: float = 5.0,
    channels: int = 32,
    num_layers: int = 3,
    seed: int = 0,
) -> torch.nn.Module:
    """A random-weight SevenNet adapter of the real architecture (``lmax`` 2), float64."""
    import sevenn._keys as KEY

    from ase_shard.models.sevenn import SevenNet

    symbols = _symbols(numbers)
    network = random_sevennet_network(
        symbols,
        cutoff=cutoff,
        channels=channels,
        num_layers=num_layers,
        seed=seed,
        config={
            KEY.CONV_DENOMINATOR: 30.0,
            KEY.SHIFT: [-3.0] * len(symbols),  # eV per atom
            KEY.SCALE: [1.0] * len(symbols),
        },
    )
    return SevenNet(network.double())


def random_mace(
    numbers: Sequence[int],
    *,
    cutoff: float = 5.0,
    channels: int = 32,
    num_layers: int = 2,
    seed: int = 0,
) -> torch.nn.Module:
    """A random-weight ScaleShiftMACE (hidden ``Cx0e + Cx1o``, ``max_ell`` 2), float64.

    Needs the ``mace-torch`` package (its own environment, ``.venv-mace``).
    """
    # mace first: importing it lets torch.load read e3nn's pickled constants
    from mace import modules  # noqa: I001
    from e3nn import o3

    from ase_shard.models.mace import MACE

    elements = [int(z) for z in np.unique(numbers)]
    torch.manual_seed(seed)
    with _default_dtype(torch.float64):  # MACE's buffers take the default dtype
        network = modules.ScaleShiftMACE(
            r_max=cutoff,
            num_bessel=8,
            num_polynomial_cutoff=5,
            max_ell=2,
            interaction_cls=modules.interaction_classes["RealAgnosticResidualInteractionBlock"],
            interaction_cls_first=modules.interaction_classes[
                "RealAgnosticResidualInteractionBlock"
            ],
            num_interactions=num_layers,
            num_elements=len(elements),
            hidden_irreps=o3.Irreps(f"{channels}x0e+{channels}x1o"),
            MLP_irreps=o3.Irreps("16x0e"),
            atomic_energies=np.full(len(elements), -3.0),
            avg_num_neighbors=40.0,
            atomic_numbers=elements,
            correlation=3,
            gate=torch.nn.functional.silu,
            radial_MLP=[64, 64, 64],
            atomic_inter_scale=1.0,
            atomic_inter_shift=0.0,
        )
    return MACE(network)


def random_nequip(
    numbers: Sequence[int],
    *,
    cutoff: float = 5.0,
    channels: int = 32,
    num_layers: int = 3,
    seed: int = 0,
) -> torch.nn.Module:
    """A random-weight NequIP adapter of the real architecture (``l_max`` 1), float64.

    Needs the ``nequip`` package. nequip builds under its global state (float64
    default dtype); the previous default dtype is restored afterwards (the
    model's numerics do not depend on it).
    """
    from nequip.model import NequIPGNNModel
    from nequip.utils.global_state import set_global_state

    from ase_shard.models.nequip import NequIP

    symbols = _symbols(numbers)
    with _default_dtype(torch.float64):
        set_global_state()  # nequip builds under its global state (float64 default)
        network = NequIPGNNModel(
            seed=seed,
            model_dtype="float64",
            type_names=symbols,
            r_max=cutoff,
            avg_num_neighbors=20.0,
            per_type_energy_shifts=dict.fromkeys(symbols, -3.0),  # eV per atom
            per_type_energy_scales=dict.fromkeys(symbols, 1.0),
            num_layers=num_layers,
            l_max=1,
            num_features=channels,
            radial_mlp_width=32,
        )
    return NequIP(network.eval())


ML_MODELS: dict[str, Callable[..., torch.nn.Module]] = {
    "sevennet": random_sevennet,
    "mace": random_mace,
    "nequip": random_nequip,
}


# ----------------------------------------------------------------------- memory

_LIBC = ctypes.CDLL(ctypes.util.find_library("c"))


def _release_memory() -> None:
    """Collect garbage and hand freed heap back to the OS (glibc), so a phase's peak
    starts from what is still in use."""
    gc.collect()
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


def _rss_mb() -> float | None:
    """Resident memory of this process now (MiB), ``None`` without ``/proc``."""
    try:
        with open("/proc/self/statm") as statm:
            pages = int(statm.read().split()[1])
    except OSError:
        return None
    return pages * resource.getpagesize() / 2**20


def _reset_rss_peak() -> bool:
    """Reset this process's peak resident memory to its current one (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return True


class PeakMemory:
    """Peak memory of this process over one phase of the benchmark.

    ``ru_maxrss`` is a high-water mark over the process's life; on Linux it is
    reset at :meth:`start` (``/proc/self/clear_refs``), elsewhere a phase's
    peak includes every earlier phase (``reset`` is then false). On CUDA the
    peak of ``torch.cuda.max_memory_allocated`` is reported too, and its rise
    over what was allocated at :meth:`start` (torch's cache emptied first).
    """

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.device = device
        self.reset = False
        self.start_mb: float | None = None
        self.cuda_start_mb = 0.0

    def start(self) -> None:
        _release_memory()
        self.reset = _reset_rss_peak()
        self.start_mb = _rss_mb()
        if self.cuda:
            torch.cuda.empty_cache()  # the previous subject's cached blocks are not this one's
            torch.cuda.reset_peak_memory_stats(self.device)
            self.cuda_start_mb = torch.cuda.memory_allocated(self.device) / 2**20

    def stop(self) -> dict:
        """``peak_rss_mb``, ``start_rss_mb``, their difference and (CUDA) ``cuda_peak_mb``
        and ``cuda_peak_delta_mb``."""
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak_mb = peak / (2**20 if platform.system() == "Darwin" else 2**10)
        out = {
            "peak_rss_mb": peak_mb,
            "start_rss_mb": self.start_mb,
            "peak_rss_delta_mb": None if self.start_mb is None else peak_mb - self.start_mb,
            "peak_reset": self.reset,
        }
        if self.cuda:
            out["cuda_peak_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
            out["cuda_peak_delta_mb"] = out["cuda_peak_mb"] - self.cuda_start_mb
        return out


# ----------------------------------------------------------------------- measurement


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


def _on_root(comm: Comm, compute: Callable[[], Any]) -> Any:
    """``compute()`` on rank 0 while the other ranks wait; its value on rank 0
    (``None`` elsewhere). An error on rank 0 is raised on every rank."""
    value, error = None, None
    if comm.is_root:
        try:
            value = compute()
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
    # waiting ranks sleep: spinning would take CPU from rank 0's timings
    comm.rendezvous(None, "finish rank 0's measurement")
    error = comm.bcast(error)
    if error is not None:
        raise RuntimeError(f"rank 0 failed while the other ranks waited: {error}")
    return value


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
    return _on_root(comm, run)


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
    list per rank, see :func:`_phase_means`) and the last step's forces
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
            mine = None if timer is None else _phase_means(timer, counts[kind])
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
                result.update(_per_rank(ranks))
            results[entry.name][kind] = result
    return results


# the breakdowns per phase: wall-clock seconds, and CPU seconds with MPI calls excluded
BREAKDOWNS = {"breakdown": "totals", "breakdown_cpu": "cpu"}


def _phase_means(timer: PhaseTimer, steps: int) -> dict[str, dict[str, float]]:
    """This rank's seconds per phase and step: wall (``breakdown``) and CPU
    without MPI calls (``breakdown_cpu``), from ``timer``'s totals over ``steps``."""
    return {
        field: {phase: getattr(timer, totals)[phase] / steps for phase in PHASES}
        for field, totals in BREAKDOWNS.items()
    }


def _per_rank(ranks: list[dict]) -> dict[str, dict[str, list[float]]]:
    """Every rank's :func:`_phase_means` as ``{field: {phase: [value per rank]}}``."""
    return {
        field: {phase: [r[field][phase] for r in ranks] for phase in PHASES}
        for field in BREAKDOWNS
    }


def _layout(calc: ShardedCalculator) -> list[list[int]] | None:
    """Rank 0: ``[rows, owned, nodes]`` per rank of the calculator's layout."""
    counts = calc.layout_counts
    return None if counts is None else [[int(n) for n in c] for c in counts]


def _spin(iterations: int) -> None:
    """The ceiling's fixed single-thread work: ``iterations`` of tanh(x @ w)."""
    x = torch.full(_CEILING_SHAPE, 0.5, dtype=torch.float64)
    w = torch.full((_CEILING_SHAPE[1], _CEILING_SHAPE[1]), 1.0 / _CEILING_SHAPE[1])
    w = w.to(torch.float64)
    for _ in range(iterations):
        x = torch.tanh(x @ w + 0.1)


class Ceiling:
    """The machine's own speed-up limit on ``comm.size`` ranks, sampled between steps.

    A fixed amount of single-thread work (calibrated on rank 0 to last
    ``seconds``) runs on rank 0 alone while the others wait, then split evenly
    over all ranks, each timed from a common start to the slowest rank's end.
    :meth:`sample` takes one of each; the benchmark samples after every round
    of steps, so the ceiling sees the load the steps saw. ``speedup`` is the
    median over samples of serial time / split time.
    """

    def __init__(self, comm: Comm, seconds: float):
        self.comm = comm
        size = comm.size

        def calibrate() -> int:
            start = time.perf_counter()
            _spin(64)
            per_iteration = (time.perf_counter() - start) / 64
            return size * max(1, math.ceil(seconds / per_iteration / size))

        self.iterations = comm.bcast(_on_root(comm, calibrate))
        self.serial: list[float] = []
        self.split: list[float] = []

    def sample(self) -> None:
        """One serial run on rank 0 and one split run on all ranks."""
        comm = self.comm

        def serial_run() -> float:
            start = time.perf_counter()
            _spin(self.iterations)
            return time.perf_counter() - start

        self.serial.append(comm.bcast(_on_root(comm, serial_run)))
        comm.allgather(None)
        start = time.perf_counter()
        _spin(self.iterations // comm.size)
        self.split.append(max(comm.allgather(time.perf_counter() - start)))

    def result(self) -> dict:
        """Iterations, the samples, their medians and ``speedup`` (median of ratios)."""
        serial, split = np.array(self.serial), np.array(self.split)
        return {
            "iterations": self.iterations,
            "serial_samples_s": self.serial,
            "split_samples_s": self.split,
            "serial_s": float(np.median(serial)),
            "split_s": float(np.median(split)),
            "speedup": float(np.median(serial / split)),
        }


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
    load_start = _load_average()
    moves = Displacements(atoms, settings.amplitude, settings.seed)
    options = dict(settings.calculator or {})

    calc = ShardedCalculator(model, skin=settings.skin, dtype=dtype, **options)
    device, dtype = calc.device, calc.dtype
    threads = _threads_and_cpus(comm)
    entries = [_Entry("sharded", _ShardedSubject(calc, atoms.copy()), everyone=True)]
    alone = None
    if comm.size > 1 and settings.serial_reference:
        alone = comm.split_self()

        def sharded_alone() -> _ShardedSubject:
            one = ShardedCalculator(model, skin=settings.skin, dtype=dtype, comm=alone, **options)
            return _ShardedSubject(one, atoms.copy())

        entries.append(_Entry("sharded_1", _on_root(comm, sharded_alone), everyone=False))
    bare = _on_root(
        comm, lambda: _BareSubject(BareModel(model, settings.skin, dtype, device), atoms.copy())
    )
    entries.append(_Entry("bare", bare, everyone=False))
    if ase_calculator is not None:
        subject = _on_root(comm, lambda: _AseSubject(ase_calculator(), atoms.copy()))
        entries.append(_Entry("ase", subject, everyone=False, kinds=("reuse",)))

    first_calls = _first_calls(comm, entries, moves, device)
    ceiling = Ceiling(comm, settings.ceiling_seconds)
    results = _timed_steps(comm, entries, moves, settings, ceiling)
    layouts = {
        e.name: _layout(e.subject.calc)
        for e in entries
        if e.name.startswith("sharded") and e.subject is not None
    }
    del calc, entries, bare
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
        **_report_header(
            atoms,
            model,
            settings,
            threads,
            device,
            dtype,
            labels,
            load_start,
            comm.size,
        ),
        "agreement": _agreement(results, forces),
        "results": results,
        "ceiling": ceiling.result(),
    }
    report["ratios"] = _ratios(report)
    return report


def _threads_and_cpus(comm: Comm) -> tuple[list[int], list[int]] | None:
    """Every rank's torch threads and the CPUs its affinity allows (rank 0; ``None`` elsewhere)."""
    threads, cpus = comm.gather(torch.get_num_threads()), comm.gather(_cpus())
    return None if threads is None else (threads, cpus)


def _report_header(
    atoms: Atoms,
    model: torch.nn.Module,
    settings: StepSettings,
    threads: tuple[list[int], list[int]],
    device: torch.device,
    dtype: torch.dtype,
    labels: dict | None,
    load_start: float | None,
    size: int,
) -> dict:
    """What a report says about the run besides its results: labels, environment
    (with the load average at ``load_start`` and now), ranks, threads, device,
    dtype, system, model and settings. ``threads`` is each rank's torch threads
    and the number of CPUs its affinity allows."""
    threads, affinity = threads
    settings_json = asdict(settings)
    settings_json["calculator"] = {k: str(v) for k, v in (settings.calculator or {}).items()}
    return {
        "labels": dict(labels or {}),
        "environment": {
            "host": socket.gethostname(),
            # the machine's; a launcher that binds ranks to cores leaves each rank fewer
            "cpus": os.cpu_count(),
            "cpus_per_rank": affinity,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "ase_shard": ase_shard.__version__,
            "source": _source_state(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            # 1-minute load averages: other jobs on a shared machine distort the timings
            "load_average": [load_start, _load_average()],
        },
        "ranks": size,
        "threads_per_rank": threads,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
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


def _source_state() -> dict | None:
    """The git commit of the ``ase_shard`` checkout and its modified files (``None``
    outside a git checkout): what code produced the timings."""
    package = os.path.dirname(os.path.abspath(__file__))

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "-C", package, *args], capture_output=True, text=True, timeout=30
        )
        if done.returncode != 0:
            raise OSError(done.stderr)
        return done.stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        status = git("status", "--porcelain", "--untracked-files=no", "--", ".")
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "modified": [line[3:] for line in status.splitlines()]}


def _load_average() -> float | None:
    """The 1-minute load average (``None`` where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _cpus() -> int:
    """CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


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


# ----------------------------------------------------------------------- framework cost

# the phases of the model's work (its neighbour list, evaluation and gradient sum); the
# others are the framework's own (ShardedCalculator's): their CPU is the "framework CPU"
MODEL_PHASES = ("neighbors", "forward", "backward", "reverse")
FRAMEWORK_PHASES = tuple(phase for phase in PHASES if phase not in MODEL_PHASES)
# the project's bound on the largest framework CPU of a rank over the smallest one's
FRAMEWORK_BALANCE = 1.10
NO_EDGE = "no-edge"


def no_edge_model() -> torch.nn.Module:
    """A model without pairs: Lennard-Jones cut off at 0.3 Å (``sigma`` 0.1 Å).

    No two atoms of a real structure are that close, so the model sees no
    edges and ``ShardedCalculator`` with it costs what the framework itself
    costs: validation, decomposition, scatter, an empty neighbour search and
    model, gather. Its halo is only ``0.3 Å + skin`` wide, thinner than a real
    model's, so ghost rows cost less than they would there.
    """
    return LennardJones(sigma=0.1, rc=0.3)


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

    With :func:`no_edge_model` the model has no pairs, so the sharded time is
    the framework's own cost. After each subject's first call and one
    warm-up step, the timed steps follow :func:`_schedule`.

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
    load_start = _load_average()
    atoms = atoms.copy()
    rng = np.random.default_rng(settings.seed)  # the same momenta on every rank
    thermalize_momenta(atoms, temperature_K=settings.temperature, rng=rng)
    calc = ShardedCalculator(model, skin=settings.skin, dtype=dtype, **(settings.calculator or {}))
    calc.timer.synchronize = True
    threads = _threads_and_cpus(comm)
    memory = PeakMemory(calc.device)
    memory.start()
    baseline = _Dynamics(atoms, ZeroCalculator(), settings.timestep)
    sharded = _Dynamics(atoms, calc, settings.timestep)
    for subject in (baseline, sharded):  # the first call (a build) and a warm-up step
        subject.atoms.get_forces()
        subject.step(comm, rebuild=False)

    schedule = _schedule(settings.reuse_steps, settings.rebuild_steps)
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
    used = comm.gather(memory.stop())
    ranks = comm.gather(
        {
            kind: {"samples": samples[kind], **_phase_means(sums[kind], len(samples[kind]))}
            for kind in KINDS
        }
    )
    if not comm.is_root:
        return None
    return {
        "schema": "ase-shard-bench-framework/1",
        **_report_header(
            atoms,
            model,
            settings,
            threads,
            calc.device,
            calc.dtype,
            labels,
            load_start,
            comm.size,
        ),
        "schedule": schedule,
        "rebuilds": calc.rebuilds,  # the first call's build included
        "max_force": float(np.abs(sharded.atoms.get_forces()).max(initial=0.0)),
        "layout": _layout(calc),
        "memory": used,
        "results": {kind: _framework_result(ranks, kind, rebuilds[kind]) for kind in KINDS},
    }


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
    per_rank = _per_rank([r[kind] for r in ranks])
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


# ----------------------------------------------------------------------- output

_SUBJECTS = {
    "bare": "bare model (rank 0)",
    "sharded_1": "sharded, 1 rank",
    "sharded": "sharded, {P}",
    "ase": "ASE's own calculator",
}


def _ranks(size: int) -> str:
    return f"{size} rank" if size == 1 else f"{size} ranks"


def _label(name: str, size: int) -> str:
    return _SUBJECTS[name].format(P=_ranks(size))


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.1f}"


def breakdown_rows(
    report: dict, field: str = "breakdown"
) -> list[tuple[str, dict[str, float], float]]:
    """``(label, seconds per phase, step seconds)`` for the breakdown tables and plot.

    ``field`` is ``"breakdown"`` (wall clock) or ``"breakdown_cpu"`` (CPU
    time, MPI calls excluded). One row per subject and kind; the ``P``-rank
    calculator gets rank 0 and, if another, its rank with the most phase time.
    """
    results, size = report["results"], report["ranks"]
    rows = []
    for name in ("bare", "sharded_1", "sharded"):
        if name not in results:
            continue
        for kind in KINDS:
            result = results[name][kind]
            per_rank = result[field]
            totals = np.sum([per_rank[phase] for phase in PHASES], axis=0)
            ranks = [0]
            slowest = int(np.argmax(totals))
            if slowest != 0:
                ranks.append(slowest)
            for rank in ranks:
                suffix = f", rank {rank}" if name == "sharded" and size > 1 else ""
                rows.append(
                    (
                        f"{_label(name, size)}{suffix}, {kind}",
                        {phase: per_rank[phase][rank] for phase in PHASES},
                        result["step_s"],
                    )
                )
    return rows


def _header_lines(report: dict, title: str) -> list[str]:
    """The first lines of a summary: system, model, ranks, threads, device, load."""
    labels, model = report["labels"], report["model"]
    load = report["environment"]["load_average"]
    return [
        f"{title}: {labels.get('system', report['system']['formula'])}, "
        f"{report['system']['n_atoms']} atoms, {labels.get('model', model['class'])} "
        f"({model['class']}, cutoff {model['cutoff']:g} Å, {report['dtype']}), "
        f"{_ranks(report['ranks'])} x {max(report['threads_per_rank'])} thread(s), "
        f"{report['device']}, skin {report['settings']['skin']:g} Å",
        f"  {_cpu_text(report['environment'])}; 1-minute load average at start and end: "
        + ", ".join("-" if x is None else f"{x:.1f}" for x in load),
    ]


def _cpu_text(environment: dict) -> str:
    """The machine's CPUs and those each rank may run on (its affinity)."""
    text = f"{environment['cpus']} CPUs"
    per_rank = environment.get("cpus_per_rank")  # absent from reports before it was added
    if per_rank:
        low, high = min(per_rank), max(per_rank)
        text += f", {low if low == high else f'{low}-{high}'} usable per rank (affinity)"
    return text


def _source_note(report: dict) -> list[str]:
    """A line naming the modified files the report was measured with, if any."""
    source = report["environment"]["source"]
    if source is None or not source["modified"]:
        return []
    return [
        f"  note: measured on commit {source['commit'][:10]} with modified files: "
        + ", ".join(source["modified"])
    ]


def _layout_line(layout: list[list[int]], size: int) -> str:
    """Owned atoms, nodes, rows and padding (``nodes / owned``) over the ranks."""
    layout = np.array(layout)
    padded = layout[:, 2] / np.maximum(layout[:, 1], 1)
    return (
        f"  layout on {_ranks(size)}: owned {layout[:, 1].min()}-{layout[:, 1].max()}, "
        f"nodes {layout[:, 2].min()}-{layout[:, 2].max()}, rows {layout[:, 0].min()}-"
        f"{layout[:, 0].max()}, nodes/owned {padded.min():.2f}-{padded.max():.2f}"
    )


def format_summary(report: dict) -> str:
    """A plain-text summary of a report: step times, ratios, agreement, breakdown."""
    results, size, ratios = report["results"], report["ranks"], report["ratios"]
    lines = _header_lines(report, "ase-shard bench") + [
        "",
        f"  {'ms per step':<28}{'reuse':>10}{'rebuild':>10}{'first':>10}"
        f"{'first-call MiB':>16}{'peak RSS MiB':>14}",
    ]
    for name in ("bare", "sharded_1", "sharded", "ase"):
        if name not in results:
            continue
        result = results[name]
        memory = {
            field: max((m[field] for m in result["memory"] if m[field] is not None), default=None)
            for field in ("peak_rss_delta_mb", "peak_rss_mb")
        }
        lines.append(
            f"  {_label(name, size):<28}{_ms(result['reuse']['step_s']):>10}"
            f"{_ms(result.get('rebuild', {}).get('step_s')):>10}"
            f"{_ms(result['first_call_s']):>10}{_mib(memory['peak_rss_delta_mb']):>16}"
            f"{_mib(memory['peak_rss_mb']):>14}"
        )
    lines += ["", f"  {'ratios (median of per-step ratios)':<36}{'reuse':>10}{'rebuild':>10}"]
    rows = [
        ("sharded_1_over_bare", "1-rank sharded / bare"),
        ("speedup", f"speed-up, 1 -> {_ranks(size)}"),
        ("efficiency", "parallel efficiency"),
        ("speedup_vs_bare", f"speed-up, bare -> {_ranks(size)}"),
    ]
    for key, text in rows:
        if key in ratios["reuse"]:
            lines.append(
                f"  {text:<36}{ratios['reuse'][key]:>10.3f}{ratios['rebuild'][key]:>10.3f}"
            )
    lines.append(f"  {f'machine ceiling on {_ranks(size)}':<36}{ratios['ceiling']:>10.3f}")
    if "memory_ratio" in ratios:
        text = "first-call memory, max rank / 1 rank"
        lines.append(f"  {text:<36}{ratios['memory_ratio']:>10.3f}")
    if "rss_ratio" in ratios:
        lines.append(f"  {'peak RSS, max rank / 1 rank':<36}{ratios['rss_ratio']:>10.3f}")
    if "ase_over_sharded" in ratios:
        lines.append(f"  {'ASE calculator / sharded':<36}{ratios['ase_over_sharded']:>10.3f}")
    if "ase_over_sharded_1" in ratios:
        text = "ASE calculator / 1-rank sharded"
        lines.append(f"  {text:<36}{ratios['ase_over_sharded_1']:>10.3f}")
    lines += ["", "  agreement with the bare model (max relative difference)"]
    tolerance = AGREEMENT_TOLERANCE[report["dtype"]]
    for name, a in report["agreement"].items():
        flag = "  <- DIFFERS" if max(a.values()) > tolerance else ""
        lines.append(
            f"    {_label(name, size):<26} energy {a['energy']:.1e}, "
            f"forces {a['forces']:.1e}{flag}"
        )
    if any(max(a.values()) > tolerance for a in report["agreement"].values()):
        lines.append(
            f"  WARNING: results differ from the bare model by more than {tolerance:g}; "
            "these timings are of wrong results"
        )
    lines += _source_note(report)
    lines += ["", _layout_line(results["sharded"]["layout"], size)]
    for field, title in (
        ("breakdown", "breakdown, wall ms per step"),
        ("breakdown_cpu", "breakdown, CPU ms per step (CPU, MPI excluded)"),
    ):
        lines += ["", f"  {title}: " + " ".join(PHASES)]
        for label, phases, step in breakdown_rows(report, field):
            values = " ".join(_ms(phases[phase]) for phase in PHASES)
            lines.append(f"    {label}: {values} (step {_ms(step)})")
    return "\n".join(lines)


def format_framework_summary(report: dict) -> str:
    """A plain-text summary of a :func:`run_framework` report: step times, their
    ratio, the CPU per phase and rank (MPI excluded), memory and layout."""
    results, size, settings = report["results"], report["ranks"], report["settings"]
    schedule = " ".join("R" if kind == "rebuild" else "u" for kind in report["schedule"])
    lines = _header_lines(report, "ase-shard bench --framework") + [
        f"  ASE VelocityVerlet, {settings['timestep']:g} fs, Maxwell-Boltzmann momenta at "
        f"{settings['temperature']:g} K (seed {settings['seed']})",
        f"  timed steps after a warm-up step: {schedule} (R: rebuild requested, u: reuse)",
        "",
        f"  {'ms per step, median over steps':<56}{'reuse':>10}{'rebuild':>10}",
    ]
    ratio = "{:.3f}".format
    rows = [
        ("baseline_s", "ASE step, ZeroCalculator: rank 0", _ms),
        ("baseline_max_s", "ASE step, ZeroCalculator: slowest rank", _ms),
        ("framework_s", "inside ShardedCalculator.calculate: slowest rank", _ms),
        ("sharded_step_s", "ASE step, ShardedCalculator: slowest rank", _ms),
        ("framework_over_baseline", "calculate / ZeroCalculator step, slowest ranks", ratio),
        ("framework_over_baseline_rank0", "calculate / ZeroCalculator step on rank 0", ratio),
        ("rebuilds", "rebuilds in these steps", str),
    ]
    for key, text, show in rows:
        values = "".join(f"{show(results[kind][key]):>10}" for kind in KINDS)
        lines.append(f"  {text:<56}{values}")
    lines += [
        "  (ratios: median of per-step ratios)",
        "",
        "  ms per step and rank, mean over steps: CPU per phase (CPU, MPI excluded) and",
        "    framework: their sum over " + " + ".join(FRAMEWORK_PHASES) + ";",
        "    in calc: wall-clock time inside calculate, MPI waits included; outside: the part",
        "    of it outside the phases (ASE's Calculator.calculate, the start barrier, ...)",
    ]
    header = "".join(f"{phase:>10}" for phase in PHASES)
    header += f"{'framework':>11}{'in calc':>10}{'outside':>10}"
    for kind in KINDS:
        result = results[kind]
        lines.append(f"    {kind:<9}{header}")
        for rank in range(size):
            cpu = "".join(f"{1e3 * result['breakdown_cpu'][p][rank]:>10.2f}" for p in PHASES)
            inside = result["calculate_s"][rank]
            outside = inside - sum(result["breakdown"][p][rank] for p in PHASES)
            lines.append(
                f"    rank {rank:<4}{cpu}{1e3 * result['framework_cpu_s'][rank]:>11.2f}"
                f"{1e3 * inside:>10.2f}{1e3 * outside:>10.2f}"
            )
    balance = []
    for kind in KINDS:
        value = results[kind]["framework_cpu_max_over_min"]
        flag = " EXCEEDS" if value is not None and value > FRAMEWORK_BALANCE else ""
        balance.append(f"{kind} {'-' if value is None else f'{value:.3f}'}{flag}")
    memory = report["memory"]
    lines += [
        f"  framework CPU, max / min over ranks (bound {FRAMEWORK_BALANCE:g}): "
        + ", ".join(balance),
        "  peak RSS MiB per rank: "
        + ", ".join(_mib(m["peak_rss_mb"]) for m in memory)
        + " (resident before the first calls: "
        + ", ".join(_mib(m["start_rss_mb"]) for m in memory)
        + ")",
        _layout_line(report["layout"], size),
        f"  largest |force| at the last step: {report['max_force']:.3g} eV/Å",
    ]
    automatic = results["reuse"]["rebuilds"]
    if automatic:
        lines.append(
            f"  WARNING: {automatic} reuse step(s) rebuilt on their own (atoms moved more than "
            "skin / 2 since the last build): use fewer reuse steps per rebuild step or a "
            "larger skin"
        )
    lines += _source_note(report)
    return "\n".join(lines)


def _subject_ticks(axes, x: np.ndarray, labels: list[str]) -> None:
    """Subject names under the bars, wrapped and slanted: side by side they overlap."""
    wrapped = [label.replace(" (", "\n(").replace(", ", "\n") for label in labels]
    axes.set_xticks(x, wrapped, fontsize=8, rotation=30, ha="right", rotation_mode="anchor")


def _legend_above_bars(axes) -> None:
    """A legend in headroom above the tallest bar, so that it hides none."""
    axes.set_ylim(top=axes.get_ylim()[1] * 1.3)
    axes.legend(fontsize=8, loc="upper right")


def plot_report(report: dict, path: str) -> None:
    """Write a PNG: step times with speed-ups, peak memory per rank and the breakdown.

    The breakdown panel shows CPU time per phase with MPI calls excluded (what
    each rank computed itself); the grey rest of each bar is the remainder of
    the step's wall time: waits in MPI and work outside the phases.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results, size, ratios = report["results"], report["ranks"], report["ratios"]
    rows = breakdown_rows(report, "breakdown_cpu")
    fig, (left, middle, right) = plt.subplots(
        1, 3, figsize=(17, 1.8 + 0.35 * len(rows)), gridspec_kw={"width_ratios": [1, 1, 1.6]}
    )
    names = [name for name in ("bare", "sharded_1", "sharded", "ase") if name in results]
    x = np.arange(len(names))
    for offset, kind in ((-0.2, "reuse"), (0.2, "rebuild")):
        times = [results[n].get(kind, {}).get("step_s") or 0.0 for n in names]
        left.bar(x + offset, [1e3 * t for t in times], width=0.4, label=f"{kind} step")
    _subject_ticks(left, x, [_label(n, size) for n in names])
    left.set_ylabel("ms per step (median)")
    title = f"{_ranks(size)}: ceiling {ratios['ceiling']:.2f}x"
    if "speedup" in ratios["reuse"]:
        title += f", speed-up {ratios['reuse']['speedup']:.2f}x (reuse)"
    left.set_title(title, fontsize=10)
    _legend_above_bars(left)

    for offset, (field, label) in (
        (-0.2, ("peak_rss_mb", "peak RSS")),
        (0.2, ("peak_rss_delta_mb", "first call")),
    ):
        peaks = [max((m[field] or 0.0) for m in results[n]["memory"]) for n in names]
        middle.bar(x + offset, peaks, width=0.4, label=label)
    _subject_ticks(middle, x, [_label(n, size) for n in names])
    middle.set_ylabel("MiB, largest rank")
    if "rss_ratio" in ratios:
        middle.set_title(
            f"memory per rank / 1 rank: RSS {ratios['rss_ratio']:.2f}, "
            f"first call {ratios['memory_ratio']:.2f}",
            fontsize=10,
        )
    _legend_above_bars(middle)

    y = np.arange(len(rows))[::-1]
    start = np.zeros(len(rows))
    colors = plt.get_cmap("tab10").colors
    for k, phase in enumerate(PHASES):
        widths = np.array([1e3 * phases[phase] for _, phases, _ in rows])
        right.barh(y, widths, left=start, color=colors[k % 10], label=phase)
        start += widths
    other = np.maximum(np.array([1e3 * step for _, _, step in rows]) - start, 0.0)
    right.barh(y, other, left=start, color="lightgrey", label="rest of the step (wall)")
    right.set_yticks(y, [label for label, _, _ in rows], fontsize=8)
    right.set_xlabel("ms per step")
    right.set_title("CPU per phase, MPI excluded (mean per step)", fontsize=10)
    right.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.22))
    fig.suptitle(
        f"{report['labels'].get('system', report['system']['formula'])}: "
        f"{report['system']['n_atoms']} atoms, {report['labels'].get('model', '')} "
        f"({report['model']['class']}, {report['dtype']})",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
