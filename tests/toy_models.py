"""A test-only message-passing model: several layers, smooth cutoff, random weights."""

from __future__ import annotations

import math

import torch

from ase_shard.graph import LocalGraph


class ToyMessagePassing(torch.nn.Module):
    """``num_layers`` rounds of messages into each edge's centre, then a readout.

    Node features start from a per-element embedding; each layer adds
    ``tanh(sum_j f_c(r_ij) h_j W)`` (cosine cutoff ``f_c``), so an atom's energy depends on
    every atom within ``num_layers * cutoff`` (Å). Weights are random but fixed
    by ``seed``; energies are in eV-like units of order 0.1-1. Between layers it
    takes ghost features from their owners when the calculator exchanges them.
    """

    atomic_types = None
    supports_layer_halo = True

    def __init__(self, cutoff: float = 3.0, num_layers: int = 3, features: int = 8, seed: int = 0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.cutoff = cutoff
        self.num_layers = num_layers
        self.embedding = torch.nn.Parameter(
            torch.randn(119, features, generator=generator, dtype=torch.float64)
        )
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(
                torch.randn(features, features, generator=generator, dtype=torch.float64)
                / math.sqrt(features)
            )
            for _ in range(num_layers)
        )
        self.readout = torch.nn.Parameter(
            torch.randn(features, generator=generator, dtype=torch.float64) / features
        )

    def forward(self, graph: LocalGraph) -> torch.Tensor:
        centre, neighbour = graph.edge_index
        r = torch.linalg.vector_norm(graph.edge_vectors, dim=-1)
        radial = 0.5 * (torch.cos(math.pi * r / self.cutoff) + 1.0)
        h = self.embedding[graph.numbers]
        for layer, weight in enumerate(self.weights):
            if layer and graph.exchange is not None:
                h = graph.exchange(h[: graph.n_owned])
            messages = torch.zeros_like(h).index_add(0, centre, radial[:, None] * h[neighbour])
            h = h + torch.tanh(messages @ weight)
        return h @ self.readout


class ChargedPairs(torch.nn.Module):
    """A test-only pair model that reads per-atom charges and spins and the total charge.

    ``e_i = sum_j f_c(r) [q_i q_j exp(-r) / 2 + s_i (1 + Q / 4) exp(-r^2 / 4) / 10]`` with
    ``q`` the initial charges, ``s`` a custom ``"spins"`` array (which ASE's own change
    detection ignores) and ``Q = atoms.info["charge"]``. Energies in eV-like units.
    """

    atomic_types = None
    num_layers = 1
    per_atom_inputs = ("initial_charges", "spins")
    system_inputs = ("charge",)

    def __init__(self, cutoff: float = 4.0):
        super().__init__()
        self.cutoff = cutoff

    def forward(self, graph: LocalGraph) -> torch.Tensor:
        centre, neighbour = graph.edge_index
        r = torch.linalg.vector_norm(graph.edge_vectors, dim=-1)
        cut = 0.5 * (torch.cos(math.pi * r / self.cutoff) + 1.0)
        q, s = graph.inputs["initial_charges"], graph.inputs["spins"]
        total = graph.system["charge"]
        pair = 0.5 * q[centre] * q[neighbour] * torch.exp(-r)
        spin = 0.1 * s[centre] * (1.0 + total / 4.0) * torch.exp(-r * r / 4.0)
        return torch.zeros_like(q).index_add(0, centre, cut * (pair + spin))


class ChargeTransfer(torch.nn.Module):
    """A test-only charge model: each pair moves charge towards the more electronegative end.

    ``q_i = q0(Z_i) + sum_j f_c(r_ij) (chi(Z_j) - chi(Z_i)) / 10`` over the pairs within
    ``cutoff`` (Å), ``f_c`` a cosine cut-off: antisymmetric in the pair, so the total
    charge is ``sum_i q0(Z_i)`` whatever the geometry, and the charges change with the
    positions (``Coulomb(charges=ChargeTransfer())`` must carry that into the forces).
    ``q0`` is +1 for Na and -1 for Cl, ``chi`` 0.9 and 3.2.
    """

    num_layers = 1
    atomic_types = (11, 17)

    def __init__(self, cutoff: float = 4.0):
        super().__init__()
        self.cutoff = cutoff
        formal, electronegativity = torch.zeros(18, dtype=torch.float64), torch.zeros(18)
        formal[11], formal[17] = 1.0, -1.0
        electronegativity[11], electronegativity[17] = 0.9, 3.2
        self.register_buffer("formal", formal)
        self.register_buffer("electronegativity", electronegativity.to(torch.float64))

    def forward(self, graph: LocalGraph) -> torch.Tensor:
        centre, neighbour = graph.edge_index
        r = torch.linalg.vector_norm(graph.edge_vectors, dim=-1)
        cut = 0.5 * (torch.cos(math.pi * r / self.cutoff) + 1.0)
        chi = self.electronegativity[graph.numbers]
        moved = 0.1 * cut * (chi[neighbour] - chi[centre])
        return self.formal[graph.numbers].index_add(0, centre, moved)
