"""Which of two ranks takes a pair they share, and the edges a block keeps of its list."""

import numpy as np
import pytest

from ase_shard.shared_pairs import centre_takes_pair, pairs_once

MASK = (1 << 64) - 1


def _takes_in_python(a: int, b: int) -> bool:
    """The hash of the pair in Python's integers, wrapped to 64 bits by hand."""
    low, high = min(a, b), max(a, b)
    mixed = ((low * 0x9E3779B97F4A7C15) & MASK) ^ ((high * 0xC2B2AE3D27D4EB4F) & MASK)
    mixed = ((mixed ^ (mixed >> 29)) * 0xBF58476D1CE4E5B9) & MASK
    return bool((mixed >> 32) & 1) == (a < b)


def test_centre_takes_pair_once_and_evenly() -> None:
    """One of the two ends' ranks takes each pair, about half the pairs each, also for
    atoms numbered like a crystal (ids that differ by the same offsets across a boundary)."""
    rng = np.random.default_rng(3)
    a = rng.integers(0, 10**7, 20_000)
    b = rng.integers(0, 10**7, 20_000)
    a, b = a[a != b], b[a != b]
    assert (centre_takes_pair(a, b) != centre_takes_pair(b, a)).all()
    assert 0.47 < centre_takes_pair(a, b).mean() < 0.53
    low = np.arange(5_000)
    for offset in (1, 2, 3, 4, 5, 80, 1600, 31_999):
        share = centre_takes_pair(low, low + offset).mean()
        assert 0.45 < share < 0.55, (offset, share)


def test_centre_takes_pair_is_the_documented_hash() -> None:
    """The compiled hash equals its arithmetic done in Python's integers: ranks running
    the same code agree, and so do ids near 2**63 (no signed overflow)."""
    rng = np.random.default_rng(8)
    a = np.concatenate([rng.integers(0, 2**40, 500), [0, 1, 2**63 - 1]])
    b = np.concatenate([rng.integers(0, 2**40, 500), [2**63 - 2, 0, 5]])
    expected = [_takes_in_python(int(x), int(y)) for x, y in zip(a, b, strict=True)]
    np.testing.assert_array_equal(centre_takes_pair(a, b), expected)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_pairs_once_keeps_taken_ghost_edges_grouped_then_owned_edges(dtype) -> None:
    """Against numpy: of the edges to ghosts those the centre's rank takes, stably
    sorted by ghost, then every edge between owned nodes in list order; rows past the
    nodes (folded images) count as their node."""
    rng = np.random.default_rng(9)
    n_owned, n_nodes, n_rows, n_edges = 50, 80, 110, 4_000
    ids = rng.permutation(10_000)[:n_nodes].astype(np.int64)
    node = np.concatenate([np.arange(n_nodes), rng.integers(0, n_nodes, n_rows - n_nodes)])
    centre = rng.integers(0, n_owned, n_edges).astype(dtype)
    rows = rng.integers(0, n_rows, n_edges).astype(dtype)
    kept_centre, kept_rows = pairs_once(centre, rows, node, ids, n_owned)

    neighbour = node[rows]
    to_ghost = np.flatnonzero(
        (neighbour >= n_owned) & centre_takes_pair(ids[centre], ids[neighbour])
    )
    to_ghost = to_ghost[np.argsort(neighbour[to_ghost], kind="stable")]
    order = np.concatenate([to_ghost, np.flatnonzero(neighbour < n_owned)])
    assert kept_centre.dtype == kept_rows.dtype == dtype
    np.testing.assert_array_equal(kept_centre, centre[order])
    np.testing.assert_array_equal(kept_rows, rows[order])
    assert 0 < len(to_ghost) < (neighbour >= n_owned).sum()


def test_pairs_once_of_no_edges_and_no_ghosts() -> None:
    empty = np.zeros(0, np.int32)
    kept = pairs_once(empty, empty, np.arange(3), np.arange(3), 3)
    assert [len(k) for k in kept] == [0, 0]
    centre, rows = np.array([0, 1], np.int32), np.array([1, 2], np.int32)
    kept = pairs_once(centre, rows, np.arange(3), np.array([7, 5, 6]), 3)
    np.testing.assert_array_equal(kept, [centre, rows])
