"""Coulomb (Ewald and PME) in one process: what it declares and refuses, PME's error
against a converged Ewald sum, and forces with charges from a model against finite
differences. Its results against torch-pme's own calculators at 1-4 ranks:
``tests/test_sharded_coulomb.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torchpme")

from ase import Atoms  # noqa: E402
from ase.build import bulk, molecule  # noqa: E402
from ase.calculators.calculator import PropertyNotImplementedError  # noqa: E402
from oracles import rel_err  # noqa: E402
from toy_models import ChargeTransfer  # noqa: E402

from ase_shard import ShardedCalculator  # noqa: E402
from ase_shard.models import EMT, Coulomb, Sum  # noqa: E402

# relative, to round-off: what the tests assert (the acceptance is 1e-8 against torch-pme
# and 1e-10 for charges from a model, against finite differences and one rank)
RTOL = 1e-10
# Å: the real-space cutoff of the tests' sums (shorter than the 8 Å default, for time)
CUTOFF = 6.0


def ionic(atoms: Atoms) -> Atoms:
    """``atoms`` with formal charges: +1 on Na, -1 on Cl."""
    atoms.set_initial_charges(np.where(atoms.numbers == 11, 1.0, -1.0))
    return atoms


def coulomb_systems() -> dict[str, Atoms]:
    """Rocksalt NaCl (64 atoms, rattled), a disordered molten-salt-like snapshot (the
    same atoms displaced by 0.4 Å in a cell 10% longer) and a triclinic cell (the
    rhombohedral primitive cell, 3x3x3, sheared)."""
    rocksalt = bulk("NaCl", "rocksalt", a=5.64, cubic=True).repeat(2)
    rocksalt.rattle(0.05, seed=1)
    molten = bulk("NaCl", "rocksalt", a=5.64, cubic=True).repeat(2)
    molten.set_cell(molten.cell * 1.1, scale_atoms=True)
    molten.rattle(0.4, seed=2)
    triclinic = bulk("NaCl", "rocksalt", a=5.64).repeat(3)
    shear = np.array([[1.0, 0.08, -0.05], [0.03, 0.97, 0.06], [-0.04, 0.05, 1.02]])
    triclinic.set_cell(triclinic.cell.array @ shear, scale_atoms=True)
    triclinic.rattle(0.05, seed=3)
    systems = {"rocksalt": rocksalt, "molten": molten, "triclinic": triclinic}
    return {name: ionic(atoms) for name, atoms in systems.items()}


def test_declarations() -> None:
    """Parameters from cutoff and accuracy; a charge model adds a layer; what is refused."""
    model = Coulomb(cutoff=CUTOFF, accuracy=1e-6)
    assert model.uses_positions and model.num_layers == 1
    assert model.per_atom_inputs == ("initial_charges",)
    # the Gaussian's real-space tail and the k-space tail both fall to ~accuracy
    s = np.sqrt(np.log(1e6))
    assert model.smearing == pytest.approx(CUTOFF / (np.sqrt(2) * s))
    assert np.pi / model.lr_wavelength == pytest.approx(np.sqrt(2) * s / model.smearing)
    predicted = Coulomb(charges=ChargeTransfer(), cutoff=CUTOFF)
    assert predicted.num_layers == 2 and predicted.supports_layer_halo
    assert not hasattr(predicted, "per_atom_inputs")
    assert Sum(EMT(), model).uses_positions and not Sum(EMT()).uses_positions
    with pytest.raises(ValueError, match="method"):
        Coulomb(method="p3m")
    with pytest.raises(ValueError, match="longer than"):
        Coulomb(charges=ChargeTransfer(cutoff=7.0), cutoff=CUTOFF)


def test_stresses_are_refused() -> None:
    """The reciprocal sum's virial has no per-atom split: ``stresses`` is not offered."""
    atoms = coulomb_systems()["rocksalt"]
    atoms.calc = ShardedCalculator(Coulomb(cutoff=CUTOFF))
    assert "stresses" not in atoms.calc.implemented_properties
    assert np.isfinite(atoms.get_stress()).all()
    with pytest.raises(PropertyNotImplementedError, match="stresses"):
        atoms.get_stresses()


@pytest.mark.parametrize("pbc", [(True, True, False), (False, False, False)])
def test_needs_a_periodic_cell(pbc) -> None:
    """A slab or a molecule: a clear error, not an Ewald sum of a lattice it is not."""
    atoms = coulomb_systems()["rocksalt"] if pbc[0] else ionic(molecule("NaCl"))
    atoms.pbc = pbc
    atoms.calc = ShardedCalculator(Coulomb(cutoff=CUTOFF))
    with pytest.raises(ValueError, match="periodic along all three axes"):
        atoms.get_potential_energy()


@pytest.mark.parametrize("system", ["rocksalt", "molten"])
def test_pme_error_against_converged_ewald(system: str) -> None:
    """PME at the default accuracy against Ewald at 1e-12 (converged): the error that
    docs/models.md reports, bounded here."""
    atoms = coulomb_systems()[system]
    results = {}
    for method, accuracy in (("pme", 1e-6), ("ewald", 1e-12)):
        atoms.calc = ShardedCalculator(Coulomb(method=method, cutoff=8.0, accuracy=accuracy))
        results[method] = (atoms.get_potential_energy(), atoms.get_forces(), atoms.get_stress())
    energy, forces, stress = (
        rel_err(got, ref) for got, ref in zip(results["pme"], results["ewald"], strict=True)
    )
    print(
        f"PME vs converged Ewald, {system}: energy {energy:.1e} forces {forces:.1e} stress "
        f"{stress:.1e}"
    )
    # measured: energy 3e-6 / 8e-6, forces 4e-4 / 3e-5, stress 2e-5 / 4e-5
    assert energy < 2e-5 and forces < 1e-3 and stress < 1e-4


def test_predicted_charges_forces_are_the_energy_gradient() -> None:
    """Charges from a model: forces and stress equal 5-point central differences of the
    energy (the charges' dependence on the positions included), to 1e-10 of the largest.
    At accuracy 1e-10 the energy's jumps as pairs cross the real-space cutoff (erfc
    there) are far below the differences' round-off."""
    atoms = coulomb_systems()["molten"]
    model = Coulomb(charges=ChargeTransfer(), cutoff=CUTOFF, accuracy=1e-10)
    atoms.calc = ShardedCalculator(model)
    forces, stress = atoms.get_forces(), atoms.get_stress()
    stencil = ((-2, 1 / 12), (-1, -2 / 3), (1, 2 / 3), (2, -1 / 12))

    def derivative(move, step: float) -> float:
        energies = []
        for k, _ in stencil:
            displaced = atoms.copy()
            move(displaced, k * step)
            displaced.calc = atoms.calc
            energies.append(displaced.get_potential_energy())
        return sum(weight * e for (_, weight), e in zip(stencil, energies, strict=True)) / step

    # measured: within 4e-12 of the largest force (steps of 1e-3 Å) and 1.3e-12 of the
    # largest stress (strains of 3e-4)
    for atom, axis in ((0, 0), (7, 1), (33, 2), (50, 0)):

        def move(displaced, h, atom=atom, axis=axis):
            displaced.positions[atom, axis] += h

        error = abs(-derivative(move, 1e-3) - forces[atom, axis])
        assert error <= RTOL * np.abs(forces).max(), (atom, axis, error)
    for voigt, (a, b) in ((0, (0, 0)), (5, (0, 1))):

        def strain(displaced, h, a=a, b=b):
            deformation = np.eye(3)
            deformation[a, b] += h
            displaced.set_cell(displaced.cell.array @ deformation, scale_atoms=True)

        # the virial is symmetric (the energy does not change with a rotation), so one
        # off-diagonal strain's derivative is the stress's term
        error = abs(derivative(strain, 3e-4) / atoms.get_volume() - stress[voigt])
        assert error <= RTOL * np.abs(stress).max(), (voigt, error)


def test_cli_coulomb_adds_electrostatics_and_is_recorded(tmp_path, capsys) -> None:
    """``ase-shard md FILE --model lj --coulomb pme`` runs the Lennard-Jones preset + PME of
    the file's charges: its frames hold ASE's Lennard-Jones plus torch-pme's PME, and
    record ``pme``; a restart keeps it and refuses another; a structure without charges
    exits 2 with a message."""
    from ase.io import write
    from md_terms import assert_refused, run_with_term
    from oracles import ase_results, torchpme_results

    from ase_shard.md import ASE_CALCULATORS

    _, traj, frame = run_with_term(tmp_path, coulomb_systems()["rocksalt"], "lj", "coulomb", "pme")
    lj = ase_results(ASE_CALCULATORS["lj"](), frame)
    pme = torchpme_results(Coulomb(method="pme"), frame)
    expected = lj["energy"] + pme["energy"]
    assert abs(frame.get_potential_energy() - expected) <= RTOL * abs(expected)
    forces = lj["forces"] + pme["forces"]
    np.testing.assert_allclose(
        frame.get_forces(), forces, rtol=0, atol=RTOL * np.abs(forces).max()
    )
    neutral = tmp_path / "argon.extxyz"
    write(neutral, bulk("Ar", "fcc", a=5.26, cubic=True).repeat(2))
    assert_refused(
        capsys,
        [
            (
                ["--restart", str(traj), "--coulomb", "ewald"],
                "written with --coulomb pme, not ewald",
            ),
            ([str(neutral), "--model", "lj", "--coulomb", "ewald"], "holds no charges"),
        ],
    )
