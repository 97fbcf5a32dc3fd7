"""Serial checks of a block's pieces (no MPI): per-row sums of edge gradients, and
the edges listed for models that take each pair once.

The oracles: numpy's unbuffered ``np.add.at`` with the virial written out as
outer products, and the full neighbour list of the autograd path.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from ase.build import bulk
from sync_count import Autograd, rank_blocks

from ase_shard import block as block_module
from ase_shard.block import edge_images, rows_to_nodes, sum_edge_gradients
from ase_shard.models import EMT

VOIGT = [(0, 0), (1, 1), (2, 2), (1, 2), (0, 2), (0, 1)]


def test_sum_edge_gradients_matches_add_at() -> None:
    rng = np.random.default_rng(5)
    n_rows, n_edges = 7, 200
    # repeated pairs, self-images (centre == neighbour) and a row without edges
    centre = rng.integers(0, n_rows - 1, n_edges)
    neighbour = rng.integers(0, n_rows - 1, n_edges)
    vectors = rng.normal(size=(n_edges, 3))
    grad = rng.normal(size=(n_edges, 3))

    forces = np.zeros((n_rows, 3))
    np.add.at(forces, centre, grad)
    np.add.at(forces, neighbour, -grad)
    outer = vectors[:, :, None] * grad[:, None, :]
    symmetric = 0.5 * (outer + outer.transpose(0, 2, 1))
    share = np.stack([symmetric[:, a, b] for a, b in VOIGT], axis=1) / 2
    virial = np.zeros((n_rows, 6))
    np.add.at(virial, centre, share)
    np.add.at(virial, neighbour, share)

    got = sum_edge_gradients(
        *(torch.from_numpy(a) for a in (centre, neighbour, vectors, grad)), n_rows
    ).numpy()
    assert got.shape == (n_rows, 9)
    np.testing.assert_allclose(got[:, :3], forces, rtol=0, atol=1e-13)
    np.testing.assert_allclose(got[:, 3:], virial, rtol=0, atol=1e-13)
    assert not got[n_rows - 1].any()
    # the rows' virials add up to the total virial sum_e d (x) g
    total = symmetric.sum(axis=0)
    np.testing.assert_allclose(got[:, 3:].sum(axis=0), [total[a, b] for a, b in VOIGT])


def test_sum_edge_gradients_without_edges() -> None:
    empty = torch.zeros((0, 3), dtype=torch.float64)
    index = torch.zeros(0, dtype=torch.int64)
    got = sum_edge_gradients(index, index, empty, empty, 3)
    assert got.shape == (3, 9) and not got.any()


class _PairHalo:
    """Stands in for a rank's HaloExchange: which edges a block lists is settled when it
    is built, before any exchange (an evaluation would call it)."""


def _pairs(block) -> Counter:
    """The block's edges as atom pairs ``(a, b, cell shift)``, each pair one way round."""
    centre, neighbour = block.centre.numpy(), block.neighbour.numpy()
    shift = np.zeros((block.n_nodes, 3))
    shift[block.shifted_nodes.numpy()] = block.node_shift.numpy()
    cells = shift[neighbour] - shift[centre]
    shifted, shift = block.image_edges()
    cells[shifted.numpy()] += shift.numpy()
    a, b = block.ids[centre], block.ids[neighbour]
    cells = cells.astype(np.int64)
    # (b, a, -s) is (a, b, s) seen from b; a self-image pair (a, a, +-s) keeps its larger shift
    flip = (a > b) | ((a == b) & [tuple(c) < tuple(-c) for c in cells])
    low, high = np.where(flip, b, a), np.where(flip, a, b)
    cells = np.where(flip[:, None], -cells, cells)
    return Counter(zip(low.tolist(), high.tolist(), map(tuple, cells.tolist()), strict=True))


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_newton_pair_blocks_list_each_pair_once(ranks: int) -> None:
    """EMT (``newton_pair``) on every rank's block: each pair of atoms once over all
    ranks, where a full list (the autograd path's) holds it from both ends; a
    self-image pair twice, as in the full list."""
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat((4, 3, 3))
    atoms.pbc = (True, False, True)
    atoms.rattle(0.05, seed=4)
    listed = Counter()
    for block in rank_blocks(EMT(), atoms, ranks, pair_halo=_PairHalo()):
        assert ranks == 1 or block.n_nodes > block.n_owned  # pairs between ranks
        listed.update(_pairs(block))
    (full,) = rank_blocks(Autograd(EMT()), atoms, 1)
    both_ways = _pairs(full)
    assert set(both_ways.values()) == {2}
    expected = {pair: 2 if pair[0] == pair[1] else 1 for pair in both_ways}
    assert dict(listed) == expected


@pytest.mark.parametrize("ranks", [2, 3])
def test_newton_pair_blocks_list_edges_to_ghosts_first(ranks: int) -> None:
    """With a pair halo, a block's edges to ghosts come first, grouped by ghost."""
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat((4, 3, 3))
    atoms.rattle(0.05, seed=4)
    for block in rank_blocks(EMT(), atoms, ranks, pair_halo=_PairHalo()):
        neighbour = block.neighbour.numpy()
        to_ghost = int((neighbour >= block.n_owned).sum())
        assert to_ghost > 0
        assert (np.diff(neighbour[:to_ghost]) >= 0).all() and neighbour[0] >= block.n_owned
        assert (neighbour[to_ghost:] < block.n_owned).all()


@pytest.mark.parametrize("ranks", [2, 3])
def test_node_positions_from_the_shifted_nodes_alone(ranks: int) -> None:
    """A block keeps only its shifted nodes' shifts: their positions are those of every
    node's offset added, to the last bit (a triclinic cell, atoms outside it)."""
    atoms = bulk("Cu", "fcc", a=3.61).repeat((5, 4, 4))
    atoms.rattle(0.05, seed=5)
    atoms.positions += 0.7  # some atoms beyond the cell: their nodes are wrapped images
    for block in rank_blocks(EMT(), atoms, ranks):
        assert 0 < len(block.shifted_nodes) < block.n_nodes
        rows = torch.as_tensor(atoms.positions[block.ids])
        every = torch.zeros((block.n_nodes, 3), dtype=torch.float64)
        every[block.shifted_nodes] = block.node_shift
        expected = rows + every @ torch.as_tensor(atoms.cell.array)
        assert torch.equal(block._positions(rows, atoms.cell.array), expected)


def test_edge_images_match_numpys_unique_rows() -> None:
    """Whole-cell shifts of some edges as rows of a table of distinct shifts, zero first."""
    rng = np.random.default_rng(6)
    n_edges = 5_000
    shifted = np.sort(rng.choice(n_edges, 1_500, replace=False))
    shifts = rng.integers(-3, 4, (len(shifted), 3)).astype(np.float64)
    shifts[shifts[:, 2] == 0, 2] = 5  # no zero shift; an uneven box of shifts
    image, table = edge_images(n_edges, shifted, shifts)
    np.testing.assert_array_equal(table[0], 0.0)
    np.testing.assert_array_equal(table[1:], np.unique(shifts, axis=0))
    np.testing.assert_array_equal(table[image[shifted]], shifts)
    assert not np.delete(image, shifted).any()
    image, table = edge_images(3, np.zeros(0, dtype=np.int64), np.zeros((0, 3)))
    assert not image.any() and table.shape == (1, 3)


@pytest.mark.parametrize(("distinct", "kind"), [(127, np.int8), (128, np.int16)])
def test_edge_images_take_the_smallest_type(distinct: int, kind: type) -> None:
    """A byte an edge while the table, its zero row included, has at most 128 rows."""
    shifts = np.zeros((distinct, 3))
    shifts[:, 0] = np.arange(1, distinct + 1)
    shifted = 2 * np.arange(distinct)
    image, table = edge_images(2 * distinct, shifted, shifts)
    assert image.dtype == kind
    np.testing.assert_array_equal(table[image[shifted]], shifts)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_rows_to_nodes_gathers_in_place_by_chunks(dtype: torch.dtype, monkeypatch) -> None:
    """Rows replaced by their nodes in the given storage, chunk bounds straddled."""
    monkeypatch.setattr(block_module, "NODES_CHUNK", 7)
    rng = np.random.default_rng(9)
    node = torch.from_numpy(rng.integers(0, 40, 60))
    rows = torch.from_numpy(rng.integers(0, 60, 100)).to(dtype)
    expected = node[rows.long()]
    nodes = rows_to_nodes(rows, node)
    assert nodes.data_ptr() == rows.data_ptr() and nodes.dtype == dtype
    np.testing.assert_array_equal(nodes.numpy(), expected.numpy())
