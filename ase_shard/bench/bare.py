"""The bare model: the reference ``ase-shard bench`` times ``ShardedCalculator`` against.

The model evaluated on the whole system as one periodic graph, on one process:
the same neighbour-list library and skin, no partition, halo or MPI. What it
delivers (energy, per-atom energies, forces, virial) is what the calculator
delivers, so both the timings and the results of the two compare directly.
"""

from __future__ import annotations

import numpy as np
import torch
import vesin
from ase import Atoms

from ase_shard.block import RESULT_COLUMNS, edge_images, sum_edge_gradients
from ase_shard.graph import EdgeList, LocalGraph, direct_forces, takes_pairs_once
from ase_shard.timing import PhaseTimer


class BareModel:
    """A model evaluated on the whole system as one periodic graph, without decomposition.

    The neighbour list (``vesin``, periodic, radius ``cutoff + skin``) is built
    by :meth:`build` and reused by :meth:`evaluate` until the next build, as
    ``ShardedCalculator`` reuses its local lists. Each evaluation forms the
    edge vectors in float64, keeps those within ``cutoff``, runs the model and
    one backward pass, and sums forces and per-atom virials, so it delivers what
    ``ShardedCalculator`` delivers. A model with its own compiled forces
    (:class:`ase_shard.graph.DirectForces`: the built-in potentials) is
    evaluated through them on a CPU in float64, as ``ShardedCalculator`` does.

    Parameters
    ----------
    model : torch.nn.Module
        A ``ShardModel``, already on ``device`` in ``dtype``.
    skin : float
        Extra neighbour-list radius (Å).
    dtype : torch.dtype
    device : torch.device
    """

    def __init__(
        self, model: torch.nn.Module, skin: float, dtype: torch.dtype, device: torch.device
    ):
        self.model = model
        self.skin = skin
        self.dtype = dtype
        self.device = torch.device(device)
        self.timer = PhaseTimer(self.device, synchronize=True)
        self.pairs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.images: tuple[np.ndarray, np.ndarray] | None = None  # see block.edge_images

    def build(self, atoms: Atoms) -> None:
        """The periodic neighbour list of ``atoms`` within ``cutoff + skin``."""
        with self.timer.phase("neighbors"):
            periodic = atoms.pbc.any()
            box = atoms.cell.array if periodic else np.zeros((3, 3))
            nl = vesin.NeighborList(cutoff=float(self.model.cutoff) + self.skin, full_list=True)
            i, j, shifts = nl.compute(atoms.positions, box, periodic=atoms.pbc, quantities="ijS")
            if takes_pairs_once(self.model):
                # one edge per pair (both of a self-image pair), as LocalBlock lists them
                once = j >= i
                i, j, shifts = i[once], j[once], shifts[once]
            self.pairs = tuple(
                torch.as_tensor(a.astype(np.int64), device=self.device) for a in (i, j, shifts)
            )
            shifted = np.flatnonzero(shifts.any(axis=1))
            self.images = edge_images(len(i), shifted, shifts[shifted].astype(np.float64))

    def evaluate(self, atoms: Atoms) -> dict[str, np.ndarray]:
        """Energy, per-atom energies, forces and virial (eV, eV/Å, eV) of ``atoms``."""
        direct = direct_forces(self.model)
        if direct is not None and self.device.type == "cpu" and self.dtype == torch.float64:
            return self._evaluate_direct(direct, atoms)
        timer, device = self.timer, self.device
        with timer.phase("forward"):
            i, j, shifts = self.pairs
            positions = torch.as_tensor(atoms.positions, device=device)
            cell = torch.as_tensor(atoms.cell.array, device=device)
            vectors64 = positions[j] - positions[i] + shifts.to(torch.float64) @ cell
            within = (vectors64 * vectors64).sum(dim=1) < float(self.model.cutoff) ** 2
            i, j, d = i[within], j[within], vectors64[within]
            vectors = d.to(self.dtype).detach().requires_grad_(True)
            numbers = torch.as_tensor(atoms.numbers, dtype=torch.int64, device=device)
            graph = LocalGraph(numbers, torch.stack([i, j]), vectors, len(atoms))
            energies = self.model(graph)
        with timer.phase("backward"):
            (grad,) = torch.autograd.grad(energies.sum(), vectors)
            grad = grad.to(torch.float64)
        with timer.phase("reverse"):
            rows = sum_edge_gradients(i, j, d, grad, len(atoms))
            energies = energies.detach().to(torch.float64)
            out = {
                "energy": energies.sum().cpu().numpy(),
                "energies": energies.cpu().numpy(),
                "forces": rows[:, :3].cpu().numpy(),
                "virial": rows[:, 3:].sum(dim=0).cpu().numpy(),
            }
        return out

    def _evaluate_direct(self, model, atoms: Atoms) -> dict[str, np.ndarray]:
        """:meth:`evaluate` by the model's compiled kernel, on the host."""
        with self.timer.phase("forward"):
            i, j = self.pairs[0].numpy(), self.pairs[1].numpy()
            image, table = self.images
            numbers = atoms.numbers.astype(np.int64)
            cell = atoms.cell.array
            edges = EdgeList(
                atoms.positions, numbers, i, j, image, table @ cell, len(atoms), self.model.cutoff
            )
            rows = np.zeros((RESULT_COLUMNS, len(atoms)))
            model.energy_forces(edges, rows)
        return {
            "energy": rows[0].sum(),
            "energies": rows[0],
            "forces": rows[1:4].T,
            "virial": rows[4:].sum(axis=1),
        }
