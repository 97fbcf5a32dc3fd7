"""Serial checks of the per-row sums of edge gradients (no MPI).

The oracle is numpy's unbuffered ``np.add.at`` with the virial written out as
outer products, not the code under test.
"""

from __future__ import annotations

import numpy as np
import torch

from ase_shard.block import sum_edge_gradients

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
