"""Owner assignment: which rank owns which atom (pure numpy, no MPI).

Geometry is expressed in a *frame*: the cell vectors on periodic axes and an
orthonormal completion on non-periodic ones, so a molecule with no cell or a
slab with a zero cell vector still has well-defined coordinates. Frame
coordinates are fractional on periodic axes (wrapped into ``[0, 1)``) and in Å
along the unit vectors of non-periodic axes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

PARTITIONS = ("spatial", "contiguous")


def frame_matrix(cell: np.ndarray, pbc: np.ndarray) -> np.ndarray:
    """Rows: cell vectors on periodic axes, orthonormal completion elsewhere.

    Parameters
    ----------
    cell : (3, 3) array, Å
    pbc : (3,) bool array

    Returns
    -------
    (3, 3) array whose rows span space; row ``i`` belongs to axis ``i``.
    """
    frame = np.zeros((3, 3))
    periodic = np.flatnonzero(pbc)
    frame[periodic] = cell[periodic]
    if len(periodic) < 3:
        # The right-singular vectors beyond the periodic span are orthonormal
        # and orthogonal to every periodic vector.
        basis = np.zeros((3, 3)) if len(periodic) == 0 else cell[periodic]
        _, _, vt = np.linalg.svd(np.vstack([basis, np.zeros((3 - len(periodic), 3))]))
        complement = vt[len(periodic) :] if len(periodic) else np.eye(3)
        frame[np.flatnonzero(~pbc)] = complement
    return frame


def plane_spacings(frame: np.ndarray) -> np.ndarray:
    """Distance (Å) between the lattice planes ``s_i = const`` of each axis."""
    volume = abs(np.linalg.det(frame))
    cross = np.cross(frame[[1, 2, 0]], frame[[2, 0, 1]])
    return volume / np.linalg.norm(cross, axis=1)


@dataclass
class FrameCoordinates:
    """Atoms expressed in the frame.

    Attributes
    ----------
    s : (N, 3) array
        Frame coordinates; periodic axes wrapped into ``[0, 1)``.
    wrap_shift : (N, 3) int array
        Cell images that bring each atom into the wrapped cell:
        ``positions + wrap_shift @ cell`` has coordinates ``s``.
    spacing : (3,) array
        Plane spacings of the frame, Å.
    """

    s: np.ndarray
    wrap_shift: np.ndarray
    spacing: np.ndarray


def frame_coordinates(
    positions: np.ndarray, cell: np.ndarray, pbc: np.ndarray
) -> FrameCoordinates:
    """Express ``positions`` (Å) in the frame of ``cell``/``pbc``."""
    frame = frame_matrix(cell, pbc)
    # one (3, 3) x (3, N) product (8x faster than solve), kept column-major: one row per axis
    s = (np.linalg.inv(frame).T @ positions.T).T
    shift = np.where(pbc, -np.floor(s), 0.0)
    s = s + shift
    # s - floor(s) can round up to exactly 1.0 for tiny negative s
    over = (s >= 1.0) & pbc
    shift[over] -= 1.0
    s[over] -= 1.0
    return FrameCoordinates(s=s, wrap_shift=shift.astype(np.int64), spacing=plane_spacings(frame))


def factorisations(n_ranks: int) -> list[tuple[int, int, int]]:
    """All ordered ``(px, py, pz)`` with ``px * py * pz == n_ranks``."""
    return [
        (px, py, n_ranks // (px * py))
        for px, py in itertools.product(range(1, n_ranks + 1), repeat=2)
        if n_ranks % (px * py) == 0
    ]


def choose_grid(
    coords: FrameCoordinates, pbc: np.ndarray, n_ranks: int, halo_width: float
) -> tuple[int, int, int]:
    """Rank grid that minimises the estimated halo volume.

    Extents are the plane spacing on periodic axes and the atoms' span on the
    others; a non-periodic axis has no halo beyond the system's surface.
    """
    if len(coords.s) == 0:
        return (n_ranks, 1, 1)
    span = coords.s.max(axis=0) - coords.s.min(axis=0)
    return grid_for_extent(np.where(pbc, coords.spacing, span), pbc, n_ranks, halo_width)


def grid_for_extent(
    extent: np.ndarray, pbc: np.ndarray, n_ranks: int, halo_width: float
) -> tuple[int, int, int]:
    """:func:`choose_grid` from the system's extent per axis (Å)."""

    def halo_volume(grid: tuple[int, int, int]) -> float:
        p = np.array(grid)
        sides = extent / p
        cuts = np.where(pbc, 2.0, 2.0 * (p - 1) / p)
        return float(np.prod(sides + cuts * halo_width) - np.prod(sides))

    return min(factorisations(n_ranks), key=halo_volume)


def grouped_order(keys: np.ndarray, n_keys: int) -> np.ndarray:
    """Indices sorted by their key in ``[0, n_keys)``, each key's in index order.

    Keys cast to the smallest unsigned type that holds them: at 8 or 16 bits
    numpy's stable argsort is an ``O(n)`` radix sort.
    """
    return np.argsort(keys.astype(np.min_scalar_type(max(n_keys - 1, 0))), kind="stable")


# bins per group and axis of the histograms that find where the cuts fall
CUT_BINS = 1024


def bins_of(values: np.ndarray, lo: float, hi: float, n_bins: int = CUT_BINS) -> np.ndarray:
    """Histogram bin of each value on ``n_bins`` equal bins spanning ``[lo, hi]``."""
    scale = n_bins / (hi - lo) if hi > lo else 0.0
    bins = np.floor((values - lo) * scale)
    return np.clip(bins, 0, n_bins - 1).astype(np.int64)


@dataclass(frozen=True)
class OverRanks:
    """The two collectives that place cuts among atoms spread over ranks (this module
    has no MPI of its own): :data:`EVERY_ATOM_HERE` where one holds every atom.

    Attributes
    ----------
    sum : callable
        Element-wise sum of an int64 array over the ranks.
    concatenate : callable
        Every rank's rows of a float64 array, concatenated in rank order.
    """

    sum: Callable[[np.ndarray], np.ndarray]
    concatenate: Callable[[np.ndarray], np.ndarray]


EVERY_ATOM_HERE = OverRanks(sum=lambda a: a, concatenate=lambda a: a)


@dataclass(frozen=True)
class Cuts:
    """Where a ``px x py x pz`` grid of boxes cuts the atoms, axis by axis.

    Axis 0 is cut once for all atoms; axis 1 within each of axis 0's slabs;
    axis 2 within each column. Along an axis the atoms are in the order of
    ``(frame coordinate, atom id)``, so that atoms on one lattice plane can
    still be split; a cut is the last atom it leaves below.

    Attributes
    ----------
    grid : (int, int, int)
    planes, last_ids : three arrays each
        ``planes[a]`` and ``last_ids[a]`` are ``(groups, grid[a] - 1)``: for
        each group formed by the axes before ``a`` (one for axis 0), the frame
        coordinate (fractional on periodic axes, Å elsewhere) and the id of
        the last atom below each cut. An atom above cut ``j`` of its group, in
        that order, goes to a part after ``j``.
    """

    grid: tuple[int, int, int]
    planes: tuple[np.ndarray, np.ndarray, np.ndarray]
    last_ids: tuple[np.ndarray, np.ndarray, np.ndarray]


@dataclass(frozen=True)
class Balanced:
    """Cuts just placed (:func:`balanced_cuts`) and the boxes they give this rank's atoms.

    Attributes
    ----------
    cuts : Cuts
    owners : (n,) int array
        The box (owner rank) of each atom, as :func:`owners_at` would give it.
    """

    cuts: Cuts
    owners: np.ndarray


def frame_box(s: np.ndarray) -> np.ndarray:
    """``(2, 3)``: the lowest and highest frame coordinates of the atoms ``s`` along each
    axis (``inf`` and ``-inf`` when there are none)."""
    # column by column: numpy's axis-0 reduction of an (n, 3) array is strided, 16x slower
    columns = [s[:, axis] for axis in range(3)]
    return np.array(
        [[c.min(initial=np.inf) for c in columns], [c.max(initial=-np.inf) for c in columns]]
    )


def owners_at(s: np.ndarray, ids: np.ndarray, cuts: Cuts) -> np.ndarray:
    """Box (owner rank) of each atom ``ids`` at frame coordinates ``s`` (``(n, 3)``)."""
    group = np.zeros(len(s), dtype=np.int64)
    for axis, parts in enumerate(cuts.grid):
        if parts > 1:
            above = _above(s[:, axis], ids, cuts.planes[axis][group], cuts.last_ids[axis][group])
            group = group * parts + above.sum(axis=1)
    return group


def _above(
    values: np.ndarray, ids: np.ndarray, planes: np.ndarray, last: np.ndarray
) -> np.ndarray:
    """``(n, k)``: whether each atom comes after each of its ``k`` cuts in the order of
    ``(value, id)``."""
    values, ids = values[:, None], ids[:, None]
    return (values > planes) | ((values == planes) & (ids > last))


def balanced_cuts(
    s: np.ndarray,
    ids: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    grid: tuple[int, int, int],
    over_ranks: OverRanks,
    weights: np.ndarray | None = None,
) -> Balanced:
    """Cuts that give every box the same share of the atoms, or of their ``weights``,
    and the boxes of this rank's atoms.

    Along each axis the atoms of a group, in the order of ``(coordinate,
    id)``, are numbered by the weight before them, ``W``; an atom goes to
    part ``floor(W parts / total)``, so the parts' weights differ by at most
    one atom's (by count: ``N / P`` atoms each, within one). The same rule on
    every rank, with the same result whichever rank holds an atom: a
    histogram summed over the ranks (:data:`CUT_BINS` bins per group from
    ``lo`` to ``hi``) finds the bin of each cut, and the atoms of those bins,
    gathered from every rank, the atom.

    Parameters
    ----------
    s : (n, 3) array
        Frame coordinates of this rank's atoms.
    ids : (n,) int array
        Their ids (the same atom has the same id on every rank).
    lo, hi : (3,) arrays
        The frame box of every rank's atoms.
    grid : (int, int, int)
    over_ranks : OverRanks
        Two collectives per cut axis; :data:`EVERY_ATOM_HERE` when ``s`` holds
        every atom.
    weights : (n,) int array, optional
        Each atom's share of the work; default 1 (balance the atoms).
    """
    weights = np.ones(len(s), dtype=np.int64) if weights is None else weights
    group = np.zeros(len(s), dtype=np.int64)
    n_groups, planes, last_ids = 1, [], []
    for axis, parts in enumerate(grid):
        if parts == 1:
            planes.append(np.zeros((n_groups, 0)))
            last_ids.append(np.zeros((n_groups, 0), dtype=np.int64))
            continue
        values = s[:, axis]
        where = group * CUT_BINS + bins_of(values, lo[axis], hi[axis])
        # float sums of int weights: exact below 2^53
        histograms = np.bincount(where, weights, n_groups * CUT_BINS).astype(np.int64)
        histograms = over_ranks.sum(histograms).reshape(n_groups, CUT_BINS)
        before = np.cumsum(histograms, axis=1) - histograms  # weight in the bins below
        total = histograms.sum(axis=1)
        # the last atom below cut j is the last whose weight before it, W, has
        # W parts < j total: in the last non-empty bin where the bin's first atom has
        j = np.arange(1, parts)
        below = (histograms[:, :, None] > 0) & (
            before[:, :, None] * parts < j[None, None, :] * total[:, None, None]
        )
        cut_bins = CUT_BINS - 1 - np.argmax(below[:, ::-1, :], axis=1)  # (groups, parts - 1)
        wanted = np.zeros(n_groups * CUT_BINS, dtype=bool)
        wanted[(np.arange(n_groups)[:, None] * CUT_BINS + cut_bins)[below.any(axis=1)]] = True
        mine = wanted[where]
        candidates = over_ranks.concatenate(
            np.column_stack([where[mine], values[mine], ids[mine], weights[mine]]).astype(float)
        )
        plane = np.full((n_groups, parts - 1), np.inf)
        last = np.full((n_groups, parts - 1), np.iinfo(np.int64).max)
        for g, k in zip(*np.nonzero(below.any(axis=1)), strict=True):
            key = g * CUT_BINS + cut_bins[g, k]
            rows = candidates[candidates[:, 0] == key]
            rows = rows[np.lexsort((rows[:, 2], rows[:, 1]))]
            weight_before = before[g, cut_bins[g, k]] + np.cumsum(rows[:, 3]) - rows[:, 3]
            at = np.flatnonzero(weight_before * parts < (k + 1) * total[g])[-1]
            plane[g, k], last[g, k] = rows[at, 1], int(rows[at, 2])
        planes.append(plane)
        last_ids.append(last)
        group = group * parts + _above(values, ids, plane[group], last[group]).sum(axis=1)
        n_groups *= parts
    return Balanced(Cuts(tuple(int(p) for p in grid), tuple(planes), tuple(last_ids)), group)


def spatial_owners(coords: FrameCoordinates, grid: tuple[int, int, int]) -> np.ndarray:
    """Owner rank of each atom on a ``px x py x pz`` grid of count-balanced boxes.

    Axis 0 is cut at quantiles of all atoms; axis 1 at quantiles within each
    axis-0 slab; axis 2 within each column, so every rank gets ``N/P`` atoms
    (within one) even for slabs and clusters (:func:`balanced_cuts` of every
    atom, their ids their indices).
    """
    lo, hi = frame_box(coords.s)
    ids = np.arange(len(coords.s))
    return balanced_cuts(coords.s, ids, lo, hi, grid, EVERY_ATOM_HERE).owners


def contiguous_owners(n_atoms: int, n_ranks: int) -> np.ndarray:
    """Owner rank by index blocks: rank ``r`` owns ``[r N / P, (r+1) N / P)``."""
    return np.arange(n_atoms, dtype=np.int64) * n_ranks // max(n_atoms, 1)
