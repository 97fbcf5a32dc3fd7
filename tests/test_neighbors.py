"""Serial checks of the non-periodic full neighbour list against brute force and vesin."""


from __future__ import annotations

import numpy as np
import pytest
import torch

from ase_shard import neighbors
from ase_shard.cell_list import _stencil, cell_list_pairs, has_empty_slab
from ase_shard.neighbors import _cell_list_pairs, _may_have_gaps, neighbor_pairs


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


PATHS = ("numba", "vesin", "torch")


def _all_paths(
    points: np.ndarray, cutoff: float, n_centres: int | None = None
) -> dict[str, torch.Tensor]:
    """Pairs from the compiled cell list, vesin and the torch cell list (run on the CPU)."""
    positions = torch.from_numpy(points)
    return {
        path: neighbor_pairs(positions, cutoff, n_centres, neighbor_list=path) for path in PATHS
    }


def _centred(pairs: np.ndarray, n_centres: int) -> np.ndarray:
    """Sorted ``(E, 2)`` pairs less those centred on a row ``>= n_centres``."""
    return pairs[pairs[:, 0] < n_centres]


@pytest.mark.parametrize("kind", ["uniform", "clusters", "sheet"])
@pytest.mark.parametrize("n", [0, 1, 2, 50, 500])
@pytest.mark.parametrize("cutoff", [0.7, 3.0, 500.0])
def test_pairs_match_brute_force(kind: str, n: int, cutoff: float) -> None:
    """Every path gives exactly the brute-force list, including a cutoff beyond the cloud,
    and with centres restricted to the first rows just its pairs centred on them."""
    points = _cloud(kind, n, seed=n)
    expected = _brute_force(points, cutoff)
    for n_centres in (None, 0, n // 3, n):
        want = expected if n_centres is None else _centred(expected, n_centres)
        for name, pairs in _all_paths(points, cutoff, n_centres).items():
            np.testing.assert_array_equal(_sorted_pairs(pairs), want, err_msg=name)


@pytest.mark.parametrize("ratio", [0.3, 0.5, 0.62, 0.8, 1.0, 1.7])
def test_stencil_visits_exactly_the_bins_in_reach(ratio: float) -> None:
    """A centre visits a bin at offset ``(da, db, dc)`` exactly when the nearest points of
    the two bins lie closer than the cutoff: per axis ``max(|d| - 1, 0)`` widths apart."""
    cutoff = 3.0
    width = ratio * cutoff
    reach, z_reach = _stencil(cutoff, width)
    offsets = np.arange(-reach - 2, reach + 3)
    for da in offsets:
        for db in offsets:
            for dc in offsets:
                gaps = np.maximum(np.abs([da, db, dc]) - 1, 0) * width
                in_reach = float(gaps @ gaps) < cutoff**2
                visited = (
                    max(abs(da), abs(db)) <= reach and abs(dc) <= z_reach[abs(da), abs(db)]
                )
                assert visited == in_reach, (ratio, da, db, dc)


@pytest.mark.parametrize("kind", ["uniform", "clusters", "sheet"])
@pytest.mark.parametrize("cutoff", [0.7, 3.0])
def test_once_by_lists_one_direction_of_each_pair(kind: str, cutoff: float) -> None:
    """With ``once_by`` (rows mapped to nodes, as a rank's periodic images are), every path
    gives exactly the brute-force pairs ``(i, j)`` with ``once_by[j] >= i``: of two
    centres' pair the edge from the lower, every edge to a higher node's row, both
    edges between a node and an image of itself."""
    points = _cloud(kind, 400, seed=7)
    rng = np.random.default_rng(8)
    # the first 300 rows are nodes; the last 100 rows are images of random ones
    node = np.concatenate([np.arange(300), rng.integers(0, 300, 100)])
    expected = _brute_force(points, cutoff)
    for n_centres in (300, 120):
        want = _centred(expected, n_centres)
        want = want[node[want[:, 1]] >= want[:, 0]]
        for path in PATHS:
            pairs = neighbor_pairs(
                torch.from_numpy(points), cutoff, n_centres, path, once_by=torch.from_numpy(node)
            )
            np.testing.assert_array_equal(_sorted_pairs(pairs), want, err_msg=path)
    assert len(want) > 0


@pytest.mark.parametrize("path", PATHS)
def test_int32_pairs_are_the_int64_ones(path: str) -> None:
    """``dtype=torch.int32`` gives the same pairs in the same order, with and without
    ``once_by``."""
    points = _cloud("uniform", 400, seed=11)
    node = np.concatenate([np.arange(300), np.random.default_rng(12).integers(0, 300, 100)])
    for once_by in (None, torch.from_numpy(node)):
        wide = neighbor_pairs(torch.from_numpy(points), 3.0, 300, path, once_by=once_by)
        narrow = neighbor_pairs(
            torch.from_numpy(points), 3.0, 300, path, once_by=once_by, dtype=torch.int32
        )
        assert narrow.dtype == torch.int32 and narrow.shape[1] > 0
        np.testing.assert_array_equal(narrow.numpy(), wide.numpy())


@pytest.mark.parametrize("kind", ["uniform", "clusters", "sheet"])
@pytest.mark.parametrize("slab", [7, 60])
def test_slabs_give_the_same_pairs(kind: str, slab: int, monkeypatch) -> None:
    """Blocks beyond ``VESIN_SLAB`` points are searched by slabs: still exactly brute force,
    ties at slab bounds included (a lattice has many equal coordinates), centres too."""
    monkeypatch.setattr(neighbors, "VESIN_SLAB", slab)
    lattice = np.stack(np.meshgrid(*[np.arange(5.0)] * 3), axis=-1).reshape(-1, 3) * 1.1
    for points in (_cloud(kind, 500, seed=3), lattice):
        for cutoff in (0.7, 1.2, 3.0):
            expected = _brute_force(points, cutoff)
            for n_centres in (None, 70):
                got = _sorted_pairs(neighbor_pairs(torch.from_numpy(points), cutoff, n_centres))
                want = expected if n_centres is None else _centred(expected, n_centres)
                np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("chunk", [1, 7, 300])
def test_cell_list_chunks_give_the_same_pairs(chunk: int, monkeypatch) -> None:
    """Candidates searched a chunk at a time, items straddling chunk bounds, are still
    exactly brute force."""
    monkeypatch.setattr(neighbors, "CELL_CHUNK", chunk)
    monkeypatch.setattr(neighbors, "CELL_CHUNKS", 10_000)
    points = _cloud("clusters", 400, seed=5)
    expected = _brute_force(points, 2.0)
    for n_centres in (None, 150):
        pairs = neighbor_pairs(torch.from_numpy(points), 2.0, n_centres, neighbor_list="torch")
        want = expected if n_centres is None else _centred(expected, n_centres)
        np.testing.assert_array_equal(_sorted_pairs(pairs), want)


@pytest.mark.parametrize("kind", ["uniform", "clusters"])
def test_full_list_symmetric(kind: str) -> None:
    """Every (i, j) comes with (j, i); no self pairs; not empty."""
    points = _cloud(kind, 300, seed=1)
    for name, pairs in _all_paths(points, 2.5).items():
        ij = _sorted_pairs(pairs)
        assert len(ij) > 0, name
        assert np.all(ij[:, 0] != ij[:, 1]), name
        ji = ij[:, ::-1]
        np.testing.assert_array_equal(ji[np.lexsort((ji[:, 1], ji[:, 0]))], ij, err_msg=name)


def test_cutoff_beyond_cloud_is_complete_graph() -> None:
    """A cutoff larger than the cloud gives all n (n - 1) ordered pairs."""
    points = _cloud("uniform", 40, seed=2)
    for name, pairs in _all_paths(points, 100.0).items():
        assert pairs.shape == (2, 40 * 39), name


def test_coincident_and_boundary_points() -> None:
    """Coincident points pair up; distance exactly ``cutoff`` does not; bin edges are exact."""
    points = np.array(
        [[0, 0, 0], [0, 0, 0], [2, 0, 0], [4, 0, 0], [3.9999, 0, 0], [5.9999, 0, 2], [6, 0, 0]],
        dtype=np.float64,
    )
    expected = _brute_force(points, 2.0)
    assert [0, 2] not in expected.tolist() and [3, 4] in expected.tolist()
    for name, pairs in _all_paths(points, 2.0).items():
        np.testing.assert_array_equal(_sorted_pairs(pairs), expected, err_msg=name)


def test_float32_and_grad_inputs() -> None:
    """Single precision and tensors requiring grad are accepted; pairs follow the values."""
    points = _cloud("clusters", 200, seed=3).astype(np.float32)
    expected = _brute_force(points.astype(np.float64), 1.5)
    positions = torch.from_numpy(points).requires_grad_(True)
    for path in PATHS:
        pairs = neighbor_pairs(positions, 1.5, neighbor_list=path)
        np.testing.assert_array_equal(_sorted_pairs(pairs), expected, err_msg=path)


def test_far_apart_groups() -> None:
    """Empty gaps of 1e9 Å: the pairs are the brute-force ones, no overflow."""
    rng = np.random.default_rng(4)
    points = rng.uniform(0.0, 6.0, (40, 3))
    points[30:] += [1e9, -3e8, 5e6]  # a second group far away
    points[35:] += [0.0, 0.0, 1e9]
    expected = _brute_force(points, 2.5)
    for name, pairs in _all_paths(points, 2.5).items():
        np.testing.assert_array_equal(_sorted_pairs(pairs), expected, err_msg=name)


def test_cell_list_keys_do_not_overflow() -> None:
    """Groups 1e9 Å apart on every axis, gaps left open: one key of x, y and z bins would
    need ~1e27 values; the two-level keys stay exact."""
    rng = np.random.default_rng(6)
    points = rng.uniform(0.0, 5.0, (60, 3)) + 1e9 * rng.integers(0, 2, (60, 3))
    got = _cell_list_pairs(torch.from_numpy(points), 2.0, len(points))
    np.testing.assert_array_equal(_sorted_pairs(got), _brute_force(points, 2.0))
    # the compiled cell list widens its bins instead: a few bins, still exact
    got = torch.from_numpy(cell_list_pairs(points, 2.0, len(points)))
    np.testing.assert_array_equal(_sorted_pairs(got), _brute_force(points, 2.0))


def test_dense_cluster_beyond_the_first_guess() -> None:
    """A tight cluster in a wide, empty box holds far more pairs than its mean density
    predicts: the compiled cell list goes on from the centre that did not fit, into
    more room, and every pair is listed once."""
    points = np.random.default_rng(12).normal(0.0, 0.2, (400, 3))
    points[0] = [300.0, 0.0, 0.0]
    got = torch.from_numpy(cell_list_pairs(points, 1.5, len(points)))
    assert got.shape[1] > 1024 + 1.5 * 400  # beyond what was allocated first
    np.testing.assert_array_equal(_sorted_pairs(got), _brute_force(points, 1.5))


@pytest.mark.parametrize("dense_cluster", [False, True])
def test_compiled_list_holds_no_spare_room(dense_cluster: bool) -> None:
    """The list's memory is its pairs only: the room sized ahead of the search is given
    back (one sweep), or the sweeps' parts are joined into a list of their size; the
    pairs are those of a brute-force search, each once."""
    if dense_cluster:  # as above: two sweeps
        points = np.random.default_rng(12).normal(0.0, 0.2, (400, 3))
        points[0] = [300.0, 0.0, 0.0]
    else:
        points = _gas(2000)
    pairs = cell_list_pairs(points, 3.0, len(points), np.arange(len(points)), np.int32)
    owner = pairs if pairs.base is None else pairs.base
    assert owner.nbytes == pairs.nbytes == 2 * pairs.shape[1] * 4
    expected = _brute_force(points, 3.0)
    expected = expected[expected[:, 0] < expected[:, 1]]
    got = _sorted_pairs(torch.from_numpy(pairs.astype(np.int64)))
    np.testing.assert_array_equal(got, expected)


def _gas(n: int) -> np.ndarray:
    """Uniform random points in a 30 Å box."""
    return np.random.default_rng(7).uniform(0.0, 30.0, (n, 3))


def _diagonal_chain(n: int) -> np.ndarray:
    """Points 1 Å apart along the body diagonal: a dense grid would need ~n^3 bins."""
    jitter = np.random.default_rng(8).normal(0.0, 0.05, (n, 3))
    return np.arange(n)[:, None] * np.full(3, 1 / np.sqrt(3)) + jitter


def _slab_with_vacuum(n: int) -> np.ndarray:
    """A 10 Å slab and its image across 30 Å of vacuum, as a folded periodic image gives."""
    slab = np.random.default_rng(9).uniform(0.0, [20.0, 20.0, 10.0], (n // 2, 3))
    return np.concatenate([slab, slab + [0.0, 0.0, 40.0]])


def _cluster_and_far_point(n: int) -> np.ndarray:
    """A 3 Å Gaussian cluster with its middle row moved 1e9 Å away (none if ``n == 0``)."""
    points = np.random.default_rng(10).normal(0.0, 3.0, (n, 3))
    points[n // 2 : n // 2 + 1] = [1e9, -2e8, 3e7]
    return points


@pytest.mark.parametrize(
    "geometry", [_gas, _diagonal_chain, _slab_with_vacuum, _cluster_and_far_point]
)
@pytest.mark.parametrize("n", [0, 1, 2_000])
def test_cell_lists_match_vesin(geometry, n: int) -> None:
    """Both cell lists find vesin's pairs, all centres or the first third."""
    points = geometry(n)
    for n_centres in (None, n // 3):
        paths = _all_paths(points, 3.0, n_centres)
        for path in ("numba", "torch"):
            np.testing.assert_array_equal(
                _sorted_pairs(paths[path]), _sorted_pairs(paths["vesin"]), err_msg=path
            )
        if n > 2:  # not a vacuous comparison
            assert paths["vesin"].shape[1] > 0


@pytest.mark.parametrize(
    "geometry", [_gas, _diagonal_chain, _slab_with_vacuum, _cluster_and_far_point]
)
@pytest.mark.parametrize("n", [2, 2_000])
@pytest.mark.parametrize("cutoff", [0.5, 3.0])
def test_compiled_gap_test_agrees_with_torch(geometry, n: int, cutoff: float) -> None:
    """The host paths' compiled test for empty slabs answers as the torch one does."""
    points = geometry(n)
    want = _may_have_gaps(torch.from_numpy(points), cutoff)
    assert has_empty_slab(points, 4.0 * cutoff) == want
    if geometry in (_slab_with_vacuum, _cluster_and_far_point) and n > 2:
        assert want  # not vacuous: both kinds of answer are checked


def test_default_is_numba_on_cpu() -> None:
    """CPU tensors go to the compiled cell list unchanged: the same pairs in the same order."""
    positions = torch.from_numpy(_gas(500))
    assert torch.equal(
        neighbor_pairs(positions, 3.0), neighbor_pairs(positions, 3.0, None, "numba")
    )


def test_invalid_arguments() -> None:
    """An unknown search, or centres beyond the rows, is a ValueError."""
    positions = torch.from_numpy(_gas(10))
    with pytest.raises(ValueError, match="neighbor_list"):
        neighbor_pairs(positions, 3.0, neighbor_list="cuda")
    for n_centres in (-1, 11):
        with pytest.raises(ValueError, match="n_centres"):
            neighbor_pairs(positions, 3.0, n_centres)


@pytest.mark.timeout(120)
def test_large_block_matches_vesin() -> None:
    """256,000 rows of fcc Cu (3.61 Å, rattled) at EMT-like cutoff 5.5 Å: 13 M pairs,
    the same set from every search (the torch path chunked at scale). About 15 s."""
    k = 40
    basis = np.array([[0, 0, 0], [0, 0.5, 0.5], [0.5, 0, 0.5], [0.5, 0.5, 0]])
    cells = np.stack(np.meshgrid(*[np.arange(k)] * 3, indexing="ij"), axis=-1).reshape(-1, 1, 3)
    points = ((cells + basis) * 3.61).reshape(-1, 3)
    points += np.random.default_rng(11).normal(0.0, 0.02, points.shape)
    n = len(points)
    keys = {}
    for path in PATHS:
        pairs = neighbor_pairs(torch.from_numpy(points), 5.5, neighbor_list=path).numpy()
        keys[path] = np.sort(pairs[0] * n + pairs[1])
        del pairs
    assert len(keys["vesin"]) > 50 * n
    np.testing.assert_array_equal(keys["torch"], keys["vesin"])
    np.testing.assert_array_equal(keys["numba"], keys["vesin"])
