"""Serial checks of the non-periodic full neighbour list against brute force."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ase_shard.neighbors import _cell_list_pairs, close_gaps, neighbor_pairs


def _brute_force(points: np.ndarray, cutoff: float) -> np.ndarray:
    """All ordered pairs ``i != j`` closer than ``cutoff``, lexicographically sorted."""
    dist = np.linalg.norm(points[:, None] - points[None], axis=-1)
    close = (dist < cutoff) & ~np.eye(len(points), dtype=bool)
    return np.argwhere(close).astype(np.int64)  # argwhere is row-major: already sorted


def _sorted_pairs(pairs: torch.Tensor) -> np.ndarray:
    """``(2, E)`` pairs as lexicographically sorted ``(E, 2)``; duplicates kept."""
    assert pairs.dtype == torch.int64
    assert pairs.device.type == "cpu"
    assert pairs.ndim == 2 and pairs.shape[0] == 2
    ij = pairs.numpy().T
    return ij[np.lexsort((ij[:, 1], ij[:, 0]))]


def _cloud(kind: str, n: int, seed: int) -> np.ndarray:
    """Uniform box, a few tight clusters far apart, or a flat sheet, in Å."""
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        return rng.uniform(0.0, 12.0, (n, 3))
    if kind == "clusters":
        centres = rng.uniform(-40.0, 40.0, (4, 3))
        return centres[rng.integers(0, 4, n)] + rng.normal(0.0, 0.8, (n, 3))
    return np.column_stack([rng.uniform(-20, 20, (n, 2)), rng.normal(0, 0.05, n)])


def _both_paths(points: np.ndarray, cutoff: float) -> dict[str, torch.Tensor]:
    """The vesin path (CPU dispatch) and the torch cell list called directly."""
    positions = torch.from_numpy(points)
    paths = {"vesin": neighbor_pairs(positions, cutoff)}
    if len(points):  # the cell list needs a point to anchor its bins
        paths["cell_list"] = _cell_list_pairs(positions, cutoff)
    return paths


@pytest.mark.parametrize("kind", ["uniform", "clusters", "sheet"])
@pytest.mark.parametrize("n", [0, 1, 2, 50, 500])
@pytest.mark.parametrize("cutoff", [0.7, 3.0, 500.0])
def test_pairs_match_brute_force(kind: str, n: int, cutoff: float) -> None:
    """Both paths give exactly the brute-force list, including a cutoff beyond the cloud."""
    points = _cloud(kind, n, seed=n)
    expected = _brute_force(points, cutoff)
    for name, pairs in _both_paths(points, cutoff).items():
        got = _sorted_pairs(pairs)
        np.testing.assert_array_equal(got, expected, err_msg=name)


@pytest.mark.parametrize("kind", ["uniform", "clusters", "sheet"])
@pytest.mark.parametrize("slab", [7, 60])
def test_slabs_give_the_same_pairs(kind: str, slab: int, monkeypatch) -> None:
    """Blocks beyond ``VESIN_SLAB`` points are searched by slabs: still exactly brute force,
    ties at slab bounds included (a lattice has many equal coordinates)."""
    from ase_shard import neighbors

    monkeypatch.setattr(neighbors, "VESIN_SLAB", slab)
    lattice = np.stack(np.meshgrid(*[np.arange(5.0)] * 3), axis=-1).reshape(-1, 3) * 1.1
    for points in (_cloud(kind, 500, seed=3), lattice):
        for cutoff in (0.7, 1.2, 3.0):
            got = _sorted_pairs(neighbor_pairs(torch.from_numpy(points), cutoff))
            np.testing.assert_array_equal(got, _brute_force(points, cutoff))


@pytest.mark.parametrize("kind", ["uniform", "clusters"])
def test_full_list_symmetric(kind: str) -> None:
    """Every (i, j) comes with (j, i); no self pairs; not empty."""
    points = _cloud(kind, 300, seed=1)
    for name, pairs in _both_paths(points, 2.5).items():
        ij = _sorted_pairs(pairs)
        assert len(ij) > 0, name
        assert np.all(ij[:, 0] != ij[:, 1]), name
        ji = ij[:, ::-1]
        np.testing.assert_array_equal(ji[np.lexsort((ji[:, 1], ji[:, 0]))], ij, err_msg=name)


def test_cutoff_beyond_cloud_is_complete_graph() -> None:
    """A cutoff larger than the cloud gives all n (n - 1) ordered pairs."""
    points = _cloud("uniform", 40, seed=2)
    for name, pairs in _both_paths(points, 100.0).items():
        assert pairs.shape == (2, 40 * 39), name


def test_coincident_and_boundary_points() -> None:
    """Coincident points pair up; distance exactly ``cutoff`` does not; bin edges are exact."""
    points = np.array(
        [[0, 0, 0], [0, 0, 0], [2, 0, 0], [4, 0, 0], [3.9999, 0, 0], [5.9999, 0, 2], [6, 0, 0]],
        dtype=np.float64,
    )
    expected = _brute_force(points, 2.0)
    assert [0, 2] not in expected.tolist() and [3, 4] in expected.tolist()
    for name, pairs in _both_paths(points, 2.0).items():
        np.testing.assert_array_equal(_sorted_pairs(pairs), expected, err_msg=name)


def test_float32_and_grad_inputs() -> None:
    """Single precision and tensors requiring grad are accepted; pairs follow the values."""
    points = _cloud("clusters", 200, seed=3).astype(np.float32)
    expected = _brute_force(points.astype(np.float64), 1.5)
    positions = torch.from_numpy(points).requires_grad_(True)
    for pairs in (neighbor_pairs(positions, 1.5), _cell_list_pairs(positions, 1.5)):
        np.testing.assert_array_equal(_sorted_pairs(pairs), expected)


def test_far_apart_groups() -> None:
    """Empty gaps of 1e9 Å: the pairs are the brute-force ones, no overflow."""
    rng = np.random.default_rng(4)
    points = rng.uniform(0.0, 6.0, (40, 3))
    points[30:] += [1e9, -3e8, 5e6]  # a second group far away
    points[35:] += [0.0, 0.0, 1e9]
    expected = _brute_force(points, 2.5)
    got = neighbor_pairs(torch.as_tensor(points), 2.5)
    np.testing.assert_array_equal(_sorted_pairs(got), expected)
    np.testing.assert_array_equal(
        _sorted_pairs(_cell_list_pairs(close_gaps(torch.as_tensor(points), 2.5), 2.5)), expected
    )
