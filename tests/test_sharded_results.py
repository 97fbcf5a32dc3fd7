"""``calc.results`` as ASE's own calculators leave it, and energies as smooth as theirs.

Serially and under mpirun (every rank checks its own copy of the results).

- After an energy call, ASE's ``EMT``, ``LennardJones`` and ``MorsePotential``
  hold energy, free energy, per-atom energies and forces (and stress for a
  3-D cell); ASE's tools read them from ``calc.results`` (the extxyz and CASTEP
  writers, the dimer method), so ours must hold at least the same, with the
  same values.
- Energies are summed with compensation (``ase_shard.summation``): the same
  crystal in two equivalent cells gives the same energy to 1e-12 eV, and
  finite differences of the energy match the analytical stress as tightly as
  ASE's ``test_fd`` asks of ASE's EMT.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from ase import Atoms
from ase.build import bulk
from ase.calculators.emt import EMT as AseEMT
from ase.calculators.fd import FiniteDifferenceCalculator
from ase.calculators.lj import LennardJones as AseLJ
from ase.cell import Cell
from oracles import relative_errors
from systems import CASES, alloy_in_equivalent_cells

from ase_shard import ShardedCalculator
from ase_shard.models import EMT, LennardJones

# periodic (3-D cells) and not: the clusters have no stress to ask for
_PERIODIC = ["alloy_emt", "ar_triclinic_lj", "morse_crystal_tft"]
_CALLS = [
    *((name, call) for name in _PERIODIC for call in ("get_potential_energy", "get_stress")),
    *((name, "get_potential_energy") for name in ["au_cluster_emt", "c60_morse"]),
    ("alloy_emt", "get_forces"),
]


@pytest.mark.parametrize(("name", "call"), _CALLS)
def test_results_hold_what_ases_calculator_holds(name: str, call: str) -> None:
    """Every key ASE's calculator of the same potential fills, with the same values."""
    case = CASES[name]
    atoms = case.make_atoms()
    reference, ours = atoms.copy(), atoms.copy()
    reference.calc = case.make_ase_calc()
    ours.calc = ShardedCalculator(case.make_model())
    getattr(reference, call)()
    getattr(ours, call)()
    expected = set(reference.calc.results) - {"stresses"}  # per-atom stresses: when asked
    assert expected <= set(ours.calc.results), sorted(expected - set(ours.calc.results))
    errors = relative_errors(ours.calc.results, {k: reference.calc.results[k] for k in expected})
    assert max(errors.values()) <= 1e-10, errors


def test_an_energy_call_leaves_forces_for_ases_writers() -> None:
    """ASE's extxyz writer stores what ``calc.results`` holds after an energy call."""
    from ase.io import read, write

    atoms = CASES["alloy_emt"].make_atoms()
    atoms.calc = ShardedCalculator(EMT())
    energy = atoms.get_potential_energy()
    text = io.StringIO()
    write(text, atoms, format="extxyz", parallel=False)  # every rank its own copy
    text.seek(0)
    frame = read(text, format="extxyz", parallel=False)
    reference = atoms.copy()
    reference.calc = AseEMT()
    # extxyz keeps 8 decimals of the per-atom columns
    assert frame.get_potential_energy() == pytest.approx(energy, rel=1e-12)
    np.testing.assert_allclose(frame.get_forces(), reference.get_forces(), rtol=0, atol=1e-7)
    np.testing.assert_allclose(
        frame.calc.results["energies"], reference.get_potential_energies(), rtol=0, atol=1e-7
    )


def _au_in(cell: Cell) -> float:
    atoms = Atoms("Au", cell=cell, pbc=True)
    atoms.calc = ShardedCalculator(EMT())
    return atoms.get_potential_energy()


def test_one_atom_in_equivalent_cells_has_one_energy() -> None:
    """ASE's ``bravais/test_orcc_mcl``: 218.75 eV from hundreds of periodic images.

    The same lattice in two cells lists the images in another order; plain sums
    differed by 1.02e-12 eV (ASE's EMT: 0).
    """
    for cell in (
        Cell.new([[1, 0, 0], [0, 2, 0], [0.5, 0, 3]]),
        Cell.new([[1, 0, 0], [0, 2, 0], [0.5 - 1e-3, 0, 3]]),
    ):
        first, second = _au_in(cell), _au_in(cell.get_bravais_lattice().tocell())
        assert first == pytest.approx(218.75, abs=0.01)
        assert abs(first - second) <= 1e-12, first - second


def test_a_pair_potential_in_equivalent_cells_has_one_energy() -> None:
    """One argon atom and its ~1,200 images within 12 Å, in the two cells of
    :func:`test_one_atom_in_equivalent_cells_has_one_energy`: the kernel's per-atom
    energy is a plain sum of its pairs' halves, here all into one atom, in another
    order per cell; within 1e-14 relative (measured 4.5e-15), ASE's ``LennardJones``
    to 1e-10."""
    for cell in (
        Cell.new([[1, 0, 0], [0, 2, 0], [0.5, 0, 3]]),
        Cell.new([[1, 0, 0], [0, 2, 0], [0.5 - 1e-3, 0, 3]]),
    ):
        energies = []
        for each in cell, cell.get_bravais_lattice().tocell():
            atoms = Atoms("Ar", cell=each, pbc=True)
            atoms.calc = ShardedCalculator(LennardJones(sigma=1.0, epsilon=1.0, rc=12.0))
            energies.append(atoms.get_potential_energy())
        assert energies[0] == pytest.approx(energies[1], rel=1e-14, abs=0)
        atoms.calc = AseLJ(sigma=1.0, epsilon=1.0, rc=12.0, smooth=False)
        assert energies[1] == pytest.approx(atoms.get_potential_energy(), rel=1e-10, abs=0)


def test_an_alloy_in_equivalent_cells_has_one_energy() -> None:
    """108 atoms (about 160 eV) in a cubic cell and in a sheared one of the same lattice,
    with its atoms wrapped into it: within 1e-12 eV, and ASE's energy to 1e-10 relative."""
    atoms, sheared = alloy_in_equivalent_cells()
    energies = []
    for copy in atoms.copy(), sheared:
        copy.calc = ShardedCalculator(EMT())
        energies.append(copy.get_potential_energy())
    assert abs(energies[0] - energies[1]) <= 1e-12, energies[0] - energies[1]
    atoms.calc = AseEMT()
    assert energies[0] == pytest.approx(atoms.get_potential_energy(), rel=1e-10, abs=0)


def test_finite_differences_match_as_tightly_as_for_ases_emt() -> None:
    """ASE's ``calculator/test_fd``: stress to 1.5e-7 relative (plain sums: 2.7e-7)."""
    atoms = bulk("Cu", cubic=True)
    atoms.rattle(0.1, seed=42)
    atoms.calc = ShardedCalculator(EMT())
    analytical = atoms.get_forces(), atoms.get_stress()
    atoms.calc = FiniteDifferenceCalculator(ShardedCalculator(EMT()))
    numerical = atoms.get_forces(), atoms.get_stress()
    np.testing.assert_allclose(numerical[0], analytical[0], rtol=1e-7)
    np.testing.assert_allclose(numerical[1], analytical[1], rtol=1.5e-7)
