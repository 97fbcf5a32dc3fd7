"""Lennard-Jones pair potential matching ``ase.calculators.lj.LennardJones``."""

from __future__ import annotations

import numpy as np
import torch

from ase_shard import kernels
from ase_shard.graph import EdgeList, LocalGraph
from ase_shard.models.sum import Addable


class LennardJones(Addable, torch.nn.Module):
    """Lennard-Jones potential, ``u(r) = 4 epsilon ((sigma/r)^12 - (sigma/r)^6)``.

    Reproduces ASE's conventions: with ``smooth=False`` the pair energy is
    shifted by ``u(rc)`` so that it vanishes at the cutoff; with ``smooth=True``
    it is multiplied by a switching function of ``r**2`` going from 1 at ``ro``
    to 0 at ``rc``. Each atom gets half of every pair energy it takes part in.

    Parameters
    ----------
    sigma : float
        Length scale in Å; the minimum lies at ``2**(1/6) * sigma``.
    epsilon : float
        Well depth in eV.
    rc : float, optional
        Cutoff in Å, ``3 * sigma`` if omitted.
    ro : float, optional
        Onset of the smooth cutoff in Å, ``0.66 * rc`` if omitted.
    smooth : bool
        Use the switching function instead of the energy shift.
    """

    num_layers = 1
    atomic_types = None
    newton_pair = True  # energy_forces takes each pair once (ase_shard.graph.DirectForces)

    def __init__(
        self,
        sigma: float = 1.0,
        epsilon: float = 1.0,
        rc: float | None = None,
        ro: float | None = None,
        smooth: bool = False,
    ) -> None:
        super().__init__()
        self.sigma = float(sigma)
        self.epsilon = float(epsilon)
        self.rc = float(3.0 * self.sigma if rc is None else rc)
        self.ro = float(0.66 * self.rc if ro is None else ro)
        self.smooth = bool(smooth)
        self.cutoff = self.rc

    def forward(self, graph: LocalGraph) -> torch.Tensor:
        """Per-atom energies in eV, shape ``(n_atoms,)``."""
        vectors = graph.edge_vectors
        r2 = (vectors * vectors).sum(dim=-1)
        c6 = (self.sigma**2 / r2) ** 3
        pair = 4.0 * self.epsilon * (c6 * c6 - c6)
        if self.smooth:
            # ASE's switching function acts on squared distances.
            rc2 = self.rc**2
            ro2 = self.ro**2
            switch = (rc2 - r2) ** 2 * (rc2 + 2.0 * r2 - 3.0 * ro2) / (rc2 - ro2) ** 3
            pair = pair * torch.where(r2 < ro2, torch.ones_like(r2), switch)
        else:
            e_rc = (
                4.0 * self.epsilon * ((self.sigma / self.rc) ** 12 - (self.sigma / self.rc) ** 6)
            )
            pair = pair - e_rc
        energies = vectors.new_zeros(graph.n_atoms)
        return energies.index_add(0, graph.edge_index[0], 0.5 * pair)

    def energy_forces(self, edges: EdgeList, out: np.ndarray) -> float:
        """Energies (eV), forces (eV/Å) and virials (eV) by a compiled kernel.

        See :class:`ase_shard.graph.DirectForces`; returns the shortest listed
        edge's squared length (Å²).
        """
        if self.smooth:
            kind, params = kernels.LJ_SMOOTH, [self.rc**2, self.ro**2]
        else:
            ratio = self.sigma / self.rc
            kind, params = kernels.LJ_SHIFTED, [4.0 * self.epsilon * (ratio**12 - ratio**6)]
        params = np.array([self.sigma, self.epsilon, *params])
        return kernels.pair_forces(kind, params, edges, out)
