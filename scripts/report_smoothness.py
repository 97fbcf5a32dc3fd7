"""How smooth and order-independent EMT energies are: ase_shard beside ASE's own EMT.

The four measurements of docs/models.md "Compensated sums" (issue 27), for any source
tree on ``PYTHONPATH``, in one process:

- one Au atom (218.75 eV, hundreds of periodic images) in two equivalent cells
  (ASE's ``bravais/test_orcc_mcl``): energy difference, eV;
- a 108-atom CuAg alloy in a cubic and a sheared cell of the same lattice: energy
  difference, eV;
- finite-difference against analytical stress of rattled Cu (ASE's
  ``calculator/test_fd``, whose bar is 1.5e-7), the largest relative error per
  rattle; the first rattle is ASE's (seed 42), then the median over seeds 0-11;
- energy noise: the standard deviation of second differences of the energy along a
  homogeneous strain path of 21 points within +-1e-6 (a smooth function gives ~0).

Usage::

    python scripts/report_smoothness.py
    PYTHONPATH=/path/to/other/tree python scripts/report_smoothness.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from ase import Atoms
from ase.build import bulk
from ase.calculators.emt import EMT as AseEMT
from ase.calculators.fd import FiniteDifferenceCalculator
from ase.cell import Cell

import ase_shard
from ase_shard.models import EMT

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from systems import alloy_in_equivalent_cells  # noqa: E402


def ours() -> ase_shard.ShardedCalculator:
    return ase_shard.ShardedCalculator(EMT())


def equivalent_cells_au(make) -> float:
    cell = Cell.new([[1, 0, 0], [0, 2, 0], [0.5, 0, 3]])
    energies = []
    for c in (cell, cell.get_bravais_lattice().tocell()):
        atoms = Atoms("Au", cell=c, pbc=True)
        atoms.calc = make()
        energies.append(atoms.get_potential_energy())
    return abs(energies[0] - energies[1])


def equivalent_cells_alloy(make) -> float:
    energies = []
    for atoms in alloy_in_equivalent_cells():
        atoms.calc = make()
        energies.append(atoms.get_potential_energy())
    return abs(energies[0] - energies[1])


def fd_stress_error(make, seed: int) -> float:
    atoms = bulk("Cu", cubic=True)
    atoms.rattle(0.1, seed=seed)
    atoms.calc = make()
    analytical = atoms.get_stress()
    atoms.calc = FiniteDifferenceCalculator(make())
    numerical = atoms.get_stress()
    return float(np.max(np.abs(numerical - analytical) / np.abs(analytical)))


def energy_noise(make) -> float:
    atoms = bulk("Cu", cubic=True)
    atoms.rattle(0.1, seed=42)
    energies = []
    for strain in np.linspace(-1e-6, 1e-6, 21):
        strained = atoms.copy()
        strained.set_cell(atoms.cell * (1 + strain), scale_atoms=True)
        strained.calc = make()
        energies.append(strained.get_potential_energy())
    return float(np.std(np.diff(energies, 2)))


def main() -> None:
    rows = [
        ("Au atom, equivalent cells (eV)", equivalent_cells_au),
        ("CuAg alloy, equivalent cells (eV)", equivalent_cells_alloy),
        ("FD stress, seed 42 (relative)", lambda make: fd_stress_error(make, 42)),
        (
            "FD stress, median of seeds 0-11",
            lambda make: float(np.median([fd_stress_error(make, s) for s in range(12)])),
        ),
        ("energy noise (eV)", energy_noise),
    ]
    print(f"ase_shard from {ase_shard.__file__}")
    print(f"{'measurement':36s} {'ase_shard':>10s} {'ASE EMT':>10s}")
    for name, measure in rows:
        print(f"{name:36s} {measure(ours):10.2e} {measure(AseEMT):10.2e}")


if __name__ == "__main__":
    main()
