"""Independent oracles for tests: a one-graph periodic evaluation and ASE's results.

``evaluate_periodic_graph`` builds the full periodic neighbour list with vesin,
evaluates a model on one ``LocalGraph`` holding every atom (no partition, no
halo), and derives forces and stress by autograd through the edge vectors.
"""

from __future__ import annotations

import numpy as np
import torch
import vesin
from ase import Atoms

from ase_shard.graph import LocalGraph

_VOIGT = ([0, 1, 2, 1, 0, 0], [0, 1, 2, 2, 2, 1])


def evaluate_periodic_graph(
    model: torch.nn.Module,
    atoms: Atoms,
    dtype: torch.dtype = torch.float64,
    inputs: dict[str, np.ndarray] | None = None,
    system: dict[str, float] | None = None,
) -> dict[str, np.ndarray]:
    """Energy (eV), per-atom energies, forces (eV/Å) and stresses (eV/Å³) of ``atoms``.

    ``inputs`` (per-atom arrays) and ``system`` (per-system values) become the
    graph's ``inputs`` and ``system``, for models that declare them.
    """
    periodic = bool(atoms.pbc.any())
    box = atoms.cell.array if periodic else np.zeros((3, 3))
    nl = vesin.NeighborList(cutoff=model.cutoff, full_list=True)
    i, j, shifts = nl.compute(atoms.positions, box, periodic=atoms.pbc, quantities="ijS")
    i = torch.as_tensor(i.astype(np.int64))
    j = torch.as_tensor(j.astype(np.int64))
    pos = torch.as_tensor(atoms.positions)
    vectors = pos[j] - pos[i] + torch.as_tensor(shifts.astype(np.float64)) @ torch.as_tensor(box)
    keep = torch.linalg.vector_norm(vectors, dim=-1) < model.cutoff
    i, j = i[keep], j[keep]
    vectors = vectors[keep].to(dtype).requires_grad_(True)

    graph = LocalGraph(
        numbers=torch.as_tensor(atoms.numbers, dtype=torch.int64),
        edge_index=torch.stack([i, j]),
        edge_vectors=vectors,
        n_owned=len(atoms),
        inputs={k: torch.as_tensor(v, dtype=dtype) for k, v in (inputs or {}).items()},
        system={k: torch.as_tensor(v, dtype=dtype) for k, v in (system or {}).items()},
    )
    energies = model(graph)
    assert energies.dtype == dtype and energies.shape == (len(atoms),)
    energy = energies.sum()
    (grad,) = torch.autograd.grad(energy, vectors)
    assert torch.isfinite(grad).all()

    forces = torch.zeros(len(atoms), 3, dtype=dtype).index_add(0, i, grad).index_add(0, j, -grad)
    out = {
        "energy": energy.detach().double().numpy(),
        "energies": energies.detach().double().numpy(),
        "forces": forces.double().numpy(),
    }
    if atoms.cell.rank == 3:
        edge_virial = vectors.detach()[:, :, None] * grad[:, None, :]
        edge_virial = 0.5 * (edge_virial + edge_virial.transpose(1, 2))
        volume = atoms.get_volume()
        # Half of each edge's virial to either endpoint.
        atom_virial = torch.zeros(len(atoms), 3, 3, dtype=dtype)
        atom_virial = atom_virial.index_add(0, i, 0.5 * edge_virial)
        atom_virial = atom_virial.index_add(0, j, 0.5 * edge_virial)
        out["stress"] = (edge_virial.sum(0)[_VOIGT] / volume).double().numpy()
        out["stresses"] = (atom_virial[:, _VOIGT[0], _VOIGT[1]] / volume).double().numpy()
    return out


def ase_results(calc, atoms: Atoms, stresses: bool = False) -> dict[str, np.ndarray]:
    """The same quantities from an ASE calculator."""
    atoms = atoms.copy()
    atoms.calc = calc
    ref = {
        "energy": np.asarray(atoms.get_potential_energy()),
        "energies": atoms.get_potential_energies(),
        "forces": atoms.get_forces(),
    }
    if atoms.cell.rank == 3:
        ref["stress"] = atoms.get_stress()
        if stresses:
            ref["stresses"] = atoms.get_stresses()
    return ref


def rel_err(value: np.ndarray, ref: np.ndarray) -> float:
    """Max-abs error over max-abs reference value."""
    scale = np.max(np.abs(ref)) if np.size(ref) else 0.0
    error = np.max(np.abs(value - ref)) if np.size(ref) else 0.0
    return float(error / scale) if scale > 0 else float(error)


def relative_errors(got: dict, ref: dict) -> dict[str, float]:
    """Max-abs error over max-abs reference, for every key of ``ref``."""
    return {key: rel_err(np.asarray(got[key]), np.asarray(ref[key])) for key in ref}


def torchpme_results(coulomb, atoms: Atoms) -> dict[str, np.ndarray]:
    """Energy, per-atom energies, forces and stress from torch-pme's own calculator.

    ``torchpme.EwaldCalculator`` or ``PMECalculator`` with ``coulomb``'s method and
    parameters (:class:`ase_shard.models.Coulomb`'s attributes), in one process, given
    every pair within ``coulomb.cutoff`` from ASE's neighbour list; the charges are
    ``atoms``' initial charges or, for a charge model, the model's on the pairs within
    its cutoff. Energy ``sum_i q_i V_i``, forces and stress by autograd through the
    positions and a strain of positions and cell together.
    """
    import torchpme
    from ase.neighborlist import neighbor_list

    potential = torchpme.CoulombPotential(
        smearing=coulomb.smearing, prefactor=torchpme.prefactors.eV_A
    )
    if coulomb.method == "ewald":
        calculator = torchpme.EwaldCalculator(
            potential, lr_wavelength=coulomb.lr_wavelength, full_neighbor_list=True
        )
    else:
        calculator = torchpme.PMECalculator(
            potential, mesh_spacing=coulomb.mesh_spacing, full_neighbor_list=True
        )
    original = torch.as_tensor(atoms.positions).requires_grad_()
    strain = torch.zeros(3, 3, dtype=torch.float64, requires_grad=True)
    deformation = torch.eye(3, dtype=torch.float64) + strain
    cell = torch.as_tensor(atoms.cell.array) @ deformation
    positions = original @ deformation

    def pairs(cutoff: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        i, j, shifts = neighbor_list("ijS", atoms, cutoff)
        i, j = torch.as_tensor(i), torch.as_tensor(j)
        vectors = positions[j] - positions[i] + torch.as_tensor(shifts, dtype=torch.float64) @ cell
        return i, j, vectors

    if coulomb.charge_model is None:
        charges = torch.as_tensor(atoms.get_initial_charges())
    else:
        i, j, vectors = pairs(float(coulomb.charge_model.cutoff))
        graph = LocalGraph(
            torch.as_tensor(atoms.numbers), torch.stack([i, j]), vectors, len(atoms)
        )
        charges = coulomb.charge_model(graph)
    i, j, vectors = pairs(coulomb.cutoff)
    charges = charges.unsqueeze(-1)
    potentials = calculator(
        charges,
        cell,
        positions,
        torch.stack([i, j], dim=1),
        torch.linalg.vector_norm(vectors, dim=1),
    )
    energies = (charges * potentials).squeeze(-1)
    energy = energies.sum()
    position_grad, strain_grad = torch.autograd.grad(energy, [original, strain])
    virial = 0.5 * (strain_grad + strain_grad.T)
    return {
        "energy": energy.detach().numpy(),
        "energies": energies.detach().numpy(),
        "forces": -position_grad.numpy(),
        "stress": (virial[_VOIGT] / atoms.get_volume()).detach().numpy(),
    }
