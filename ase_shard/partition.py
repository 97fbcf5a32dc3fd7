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


def balanced_labels(values: np.ndarray, groups: np.ndarray, parts: int) -> np.ndarray:
    """Split each group into ``parts`` runs of equal count along ``values``.

    An atom of rank ``r`` among the ``n`` of its group, in the order of
    ``(value, index)``, gets label ``r * parts // n``. Found by selection
    (``np.partition``) rather than by sorting: ``O(n)`` per cut.
    """
    labels = np.zeros(len(values), dtype=np.int64)
    if parts == 1 or len(values) == 0:
        return labels
    n_groups = int(groups.max()) + 1
    by_group = grouped_order(groups, n_groups)  # members of each group in index order
    counts = np.bincount(groups, minlength=n_groups)
    for members in np.split(by_group, np.cumsum(counts)[:-1]):
        n = len(members)
        # the first rank with label j is ceil(j n / parts)
        cuts = [k for k in ((j * n + parts - 1) // parts for j in range(1, parts)) if k < n]
        if not cuts:
            continue
        group_values = values[members]
        selected = np.partition(group_values, cuts)
        mine = np.zeros(n, dtype=np.int64)
        for k in cuts:
            value = selected[k]
            at_or_after = group_values >= value
            # of the atoms tied at the cut value, the first ones (by index) come before it
            ties = np.flatnonzero(group_values == value)
            at_or_after[ties[: k - (n - np.count_nonzero(at_or_after))]] = False
            mine += at_or_after
        labels[members] = mine
    return labels


def spatial_owners(coords: FrameCoordinates, grid: tuple[int, int, int]) -> np.ndarray:
    """Owner rank of each atom on a ``px x py x pz`` grid of count-balanced boxes.

    Axis 0 is cut at quantiles of all atoms; axis 1 at quantiles within each
    axis-0 slab; axis 2 within each column, so every rank gets ``N/P`` atoms
    (within one) even for slabs and clusters.
    """
    group = np.zeros(len(coords.s), dtype=np.int64)
    for axis, parts in enumerate(grid):
        if parts > 1:  # one part leaves the groups as they are
            group = group * parts + balanced_labels(coords.s[:, axis], group, parts)
    return group


# bins per group and axis of the histograms that place distributed cuts
CUT_BINS = 1024


def bins_of(values: np.ndarray, lo: float, hi: float, n_bins: int = CUT_BINS) -> np.ndarray:
    """Histogram bin of each value on ``n_bins`` equal bins spanning ``[lo, hi]``."""
    scale = n_bins / (hi - lo) if hi > lo else 0.0
    bins = np.floor((values - lo) * scale)
    return np.clip(bins, 0, n_bins - 1).astype(np.int64)


def balanced_bin_cuts(histograms: np.ndarray, parts: int) -> np.ndarray:
    """Where to cut each group's histogram into ``parts`` runs of about equal count.

    Parameters
    ----------
    histograms : (G, B) int array
        Atoms per group and bin.
    parts : int

    Returns
    -------
    (G, parts - 1) int array
        Cut ``j`` of a group is a bin index: atoms in lower bins get labels
        ``<= j``. Cuts sit at the bin edge closest to ``j / parts`` of the
        group's atoms, so every rank computing this from the same (summed)
        histograms gets the same cuts.
    """
    cumulative = np.cumsum(histograms, axis=1)
    below = np.concatenate([np.zeros((len(histograms), 1), np.int64), cumulative], axis=1)
    targets = cumulative[:, -1:] * np.arange(1, parts) / parts
    cuts = np.empty((len(histograms), parts - 1), dtype=np.int64)
    for group, (counts, wanted) in enumerate(zip(below, targets, strict=True)):
        after = np.clip(np.searchsorted(counts, wanted), 1, len(counts) - 1)
        # the edge before or at the target, whichever count is closer to it
        closer = np.abs(counts[after - 1] - wanted) <= np.abs(counts[after] - wanted)
        cuts[group] = after - closer
    return cuts


def histogram_owners(
    s: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    grid: tuple[int, int, int],
    sum_over_ranks: Callable[[np.ndarray], np.ndarray],
) -> np.ndarray:
    """Owner rank of each of this rank's atoms when every rank holds only some atoms.

    The spatial rule of distributed atoms: a ``px*py*pz`` grid of boxes in
    frame coordinates, cut axis by axis at the histogram bins that balance
    the atoms of all ranks (:func:`balanced_bin_cuts`). Every rank computes
    the same cuts from the same summed histograms, so an atom's owner does
    not depend on which rank holds it.

    Parameters
    ----------
    s : (n, 3) array
        Frame coordinates of this rank's atoms.
    lo, hi : (3,) arrays
        The frame box of every rank's atoms.
    grid : (int, int, int)
    sum_over_ranks : callable
        Element-wise sum of an int64 array over the ranks (one collective per
        cut axis; this module has no MPI of its own).
    """
    group = np.zeros(len(s), dtype=np.int64)
    n_groups = 1
    for axis, parts in enumerate(grid):
        if parts == 1:
            continue
        bins = bins_of(s[:, axis], lo[axis], hi[axis])
        histograms = np.bincount(group * CUT_BINS + bins, minlength=n_groups * CUT_BINS)
        histograms = sum_over_ranks(histograms).reshape(n_groups, CUT_BINS)
        cuts = balanced_bin_cuts(histograms, parts)
        group = group * parts + (bins[:, None] >= cuts[group]).sum(axis=1)
        n_groups *= parts
    return group


def contiguous_owners(n_atoms: int, n_ranks: int) -> np.ndarray:
    """Owner rank by index blocks: rank ``r`` owns ``[r N / P, (r+1) N / P)``."""
    return np.arange(n_atoms, dtype=np.int64) * n_ranks // max(n_atoms, 1)
