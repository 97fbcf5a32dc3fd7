"""What every layout shares: the request, the decomposition and the interface.

A *layout* says where the atoms live and so how a rank's rows and results
travel. Three exist, one module each, with one interface (:class:`Layout`):

- :class:`~ase_shard.layouts.replicated.ReplicatedLayout` (SPMD): every rank holds
  the same ``Atoms``; each plans and reads its own share of it;
- :class:`~ase_shard.layouts.root.RootLayout` (worker mode): rank 0 alone holds the
  ``Atoms``; it plans for every rank and sends each its rows;
- :class:`~ase_shard.layouts.distributed.DistributedLayout`: each rank holds only
  the atoms it owns (:class:`~ase_shard.distributed.DistributedAtoms`), which
  migrate to their owners at rebuilds.

The calculator's step calls a layout's verbs in this order: :meth:`Layout.node_rows`
(reuse steps), :meth:`Layout.validate`, :meth:`Layout.share` and
:meth:`Layout.settle` (inside the step's one vote), :meth:`Layout.build` at
rebuilds, :meth:`Layout.with_ghosts`, then :meth:`Layout.finish`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
from ase import Atoms

from ase_shard.balance import WorkCuts
from ase_shard.block import RESULT_COLUMNS, VIRIAL_ROWS
from ase_shard.comm import Comm, Failure
from ase_shard.exchange import Halo
from ase_shard.halo import RankRows
from ase_shard.inputs import ModelInputs, pack, row_width, take_rows
from ase_shard.partition import (
    EVERY_ATOM_HERE,
    FrameCoordinates,
    choose_grid,
    contiguous_owners,
    frame_box,
    frame_coordinates,
    spatial_owners,
)
from ase_shard.settings import Settings
from ase_shard.summation import compensated_row_sums, exact_total
from ase_shard.timing import PhaseTimer

# per-atom results and their rows in the block's result columns
PER_ATOM = (("energies", [0]), ("forces", [1, 2, 3]), ("stresses", [4, 5, 6, 7, 8, 9]))
# what every calculation returns, asked for or not, as ASE's EMT, LennardJones and
# MorsePotential do (ASE's tools read calc.results after an energy call); the per-atom
# stresses travel only when asked for
ALWAYS = ("energies", "forces")
# the block's rows summed into the totals: energy, then virial (Voigt)
ENERGY_ROWS = [0]
VIRIAL = range(RESULT_COLUMNS)[VIRIAL_ROWS]


@dataclass
class Request:
    """What one calculation needs, from the rank(s) holding the ``Atoms``.

    In worker mode rank 0 broadcasts it; otherwise every rank makes its own.

    Attributes
    ----------
    n_atoms : int
        Atoms of the whole system.
    cell : (3, 3) array
        Å.
    pbc : (3,) bool array
    changed : bool
        Numbers or pbc changed since the last calculation (ASE's check).
    properties : tuple of str
        What ASE asked for.
    has_stress : bool
        The cell has rank 3.
    input_shapes : dict of str to list of int
        Per-atom shape of each per-atom model input.
    system : dict of str to list
        The per-system model inputs.
    failure : Failure or None
        Why the inputs could not be read on the rank that made the request.
    """

    n_atoms: int
    cell: np.ndarray
    pbc: np.ndarray
    changed: bool
    properties: tuple[str, ...]
    has_stress: bool
    input_shapes: dict[str, list[int]] = field(default_factory=dict)
    system: dict[str, list] = field(default_factory=dict)
    failure: Failure | None = None

    @classmethod
    def of(
        cls,
        atoms: Atoms,
        properties: Sequence[str],
        system_changes: Sequence[str],
        inputs: ModelInputs,
        parameters: Mapping,
        rank: int,
    ) -> Request:
        """What a calculation of ``atoms`` needs (on the rank(s) holding them); never
        raises: inputs that cannot be read are this ``rank``'s :attr:`failure`."""
        request = cls(
            n_atoms=atoms.get_global_number_of_atoms(),
            cell=atoms.cell.array.copy(),
            pbc=atoms.pbc.copy(),
            changed=bool({"numbers", "pbc"} & set(system_changes)),
            properties=tuple(properties),
            has_stress=atoms.cell.rank == 3,
        )
        if inputs:
            try:
                shapes = inputs.per_atom_arrays(atoms)
                request.input_shapes = {k: list(v.shape[1:]) for k, v in shapes.items()}
                request.system = inputs.system_values(atoms, parameters)
            except Exception as exc:
                request.failure = Failure.of(exc, rank)
        return request

    @property
    def row_width(self) -> int:
        """Columns of a node row: the position (Å), then the packed per-atom inputs."""
        return row_width(self.input_shapes)


@dataclass
class Decomposition:
    """This rank's share of the decomposition, kept between rebuilds.

    Attributes
    ----------
    n_atoms : int
        Atoms of the whole system at the build.
    cell : (3, 3) array
        The cell at the build (Å).
    rows : RankRows
        This rank's rows (owned, ghost nodes, folded images).
    numbers : (n_nodes,) int array
        The nodes' atomic numbers.
    owned_positions : (n_owned, 3) array or None
        Owned atoms at the build (Å), for the rebuild test; set once the node
        rows are read.
    counts : (P, 6) int array or None
        Rows, owned atoms, nodes, sent rows, listed edges and the edges' work
        (:meth:`ase_shard.block.LocalBlock.listed_work`) of every rank; set once
        every rank has built its block.
    """

    n_atoms: int
    cell: np.ndarray
    rows: RankRows
    numbers: np.ndarray
    owned_positions: np.ndarray | None = None
    counts: np.ndarray | None = None

    @cached_property
    def node_ids(self) -> np.ndarray | slice:
        """Atoms of this rank's nodes; a slice when they are consecutive (one rank)."""
        ids = self.rows.ids[: self.rows.n_nodes]
        if len(ids) and ids[-1] - ids[0] == len(ids) - 1 and (np.diff(ids) == 1).all():
            return slice(int(ids[0]), int(ids[-1]) + 1)
        return ids


@dataclass(frozen=True)
class Ghosts:
    """The ghost rows of one rank: atom ``ids`` at ``positions[ids] + image_shift @ cell``."""

    ids: np.ndarray
    image_shift: np.ndarray

    @classmethod
    def of(cls, rows: RankRows) -> Ghosts:
        """A rank's rows beyond its owned atoms."""
        return cls(rows.ids[rows.n_owned :], rows.image_shift[rows.n_owned :])


@dataclass(frozen=True)
class DecompositionView:
    """The current decomposition as a user inspects it (``calc.decomposition``).

    Attributes
    ----------
    owners : (N,) int array
        The owner rank of every atom.
    ghosts : dict of int to Ghosts
        The ghost rows of the ranks this rank knows: its own under SPMD, every
        rank's on rank 0 in worker mode.
    """

    owners: np.ndarray
    ghosts: dict[int, Ghosts]


class Layout(ABC):
    """Where the atoms live, and how a rank's rows and results travel.

    Parameters
    ----------
    comm : Comm
    halo : Halo
        The calculator's communication verbs.
    settings : Settings
    inputs : ModelInputs
        The per-atom and per-system inputs the model declares.
    timer : PhaseTimer

    Attributes
    ----------
    state : Decomposition or None
        This rank's share of the current decomposition; ``None`` until the
        first :meth:`build` and after a failed step.
    """

    def __init__(
        self,
        comm: Comm,
        halo: Halo,
        settings: Settings,
        inputs: ModelInputs,
        timer: PhaseTimer,
    ):
        self.comm, self.halo, self.settings = comm, halo, settings
        self.inputs, self.timer = inputs, timer
        self.state: Decomposition | None = None
        # balance="work": the cuts kept between rebuilds and the atoms' weights (on
        # one rank there is nothing to balance, and the weights are not counted)
        by_work = settings.partition == "spatial" and settings.balance == "work"
        by_work = by_work and comm.size > 1
        self.work_cuts = WorkCuts() if by_work else None

    # -- the interface ------------------------------------------------------------------

    @abstractmethod
    def build(self, atoms: Atoms | None, request: Request) -> Decomposition:
        """Partition, find this rank's ghosts and record the exchange plan (collective).

        Sets and returns :attr:`state`; the halo's plan is recorded
        (:meth:`ase_shard.exchange.Halo.borders`).
        """

    @abstractmethod
    def node_rows(self, atoms: Atoms | None, request: Request) -> np.ndarray:
        """This rank's node rows at this step (collective where rows travel).

        ``(n, request.row_width)`` float64: positions (Å) and the packed
        per-atom inputs. ``n`` is every node's row, except for distributed
        atoms (owned rows only; :meth:`with_ghosts` adds the ghosts').
        """

    def stale(self, atoms: Atoms | None) -> str | None:
        """Why :attr:`state` no longer fits ``atoms`` (a rebuild reason), if it does not."""
        return None

    def with_ghosts(self, rows: np.ndarray) -> np.ndarray:
        """:meth:`node_rows` completed with the ghost nodes' rows (the rows as they are
        unless the ghosts' come from their owners)."""
        return rows

    def failure(self, request: Request) -> Failure | None:
        """This rank's share of the request's failure in the step's vote."""
        return request.failure

    @abstractmethod
    def validate(self, atoms: Atoms | None, request: Request) -> None:
        """Before a rebuild, check this rank's share of the atoms (raises ``ValueError``)."""

    def share(self, atoms: Atoms | None, request: Request, inputs_digest: Any) -> Any:
        """What this rank tells the others in the step's vote about its copy (small)."""
        return None

    def settle(
        self, shares: list, request: Request, reason: str | None, copies: list[Atoms]
    ) -> str | None:
        """Every rank's :meth:`share`, after the vote: raise if the ranks' systems
        disagree; the (possibly new) rebuild reason. ``copies`` are this call's
        ``Atoms`` on this rank (the caller's and the calculator's)."""
        return reason

    @abstractmethod
    def collect(self, partial: np.ndarray, owned: np.ndarray) -> tuple[Any, Any]:
        """Where the results go: ``(every rank's partial sums, per-atom columns)`` on
        the ranks that hold the ``Atoms``, a column per atom they hold, in their
        order (collective).

        ``partial`` is this rank's ``(1, 7, 2)`` compensated sums of energy and
        virial; ``owned`` its owned atoms' ``(k, n_owned)`` per-atom results, a
        view of the block's columns (read before the next evaluation).
        """

    def _collected(
        self,
        send: Callable[[np.ndarray, np.ndarray], np.ndarray | None],
        partial: np.ndarray,
        owned: np.ndarray,
        gathered_row: np.ndarray | None,
    ) -> tuple[Any, Any]:
        """:meth:`collect` by ``send`` (``Comm.allgather_rows``: to every rank;
        ``Comm.gather_rows``: to rank 0), an atom's results a row on the way, put
        back in atom order."""
        if self.comm.size == 1:
            # nothing travels, and one rank owns its atoms in their order: the columns
            # as they are, not turned into rows and back (two copies of every atom's
            # results; 3 ms a step of 256,000 atoms)
            return partial, owned
        totals = send(partial, np.ones(self.comm.size, dtype=np.int64))
        values = send(np.ascontiguousarray(owned.T), self.state.counts[:, 1])
        return totals, None if values is None else in_order(values, gathered_row).T

    def decomposition(self) -> DecompositionView | None:
        """The decomposition as a user inspects it; ``None`` where the owners are not
        known."""
        return None

    @abstractmethod
    def record_work(self, edges: np.ndarray) -> None:
        """``balance="work"``: this rank's owned atoms' edges at the rebuild (in owned
        row order) become the weights of the atoms the next partition sees
        (:meth:`ase_shard.balance.WorkCuts.record`; collective where that
        partition sees other ranks' atoms)."""

    # -- shared by the layouts ------------------------------------------------------------

    def finish(
        self,
        atoms: Atoms | None,
        request: Request,
        columns: np.ndarray,
        virial_in_node_0: bool,
    ) -> dict[str, Any] | None:
        """ASE's results from the block's ``(10, n_nodes)`` columns (collective).

        Ghost nodes' columns go back to their owners (reverse), then every
        rank's owned results and partial sums travel to the ranks holding the
        ``Atoms``; ``None`` elsewhere. Energy and virial are compensated sums,
        added exactly over the ranks: the same bits on every rank, whatever the
        order of the atoms, the cell or the number of ranks. Per-atom energies
        and forces always travel, per-atom stresses only when asked for.
        ``virial_in_node_0``: the virial rows are zero but in node 0's column
        (the block's ``virial_in_node_0``), which alone is summed.
        """
        # ghosts' shares of energy (a pair taken once) and virial count towards the total
        virials = columns[:, :1] if virial_in_node_0 else columns
        energy = compensated_row_sums(columns, ENERGY_ROWS)
        partial = np.concatenate([energy, compensated_row_sums(virials, VIRIAL)])[None]
        wanted = [
            (name, rows)
            for name, rows in PER_ATOM
            if name in ALWAYS or (name in request.properties and request.has_stress)
        ]
        # the wanted rows are the first ones: the ghosts' columns are added into the
        # owned ones where they lie (the block writes all its columns afresh each step)
        n_rows = sum(len(rows) for _, rows in wanted)
        owned = self.halo.reverse(columns[:n_rows])
        totals, values = self.collect(partial, owned)
        if atoms is None:
            return None
        totals = exact_total(totals)
        results: dict[str, Any] = {"energy": float(totals[0]), "free_energy": float(totals[0])}
        if request.has_stress:
            results["stress"] = totals[1:] / atoms.get_volume()
        for name, rows in wanted:
            # each result ASE's own: an array of its own, an atom a row, C-ordered
            result = values[rows[0] : rows[-1] + 1].T.copy()
            if name == "stresses":
                result /= atoms.get_volume()
            results[name] = result[:, 0] if name == "energies" else result
        return results

    def partition(
        self, atoms: Atoms, request: Request, first: int = 0
    ) -> tuple[FrameCoordinates, np.ndarray]:
        """Frame coordinates and owner rank of every atom of ``atoms``: the same rule on
        every rank. Ranks below ``first`` own nothing (an idle driving rank)."""
        with self.timer.phase("partition"):
            coords = frame_coordinates(atoms.positions, request.cell, request.pbc)
            ranks = self.comm.size - first
            if self.settings.partition == "contiguous":
                return coords, contiguous_owners(len(coords.s), ranks) + first
            width = self.settings.halo_width
            grid = tuple(self.settings.grid or choose_grid(coords, request.pbc, ranks, width))
            if self.work_cuts is None:
                return coords, spatial_owners(coords, grid) + first
            lo, hi = frame_box(coords.s)
            ids = np.arange(len(coords.s))
            owners = self.work_cuts.owners(coords.s, ids, lo, hi, grid, EVERY_ATOM_HERE)
            return coords, owners + first

    def rows_of(self, atoms: Atoms, ids: np.ndarray | slice) -> np.ndarray:
        """Positions (Å) and packed per-atom inputs of the atoms ``ids`` of ``atoms``."""
        positions = take_rows(atoms.positions, ids)
        if not self.inputs.per_atom:
            return positions
        arrays = self.inputs.per_atom_arrays(atoms)
        return np.concatenate([positions, pack(arrays, ids)], axis=1)


def gathered_rows(owners: np.ndarray) -> np.ndarray | None:
    """Each atom's row in results gathered by owner rank (ascending ids within a rank).

    ``None`` when that is the atoms' own order (one rank, contiguous blocks).
    """
    if (np.diff(owners) >= 0).all():
        return None
    rows = np.empty(len(owners), dtype=np.int64)
    rows[np.argsort(owners, kind="stable")] = np.arange(len(owners))
    return rows


def in_order(values: np.ndarray, row: np.ndarray | None) -> np.ndarray:
    """Rows gathered by owner rank put back in atom order (:func:`gathered_rows`)."""
    # a gather by row, several times faster than numpy's scatter into rows
    return values if row is None else np.take(values, row, axis=0)
