"""ShardedCalculator: the ASE face of ase_shard.

``calculate`` is one step, as LAMMPS's ``Verlet::run`` is to its verbs:

1. **request**: what ASE asked for, from the rank(s) holding the ``Atoms``;
2. **vote**: each rank validates its share, tests whether pair distances may
   have moved beyond the skin, and says what it holds (the layout's share);
   one allgather, after which every rank raises the same error or takes the
   same decision;
3. **rebuild** (rarely): the layout partitions and records the halo plan
   (``exchange`` and ``borders``), and the block lists its edges;
4. **forward**: this rank's node rows, the ghosts' from their owners;
5. **evaluate**: the block, closed by a status vote;
6. **finish**: ``reverse`` (ghosts' sums to their owners), then the layout
   brings the results to the ranks that hold the ``Atoms``.

Where the atoms live (every rank, rank 0 alone, or each rank its own) is a
layout's concern (:mod:`ase_shard.layouts`); the communication verbs are the
halo's (:class:`ase_shard.exchange.Halo`); the collectives are :mod:`ase_shard.comm`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from ase import Atoms
from ase.calculators.calculator import Calculator, all_changes

from ase_shard.balance import Balance
from ase_shard.block import LocalBlock, SumBlock
from ase_shard.comm import CALCULATE, CLOSE, Comm, Failure, reraise
from ase_shard.distributed import DistributedAtoms
from ase_shard.exchange import Halo, HaloExchange, PeerFailure, check_status
from ase_shard.graph import (
    ShardModel,
    check_model,
    model_digest,
    predicts_forces,
    supports_layer_halo,
    uses_positions,
)
from ase_shard.halo import RankRows
from ase_shard.inputs import ModelInputs, unpack
from ase_shard.layouts import (
    DecompositionView,
    DistributedLayout,
    Layout,
    ReplicatedLayout,
    Request,
    RootLayout,
)
from ase_shard.memory import RankShare, is_out_of_memory, out_of_memory, release_free_memory
from ase_shard.models.sum import Sum
from ase_shard.padding import Capacities, CompiledModel, runs_compiled
from ase_shard.placement import checked_dtype, place_rank, placed
from ase_shard.reuse import displacement_reason, forced_rebuild
from ase_shard.settings import Settings, checked_timeout, rank_grid
from ase_shard.system import changed_fields, validate_cell, validate_rows
from ase_shard.system_fft import SystemFFT
from ase_shard.system_sum import SystemSum
from ase_shard.timing import PhaseTimer

logger = logging.getLogger(__name__)

# every change check_state can report
_CHANGES = (*all_changes, "model inputs")


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
        ``spatial``: a ``px*py*pz`` grid of boxes in frame coordinates, cut
        axis by axis so that the boxes share the work (``balance``).
        ``contiguous``: blocks of atom indices.
    balance : {"work", "count"}
        What the ``spatial`` cuts balance. ``work``: each atom weighs the
        edges listed at it at the last rebuild (plus a node's cost), the cuts
        are kept between rebuilds and cut again when the busiest rank's work
        exceeds the mean by 2 % (liquid-vapour, slabs, clusters:
        :mod:`ase_shard.balance`); the first cut, and every cut on one rank,
        is by count, and bulk keeps its first. ``count``: every rank owns as
        many atoms as the others (within one), cut again at every rebuild.
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
        when a capacity grows. Parts dynamo cannot compile run eagerly. Each
        term of a :class:`~ase_shard.models.Sum` is compiled on its own graphs;
        a term that does not run compiled (``Coulomb``) runs eagerly beside them.
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
    cell has rank 3; ``stresses`` not for a model that predicts its forces and
    stress (:class:`ase_shard.graph.PredictedForces`), nor for one whose energy
    reads absolute positions (``uses_positions``, e.g. a ``Coulomb`` term).

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
        dtype: torch.dtype | str | None = None,
        comm: Any = None,
        partition: str = "spatial",
        balance: str = "work",
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
        self._place(
            model,
            device,
            dtype,
            timeout,
            dict(
                skin=skin,
                partition=partition,
                balance=balance,
                grid=grid,
                halo=halo,
                compile=compile,
                min_distance=min_distance,
                neighbor_list=neighbor_list,
            ),
        )
        self.parameters.update(self.settings.parameters(model))
        self.inputs = ModelInputs.of(model)
        if predicts_forces(self.model) or uses_positions(self.model):
            # a predicted stress, or a reciprocal-space sum's, has no per-atom split
            # (ase_shard.graph.PredictedForces, ShardModel's uses_positions)
            self.implemented_properties = [
                name for name in self.implemented_properties if name != "stresses"
            ]
        if hasattr(self.model, "reference_energies"):
            self.implemented_properties = [*self.implemented_properties, "node_energy"]
        self.rebuilds = 0
        self.timer = PhaseTimer(self.device, self.comm)
        self.halo = Halo(self.comm, self.device)
        self.layout: Layout = self._layout(ReplicatedLayout)
        self._block: LocalBlock | None = None
        # one per term of a Sum (None for a term that runs eagerly), else one
        self._compiled: list[CompiledModel | None] | None = None
        if compile:
            backend = compile if isinstance(compile, str) else "inductor"
            self._compiled = compiled_terms(self.model, backend)
        self._driving = False  # worker mode: rank 0 drives, the others serve
        self._on_close: list[Callable[[], None]] = []
        self._copies: list[Atoms] = []  # this call's Atoms: the caller's and ours
        self._inputs_digest: bytes | None = None  # of the inputs last calculated
        self._met = False  # check_state's vote was this call's rendezvous
        # a plan of this run (an ase_shard.plan.Plan, which imports this module), whose
        # estimate for this rank an OutOfMemory quotes
        self.memory_plan: Any = None

    def _place(
        self, model: ShardModel, device: Any, dtype: Any, timeout: Any, arguments: dict
    ) -> None:
        """Check the arguments and place the model on every rank, or raise on every rank.

        Sets :attr:`settings`, :attr:`timeout`, :attr:`device`, :attr:`dtype`
        and :attr:`model`. Every rank checks, then one vote: every rank raises
        the same error together (reported once under mpirun), never one rank
        alone; a model whose parameters differ between ranks is an error too.
        """
        failure = None
        try:
            check_model(model)
            self.settings = Settings.checked(model, self.comm.size, **arguments)
            self.timeout = checked_timeout(timeout)
            dtype = checked_dtype(dtype, model)
        except (TypeError, ValueError) as exc:
            failure = Failure.of(exc, self.comm.rank)
        try:
            self.device = place_rank(device, self.comm)  # collective: every rank comes
        except ValueError as exc:
            self.device = torch.device("cpu")
            failure = failure or Failure.of(exc, self.comm.rank)

        def place() -> tuple[str, str]:
            self.dtype = dtype
            self.model = placed(model, self.device, dtype)  # may run out of memory
            return model_digest(self.model), self.device.type

        views = self.comm.share(place, failed=failure)
        differing = [rank for rank, view in enumerate(views) if view[0] != views[0][0]]
        if differing:
            error = ValueError(
                f"the model's parameters on ranks {differing} differ from rank 0's: build "
                "it identically on every rank (same seed or the same checkpoint)"
            )
            self.comm.raised_together(error)
            raise error
        # models that sum their own forces on the host may then split pairs between ranks
        self._on_host_everywhere = all(view[1] == "cpu" for view in views)

    # -- what users and ASE see -----------------------------------------------------------

    @property
    def skin(self) -> float:
        return self.settings.skin

    @property
    def compile_fallbacks(self) -> int:
        """With ``compile``: how often torch.compile gave up on part of the model (run
        eagerly then, with a ``RuntimeWarning``)."""
        return sum(compiled.fallbacks for compiled in self._compiled or () if compiled)

    @property
    def halo_reach(self) -> float:
        """Distance (Å) the ghosts must cover beyond the skin."""
        return self.settings.halo_reach

    @property
    def layout_counts(self) -> list[tuple[int, int, int]] | None:
        """``(rows, owned, nodes)`` per rank of the current layout (every rank).

        Rows count every atom image; nodes are what the model evaluates
        (owned atoms plus ghost atoms), so ``nodes / owned`` is the padding.
        """
        state = self.layout.state
        if state is None or state.counts is None:
            return None
        return [tuple(int(n) for n in counts[:3]) for counts in state.counts]

    @property
    def balance(self) -> Balance | None:
        """Each rank's share of the work at the last rebuild (every rank; ``None``
        before the first): owned atoms, ghost atoms, listed edges and the times the
        atoms were cut by their work (``balance="work"``)."""
        state = self.layout.state
        if state is None or state.counts is None:
            return None
        counts = state.counts
        work_cuts = self.layout.work_cuts
        return Balance(
            owned=tuple(int(n) for n in counts[:, 1]),
            ghosts=tuple(int(n) for n in counts[:, 2] - counts[:, 1]),
            edges=tuple(int(n) for n in counts[:, 4]),
            rebalances=0 if work_cuts is None else work_cuts.rebalances,
        )

    @property
    def decomposition(self) -> DecompositionView | None:
        """The current layout, for inspection and plots.

        ``owners`` is the owner rank of every atom; ``ghosts[r]`` holds rank
        ``r``'s ghost rows (``ids``, ``image_shift``): the ghost sits at
        ``positions[ids] + image_shift @ cell``. Under SPMD every rank knows the
        owners and only its own ghosts; in worker mode rank 0 knows all
        ranks' ghosts. ``None`` where the owners are not known (distributed
        atoms, serving ranks).
        """
        return self.layout.decomposition()

    def request_rebuild(self) -> None:
        """Rebuild the decomposition at the next calculation (call on every rank)."""
        self.layout.state = None
        self.reset()

    def check_state(self, atoms: Atoms, tol: float = 1e-15) -> list[str]:
        """ASE's changes, plus ``"model inputs"`` when a declared input changed.

        ASE compares only positions, numbers, cell, pbc and the initial charges
        and magnetic moments; a model may also read custom arrays, velocities
        or ``atoms.info`` values. On distributed atoms the ranks vote: each
        sees only its own atoms change, and all recalculate, or none.
        """
        changes = changed_fields(self.atoms, atoms, tol, set(self.ignored_changes))
        if self.inputs and self._inputs_digest != self.inputs.digest(atoms, self.parameters):
            changes.append("model inputs")
        if isinstance(atoms, DistributedAtoms) and self.comm.size > 1:
            union = self.comm.union(
                np.isin(_CHANGES, changes),
                self.timeout,
                "check their atoms too (do all ranks call the calculator?)",
            )
            changes = [name for name, changed in zip(_CHANGES, union, strict=True) if changed]
            # every rank is here: a calculation that follows needs no rendezvous of its own
            self._met = bool(changes)
        return changes

    # -- worker mode -------------------------------------------------------------------

    def drive_workers(
        self,
        *,
        root_computes: bool = True,
        grid: Sequence[int] | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        """Worker mode, on every rank: rank 0 alone runs ASE from now on.

        Rank 0 keeps the ``Atoms``, plans for every rank and sends each its
        share of every calculation; the other ranks call :meth:`serve`.

        Parameters
        ----------
        root_computes : bool
            ``False``: rank 0 owns no atoms and only drives (a notebook
            process driving spawned workers).
        grid : (int, int, int), optional
            Rank grid over the computing ranks.
        on_close : callable, optional
            Called on rank 0 by :meth:`close`, after the servers are released.
        """
        computing = self.comm.size - (not root_computes)
        if grid is not None:
            self.settings = replace(self.settings, grid=rank_grid(grid, computing))
            self.parameters["grid"] = list(self.settings.grid)
        self.layout = self._layout(RootLayout, idle_root=not root_computes)
        self._driving = True
        if on_close is not None:
            self._on_close.append(on_close)

    def serve(self) -> None:
        """Worker mode, on ranks other than 0: evaluate rank 0's calculations until it
        closes the calculator (:meth:`close`); then return."""
        while (message := self.comm.bcast(None))[0] == CALCULATE:
            try:
                self._step(None, message[1])
            except Exception:
                self._forget()  # rank 0 raises the same error; keep serving

    def close(self) -> None:
        """Release the serving ranks (worker/notebook mode); safe to call twice.

        In SPMD mode there is nothing to release.
        """
        if self._driving and self.comm.is_root:
            self._driving = False
            self.comm.bcast((CLOSE, None))
            for release in self._on_close:
                release()
            self._on_close.clear()

    def __enter__(self) -> ShardedCalculator:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- the step ----------------------------------------------------------------------

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
        # the caller's Atoms too, so a re-synchronisation reaches them
        self._copies = [copy for copy in (atoms,) if copy is not None]
        given = atoms if atoms is not None else self.atoms
        distributed = isinstance(given, DistributedAtoms)
        if distributed:
            self._check_distributed(given)
            # atoms migrate in place: the caller's (a driver's) atoms, not a copy, which
            # is taken once they have moved (what the next call compares)
            atoms, self.atoms = given, None
        else:
            Calculator.calculate(self, atoms, properties, system_changes)
            atoms = self.atoms
        if not self._driving:
            wanted = DistributedLayout if distributed else ReplicatedLayout
            if type(self.layout) is not wanted:
                self.layout = self._layout(wanted)
        self._copies.append(atoms)
        if self.inputs:
            self._inputs_digest = self.inputs.digest(atoms, self.parameters)
        request = Request.of(
            atoms, properties, system_changes, self.inputs, self.parameters, self.comm.rank
        )
        if self._driving:
            self.comm.bcast((CALCULATE, request))
        elif not self._met:
            self.comm.rendezvous(
                self.timeout, "calculate too (do all ranks hold the same Atoms and call it?)"
            )
        self._met = False
        try:
            self.results.update(self._step(atoms, request))
            if distributed:
                self.atoms = atoms.copy()
        except BaseException as exc:
            self._forget()  # the next call starts from a fresh decomposition on every rank
            if isinstance(exc, Exception) and not self._driving:
                self.comm.raised_together(exc)  # errors leave _step on every rank
            raise

    def _step(self, atoms: Atoms | None, request: Request) -> dict[str, Any] | None:
        """One collective evaluation; ``atoms`` is ``None`` on serving ranks, which get
        no results."""
        layout, timer = self.layout, self.timer
        reason, deformation = forced_rebuild(
            layout.state, request.n_atoms, request.cell, request.changed
        )
        if reason is None:
            reason = layout.stale(atoms)
        rows, failed = None, None
        if reason is None and request.failure is None:
            with timer.phase("scatter"):
                try:
                    rows = layout.node_rows(atoms, request)
                except Exception as exc:  # e.g. out of memory: the vote raises it everywhere
                    error = self._memory_failure(exc, "reading its atoms' rows")
                    failed = Failure.of(error, self.comm.rank)
        with timer.phase("validate"):
            reason = self._agree(atoms, request, reason, rows, deformation, failed)
        if reason is not None:
            rows = self._rebuild(atoms, request, reason)
        else:
            rows = layout.with_ghosts(rows)
        columns = self._evaluate(rows, request)
        with timer.phase("gather"):
            results = layout.finish(atoms, request, columns, self._block.virial_in_node_0)
        reference = getattr(self.model, "reference_energies", None)
        if results is not None and reference is not None:
            # per-atom energies less the isolated atoms' (MACE's node_energy)
            results["node_energy"] = results["energies"] - reference(atoms.numbers)
        return results

    # -- 2. the vote -------------------------------------------------------------------

    def _agree(
        self,
        atoms: Atoms | None,
        request: Request,
        reason: str | None,
        rows: np.ndarray | None,
        deformation: np.ndarray | None,
        failed: Failure | None = None,
    ) -> str | None:
        """Validate, vote on a rebuild and check the ranks' systems: one allgather.

        Each rank validates its own share only (the owned rows it evaluates,
        or before a rebuild the layout's share of the atoms) and sends what
        its layout says of its copy (:meth:`ase_shard.layouts.base.Layout.share`):
        under SPMD the fingerprint of its whole copy, so that a copy that
        differs from rank 0's anywhere is found at this call, before any rank
        evaluates it. Every rank then raises the same error, or returns the
        same rebuild reason (``None``: reuse). ``failed``: this rank's failure
        before the vote (reading its node rows), which every rank then raises.
        """
        layout = self.layout

        def own() -> tuple[str | None, Any]:
            own_reason = reason
            if reason is not None or deformation is not None:
                validate_cell(request.cell, request.pbc)  # else the build's cell, checked then
            if rows is not None:
                validate_rows(rows, layout.state.rows, request.input_shapes)
                own_reason = displacement_reason(
                    layout.state, rows[:, :3], deformation, self.settings.halo_reach, self.skin
                )
            else:
                layout.validate(atoms, request)
            return own_reason, layout.share(atoms, request, self._inputs_digest)

        views = self.comm.share(own, failed=failed or layout.failure(request))
        reason = next((view[0] for view in views if view[0] is not None), None)
        return layout.settle([view[1] for view in views], request, reason, self._copies)

    # -- 3. rebuild --------------------------------------------------------------------

    def _rebuild(self, atoms: Atoms | None, request: Request, reason: str) -> np.ndarray:
        """The layout's new decomposition and halo plan, then the block; the node rows."""
        self.rebuilds += 1
        self._block = None
        layout = self.layout
        state = layout.build(atoms, request)
        with self.timer.phase("scatter"):
            rows = layout.node_rows(atoms, request)
        rows = layout.with_ghosts(rows)
        state.owned_positions = rows[: state.rows.n_owned, :3].copy()

        def own_block() -> tuple[tuple[int, ...], list[Capacities]]:
            validate_rows(rows, state.rows, request.input_shapes)
            try:
                self._block = self._new_block(state, rows, request)
            except Exception as exc:
                raise self._memory_failure(exc, "listing its edges") from exc
            planned = state.rows
            counts = (
                len(planned.ids),
                planned.n_owned,
                planned.n_nodes,
                len(planned.send_index),
                listed_edges(self._block),
                sum(block.listed_work() for block in self._term_blocks()),
            )
            return counts, [block.needed() for block in self._term_blocks()]

        views = self.comm.share(own_block)
        release_free_memory()  # the search's temporaries
        state.counts = np.array([view[0] for view in views], dtype=np.int64)
        work_cuts = layout.work_cuts
        if work_cuts is not None and work_cuts.measure(state.counts[:, 5], state.counts[:, 1]):
            with self.timer.phase("partition"):  # the next partition's weights
                edges = sum(block.node_edges() for block in self._term_blocks())
                # a pair listed on one rank is the work of its other atom's too
                owned = self.halo.reverse(edges[None].astype(np.float64))[0]
                layout.record_work(owned.astype(np.int64))
        if self._compiled is not None:
            # every rank pads to the same sizes, so they (re)compile together
            terms = zip(self._term_blocks(), self._compiled, strict=True)
            for k, (block, compiled) in enumerate(terms):
                if compiled is not None:
                    block.pad(compiled.grow([view[1][k] for view in views]))
        if self.comm.is_root:
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
        return rows

    def _new_block(self, state, rows: np.ndarray, request: Request) -> LocalBlock | SumBlock:
        """This rank's block: its local graph's edges at the new decomposition."""
        several = self.comm.size > 1
        return new_block(
            self.model,
            state.rows,
            state.numbers,
            rows[:, :3],
            request.cell,
            self.settings,
            self.device,
            self.halo.plan,
            pair_halo=several and self._on_host_everywhere,
            compiled=self._compiled,
            timer=self.timer,
            system_sum=SystemSum(self.comm) if several else None,
            system_fft=SystemFFT(self.comm) if several else None,
        )

    # -- 5. evaluation -----------------------------------------------------------------

    def _evaluate(self, rows: np.ndarray, request: Request) -> np.ndarray:
        """The block's ``(10, n_nodes)`` result columns, or the same error on every rank.

        A rank whose model raised casts a "failed" status vote; the others
        stop at their next vote (:class:`ase_shard.exchange.PeerFailure`),
        and every rank raises the error of the ranks that failed. Ranks whose
        models made different exchanges stop at the first vote where they part
        (:class:`ase_shard.exchange.ExchangeMismatch`).
        """
        comm = self.comm
        failure = None
        try:
            inputs = unpack(rows[:, 3:], request.input_shapes)
            columns = self._block.evaluate(
                rows[:, :3],
                request.cell,
                self.dtype,
                inputs,
                request.system,
                per_node_virials="stresses" in request.properties,
            )
            for compiled in self._compiled or ():
                if compiled is not None:
                    compiled.count_fallbacks()
            # the closing status vote (see ase_shard.exchange)
            check_status(*comm.status(False, closing=True), "in its evaluation")
        except PeerFailure as exc:
            failure = Failure.of(exc, comm.rank)
        except Exception as exc:
            failure = Failure.of(self._memory_failure(exc, "in its evaluation"), comm.rank)
            comm.status(True, closing=True)
        if failure is not None:
            with self.timer.phase("gather"):
                # after the vote every rank knows that some rank failed
                failed = [f for f in comm.allgather(failure) if f is not None]
                # report the ranks that failed, not those that stopped for them
                raise reraise(
                    [f for f in failed if f.qualname != PeerFailure.__qualname__] or failed
                )
        return columns

    # -- helpers -----------------------------------------------------------------------

    def _memory_failure(self, error: Exception, where: str) -> Exception:
        """``error``, or if it is an allocation failure the :class:`OutOfMemory` that
        says what this rank held (its atoms, ghosts and, once listed, edges)."""
        if not is_out_of_memory(error):
            return error
        state = self.layout.state
        owned = ghosts = None
        if state is not None:
            owned, ghosts = state.rows.n_owned, state.rows.n_nodes - state.rows.n_owned
        edges = None if self._block is None else listed_edges(self._block)
        planned = None
        if self.memory_plan is not None and self.memory_plan.ranks == self.comm.size:
            planned = self.memory_plan.peak_memory_per_rank[self.comm.rank]
        return out_of_memory(error, where, RankShare(owned, ghosts, edges, planned))

    def _term_blocks(self) -> list[LocalBlock]:
        """The block of each term (of a ``Sum``: one per term), in the terms' order."""
        return term_blocks(self._block)

    def _layout(self, kind: type[Layout], **options: Any) -> Layout:
        """A new layout of ``kind`` over this calculator's communication and settings."""
        self._block = None
        return kind(self.comm, self.halo, self.settings, self.inputs, self.timer, **options)

    def _check_distributed(self, atoms: DistributedAtoms) -> None:
        if self._driving:
            raise ValueError("DistributedAtoms need every rank to run the script (SPMD)")
        if atoms.comm.size != self.comm.size:
            raise ValueError(
                f"the DistributedAtoms are spread over {atoms.comm.size} rank(s), the "
                f"calculator over {self.comm.size}: give both the same communicator"
            )

    def _forget(self) -> None:
        """After a failed step every rank starts the next from a fresh decomposition."""
        self.layout.state = None
        self._block = None
        self.halo.forget()
        self._inputs_digest = None


# help(ShardedCalculator.__init__) would otherwise show ASE's base-class text
ShardedCalculator.__init__.__doc__ = ShardedCalculator.__doc__


def _terms(model: ShardModel) -> list[ShardModel]:
    """A :class:`~ase_shard.models.Sum`'s terms, or the model alone."""
    return list(model.terms) if isinstance(model, Sum) else [model]


def new_block(
    model: ShardModel,
    rows: RankRows,
    numbers: np.ndarray,
    node_positions: np.ndarray,
    cell: np.ndarray,
    settings: Settings,
    device: torch.device,
    plan: HaloExchange,
    *,
    pair_halo: bool,
    compiled: list[CompiledModel | None] | None = None,
    timer: PhaseTimer | None = None,
    system_sum: SystemSum | None = None,
    system_fft: SystemFFT | None = None,
) -> LocalBlock | SumBlock:
    """A rank's block at a decomposition: its local graph's edges (of a
    :class:`~ase_shard.models.Sum`, one block per term, each at its own cutoff).

    ``plan`` is the rank's halo exchange: the per-layer halo's (``settings.halo
    == "layer"``, for the terms that support it) and, with ``pair_halo`` (every
    rank of several evaluates on the host), the one a ``newton_pair`` kernel
    sums a pair between two ranks through. ``compiled`` holds each term's
    compiled model (``None`` for one that runs eagerly). The calculator builds
    its blocks here at every rebuild, :func:`ase_shard.plan.plan` every rank's.
    """
    layer = settings.halo == "layer"

    def block(term: ShardModel, exchange, term_compiled: CompiledModel | None) -> LocalBlock:
        return LocalBlock(
            rows,
            numbers,
            node_positions,
            cell,
            term,
            skin=settings.skin,
            device=device,
            exchange=exchange,
            timer=timer,
            compiled=None if term_compiled is None else term_compiled.compiled,
            min_distance=settings.min_distance,
            neighbor_list=settings.neighbor_list,
            pair_halo=plan if pair_halo else None,
            system_sum=system_sum,
            system_fft=system_fft,
        )

    each = compiled or [None] * len(_terms(model))
    if isinstance(model, Sum):
        # a term exchanges through the plan if it can (a one-layer term, e.g. EMT,
        # has nothing to exchange)
        return SumBlock(
            [
                block(term, plan if layer and supports_layer_halo(term) else None, term_compiled)
                for term, term_compiled in zip(model.terms, each, strict=True)
            ]
        )
    return block(model, plan if layer else None, each[0])


def term_blocks(block: LocalBlock | SumBlock) -> list[LocalBlock]:
    """The block of each term (of a ``Sum``: one per term), in the terms' order."""
    return block.blocks if isinstance(block, SumBlock) else [block]


def listed_edges(block: LocalBlock | SumBlock) -> int:
    """The edges a rank's block lists (of a ``Sum``, every term's)."""
    return sum(int(term.centre.shape[0]) for term in term_blocks(block))


def compiled_terms(model: ShardModel, backend: str) -> list[CompiledModel | None]:
    """Each term compiled on its own graphs (``None`` for a term of a ``Sum`` that
    does not run compiled: it runs eagerly); a model that is not a ``Sum`` is
    compiled or refused (:class:`~ase_shard.padding.CompiledModel`)."""
    if not isinstance(model, Sum) or not any(runs_compiled(term) for term in model.terms):
        return [CompiledModel(term, backend) for term in _terms(model)]
    return [CompiledModel(term, backend) if runs_compiled(term) else None for term in model.terms]
