"""Morse pair potential matching ``ase.calculators.morse.MorsePotential``."""

from __future__ import annotations

import numpy as np
import torch

from ase_shard import kernels
from ase_shard.graph import EdgeList, LocalGraph
from ase_shard.models.sum import Addable


class Morse(Addable, torch.nn.Module):
    """Morse potential with ASE's quintic smooth cutoff.

    The pair energy ``epsilon * (exp(-2 rho0 (r/r0 - 1)) - 2 exp(-rho0 (r/r0 - 1)))``
    is multiplied by a quintic switching function going from 1 at
    ``rcut1 * r0`` to 0 at ``rcut2 * r0``. Each atom gets half of every pair
    energy it takes part in.

    Parameters
    ----------
    epsilon : float
        Well depth in eV.
    r0 : float
        Position of the minimum in Å.
    rho0 : float
        Dimensionless stiffness.
    rcut1, rcut2 : float
        Onset and end of the cutoff, in units of ``r0``.
    """

    num_layers = 1
    atomic_types = None
    newton_pair = True  # energy_forces takes each pair once (ase_shard.graph.DirectForces)

    def __init__(
        self,
        epsilon: float = 1.0,
        r0: float = 1.0,
        rho0: float = 6.0,
        rcut1: float = 1.9,
        rcut2: float = 2.7,
    ) -> None:
        super().__init__()
        self.epsilon = float(epsilon)
        self.r0 = float(r0)
        self.rho0 = float(rho0)
        self.r_on = float(rcut1) * self.r0
        self.r_off = float(rcut2) * self.r0
        self.cutoff = self.r_off

    def forward(self, graph: LocalGraph) -> torch.Tensor:
        """Per-atom energies in eV, shape ``(n_atoms,)``."""
        vectors = graph.edge_vectors
        r = torch.linalg.vector_norm(vectors, dim=-1)
        expf = torch.exp(self.rho0 * (1.0 - r / self.r0))
        pair = self.epsilon * expf * (expf - 2.0)
        # s runs from 1 at r_on to 0 at r_off; ASE holds the quintic at 1 below r_on.
        s = 1.0 - (r - self.r_on) / (self.r_off - self.r_on)
        quintic = 6.0 * s**5 - 15.0 * s**4 + 10.0 * s**3
        switch = torch.where(s >= 1.0, torch.ones_like(s), quintic)
        energies = vectors.new_zeros(graph.n_atoms)
        return energies.index_add(0, graph.edge_index[0], 0.5 * pair * switch)

    def energy_forces(self, edges: EdgeList, out: np.ndarray) -> float:
        """Energies (eV), forces (eV/Å) and virials (eV) by a compiled kernel.

        See :class:`ase_shard.graph.DirectForces`; returns the shortest listed
        edge's squared length (Å²).
        """
        params = np.array([self.epsilon, self.r0, self.rho0, self.r_on, self.r_off])
        return kernels.pair_forces(kernels.MORSE, params, edges, out)
