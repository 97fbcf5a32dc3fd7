"""Distributed atoms: each rank holds only the atoms it owns (ASAP3-style).

:func:`distribute` turns one ``Atoms`` into a :class:`DistributedAtoms` per
rank; a :class:`~ase_shard.ShardedCalculator` attached to it exchanges ghosts
with the ranks within reach and migrates atoms, with every per-atom array, to
their new owners inside the force call (as ASE's ``VelocityVerlet.step``
expects). :func:`gather` brings the whole system back to one rank.

Global quantities (kinetic energy, temperature, degrees of freedom, centre of
mass, the ideal-gas stress, force norms in optimisers) are reduced over the
ranks; per-atom arrays and results are local. Sums over ranks are taken in
rank order from an allgather, so every rank gets the same bits and
thermostats stay in step.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
from ase import Atoms
from ase.stress import voigt_6_to_full_3x3_stress

from ase_shard.comm import Comm
from ase_shard.system import checksum

# per-atom array holding each atom's index in the original Atoms
GLOBAL_ID = "global_id"


class DistributedAtoms(Atoms):
    """The atoms one rank owns, with global observables.

    Made by :func:`distribute`; ``len(atoms)`` and every per-atom array are
    local and change when atoms migrate (inside force calls), while
    ``get_global_number_of_atoms()``, ``get_kinetic_energy()``,
    ``get_temperature()``, ``get_center_of_mass()`` and ``get_stress()`` are
    those of the whole system. Methods that reduce over ranks are
    collective: call them on every rank.

    Attributes
    ----------
    comm : ase_shard.comm.Comm
    n_global : int
        Atoms over all ranks.
    """

    comm: Comm | None = None
    n_global: int = 0

    def copy(self) -> DistributedAtoms:
        atoms = super().copy()
        atoms.comm, atoms.n_global = self.comm, self.n_global
        return atoms

    def get_global_ids(self) -> np.ndarray:
        """Index of each local atom in the original (gathered) ``Atoms``."""
        return self.arrays[GLOBAL_ID].copy()

    def sum_over_ranks(self, value: Any) -> Any:
        """Sum of ``value`` (a number or array) over ranks, the same bits on every rank."""
        parts = self.comm.allgather(np.asarray(value, dtype=np.float64))
        total = parts[0].copy()
        for part in parts[1:]:
            total += part
        return total if total.ndim else float(total)

    def get_global_number_of_atoms(self) -> int:
        return self.n_global

    def get_number_of_degrees_of_freedom(self) -> int:
        return 3 * self.n_global - sum(c.get_removed_dof(self) for c in self.constraints)

    def get_kinetic_energy(self) -> float:
        """Kinetic energy of all atoms (eV; collective)."""
        return self.sum_over_ranks(super().get_kinetic_energy())

    def get_center_of_mass(self, scaled: bool = False, indices=None) -> np.ndarray:
        """Centre of mass of all atoms (Å; collective). ``indices`` are not supported."""
        if indices is not None:
            raise ValueError("indices refer to local atoms: not supported on DistributedAtoms")
        masses = self.get_masses()
        weighted = self.sum_over_ranks(np.append(masses @ self.positions, masses.sum()))
        com = weighted[:3] / weighted[3]
        return self.cell.scaled_positions(com[None])[0] if scaled else com

    def get_kinetic_stress(self, voigt: bool = True) -> np.ndarray:
        """Kinetic (ideal-gas) stress of all atoms, eV/Å³ (collective)."""
        stress = self.sum_over_ranks(super().get_kinetic_stress(voigt=True))
        return stress if voigt else voigt_6_to_full_3x3_stress(stress)

    def get_masses(self) -> np.ndarray:
        # ASE's MD drivers (MolecularDynamics) ask for the masses when they are made and
        # never for an optimisable: unsafe ones are refused here
        _refuse_unsafe_driver(self.comm)
        return super().get_masses()

    def __ase_optimizable__(self) -> Any:
        # imported here: ase.optimize pulls in scipy (~0.8 s for every process)
        from ase_shard.dynamics import DistributedOptimizable

        _refuse_unsafe_driver(self.comm)
        return DistributedOptimizable(self)


def distributed_safe(driver: Any) -> bool:
    """Whether an ASE dynamics object survives atoms migrating inside force calls.

    ASE's ``VelocityVerlet`` and ``Bussi`` do (they store momenta on the
    atoms before the force call and use global kinetic energies); other
    drivers declare it with a class attribute ``distributed_safe = True``.
    Subclasses of ASE's drivers must declare it themselves.
    """
    from ase.md.bussi import Bussi
    from ase.md.verlet import VelocityVerlet

    return type(driver) in (VelocityVerlet, Bussi) or bool(
        getattr(type(driver), "distributed_safe", False)
    )


def _refuse_unsafe_driver(comm: Comm) -> None:
    """Raise ``TypeError`` if an ASE driver that is not :func:`distributed_safe` is being made.

    Every rank builds the same driver (SPMD) and so raises together: reported once.
    """
    driver = _constructing_driver()
    if driver is not None and not distributed_safe(driver):
        error = TypeError(
            f"{type(driver).__name__} cannot run on DistributedAtoms: it keeps per-atom "
            "arrays across force calls (atoms migrate between ranks inside them), sums "
            "over this rank's atoms only, or needs the whole system at once. Use "
            "VelocityVerlet, Bussi, or the drivers in ase_shard.dynamics (Langevin, "
            "NoseHooverChainNVT, IsotropicMTKNPT, FIRE); or gather() the atoms and run it "
            "on one rank"
        )
        comm.raised_together(error)
        raise error


def _constructing_driver() -> Any:
    """The ASE dynamics object whose ``__init__`` is running further up the stack, if any."""
    from ase.optimize.optimize import BaseDynamics

    frame = sys._getframe(2)
    for _ in range(8):  # the driver's __init__ is a few frames up
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        # only while a driver is made: its steps and trajectory writes ask too
        if frame.f_code.co_name == "__init__" and isinstance(candidate, BaseDynamics):
            return candidate
        frame = frame.f_back
    return None


# -- moving atoms between ranks -------------------------------------------------------------


def array_layout(arrays: dict[str, np.ndarray]) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(name, dtype, per-atom shape)`` of every per-atom array."""
    layout = []
    for name, array in arrays.items():
        if array.dtype.hasobject:
            raise ValueError(f"per-atom array {name!r} holds Python objects; it cannot migrate")
        layout.append((name, array.dtype.str, tuple(array.shape[1:])))
    return layout


def _pack(arrays: dict[str, np.ndarray], layout: list) -> np.ndarray:
    """Per-atom arrays side by side as ``(n, bytes per atom)`` uint8 rows."""
    n = len(arrays["positions"])
    columns = [
        np.ascontiguousarray(arrays[name], dtype=dtype)
        .reshape(n, int(np.prod(shape, dtype=np.int64)))
        .view(np.uint8)
        for name, dtype, shape in layout
    ]
    return np.concatenate(columns, axis=1) if columns else np.zeros((n, 0), np.uint8)


def _unpack(rows: np.ndarray, layout: list) -> dict[str, np.ndarray]:
    """Inverse of :func:`_pack`."""
    arrays, start = {}, 0
    for name, dtype, shape in layout:
        width = np.dtype(dtype).itemsize * int(np.prod(shape, dtype=np.int64))
        block = np.ascontiguousarray(rows[:, start : start + width])
        arrays[name] = block.view(dtype).reshape(len(rows), *shape)
        start += width
    return arrays


def agreed_layout(atoms: Atoms, comm: Comm) -> list:
    """The union of every rank's per-atom arrays (collective; raises on every rank).

    A rank without an array (e.g. no momenta yet) migrates zeros for it, as
    ASE's getters would return.
    """
    union: dict[str, tuple] = {}
    for rank_layout in comm.share(lambda: array_layout(atoms.arrays)):
        for name, dtype, shape in rank_layout:
            if union.setdefault(name, (dtype, shape)) != (dtype, shape):
                error = ValueError(
                    f"per-atom array {name!r} differs between ranks: {union[name]} and "
                    f"{(dtype, shape)}"
                )
                comm.raised_together(error)  # every rank compares the same layouts
                raise error
    for name, (dtype, shape) in union.items():
        if name not in atoms.arrays:
            atoms.arrays[name] = np.zeros((len(atoms), *shape), dtype=dtype)
    return [(name, *union[name]) for name in union]


def migrate(atoms: DistributedAtoms, owners: np.ndarray) -> np.ndarray:
    """Send each local atom, with every per-atom array, to rank ``owners[i]`` (collective).

    Afterwards ``atoms`` holds the atoms this rank owns, ordered by global
    id. Returns where each atom now held came from: its index among this
    rank's atoms before, or -1 for atoms received from other ranks.
    """
    comm = atoms.comm
    ids = atoms.arrays[GLOBAL_ID]
    if comm.size == 1 and (np.diff(ids) > 0).all():
        # one rank, its atoms in order already: nothing moves. Packed, sent to itself and
        # unpacked, every per-atom array was copied three times (at 256,000 atoms, 18 MB
        # a copy, left in the heap: 0.07 kB per atom on the peak)
        return np.arange(len(ids))
    layout = agreed_layout(atoms, comm)
    order = np.argsort(owners, kind="stable")
    send_counts = np.bincount(owners, minlength=comm.size).astype(np.int64)
    recv_counts = comm.alltoall_counts(send_counts)
    mine = slice(int(send_counts[: comm.rank].sum()), int(send_counts[: comm.rank + 1].sum()))
    kept = order[mine]
    packed = _pack(atoms.arrays, layout)[order]
    received = comm.alltoallv_rows(packed, send_counts, recv_counts)
    arrays = _unpack(received, layout)
    by_id = np.argsort(arrays[GLOBAL_ID], kind="stable")
    atoms.arrays = {name: array[by_id] for name, array in arrays.items()}
    # the rows this rank sent to itself come back where it received them
    origin = np.full(len(by_id), -1, dtype=np.int64)
    start = int(recv_counts[: comm.rank].sum())
    origin[start : start + len(kept)] = kept
    return origin[by_id]


def distribute(
    atoms: Atoms | None, *, root: int = 0, comm: Any = None
) -> DistributedAtoms:
    """Give each rank a share of ``atoms`` (collective).

    Parameters
    ----------
    atoms : Atoms or None
        The whole system on ``root``; other ranks may pass ``None`` (or the
        same system, which is then not sent: each rank takes its share of
        its own copy, when every copy equals the root's bit for bit; else the
        root's is sent).
    root : int
        The rank whose ``atoms`` counts.
    comm : mpi4py communicator, optional
        Default ``MPI.COMM_WORLD``.

    Returns
    -------
    DistributedAtoms
        This rank's atoms: a contiguous block of indices at first, every
        per-atom array, a ``"global_id"`` array (the index in ``atoms``), and
        ``atoms``'s cell, pbc and info. The first calculation of a
        :class:`~ase_shard.ShardedCalculator` moves them to their spatial
        domains. Constraints are not supported (indices would not survive
        migration).
    """
    comm = Comm(comm)
    n_global, layout, cell, pbc, info = comm.decide(lambda: _header(atoms), root=root)
    counts = np.diff(np.arange(comm.size + 1) * n_global // comm.size)
    span = slice(int(counts[: comm.rank].sum()), int(counts[: comm.rank + 1].sum()))
    packed = _packed_copy(atoms, n_global, layout)
    # each rank takes its share of its own copy only where every copy is the root's,
    # bit for bit: a rank's differing copy must not mix into the system
    digests = comm.allgather(None if packed is None else checksum(packed))
    if digests[root] is not None and all(digest == digests[root] for digest in digests):
        rows = packed[span]
    else:
        send = packed if comm.rank == root else None
        rows = comm.scatter_rows(send, counts, (rows_width(layout),), np.uint8, root=root)
    local = DistributedAtoms(cell=cell, pbc=pbc, info=info)
    local.arrays = _unpack(rows, layout)
    local.comm, local.n_global = comm, n_global
    return local


def _packed_copy(atoms: Any, n_global: int, layout: list) -> np.ndarray | None:
    """This rank's copy of the system as :func:`_pack`'s rows, ``None`` if it holds none."""
    if not isinstance(atoms, Atoms) or isinstance(atoms, DistributedAtoms):
        return None
    if len(atoms) != n_global:
        return None
    arrays = with_global_ids(atoms).arrays
    if any(name not in arrays for name, _, _ in layout):
        return None
    try:
        return _pack(arrays, layout)
    except ValueError:  # an array of another shape than the root's
        return None


def rows_width(layout: list) -> int:
    """Bytes per atom of :func:`_pack`'s rows."""
    return sum(np.dtype(d).itemsize * int(np.prod(s, dtype=np.int64)) for _, d, s in layout)


def with_global_ids(atoms: Atoms) -> Atoms:
    """``atoms`` with a ``"global_id"`` array (its own, when it has one)."""
    if GLOBAL_ID in atoms.arrays:
        return atoms
    atoms = atoms.copy()
    atoms.arrays[GLOBAL_ID] = np.arange(len(atoms), dtype=np.int64)
    return atoms


def _header(atoms: Atoms | None) -> tuple:
    """What every rank needs to know of ``atoms`` before its rows arrive."""
    if not isinstance(atoms, Atoms):
        raise TypeError(f"distribute: the root rank must pass an ase.Atoms, not {atoms!r}")
    if isinstance(atoms, DistributedAtoms):
        raise TypeError("distribute: these atoms are distributed already; gather() them first")
    if atoms.constraints:
        raise ValueError(
            "distribute: constraints are not supported on distributed atoms (their atom "
            f"indices would not follow migrating atoms): {atoms.constraints}"
        )
    layout = array_layout(with_global_ids(atoms).arrays)
    return len(atoms), layout, atoms.cell.array.copy(), atoms.pbc.copy(), dict(atoms.info)


def gather(local: DistributedAtoms, *, root: int = 0) -> Atoms | None:
    """The whole system on ``root`` in its original order, ``None`` elsewhere (collective).

    Every per-atom array comes back (the ``"global_id"`` array is dropped);
    cell, pbc and info are those of ``local``.
    """
    comm = local.comm
    layout = agreed_layout(local, comm)
    counts = comm.allgather(len(local))
    rows = comm.gather_rows(_pack(local.arrays, layout), counts, root=root)
    if comm.rank != root:
        return None
    arrays = _unpack(rows, layout)
    order = np.argsort(arrays.pop(GLOBAL_ID), kind="stable")
    atoms = Atoms(cell=local.cell.array.copy(), pbc=local.pbc.copy(), info=dict(local.info))
    atoms.arrays = {name: array[order] for name, array in arrays.items()}
    return atoms


def stationary(atoms: DistributedAtoms, preserve_temperature: bool = True) -> None:
    """Remove the total momentum of all atoms (collective).

    The distributed counterpart of ASE's
    ``ase.md.velocitydistribution.Stationary``, which sums the local arrays
    only; like it, it then restores the temperature (K) the atoms had.
    """
    temperature = atoms.get_temperature()
    masses = atoms.get_masses()
    momentum = atoms.get_momenta()
    total = atoms.sum_over_ranks(np.append(momentum.sum(axis=0), masses.sum()))
    atoms.set_momenta(momentum - np.outer(masses, total[:3] / total[3]))
    if preserve_temperature:
        from ase.md.velocitydistribution import force_temperature

        force_temperature(atoms, temperature)  # global: it asks the atoms for T and dof
