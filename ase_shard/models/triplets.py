"""Three-body (angle) lists from a rank's edges, for the models that have them.

CHGNet's bond graph (:mod:`ase_shard.models.chgnet`) and M3GNet's three-body
interaction (:mod:`ase_shard.models.mattersim`) both sum over the angles at an
atom: every ordered pair of two different edges centred on it, both shorter
than a three-body cutoff. A ``LocalGraph`` lists every edge of each centre
whose energy or features matter, so these pairs are found among its edges,
vectorised (no loop over atoms or edges).
"""

from __future__ import annotations

import torch


def pairs_within(keys: torch.Tensor, n_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All ordered pairs ``(a, b)`` of positions with ``keys[a] == keys[b]``, ``a`` sorted.

    ``keys`` holds integers in ``[0, n_keys)``; ``a == b`` is included. The
    pairs come grouped by key (in increasing key order), so a group of ``m``
    equal keys gives ``m * m`` pairs.
    """
    order = torch.argsort(keys, stable=True)
    sorted_keys = keys[order]
    counts = torch.bincount(sorted_keys, minlength=n_keys)
    start = torch.cumsum(counts, 0) - counts
    per_entry = counts[sorted_keys]
    first = torch.repeat_interleave(torch.arange(len(keys), device=keys.device), per_entry)
    block = torch.repeat_interleave(torch.cumsum(per_entry, 0) - per_entry, per_entry)
    second = start[sorted_keys][first] + torch.arange(len(first), device=keys.device) - block
    return order[first], order[second]


def angle_pairs(
    centre: torch.Tensor, candidates: torch.Tensor, n_nodes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every ordered pair of two different edges among ``candidates`` with one centre.

    Parameters
    ----------
    centre : (E,) int64
        Each edge's centre node (``edge_index[0]``).
    candidates : (C,) int64
        The edges that may form angles (those within a three-body cutoff).
    n_nodes : int
        Number of nodes (centres lie in ``[0, n_nodes)``).

    Returns
    -------
    first, second : (A,) int64
        Edge indices: ``(first[a], second[a])`` is the angle between two
        different candidates at their common centre, each unordered pair
        appearing in both orders; grouped by centre.
    """
    first, second = pairs_within(centre[candidates], n_nodes)
    distinct = first != second
    return candidates[first[distinct]], candidates[second[distinct]]
