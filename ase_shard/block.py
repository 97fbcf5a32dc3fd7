"""One rank's block of atoms: local graph, evaluation and derivatives.

Pure torch, no MPI: the calculator feeds it rows received from rank 0 and
sends back per-row contributions that rank 0 sums into owners.
"""

from __future__ import annotations

import numpy as np
import torch

from ase_shard.graph import LocalGraph
from ase_shard.neighbors import neighbor_pairs

# Columns of the per-row result: owned energy, force (3), virial Voigt (6).
RESULT_COLUMNS = 10
_VOIGT_A = [0, 1, 2, 1, 0, 0]
_VOIGT_B = [0, 1, 2, 2, 2, 1]


class LocalBlock:
    """Owned rows then ghosts, with a neighbour list valid within the skin.

    Parameters
    ----------
    numbers : (n,) int array
    image_shift : (n, 3) int array
        Row position is ``row_positions + image_shift @ cell``.
    n_owned : int
    model : ShardModel
    skin : float
        Extra neighbour-list radius in Å, so the list stays valid until some
        atom moved more than ``skin / 2``.
    positions : (n, 3) array
        Row positions (Å) at build time.
    cell : (3, 3) array
    device : torch.device
    """

    def __init__(self, numbers, image_shift, n_owned, model, skin, positions, cell, device):
        self.device = torch.device(device)
        self.numbers = torch.as_tensor(numbers, dtype=torch.int64, device=self.device)
        self.image_shift = torch.as_tensor(image_shift, dtype=torch.float64, device=self.device)
        self.n_owned = int(n_owned)
        self.model = model
        block_positions = self.positions(positions, cell)
        pairs = neighbor_pairs(block_positions, float(model.cutoff) + skin).to(self.device)
        if int(model.num_layers) == 1:
            # a one-layer energy depends only on edges centred on the atom
            pairs = pairs[:, pairs[0] < self.n_owned]
        self.pairs = pairs

    def positions(self, row_positions: np.ndarray, cell: np.ndarray) -> torch.Tensor:
        """Cartesian positions (Å, float64) of every row."""
        rows = torch.as_tensor(row_positions, dtype=torch.float64, device=self.device)
        cell = torch.as_tensor(cell, dtype=torch.float64, device=self.device)
        return rows + self.image_shift @ cell

    def evaluate(self, row_positions: np.ndarray, cell: np.ndarray, dtype) -> torch.Tensor:
        """Per-row energy, force and virial contributions.

        Returns
        -------
        torch.Tensor
            ``(n, RESULT_COLUMNS)`` float64: per-atom energy in eV (owned rows
            only, zero for ghosts), force in eV/Å, and the virial
            ``sum d ⊗ dE/dd`` in eV (Voigt order xx, yy, zz, yz, xz, xy) with
            each edge's share split evenly between its two atoms. Ghost rows
            hold contributions that belong to their owners.
        """
        positions = self.positions(row_positions, cell)
        i, j = self.pairs
        vectors64 = positions[j] - positions[i]
        within = (vectors64 * vectors64).sum(dim=1) < float(self.model.cutoff) ** 2
        i, j = i[within], j[within]
        # edges are formed in float64, then cast, so float32 models do not
        # lose precision to large absolute coordinates
        vectors = vectors64[within].to(dtype).requires_grad_(True)
        graph = LocalGraph(self.numbers, torch.stack([i, j]), vectors, self.n_owned)
        energies = self.model(graph)
        owned_energy = energies[: self.n_owned]
        if vectors.shape[0] and owned_energy.requires_grad:
            (grad,) = torch.autograd.grad(owned_energy.sum(), vectors)
            grad = grad.to(torch.float64)
        else:
            grad = torch.zeros_like(vectors64[within])

        n = positions.shape[0]
        d = vectors64[within]
        # symmetric edge virial in Voigt order, half to each endpoint
        edge_virial = 0.25 * (
            d[:, _VOIGT_A] * grad[:, _VOIGT_B] + d[:, _VOIGT_B] * grad[:, _VOIGT_A]
        )
        rows = torch.zeros((n, RESULT_COLUMNS), dtype=torch.float64, device=self.device)
        rows[: self.n_owned, 0] = owned_energy.detach().to(torch.float64)
        # d = r_j - r_i, so dE/dr_j = g and dE/dr_i = -g; force is -dE/dr
        rows[:, 1:].index_add_(0, i, torch.cat([grad, edge_virial], dim=1))
        rows[:, 1:].index_add_(0, j, torch.cat([-grad, edge_virial], dim=1))
        return rows
