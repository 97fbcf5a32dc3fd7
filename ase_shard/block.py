"""One rank's block of atoms: local graph, evaluation and derivatives.

Pure torch, no MPI of its own: the calculator gives it the rank's rows and
node positions and sums the per-node contributions it returns into their
owners. With a per-layer halo the model's ``graph.exchange`` calls are the
only collectives inside.
"""

from __future__ import annotations

import numpy as np
import torch

from ase_shard.exchange import HaloExchange
from ase_shard.graph import (
    EdgeList,
    Hops,
    LocalGraph,
    MeshTransform,
    PredictedForces,
    Scratch,
    direct_forces,
    model_dtype,
    predicts_forces,
    takes_pairs_once,
    uses_positions,
)
from ase_shard.halo import RankRows
from ase_shard.neighbors import neighbor_pairs
from ase_shard.padding import Capacities, pad_graph
from ase_shard.timing import PhaseTimer

# Rows of the per-node result: energy, force (3), virial Voigt (6).
RESULT_COLUMNS = 10
# their virial rows (Voigt xx yy zz yz xz xy), after the energy and the three forces
VIRIAL_ROWS = slice(4, 10)

# Å: atoms closer than this are one point, whatever min_distance says. Their edge
# vector is round-off (its direction meaningless) or zero (NaN forces), so a model
# returns NaN or a finite answer that means nothing. Nuclei are ~1e-5 Å across; the
# closest contacts of real optimisations and MD (~0.2 Å) are far above it.
COINCIDENT_DISTANCE = 1e-4
_VOIGT = ((0, 0), (1, 1), (2, 2), (1, 2), (0, 2), (0, 1))


def sum_edge_gradients(
    centre: torch.Tensor,
    neighbour: torch.Tensor,
    vectors: torch.Tensor,
    grad: torch.Tensor,
    n_rows: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-row forces and virials from the energy's gradient w.r.t. edge vectors.

    Parameters
    ----------
    centre, neighbour : (E,) int64 tensors
        Rows of each edge's ends.
    vectors : (E, 3) float64 tensor
        Edge vectors ``d = r_neighbour - r_centre`` in Å.
    grad : (E, 3) float64 tensor
        ``dE/dd`` in eV/Å.
    n_rows : int
    out : (9, n_rows) float64 tensor, optional
        Zeroed storage to sum into (a new one by default).

    Returns
    -------
    torch.Tensor
        ``(n_rows, 9)`` float64 (a transposed view): the force in eV/Å
        (``dE/dr_neighbour = g`` and ``dE/dr_centre = -g``, so ``+g`` on the
        centre and ``-g`` on the neighbour), then the virial ``sum d ⊗ g``
        symmetrised, Voigt order xx, yy, zz, yz, xz, xy, in eV, each edge's
        share split evenly between its ends.
    """
    # One column at a time, with 1-D index_add_ into contiguous rows and one
    # reused per-edge buffer: several times faster on CPU than (E, 9) blocks,
    # whose fresh pages and strided scatters dominated the step for EMT.
    if out is None:
        out = torch.zeros((9, n_rows), dtype=torch.float64, device=grad.device)
    for axis in range(3):
        column = grad[:, axis]
        out[axis].index_add_(0, centre, column).index_add_(0, neighbour, column, alpha=-1)
    work = torch.empty(grad.shape[0], dtype=torch.float64, device=grad.device)
    for k, (a, b) in enumerate(_VOIGT):
        share = torch.mul(vectors[:, a], grad[:, b], out=work)
        if a != b:
            share.addcmul_(vectors[:, b], grad[:, a]).mul_(0.5)
        out[3 + k].index_add_(0, centre, share).index_add_(0, neighbour, share)
    out[3:] *= 0.5
    return out.t()


def add_position_gradients(
    result: torch.Tensor, positions_grad: torch.Tensor | None, strain_grad: torch.Tensor | None
) -> None:
    """Add an energy's gradients w.r.t. node positions and a strain to result columns.

    ``positions_grad`` (``(n_nodes, 3)``, eV/Å) gives the forces ``-dE/dr``;
    ``strain_grad`` (``(3, 3)``, eV), the derivative for positions and cell strained
    together, is the virial, symmetrised into the first node's Voigt columns: such
    a term has no per-atom split of its virial (per-atom stresses are refused), only
    the columns' sum is read.
    """
    if positions_grad is not None:
        result[1:4] -= positions_grad.to(torch.float64).t()
    if strain_grad is not None and result.shape[1]:
        virial = strain_grad.to(torch.float64)
        virial = 0.5 * (virial + virial.t())
        result[4:, 0] += torch.stack([virial[a, b] for a, b in _VOIGT])


def hop_counts(
    centre: torch.Tensor, neighbour: torch.Tensor, n_owned: int, n_nodes: int, depth: int
) -> torch.Tensor:
    """Message-passing hops from the owned nodes (the first ``n_owned``) to every node.

    Messages flow from an edge's neighbour into its centre, so the neighbours
    of edges centred ``k`` hops out are at most ``k + 1`` hops out.

    Parameters
    ----------
    centre, neighbour : (E,) int64 tensors
        The edges' ends.
    n_owned, n_nodes : int
    depth : int
        Hops counted; nodes further out get ``depth + 1``.

    Returns
    -------
    torch.Tensor
        ``(n_nodes,)`` int64, in ``[0, depth + 1]``.
    """
    hops = torch.full((n_nodes,), depth + 1, dtype=torch.int64, device=centre.device)
    hops[:n_owned] = 0
    for hop in range(1, depth + 1):
        reached = hops.index_select(0, centre) < hop
        hops.scatter_reduce_(0, neighbour, torch.where(reached, hop, depth + 1), "amin")
    return hops


def kept_edges_on_host(keep: torch.Tensor, ends: np.ndarray) -> tuple[torch.Tensor, list[int]]:
    """Indices of the kept edges, and how many are kept before each of ``ends``.

    For a CPU tensor: no device to wait for, and numpy's ``flatnonzero`` is
    many times faster than torch's ``nonzero`` there.
    """
    within = np.flatnonzero(keep.numpy())
    return torch.from_numpy(within), np.searchsorted(within, ends).tolist()


def kept_edges_on_device(keep: torch.Tensor, last: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """:func:`kept_edges_on_host` on an accelerator, with one copy to the host.

    ``last`` holds ``ends - 1`` (every end positive). The copy brings the kept
    counts; ``nonzero_static`` then finds the indices without another wait
    (``nonzero`` would copy its own count to the host).
    """
    kept = keep.cumsum(0).index_select(0, last).tolist()
    return torch.nonzero_static(keep, size=kept[-1]).squeeze(1), kept


# Rows per gather of rows_to_nodes on the host: its scratch stays in cache.
NODES_CHUNK = 1 << 16


def rows_to_nodes(rows: torch.Tensor, node: torch.Tensor) -> torch.Tensor:
    """``node[rows]``, written over ``rows`` (and returned): each edge's neighbour row
    (an owned or ghost node, or a folded image of one) as its node.

    In place, so the search's list is the block's, held once; on the host a chunk
    at a time, so the gather's scratch is a chunk's, not the list's (4 or 8 bytes
    an edge at the rebuild's peak).
    """
    if rows.device.type != "cpu":
        return rows.copy_(node.index_select(0, rows))
    for chunk in rows.split(NODES_CHUNK):
        chunk.copy_(node.index_select(0, chunk))
    return rows


def edge_images(
    n_edges: int, shifted: np.ndarray, shifts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Each edge's (or row's) periodic image as a row of a small table of image shifts.

    Parameters
    ----------
    n_edges : int
    shifted : (S,) int64 array
        The edges whose neighbour sits at a periodic image of its node (or the
        rows that are another image of their node).
    shifts : (S, 3) float64 array
        Their image shifts in cells.

    Returns
    -------
    image : (n_edges,) int8, int16 or int32 array
        Each edge's row of ``table``; 0 for the edges not in ``shifted``.
    table : (m, 3) float64 array
        The distinct shifts in cells, zero first: ``table @ cell`` are the offsets in Å.
    """
    # whole cells in a small box: a key per shift and a lookup table, no sort (np.unique
    # over rows sorted 10^5 of them by slow row comparisons at every rebuild)
    cells = np.rint(shifts).astype(np.int64).reshape(-1, 3)
    low = cells.min(axis=0, initial=0)
    span = cells.max(axis=0, initial=0) - low + 1
    key = np.ravel_multi_index((cells - low).T, span)
    present = np.zeros(int(np.prod(span)), dtype=bool)
    present[key] = True
    distinct = np.stack(np.unravel_index(np.flatnonzero(present), span), axis=1) + low
    table = np.concatenate([np.zeros((1, 3)), distinct])
    # a byte an edge while the distinct shifts are few (as usual: the cells around
    # the box), two or four beyond
    kind = np.int8 if len(table) <= 2**7 else np.int16 if len(table) <= 2**15 else np.int32
    image = np.zeros(n_edges, dtype=kind)
    image[shifted] = np.cumsum(present)[key]  # rows of ``distinct`` from 1: 0 is no shift
    return image, table


class LocalBlock:
    """A rank's nodes (owned, then ghosts) and edges valid within the skin.

    Parameters
    ----------
    rows : RankRows
        The rank's rows: owned and ghost nodes, then folded periodic images.
    numbers : (n_nodes,) int array
        Atomic numbers of the nodes.
    node_positions : (n_nodes, 3) array
        Positions (Å) of the nodes' atoms (``positions[rows.ids[:n_nodes]]``)
        at build time; a row sits at its node's atom plus
        ``rows.image_shift @ cell``.
    cell : (3, 3) array
    model : ShardModel
    skin : float
        Extra neighbour-list radius in Å, so the list stays valid until some
        atom moved more than ``skin / 2``.
    device : torch.device
    exchange : HaloExchange, optional
        Per-layer halo: only edges centred on owned nodes are built and the
        model refreshes ghost features through it. Without (full halo) and with
        several layers, the edges are sorted by their centres' hop counts from
        the owned nodes, those centred ``num_layers`` or more hops out are left
        out, and the model gets the counts (``LocalGraph.hops``).
    timer : PhaseTimer, optional
    compiled : callable, optional
        The compiled model; it is given graphs padded to :meth:`pad`'s capacities.
    min_distance : float
        Å; :meth:`evaluate` raises ``ValueError`` for a pair of atoms closer
        than this, or than :data:`COINCIDENT_DISTANCE` (only pairs within the
        model's cutoff are seen).
    neighbor_list : {"auto", "numba", "vesin", "torch"}
        The neighbour search (see :func:`ase_shard.neighbors.neighbor_pairs`).
    pair_halo : HaloExchange, optional
        Given on every rank when every rank evaluates on the host (several
        ranks), else on none: with it a model that declares ``newton_pair``
        and sums its own forces here evaluates a pair between two ranks on
        one of them (:func:`ase_shard.shared_pairs.centre_takes_pair`), exchanging per-node sums
        through it (:attr:`ase_shard.graph.EdgeList.halo`); a two-stage model
        that sums its own forces does so with the per-layer halo (``exchange``)
        only with it or on one rank, as its exchanges are then the host's.
    system_sum : callable, optional
        Given to the model's graphs as ``LocalGraph.system_sum`` (a
        :class:`ase_shard.system_sum.SystemSum` on several ranks).
    system_fft : MeshTransform, optional
        Given to the model's graphs as ``LocalGraph.system_fft`` (on several ranks).
    """

    def __init__(
        self,
        rows: RankRows,
        numbers: np.ndarray,
        node_positions: np.ndarray,
        cell: np.ndarray,
        model,
        *,
        skin: float,
        device,
        exchange: HaloExchange | None = None,
        timer: PhaseTimer | None = None,
        compiled=None,
        min_distance: float = 0.0,
        neighbor_list: str = "auto",
        pair_halo: HaloExchange | None = None,
        system_sum=None,
        system_fft: MeshTransform | None = None,
    ):
        self.device = torch.device(device)
        self.timer = timer or PhaseTimer(self.device)
        n_owned, n_nodes = rows.n_owned, rows.n_nodes
        self.ids = np.asarray(rows.ids[:n_nodes])
        self.numbers = torch.as_tensor(numbers, dtype=torch.int64, device=self.device)
        image_shift = torch.as_tensor(rows.image_shift, dtype=torch.float64, device=self.device)
        node = torch.as_tensor(rows.node, dtype=torch.int64, device=self.device)
        # the nodes whose row is another image of their atom (an atom wrapped into the
        # cell) and their shifts in cells: the others' are zero, and the rows' shifts (24
        # bytes a row) are not held past the build
        self.shifted_nodes = image_shift[:n_nodes].any(dim=1).nonzero().squeeze(1)
        self.node_shift = image_shift[self.shifted_nodes]
        self.n_owned, self.n_nodes = int(n_owned), int(n_nodes)
        self.model = model
        self.exchange = exchange
        # the graphs' system_sum (see LocalGraph): None in one process
        self.system_sum = system_sum
        self.system_fft = system_fft
        self.compiled = compiled
        # pairs beyond the cutoff may be missing from the list on reuse steps
        self.min_distance = min(max(float(min_distance), COINCIDENT_DISTANCE), float(model.cutoff))
        self.capacity: Capacities | None = None
        self._shift_cell: np.ndarray | None = None  # cell of the cached offsets
        self._result: torch.Tensor | None = None
        # a built-in potential sums its own forces on a CPU in float64 (no autograd)
        on_host = self.device.type == "cpu" and compiled is None
        on_host = on_host and model_dtype(model) == torch.float64
        self._direct = direct_forces(model) if on_host else None
        # the halo its kernel exchanges per-node columns through (GhostColumns)
        self._halo: HaloExchange | None = None
        if self._direct is not None and int(model.num_layers) > 1:
            # two stages: the per-layer halo's plan carries the first stage's columns
            # to the ghosts and their derivatives back, as host collectives that every
            # rank must make: pair_halo says all ranks evaluate on the host
            one_rank = exchange is not None and exchange.comm.size == 1
            self._halo = exchange if pair_halo is not None or one_rank else None
            if self._halo is None:
                self._direct = None
        elif exchange is not None:
            self._direct = None
        self._columns: np.ndarray | None = None  # the direct path's result
        self._scratch = Scratch()  # the direct model's arrays between steps
        # the last evaluation's virial rows are zero but in node 0's column (a direct
        # model's sum, :class:`~ase_shard.graph.DirectForces`): their sums read that
        # alone. Only the direct path sets it, and a block keeps its path
        self.virial_in_node_0 = False
        # forces and virials as the model's outputs (PredictedForces): no autograd
        self._predicts = predicts_forces(model)
        # an energy of absolute positions and the cell: their gradients add to the edges'
        self._uses_positions = uses_positions(model)
        newton_pair = self._direct is not None and takes_pairs_once(model)
        self._listed_once = newton_pair  # each pair listed on one end only
        if newton_pair:
            self._halo = pair_halo
        types = getattr(model, "atomic_types", None)
        self.fill_number = int(min(types)) if types else 1  # padding nodes' element

        with self.timer.phase("neighbors"):
            atoms = torch.as_tensor(node_positions, dtype=torch.float64, device=self.device)
            cell = torch.as_tensor(cell, dtype=torch.float64, device=self.device)
            # Edges centred on owned nodes suffice when the energy of an atom
            # depends on its own edges only (one layer) or ghosts get their
            # features from their owners (per-layer halo); folded images never
            # centre an edge, their node already has them all.
            owned_only = exchange is not None or int(model.num_layers) == 1
            # the host kernels take int32 indices: half the list's bytes (the edges
            # are most of a block's memory); torch's scatters want int64
            host32 = self._direct is not None and node.shape[0] < 2**31
            centre, row = neighbor_pairs(
                atoms[node] + image_shift @ cell,
                float(model.cutoff) + skin,
                n_centres=self.n_owned if owned_only else self.n_nodes,
                neighbor_list=neighbor_list,
                # a pair between owned nodes is searched from its lower end only
                once_by=node if newton_pair else None,
                dtype=torch.int32 if host32 else torch.int64,
            )
            if newton_pair and self._halo is not None:
                centre, row = self._pairs_once(centre, row, node)
            # the edges within the cutoff at a step are counted per hop level
            # (what ends each level); one level when all are centred on owned nodes
            ends = [centre.shape[0]]
            self._hops: tuple[tuple[int, ...], torch.Tensor, torch.Tensor] | None = None
            if not owned_only:
                ends, kept = self._count_hops(centre, node[row], int(model.num_layers))
                if kept is not None:
                    centre, row = centre[kept], row[kept]
            self._level_ends = np.asarray(ends, dtype=np.int64)
            self._level_last = torch.as_tensor(self._level_ends - 1, device=self.device)
            self.centre = centre
            # torch's path keeps the edges that cross to a periodic image (to a folded
            # row, another image of its node than the node's own) and their shifts in
            # cells: a few per cent of the edges (24 bytes an edge for all would add
            # up); the kernels' path, each edge's row of a small table of shifts (a
            # byte an edge, no offsets)
            self.shifted_edges: torch.Tensor | None = None
            self.edge_shift: torch.Tensor | None = None
            self._images: tuple[np.ndarray, np.ndarray] | None = None
            self._plain = range(0)  # EdgeList.plain
            if self._direct is None:
                shifted = (row >= self.n_nodes).nonzero().squeeze(1)
                shifted_rows = row[shifted]
                self.neighbour = rows_to_nodes(row, node)
                self.shifted_edges = shifted
                self.edge_shift = image_shift[shifted_rows] - image_shift[self.neighbour[shifted]]
            else:
                # the shifts found per folded row (tens of thousands), then read per
                # edge: 32,000 Ar atoms on one rank, 90,000 of 1,010,000 edges
                # shifted, 2.3 ms a rebuild against 8 found per shifted edge. torch's
                # index_select reads the int32 rows as they are (numpy's take copies
                # them to int64 first, 8 bytes an edge at the peak; its indexing does
                # not, but took twice as long)
                folded = np.arange(self.n_nodes, node.shape[0])
                shift = image_shift[self.n_nodes :] - image_shift[node[self.n_nodes :]]
                row_image, table = edge_images(node.shape[0], folded, shift.numpy())
                image = torch.index_select(torch.from_numpy(row_image), 0, row).numpy()
                self.neighbour = rows_to_nodes(row, node)
                self._images = (image, table)
                # the kernels leave the offsets of the plain edges out (the kernels' edges
                # are all centred on owned nodes: no hop levels whose order to keep)
                from ase_shard.kernels import plain_edges_together

                self._plain = plain_edges_together(
                    self.centre.numpy(), self.neighbour.numpy(), image, self.n_owned,
                    ghosts_first=newton_pair and self._halo is not None,
                )  # fmt: skip

    def _pairs_once(
        self, centre: torch.Tensor, rows: torch.Tensor, node: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The edges a ``newton_pair`` model evaluates with a pair halo, in their order.

        The search has already left, of a pair of owned nodes, the edge from the
        lower one only (``once_by``); without a pair halo its list is the one
        evaluated. With one, of the edges to ghosts those whose pair this rank
        takes (the other rank lists the same pair and leaves it), grouped by
        ghost, then the edges between owned nodes
        (:func:`ase_shard.shared_pairs.pairs_once`; on the host only, as the
        kernels that take pairs once).
        """
        from ase_shard.shared_pairs import pairs_once

        kept = pairs_once(centre.numpy(), rows.numpy(), node.numpy(), self.ids, self.n_owned)
        return torch.from_numpy(kept[0]), torch.from_numpy(kept[1])

    def _count_hops(
        self, centre: torch.Tensor, neighbour: torch.Tensor, depth: int
    ) -> tuple[list[int], torch.Tensor | None]:
        """Full halo, several layers: hop counts of nodes and edges (``LocalGraph.hops``).

        The node counts are kept for the steps in ``_hops``.

        Parameters
        ----------
        centre, neighbour : (E,) int64 tensors
            The nodes of the edges within ``cutoff + skin``.
        depth : int
            The model's number of layers.

        Returns
        -------
        ends : list of int
            ``ends[k]``: the edges centred within ``k`` hops, ``k < depth``.
        kept : torch.Tensor or None
            The edges to keep, by their centre's hop count (stable), those
            centred ``depth`` or more hops out left out: they cannot reach an
            owned energy. ``None``: all, in their order (all centred on owned nodes).
        """
        hops = hop_counts(centre, neighbour, self.n_owned, self.n_nodes, depth)
        edge_hops = hops.index_select(0, centre)
        # a rebuild may wait for the device: one copy of both counts
        counts = torch.stack(
            [torch.bincount(values, minlength=depth + 2) for values in (edge_hops, hops)]
        )
        edge_ends, node_ends = np.cumsum(counts.tolist(), axis=1).tolist()
        rows = tuple(node_ends[: depth + 1])
        order = torch.argsort(hops, stable=True)[: rows[-1]]
        place = torch.full_like(hops, -1).index_copy_(
            0, order, torch.arange(rows[-1], device=hops.device)
        )
        self._hops = (rows, order, place)
        ends = edge_ends[:depth]
        if ends[0] == centre.shape[0]:
            return ends, None
        return ends, torch.argsort(edge_hops, stable=True)[: ends[-1]]

    def needed(self) -> Capacities:
        """Sizes a padded graph needs until the next rebuild (one spare owned node)."""
        return Capacities(self.n_owned + 1, self.n_nodes - self.n_owned, self.centre.shape[0])

    def node_edges(self) -> np.ndarray:
        """``(n_nodes,)``: the edges listed at each node, the load balance's weights
        (:mod:`ase_shard.balance`) once the ghosts' are added to their owners'.
        Those centred on an owned node and, where each pair is listed once (on
        one of the ranks of its two atoms), those ending at any node: that pair
        is as much the work of its neighbour as of its centre."""
        counts = torch.bincount(self.centre, minlength=self.n_nodes)
        counts[self.n_owned :] = 0  # a ghost centres edges only for its own features
        if self._listed_once:
            counts += torch.bincount(self.neighbour, minlength=self.n_nodes)
        return counts.cpu().numpy()

    def listed_work(self) -> int:
        """The edges this block lists, a pair listed once counting twice (at both its
        atoms, as :meth:`node_edges` counts it): its rank's load."""
        return int(self.centre.shape[0]) * (2 if self._listed_once else 1)

    def pad(self, capacity: Capacities) -> None:
        """Give the compiled model graphs of these sizes from now on."""
        self.capacity = capacity

    def _offsets(self, cell: np.ndarray) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Cartesian offsets (Å) of the shifted nodes' (``shifted_nodes``) and the
        shifted edges' images (the latter ``None`` where the kernels read each edge's
        image, ``_images``)."""
        # they change only with the cell (barostats); compared on the host, where
        # a comparison costs no wait for a device
        if self._shift_cell is None or not np.array_equal(self._shift_cell, cell):
            self._shift_cell = np.array(cell, dtype=np.float64)
            on_device = torch.as_tensor(self._shift_cell, device=self.device)
            edges = None if self.edge_shift is None else self.edge_shift @ on_device
            # one product over all nodes, zeros for the unshifted, as when every node's
            # offset was held: the same numbers to the last bit whichever kernel the
            # product's shape picks (only once per cell)
            every = torch.zeros((self.n_nodes, 3), dtype=torch.float64, device=self.device)
            every[self.shifted_nodes] = self.node_shift
            self._shifts = ((every @ on_device)[self.shifted_nodes], edges)
            self._device_cell = on_device
        return self._shifts

    def _positions(self, rows: torch.Tensor, cell: np.ndarray) -> torch.Tensor:
        """The nodes' positions (Å): their atoms' ``rows`` (left as they are), the
        shifted nodes' moved to their images."""
        return rows.index_add(0, self.shifted_nodes, self._offsets(cell)[0])

    def _kept_edges(self, keep: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Indices of the edges with ``keep`` set, and how many of them end each hop level.

        The step's one wait for an accelerator: how many edges are within the
        cutoff (per level, in the same copy). The listed order is kept, so the
        kept edges stay sorted by hop count.
        """
        if not keep.shape[0]:
            return keep.new_zeros(0, dtype=torch.int64), [0] * len(self._level_ends)
        if keep.device.type == "cpu":
            return kept_edges_on_host(keep, self._level_ends)
        return kept_edges_on_device(keep, self._level_last)

    def evaluate(
        self,
        node_rows: np.ndarray,
        cell: np.ndarray,
        dtype,
        inputs: dict[str, np.ndarray] | None = None,
        system: dict[str, list] | None = None,
        per_node_virials: bool = True,
    ) -> torch.Tensor:
        """Per-node energy, force and virial contributions.

        Parameters
        ----------
        node_rows : (n_nodes, 3) array
            Positions (Å) of the nodes' atoms (``positions[ids[:n_nodes]]``).
        cell : (3, 3) array
        dtype : torch.dtype
            The model's precision.
        inputs : dict of str to (n_nodes, ...) arrays, optional
            The model's per-atom inputs for the nodes.
        system : dict of str to values, optional
            The model's per-system inputs.
        per_node_virials : bool
            ``False``: only the virial columns' sum is used (no per-atom
            stresses asked for), which a model with its own kernel may take
            as licence to skip the per-node split (:class:`~ase_shard.graph.EdgeList`).

        Returns
        -------
        numpy.ndarray
            ``(RESULT_COLUMNS, n_nodes)`` float64 on the host, one row per
            quantity (each contiguous): per-atom energy in eV, force in
            eV/Å (3 rows), and the virial ``sum d ⊗ dE/dd`` in eV (Voigt order
            xx, yy, zz, yz, xz, xy) with each edge's share split evenly
            between its two atoms. Ghost nodes' columns hold contributions
            that belong to their owners. The storage is reused by the next
            call (on CPU it is the block's own buffer).

        Notes
        -----
        A model that predicts its forces (:class:`ase_shard.graph.PredictedForces`)
        gives its owned atoms' columns itself, without autograd; its ghosts'
        columns are zero.

        A model with ``energy_forces`` (:class:`ase_shard.graph.DirectForces`,
        the built-in potentials and D3) computes the columns itself on a CPU in
        float64 without ``torch.compile`` (one layer without the per-layer
        halo, or two stages with it), from the edges listed at the last
        rebuild: no edge vectors, cutoff filtering or autograd here.
        """
        if self._direct is not None:
            return self._evaluate_direct(node_rows, cell, per_node_virials)
        timer = self.timer
        with timer.phase("forward"):
            # copies from the host first: before any kernel is queued they wait for nothing
            rows = torch.as_tensor(node_rows, dtype=torch.float64, device=self.device)
            inputs, system = self._upload(inputs), self._upload(system)
            positions = self._positions(rows, cell)
            vectors64 = self._edge_vectors(positions, cell)
            squared = (vectors64 * vectors64).sum(dim=1)
            within, kept = self._kept_edges(squared < float(self.model.cutoff) ** 2)
            # read on the host with the result (see below), not by a sync of its own
            closest = squared.min() if squared.shape[0] else squared.new_full((), np.inf)
            i, j = self.centre.index_select(0, within), self.neighbour.index_select(0, within)
            d = vectors64.index_select(0, within)
            del vectors64, within, squared
            # edges are formed in float64, then cast, so float32 models do not
            # lose precision to large absolute coordinates
            vectors = d.detach().to(dtype).requires_grad_(not self._predicts)
            wrt = [vectors]
            exchange = None
            if self.exchange is not None:
                # a Sum's terms share the exchange, each with its own rows (padded or not)
                padded = self.capacity
                if padded is None:
                    self.exchange.pad(self.n_owned, self.n_nodes - self.n_owned)
                else:
                    self.exchange.pad(padded.owned, padded.ghosts)
                wrt.append(self.exchange.new_evaluation(dtype))
                exchange = self.exchange
            graph = LocalGraph(
                self.numbers,
                torch.stack([i, j]),
                vectors,
                self.n_owned,
                exchange,
                {name: value.to(dtype) for name, value in inputs.items()},
                {name: value.to(dtype) for name, value in system.items()},
                None if self._hops is None else Hops(tuple(kept), *self._hops),
                self.system_sum,
                cell=self._device_cell.to(dtype),  # cached with the offsets above
                system_fft=self.system_fft,
            )
            strain = None
            if self._uses_positions:
                # one strain of positions and cell together: dE/dstrain is the virial
                at = positions.detach().requires_grad_()
                strain = torch.zeros_like(self._device_cell).requires_grad_()
                graph.positions = (at + at @ strain).to(dtype)
                graph.cell = (self._device_cell + self._device_cell @ strain).to(dtype)
                wrt += [at, strain]
            predicted = None
            if self._predicts:
                graph.positions = positions.to(dtype)
                with torch.no_grad():
                    predicted = self.model(graph)
                if not isinstance(predicted, PredictedForces):
                    raise TypeError(
                        f"{type(self.model).__name__} declares predicts_forces but returned "
                        f"{type(predicted).__name__}, not ase_shard.graph.PredictedForces"
                    )
                predicted.check(self.n_owned, type(self.model).__name__)
            elif self.capacity is None:
                owned_energy = self.model(graph)[: self.n_owned]
            else:
                padded = pad_graph(graph, self.capacity, self.fill_number, self.model.cutoff)
                owned_energy = self.compiled(padded)[: self.n_owned]

        with timer.phase("backward"):
            if predicted is None:
                grads = [None] * len(wrt)
                # with an exchange every rank must run backward (it is collective)
                needed = exchange is not None or vectors.shape[0] or strain is not None
                if owned_energy.requires_grad and needed:
                    grads = torch.autograd.grad(owned_energy.sum(), wrt, allow_unused=True)
                grad = torch.zeros_like(d) if grads[0] is None else grads[0].to(torch.float64)

        with timer.phase("reverse"):
            # reused: fresh pages for it cost more than zeroing it; two extra
            # entries carry the checks to the host in the same copy
            size = RESULT_COLUMNS * self.n_nodes
            if self._result is None:
                self._result = d.new_zeros(size + 2)
            result = self._result.zero_()[:size].view(RESULT_COLUMNS, self.n_nodes)
            if predicted is None:
                sum_edge_gradients(i, j, d, grad, self.n_nodes, out=result[1:])
                result[0, : self.n_owned] = owned_energy.detach().to(torch.float64)
                if strain is not None:
                    add_position_gradients(result, *grads[-2:])
            else:
                # the owned atoms' own results; the ghosts' columns stay zero
                owned = result[:, : self.n_owned]
                owned[0] = predicted.energies.to(torch.float64)
                owned[1:4] = predicted.forces.to(torch.float64).t()
                owned[4:] = predicted.virials.to(torch.float64).t()
            # NaN and inf reach the sum: one small reduction in the common case
            self._result[size] = result.sum()
            self._result[size + 1] = closest
            host = self._result.cpu()  # the step's one copy to the host (none on CPU)
            total, closest = host[size:].tolist()
            columns = host[:size].view(RESULT_COLUMNS, self.n_nodes).numpy()
            self._check(columns, total, closest, positions, cell)
        return columns

    def _evaluate_direct(
        self, node_rows: np.ndarray, cell: np.ndarray, per_node_virials: bool
    ) -> np.ndarray:
        """:meth:`evaluate` by the model's own compiled kernel (:class:`DirectForces`)."""
        with self.timer.phase("forward"):
            rows = torch.as_tensor(node_rows, dtype=torch.float64)
            positions = self._positions(rows, cell).numpy()
            image, shifts = self._images
            columns = self._direct_columns(per_node_virials)
            edges = EdgeList(
                positions,
                self.numbers.numpy(),
                self.centre.numpy(),
                self.neighbour.numpy(),
                image,
                shifts @ cell,
                self.n_owned,
                float(self.model.cutoff),
                self._halo,
                per_node_virials,
                self.ids,
                self._plain,
                self._scratch,
            )
            closest = self._direct.energy_forces(edges, columns)
        with self.timer.phase("reverse"):
            if self.virial_in_node_0:  # the other virial columns are zero
                total = columns[: VIRIAL_ROWS.start].sum() + columns[VIRIAL_ROWS, :1].sum()
            else:
                total = columns.sum()
            self._check(columns, total, closest, torch.from_numpy(positions), cell)
        return columns

    def _direct_columns(self, per_node_virials: bool) -> np.ndarray:
        """The direct path's result columns, zeroed where its model adds
        (:class:`~ase_shard.graph.DirectForces`).

        Without virials per node, the energy and force rows and node 0's virial
        column only: the model adds its virial's sum there and leaves the other
        virial columns, zero since the last call that zeroed them. Zeroing the six
        rows, summing them for the finite check and again for the totals took a
        twentieth of a Lennard-Jones MD step (32,000 and 256,000 Ar atoms).
        """
        if self._columns is None:
            self._columns = np.zeros((RESULT_COLUMNS, self.n_nodes))
        elif per_node_virials or not self.virial_in_node_0:  # virials per node last time
            self._columns.fill(0.0)
        else:
            self._columns[: VIRIAL_ROWS.start].fill(0.0)
            self._columns[VIRIAL_ROWS, :1] = 0.0
        self.virial_in_node_0 = not per_node_virials
        return self._columns

    def _check(
        self,
        columns: np.ndarray,
        total: float,
        closest: float,
        positions: torch.Tensor,
        cell: np.ndarray,
    ) -> None:
        """Raise for atoms closer than ``min_distance`` or non-finite results.

        ``total`` is the sum of ``columns`` and ``closest`` the shortest listed
        edge's squared length (Å²): one comparison each in the common case.
        """
        if closest < self.min_distance**2:
            self._check_distances(positions, cell)
        if np.isfinite(total):
            return
        atoms = np.unique(self.ids[~np.isfinite(columns).all(axis=0)])
        if len(atoms):
            shown = ", ".join(map(str, atoms[:10])) + (" ..." if len(atoms) > 10 else "")
            raise FloatingPointError(
                f"non-finite energy or forces from the model for atoms [{shown}] "
                f"({len(atoms)} atoms)"
            )

    def _edge_vectors(self, positions: torch.Tensor, cell: np.ndarray) -> torch.Tensor:
        """``(E, 3)`` float64 vectors (Å) of the listed edges, centre to neighbour."""
        # formed in place: the (E, 3) temporaries are the largest of a step
        vectors = positions.index_select(0, self.neighbour)
        vectors -= positions.index_select(0, self.centre)
        vectors.index_add_(0, *self._edge_offsets(cell))
        return vectors

    def image_edges(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The edges whose neighbour sits at another image of its node than the node's
        row, and the shift between the two in cells: ``(S,)`` int64, ``(S, 3)`` float64
        (an edge's vector is ``r_neighbour - r_centre`` plus its shift ``@ cell``)."""
        if self._images is None:
            return self.shifted_edges, self.edge_shift
        # formed again from the kernels' table (for the rare distance check)
        image, table = self._images
        shifted = np.flatnonzero(image)
        return torch.from_numpy(shifted), torch.from_numpy(table[image[shifted]])

    def _edge_offsets(self, cell: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`image_edges` with the shifts as offsets in Å (cached on torch's path)."""
        if self._images is None:
            return self.shifted_edges, self._offsets(cell)[1]
        shifted, shift = self.image_edges()
        return shifted, shift @ torch.as_tensor(cell, dtype=torch.float64)

    def _check_distances(self, positions: torch.Tensor, cell: np.ndarray) -> None:
        """Raise ``ValueError`` naming the closest pair closer than ``min_distance``.

        The message says whether the pair is coincident (closer than
        :data:`COINCIDENT_DISTANCE`, always refused) or closer than a
        ``min_distance`` the caller asked for.
        """
        distance = torch.linalg.vector_norm(self._edge_vectors(positions, cell), dim=1)
        close = (distance < self.min_distance).nonzero().squeeze(1)
        if not len(close):
            return
        ends = self.ids[torch.stack([self.centre[close], self.neighbour[close]]).cpu().numpy()]
        pairs = np.unique(np.sort(ends, axis=0), axis=1)
        first = distance[close].argmin().item()
        a, b = sorted(ends[:, first].tolist())
        who = f"atom {a} and its periodic image" if a == b else f"atoms {a} and {b}"
        closest = distance[close[first]].item()
        how_many = f"({pairs.shape[1]} pair(s) that close)"
        if self.min_distance <= COINCIDENT_DISTANCE:
            raise ValueError(
                f"{who} are {closest:.2g} Å apart: coincident atoms (closer than "
                f"{COINCIDENT_DISTANCE:g} Å) {how_many}, e.g. an atom added twice; no "
                "potential is defined there"
            )
        raise ValueError(
            f"{who} are {closest:.4f} Å apart, closer than min_distance="
            f"{self.min_distance:g} Å {how_many}: "
            "overlapping atoms, or a run that blew up; pass min_distance=0 to "
            "ShardedCalculator to allow it"
        )

    def _upload(self, values: dict | None) -> dict[str, torch.Tensor]:
        """Model inputs on the device, in float64 (cast once all copies are done)."""
        return {
            name: torch.as_tensor(value, dtype=torch.float64, device=self.device)
            for name, value in (values or {}).items()
        }


class SumBlock:
    """The blocks of a :class:`~ase_shard.models.Sum`'s terms over one rank's nodes.

    Each term has its own :class:`LocalBlock`: its edges listed at its own cutoff
    (plus the skin), its own path (a built-in potential's kernel, autograd, the
    per-layer exchange for a term of several layers). The result columns of the
    terms add up: energies, forces and virials are sums over the terms.

    Parameters
    ----------
    blocks : sequence of LocalBlock
        One per term, built over the same rows.
    """

    def __init__(self, blocks: list[LocalBlock]):
        self.blocks = list(blocks)
        self._columns: np.ndarray | None = None

    @property
    def virial_in_node_0(self) -> bool:
        """The summed virial rows are zero but in node 0's column (every term's are)."""
        return all(block.virial_in_node_0 for block in self.blocks)

    def evaluate(
        self,
        node_rows: np.ndarray,
        cell: np.ndarray,
        dtype,
        inputs: dict[str, np.ndarray] | None = None,
        system: dict[str, list] | None = None,
        per_node_virials: bool = True,
    ) -> np.ndarray:
        """The terms' :meth:`LocalBlock.evaluate` columns, added up (same layout)."""
        for k, block in enumerate(self.blocks):
            columns = block.evaluate(node_rows, cell, dtype, inputs, system, per_node_virials)
            if k == 0:
                # each block reuses its storage at its next call: the sum keeps its own
                if self._columns is None or self._columns.shape != columns.shape:
                    self._columns = np.empty_like(columns)
                np.copyto(self._columns, columns)
            else:
                self._columns += columns
        return self._columns
