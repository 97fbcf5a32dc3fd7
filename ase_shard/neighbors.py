"""Neighbour pairs of a finite block of points (images already explicit).

Each rank's block (owned rows + ghosts) carries its periodic images as rows,
so the search is always non-periodic. CPU tensors go to ``vesin``; tensors on
an accelerator use a torch cell list so they never leave the device.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
import vesin


def neighbor_pairs(positions: torch.Tensor, cutoff: float) -> torch.Tensor:
    """Full list of pairs closer than ``cutoff``.

    Parameters
    ----------
    positions : torch.Tensor
        ``(n, 3)`` positions in Å.
    cutoff : float
        Search radius in Å.

    Returns
    -------
    torch.Tensor
        ``(2, E)`` int64 on ``positions.device``: both ``(i, j)`` and ``(j, i)``
        for every pair with ``|r_j - r_i| < cutoff``, ``i != j``.
    """
    if positions.shape[0] < 2:
        return torch.zeros((2, 0), dtype=torch.int64, device=positions.device)
    positions = close_gaps(positions.detach().to(torch.float64), cutoff)
    if positions.device.type == "cpu":
        return _vesin_pairs(positions, cutoff)
    return _cell_list_pairs(positions, cutoff)


def close_gaps(positions: torch.Tensor, cutoff: float) -> torch.Tensor:
    """Positions with every empty slab wider than ``2 cutoff`` narrowed to ``2 cutoff``.

    No pair closer than ``cutoff`` spans such a slab, and none is created by
    narrowing it, so the pairs are unchanged; but the extent a cell list must
    cover stays below ``8 n cutoff`` even with an atom 1e9 Å away (which would
    otherwise overflow vesin's bin count or a GPU cell list's memory).
    """
    if not _may_have_gaps(positions, cutoff):
        return positions
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
    """
    lo = positions.min(dim=0).values
    slabs = torch.floor((positions - lo) / (4.0 * cutoff)).to(torch.int64)
    n_slabs = slabs.max(dim=0).values + 1
    if bool((n_slabs > 4 * positions.shape[0]).any()):
        return True
    return any(
        bool((torch.bincount(slabs[:, axis], minlength=int(n)) == 0).any())
        for axis, n in enumerate(n_slabs.tolist())
    )


# Points per vesin search: its time per point grows with the block beyond about
# this (0.2 s for 256,000 points, 2.05 s for 1,000,188), so larger blocks go by slabs.
VESIN_SLAB = 100_000


def _vesin_pairs(positions: torch.Tensor, cutoff: float) -> torch.Tensor:
    points = positions.numpy()  # neighbor_pairs passes detached float64
    if len(points) <= VESIN_SLAB:
        return torch.from_numpy(_vesin_block(points, cutoff))
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
        pairs = _vesin_block(points[members], cutoff)
        centre_x = x[members[pairs[0]]]
        found.append(members[pairs[:, (centre_x >= lo) & (centre_x < hi)]])
    return torch.from_numpy(np.concatenate(found, axis=1))


def _vesin_block(points: np.ndarray, cutoff: float) -> np.ndarray:
    """``(2, E)`` int64 full list of one block (no periodicity)."""
    nl = vesin.NeighborList(cutoff=float(cutoff), full_list=True)
    i, j = nl.compute(points=points, box=np.zeros((3, 3)), periodic=False, quantities="ij")
    # vesin's indices are uint64: a view, not a conversion, before the one copy
    return np.stack([i.view(np.int64), j.view(np.int64)])


def _cell_list_pairs(positions: torch.Tensor, cutoff: float) -> torch.Tensor:
    """Vectorised cell list: bins of edge ``cutoff``, 27 neighbouring bins."""
    device = positions.device
    pos = positions.detach().to(torch.float64)
    origin = pos.min(dim=0).values
    bins = torch.floor((pos - origin) / cutoff).to(torch.int64)
    n_bins = bins.max(dim=0).values + 3  # one empty layer on each side
    bins = bins + 1
    strides = torch.stack([n_bins[1] * n_bins[2], n_bins[2], torch.ones_like(n_bins[2])])
    keys = (bins * strides).sum(dim=1)
    order = torch.argsort(keys)
    sorted_keys = keys[order]
    total_bins = int(n_bins.prod())
    counts = torch.bincount(sorted_keys, minlength=total_bins)
    starts = torch.cumsum(counts, 0) - counts

    centres, neighbours = [], []
    for offset in itertools.product((-1, 0, 1), repeat=3):
        shift = (torch.tensor(offset, device=device) * strides).sum()
        other = keys + shift
        n_other = counts[other]
        centre = torch.repeat_interleave(torch.arange(pos.shape[0], device=device), n_other)
        first = torch.repeat_interleave(starts[other], n_other)
        rank_in_bin = torch.arange(centre.shape[0], device=device) - torch.repeat_interleave(
            torch.cumsum(n_other, 0) - n_other, n_other
        )
        centres.append(centre)
        neighbours.append(order[first + rank_in_bin])
    i = torch.cat(centres)
    j = torch.cat(neighbours)
    d2 = ((pos[j] - pos[i]) ** 2).sum(dim=1)
    keep = (i != j) & (d2 < cutoff * cutoff)
    return torch.stack([i[keep], j[keep]])
