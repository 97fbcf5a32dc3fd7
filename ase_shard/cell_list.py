"""A compiled cell list on the host: the CPU neighbour search (numba).

One pass over the centres in bin order, so every centre's neighbouring bins are
still in cache from the one before; no pair is ever held as a candidate. The
bins are half of ``cutoff`` wide where the points are dense (a centre visits
the 5 x 5 x 5 bins around its own: 42 % fewer candidates than 3 x 3 x 3 bins
``cutoff`` wide), and number at most ``4 n + 64``, so memory is ``O(n)`` whatever the extent
(:func:`ase_shard.neighbors.close_gaps` keeps the extent ``O(n cutoff)``).
Compiled on first use and cached on disk by numba (a few seconds once per
installation).
"""

from __future__ import annotations

import numba
import numpy as np

from ase_shard.compiled import unsigned

# Bins per point at most: more bins than points only adds empty bins to visit.
BINS_PER_POINT = 4


def cell_list_pairs(
    points: np.ndarray,
    cutoff: float,
    n_centres: int,
    once_by: np.ndarray | None = None,
    dtype: type[np.signedinteger] = np.int64,
) -> np.ndarray:
    """``(2, E)`` full list centred on the first ``n_centres`` rows (no periodicity).

    Parameters
    ----------
    points : numpy.ndarray
        ``(n, 3)`` float64 positions in Å, ``n >= 1``.
    cutoff : float
        Search radius in Å: pairs with ``|r_j - r_i| < cutoff``, ``i != j``.
    n_centres : int
        Only pairs whose centre ``i`` is below ``n_centres``.
    once_by : numpy.ndarray, optional
        ``(n,)`` int64: only the pairs with ``once_by[j] >= i``
        (:func:`ase_shard.neighbors.neighbor_pairs`), never written otherwise.
    dtype : numpy integer type
        Of the pairs: ``numpy.int32`` halves the list where row numbers fit in it.

    Returns
    -------
    numpy.ndarray
        Pairs ``(i, j)`` of ``dtype``, grouped by centre (centres in bin order).
    """
    points = np.ascontiguousarray(points, dtype=np.float64)
    lo, hi = _bounds(points)
    extent = hi - lo
    # half the cutoff where the points are denser than one per cutoff-wide bin (a third
    # took longer: more bins to visit for fewer candidates), else a point per bin about
    spacing = float(np.prod(extent + cutoff) / len(points)) ** (1 / 3)
    width = float(cutoff) / 2 if spacing < cutoff else spacing
    shape = np.floor(extent / width).astype(np.int64) + 1
    while np.prod(shape) > BINS_PER_POINT * len(points) + 64:
        width *= 1.25
        shape = np.floor(extent / width).astype(np.int64) + 1
    reach, z_reach = _stencil(float(cutoff), width)
    cell, start, order, sorted_points = _bin(points, lo, width, shape)
    # room for the pairs of a uniform block; where the points are denser (a liquid
    # beside its vapour), the sweep stops at the centre that does not fit and goes
    # on from there into more room, sized by the pairs per centre found so far
    density = len(points) / np.prod(extent + cutoff)
    capacity = int(1.5 * n_centres * density * 4.19 * cutoff**3) + 1024
    if once_by is not None:
        capacity //= 2  # about one of a pair's two directions
    capacity = min(capacity, n_centres * len(points))
    once = once_by is not None
    # in bin order, as the sweep reads them
    nodes = np.ascontiguousarray(once_by, dtype=np.int64)[order] if once else np.zeros(0, np.int64)
    parts, done = [], 0
    while True:
        buffer = np.empty(2 * capacity, dtype=dtype)
        pairs = buffer.reshape(2, capacity)
        found, done = _sweep(
            sorted_points, order, cell, start, shape, reach, z_reach, n_centres,
            cutoff * cutoff, once, nodes, done, pairs,
        )  # fmt: skip
        if done == len(points) and not parts:
            del pairs  # no view of the buffer left: it can shrink
            return _shrunk(buffer, capacity, found)
        parts.append(pairs[:, :found])
        if done == len(points):
            return np.concatenate(parts, axis=1)
        listed = sum(part.shape[1] for part in parts)
        capacity = int(1.5 * listed / max(done, 1) * (len(points) - done)) + len(points) + 1024


def _shrunk(buffer: np.ndarray, capacity: int, found: int) -> np.ndarray:
    """The first ``found`` pairs of ``buffer`` (a ``(2, capacity)`` list, flat) as a
    ``(2, found)`` list in the same memory.

    The neighbours' row moves down behind the centres' and the room after it goes back
    to the system (``realloc`` shrinks a large block in place): the room sized ahead
    of the search, a fifth or more of a block's edge list, is not held while the list
    lives (256,000 Ar atoms at 9 Å: 19 MiB).
    """
    _move_down(buffer, capacity, found)
    buffer.resize(2 * found, refcheck=False)  # safe: the caller dropped its one view
    return buffer.reshape(2, found)


@numba.njit(cache=True)
def _move_down(buffer, capacity, found):  # pragma: no cover - compiled
    """``buffer[found:2 found] = buffer[capacity:capacity + found]``, ``found <= capacity``
    (front to back: a value is read before anything is written over it; numpy would
    copy the overlapping source first)."""
    for k in range(found):
        buffer[found + k] = buffer[capacity + k]


def _stencil(cutoff: float, width: float) -> tuple[int, np.ndarray]:
    """The bins a centre visits: ``reach`` bins either way along the first two axes, and
    along the third ``z_reach[|da|, |db|]`` either way (-1: none), the bins whose
    nearest points can lie within ``cutoff`` (Å) of some point of the centre's bin."""
    reach = int(np.ceil(cutoff / width))
    gap = np.maximum(np.arange(reach + 1) - 1, 0) * width  # nearest distance, per axis
    plane = gap[:, None] ** 2 + gap[None, :] ** 2
    rest = np.sqrt(np.maximum(cutoff**2 - plane, 0.0))
    z_reach = np.minimum(np.floor(rest / width).astype(np.int64) + 1, reach)
    return reach, np.where(plane < cutoff**2, z_reach, -1)


def has_empty_slab(points: np.ndarray, width: float) -> bool:
    """Whether slabs of ``width`` Å tiling some axis from its lowest point leave one empty.

    Also true when some axis needs more than ``4 n`` slabs (the points cannot fill them).
    """
    points = np.ascontiguousarray(points, dtype=np.float64)
    return len(points) > 0 and bool(_has_empty_slab(points, float(width)))


@numba.njit(cache=True)
def _has_empty_slab(points, width):  # pragma: no cover - compiled
    lo, hi = _bounds(points)
    n = points.shape[0]
    for a in range(3):
        n_slabs = int((hi[a] - lo[a]) / width) + 1
        if n_slabs > 4 * n:
            return True
        occupied = np.zeros(n_slabs, np.bool_)
        for k in range(n):
            occupied[int((points[k, a] - lo[a]) / width)] = True
        for b in range(n_slabs):
            if not occupied[b]:
                return True
    return False


@numba.njit(cache=True)
def _bounds(points):  # pragma: no cover - compiled
    """Lowest and highest coordinate along each axis (numpy's axis-0 min is strided)."""
    lo = points[0].copy()
    hi = points[0].copy()
    for k in range(1, points.shape[0]):
        for a in range(3):
            lo[a] = min(lo[a], points[k, a])
            hi[a] = max(hi[a], points[k, a])
    return lo, hi


@numba.njit(cache=True)
def _bin(points, lo, width, shape):  # pragma: no cover - compiled
    """Counting sort of the points into bins: each point's bin, each bin's first row in
    bin order, the points in bin order (``order``) and their positions so sorted."""
    n = points.shape[0]
    s1 = shape[1]
    s2 = shape[2]
    cell = np.empty(n, np.int64)
    for k in range(n):
        c0 = min(int((points[k, 0] - lo[0]) / width), shape[0] - 1)
        c1 = min(int((points[k, 1] - lo[1]) / width), s1 - 1)
        c2 = min(int((points[k, 2] - lo[2]) / width), s2 - 1)
        cell[k] = (c0 * s1 + c1) * s2 + c2
    start = np.zeros(shape[0] * s1 * s2 + 1, np.int64)
    for k in range(n):
        start[cell[k] + 1] += 1
    for b in range(start.shape[0] - 1):
        start[b + 1] += start[b]
    fill = start[:-1].copy()
    order = np.empty(n, np.int64)
    sorted_points = np.empty_like(points)
    for k in range(n):
        q = fill[cell[k]]
        order[q] = k
        sorted_points[q] = points[k]
        fill[cell[k]] += 1
    return cell, start, order, sorted_points


@numba.njit(cache=True)
def _sweep(
    sorted_points, order, cell, start, shape, reach, z_reach, n_centres, cutoff2, once, nodes,
    first, pairs,
):  # pragma: no cover - compiled
    """Write the pairs of the centres from row ``first`` on (in bin order) into
    ``pairs`` (with ``once``, only those with ``nodes[q] >= i``, ``nodes`` in bin order);
    stop before the first centre whose candidates might not fit. Return the pairs
    written and the row to go on from (``n`` when every centre is done).

    Every candidate is written and kept or not without a branch: whether a point is
    within the cutoff, and whether a pair within it is the one of its two kept, are
    coin tosses to the processor (32,000 liquid Ar atoms at 9 Å: 29.5 ms against 41
    with branches, 46 with bins cutoff wide).
    """
    n = sorted_points.shape[0]
    s1 = shape[1]
    s2 = shape[2]
    capacity = pairs.shape[1]
    found = 0
    for qi in range(first, n):
        i = order[qi]
        if i >= n_centres:
            continue
        c = cell[i]
        c0 = c // (s1 * s2)
        c1 = (c // s2) % s1
        c2 = c % s2
        x = sorted_points[qi, 0]
        y = sorted_points[qi, 1]
        z = sorted_points[qi, 2]
        written = found
        for a in range(max(c0 - reach, 0), min(c0 + reach + 1, shape[0])):
            for b in range(max(c1 - reach, 0), min(c1 + reach + 1, s1)):
                m = z_reach[abs(a - c0), abs(b - c1)]
                if m < 0:
                    continue
                row = (a * s1 + b) * s2
                q0 = start[row + max(c2 - m, 0)]
                q1 = start[row + min(c2 + m + 1, s2)]
                if written + (q1 - q0) > capacity:
                    return found, qi  # this centre again, in more room
                for q in range(q0, q1):
                    uq, uw = unsigned(q), unsigned(written)  # (see there)
                    dx = sorted_points[uq, 0] - x
                    dy = sorted_points[uq, 1] - y
                    dz = sorted_points[uq, 2] - z
                    keep = (dx * dx + dy * dy + dz * dz < cutoff2) & (q != qi)
                    pairs[0, uw] = i
                    pairs[1, uw] = order[uq]
                    written += keep & (nodes[uq] >= i) if once else keep
        found = written
    return found, n
