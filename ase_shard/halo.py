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

from ase_shard.partition import FrameCoordinates, grouped_order


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
    recv_counts : (P,) int64
        Ghost nodes owned by each rank: node features received from each rank
        per exchange, in ghost-node order.
    requests : (n_nodes - n_owned,) int64
        Place of each ghost node among its owner's owned nodes: what this rank
        asks each owner to send, grouped by owner.
    send_index : (m,) int64
        Owned nodes whose features other ranks need, grouped by receiving rank
        (the other ranks' requests; filled in by :func:`exchange_plans` or by
        an all-to-all of the requests).
    send_counts : (P,) int64
        Node features sent to each rank per exchange.
    """

    ids: np.ndarray
    image_shift: np.ndarray
    n_owned: int
    node: np.ndarray
    n_nodes: int
    recv_counts: np.ndarray
    requests: np.ndarray
    send_index: np.ndarray | None = None
    send_counts: np.ndarray | None = None


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

    The work is ``O(N)`` plus the rows returned for spatially compact
    domains: candidate images are binned once into a grid of cells about a
    halo width wide, and each rank tests only the atoms in the cells its
    widened box overlaps.

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
    # One row per axis (a free view of the column-major frame coordinates):
    # per-axis tests then read contiguous memory.
    s = np.ascontiguousarray(coords.s.T)
    width = np.where(pbc, halo_width / coords.spacing, halo_width)
    by_owner, counts = _by_owner(owners, n_ranks)
    owned = np.split(by_owner, np.cumsum(counts)[:-1])
    lo, hi = _owned_boxes(s, by_owner, counts)
    lo, hi = lo - width, hi + width
    reach_lo, reach_hi = lo.min(axis=0), hi.max(axis=0)

    images, cand_ids, cand_image = _near_images(s, width, pbc, reach_lo, reach_hi)
    cand_s = np.take(s, cand_ids, axis=1) + np.take(images, cand_image, axis=0).T
    cells = _CellGrid(cand_s, reach_lo, reach_hi, width)
    del cand_s  # the grid keeps its own copy in cell order

    position = _places(by_owner, counts)
    local = []
    for rank in range(n_ranks):
        # Candidates come back ascending, so ghost rows keep the order of the
        # image search (by image, then atom), whatever the grid. An empty
        # rank's box is inverted (lo = inf): it needs no ghosts.
        found = cells.query(lo[rank], hi[rank]) if len(owned[rank]) else np.zeros(0, np.int64)
        local.append(
            _rows_of(
                rank,
                n_ranks,
                owned[rank],
                (cand_ids[found], cand_image[found], images),
                coords.wrap_shift,
                owners,
                position,
                fold_foreign,
            )
        )
    return exchange_plans(local)


def local_rows(
    coords: FrameCoordinates,
    pbc: np.ndarray,
    owners: np.ndarray,
    rank: int,
    n_ranks: int,
    halo_width: float,
    fold_foreign: bool = False,
) -> RankRows:
    """The rows of ``rank`` alone: its owned atoms and its own ghosts.

    What one rank computes for itself when every rank holds every atom: the
    same rows :func:`rank_rows` gives that rank, without looking at the other
    ranks' halos (``O(N)``: one box test of every atom image near the rank's
    widened box). The send side of the exchange plan is left empty; it is the
    other ranks' ``requests``.

    Parameters are those of :func:`rank_rows`, plus ``rank``.
    """
    s = np.ascontiguousarray(coords.s.T)
    width = np.where(pbc, halo_width / coords.spacing, halo_width)
    owned = np.flatnonzero(owners == rank)
    if len(owned):
        mine = np.take(s, owned, axis=1)
        images, found_ids, found_image = _near_images(
            s, width, pbc, mine.min(axis=1) - width, mine.max(axis=1) + width
        )
    else:
        images = np.zeros((1, 3), dtype=np.int64)
        found_ids, found_image = np.zeros(0, np.int64), np.zeros(0, np.uint8)
    return _rows_of(
        rank,
        n_ranks,
        owned,
        (found_ids, found_image, images),
        coords.wrap_shift,
        owners,
        owned_places(owners, n_ranks),
        fold_foreign,
    )


def owned_places(owners: np.ndarray, n_ranks: int) -> np.ndarray:
    """Place of each atom among the atoms its owner owns (ascending ids).

    Owned nodes are laid out in this order on every rank, so ``(owner,
    place)`` names a node without any communication.
    """
    return _places(*_by_owner(owners, n_ranks))


def _rows_of(
    rank: int,
    n_ranks: int,
    owned: np.ndarray,
    found: tuple[np.ndarray, np.ndarray, np.ndarray],
    wrap_shift: np.ndarray,
    owners: np.ndarray,
    position: np.ndarray,
    fold_foreign: bool,
) -> RankRows:
    """One rank's rows from its owned atoms and the atom images in its widened box.

    ``found`` is ``(ids, image, images)``: the atom and the index into
    ``images`` (cell shifts) of every image found.
    """
    found_ids, found_image, images = found
    home = np.flatnonzero(~images.any(axis=1))[0]  # index of the zero shift
    n_owned = len(owned)
    # the home images of the rank's own atoms are its owned rows already
    ghost = (found_image != home) | (owners[found_ids] != rank)
    ids = np.concatenate([owned, found_ids[ghost]]).astype(np.int64)
    image_shift = np.concatenate(
        [np.zeros((n_owned, 3), dtype=np.int64), np.take(images, found_image[ghost], axis=0)]
    )
    image_shift += wrap_shift[ids]
    return fold_rows(
        rank, n_ranks, ids, image_shift, n_owned, owners[ids], position[ids], fold_foreign
    )


def _by_owner(owners: np.ndarray, n_ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """Atoms sorted by owner (ascending ids within an owner), and atoms per owner."""
    return grouped_order(owners, n_ranks), np.bincount(owners, minlength=n_ranks)


def _places(by_owner: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Place of each atom among its owner's atoms, from :func:`_by_owner`."""
    place = np.empty(len(by_owner), dtype=np.int64)
    place[by_owner] = np.arange(len(by_owner)) - np.repeat(np.cumsum(counts) - counts, counts)
    return place


def _owned_boxes(
    s: np.ndarray, by_owner: np.ndarray, counts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Bounding box of each rank's atoms.

    Parameters
    ----------
    s : (3, N) float
        Frame coordinates, one row per axis.
    by_owner, counts : from :func:`_by_owner`

    Returns
    -------
    lo, hi : (P, 3) float
        Box corners; ``inf`` and ``-inf`` for a rank that owns nothing.
    """
    starts = np.cumsum(counts) - counts
    lo = np.full((len(counts), 3), np.inf)
    hi = np.full((len(counts), 3), -np.inf)
    filled = np.flatnonzero(counts)
    if len(filled):
        s_by_owner = np.take(s, by_owner, axis=1)
        lo[filled] = np.minimum.reduceat(s_by_owner, starts[filled], axis=1).T
        hi[filled] = np.maximum.reduceat(s_by_owner, starts[filled], axis=1).T
    return lo, hi


def _near_images(
    s: np.ndarray, width: np.ndarray, pbc: np.ndarray, reach_lo: np.ndarray, reach_hi: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Atom images inside the box ``[reach_lo, reach_hi]`` (frame coordinates).

    Parameters
    ----------
    s : (3, N) float
        Frame coordinates, one row per axis.
    width : (3,) float
        Halo width in frame units.
    pbc : (3,) bool
    reach_lo, reach_hi : (3,) float

    Returns
    -------
    images : (K, 3) int64
        Cell shifts tried, in ``itertools.product`` order.
    ids : (M,) int64
        Atom of each image found; ordered by image, then by atom.
    image : (M,) unsigned int
        Index into ``images`` of each image found.
    """
    shifts = image_range(width, pbc)
    # The box test splits by axis: testing each axis and shift once leaves
    # two boolean ANDs per image instead of a pass over all coordinates.
    near_axis = [
        {k: (s[axis] + k >= reach_lo[axis]) & (s[axis] + k <= reach_hi[axis]) for k in ks}
        for axis, ks in enumerate(shifts)
    ]
    images = list(itertools.product(*shifts))
    ids = [
        np.flatnonzero(near_axis[0][kx] & near_axis[1][ky] & near_axis[2][kz])
        for kx, ky, kz in images
    ]
    image_index = np.arange(len(images), dtype=np.min_scalar_type(len(images)))
    image_index = np.repeat(image_index, [len(i) for i in ids])
    return np.array(images, dtype=np.int64), np.concatenate(ids), image_index


class _CellGrid:
    """Points binned into a uniform grid of cells, for box queries.

    Cells are about ``width`` wide per axis, wider where that would make more
    cells than points or than ``MAX_CELLS``, so binning is ``O(M)`` and a
    query reads the points inside its box plus about one cell's layer around
    them.

    Parameters
    ----------
    points : (3, M) float
        One row per axis.
    lo, hi : (3,) float
        Box that holds every point and every query box.
    width : (3,) float
        Preferred cell width per axis.
    """

    # 16-bit cell keys make numpy's stable argsort an O(M) radix sort
    MAX_CELLS = 2**16

    def __init__(
        self, points: np.ndarray, lo: np.ndarray, hi: np.ndarray, width: np.ndarray
    ) -> None:
        extent = hi - lo if points.shape[1] else np.zeros(3)
        self.n = _cell_counts(extent, width, min(points.shape[1], self.MAX_CELLS))
        self.origin = lo[:, None]
        self.scale = np.divide(self.n, extent, out=np.zeros(3), where=extent > 0)[:, None]
        cell = np.ravel_multi_index(self._cell_of(points), self.n)
        self.order = np.argsort(cell.astype(np.uint16), kind="stable")
        # stored in cell order, so a query reads contiguous runs
        self.points = np.take(points, self.order, axis=1)
        self.offsets = np.zeros(np.prod(self.n) + 1, dtype=np.int64)
        np.cumsum(np.bincount(cell, minlength=np.prod(self.n)), out=self.offsets[1:])

    def _cell_of(self, points: np.ndarray) -> np.ndarray:
        # floor((x - origin) * scale) is monotone in x, so every point inside
        # a query box falls in a cell between the cells of the box's corners
        index = points - self.origin
        index *= self.scale
        np.floor(index, out=index)
        np.clip(index, 0, self.n[:, None] - 1, out=index)
        return index.astype(np.int64)

    def query(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Indices of the points inside the box ``[lo, hi]``, ascending."""
        first, last = self._cell_of(np.stack([lo, hi], axis=1)).T
        columns = np.arange(first[0], last[0] + 1)[:, None] * self.n[1]
        columns = (columns + np.arange(first[1], last[1] + 1)).ravel() * self.n[2]
        # along the last axis the cells of a column, and their points, are contiguous
        starts = self.offsets[columns + first[2]]
        lengths = self.offsets[columns + last[2] + 1] - starts
        ends = np.cumsum(lengths)
        steps = np.arange(ends[-1]) + np.repeat(starts - (ends - lengths), lengths)
        points = np.take(self.points, steps, axis=1)
        inside = np.ones(len(steps), dtype=bool)
        for axis in range(3):
            inside &= (points[axis] >= lo[axis]) & (points[axis] <= hi[axis])
        return np.sort(self.order[steps[inside]])


def _cell_counts(extent: np.ndarray, width: np.ndarray, limit: int) -> np.ndarray:
    """Cells per axis: about ``width`` wide, at most ``max(limit, 1)`` in all."""
    n = np.divide(extent, width, out=np.ones(3), where=width > 0)
    n = np.maximum(np.floor(n), 1.0)
    # Shrink the axes that still have several cells by a common factor;
    # axes that hit one cell leave room to the others, so repeat (at most 3x).
    while np.prod(n) > max(limit, 1):
        split = n > 1
        factor = (np.prod(n) / max(limit, 1)) ** (1 / split.sum())
        n = np.where(split, np.maximum(np.floor(n / factor), 1.0), n)
    return n.astype(np.int64)


def fold_rows(
    rank: int,
    n_ranks: int,
    ids: np.ndarray,
    image_shift: np.ndarray,
    n_owned: int,
    row_owner: np.ndarray,
    row_place: np.ndarray,
    fold_foreign: bool,
) -> RankRows:
    """Order one rank's rows as owned, ghost nodes, folded images; note the requests.

    Parameters
    ----------
    rank, n_ranks : int
    ids : (n,) int array
        Global atom of every row; the first ``n_owned`` are the owned atoms.
    image_shift : (n, 3) int array
    n_owned : int
    row_owner, row_place : (n,) int arrays
        Owner rank of every row's atom, and the atom's place among its
        owner's owned atoms.
    fold_foreign : bool
        See :func:`rank_rows`.
    """
    ghost = np.arange(n_owned, len(ids))
    foreign = ghost[row_owner[ghost] != rank]
    if fold_foreign:
        _, first = np.unique(ids[foreign], return_index=True)
        foreign = foreign[first]
    # ghost nodes grouped by owner rank, so one exchange receives them in order
    foreign = foreign[np.lexsort((ids[foreign], row_owner[foreign]))]
    n_nodes = n_owned + len(foreign)
    is_node = np.zeros(len(ids), dtype=bool)
    is_node[:n_owned] = True
    is_node[foreign] = True
    order = np.concatenate([np.arange(n_owned), foreign, np.flatnonzero(~is_node)])
    ids, image_shift = ids[order], image_shift[order]
    row_owner, row_place = row_owner[order], row_place[order]

    node = np.arange(len(ids), dtype=np.int64)
    folded = ids[n_nodes:]
    mine = row_owner[n_nodes:] == rank
    node[n_nodes:][mine] = row_place[n_nodes:][mine]
    ghost_ids = ids[n_owned:n_nodes]
    by_id = np.argsort(ghost_ids)
    node[n_nodes:][~mine] = n_owned + by_id[np.searchsorted(ghost_ids[by_id], folded[~mine])]
    recv_counts = np.bincount(row_owner[n_owned:n_nodes], minlength=n_ranks)
    return RankRows(
        ids, image_shift, n_owned, node, n_nodes, recv_counts, row_place[n_owned:n_nodes]
    )


def images_near_domains(
    coords: FrameCoordinates,
    pbc: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    rank: int,
    halo_width: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The images of this rank's atoms that other ranks need as ghosts (distributed atoms).

    The send side of :func:`local_rows` when each rank holds only its own
    atoms: every image of an own atom inside another rank's widened domain,
    and the periodic images of own atoms inside this rank's own.

    Parameters
    ----------
    coords : FrameCoordinates
        This rank's atoms in the frame.
    pbc : (3,) bool
    lo, hi : (P, 3) float
        Every rank's domain (the frame box of its atoms; ``inf``/``-inf``
        for a rank that owns nothing).
    rank : int
    halo_width : float
        Å.

    Returns
    -------
    dest : (m,) int64
        Rank that needs each image, ascending.
    place : (m,) int64
        The image's atom among this rank's atoms.
    image_shift : (m, 3) int64
        Cells from the atom's position to the image (wrap included).
    """
    s = np.ascontiguousarray(coords.s.T)
    width = np.where(pbc, halo_width / coords.spacing, halo_width)
    dest, place, image_shift = [], [], []
    if s.shape[1]:
        own_lo, own_hi = s.min(axis=1), s.max(axis=1)
        reach = np.ceil(width) * pbc  # cells an image can be from the home cell
        for other in np.flatnonzero(np.isfinite(lo).all(axis=1)):
            far = (lo[other] - width > own_hi + reach) | (hi[other] + width < own_lo - reach)
            if far.any():
                continue
            images, ids, image = _near_images(s, width, pbc, lo[other] - width, hi[other] + width)
            if other == rank:  # own atoms in their home cell are owned rows, not ghosts
                keep = images[image].any(axis=1)
                ids, image = ids[keep], image[keep]
            dest.append(np.full(len(ids), other, dtype=np.int64))
            place.append(ids)
            image_shift.append(images[image] + coords.wrap_shift[ids])
    if not dest:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 3), np.int64)
    return np.concatenate(dest), np.concatenate(place), np.concatenate(image_shift)


def exchange_plans(local: list[RankRows]) -> list[RankRows]:
    """Fill in every rank's send side from all ranks' requests (worker mode).

    Rank ``r`` sends to each receiver the owned nodes that receiver requested
    from ``r``, in the receiver's ghost order.
    """
    requested = [np.split(r.requests, np.cumsum(r.recv_counts)[:-1]) for r in local]
    for sender, rows in enumerate(local):
        rows.send_counts = np.array([r.recv_counts[sender] for r in local], dtype=np.int64)
        rows.send_index = np.concatenate(
            [parts[sender] for parts in requested] or [np.zeros(0)]
        ).astype(np.int64)
    return local
