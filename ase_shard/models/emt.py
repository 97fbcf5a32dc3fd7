"""Effective medium theory matching ``ase.calculators.emt.EMT`` (``asap_cutoff=False``)."""

from __future__ import annotations

from math import log, sqrt

import numpy as np
import torch
from ase.calculators.emt import beta, parameters
from ase.data import atomic_numbers
from ase.units import Bohr

from ase_shard import kernels
from ase_shard.graph import EdgeList, LocalGraph
from ase_shard.kernels import (
    EMT_COLUMNS,
    EMT_E0,
    EMT_ETA2,
    EMT_INV12GAMMA1,
    EMT_KAPPA,
    EMT_LAMBDA,
    EMT_N0,
    EMT_NEGHALFV0OVERGAMMA2,
    EMT_S0,
    EMT_V0,
)
from ase_shard.models.sum import Addable

_N_ELEMENTS = 119


def _cutoff_parameters() -> tuple[float, float, float]:
    """Logistic midpoint ``rc`` (Å), neighbour cutoff ``rc_list`` (Å) and slope ``acut`` (1/Å).

    As in ASE with ``asap_cutoff=False``, these come from the largest ``s0`` in
    the whole parameter table rather than from the elements present, so every
    structure sees the same cutoff (about 5.88 Å).
    """
    r1nn = beta * max(p[1] for p in parameters.values()) * Bohr
    rc = r1nn * 0.5 * (sqrt(3.0) + 2.0)
    acut = log(1.0 / 1e-4 - 1.0) / (2.0 * r1nn - rc)
    return rc, rc + 0.5, acut


def _parameter_table(rc: float, acut: float) -> torch.Tensor:
    """``(119, 9)`` float64 table indexed by atomic number; unsupported rows are NaN."""
    table = torch.full((_N_ELEMENTS, EMT_COLUMNS), float("nan"), dtype=torch.float64)
    # fcc shell multiplicities and distances of the 1st-3rd neighbours, as in ASE.
    shells = np.array([12, 6, 24])
    for symbol, (e0, s0, v0, eta2, kappa, lmbda, n0) in parameters.items():
        s0 = s0 * Bohr
        eta2 = eta2 / Bohr
        kappa = kappa / Bohr
        r = beta * s0 * np.sqrt([1.0, 2.0, 3.0])
        x = shells / (1.0 + np.exp(acut * (r - rc))) / 12.0
        gamma1 = x @ np.exp(-eta2 * (r - beta * s0))
        gamma2 = x @ np.exp(-kappa / beta * (r - beta * s0))
        table[atomic_numbers[symbol]] = torch.tensor(
            [
                e0,
                s0,
                v0,
                eta2,
                kappa,
                lmbda / Bohr,
                n0 / Bohr**3,
                1.0 / (12.0 * gamma1),
                -0.5 * v0 / gamma2,
            ],
            dtype=torch.float64,
        )
    return table


class EMT(Addable, torch.nn.Module):
    """ASE's effective medium theory for Al, Cu, Ag, Au, Ni, Pd, Pt, H, C, N, O.

    The energy of atom ``i`` is the cohesive function of its neighbour density
    ``sigma1``, plus the atomic-sphere correction from the pair sums
    ``sigma2``, minus its reference energy ``E0``. An atom without neighbours
    gets ``-E0`` (ASE skips it before subtracting ``E0``), which is also the
    limit of the formula as ``sigma1 -> 0``.

    Neighbours are cut hard at ``cutoff = rc + 0.5`` Å where the logistic
    weight is about ``7e-6``, so the energy jumps slightly there, as in ASE.
    """

    num_layers = 1
    atomic_types = tuple(sorted(atomic_numbers[symbol] for symbol in parameters))
    newton_pair = True  # energy_forces takes each pair once (ase_shard.graph.DirectForces)

    def __init__(self) -> None:
        super().__init__()
        self.rc, self.cutoff, self.acut = _cutoff_parameters()
        self.register_buffer("table", _parameter_table(self.rc, self.acut))

    def forward(self, graph: LocalGraph) -> torch.Tensor:
        """Per-atom energies in eV, shape ``(n_atoms,)``."""
        vectors = graph.edge_vectors
        centre, neighbour = graph.edge_index
        atom = self.table.to(dtype=vectors.dtype, device=vectors.device)[graph.numbers]
        # per-edge parameters gathered one contiguous column at a time: an (E, 9)
        # gather and strided column arithmetic cost several times more
        columns = atom.t().contiguous()

        def centre_(k: int) -> torch.Tensor:
            return columns[k].index_select(0, centre)

        def neighbour_(k: int) -> torch.Tensor:
            return columns[k].index_select(0, neighbour)

        r = torch.linalg.vector_norm(vectors, dim=-1)
        w = 1.0 / (1.0 + torch.exp(self.acut * (r - self.rc)))
        chi = neighbour_(EMT_N0) / centre_(EMT_N0)

        s0_j = neighbour_(EMT_S0)
        dsigma1 = torch.exp(-neighbour_(EMT_ETA2) * (r - beta * s0_j)) * chi * w
        sigma1 = vectors.new_zeros(graph.n_atoms).index_add(0, centre, dsigma1)
        # Isolated atoms have sigma1 == 0 and log(0) would poison the gradient
        # through torch.where, so they evaluate the formula at a harmless value.
        has_neighbours = sigma1 > 0.0
        safe_sigma1 = torch.where(has_neighbours, sigma1, torch.ones_like(sigma1))
        e0 = atom[:, EMT_E0]
        lmbda = atom[:, EMT_LAMBDA]
        ds = -torch.log(safe_sigma1 * atom[:, EMT_INV12GAMMA1]) / (beta * atom[:, EMT_ETA2])
        cohesive = e0 * (1.0 + lmbda * ds) * torch.exp(-lmbda * ds)
        cohesive = cohesive + 6.0 * atom[:, EMT_V0] * torch.exp(-atom[:, EMT_KAPPA] * ds)
        cohesive = torch.where(has_neighbours, cohesive, torch.zeros_like(cohesive))

        # sigma2 contributions seen from the centre (es) and from the neighbour (eo).
        r_beta = r / beta
        es = centre_(EMT_NEGHALFV0OVERGAMMA2) * torch.exp(-neighbour_(EMT_KAPPA) * (r_beta - s0_j))
        eo = neighbour_(EMT_NEGHALFV0OVERGAMMA2) * torch.exp(
            -centre_(EMT_KAPPA) * (r_beta - centre_(EMT_S0))
        )
        pair = (es * chi + eo / chi) * w
        sphere = vectors.new_zeros(graph.n_atoms).index_add(0, centre, 0.5 * pair)
        return cohesive + sphere - e0

    def energy_forces(self, edges: EdgeList, out: np.ndarray) -> float:
        """Energies (eV), forces (eV/Å) and virials (eV) by a compiled kernel.

        See :class:`ase_shard.graph.DirectForces`; returns the shortest listed
        edge's squared length (Å²). A centre's energy needs its own density
        only, so the edges centred on owned nodes suffice, as in :meth:`forward`.
        """
        table = self.table.detach().cpu().numpy()
        return kernels.emt_forces(table, self.rc, self.acut, beta, edges, out)
