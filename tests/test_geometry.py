"""Serial checks of the frame, owner assignment and halo selection (no MPI).

Expected values come from geometry identities, ASE's reciprocal cell and brute
force over explicit cell images, never from the code under test.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from ase.cell import Cell

from ase_shard.halo import images_near_domains, local_rows, rank_rows
from ase_shard.partition import (
    EVERY_ATOM_HERE,
    FrameCoordinates,
    OverRanks,
    balanced_cuts,
    choose_grid,
    contiguous_owners,
    frame_coordinates,
    frame_matrix,
    grouped_order,
    owners_at,
    plane_spacings,
    spatial_owners,
)

ALL_PBC = list(itertools.product((False, True), repeat=3))
GRIDS = [(1, 1, 1), (2, 1, 1), (2, 2, 1), (1, 3, 1), (2, 1, 2), (4, 1, 1)]


def _triclinic(rng: np.random.Generator, lengths=(4.0, 5.0, 6.0)) -> np.ndarray:
    """Full-rank triclinic cell: given diagonal plus random tilts."""
    return np.diag(lengths) + rng.uniform(-0.3, 0.3, (3, 3)) * np.mean(lengths)


def _periodic_fractions(points: np.ndarray, cell: np.ndarray, pbc) -> np.ndarray:
    """Fractional coordinates along the periodic cell vectors.

    The pseudo-inverse's columns are the reciprocal vectors within the span of
    the periodic vectors, so this needs no completion of the cell.
    """
    periodic = cell[np.asarray(pbc)]
    return points @ np.linalg.pinv(periodic)


# ------------------------------------------------------------------ frame


def _frame_cases() -> list[tuple[tuple[bool, bool, bool], str]]:
    cases = [(pbc, kind) for pbc in ALL_PBC for kind in ("triclinic", "zero_nonperiodic")]
    return [*cases, ((False, False, False), "zero")]


@pytest.mark.parametrize("pbc, kind", _frame_cases())
def test_frame_matrix(pbc: tuple[bool, bool, bool], kind: str) -> None:
    """Periodic rows are the cell; the rest is an orthonormal, orthogonal completion."""
    pbc = np.array(pbc)
    cell = _triclinic(np.random.default_rng(1))
    if kind == "zero_nonperiodic":
        cell[~pbc] = 0.0
    elif kind == "zero":
        cell[:] = 0.0
    frame = frame_matrix(cell, pbc)

    np.testing.assert_array_equal(frame[pbc], cell[pbc])
    free = frame[~pbc]
    np.testing.assert_allclose(free @ free.T, np.eye(len(free)), atol=1e-12)
    np.testing.assert_allclose(free @ cell[pbc].T, 0.0, atol=1e-12)
    assert np.linalg.matrix_rank(frame) == 3
    # |det| is the k-volume of the periodic vectors (Gram determinant)
    periodic = cell[pbc]
    gram_volume = np.sqrt(np.linalg.det(periodic @ periodic.T)) if pbc.any() else 1.0
    assert abs(np.linalg.det(frame)) == pytest.approx(gram_volume, rel=1e-12)


def test_plane_spacings_triclinic() -> None:
    """Spacing of lattice planes is 1 / |reciprocal vector|."""
    cell = _triclinic(np.random.default_rng(2))
    expected = 1.0 / np.linalg.norm(Cell(cell).reciprocal(), axis=1)
    np.testing.assert_allclose(plane_spacings(cell), expected, rtol=1e-12)


@pytest.mark.parametrize("pbc", ALL_PBC)
def test_plane_spacings_mixed_pbc(pbc: tuple[bool, bool, bool]) -> None:
    """Periodic axes: in-span reciprocal spacing; non-periodic axes: 1 (Å per Å)."""
    pbc = np.array(pbc)
    cell = _triclinic(np.random.default_rng(3))
    spacing = plane_spacings(frame_matrix(cell, pbc))
    if pbc.any():
        reciprocal = np.linalg.pinv(cell[pbc])
        np.testing.assert_allclose(spacing[pbc], 1.0 / np.linalg.norm(reciprocal, axis=0))
    np.testing.assert_allclose(spacing[~pbc], 1.0, rtol=1e-12)


# ------------------------------------------------------- frame coordinates


def _check_frame_coordinates(positions: np.ndarray, cell: np.ndarray, pbc: np.ndarray) -> None:
    coords = frame_coordinates(positions, cell, pbc)
    s, shift = coords.s, coords.wrap_shift
    assert s.shape == positions.shape
    assert shift.dtype == np.int64
    assert np.all(s[:, pbc] >= 0.0) and np.all(s[:, pbc] < 1.0)
    assert np.all(shift[:, ~pbc] == 0)
    wrapped = positions + shift @ cell
    np.testing.assert_allclose(wrapped, s @ frame_matrix(cell, pbc), rtol=0, atol=1e-12)
    if pbc.any():
        # independent: periodic s are the in-span fractions of the wrapped positions
        frac = _periodic_fractions(wrapped, cell, pbc)
        np.testing.assert_allclose(frac, s[:, pbc], rtol=0, atol=1e-12)
        remainder = wrapped - frac @ cell[pbc]
    else:
        remainder = wrapped
    # non-periodic s are Å along orthonormal directions: lengths are preserved
    np.testing.assert_allclose(
        np.linalg.norm(s[:, ~pbc], axis=1), np.linalg.norm(remainder, axis=1), atol=1e-12
    )


@pytest.mark.parametrize("pbc", ALL_PBC)
def test_frame_coordinates_triclinic(pbc: tuple[bool, bool, bool]) -> None:
    """Atoms inside, far outside and a hair below zero of a triclinic cell."""
    pbc = np.array(pbc)
    rng = np.random.default_rng(4)
    cell = _triclinic(rng)
    frac = np.vstack(
        [
            rng.uniform(0.0, 1.0, (20, 3)),
            rng.uniform(-12.0, 12.0, (20, 3)),
            [[-1e-17, 0.5, 0.5], [0.5, -1e-17, -1e-17], [-1e-17, -1e-17, -1e-17]],
            [[1.0, 0.0, -1.0], [3.0, -2.0, 7.0]],
        ]
    )
    _check_frame_coordinates(frac @ cell, cell, pbc)


@pytest.mark.parametrize("pbc", ALL_PBC)
def test_frame_coordinates_round_up_guard(pbc: tuple[bool, bool, bool]) -> None:
    """s = -1e-17 exactly: 1 - 1e-17 rounds to 1.0 and must be folded back to 0."""
    pbc = np.array(pbc)
    cell = np.diag([4.0, 8.0, 2.0])  # powers of two: the solve is exact
    tiny = -1e-17 * np.diag(cell)
    assert (tiny[0] / cell[0, 0]) + 1.0 == 1.0  # the case the guard exists for
    positions = np.array([tiny, [tiny[0], 1.0, 1.0], [-4e-300, -3e-18, 1.0]])
    _check_frame_coordinates(positions, cell, pbc)


def test_frame_coordinates_molecule_without_cell() -> None:
    """No cell at all: coordinates are the Cartesian positions in an orthonormal frame."""
    rng = np.random.default_rng(5)
    positions = rng.normal(0.0, 30.0, (15, 3))
    pbc = np.zeros(3, bool)
    _check_frame_coordinates(positions, np.zeros((3, 3)), pbc)
    s = frame_coordinates(positions, np.zeros((3, 3)), pbc).s
    dist = np.linalg.norm(positions[:, None] - positions[None], axis=-1)
    np.testing.assert_allclose(np.linalg.norm(s[:, None] - s[None], axis=-1), dist, atol=1e-12)


# -------------------------------------------------------------- rank grid


def _coords(positions: np.ndarray, cell: np.ndarray, pbc) -> FrameCoordinates:
    return frame_coordinates(positions, np.asarray(cell, float), np.asarray(pbc))


@pytest.mark.parametrize("n_ranks", range(1, 13))
def test_choose_grid_product(n_ranks: int) -> None:
    """The grid always multiplies to the number of ranks."""
    rng = np.random.default_rng(n_ranks)
    cell = _triclinic(rng, (9.0, 7.0, 12.0))
    for pbc in ALL_PBC:
        coords = _coords(rng.uniform(0, 1, (40, 3)) @ cell, cell, pbc)
        assert np.prod(choose_grid(coords, np.array(pbc), n_ranks, 4.0)) == n_ranks
    empty = _coords(np.zeros((0, 3)), cell, (True, True, True))
    assert np.prod(choose_grid(empty, np.ones(3, bool), n_ranks, 4.0)) == n_ranks


@pytest.mark.parametrize("halo_width", [2.0, 5.0, 8.0])
def test_choose_grid_thin_slab(halo_width: float) -> None:
    """A 20 x 20 Å slab 4 Å thick (pbc T,T,F) is never cut across its thickness."""
    rng = np.random.default_rng(6)
    cell = np.diag([20.0, 20.0, 0.0])
    positions = rng.uniform([0, 0, 10], [20, 20, 14], (200, 3))
    pbc = np.array([True, True, False])
    grid = choose_grid(_coords(positions, cell, pbc), pbc, 4, halo_width)
    assert np.prod(grid) == 4
    assert grid[2] == 1


@pytest.mark.parametrize("long_axis", [0, 1, 2])
def test_choose_grid_elongated_box(long_axis: int) -> None:
    """A 60 x 10 x 10 Å periodic box on 4 ranks is cut along its long axis only."""
    rng = np.random.default_rng(7)
    lengths = np.full(3, 10.0)
    lengths[long_axis] = 60.0
    cell = np.diag(lengths)
    positions = rng.uniform(0, 1, (300, 3)) @ cell
    grid = choose_grid(_coords(positions, cell, (True,) * 3), np.ones(3, bool), 4, 5.0)
    expected = [1, 1, 1]
    expected[long_axis] = 4
    assert tuple(grid) == tuple(expected)


# ----------------------------------------------------------------- owners


def _systems(rng: np.random.Generator, n_atoms: int) -> dict[str, FrameCoordinates]:
    """Bulk, slab and off-centre cluster frame coordinates with ``n_atoms`` atoms."""
    bulk_cell = _triclinic(rng, (8.0, 9.0, 10.0))
    bulk = rng.uniform(-0.5, 1.5, (n_atoms, 3)) @ bulk_cell
    slab = rng.uniform([0, 0, 20], [15, 15, 24], (n_atoms, 3))
    cluster = rng.normal([3.0, 28.0, 5.0], 2.0, (n_atoms, 3))
    return {
        "bulk": _coords(bulk, bulk_cell, (True, True, True)),
        "slab": _coords(slab, np.diag([15.0, 15.0, 0.0]), (True, True, False)),
        "cluster": _coords(cluster, np.diag([30.0, 30.0, 30.0]), (False, False, False)),
    }


def _assert_balanced(owners: np.ndarray, n_atoms: int, n_ranks: int) -> None:
    assert owners.shape == (n_atoms,)
    assert np.issubdtype(owners.dtype, np.integer)
    assert np.all((owners >= 0) & (owners < n_ranks))
    counts = np.bincount(owners, minlength=n_ranks)
    assert len(counts) == n_ranks
    assert set(counts) <= {n_atoms // n_ranks, -(-n_atoms // n_ranks)}


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("n_atoms", [37, 41, 103])
def test_spatial_owners_balanced(grid: tuple[int, int, int], n_atoms: int) -> None:
    """Every rank owns floor or ceil of N/P atoms, on bulk, slab and cluster."""
    rng = np.random.default_rng(n_atoms)
    for coords in _systems(rng, n_atoms).values():
        _assert_balanced(spatial_owners(coords, grid), n_atoms, int(np.prod(grid)))


@pytest.mark.parametrize("grid", GRIDS)
def test_spatial_owners_are_spatial(grid: tuple[int, int, int]) -> None:
    """Ranks are ordered slabs along axis 0, then columns along axis 1, then boxes."""
    rng = np.random.default_rng(8)
    for coords in _systems(rng, 60).values():
        owners = spatial_owners(coords, grid)
        index = np.stack(np.unravel_index(owners, grid), axis=1)
        for axis in range(3):
            # within each group of the previous axes, cuts are ordered along this axis
            outer = np.ravel_multi_index(index[:, :axis].T, grid[:axis]) if axis else 0
            outer = np.broadcast_to(outer, owners.shape)
            for group in np.unique(outer):
                sel = outer == group
                for part in range(grid[axis] - 1):
                    below = coords.s[sel & (index[:, axis] == part), axis]
                    above = coords.s[sel & (index[:, axis] > part), axis]
                    assert below.max() <= above.min()


@pytest.mark.parametrize("grid", [(4, 1, 1), (2, 2, 2), (1, 1, 5)])
@pytest.mark.parametrize("n_atoms", [0, 1, 3])
def test_spatial_owners_more_ranks_than_atoms(grid: tuple[int, int, int], n_atoms: int) -> None:
    """Fewer atoms than ranks: some ranks are empty, nothing crashes."""
    rng = np.random.default_rng(9)
    for coords in _systems(rng, n_atoms).values():
        _assert_balanced(spatial_owners(coords, grid), n_atoms, int(np.prod(grid)))


@pytest.mark.parametrize("n_ranks", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("n_atoms", [0, 1, 2, 5, 17, 64])
def test_contiguous_owners(n_atoms: int, n_ranks: int) -> None:
    """Index blocks in rank order with sizes within one of each other."""
    owners = contiguous_owners(n_atoms, n_ranks)
    _assert_balanced(owners, n_atoms, n_ranks)
    assert np.all(np.diff(owners) >= 0)


# ------------------------------------------------------------------- halo


def _halo_case(seed: int, pbc: np.ndarray, n_atoms: int) -> tuple[np.ndarray, np.ndarray]:
    """Random triclinic cell with one short axis; atoms spread over several images.

    Non-periodic cell vectors are zeroed for odd seeds.
    """
    rng = np.random.default_rng(seed)
    lengths = rng.permutation([2.5, 5.0, 7.0])
    full = _triclinic(rng, lengths)
    positions = rng.uniform(-1.0, 2.0, (n_atoms, 3)) @ full
    cell = full.copy()
    if seed % 2:
        cell[~pbc] = 0.0
    return positions, cell


def _expected_halo(
    positions: np.ndarray, cell: np.ndarray, pbc: np.ndarray, centres: np.ndarray, width: float
) -> set[tuple[int, ...]]:
    """Brute force: every (id, shift) image within ``width`` of some centre."""
    if len(centres) == 0:
        return set()
    if pbc.any():
        frac = _periodic_fractions(positions, cell, pbc)
        spacing = 1.0 / np.linalg.norm(np.linalg.pinv(cell[pbc]), axis=0)
        reach = int(np.ceil(width / spacing.min())) + 2
    else:
        frac = np.zeros((len(positions), 0))
        reach = 0
    base = np.zeros((len(positions), 3), dtype=np.int64)
    base[:, pbc] = -np.floor(frac)  # shift that puts each atom in the home cell
    expected = set()
    offsets = [range(-reach, reach + 1) if p else range(1) for p in pbc]
    for offset in itertools.product(*offsets):
        shift = base + np.array(offset)
        images = positions + shift @ cell
        dist = np.linalg.norm(images[:, None] - centres[None], axis=-1).min(axis=1)
        hits = np.flatnonzero(dist <= width)
        if len(hits) and reach and np.abs(offset).max() == reach:
            raise AssertionError("oracle image range too small")
        expected.update((int(i), *map(int, shift[i])) for i in hits)
    return expected


def _halo_params() -> list[tuple]:
    params = []
    for seed, pbc in enumerate(ALL_PBC):
        for partition in ("spatial", "contiguous"):
            for n_ranks in (1, 2, 3, 4):
                params.append((seed, pbc, partition, n_ranks, 24))
    params += [(11, (True,) * 3, "spatial", 4, 3), (12, (True, False, True), "contiguous", 4, 2)]
    return params


@pytest.mark.parametrize("seed, pbc, partition, n_ranks, n_atoms", _halo_params())
def test_rank_rows_halo(
    seed: int, pbc: tuple[bool, bool, bool], partition: str, n_ranks: int, n_atoms: int
) -> None:
    """Halo completeness and row bookkeeping with a halo wider than the short axis."""
    pbc = np.array(pbc)
    width = 4.5  # beyond the 2.5 Å axis: several images per atom are needed
    positions, cell = _halo_case(seed, pbc, n_atoms)
    coords = frame_coordinates(positions, cell, pbc)
    if partition == "spatial":
        grid = choose_grid(coords, pbc, n_ranks, width)
        owners = spatial_owners(coords, grid)
    else:
        owners = contiguous_owners(n_atoms, n_ranks)
    rows = rank_rows(coords, pbc, owners, n_ranks, width)
    assert len(rows) == n_ranks

    owned_all = np.concatenate([r.ids[: r.n_owned] for r in rows])
    np.testing.assert_array_equal(np.sort(owned_all), np.arange(n_atoms))
    for rank, r in enumerate(rows):
        assert r.ids.dtype == np.int64 and r.image_shift.dtype == np.int64
        assert r.image_shift.shape == (len(r.ids), 3)
        assert np.all(r.image_shift[:, ~pbc] == 0)
        mine = np.flatnonzero(owners == rank)
        np.testing.assert_array_equal(np.sort(r.ids[: r.n_owned]), mine)
        if len(mine) == 0:
            assert len(r.ids) == 0
            continue
        keys = [(int(i), *map(int, n)) for i, n in zip(r.ids, r.image_shift, strict=True)]
        assert len(set(keys)) == len(keys), "duplicate (id, shift) rows"

        row_pos = positions[r.ids] + r.image_shift @ cell
        owned_pos = row_pos[: r.n_owned]
        if pbc.any():
            frac = _periodic_fractions(owned_pos, cell, pbc)
            assert np.all(frac > -1e-12) and np.all(frac < 1.0 + 1e-12)
        missing = _expected_halo(positions, cell, pbc, owned_pos, width) - set(keys)
        assert not missing, f"rank {rank} lacks images {sorted(missing)[:5]}"


@pytest.mark.parametrize("fold_foreign", [False, True])
@pytest.mark.parametrize("seed, pbc, partition, n_ranks, n_atoms", _halo_params()[::5])
def test_rank_rows_nodes_and_exchange_plan(
    seed: int, pbc, partition: str, n_ranks: int, n_atoms: int, fold_foreign: bool
) -> None:
    """Nodes: owned, then ghosts by owner; images fold onto a node of the same atom."""
    pbc = np.array(pbc)
    positions, cell = _halo_case(seed, pbc, n_atoms)
    coords = frame_coordinates(positions, cell, pbc)
    if partition == "spatial":
        owners = spatial_owners(coords, choose_grid(coords, pbc, n_ranks, 4.5))
    else:
        owners = contiguous_owners(n_atoms, n_ranks)
    rows = rank_rows(coords, pbc, owners, n_ranks, 4.5, fold_foreign)
    for rank, r in enumerate(rows):
        ghost_ids = r.ids[r.n_owned : r.n_nodes]
        np.testing.assert_array_equal(r.node[: r.n_nodes], np.arange(r.n_nodes))
        # every row is an image of its node's atom; no node is an owned atom's image
        np.testing.assert_array_equal(r.ids[r.node], r.ids)
        assert np.all(owners[ghost_ids] != rank)
        assert np.all(np.diff(owners[ghost_ids]) >= 0)
        if fold_foreign:
            assert len(np.unique(ghost_ids)) == len(ghost_ids)
        else:
            assert np.all(owners[r.ids[r.n_nodes :]] == rank)
        np.testing.assert_array_equal(
            r.recv_counts, np.bincount(owners[ghost_ids], minlength=n_ranks)
        )
    # what each rank sends is exactly the ghost nodes the receivers expect, in order
    for receiver, r in enumerate(rows):
        expected = r.ids[r.n_owned : r.n_nodes]
        received = []
        for sender, s in enumerate(rows):
            offset = s.send_counts[:receiver].sum()
            index = s.send_index[offset : offset + s.send_counts[receiver]]
            received.append(s.ids[index])
            assert s.send_counts[receiver] == r.recv_counts[sender]
        np.testing.assert_array_equal(np.concatenate(received), expected)


@pytest.mark.parametrize("seed, pbc, partition, n_ranks, n_atoms", _halo_params()[::3])
def test_images_near_domains_are_the_ghosts(
    seed: int, pbc, partition: str, n_ranks: int, n_atoms: int
) -> None:
    """What owners send (distributed atoms) is exactly each rank's own ghost search.

    Every rank holds only its own atoms; the images each sends to each
    receiver must be that receiver's ghost rows from :func:`local_rows`,
    which looks at every atom.
    """
    pbc = np.array(pbc)
    width = 4.5
    positions, cell = _halo_case(seed, pbc, n_atoms)
    coords = frame_coordinates(positions, cell, pbc)
    if partition == "spatial":
        owners = spatial_owners(coords, choose_grid(coords, pbc, n_ranks, width))
    else:
        owners = contiguous_owners(n_atoms, n_ranks)
    lo = np.full((n_ranks, 3), np.inf)
    hi = np.full((n_ranks, 3), -np.inf)
    for rank in np.unique(owners):
        lo[rank], hi[rank] = coords.s[owners == rank].min(0), coords.s[owners == rank].max(0)
    sent = {rank: set() for rank in range(n_ranks)}
    for sender in range(n_ranks):
        mine = np.flatnonzero(owners == sender)
        local = frame_coordinates(positions[mine], cell, pbc)
        dest, place, shift = images_near_domains(local, pbc, lo, hi, sender, width)
        assert np.all(np.diff(dest) >= 0)
        for rank, atom, image in zip(dest, mine[place], shift, strict=True):
            sent[int(rank)].add((int(atom), *map(int, image)))
    for rank in range(n_ranks):
        rows = local_rows(coords, pbc, owners, rank, n_ranks, width)
        ghosts = zip(rows.ids[rows.n_owned :], rows.image_shift[rows.n_owned :], strict=True)
        assert sent[rank] == {(int(i), *map(int, n)) for i, n in ghosts}


def test_rank_rows_empty_system() -> None:
    """No atoms: every rank gets no rows."""
    pbc = np.ones(3, bool)
    coords = frame_coordinates(np.zeros((0, 3)), np.eye(3) * 5.0, pbc)
    rows = rank_rows(coords, pbc, np.zeros(0, np.int64), 3, 2.0)
    assert [len(r.ids) for r in rows] == [0, 0, 0]
    assert [r.n_owned for r in rows] == [0, 0, 0]


def _rows_by_brute_force(
    coords: FrameCoordinates, pbc: np.ndarray, owners: np.ndarray, n_ranks: int, width: float
) -> list[set[tuple[int, ...]]]:
    """Every (id, shift) whose image lies in its rank's widened box, trying all images.

    The box is the frame-coordinate bounding box of the rank's atoms widened
    by ``width`` (Å on non-periodic axes, ``width`` over the plane spacing on
    periodic ones); images are tried one cell beyond the farthest reach.
    """
    frac_width = np.where(pbc, width / coords.spacing, width)
    reach = np.ceil(frac_width).astype(int) + 1
    offsets = [range(-r, r + 1) if p else range(1) for r, p in zip(reach, pbc, strict=True)]
    expected = []
    for rank in range(n_ranks):
        mine = coords.s[owners == rank]
        found: set[tuple[int, ...]] = set()
        if len(mine):
            lo, hi = mine.min(axis=0) - frac_width, mine.max(axis=0) + frac_width
            for image in itertools.product(*offsets):
                points = coords.s + np.array(image)
                hits = np.flatnonzero(np.all((points >= lo) & (points <= hi), axis=1))
                shifts = coords.wrap_shift[hits] + np.array(image)
                found.update((int(i), *map(int, n)) for i, n in zip(hits, shifts, strict=True))
        expected.append(found)
    return expected


def _search_case(kind: str, pbc: np.ndarray, seed: int) -> tuple[FrameCoordinates, float]:
    """Frame coordinates and halo width of one random system.

    ``skewed``: strongly tilted cell; ``tiny``: cell axes shorter than the
    halo, so atoms need several images; ``sparse``: few atoms far apart with a
    thin halo (more ideal search cells than atoms); ``flat``: a sheet of zero
    thickness along axis 2. Non-periodic cell vectors are zeroed for odd seeds.
    """
    rng = np.random.default_rng(seed)
    if kind == "skewed":
        cell = np.diag([6.0, 7.0, 8.0]) + rng.uniform(-0.6, 0.6, (3, 3)) * 7.0
        positions, width = rng.uniform(-0.5, 1.5, (40, 3)) @ cell, 3.0
    elif kind == "tiny":
        cell = _triclinic(rng, rng.permutation([1.2, 2.0, 3.1]))
        positions, width = rng.uniform(-1.0, 2.0, (12, 3)) @ cell, 4.5
    elif kind == "sparse":
        cell = _triclinic(rng, (60.0, 70.0, 80.0))
        positions, width = rng.uniform(0.0, 1.0, (9, 3)) @ cell, 1.0
    else:
        cell = np.diag([20.0, 20.0, 20.0])
        positions, width = rng.uniform(0.0, 20.0, (30, 3)) * [1.0, 1.0, 0.0], 2.0
    if seed % 2:
        cell[~pbc] = 0.0
    return frame_coordinates(positions, cell, pbc), width


def _owners(
    coords: FrameCoordinates, pbc: np.ndarray, partition: str, n_ranks: int, width: float
) -> np.ndarray:
    """Owner ranks; ``random`` makes overlapping boxes and often empty ranks."""
    n_atoms = len(coords.s)
    if partition == "spatial":
        return spatial_owners(coords, choose_grid(coords, pbc, n_ranks, width))
    if partition == "contiguous":
        return contiguous_owners(n_atoms, n_ranks)
    if partition == "random":
        return np.random.default_rng(n_ranks).integers(0, n_ranks, n_atoms)
    # idle_root: rank 0 drives and owns nothing, as in notebook mode
    return contiguous_owners(n_atoms, max(n_ranks - 1, 1)) + (n_ranks > 1)


@pytest.mark.parametrize("kind", ["skewed", "tiny", "sparse", "flat"])
@pytest.mark.parametrize("pbc", ALL_PBC)
def test_rank_rows_match_brute_force(kind: str, pbc: tuple[bool, bool, bool]) -> None:
    """Each rank's rows are exactly the images in its widened box, owned rows first."""
    pbc = np.array(pbc)
    for seed, (n_ranks, partition) in enumerate(
        itertools.product(range(1, 5), ("spatial", "contiguous", "random", "idle_root"))
    ):
        coords, width = _search_case(kind, pbc, seed)
        owners = _owners(coords, pbc, partition, n_ranks, width)
        expected = _rows_by_brute_force(coords, pbc, owners, n_ranks, width)
        for fold_foreign in (False, True):
            rows = rank_rows(coords, pbc, owners, n_ranks, width, fold_foreign)
            for rank, r in enumerate(rows):
                keys = [(int(i), *map(int, n)) for i, n in zip(r.ids, r.image_shift, strict=True)]
                assert len(set(keys)) == len(keys), "duplicate (id, shift) rows"
                assert set(keys) == expected[rank], (seed, n_ranks, partition, rank)
                owned = r.ids[: r.n_owned]
                np.testing.assert_array_equal(np.sort(owned), np.flatnonzero(owners == rank))
                np.testing.assert_array_equal(r.image_shift[: r.n_owned], coords.wrap_shift[owned])
                # what a rank finds alone (SPMD) is what the all-rank search gives it
                alone = local_rows(coords, pbc, owners, rank, n_ranks, width, fold_foreign)
                for field in ("ids", "image_shift", "node", "recv_counts", "requests"):
                    np.testing.assert_array_equal(getattr(alone, field), getattr(r, field))
                assert (alone.n_owned, alone.n_nodes) == (r.n_owned, r.n_nodes)


def test_rank_rows_many_atoms_thin_halo() -> None:
    """More ideal search cells than the grid allows: rows still match brute force."""
    rng = np.random.default_rng(13)
    pbc = np.zeros(3, bool)
    coords = frame_coordinates(rng.uniform(0.0, 60.0, (70_000, 3)), np.zeros((3, 3)), pbc)
    owners = spatial_owners(coords, (3, 1, 1))
    expected = _rows_by_brute_force(coords, pbc, owners, 3, 0.3)
    for rank, r in enumerate(rank_rows(coords, pbc, owners, 3, 0.3)):
        keys = {(int(i), *map(int, n)) for i, n in zip(r.ids, r.image_shift, strict=True)}
        assert len(keys) == len(r.ids)
        assert keys == expected[rank]


def test_checksum_sees_one_changed_bit() -> None:
    from ase_shard.system import checksum

    values = np.random.default_rng(3).normal(size=(1000, 3))
    changed = values.copy()
    changed[517, 1] = np.nextafter(changed[517, 1], np.inf)
    assert checksum(values) == checksum(values.copy())
    assert checksum(values) != checksum(changed)
    assert checksum(np.arange(5)) != checksum(np.arange(6))


def _expected_owners(
    s: np.ndarray, ids: np.ndarray, weights: np.ndarray, grid: tuple[int, int, int]
) -> np.ndarray:
    """The rule by its definition, atom by atom: along each axis, within each group, an
    atom goes to part ``floor(W parts / total)``, ``W`` the weight before it in the
    order of ``(coordinate, id)``."""
    group = np.zeros(len(s), dtype=np.int64)
    for axis, parts in enumerate(grid):
        label = np.zeros(len(s), dtype=np.int64)
        for g in np.unique(group):
            members = np.flatnonzero(group == g)
            order = members[np.lexsort((ids[members], s[members, axis]))]
            before = np.cumsum(weights[order]) - weights[order]
            label[order] = before * parts // weights[members].sum()
        group = group * parts + label
    return group


class _ThreadRanks:
    """``ranks`` threads standing in for MPI ranks: the two collectives of
    :class:`OverRanks` by a barrier and shared slots (balanced_cuts without MPI)."""

    def __init__(self, ranks: int):
        import threading

        self.barrier = threading.Barrier(ranks)
        self.slots: list = [None] * ranks

    def over_ranks(self, rank: int) -> OverRanks:
        def every(value):
            self.barrier.wait()
            self.slots[rank] = value
            self.barrier.wait()
            values = list(self.slots)
            self.barrier.wait()
            return values

        return OverRanks(
            sum=lambda a: np.sum(every(a), axis=0), concatenate=lambda a: np.concatenate(every(a))
        )


@pytest.mark.parametrize("grid", [(3, 1, 1), (2, 2, 1), (1, 3, 2), (2, 2, 2)])
@pytest.mark.parametrize("weighted", [False, True])
def test_balanced_cuts_follow_coordinate_then_id_order(grid, weighted: bool) -> None:
    """Owners equal the rule's definition, ties on lattice planes split by id, whether one
    holder has every atom or three ranks (threads) hold a share each."""
    import threading

    rng = np.random.default_rng(sum(grid))
    n = 700
    s = rng.integers(0, 7, (n, 3)) / 7.0  # 7 planes per axis: many ties
    ids = rng.permutation(n) + 1000
    weights = rng.integers(1, 60, n) if weighted else np.ones(n, dtype=np.int64)
    expected = _expected_owners(s, ids, weights, grid)
    lo, hi = s.min(axis=0), s.max(axis=0)
    cuts = balanced_cuts(s, ids, lo, hi, grid, EVERY_ATOM_HERE, weights if weighted else None)
    np.testing.assert_array_equal(owners_at(s, ids, cuts.cuts), expected)
    # the atoms shared out unevenly among three ranks, one with none
    holder = rng.choice([0, 1, 1, 2], n)
    ranks, got = _ThreadRanks(3), np.full(n, -1)

    def rank(r: int) -> None:
        mine = holder == r
        share = balanced_cuts(
            s[mine],
            ids[mine],
            lo,
            hi,
            grid,
            ranks.over_ranks(r),
            weights[mine] if weighted else None,
        )
        got[mine] = owners_at(s[mine], ids[mine], share.cuts)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    np.testing.assert_array_equal(got, expected)
    # within one atom's weight of an equal share
    work = np.bincount(expected, weights, int(np.prod(grid)))
    assert work.max() - work.min() <= 2 * weights.max()


def test_balanced_cuts_fewer_atoms_than_boxes() -> None:
    """Three atoms on a 2 x 2 grid: one box stays empty, the others get one each."""
    s = np.array([[0.1, 0.5, 0.5], [0.9, 0.2, 0.5], [0.9, 0.8, 0.5]])
    ids = np.arange(3)
    cuts = balanced_cuts(s, ids, s.min(axis=0), s.max(axis=0), (2, 2, 1), EVERY_ATOM_HERE)
    owners = owners_at(s, ids, cuts.cuts)
    np.testing.assert_array_equal(owners, _expected_owners(s, ids, np.ones(3, int), (2, 2, 1)))
    assert sorted(np.bincount(owners, minlength=4)) == [0, 1, 1, 1]


@pytest.mark.parametrize("n_keys", [40, 70_000])  # 8/16-bit and 32-bit sort keys
def test_grouped_order_is_a_stable_sort(n_keys: int) -> None:
    rng = np.random.default_rng(8)
    keys = rng.integers(0, n_keys, 20_000)
    order = grouped_order(keys, n_keys)
    expected = sorted(range(len(keys)), key=lambda e: keys[e])  # stable: ties as listed
    np.testing.assert_array_equal(order, expected)
    assert len(grouped_order(np.zeros(0, dtype=np.int64), 0)) == 0
