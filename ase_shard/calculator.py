"""ShardedCalculator: an ASE calculator that spreads one system over MPI ranks.

``calculate`` follows the data path of the design, with no serial rank:

1. agree: each rank validates and tests for a rebuild over the atoms it owns
   and checks its share of the same-Atoms agreement; one small allgather
   combines the verdicts;
2. rebuild (rarely): every rank computes the owners of all atoms by the same
   rule and its own ghosts only; an all-to-all of ghost requests tells each
   owner what to send (LAMMPS's ``borders``);
3. each rank takes its node positions from its own ``Atoms`` and evaluates its
   block;
4. ghost rows go back to their owners (reverse exchange), and one allgather of
   the owned results leaves every rank with the same results.

In worker mode (rank 0 alone holds the ``Atoms``), rank 0 plans at rebuilds,
sends each rank only its node rows and receives only owned results.
"""

from __future__ import annotations

import copy
import logging
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from numbers import Real
from typing import Any

import numpy as np
import torch
from ase import Atoms
from ase.calculators.calculator import Calculator, all_changes, compare_atoms

from ase_shard.block import LocalBlock
from ase_shard.comm import CALCULATE, CLOSE, Comm, describe, node_local_rank, rebuild
from ase_shard.distributed import GLOBAL_ID, DistributedAtoms, migrate
from ase_shard.exchange import HaloExchange, PeerFailure
from ase_shard.graph import (
    ShardModel,
    check_model,
    model_digest,
    model_dtype,
    receptive_field,
    supports_layer_halo,
)
from ase_shard.halo import RankRows, fold_rows, images_near_domains, local_rows, rank_rows
from ase_shard.inputs import ModelInputs, pack, take_rows, unpack
from ase_shard.neighbors import NEIGHBOR_LISTS
from ase_shard.padding import Capacities
from ase_shard.partition import (
    CUT_BINS,
    PARTITIONS,
    FrameCoordinates,
    balanced_bin_cuts,
    bins_of,
    choose_grid,
    contiguous_owners,
    frame_coordinates,
    grid_for_extent,
    spatial_owners,
)
from ase_shard.summation import compensated_row_sums, exact_total
from ase_shard.system import (
    checksum,
    differing_fields,
    fingerprint,
    slice_bounds,
    validate,
    validate_cell,
    validate_numbers,
    validate_positions,
)
from ase_shard.timing import PhaseTimer

logger = logging.getLogger(__name__)

HALOS = ("layer", "full")


def place_rank(device: Any, comm: Comm) -> torch.device:
    """This rank's device, and its share of the node's cores.

    ``device`` if given, else ``cuda:<node-local rank % GPUs>`` when CUDA is
    available, else CPU. Without ``OMP_NUM_THREADS``, torch would start one
    thread per core in every rank; ranks sharing a node split the cores instead.
    """
    node_rank, node_size = comm.node_placement()
    if node_size > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // node_size))
    if device is not None:
        placed = checked_device(device)
    elif torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        # the launcher's node-local rank counts every process of the job on this
        # node, so calculators on sub-communicators do not pile onto the same GPUs
        launcher_rank, launcher_size = node_local_rank()
        if launcher_rank is not None:
            node_rank, node_size = launcher_rank, launcher_size
        if node_size > gpus:
            logger.warning(
                "%d ranks on this node share %d GPU(s); give each rank its own GPU, "
                "or use MPS, for full speed",
                node_size,
                gpus,
            )
        placed = torch.device(f"cuda:{node_rank % gpus}")
    else:
        placed = torch.device("cpu")
    if placed.type == "cuda":
        # kernels, allocations and synchronisations without a device index go here,
        # not to GPU 0
        torch.cuda.set_device(placed)
    return placed


def placed(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` on ``device`` in ``dtype``: a copy if that moves or casts it.

    A model that cannot be copied (TorchScript functions inside) is moved in
    place, with a warning.

    ``Module.to`` works in place, which would change the caller's model (and
    make a CPU reference evaluated after it run on the GPU).
    """
    def in_place(tensor: torch.Tensor) -> bool:
        cast = tensor.is_floating_point() and tensor.dtype != dtype
        return tensor.device == device and not cast

    if all(map(in_place, [*model.parameters(), *model.buffers()])):
        return model
    try:
        model = copy.deepcopy(model)
    except Exception as exc:  # TorchScript functions inside (SevenNet) cannot be copied
        warnings.warn(
            f"{type(model).__name__} cannot be copied ({exc}), so it is moved to {device} "
            f"and cast to {dtype} in place: the caller's model changes too",
            RuntimeWarning,
            stacklevel=3,
        )
    return model.to(device=device, dtype=dtype)


def checked_device(device: Any) -> torch.device:
    """``torch.device(device)``, or ``ValueError`` naming the devices this process has."""
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    available = ["cpu", *(f"cuda:{k}" for k in range(cuda))]
    if torch.backends.mps.is_available():
        available.append("mps")
    try:
        placed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"device {device!r} is not a torch device; available here: {', '.join(available)}"
        ) from None
    index = 0 if placed.index is None else placed.index
    usable = {
        "cpu": True,
        "cuda": index < cuda,
        "mps": "mps" in available,
    }.get(placed.type, True)  # other backends (xpu, ...) report their own errors
    if not usable:
        raise ValueError(
            f"device {device!r} is not available here; available: {', '.join(available)}"
        )
    return placed


# the precisions a model can run in, by the names the command line uses
DTYPES = {"float32": torch.float32, "float64": torch.float64}


def checked_dtype(dtype: Any, model: torch.nn.Module) -> torch.dtype:
    """The precision to evaluate ``model`` in: ``dtype``, else the model's own.

    ``dtype`` is ``"float32"``, ``"float64"``, ``torch.float32``,
    ``torch.float64`` or ``None``; anything else raises ``ValueError`` naming
    it. Half precision is refused, also when it is the model's own.
    """
    resolved = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if dtype is None:
        resolved = model_dtype(model)
    if isinstance(resolved, torch.dtype) and resolved in DTYPES.values():
        return resolved
    if isinstance(resolved, torch.dtype) and resolved.is_floating_point:
        whose = "the model's dtype" if dtype is None else "dtype"
        raise ValueError(
            f"{whose} is {resolved}: in half precision (float16/bfloat16) edge vectors keep "
            "3 significant digits and forces are not usable for MD; pass dtype=torch.float32 "
            "(or 'float32') to run such a model"
        )
    raise ValueError(
        "dtype must be 'float32' or 'float64' (or torch.float32, torch.float64, None for the "
        f"model's own), not {dtype!r}"
    )


def _length(name: str, value: Any) -> float:
    """``value`` as a finite distance >= 0 (Å), or ``ValueError`` naming ``name``."""
    try:
        length = float(value)
    except (TypeError, ValueError):
        length = np.nan
    if not (np.isfinite(length) and length >= 0):
        raise ValueError(f"{name} must be a finite distance >= 0 Å, not {value!r}")
    return length


def _rank_grid(grid: Any, size: int) -> tuple[int, int, int]:
    """``grid`` as three positive integers multiplying to ``size``, or ``ValueError``."""
    try:
        cells = tuple(int(p) for p in grid)
        integral = all(p == cell for p, cell in zip(grid, cells, strict=True))
    except (TypeError, ValueError):
        cells, integral = (), False
    if not integral or len(cells) != 3 or min(cells) < 1 or np.prod(cells) != size:
        raise ValueError(
            f"grid must be three positive integers that multiply to {size} ranks, not {grid!r}"
        )
    return cells


# per-atom results and their columns in the block's rows
_PER_ATOM = (("energies", [0]), ("forces", [1, 2, 3]), ("stresses", [4, 5, 6, 7, 8, 9]))
# what every calculation returns, asked for or not, as ASE's EMT, LennardJones and
# MorsePotential do (ASE's tools read calc.results after an energy call); the per-atom
# stresses travel only when asked for
_ALWAYS = ("energies", "forces")
# the block's rows summed into the totals: energy, virial (Voigt)
_TOTALS = [0, 4, 5, 6, 7, 8, 9]


@dataclass
class _Request:
    """What one calculation needs, from the rank(s) holding the ``Atoms``.

    In worker mode rank 0 broadcasts it; under SPMD every rank makes its own.
    """

    n_atoms: int
    cell: np.ndarray
    pbc: np.ndarray
    changed: bool  # numbers or pbc changed since the last calculation (ASE's check)
    properties: tuple[str, ...]
    has_stress: bool
    input_shapes: dict[str, list[int]] = field(default_factory=dict)
    system: dict[str, list] = field(default_factory=dict)
    error: tuple | None = None  # why the inputs could not be read


@dataclass
class _Decomposition:
    """This rank's share of the decomposition, kept between rebuilds.

    Attributes
    ----------
    n_atoms : int
    cell : (3, 3) array
        The cell at the build (Å).
    rows : RankRows
        This rank's rows and exchange plan.
    numbers : (n_nodes,) int array
    owned_positions : (n_owned, 3) array
        Owned atoms at the build (Å), for the rebuild test.
    counts : (P, 4) int array
        Rows, owned atoms, nodes and sent rows of every rank.
    exchange : HaloExchange
    owners, gathered_row : (N,) int arrays
        Owner of every atom, and each atom's row in results gathered in rank
        order (``None`` when that is the atoms' own order). Every rank under
        SPMD; rank 0 in worker mode.
    layouts : list of RankRows
        Worker mode, rank 0: every rank's rows.
    root_nodes : (sum of nodes,) int array
        Worker mode, rank 0: every rank's node atoms, rank by rank.
    node_counts : (P,) int array
        Worker mode: nodes per rank.
    """

    n_atoms: int
    cell: np.ndarray
    rows: RankRows
    numbers: np.ndarray
    owned_positions: np.ndarray | None = None
    counts: np.ndarray | None = None
    exchange: HaloExchange | None = None
    owners: np.ndarray | None = None
    gathered_row: np.ndarray | None = None
    layouts: list[RankRows] | None = None
    root_nodes: np.ndarray | None = None
    node_counts: np.ndarray | None = None

    @cached_property
    def node_ids(self) -> np.ndarray | slice:
        """Atoms of this rank's nodes; a slice when they are consecutive (one rank)."""
        ids = self.rows.ids[: self.rows.n_nodes]
        if len(ids) and ids[-1] - ids[0] == len(ids) - 1 and (np.diff(ids) == 1).all():
            return slice(int(ids[0]), int(ids[-1]) + 1)
        return ids


def _gathered_rows(owners: np.ndarray) -> np.ndarray | None:
    """Each atom's row in results gathered by owner rank (ascending ids within a rank).

    ``None`` when that is the atoms' own order (one rank, contiguous blocks).
    """
    if (np.diff(owners) >= 0).all():
        return None
    rows = np.empty(len(owners), dtype=np.int64)
    rows[np.argsort(owners, kind="stable")] = np.arange(len(owners))
    return rows


def _failed_frames() -> int:
    """Frames torch.compile has given up on in this process (they ran eagerly)."""
    frames = torch._dynamo.utils.counters["frames"]
    return frames["total"] - frames["ok"]


def _strain(deformation: np.ndarray) -> float:
    """Spectral norm of ``F - I`` for a cell deformation ``F``."""
    return float(np.linalg.norm(deformation - np.eye(3), ord=2))


# every change check_state can report
_CHANGES = (*all_changes, "model inputs")

# what every check compares, settled by _differs rather than by ASE's np.allclose: the
# per-atom arrays (see _close), and cell and pbc, for which np.allclose's own overhead
# (about 70 us a call) was most of the checks' 0.6 ms per MD step of 32,000 atoms
_PER_ATOM_STATE = ("positions", "numbers")
_BOX_STATE = ("cell", "pbc")


def _close(a: np.ndarray, b: np.ndarray, tol: float) -> bool:
    """``np.allclose(a, b, rtol=0, atol=tol)``, as ASE's ``compare_atoms`` tests arrays.

    ``np.allclose`` makes several full-size temporaries: on a million atoms it
    cost 40 ms per check, and an MD step checks three times. Here the arrays
    are compared exactly, a cache-sized chunk at a time, so moved positions
    are told at the first chunk; only a difference within ``tol`` (rare)
    falls back to ``np.allclose``.
    """
    if a.shape != b.shape:
        return False
    a, b = a.reshape(-1), b.reshape(-1)
    for start in range(0, a.size, _CHUNK):
        differ = a[start : start + _CHUNK] != b[start : start + _CHUNK]
        if differ.any():
            first = start + int(differ.argmax())
            if not abs(a[first] - b[first]) <= tol:  # NaN is not close, as in allclose
                return False
            return bool(np.allclose(a, b, rtol=0, atol=tol))
    return True


def _differs(old: Atoms, new: Atoms, name: str, tol: float) -> bool:
    """Whether ``name`` (cell, pbc or a per-atom array) changed, as ``compare_atoms`` tells."""
    if name == "pbc":
        return not np.array_equal(old.pbc, new.pbc)
    if name == "cell":
        return not _close(old.cell.array, new.cell.array, tol)
    return not _close(old.arrays[name], new.arrays[name], tol)


# elements compared at a time by _close: 512 kB of float64, within a core's L2 cache
_CHUNK = 1 << 16


# Å: ranks' copies of the positions and cell closer than this to rank 0's are
# re-synchronised from rank 0 (round-off); farther ones are an error
SYNC_TOLERANCE = 1e-10


def _diverged(detail: str) -> ValueError:
    return ValueError(
        "ranks hold different Atoms than rank 0 (" + detail + "). Under mpirun every "
        "rank must build and move the same system: seed random numbers identically "
        "(e.g. Langevin(..., rng=np.random.default_rng(seed)))"
    )


class ShardedCalculator(Calculator):
    """Evaluate a torch potential on one system spread over MPI ranks.

    Parameters
    ----------
    model : torch.nn.Module
        A model following the protocol of :class:`ase_shard.graph.ShardModel`
        (``cutoff`` in Å, ``num_layers``, ``atomic_types``, per-atom energies
        in eV). Anything else raises ``TypeError`` naming what is missing
        (:func:`ase_shard.graph.check_model`), here rather than at the first
        calculation.
    skin : float
        Extra neighbour/halo distance in Å. The decomposition is reused until
        some atom moved more than ``skin / 2`` since it was built (a cell
        deformation counts through the distances it changes).
    device : str or torch.device, optional
        Where this rank evaluates; default ``cuda:<node-local rank % GPUs>``
        when CUDA is available, else CPU.
    dtype : {"float64", "float32"} or torch.dtype, optional
        Precision of the model (it is cast): ``torch.float64`` or
        ``torch.float32``, or their names; default: the model's own. Half
        precision is refused.
    comm : mpi4py communicator, optional
        Default ``MPI.COMM_WORLD`` when mpi4py is loaded, else one rank.
    partition : {"spatial", "contiguous"}
        ``spatial``: a count-balanced ``px*py*pz`` grid of boxes in frame
        coordinates. ``contiguous``: blocks of atom indices.
    grid : (int, int, int), optional
        Rank grid for ``spatial``; default: the one with the smallest halo.
    halo : {"layer", "full"}, optional
        ``full``: ghosts cover the whole receptive field (``cutoff *
        num_layers``) and each rank computes their features itself; works for
        any model. ``layer``: ghosts cover one cutoff and the model refreshes
        their features from their owners between layers (models with
        ``supports_layer_halo``). Default: ``layer`` where supported.
    compile : bool or str
        Run the model through ``torch.compile`` (``True``: the default
        backend; a string names the backend). Graphs are padded to capacities
        agreed by all ranks, so shapes change, and the model recompiles, only
        when a capacity grows. Parts dynamo cannot compile run eagerly.
    timeout : float or None
        Seconds a rank waits at the start of a calculation for the other ranks
        (under mpirun, SPMD) before it aborts the MPI job with a message:
        ranks whose ``Atoms`` diverged, so that only some of them calculate,
        end the job instead of hanging it. ``None`` waits forever.
    min_distance : float
        Å. Two atoms closer than this (within the model's cutoff) raise a
        ``ValueError`` on every rank naming them: a stricter check for
        overlapping atoms in a structure, or an MD run that blew up (0.5 Å is
        below every bond, H2: 0.74 Å). Off by default, as in ASE: a close
        contact is the model's to evaluate. Coincident atoms (closer than
        :data:`ase_shard.block.COINCIDENT_DISTANCE`, 1e-4 Å) always raise.
    neighbor_list : {"auto", "numba", "vesin", "torch"}
        The local neighbour search at rebuilds: ``numba`` (a compiled cell
        list, CPU), ``vesin`` (CPU), ``torch`` (a cell list that stays on the
        device), or ``auto``: numba for CPU tensors, torch on an accelerator.

    Results (eV, eV/Å, eV/Å³) equal the serial evaluation to round-off and are
    bitwise identical on every rank. ``stress``/``stresses`` exist only when the
    cell has rank 3.

    The arguments are checked when the calculator is made, on every rank: a
    model that does not follow the protocol raises ``TypeError``, any other
    invalid argument ``ValueError``, the same error on every rank (under
    mpirun, reported once).
    """

    implemented_properties = ["energy", "free_energy", "energies", "forces", "stress", "stresses"]
    nolabel = True

    def __init__(
        self,
        model: ShardModel,
        *,
        skin: float = 0.5,
        device: Any = None,
        dtype: torch.dtype | None = None,
        comm: Any = None,
        partition: str = "spatial",
        grid: Sequence[int] | None = None,
        halo: str | None = None,
        compile: bool | str = False,
        timeout: float | None = 600.0,
        min_distance: float = 0.0,
        neighbor_list: str = "auto",
        **kwargs,
    ):
        Calculator.__init__(self, **kwargs)
        self.comm = Comm(comm)
        # every rank checks its arguments and model, then one allgather tells every
        # rank all ranks' errors: they raise the same error together (reported once
        # under mpirun, see Comm.raised_together), never one rank while the others wait
        error, digest = None, None
        try:
            check_model(model)
            if partition not in PARTITIONS:
                raise ValueError(f"partition must be one of {PARTITIONS}, not {partition!r}")
            skin = _length("skin", skin)
            min_distance = _length("min_distance", min_distance)
            if timeout is not None and not (isinstance(timeout, Real) and timeout > 0):
                raise ValueError(
                    f"timeout must be a positive number of seconds or None, not {timeout!r}"
                )
            if neighbor_list not in NEIGHBOR_LISTS:
                raise ValueError(
                    f"neighbor_list must be one of {NEIGHBOR_LISTS}, not {neighbor_list!r}"
                )
            if halo is None:
                halo = "layer" if supports_layer_halo(model) else "full"
            if halo not in HALOS:
                raise ValueError(f"halo must be one of {HALOS}, not {halo!r}")
            if halo == "layer" and not supports_layer_halo(model) and model.num_layers > 1:
                raise ValueError(
                    f"{type(model).__name__} does not exchange features between its layers "
                    "(supports_layer_halo): use halo='full'"
                )
            if grid is not None:
                grid = _rank_grid(grid, self.comm.size)
            dtype = checked_dtype(dtype, model)
        except (TypeError, ValueError) as exc:
            error = describe(exc, self.comm.rank)
        try:
            self.device = place_rank(device, self.comm)  # collective: every rank comes
        except ValueError as exc:
            self.device = torch.device("cpu")
            error = error or describe(exc, self.comm.rank)
        if error is None:
            try:
                self.dtype = dtype
                self.model = placed(model, self.device, self.dtype)
                digest = model_digest(self.model)
            except Exception as exc:  # e.g. out of memory on this rank's device
                error = describe(exc, self.comm.rank)
        views = self.comm.allgather((error, digest, self.device.type))
        # models that sum their own forces on the host may then split pairs between ranks
        self._on_host_everywhere = all(view[2] == "cpu" for view in views)
        errors = [view[0] for view in views if view[0] is not None]
        differing = [rank for rank, view in enumerate(views) if view[1] != views[0][1]]
        if errors or differing:
            error = rebuild(errors) if errors else ValueError(
                f"the model's parameters on ranks {differing} differ from rank 0's: build "
                "it identically on every rank (same seed or the same checkpoint)"
            )
            self.comm.raised_together(error)
            raise error
        # parameters stay JSON-encodable so Trajectory can write them
        self.parameters.update(
            skin=float(skin),
            partition=partition,
            grid=list(grid) if grid else None,
            halo=halo,
            compile=compile,
            min_distance=float(min_distance),
            neighbor_list=neighbor_list,
            model=type(model).__name__,
        )
        self.rebuilds = 0
        self.timer = PhaseTimer(self.device, self.comm)
        self.timeout = timeout
        self._compiled = None
        self._capacity = Capacities()
        self._exchange_handle: int | None = None
        # frames torch.compile gave up on and ran eagerly, while this calculator ran
        self.compile_fallbacks = 0
        if compile:
            # a frame dynamo cannot compile runs eagerly instead of raising; counted
            # and warned about in _count_compile_fallbacks
            torch._dynamo.config.suppress_errors = True
            backend = compile if isinstance(compile, str) else "inductor"
            self._compiled = torch.compile(self.model, backend=backend, dynamic=False)
            self._failed_frames = _failed_frames()
        # set by ase_shard.worker: rank 0 drives, the other ranks serve
        self._driven = False
        self._idle_root = False
        self._on_close: list = []
        self._block: LocalBlock | None = None
        self._copies: list[Atoms] = []  # this call's Atoms: the caller's and ours
        self._state: _Decomposition | None = None
        self._calls = 0  # calculations so far, the same count on every rank
        # the last calculation's Atoms were DistributedAtoms (each rank holds its own)
        self._distributed = False
        self.inputs = ModelInputs.of(model)
        if hasattr(self.model, "reference_energies"):
            self.implemented_properties = [*self.implemented_properties, "node_energy"]
        self._inputs_digest: bytes | None = None  # of the inputs last calculated

    @property
    def skin(self) -> float:
        return self.parameters["skin"]

    @property
    def halo_reach(self) -> float:
        """Distance (Å) the ghosts must cover beyond the skin."""
        if self.parameters["halo"] == "layer":
            return float(self.model.cutoff)
        return receptive_field(self.model)

    @property
    def layout_counts(self) -> list[tuple[int, int, int]] | None:
        """``(rows, owned, nodes)`` per rank of the current layout (every rank).

        Rows count every atom image; nodes are what the model evaluates
        (owned atoms plus ghost atoms), so ``nodes / owned`` is the padding.
        """
        if self._state is None or self._state.counts is None:
            return None
        return [tuple(int(n) for n in counts[:3]) for counts in self._state.counts]

    def request_rebuild(self) -> None:
        """Rebuild the decomposition at the next calculation (call on every rank)."""
        self._state = None
        self.reset()

    @property
    def decomposition(self) -> dict | None:
        """The current layout, for inspection and plots.

        ``owners`` is the owner rank of every atom; ``ghosts[r]`` holds rank
        ``r``'s ghost rows as ``(ids, image_shift)``: the ghost sits at
        ``positions[ids] + image_shift @ cell``. Under SPMD every rank knows the
        owners and only its own ghosts; in worker mode rank 0 knows all
        ranks' ghosts. ``None`` where the owners are not known.
        """
        state = self._state
        if state is None or state.owners is None:
            return None
        layouts = state.layouts or {self.comm.rank: state.rows}
        if isinstance(layouts, list):
            layouts = dict(enumerate(layouts))
        ghosts = {
            rank: (rows.ids[rows.n_owned :], rows.image_shift[rows.n_owned :])
            for rank, rows in layouts.items()
        }
        return {"owners": state.owners, "ghosts": ghosts}

    def check_state(self, atoms: Atoms, tol: float = 1e-15) -> list[str]:
        """ASE's changes, plus ``"model inputs"`` when a declared input changed.

        ASE compares only positions, numbers, cell, pbc and the initial charges
        and magnetic moments; a model may also read custom arrays, velocities
        or ``atoms.info`` values.
        """
        ignored = set(self.ignored_changes)
        here = (*_BOX_STATE, *_PER_ATOM_STATE)
        changes = compare_atoms(self.atoms, atoms, tol, ignored | set(here))
        if self.atoms is not None:
            old = self.atoms
            changes += [n for n in here if n not in ignored and _differs(old, atoms, n, tol)]
        if self.inputs and self._inputs_digest != self.inputs.digest(atoms, self.parameters):
            changes.append("model inputs")
        if isinstance(atoms, DistributedAtoms) and self.comm.size > 1:
            # each rank sees only its own atoms change: all recalculate, or none
            union = self.comm.union(
                np.isin(_CHANGES, changes),
                self.timeout,
                "check their atoms too (do all ranks call the calculator?)",
            )
            changes = [name for name, changed in zip(_CHANGES, union, strict=True) if changed]
        return changes

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
        # the caller's Atoms too, so a re-synchronisation (see _settle) reaches them
        self._copies = [copy for copy in (atoms,) if copy is not None]
        given = atoms if atoms is not None else self.atoms
        distributed = isinstance(given, DistributedAtoms)
        if distributed:
            # atoms migrate in place: the caller's (a driver's) atoms, not a copy, which
            # is taken once they have moved (what the next call compares)
            atoms, self.atoms = given, None
        else:
            Calculator.calculate(self, atoms, properties, system_changes)
            atoms = self.atoms
        if distributed != self._distributed:
            self._distributed, self._state = distributed, None
        if distributed:
            if self._driven:
                raise ValueError("DistributedAtoms need every rank to run the script (SPMD)")
            if atoms.comm.size != self.comm.size:
                raise ValueError(
                    f"the DistributedAtoms are spread over {atoms.comm.size} rank(s), the "
                    f"calculator over {self.comm.size}: give both the same communicator"
                )
        self._copies.append(atoms)
        if self.inputs and atoms is not None:
            self._inputs_digest = self.inputs.digest(atoms, self.parameters)
        request = self._request(atoms, properties, system_changes)
        if self._driven:
            self.comm.bcast((CALCULATE, request))
        else:
            self.comm.rendezvous(
                self.timeout, "calculate too (do all ranks hold the same Atoms and call it?)"
            )
        try:
            self._calculate(atoms, request)
            if distributed:
                self.atoms = atoms.copy()
        except BaseException as exc:
            # the next call starts from a fresh decomposition on every rank
            self._state = self._block = None
            self._inputs_digest = None
            if isinstance(exc, Exception) and not self._driven:
                self.comm.raised_together(exc)  # errors leave _calculate on every rank
            raise

    def _request(self, atoms: Atoms, properties, system_changes) -> _Request:
        """What this call needs, from the rank(s) holding ``atoms``; never raises."""
        request = _Request(
            n_atoms=atoms.get_global_number_of_atoms(),
            cell=atoms.cell.array.copy(),
            pbc=atoms.pbc.copy(),
            changed=bool({"numbers", "pbc"} & set(system_changes)),
            properties=tuple(properties),
            has_stress=atoms.cell.rank == 3,
        )
        if self.inputs:
            try:
                shapes = self.inputs.per_atom_arrays(atoms)
                request.input_shapes = {k: list(v.shape[1:]) for k, v in shapes.items()}
                request.system = self.inputs.system_values(atoms, self.parameters)
            except Exception as exc:
                request.error = describe(exc, self.comm.rank)
        return request

    def _calculate(self, atoms: Atoms | None, request: _Request) -> None:
        """One collective evaluation; ``atoms`` is ``None`` on serving ranks."""
        comm, timer = self.comm, self.timer
        self._calls += 1
        reason, deformation = self._forced_rebuild(request)
        if reason is None and self._distributed and len(atoms) != self._state.rows.n_owned:
            reason = "local atoms changed"
        nodes = None
        if reason is None and request.error is None:
            with timer.phase("scatter"):
                # distributed: the owned rows only; ghosts come once all agreed on reuse
                nodes = self._fetch_nodes(atoms, request, ghosts=not self._distributed)
        with timer.phase("validate"):
            reason = self._agree(atoms, request, reason, nodes, deformation)
        if reason is not None:
            nodes = self._rebuild(atoms, request, reason)
        elif self._distributed:
            with timer.phase("scatter"):
                nodes = self._with_ghost_rows(nodes)
        state, block = self._state, self._block

        error, rows = None, None
        try:
            inputs = unpack(nodes[:, 3:], request.input_shapes)
            rows = block.evaluate(nodes[:, :3], request.cell, self.dtype, inputs, request.system)
            if self._compiled is not None:
                self._count_compile_fallbacks()
            # the closing status vote (see ase_shard.exchange)
            if comm.any(False):
                raise PeerFailure("another rank failed")
        except PeerFailure as exc:
            error = describe(exc, comm.rank)
        except Exception as exc:
            error = describe(exc, comm.rank)
            comm.any(True)

        with timer.phase("gather"):
            # after the vote every rank knows whether some rank failed
            if error is not None:
                failed = [e for e in comm.allgather(error) if e is not None]
                # report the ranks that failed, not those that stopped for them
                raise rebuild([e for e in failed if e[1] != PeerFailure.__qualname__] or failed)
            self._gather(atoms, request, state, rows)

    # -- 1. agree on the system and on a rebuild -------------------------------------------

    def _forced_rebuild(self, request: _Request) -> tuple[str | None, np.ndarray | None]:
        """A rebuild reason every rank sees alike, and the cell deformation since the build.

        The deformation ``F`` (``cell = cell_at_build @ F``) is ``None`` when
        the cell did not change or a rebuild is due anyway.
        """
        state = self._state
        if state is None:
            return "first call", None
        if request.n_atoms != state.n_atoms or request.changed:
            return "atoms or pbc changed", None
        if (request.cell == state.cell).all():
            return None, None
        if np.count_nonzero(state.cell.any(axis=1)) < 3:
            return "cell changed", None
        try:
            deformation = np.linalg.solve(state.cell, request.cell)
        except np.linalg.LinAlgError:
            return "cell changed", None
        if _strain(deformation) >= 0.5:
            return "cell changed", None
        return None, deformation

    def _agree(
        self,
        atoms: Atoms | None,
        request: _Request,
        reason: str | None,
        nodes: np.ndarray | None,
        deformation: np.ndarray | None,
    ) -> str | None:
        """Validate, vote on a rebuild and check the ranks' copies: one allgather.

        Each rank validates its own share only (the owned rows it evaluates,
        or, before a rebuild, one slice of the atoms), and under SPMD sends the
        fingerprint of its whole copy (:func:`ase_shard.system.fingerprint`):
        a copy that differs from rank 0's anywhere is found at this call,
        before any rank evaluates it, whatever the distance (checking a part of
        the copy per call let a diverged copy through until a later call, and
        its results out). Every rank then raises the same error, or returns
        the same rebuild reason (``None``: reuse).
        """
        comm = self.comm
        distributed = self._distributed
        spmd = comm.size > 1 and not self._driven and not distributed
        # in worker mode the request, and its error, came from rank 0
        error = request.error if comm.is_root or not self._driven else None
        own_reason, share = reason, None
        try:
            if reason is not None or deformation is not None:
                validate_cell(request.cell, request.pbc)  # else the build's cell, checked then
            if nodes is not None:
                self._validate_rows(nodes, request)
                own_reason = self._displacement_reason(nodes, deformation)
            elif distributed:
                validate_positions(atoms.positions, atoms.arrays[GLOBAL_ID])
                validate_numbers(atoms.numbers, getattr(self.model, "atomic_types", None))
            elif not self._driven:
                # before a rebuild, each rank checks one slice of every atom
                span = slice_bounds(len(atoms), comm.size, comm.rank)
                ids = np.arange(span.start, span.stop)
                validate_positions(atoms.positions[span], ids)
        except Exception as exc:
            error = error or describe(exc, comm.rank)
        if distributed:
            share = (request.n_atoms, checksum(request.cell), tuple(request.pbc.tolist()))
        elif spmd:
            share = (fingerprint(atoms), self._inputs_digest)
        views = comm.allgather((error, own_reason, share))
        errors = [view[0] for view in views if view[0] is not None]
        if errors:
            raise rebuild(errors)
        reason = next((view[1] for view in views if view[1] is not None), None)
        if distributed:
            if any(view[2] != views[0][2] for view in views):
                raise ValueError(
                    "the ranks' DistributedAtoms differ in their number of atoms, cell or pbc "
                    f"(rank by rank: {[view[2] for view in views]}); change them on every rank"
                )
            return reason
        if spmd and self._compare_copies([view[2] for view in views], request):
            # the rows fetched and the reuse vote were of the unsynchronised copies
            reason = reason or "positions re-synchronised from rank 0"
        if reason is not None and not self._driven:
            # the copies agree: every rank finds the same elements, and the same error
            try:
                validate_numbers(atoms.numbers, getattr(self.model, "atomic_types", None))
            except ValueError as exc:
                raise rebuild([describe(exc, 0)]) from None
        return reason

    def _displacement_reason(
        self, nodes: np.ndarray, deformation: np.ndarray | None
    ) -> str | None:
        """Why pair distances may have changed by more than the skin (owned atoms only).

        Reuse is safe while every pair now within the halo reach ``W`` was
        within ``W + skin`` at the build. With the cell deformed by ``F`` (a
        barostat) and each atom displaced by ``u_i`` beyond that affine map, a
        pair vector changes by at most ``|F - I| |d0| + 2 max |u|``, which
        gives the test ``(W |F - I| + 2 max |u|) / (1 - |F - I|) <= skin``.
        Without a cell change this is the usual ``max |u| <= skin / 2``. The
        ranks combine their own atoms' verdicts.
        """
        state = self._state
        moved = nodes[: state.rows.n_owned, :3] - (
            state.owned_positions if deformation is None else state.owned_positions @ deformation
        )
        strain = 0.0 if deformation is None else _strain(deformation)
        displacement = np.sqrt(np.einsum("ij,ij->i", moved, moved).max(initial=0.0))
        growth = (self.halo_reach * strain + 2.0 * displacement) / (1.0 - strain)
        if growth > self.skin:
            return f"pair distances may have changed by {growth:.3f} Å > skin"
        return None

    def _validate_rows(self, nodes: np.ndarray, request: _Request) -> None:
        """Finite positions and inputs of this rank's owned atoms."""
        rows = self._state.rows
        validate_positions(nodes[: rows.n_owned, :3], rows.ids[: rows.n_owned])
        finite = np.isfinite(nodes[: rows.n_owned, 3:]).all(axis=0)
        if not finite.all():
            shapes = request.input_shapes
            widths = [int(np.prod(shape, dtype=np.int64)) for shape in shapes.values()]
            names = np.repeat(np.array(list(shapes), dtype=object), widths)
            raise ValueError(f"per-atom model inputs {sorted(set(names[~finite]))} are not finite")

    def _compare_copies(self, shares: list, request: _Request) -> bool:
        """Every rank's fingerprint and model inputs against rank 0's.

        Returns whether the copies differed and were re-synchronised (see
        :meth:`_settle`, which raises for any other difference).
        """
        reference = shares[0]
        differing = {
            rank: differing_fields(reference[0], share[0])
            + (["model inputs"] if share[1] != reference[1] else [])
            for rank, share in enumerate(shares)
            if share != reference
        }
        if differing:
            self._settle(differing, request)
        return bool(differing)

    def _settle(self, differing: dict[int, list[str]], request: _Request) -> None:
        """The ranks' copies differ (``differing``: fields by rank): re-synchronise, or raise.

        Copies that differ only in positions and cell, by at most
        :data:`SYNC_TOLERANCE` Å from rank 0's (round-off, e.g. an optimiser's
        random start on each rank), take rank 0's values, as GPAW does; any
        other difference raises the same ``ValueError`` on every rank, naming
        each differing rank's fields, how many atoms differ and the first of
        them, and by how much positions and cell differ (Å).
        """
        fields = set().union(*differing.values())
        if "number of atoms" in fields:  # nothing to compare atom by atom
            raise _diverged("; ".join(f"rank {r}: {', '.join(f)}" for r, f in differing.items()))
        atoms = self._copies[-1]
        # rare, so pickled: rank 0's whole copy
        numbers, positions, cell = self.comm.bcast(
            (atoms.numbers, atoms.positions, atoms.cell.array) if self.comm.is_root else None
        )
        # bitwise, as the fingerprints compare (NaN differs from NaN)
        rows = np.flatnonzero(
            (atoms.numbers != numbers) | (atoms.positions != positions).any(axis=1)
        )
        # NaN-propagating maxima: a non-finite copy is never close
        moved = np.abs(atoms.positions - positions).max(initial=0.0)
        deviation = np.max([moved, np.abs(atoms.cell.array - cell).max()])
        views = self.comm.allgather((len(rows), int(rows[0]) if len(rows) else None, deviation))
        worst = float(np.max([view[2] for view in views]))
        if fields <= {"positions", "cell"} and worst <= SYNC_TOLERANCE:
            for copy in self._copies:
                copy.positions[:] = positions
                copy.cell.array[:] = cell
            request.cell = cell.copy()
            return
        details = []
        for rank, names in differing.items():
            count, first, _ = views[rank]
            # "numbers, positions of 2 atom(s) from atom 7, cell"
            last = max((i for i, n in enumerate(names) if n in _PER_ATOM_STATE), default=None)
            if last is not None and count:
                names = [*names]
                names[last] += f" of {count} atom(s) from atom {first}"
            details.append(f"rank {rank}: {', '.join(names)}")
        if fields & {"positions", "cell"}:
            details.append(f"by up to {worst:.3g} Å")
        raise _diverged("; ".join(details))

    # -- 2. rebuild --------------------------------------------------------------------------

    def _rebuild(self, atoms: Atoms | None, request: _Request, reason: str) -> np.ndarray:
        """Partition, find ghosts, exchange the plan and build the block; the node rows."""
        comm = self.comm
        self.rebuilds += 1
        self._state = self._block = None
        if self._driven:
            state = self._plan_from_root(atoms, request)
        elif self._distributed:
            state = self._plan_distributed(atoms, request)
        else:
            state = self._plan_locally(atoms, request)
        rows = state.rows
        state.exchange = HaloExchange(
            comm,
            rows.n_owned,
            rows.send_index,
            rows.send_counts,
            rows.recv_counts,
            self.device,
            self._exchange_handle,
        )
        self._exchange_handle = state.exchange.handle  # kept: compiled models specialise on it
        self._state = state
        with self.timer.phase("scatter"):
            nodes = self._fetch_nodes(atoms, request)
        state.owned_positions = nodes[: rows.n_owned, :3].copy()
        error, needed = None, None
        try:
            self._validate_rows(nodes, request)
            self._block = LocalBlock(
                rows,
                state.numbers,
                nodes[:, :3],
                request.cell,
                self.model,
                self.skin,
                self.device,
                state.exchange if self.parameters["halo"] == "layer" else None,
                self.timer,
                self._compiled,
                self.parameters["min_distance"],
                self.parameters["neighbor_list"],
                state.exchange if comm.size > 1 and self._on_host_everywhere else None,
            )
            needed = self._block.needed()
        except Exception as exc:
            error = describe(exc, comm.rank)
        counts = (len(rows.ids), rows.n_owned, rows.n_nodes, len(rows.send_index))
        views = comm.allgather((error, counts, needed))
        errors = [view[0] for view in views if view[0] is not None]
        if errors:
            raise rebuild(errors)
        state.counts = np.array([view[1] for view in views], dtype=np.int64)
        if self._compiled is not None:
            # every rank pads to the same sizes, so they (re)compile together
            self._capacity = self._capacity.grown(Capacities.largest([v[2] for v in views]))
            self._block.pad(self._capacity)
        if comm.is_root:
            owned, evaluated = state.counts[:, 1], state.counts[:, 2]
            logger.info(
                "rebuild %d (%s): owned atoms per rank %d-%d, evaluated atoms per rank %d-%d",
                self.rebuilds,
                reason,
                owned.min(),
                owned.max(),
                evaluated.min(),
                evaluated.max(),
            )
        return nodes

    @property
    def _halo_shape(self) -> tuple[float, bool]:
        """Halo width (Å: reach plus skin) and whether foreign images fold onto one ghost.

        They fold with the layer halo and for one-layer models: a ghost is then
        only ever an edge's neighbour, the same atom whichever image the edge
        reaches (through its shift).
        """
        fold = self.parameters["halo"] == "layer" or int(self.model.num_layers) == 1
        return self.halo_reach + self.skin, fold

    def _partition(self, atoms: Atoms, request: _Request) -> tuple[FrameCoordinates, np.ndarray]:
        """Frame coordinates and owner rank of every atom: the same rule on every rank."""
        with self.timer.phase("partition"):
            coords = frame_coordinates(atoms.positions, request.cell, request.pbc)
            # a driving rank 0 that only runs ASE (notebook mode) owns nothing
            first = int(self._idle_root)
            n_compute = self.comm.size - first
            if self.parameters["partition"] == "contiguous":
                return coords, contiguous_owners(len(coords.s), n_compute) + first
            grid = self.parameters["grid"] or choose_grid(
                coords, request.pbc, n_compute, self._halo_shape[0]
            )
            return coords, spatial_owners(coords, tuple(grid)) + first

    def _plan_locally(self, atoms: Atoms, request: _Request) -> _Decomposition:
        """SPMD: owners of all atoms, this rank's own ghosts, the plan by all-to-all."""
        comm, timer = self.comm, self.timer
        error = None
        try:
            coords, owners = self._partition(atoms, request)
            with timer.phase("halo"):
                rows = local_rows(
                    coords, request.pbc, owners, comm.rank, comm.size, *self._halo_shape
                )
        except Exception as exc:  # e.g. out of memory on one rank: no rank may wait alone
            error = describe(exc, comm.rank)
        errors = [e for e in comm.allgather(error) if e is not None]
        if errors:
            raise rebuild(errors)
        with timer.phase("halo"):
            # LAMMPS's borders(): each owner learns which of its atoms the others need
            rows.send_counts = comm.alltoall_counts(rows.recv_counts)
            rows.send_index = comm.alltoallv_rows(
                rows.requests, rows.recv_counts, rows.send_counts
            )
        return _Decomposition(
            n_atoms=request.n_atoms,
            cell=request.cell,
            rows=rows,
            numbers=atoms.numbers[rows.ids[: rows.n_nodes]],
            owners=owners,
            gathered_row=_gathered_rows(owners),
        )

    def _plan_distributed(self, atoms: DistributedAtoms, request: _Request) -> _Decomposition:
        """Distributed atoms: migrate to new owners, then ghosts from the ranks within reach.

        Every rank holds only its own atoms. The domains are cut at common
        histogram bins (one allreduce per cut axis), the atoms move to their
        owners with all their arrays (:func:`ase_shard.distributed.migrate`),
        each rank sends the images of its atoms that lie in another rank's
        widened domain (LAMMPS's ``borders``), and the requests of the folded
        ghost nodes go back to their owners.
        """
        comm, timer = self.comm, self.timer
        with timer.phase("partition"):
            owners = self._distributed_owners(atoms, request)
            migrate(atoms, owners)
            counts = comm.allgather(len(atoms))
            if sum(counts) != request.n_atoms:
                raise ValueError(
                    f"the ranks hold {sum(counts)} atoms between them, not the "
                    f"{request.n_atoms} that were distributed: atoms were added or deleted on "
                    "some rank (not supported on DistributedAtoms)"
                )
        with timer.phase("halo"):
            width, fold = self._halo_shape
            coords = frame_coordinates(atoms.positions, request.cell, request.pbc)
            box = np.full((2, 3), np.inf)
            box[1] = -np.inf
            if len(atoms):
                box = np.stack([coords.s.min(axis=0), coords.s.max(axis=0)])
            boxes = np.array(comm.allgather(box))
            dest, place, image_shift = images_near_domains(
                coords, request.pbc, boxes[:, 0], boxes[:, 1], comm.rank, width
            )
            ids = atoms.arrays[GLOBAL_ID]
            described = np.column_stack([ids[place], image_shift, place, atoms.numbers[place]])
            send_counts = np.bincount(dest, minlength=comm.size).astype(np.int64)
            recv_counts = comm.alltoall_counts(send_counts)
            ghosts = comm.alltoallv_rows(described.astype(np.int64), send_counts, recv_counts)
            n_owned = len(atoms)
            rows = fold_rows(
                comm.rank,
                comm.size,
                np.concatenate([ids, ghosts[:, 0]]),
                np.concatenate([coords.wrap_shift, ghosts[:, 1:4]]),
                n_owned,
                np.concatenate(
                    [np.full(n_owned, comm.rank), np.repeat(np.arange(comm.size), recv_counts)]
                ),
                np.concatenate([np.arange(n_owned), ghosts[:, 4]]),
                fold,
            )
            # LAMMPS's borders(): each owner learns which of its atoms the others need
            rows.send_counts = comm.alltoall_counts(rows.recv_counts)
            rows.send_index = comm.alltoallv_rows(
                rows.requests, rows.recv_counts, rows.send_counts
            )
        # the ghost nodes' elements, by global id, from the rows that brought them
        by_id = np.argsort(ghosts[:, 0], kind="stable")
        ghost_ids = rows.ids[n_owned : rows.n_nodes]
        found = by_id[np.searchsorted(ghosts[by_id, 0], ghost_ids)]
        numbers = np.concatenate([atoms.numbers, ghosts[found, 5]])
        return _Decomposition(
            n_atoms=request.n_atoms, cell=request.cell, rows=rows, numbers=numbers
        )

    def _distributed_owners(self, atoms: DistributedAtoms, request: _Request) -> np.ndarray:
        """New owner of each local atom: the same rule on every rank, from summed histograms.

        ``spatial``: a ``px*py*pz`` grid of count-balanced boxes in frame
        coordinates, cut axis by axis at the histogram bins that balance the
        atoms (:func:`ase_shard.partition.balanced_bin_cuts`). ``contiguous``:
        blocks of global ids.
        """
        comm = self.comm
        if self.parameters["partition"] == "contiguous":
            return contiguous_owners(request.n_atoms, comm.size)[atoms.arrays[GLOBAL_ID]]
        coords = frame_coordinates(atoms.positions, request.cell, request.pbc)
        bounds = np.array([np.inf] * 3 + [-np.inf] * 3)
        if len(atoms):
            bounds = np.concatenate([coords.s.min(axis=0), coords.s.max(axis=0)])
        everywhere = np.array(comm.allgather(bounds))
        lo, hi = everywhere[:, :3].min(axis=0), everywhere[:, 3:].max(axis=0)
        span = np.where(np.isfinite(hi - lo), hi - lo, 0.0)
        grid = self.parameters["grid"] or grid_for_extent(
            np.where(request.pbc, coords.spacing, span), request.pbc, comm.size,
            self._halo_shape[0],
        )
        group = np.zeros(len(atoms), dtype=np.int64)
        n_groups = 1
        for axis, parts in enumerate(grid):
            if parts == 1:
                continue
            bins = bins_of(coords.s[:, axis], lo[axis], hi[axis])
            histograms = np.bincount(group * CUT_BINS + bins, minlength=n_groups * CUT_BINS)
            histograms = comm.allreduce_counts(histograms).reshape(n_groups, CUT_BINS)
            cuts = balanced_bin_cuts(histograms, parts)
            group = group * parts + (bins[:, None] >= cuts[group]).sum(axis=1)
            n_groups *= parts
        return group

    def _plan_from_root(self, atoms: Atoms | None, request: _Request) -> _Decomposition:
        """Worker mode: rank 0 lays out every rank and sends each its rows."""
        comm, timer = self.comm, self.timer
        plan, layouts, owners = None, None, None
        if comm.is_root:
            try:
                validate(atoms, getattr(self.model, "atomic_types", None))
                coords, owners = self._partition(atoms, request)
                with timer.phase("halo"):
                    layouts = rank_rows(coords, request.pbc, owners, comm.size, *self._halo_shape)
                sends = [r.send_counts.tolist() for r in layouts]
                plan = (None, sends, [(len(r.ids), r.n_owned, r.n_nodes) for r in layouts])
            except Exception as exc:
                plan = (describe(exc, 0), None, None)
        with timer.phase("scatter"):
            error, sends, sizes = comm.bcast(plan)
            if error is not None:
                raise rebuild([error])
            sends, sizes = np.array(sends, dtype=np.int64), np.array(sizes, dtype=np.int64)
            meta, send_index = None, None
            if comm.is_root:
                meta = np.concatenate(
                    [
                        np.column_stack([r.ids, r.image_shift, atoms.numbers[r.ids], r.node])
                        for r in layouts
                    ]
                )
                send_index = np.concatenate([r.send_index for r in layouts])
            meta = comm.scatter_rows(meta, sizes[:, 0], (6,), np.int64)
            send_index = comm.scatter_rows(send_index, sends.sum(axis=1), (), np.int64)
        n_nodes = int(sizes[comm.rank, 2])
        rows = RankRows(
            ids=meta[:, 0].copy(),
            image_shift=meta[:, 1:4].copy(),
            n_owned=int(sizes[comm.rank, 1]),
            node=meta[:, 5].copy(),
            n_nodes=n_nodes,
            recv_counts=sends[:, comm.rank].copy(),
            requests=np.zeros(0, dtype=np.int64),
            send_index=send_index,
            send_counts=sends[comm.rank].copy(),
        )
        state = _Decomposition(
            n_atoms=request.n_atoms,
            cell=request.cell,
            rows=rows,
            numbers=meta[:n_nodes, 4].copy(),
            node_counts=sizes[:, 2],
        )
        if comm.is_root:
            state.owners, state.layouts = owners, layouts
            state.gathered_row = _gathered_rows(owners)
            state.root_nodes = np.concatenate([r.ids[: r.n_nodes] for r in layouts])
        return state

    # -- 3. node rows and evaluation ---------------------------------------------------------

    def _fetch_nodes(
        self, atoms: Atoms | None, request: _Request, ghosts: bool = True
    ) -> np.ndarray:
        """This rank's node rows: positions (Å), then the per-atom model inputs.

        SPMD: read from this rank's own ``atoms``. Distributed atoms: the
        owned rows are the local atoms, the ghost rows come from their owners
        (with ``ghosts``). Worker mode: rank 0 sends each rank its rows (one
        ``Scatterv``).
        """
        state = self._state
        if self._distributed:
            owned = self._node_rows(atoms, slice(None))
            return self._with_ghost_rows(owned) if ghosts else owned
        if not self._driven:
            return self._node_rows(atoms, state.node_ids)
        width = 3 + sum(int(np.prod(s, dtype=np.int64)) for s in request.input_shapes.values())
        send = self._node_rows(atoms, state.root_nodes) if self.comm.is_root else None
        return self.comm.scatter_rows(send, state.node_counts, (width,), np.float64)

    def _with_ghost_rows(self, owned: np.ndarray) -> np.ndarray:
        """Distributed atoms: the owned node rows, then the ghost nodes' from their owners.

        One ``Alltoallv`` (LAMMPS's forward communication); the ghosts'
        image shifts are added in the block.
        """
        exchange = self._state.exchange
        sent = take_rows(owned, exchange.send_rows.numpy())
        ghosts = self.comm.alltoallv_rows(sent, exchange.send_counts, exchange.recv_counts)
        return np.concatenate([owned, ghosts])

    def _node_rows(self, atoms: Atoms, ids: np.ndarray | slice) -> np.ndarray:
        """Positions and packed per-atom inputs of the atoms ``ids``."""
        positions = take_rows(atoms.positions, ids)
        if not self.inputs.per_atom:
            return positions
        arrays = self.inputs.per_atom_arrays(atoms)
        return np.concatenate([positions, pack(arrays, ids)], axis=1)

    # -- 4. results on their owners, then on every rank --------------------------------------

    def _gather(
        self, atoms: Atoms | None, request: _Request, state: _Decomposition, columns: np.ndarray
    ) -> None:
        """Ghost nodes' results into their owners, then owned results to every rank.

        ``columns`` is the block's ``(10, n_nodes)`` result. Energy and virial
        are summed per rank, then over the ranks in rank order, so every rank
        gets the same bits. Per-atom energies and forces always travel, as
        ASE's own calculators return them from any call; per-atom stresses
        only when asked for (to every rank under SPMD, to rank 0 in worker mode).
        """
        comm = self.comm
        # ghosts' shares of energy (a pair taken once) and virial count towards the total;
        # compensated sums, added exactly over the ranks: the totals do not depend on the
        # order of the atoms, the cell or the number of ranks
        partial = compensated_row_sums(columns[_TOTALS])
        wanted = [
            (name, rows)
            for name, rows in _PER_ATOM
            if name in _ALWAYS or (name in request.properties and request.has_stress)
        ]
        collect = comm.gather_rows if self._driven else comm.allgather_rows
        totals = collect(partial[None], np.ones(comm.size, dtype=np.int64))
        selected = columns[[row for _, rows in wanted for row in rows]]  # a copy: added to
        owned = state.exchange.sum_into_owned_columns(selected)
        # distributed atoms keep their own results, in their own order
        values = owned.T if self._distributed else collect(
            np.ascontiguousarray(owned.T), state.counts[:, 1]
        )
        if atoms is None:
            return
        totals = exact_total(totals)
        self.results["energy"] = self.results["free_energy"] = float(totals[0])
        if request.has_stress:
            self.results["stress"] = totals[1:] / atoms.get_volume()
        start = 0
        for name, rows in wanted:
            part = values[:, start : start + len(rows)]
            start += len(rows)
            if state.gathered_row is None or self._distributed:
                result = part.copy()
            else:
                # a gather by row, several times faster than numpy's scatter into rows
                result = np.take(part, state.gathered_row, axis=0)
            if name == "stresses":
                result /= atoms.get_volume()
            self.results[name] = result[:, 0] if name == "energies" else result
        reference = getattr(self.model, "reference_energies", None)
        if reference is not None:
            # per-atom energies less the isolated atoms' (MACE's node_energy)
            self.results["node_energy"] = self.results["energies"] - reference(atoms.numbers)

    def _count_compile_fallbacks(self) -> None:
        """Warn when torch.compile gave up on part of the model (it then runs eagerly)."""
        failed = _failed_frames()
        if failed > self._failed_frames:
            self.compile_fallbacks += failed - self._failed_frames
            self._failed_frames = failed
            warnings.warn(
                f"torch.compile could not compile part of {type(self.model).__name__}; "
                "that part runs eagerly, "
                f"{self.compile_fallbacks} time(s) so far (calc.compile_fallbacks); "
                "torch._dynamo's warning in the log says why",
                RuntimeWarning,
                stacklevel=2,
            )

    def close(self) -> None:
        """Release the serving ranks (worker/notebook mode); safe to call twice.

        In SPMD mode there is nothing to release.
        """
        if self._driven and self.comm.is_root:
            self._driven = False
            self.comm.bcast((CLOSE, None))
            for release in self._on_close:
                release()
            self._on_close.clear()

    def __enter__(self) -> ShardedCalculator:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


# help(ShardedCalculator.__init__) would otherwise show ASE's base-class text
ShardedCalculator.__init__.__doc__ = ShardedCalculator.__doc__
