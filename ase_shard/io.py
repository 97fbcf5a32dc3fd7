"""Trajectories of distributed atoms, written by one rank.

:class:`Trajectory` gathers a :class:`~ase_shard.distributed.DistributedAtoms`
to one rank each time it writes (so ``dyn.attach(traj.write, interval=10)``
gathers every 10 steps only), with the calculator's results in the global
atom order, and that rank writes an ordinary ASE ``.traj`` file.

A run restarts from a frame read on one rank (``parallel=False``: ASE's
``read`` otherwise broadcasts from rank 0, a collective the other ranks would
not enter)::

    atoms = read("md.traj", parallel=False) if comm.rank == 0 else None
    atoms = distribute(atoms)  # positions, momenta, masses, tags, charges, magmoms

ASE's trajectory format keeps those arrays only (no custom per-atom arrays).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from ase import Atoms
from ase.calculators.calculator import PropertyNotImplementedError
from ase.calculators.singlepoint import SinglePointCalculator
from ase.io.trajectory import TrajectoryWriter
from ase.parallel import DummyMPI

from ase_shard.comm import Comm
from ase_shard.distributed import DistributedAtoms, gather

# results the same on every rank, and results with one row per local atom
GLOBAL_RESULTS = ("energy", "free_energy", "stress")
PER_ATOM_RESULTS = ("forces", "energies", "stresses")
_RESULT_ARRAY = "ase_shard_result_"


class Trajectory:
    """An ASE trajectory writer for distributed (or ordinary) atoms.

    Parameters
    ----------
    filename : str or Path
        The ``.traj`` file, written by ``root`` alone.
    mode : {"w", "a"}
        Write a new file, or append to one.
    atoms : Atoms, optional
        What :meth:`write` writes when called without atoms.
    root : int
        The rank that writes.
    comm : mpi4py communicator, optional
        The ranks that call :meth:`write` together (default
        ``MPI.COMM_WORLD``); that of the distributed atoms written.
    """

    def __init__(
        self,
        filename: str | Path,
        mode: str = "w",
        atoms: Atoms | None = None,
        *,
        root: int = 0,
        comm: Any = None,
    ):
        self.comm = Comm(comm)
        self.atoms, self.root = atoms, root
        self.frames = 0  # written so far (by this object), known on every rank
        self._writer = None
        if self.comm.rank == root:
            self._writer = TrajectoryWriter(filename, mode, master=True, comm=DummyMPI())

    def __enter__(self) -> Trajectory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return self.frames

    def set_description(self, description: dict) -> None:
        """Header description of the file (as ASE's writer); used by ASE's drivers."""
        if self._writer is not None:
            self._writer.set_description(description)

    def write(self, atoms: Atoms | None = None, **kwargs: Any) -> None:
        """Write one frame (collective for distributed atoms).

        Parameters
        ----------
        atoms : Atoms, DistributedAtoms or an ASE optimisable, optional
            Default: the ``atoms`` given at creation. Distributed atoms are
            gathered to ``root`` in their original order; their calculator's
            energy, free energy and stress (eV, eV/Å³) and per-atom forces,
            energies and stresses, where current, are written with them.
            Other atoms are written by ``root`` as given.
        **kwargs
            Extra properties, as for ASE's ``TrajectoryWriter.write``.
        """
        atoms = self.atoms if atoms is None else atoms
        if atoms is None:
            raise ValueError("Trajectory.write: no atoms given, here or at creation")
        atoms = getattr(atoms, "atoms", atoms)  # a driver's optimisable or a filter
        if isinstance(atoms, DistributedAtoms):
            atoms = _gathered_with_results(atoms, self.root)
        if self._writer is not None:
            self._writer.write(atoms, **kwargs)
        self.frames += 1

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def _gathered_with_results(atoms: DistributedAtoms, root: int) -> Atoms | None:
    """The whole system on ``root``, with a single-point calculator of the current results.

    Collective. Per-atom results travel as per-atom arrays of a copy, so
    :func:`gather` puts them in the global order along with the atoms.
    """
    local = atoms.copy()
    results = _current_results(atoms)
    for name in PER_ATOM_RESULTS:
        if name in results:
            local.arrays[_RESULT_ARRAY + name] = results.pop(name)
    whole = gather(local, root=root)
    if whole is None:
        return None
    for name in PER_ATOM_RESULTS:
        if _RESULT_ARRAY + name in whole.arrays:
            results[name] = whole.arrays.pop(_RESULT_ARRAY + name)
    if results:
        whole.calc = SinglePointCalculator(whole, **results)
    return whole


def _current_results(atoms: Atoms) -> dict[str, np.ndarray]:
    """The attached calculator's results for ``atoms`` as they are now, without computing.

    Every rank asks for the same properties in the same order, as a
    distributed calculator's (collective) state check requires.
    """
    calc, results = atoms.calc, {}
    if calc is None:
        return results
    for name in (*GLOBAL_RESULTS, *PER_ATOM_RESULTS):
        if name not in calc.implemented_properties:
            continue
        try:
            value = calc.get_property(name, atoms, allow_calculation=False)
        except PropertyNotImplementedError:
            value = None
        if value is not None:
            results[name] = np.asarray(value)
    return results
