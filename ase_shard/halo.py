"""Ghost selection: which atom images each rank needs (pure numpy, no MPI).

A rank's *domain* is the frame-coordinate bounding box of the atoms it owns.
An image within Cartesian distance ``h`` of an owned atom lies within
``h / spacing_i`` of that box along every axis ``i``, so the widened box is a
safe superset of the halo for spatial and contiguous partitions alike.

Rows are atom images; *nodes* are what the model evaluates. A periodic image
of an atom the rank owns is not a node of its own: it folds onto the owned
node, and edges to it carry the image shift (as in a one-rank periodic graph).
With per-layer halo exchange, all images of a foreign atom also fold onto one
ghost node, whose features its owner sends after every layer.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from ase_shard.partition import FrameCoordinates


@dataclass
class RankRows:
    """The local rows of one rank: owned atoms, ghost nodes, folded images.

    Attributes
    ----------
    ids : (n,) int64
        Global atom index of every row.
    image_shift : (n, 3) int64
        Cell images: row position is ``positions[ids] + image_shift @ cell``.
    n_owned : int
        Rows ``[0, n_owned)`` are owned.
    node : (n,) int64
        Node of every row. Rows ``[0, n_nodes)`` are the nodes themselves
        (``node[k] == k``); later rows are images folded onto a node, at
        ``image_shift[row] - image_shift[node[row]]`` cells from it.
    n_nodes : int
        Owned nodes, then ghost nodes grouped by owner rank.
    send_index : (m,) int64
        Owned nodes whose features other ranks need, grouped by receiving rank.
    send_counts, recv_counts : (P,) int64
        Node features sent to / received from each rank per exchange; the
        received ones are the ghost nodes in order.
    """

    ids: np.ndarray
    image_shift: np.ndarray
    n_owned: int
    node: np.ndarray
    n_nodes: int
    send_index: np.ndarray
    send_counts: np.ndarray
    recv_counts: np.ndarray


def image_range(width: np.ndarray, pbc: np.ndarray) -> list[range]:
    """Cell images to try on each axis for a fractional halo ``width``."""
    reach = np.ceil(width).astype(int)
    return [
        range(-r, r + 1) if periodic else range(1) for r, periodic in zip(reach, pbc, strict=True)
    ]


def rank_rows(
    coords: FrameCoordinates,
    pbc: np.ndarray,
    owners: np.ndarray,
    n_ranks: int,
    halo_width: float,
    fold_foreign: bool = False,
) -> list[RankRows]:
    """Owned rows, ghost rows and the feature-exchange plan of every rank.

    Parameters
    ----------
    coords : FrameCoordinates
        Atoms in the frame (periodic axes wrapped).
    pbc : (3,) bool
    owners : (N,) int
        Owner rank of each atom.
    n_ranks : int
    halo_width : float
        Cartesian halo width in Å (receptive field + skin).
    fold_foreign : bool
        Fold all images of a foreign atom onto one ghost node (per-layer
        exchange); otherwise every foreign image is a node of its own.

    Returns
    -------
    list of RankRows, one per rank.
    """
    s = coords.s
    width = np.where(pbc, halo_width / coords.spacing, halo_width)
    owned = [np.flatnonzero(owners == rank) for rank in range(n_ranks)]
    lo = np.array([s[ids].min(axis=0) if len(ids) else np.full(3, np.inf) for ids in owned])
    hi = np.array([s[ids].max(axis=0) if len(ids) else np.full(3, -np.inf) for ids in owned])
    lo, hi = lo - width, hi + width
    reach_lo, reach_hi = lo.min(axis=0), hi.max(axis=0)

    ghost_ids: list[list[np.ndarray]] = [[] for _ in range(n_ranks)]
    ghost_shift: list[list[np.ndarray]] = [[] for _ in range(n_ranks)]
    for image in itertools.product(*image_range(width, pbc)):
        shifted = s + np.array(image)
        # atoms whose image can reach any domain at all
        near = np.flatnonzero(np.all((shifted >= reach_lo) & (shifted <= reach_hi), axis=1))
        if len(near) == 0:
            continue
        candidate = shifted[near]
        for rank in range(n_ranks):
            inside = np.all((candidate >= lo[rank]) & (candidate <= hi[rank]), axis=1)
            if not any(image):
                inside &= owners[near] != rank
            ids = near[inside]
            ghost_ids[rank].append(ids)
            ghost_shift[rank].append(np.broadcast_to(np.array(image), (len(ids), 3)))

    position = np.empty(len(owners), dtype=np.int64)  # place among its owner's nodes
    for ids in owned:
        position[ids] = np.arange(len(ids))
    local = []
    for rank in range(n_ranks):
        ids = np.concatenate([owned[rank], *ghost_ids[rank]]).astype(np.int64)
        image_shift = np.concatenate(
            [np.zeros((len(owned[rank]), 3), dtype=np.int64), *ghost_shift[rank]]
        ).astype(np.int64)
        image_shift += coords.wrap_shift[ids]
        n_owned = len(owned[rank])
        local.append(_fold(rank, ids, image_shift, n_owned, owners, position, fold_foreign))
    return _with_exchange_plan(local, owners, position)


def _fold(
    rank: int,
    ids: np.ndarray,
    image_shift: np.ndarray,
    n_owned: int,
    owners: np.ndarray,
    position: np.ndarray,
    fold_foreign: bool,
) -> RankRows:
    """Reorder one rank's rows as owned, ghost nodes, folded images (no plan yet)."""
    ghost = np.arange(n_owned, len(ids))
    foreign = ghost[owners[ids[ghost]] != rank]
    if fold_foreign:
        _, first = np.unique(ids[foreign], return_index=True)
        foreign = foreign[first]
    # ghost nodes grouped by owner rank, so one exchange receives them in order
    foreign = foreign[np.lexsort((ids[foreign], owners[ids[foreign]]))]
    n_nodes = n_owned + len(foreign)
    is_node = np.zeros(len(ids), dtype=bool)
    is_node[:n_owned] = True
    is_node[foreign] = True
    order = np.concatenate([np.arange(n_owned), foreign, np.flatnonzero(~is_node)])
    ids, image_shift = ids[order], image_shift[order]

    node = np.arange(len(ids), dtype=np.int64)
    folded = ids[n_nodes:]
    mine = owners[folded] == rank
    node[n_nodes:][mine] = position[folded[mine]]
    ghost_ids = ids[n_owned:n_nodes]
    by_id = np.argsort(ghost_ids)
    node[n_nodes:][~mine] = n_owned + by_id[np.searchsorted(ghost_ids[by_id], folded[~mine])]
    empty = np.zeros(0, dtype=np.int64)
    return RankRows(ids, image_shift, n_owned, node, n_nodes, empty, empty, empty)


def _with_exchange_plan(
    local: list[RankRows], owners: np.ndarray, position: np.ndarray
) -> list[RankRows]:
    """Fill in who sends which owned node to whom for a feature exchange."""
    n_ranks = len(local)
    counts = np.zeros((n_ranks, n_ranks), dtype=np.int64)  # counts[sender, receiver]
    sends: list[list[np.ndarray]] = [[] for _ in range(n_ranks)]
    for receiver, rows in enumerate(local):
        ghost_ids = rows.ids[rows.n_owned : rows.n_nodes]
        ghost_owner = owners[ghost_ids]
        counts[:, receiver] = np.bincount(ghost_owner, minlength=n_ranks)
        for sender, part in enumerate(np.split(ghost_ids, np.cumsum(counts[:-1, receiver]))):
            sends[sender].append(position[part])
    for rank, rows in enumerate(local):
        rows.send_index = np.concatenate(sends[rank]).astype(np.int64)
        rows.send_counts = counts[rank].copy()
        rows.recv_counts = counts[:, rank].copy()
    return local
