"""Serial checks of the torch potentials against ASE's own calculators.

A tiny harness builds the full periodic neighbour list with vesin, evaluates a
model on one ``LocalGraph`` holding every atom, and derives forces and stress by
autograd through the edge vectors, as the sharded calculator does.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import vesin
from ase import Atoms
from ase.build import bulk, fcc111, molecule
from ase.calculators.emt import EMT as AseEMT
from ase.calculators.lj import LennardJones as AseLennardJones
from ase.calculators.morse import MorsePotential as AseMorse
from ase.cluster import Icosahedron

from ase_shard.graph import LocalGraph
from ase_shard.models import EMT, LennardJones, Morse

RTOL64 = 1e-10
# Measured worst case over the float32 cases below: 8.1e-6 (EMT alloy stress);
# LJ and Morse stay under 2e-6. Single precision rounds each edge vector and
# term to ~6e-8, and EMT's energy is a difference of terms of several eV, so
# the error is relative to a much smaller result. Near-equilibrium Cu, where
# per-atom energies are ~0.03 eV, reaches 2.6e-4, hence the alloy is used here.
RTOL32 = 5e-5

_VOIGT = ([0, 1, 2, 1, 0, 0], [0, 1, 2, 2, 2, 1])


def _evaluate(
    model: torch.nn.Module, atoms: Atoms, dtype: torch.dtype = torch.float64
) -> dict[str, np.ndarray]:
    """Energy (eV), per-atom energies, forces (eV/Å) and stresses (eV/Å³) of ``atoms``."""
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


def _reference(calc, atoms: Atoms, stresses: bool = False) -> dict[str, np.ndarray]:
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


def _rel_err(value: np.ndarray, ref: np.ndarray) -> float:
    """Max-abs error over max-abs reference value."""
    return float(np.max(np.abs(value - ref)) / np.max(np.abs(ref)))


def _compare(
    model: torch.nn.Module,
    calc,
    atoms: Atoms,
    rtol: float = RTOL64,
    dtype: torch.dtype = torch.float64,
    stresses: bool = False,
) -> None:
    """Assert every quantity ASE provides agrees within ``rtol``."""
    got = _evaluate(model, atoms, dtype)
    ref = _reference(calc, atoms, stresses)
    errors = {key: _rel_err(got[key], ref[key]) for key in ref}
    assert all(err <= rtol for err in errors.values()), errors


def _rattled(atoms: Atoms, stdev: float, seed: int) -> Atoms:
    atoms.rattle(stdev=stdev, seed=seed)
    return atoms


def _cu_bulk() -> Atoms:
    return _rattled(bulk("Cu", "fcc", a=3.6, cubic=True).repeat(2), 0.05, 1)


def _emt_alloy() -> Atoms:
    atoms = bulk("Cu", "fcc", a=3.8, cubic=True).repeat((3, 2, 2))
    symbols = list(EMT.atomic_types) * (len(atoms) // len(EMT.atomic_types) + 1)
    np.random.default_rng(2).shuffle(symbols)
    atoms.numbers = symbols[: len(atoms)]
    return _rattled(atoms, 0.1, 3)


def _pt_slab() -> Atoms:
    return _rattled(fcc111("Pt", size=(3, 3, 4), vacuum=6.0), 0.05, 4)


def _au_cluster_with_lone_atom() -> Atoms:
    atoms = Icosahedron("Au", 3)
    # An atom beyond the cutoff of everything exercises the no-neighbour branch.
    atoms += Atoms("Au", positions=[atoms.positions.max(0) + 12.0])
    return _rattled(atoms, 0.05, 5)


def _ar_triclinic() -> Atoms:
    atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat(2)
    shear = np.array([[1.0, 0.0, 0.0], [0.12, 1.0, 0.0], [-0.08, 0.15, 1.0]])
    atoms.set_cell(atoms.cell.array @ shear, scale_atoms=True)
    return _rattled(atoms, 0.15, 6)


def _two_atom_cell() -> Atoms:
    # Cell vectors ~1.6 Å against a 4 Å cutoff: each atom sees its own images
    # and those of its partner out to the third shell.
    cell = [[1.6, 0.0, 0.0], [0.3, 1.7, 0.0], [-0.2, 0.25, 1.65]]
    return Atoms("Ar2", positions=[[0.0, 0.0, 0.0], [0.9, 0.8, 0.85]], cell=cell, pbc=True)


def _morse_crystal() -> Atoms:
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((3, 2, 3))
    atoms.pbc = (True, False, True)
    return _rattled(atoms, 0.08, 7)


def _c60() -> Atoms:
    return _rattled(molecule("C60"), 0.03, 8)


@pytest.mark.parametrize(
    "make_atoms", [_cu_bulk, _emt_alloy, _pt_slab, _au_cluster_with_lone_atom]
)
def test_emt_matches_ase(make_atoms) -> None:
    _compare(EMT(), AseEMT(), make_atoms())


def test_emt_alloy_uses_every_element() -> None:
    assert set(_emt_alloy().numbers) == set(EMT.atomic_types)
    assert len(EMT.atomic_types) == 11


def test_emt_lone_atom_energy_is_minus_e0() -> None:
    atoms = _au_cluster_with_lone_atom()
    energies = _evaluate(EMT(), atoms)["energies"]
    assert energies[-1] == pytest.approx(3.80, abs=1e-12)


@pytest.mark.parametrize("smooth", [False, True])
@pytest.mark.parametrize(
    ("make_atoms", "params"),
    [
        (_ar_triclinic, {"sigma": 3.4, "epsilon": 0.0104, "rc": 8.5}),
        (_two_atom_cell, {"sigma": 1.0, "epsilon": 1.0, "rc": 4.0}),
    ],
)
def test_lj_matches_ase(make_atoms, params: dict, smooth: bool) -> None:
    _compare(
        LennardJones(**params, smooth=smooth),
        AseLennardJones(**params, smooth=smooth),
        make_atoms(),
        stresses=True,
    )


def test_lj_default_cutoffs() -> None:
    model = LennardJones(sigma=2.0)
    assert model.cutoff == pytest.approx(6.0)
    assert model.ro == pytest.approx(0.66 * 6.0)


@pytest.mark.parametrize(
    ("make_atoms", "params"),
    [
        (_morse_crystal, {"epsilon": 0.35, "r0": 2.55, "rho0": 4.0}),
        (_c60, {"epsilon": 2.0, "r0": 1.4, "rho0": 5.0, "rcut1": 1.6, "rcut2": 2.4}),
    ],
)
def test_morse_matches_ase(make_atoms, params: dict) -> None:
    _compare(Morse(**params), AseMorse(**params), make_atoms())


@pytest.mark.parametrize(
    ("model", "calc", "make_atoms", "stresses"),
    [
        (EMT(), AseEMT(), _emt_alloy, False),
        (
            LennardJones(sigma=3.4, epsilon=0.0104, rc=8.5, smooth=True),
            AseLennardJones(sigma=3.4, epsilon=0.0104, rc=8.5, smooth=True),
            _ar_triclinic,
            True,
        ),
        (
            Morse(epsilon=2.0, r0=1.4, rho0=5.0),
            AseMorse(epsilon=2.0, r0=1.4, rho0=5.0),
            _c60,
            False,
        ),
    ],
)
def test_float32(model: torch.nn.Module, calc, make_atoms, stresses: bool) -> None:
    model = model.to(torch.float32)
    _compare(model, calc, make_atoms(), rtol=RTOL32, dtype=torch.float32, stresses=stresses)


def test_emt_buffer_follows_model_dtype() -> None:
    model = EMT()
    assert model.table.dtype == torch.float64
    assert model.to(torch.float32).table.dtype == torch.float32
