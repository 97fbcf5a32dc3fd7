"""Helpers for tests that run at any rank count (plain pytest or under mpirun)."""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable

import numpy as np
from ase import Atoms
from ase.build import bulk
from ase.geometry import get_distances
from ase.md.velocitydistribution import Stationary, thermalize_momenta
from oracles import ase_results, relative_errors
from systems import CASES

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


def identical_on_all_ranks(*arrays: np.ndarray) -> bool:
    """Whether every rank holds bitwise the same arrays."""
    digest = hashlib.blake2b()
    for array in arrays:
        digest.update(np.ascontiguousarray(array, dtype=np.float64).tobytes())
    return len(set(COMM.allgather(digest.hexdigest()))) == 1


def assert_identical_on_all_ranks(values: dict[str, np.ndarray]) -> None:
    """Every rank holds bitwise the same ``values``."""
    assert identical_on_all_ranks(*(values[key] for key in sorted(values)))


def assert_matches(atoms: Atoms, ase_calc, stresses: bool = False, rtol: float = 1e-10) -> None:
    """The calculator attached to ``atoms`` gives ``ase_calc``'s results (relative
    ``rtol``), bitwise alike on every rank."""
    got = results(atoms)
    errors = relative_errors(got, ase_results(ase_calc, atoms, stresses=stresses))
    assert max(errors.values()) <= rtol, errors
    assert_identical_on_all_ranks(got)


def cu_bulk() -> Atoms:
    """The shared EMT case: 108 rattled Cu atoms (``systems.CASES["cu_bulk_emt"]``)."""
    return CASES["cu_bulk_emt"].make_atoms()


def on_root(compute: Callable[[], object]) -> object:
    """``compute()`` on rank 0 alone (a one-rank reference), broadcast to every rank.

    An exception on rank 0 is raised on every rank instead of leaving them waiting.
    """
    value, error = None, None
    if COMM.is_root:
        try:
            value = compute()
        except Exception as exc:
            error = repr(exc)
    value, error = COMM.bcast((value, error))
    if error is not None:
        raise RuntimeError(f"rank 0 failed in a one-rank reference: {error}")
    return value


def fewer_atoms_than_ranks() -> dict[str, Atoms]:
    """One Cu atom, and a Cu and an Ag atom, in a small triclinic periodic cell.

    Both partitions balance atom counts, so only fewer atoms than ranks leave
    a rank empty: ``"one"`` from 2 ranks, ``"two"`` from 3. Each atom sees
    images of itself and of the other atom within 3 Å (cell vectors ~3 Å). The
    lone atom's forces vanish by symmetry (a Bravais lattice); its energy and
    stress do not.
    """
    cell = [[2.9, 0.0, 0.0], [0.6, 3.1, 0.0], [-0.4, 0.5, 3.3]]
    one = Atoms("Cu", positions=[[0.2, 0.1, 0.3]], cell=cell, pbc=True)
    two = Atoms("CuAg", positions=[[0.2, 0.1, 0.3], [1.5, 1.6, 1.4]], cell=cell, pbc=True)
    return {"one": one, "two": two}


def assert_ranks_own_nothing_iff_fewer_atoms(calc, n_atoms: int) -> None:
    """``calc``'s layout has a rank that owns no atom exactly when ``n_atoms`` < ranks."""
    owned = [owned for _, owned, _ in calc.layout_counts]
    assert sum(owned) == n_atoms, owned
    assert (0 in owned) == (n_atoms < COMM.size), owned


# eV/Å: forces this small in a reference vanish by symmetry (a lone atom in its cell)
VANISHING_FORCE = 1e-12


def assert_close_to(got: dict, ref: dict, rtol: float) -> None:
    """``got`` equals ``ref`` on every key of ``ref``: to ``rtol`` relative (max-abs error
    over max-abs value), or to ``VANISHING_FORCE`` absolute for forces that vanish in ``ref``."""
    failures = {}
    for key, value in ref.items():
        error = float(np.max(np.abs(np.asarray(got[key]) - value), initial=0.0))
        scale = float(np.max(np.abs(value), initial=0.0))
        if key == "forces" and scale < VANISHING_FORCE:
            if error > VANISHING_FORCE:
                failures[key] = f"{error:.2e} eV/Å absolute"
        elif error > rtol * scale:
            failures[key] = f"{error / scale:.2e} relative"
    assert not failures, failures


def thermalised_cu(repeat: int, temperature_k: float, seed: int) -> Atoms:
    """fcc Cu (a = 3.61 Å), rattled by 0.02 Å, with Maxwell-Boltzmann momenta.

    The same on every rank. The rattle makes forces non-zero from the first
    step, so their relative errors mean something.
    """
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(repeat)
    atoms.rattle(stdev=0.02, seed=seed)
    thermalize_momenta(atoms, temperature_K=temperature_k, rng=np.random.default_rng(seed))
    Stationary(atoms)
    return atoms


def random_gas(pbc, n_atoms: int = 64, seed: int = 0) -> Atoms:
    """Random positions of Cu, Ag and Au in a ~10 Å box with the given ``pbc``.

    Non-periodic axes get a zero cell vector, the harshest legal input. Atoms
    are redrawn until no two (nor periodic images) are closer than 1 Å, so
    ShardedCalculator's ``min_distance`` check passes.
    """
    rng = np.random.default_rng(seed)
    lengths = np.array([10.0, 10.5, 11.0])
    cell = np.diag(np.where(pbc, lengths, 0.0))
    cell[1, 0] = 1.5 if pbc[0] and pbc[1] else 0.0  # triclinic when possible
    positions = rng.uniform(0.0, 1.0, (n_atoms, 3)) * lengths
    while True:
        distances = get_distances(positions, cell=cell, pbc=pbc)[1]
        np.fill_diagonal(distances, np.inf)
        crowded = np.flatnonzero((distances < 1.0).any(axis=1))
        if not len(crowded):
            break
        positions[crowded[0]] = rng.uniform(0.0, 1.0, 3) * lengths
    numbers = rng.choice([29, 47, 79], n_atoms)
    return Atoms(numbers=numbers, positions=positions, cell=cell, pbc=pbc)
