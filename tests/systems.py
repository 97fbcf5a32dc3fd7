"""The test systems of the acceptance list, each with its model and ASE's calculator."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from ase import Atoms
from ase.build import bulk, fcc111, molecule
from ase.calculators.calculator import Calculator
from ase.calculators.emt import EMT as AseEMT
from ase.calculators.lj import LennardJones as AseLennardJones
from ase.calculators.morse import MorsePotential as AseMorse
from ase.cluster import Icosahedron

from ase_shard.models import EMT, LennardJones, Morse


def _rattled(atoms: Atoms, stdev: float, seed: int) -> Atoms:
    atoms.rattle(stdev=stdev, seed=seed)
    return atoms


def _cu_bulk() -> Atoms:
    return _rattled(bulk("Cu", "fcc", a=3.6, cubic=True).repeat(3), 0.05, 1)


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


def _c60_in_box() -> Atoms:
    # a cell on non-periodic axes must not be used for wrapping
    atoms = _c60()
    atoms.center(vacuum=4.0)
    return atoms


def _c60() -> Atoms:
    return _rattled(molecule("C60"), 0.03, 8)


AR = {"sigma": 3.4, "epsilon": 0.0104, "rc": 8.5}
TINY_LJ = {"sigma": 1.0, "epsilon": 1.0, "rc": 4.0}
MORSE_CU = {"epsilon": 0.35, "r0": 2.55, "rho0": 4.0}
# a weak Lennard-Jones tail reaching further than EMT's 5.9 Å list (a term of sums)
LJ_TAIL = {"sigma": 2.3, "epsilon": 0.02, "rc": 7.5}
MORSE_C = {"epsilon": 2.0, "r0": 1.4, "rho0": 5.0, "rcut1": 1.6, "rcut2": 2.4}


@dataclass(frozen=True)
class Case:
    """A system, the torch model under test and ASE's calculator for the same physics."""

    make_atoms: Callable[[], Atoms]
    make_model: Callable[[], torch.nn.Module]
    make_ase_calc: Callable[[], Calculator]
    has_stresses: bool = False  # ASE's calculator provides per-atom stresses


CASES = {
    "cu_bulk_emt": Case(_cu_bulk, EMT, AseEMT),
    "alloy_emt": Case(_emt_alloy, EMT, AseEMT),
    "pt111_slab_emt": Case(_pt_slab, EMT, AseEMT),
    "au_cluster_emt": Case(_au_cluster_with_lone_atom, EMT, AseEMT),
    "ar_triclinic_lj": Case(
        _ar_triclinic, lambda: LennardJones(**AR), lambda: AseLennardJones(**AR), True
    ),
    "ar_triclinic_lj_smooth": Case(
        _ar_triclinic,
        lambda: LennardJones(**AR, smooth=True),
        lambda: AseLennardJones(**AR, smooth=True),
        True,
    ),
    "two_atom_cell_lj": Case(
        _two_atom_cell, lambda: LennardJones(**TINY_LJ), lambda: AseLennardJones(**TINY_LJ), True
    ),
    "two_atom_cell_lj_smooth": Case(
        _two_atom_cell,
        lambda: LennardJones(**TINY_LJ, smooth=True),
        lambda: AseLennardJones(**TINY_LJ, smooth=True),
        True,
    ),
    "morse_crystal_tft": Case(
        _morse_crystal, lambda: Morse(**MORSE_CU), lambda: AseMorse(**MORSE_CU)
    ),
    "c60_morse": Case(_c60, lambda: Morse(**MORSE_C), lambda: AseMorse(**MORSE_C)),
    "c60_in_box_morse": Case(_c60_in_box, lambda: Morse(**MORSE_C), lambda: AseMorse(**MORSE_C)),
}


def alloy_in_equivalent_cells() -> tuple[Atoms, Atoms]:
    """108 rattled, compressed CuAg atoms (~160 eV) in a cubic cell, and the same lattice
    in a sheared cell with the atoms wrapped into it (each cell lists the pairs in
    another order; the energies must agree to round-off)."""
    rng = np.random.default_rng(3)
    cubic = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(3)
    cubic.numbers[rng.random(len(cubic)) < 0.3] = 47
    cubic.rattle(0.15, rng=rng)
    cubic.set_cell(cubic.cell * 0.93, scale_atoms=True)
    sheared = cubic.copy()
    vectors = sheared.cell.array.copy()
    vectors[1] += vectors[0]
    vectors[2] -= 2 * vectors[1]
    sheared.set_cell(vectors)
    sheared.wrap()
    return cubic, sheared


def ag_slab() -> Atoms:
    """12 Ag/Cu/Au atoms, fcc(111) with 5 Å of vacuum, pbc (T, T, F), rattled."""
    slab = fcc111("Ag", size=(2, 2, 3), vacuum=5.0, a=4.0)
    slab.numbers[[0, 5, 9]] = [29, 79, 29]
    slab.rattle(0.1, seed=2)
    return slab


def au_cluster(rng: np.random.Generator) -> Atoms:
    """16 Au/Cu/Ag atoms without a cell (non-periodic), six substituted at random."""
    cluster = bulk("Au", "fcc", a=4.0, cubic=True).repeat((2, 2, 1))
    cluster.numbers[rng.choice(len(cluster), 6, replace=False)] = [29, 29, 47, 47, 29, 47]
    cluster.rattle(0.1, seed=3)
    cluster.pbc = False
    cluster.cell = np.zeros((3, 3))
    return cluster
