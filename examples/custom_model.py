"""Wrap your own torch potential for ShardedCalculator.

    python examples/custom_model.py
    mpirun -n 2 python examples/custom_model.py     # same numbers

A model is a ``torch.nn.Module`` with three attributes (``cutoff`` in Å,
``num_layers``, ``atomic_types``) whose ``forward`` maps a ``LocalGraph`` to
one energy (eV) per local atom. ShardedCalculator derives forces and stress by
autograd through ``graph.edge_vectors``. The toy below is an untrained
two-layer message-passing network with a smooth cosine cutoff; the script
evaluates it on rattled copper and checks one force component against a
finite difference of the energy.
"""

import ase_shard  # noqa: F401  (first: sets up MPI before ASE fixes ase.parallel.world)

# isort: split

import numpy as np
import torch
from ase.build import bulk
from ase.parallel import parprint, world

from ase_shard import LocalGraph, ShardedCalculator


class ToyMessagePassing(torch.nn.Module):
    cutoff = 4.0  # Å: range of one message
    num_layers = 2  # two rounds of messages: atoms up to 8 Å away matter
    atomic_types = None  # any element

    def __init__(self, features: int = 8):
        super().__init__()
        self.embed = torch.nn.Embedding(119, features)  # one vector per atomic number
        self.update = torch.nn.Linear(features, features)
        self.readout = torch.nn.Linear(features, 1)

    def forward(self, graph: LocalGraph) -> torch.Tensor:
        centre, neighbour = graph.edge_index  # messages flow neighbour -> centre
        r = torch.linalg.vector_norm(graph.edge_vectors, dim=-1)
        # smooth weight: value and slope go to zero at the cutoff
        weight = 0.5 * (torch.cos(torch.pi * r / self.cutoff) + 1.0) * torch.exp(-r)
        h = self.embed(graph.numbers)
        for _ in range(self.num_layers):
            messages = h[neighbour] * weight[:, None]
            pooled = torch.zeros_like(h).index_add(0, centre, messages)
            h = h + torch.tanh(self.update(pooled))
        return self.readout(h).squeeze(-1)  # (n_atoms,) energies in eV


def main() -> None:
    # Under mpirun every rank builds its own copy of the model: the weights must be
    # identical everywhere (seed the initialisation, or load the same checkpoint).
    torch.manual_seed(0)
    model = ToyMessagePassing()

    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(3)  # 108 atoms
    atoms.rattle(stdev=0.05, seed=1)  # same seed on every rank
    # nn.Linear weights are float32; ask for float64 so the finite difference is clean
    atoms.calc = ShardedCalculator(model, dtype=torch.float64)

    energy = atoms.get_potential_energy()
    forces = atoms.get_forces()
    stress = atoms.get_stress()
    parprint(f"{len(atoms)} atoms on {world.size} MPI rank(s), model ToyMessagePassing")
    parprint(f"energy: {energy:.10f} eV")
    parprint(f"force on atom 0: {np.array2string(forces[0], precision=6)} eV/Å")
    parprint(f"max |force|: {np.abs(forces).max():.6f} eV/Å")
    parprint(f"sum of forces: {np.abs(forces.sum(axis=0)).max():.2e} eV/Å (should be ~0)")
    parprint(f"stress (xx yy zz yz xz xy): {np.array2string(stress, precision=6)} eV/Å^3")

    # central finite difference of the energy along x for atom 0
    h = 1e-4
    original = atoms.get_positions()
    energies = []
    for sign in (+1, -1):
        displaced = original.copy()
        displaced[0, 0] += sign * h
        atoms.positions = displaced
        energies.append(atoms.get_potential_energy())
    atoms.positions = original
    numeric = -(energies[0] - energies[1]) / (2 * h)
    difference = abs(numeric - forces[0, 0])
    parprint(
        f"finite-difference check, atom 0, x: autograd {forces[0, 0]:.8f} eV/Å, "
        f"numeric {numeric:.8f} eV/Å, |difference| {difference:.1e} eV/Å"
    )


if __name__ == "__main__":
    main()
