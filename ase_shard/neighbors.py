"""Neighbour pairs of a finite block of points (images already explicit).

Each rank's block (owned rows + ghosts) carries its periodic images as rows,
so the search is always non-periodic. CPU tensors go to a compiled cell list
(:mod:`ase_shard.cell_list`, numba) or ``vesin``; tensors on an accelerator use
a torch cell list so they never leave the device (``neighbor_list`` picks). The
torch cell list waits on the device 6 times a call, plus once for every chunk of
candidate pairs (at most 38 in all): 2 in :func:`close_gaps`, 4 to lay out its
work; it copies nothing to the device.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
import torch.nn.functional as F
import vesin

NEIGHBOR_LISTS = ("auto", "numba", "vesin", "torch")
# the pairs' types (neighbor_pairs's dtype) as the compiled cell list writes them
_NUMPY_INDEX = {torch.int32: np.int32, torch.int64: np.int64}


def neighbor_pairs(
    positions: torch.Tensor,
    cutoff: float,
    n_centres: int | None = None,
    neighbor_list: str = "auto",
    once_by: torch.Tensor | None = None,
    dtype: torch.dtype = torch.int64,
) -> torch.Tensor:
    """Full list of pairs closer than ``cutoff``, optionally centred on the first rows only.

    Parameters
    ----------
    positions : torch.Tensor
        ``(n, 3)`` positions in Å.
    cutoff : float
        Search radius in Å.
    n_centres : int, optional
        Only pairs centred on one of the first ``n_centres`` rows (a rank's owned
        rows): ``(i, j)`` is kept when ``i < n_centres``, whatever ``j``.
        Default: every row is a centre.
    neighbor_list : {"auto", "numba", "vesin", "torch"}
        The search: the compiled cell list or ``vesin`` (both on the host), the
        torch cell list (on the tensors' device), or ``auto``: numba for CPU
        tensors, torch elsewhere.
    once_by : torch.Tensor, optional
        ``(n,)`` int64, the node (atom) of each row, the first rows being the nodes
        themselves: only the pairs ``(i, j)`` with ``once_by[j] >= i`` are listed,
        one of the two directions of a pair between centres (a pair's other
        direction is never held: half the memory of a rebuild for a model that
        takes each pair once). The compiled cell list never writes the others;
        the other searches drop them after.
    dtype : torch.dtype
        Of the pairs: ``torch.int32`` (for fewer than ``2**31`` rows) halves the
        list, which the compiled cell list then writes as such.

    Returns
    -------
    torch.Tensor
        ``(2, E)`` of ``dtype`` on ``positions.device``: both ``(i, j)`` and ``(j, i)``
        for every pair with ``|r_j - r_i| < cutoff``, ``i != j``, less those
        whose centre ``i`` is not one of the centres (and, with ``once_by``, those
        it leaves out); in no particular order.

    Raises
    ------
    ValueError
        For another ``neighbor_list``, or ``n_centres`` outside ``[0, n]``.
    """
    if neighbor_list not in NEIGHBOR_LISTS:
        raise ValueError(f"neighbor_list must be one of {NEIGHBOR_LISTS}, not {neighbor_list!r}")
    n = positions.shape[0]
    n_centres = n if n_centres is None else int(n_centres)
    if not 0 <= n_centres <= n:
        raise ValueError(f"n_centres must lie in [0, {n}], not {n_centres}")
    if n < 2 or n_centres == 0:
        return torch.zeros((2, 0), dtype=dtype, device=positions.device)
    positions = positions.detach().to(torch.float64)
    if neighbor_list == "torch" or (neighbor_list == "auto" and positions.device.type != "cpu"):
        pairs = _cell_list_pairs(close_gaps(positions, cutoff), cutoff, n_centres)
        return (pairs if once_by is None else _once(pairs, once_by.to(pairs.device))).to(dtype)
    # numba loads its machinery (about 1 s) only in processes that search on the host
    from ase_shard.cell_list import cell_list_pairs, has_empty_slab

    points = positions.cpu().numpy()
    if has_empty_slab(points, 4.0 * cutoff):  # the test of close_gaps, compiled
        points = _narrow_gaps(torch.from_numpy(points), cutoff).numpy()
    if neighbor_list == "vesin":
        pairs = torch.from_numpy(_vesin_pairs(points, cutoff, n_centres))
        pairs = pairs if once_by is None else _once(pairs, once_by.cpu())
        return pairs.to(positions.device, dtype)
    nodes = None if once_by is None else once_by.cpu().numpy()
    pairs = cell_list_pairs(points, cutoff, n_centres, nodes, _NUMPY_INDEX[dtype])
    return torch.from_numpy(pairs).to(positions.device)


def _once(pairs: torch.Tensor, once_by: torch.Tensor) -> torch.Tensor:
    """The pairs ``(i, j)`` with ``once_by[j] >= i`` (:func:`neighbor_pairs`)."""
    return pairs[:, once_by[pairs[1]] >= pairs[0]]


def close_gaps(positions: torch.Tensor, cutoff: float) -> torch.Tensor:
    """Positions with every empty slab wider than ``2 cutoff`` narrowed to ``2 cutoff``.

    No pair closer than ``cutoff`` spans such a slab, and none is created by
    narrowing it, so the pairs are unchanged; but the extent a cell list must
    cover stays below ``8 n cutoff`` even with an atom 1e9 Å away (which would
    otherwise overflow vesin's bin count or a GPU cell list's memory).
    """
    if not _may_have_gaps(positions, cutoff):
        return positions
    return _narrow_gaps(positions, cutoff)


def _narrow_gaps(positions: torch.Tensor, cutoff: float) -> torch.Tensor:
    """:func:`close_gaps` without the test for gaps."""
    order = torch.argsort(positions, dim=0)
    ordered = torch.gather(positions, 0, order)
    excess = (ordered.diff(dim=0) - 2.0 * cutoff).clamp(min=0.0)
    shift = torch.cat([torch.zeros_like(excess[:1]), excess.cumsum(dim=0)])
    return positions - torch.empty_like(shift).scatter_(0, order, shift)


def _may_have_gaps(positions: torch.Tensor, cutoff: float) -> bool:
    """Whether some axis may hold an empty slab wider than ``8 cutoff`` (``O(n)``).

    Slabs of width ``4 cutoff`` tile each axis; one of them is empty inside
    every gap wider than ``8 cutoff``. Narrower gaps may stay open: they add
    less than ``8 cutoff`` each to the extent, which stays ``O(n cutoff)``.
    Two host syncs: the widest axis, and the answer.
    """
    lo = positions.min(dim=0).values
    slabs = torch.floor((positions - lo) / (4.0 * cutoff)).to(torch.int64)
    n_slabs = slabs.max(dim=0).values + 1
    widest = int(n_slabs.max())
    if widest > 4 * positions.shape[0]:
        return True
    # the three axes at once: a scatter rather than bincount, which syncs on CUDA
    occupied = torch.zeros((3, widest), dtype=torch.bool, device=positions.device)
    occupied.scatter_(1, slabs.T, True)
    inside = torch.arange(widest, device=positions.device) < n_slabs[:, None]
    return bool((inside & ~occupied).any())


# Points per vesin search: its time per point grows with the block beyond about
# this (0.2 s for 256,000 points, 2.05 s for 1,000,188), so larger blocks go by slabs.
VESIN_SLAB = 100_000


def _vesin_pairs(points: np.ndarray, cutoff: float, n_centres: int) -> np.ndarray:
    """``(2, E)`` int64 list of pairs centred on the first ``n_centres`` rows, by vesin."""
    if len(points) <= VESIN_SLAB:
        pairs = _vesin_block(points, cutoff)
        if n_centres < len(points):
            pairs = pairs[:, pairs[0] < n_centres]
        return pairs
    # slabs along the longest axis, each searched with its neighbours within the
    # cutoff; a pair is kept by the slab that holds its centre
    # the longest axis of a sample: any axis gives the same pairs
    sample = points[:: max(1, len(points) // 4096)]
    x = points[:, int(np.argmax(np.ptp(sample, axis=0)))]
    n_slabs = -(-len(points) // VESIN_SLAB)
    bounds = np.concatenate([[-np.inf], np.quantile(x, np.arange(1, n_slabs) / n_slabs), [np.inf]])
    found = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        members = np.flatnonzero((x >= lo - cutoff) & (x <= hi + cutoff))
        pairs = members[_vesin_block(points[members], cutoff)]
        centre_x = x[pairs[0]]
        found.append(pairs[:, (centre_x >= lo) & (centre_x < hi) & (pairs[0] < n_centres)])
    return np.concatenate(found, axis=1)


def _vesin_block(points: np.ndarray, cutoff: float) -> np.ndarray:
    """``(2, E)`` int64 full list of one block (no periodicity)."""
    nl = vesin.NeighborList(cutoff=float(cutoff), full_list=True)
    i, j = nl.compute(points=points, box=np.zeros((3, 3)), periodic=False, quantities="ij")
    # vesin's indices are uint64: a view, not a conversion, before the one copy
    return np.stack([i.view(np.int64), j.view(np.int64)])


# The half stencil: a bin pairs with itself and with the 13 neighbouring bins
# whose offset is lexicographically positive, so each pair of points is met once.
_HALF_STENCIL = ((0, 0, 0), *(o for o in itertools.product((-1, 0, 1), repeat=3) if o > (0, 0, 0)))

# Candidate pairs per chunk of the cell list: at least CELL_CHUNK (enough work
# to fill a GPU), at most CELL_CHUNKS chunks (each one syncs); about 80 bytes a
# candidate at the peak of a chunk.
CELL_CHUNK = 1 << 20
CELL_CHUNKS = 32


def _cell_list_pairs(positions: torch.Tensor, cutoff: float, n_centres: int) -> torch.Tensor:
    """Pairs centred on the first ``n_centres`` rows, by a sparse cell list on the tensors' device.

    Parameters
    ----------
    positions : torch.Tensor
        ``(n, 3)`` float64 positions in Å, ``n >= 1``, at most ``8 n cutoff``
        wide along each axis (as :func:`close_gaps` leaves them).
    cutoff : float
        Search radius in Å.
    n_centres : int
        Pairs ``(i, j)`` with ``i >= n_centres`` are left out.

    Returns
    -------
    torch.Tensor
        ``(2, E)`` int64 on ``positions.device``, as :func:`neighbor_pairs`.

    Notes
    -----
    Work items pair the rows of a bin with those of a bin of its half stencil.
    Their candidates are generated and filtered by distance one chunk of items
    at a time, each kept pair giving those of its two directions whose centre
    is a centre; so memory is ``O(n + pairs + chunk)`` whatever the extent.
    Host syncs: 2 in :func:`_stencil_bins`, 2 to lay out the items, and 1 per
    chunk (its kept candidates), at most ``4 + CELL_CHUNKS`` in all.
    """
    device = positions.device
    order, starts, counts, near, found = _stencil_bins(positions, cutoff)

    # sorted rows that are centres; bin pairs without one are skipped
    is_centre = order < n_centres
    centres_before = F.pad(is_centre.cumsum(0), (1, 0))
    has_centre = centres_before[starts + counts] > centres_before[starts]
    live = (found & (has_centre | has_centre[near])).flatten().nonzero().squeeze(1)
    if live.shape[0] == 0:  # sync above: the live items
        return torch.zeros((2, 0), dtype=torch.int64, device=device)
    # An item pairs each row of its home bin with a run of rows of the other bin:
    # all of them, or for the bin with itself (offset 0) those after the row.
    home, other = live % near.shape[1], near.flatten()[live]
    is_self = live < near.shape[1]
    n_i, n_j, first_i, first_j = counts[home], counts[other], starts[home], starts[other]
    size = torch.where(is_self, n_i * (n_i - 1) // 2, n_i * n_j)  # candidates

    # chunks: the items whose candidates start in [k chunk, (k + 1) chunk)
    rows_before = F.pad(n_i.cumsum(0), (1, 0))  # rows of the items before each
    before = F.pad(size.cumsum(0), (1, 0))  # candidates of the items before each
    chunk = torch.clamp(-(-before[-1] // CELL_CHUNKS), min=CELL_CHUNK)
    bounds = torch.searchsorted(before[:-1], torch.arange(CELL_CHUNKS + 1, device=device) * chunk)
    plan = torch.stack([bounds, rows_before[bounds], before[bounds]], 1)
    plan = plan.tolist()  # sync: first item, row and candidate of every chunk

    # pieces in int32 while row numbers fit: the pieces and the result coexist at the end
    index_dtype = torch.int32 if order.shape[0] < 2**31 else torch.int64
    sorted_positions = positions[order].T.contiguous()  # (3, n): one gather per axis
    cutoff2 = cutoff * cutoff
    pieces = []
    for (a, r0, g0), (b, r1, g1) in itertools.pairwise(plan):
        if a == b:  # no item starts here; some chunk has all items if none has a candidate
            continue
        # take, not [], for gathers: about half the time on CPU
        # the chunk's rows i, each meeting the rows j in [run_first, run_first + run_len)
        item = a + torch.repeat_interleave(n_i[a:b], output_size=r1 - r0)
        i = first_i.take(item) + torch.arange(r0, r1, device=device) - rows_before.take(item)
        self_item = is_self.take(item)
        run_first = torch.where(self_item, i + 1, first_j.take(item))
        run_len = torch.where(
            self_item, first_i.take(item) + n_i.take(item) - 1 - i, n_j.take(item)
        )
        # the chunk's candidates: row r's run is at [run_start, run_start + run_len)
        row = torch.repeat_interleave(run_len, output_size=g1 - g0)
        run_start = run_len.cumsum(0) - run_len
        j = (run_first - run_start).take(row) + torch.arange(g1 - g0, device=device)
        i = i.take(row)
        del row  # candidate-sized scratch is freed as soon as it is spent
        d2 = torch.zeros(g1 - g0, dtype=positions.dtype, device=device)
        for coordinate in sorted_positions:  # three axes, not points
            delta = coordinate.take(j).sub_(coordinate.take(i))
            d2.addcmul_(delta, delta)
        close = d2 < cutoff2
        del d2, delta
        # both directions in one nonzero: index k < T is (i, j), T + k is (j, i)
        chosen = torch.cat([close & is_centre.take(i), close & is_centre.take(j)])
        chosen = chosen.nonzero().squeeze(1)
        forward = chosen < g1 - g0  # sync above: the chunk's kept count
        chosen = torch.where(forward, chosen, chosen - (g1 - g0))
        i, j = i.take(chosen), j.take(chosen)
        centre = torch.where(forward, i, j)
        neighbour = torch.where(forward, j, i)
        pieces.append(order.take(torch.stack([centre, neighbour])).to(index_dtype))
    pairs = torch.empty(
        (2, sum(piece.shape[1] for piece in pieces)), dtype=torch.int64, device=device
    )
    return torch.cat(pieces, dim=1, out=pairs)


def _stencil_bins(
    positions: torch.Tensor, cutoff: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Occupied bins of a cell list and their half-stencil neighbours (2 host syncs).

    Parameters
    ----------
    positions : torch.Tensor
        ``(n, 3)`` float64 positions in Å, at most ``8 n cutoff`` wide per axis.
    cutoff : float
        Search radius in Å; bins are cubes of edge just above it.

    Returns
    -------
    order : torch.Tensor
        ``(n,)`` rows sorted by bin.
    starts, counts : torch.Tensor
        ``(bins,)`` first sorted row and number of rows of each occupied bin.
    near, found : torch.Tensor
        ``(14, bins)`` the occupied bin at each offset of ``_HALF_STENCIL``,
        valid where ``found``; ``found`` is false for a bin with itself when it
        holds one row (no pair).
    """
    device = positions.device
    # an edge a hair above the cutoff: rounding in the bin coordinates (relative
    # 1e-16 of at most 8 n bins) can then never put a pair two bins apart
    edge = cutoff * (1.0 + 1e-6)
    cells = torch.floor((positions - positions.min(dim=0).values) / edge).to(torch.int64) + 1
    span = cells.max(dim=0).values + 2  # an empty layer each side: cells +- 1 stay in [0, span)
    # Keys in two levels, as x * span_y * span_z + ... could overflow int64
    # (span < 8 n + 3 per axis): the (x, y) column first, then its rank among
    # the occupied columns (< n) with z. Only occupied bins exist.
    columns, column = torch.unique(cells[:, 0] * span[1] + cells[:, 1], return_inverse=True)
    keys = column * span[2] + cells[:, 2]
    order = torch.argsort(keys)
    bin_keys, counts = torch.unique_consecutive(keys[order], return_counts=True)
    # syncs above: the numbers of occupied columns and bins

    # Each offset's neighbours: their column among the occupied ones, then their
    # key among the occupied bins, by binary search. One offset at a time, from
    # host constants: no copy, no sync, and (bins,)-sized scratch, not (bins, 14).
    column_x, column_y = columns // span[1], columns % span[1]
    bin_column, bin_z = bin_keys // span[2], bin_keys % span[2]
    near = torch.empty((len(_HALF_STENCIL), bin_keys.shape[0]), dtype=torch.int64, device=device)
    found = torch.empty(near.shape, dtype=torch.bool, device=device)
    for offset, (dx, dy, dz) in enumerate(_HALF_STENCIL):
        near_columns = (column_x + dx) * span[1] + column_y + dy
        near_column = torch.searchsorted(columns, near_columns).clamp_(max=columns.shape[0] - 1)
        column_found = (columns.take(near_column) == near_columns).take(bin_column)
        near_keys = near_column.take(bin_column).mul_(span[2]).add_(bin_z + dz)
        torch.searchsorted(bin_keys, near_keys, out=near[offset]).clamp_(max=near.shape[1] - 1)
        torch.logical_and(
            column_found, bin_keys.take(near[offset]) == near_keys, out=found[offset]
        )
    found[0] = counts > 1  # a bin holds pairs of its own from two rows on
    return order, counts.cumsum(0) - counts, counts, near, found
