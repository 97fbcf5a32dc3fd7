"""Ghost selection: which atom images each rank needs (pure numpy, no MPI).

A rank's *domain* is the frame-coordinate bounding box of the atoms it owns.
An image within Cartesian distance ``h`` of an owned atom lies within
``h / spacing_i`` of that box along every axis ``i``, so the widened box is a
safe superset of the halo for spatial and contiguous partitions alike.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from ase_shard.partition import FrameCoordinates


@dataclass
class RankRows:
    """The local rows of one rank: owned atoms first, then ghosts.

    Attributes
    ----------
    ids : (n,) int64
        Global atom index of every row.
    image_shift : (n, 3) int64
        Cell images: row position is ``positions[ids] + image_shift @ cell``.
    n_owned : int
        Rows ``[0, n_owned)`` are owned.
    """

    ids: np.ndarray
    image_shift: np.ndarray
    n_owned: int


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
) -> list[RankRows]:
    """Owned rows and ghost rows of every rank.

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

    rows = []
    for rank in range(n_ranks):
        ids = np.concatenate([owned[rank], *ghost_ids[rank]]).astype(np.int64)
        image_shift = np.concatenate(
            [np.zeros((len(owned[rank]), 3), dtype=np.int64), *ghost_shift[rank]]
        ).astype(np.int64)
        rows.append(RankRows(ids, image_shift + coords.wrap_shift[ids], len(owned[rank])))
    return rows
