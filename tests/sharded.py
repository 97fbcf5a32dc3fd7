"""Helpers for tests that run at any rank count (plain pytest or under mpirun)."""

from __future__ import annotations

import hashlib
import sys

import numpy as np
from ase import Atoms

from ase_shard.comm import Comm

COMM = Comm()


def serial_comm():
    """A one-rank communicator for serial references (``MPI.COMM_SELF`` under MPI)."""
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi.COMM_SELF if mpi is not None else None


def results(atoms: Atoms) -> dict[str, np.ndarray]:
    """Everything the attached calculator provides for ``atoms``."""
    out = {
        "energy": np.asarray(atoms.get_potential_energy()),
        "energies": atoms.get_potential_energies(),
        "forces": atoms.get_forces(),
    }
    if atoms.cell.rank == 3:
        out["stress"] = atoms.get_stress()
        out["stresses"] = atoms.get_stresses()
    return out


def assert_identical_on_all_ranks(values: dict[str, np.ndarray]) -> None:
    """Every rank holds bitwise the same ``values``."""
    digest = hashlib.blake2b()
    for key in sorted(values):
        digest.update(np.ascontiguousarray(values[key], dtype=np.float64).tobytes())
    digests = COMM.allgather(digest.hexdigest())
    assert len(set(digests)) == 1, digests


def random_gas(pbc, n_atoms: int = 64, seed: int = 0) -> Atoms:
    """Random positions of Cu, Ag and Au in a ~10 Å box with the given ``pbc``.

    Non-periodic axes get a zero cell vector, the harshest legal input.
    """
    rng = np.random.default_rng(seed)
    lengths = np.array([10.0, 10.5, 11.0])
    cell = np.diag(np.where(pbc, lengths, 0.0))
    cell[1, 0] = 1.5 if pbc[0] and pbc[1] else 0.0  # triclinic when possible
    positions = rng.uniform(0.0, 1.0, (n_atoms, 3)) * lengths
    numbers = rng.choice([29, 47, 79], n_atoms)
    return Atoms(numbers=numbers, positions=positions, cell=cell, pbc=pbc)
