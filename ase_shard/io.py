"""Trajectories of distributed atoms: gathered to one rank, or written by every rank.

:class:`Trajectory` gathers a :class:`~ase_shard.distributed.DistributedAtoms`
to one rank each time it writes (so ``dyn.attach(traj.write, interval=10)``
gathers every 10 steps only), with the calculator's results in the global
atom order, and that rank writes an ordinary ASE ``.traj`` file.

:class:`ShardedTrajectory` has every rank write its own atoms instead (a
``NAME.shards`` directory, no rank holding the whole system), and
:func:`read_frames` puts the frames together again as ordinary ``Atoms``.

A run restarts from a frame read on one rank (``parallel=False``: ASE's
``read`` otherwise broadcasts from rank 0, a collective the other ranks would
not enter)::

    atoms = read("md.traj", parallel=False) if comm.rank == 0 else None
    atoms = distribute(atoms)  # positions, momenta, masses, tags, charges, magmoms

ASE's trajectory format keeps those arrays only (no custom per-atom arrays).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from ase import Atoms
from ase.calculators.calculator import PropertyNotImplementedError
from ase.calculators.singlepoint import SinglePointCalculator
from ase.io.trajectory import TrajectoryWriter
from ase.parallel import DummyMPI

from ase_shard.comm import Comm
from ase_shard.distributed import (
    GLOBAL_ID,
    DistributedAtoms,
    array_layout,
    gather,
    rows_width,
    with_global_ids,
)

# results the same on every rank, and results with one row per local atom
GLOBAL_RESULTS = ("energy", "free_energy", "stress")
PER_ATOM_RESULTS = ("forces", "energies", "stresses")
_RESULT_ARRAY = "ase_shard_result_"
SHARDS = ".shards"  # the name ending of a trajectory every rank writes its own atoms to
_ROWS, _INDEX = "rank-{:05d}.rows", "rank-{:05d}.index"


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


class ShardedTrajectory:
    """A trajectory every rank writes its own atoms to: no rank gathers the system.

    A directory whose name ends in ``.shards``. Each rank appends to two files of
    its own: ``rank-<r>.rows``, every frame's per-atom arrays of its atoms (raw
    bytes, array after array; the calculator's per-atom results among them), and
    ``rank-<r>.index``, a JSON line per frame written once its rows are in the
    file: the frame's number, where its rows are and how they are laid out, and
    what is the same on every rank (the number of atoms, cell, pbc, ``info``,
    energy, stress). A frame is complete when its ranks' rows add up to all the
    atoms: a kill leaves at most an incomplete last frame, which readers skip.
    Ranks write without waiting for each other (nothing is collective), and a run
    may go on on another number of ranks: the frames are put together by number.
    :func:`read_frames` reads them back as ordinary ``Atoms``; ``ase-shard convert``
    writes them in any format ``ase.io`` writes (``.traj``, extended XYZ).

    Formats that keep one file for all ranks need MPI-IO (parallel HDF5 through
    an MPI build of h5py, ADIOS2), neither of which pip installs with its MPI
    support; files per rank of raw numpy rows need nothing beyond numpy, append
    frame by frame, and survive a kill (an index line follows its rows).

    Parameters
    ----------
    path : str or Path
        The directory (``NAME.shards``).
    mode : {"w", "a"}
        Start it anew (rank 0 empties it) or go on after its complete frames.
    comm : mpi4py communicator, optional
        The ranks that write (default ``MPI.COMM_WORLD``).
    """

    def __init__(self, path: str | Path, mode: str = "w", comm: Any = None):
        if mode not in ("w", "a"):
            raise ValueError(f"mode must be 'w' or 'a', not {mode!r}")
        self.comm = Comm(comm)
        self.path = Path(path)

        def prepare() -> int:
            if mode == "w" and self.path.exists():
                shutil.rmtree(self.path)
            self.path.mkdir(parents=True, exist_ok=True)
            return cut_back_shards(self.path, lambda info: True)  # a frame cut short goes

        # numbered on from the complete frames; each rank's files end where its rows do
        self.frames = self.comm.decide(prepare)
        self._rows = open(self.path / _ROWS.format(self.comm.rank), "ab")
        self._index = open(self.path / _INDEX.format(self.comm.rank), "a")

    def __enter__(self) -> ShardedTrajectory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def write(self, atoms: Atoms, info: dict | None = None) -> None:
        """Append one frame: this rank's atoms of distributed ``atoms``, or, for atoms every
        rank holds, all of them from rank 0; with the calculator's current results (not
        computed) and ``info`` (default ``atoms.info``)."""
        distributed = isinstance(atoms, DistributedAtoms)
        results = _current_results(atoms)
        if distributed or self.comm.is_root:
            arrays = dict(atoms.arrays if distributed else with_global_ids(atoms).arrays)
            for name in PER_ATOM_RESULTS:
                if name in results:
                    arrays[_RESULT_ARRAY + name] = results.pop(name)
            offset = self._rows.tell()
            for value in arrays.values():
                self._rows.write(np.ascontiguousarray(value).tobytes())
            self._rows.flush()  # the rows are in the file before the line that lists them
            line = {
                "frame": self.frames,
                "offset": offset,
                "rows": len(atoms),
                "arrays": array_layout(arrays),
                "n_atoms": atoms.get_global_number_of_atoms(),
                "cell": atoms.cell.array.tolist(),
                "pbc": atoms.pbc.tolist(),
                "info": json_info(atoms.info if info is None else info),
                "results": {name: np.asarray(value).tolist() for name, value in results.items()},
            }
            self._index.write(json.dumps(line) + "\n")
            self._index.flush()
        self.frames += 1

    def close(self) -> None:
        self._rows.close()
        self._index.close()


def is_sharded(path: str | Path) -> bool:
    """Whether ``path`` names a :class:`ShardedTrajectory` (it ends in ``.shards``)."""
    return str(path).rstrip("/").endswith(SHARDS)


def _index_lines(path: Path) -> dict[Path, tuple[list[dict], bool]]:
    """Every rank's index, by the rows file it describes: its whole lines, and whether
    a line cut short by a kill follows them (that line is no frame's)."""
    files = {}
    for index in sorted(path.glob("rank-*.index")):
        texts = index.read_text().splitlines(keepends=True)
        whole = [json.loads(text) for text in texts if text.endswith("\n")]
        files[index.with_suffix(".rows")] = (whole, len(whole) < len(texts))
    return files


def _complete_frames(
    files: dict[Path, tuple[list[dict], bool]],
) -> dict[int, list[tuple[Path, dict]]]:
    """The frames whose ranks' rows add up to all the atoms, by number, in order."""
    frames: dict[int, list] = {}
    for rows, (lines, _) in files.items():
        for line in lines:
            frames.setdefault(line["frame"], []).append((rows, line))
    return {
        number: parts
        for number, parts in sorted(frames.items())
        if sum(line["rows"] for _, line in parts) == parts[0][1]["n_atoms"]
    }


def read_frames(path: str | Path, index: int | slice = slice(None)) -> list[Atoms]:
    """The complete frames of a :class:`ShardedTrajectory` (``index`` of them), as
    ordinary ``Atoms`` in the atoms' original order, with a single-point calculator
    of the results written with them (on the rank that calls it; not collective)."""
    frames = list(_complete_frames(_index_lines(Path(path))).values())
    chosen = frames[index] if isinstance(index, slice) else [frames[index]]
    return [_assembled(parts) for parts in chosen]


def _assembled(parts: list[tuple[Path, dict]]) -> Atoms:
    """One frame from its ranks' rows."""
    pieces = []
    for rows, line in parts:
        with open(rows, "rb") as handle:
            handle.seek(line["offset"])
            arrays = {}
            for name, dtype, shape in line["arrays"]:
                count = line["rows"] * int(np.prod(shape, dtype=np.int64))
                data = np.fromfile(handle, dtype=np.dtype(dtype), count=count)
                arrays[name] = data.reshape(line["rows"], *shape)
        pieces.append(arrays)
    first = parts[0][1]
    arrays = {name: np.concatenate([piece[name] for piece in pieces]) for name in pieces[0]}
    order = np.argsort(arrays.pop(GLOBAL_ID), kind="stable")
    atoms = Atoms(cell=first["cell"], pbc=first["pbc"], info=first["info"])
    results = {name: np.asarray(value) for name, value in first["results"].items()}
    for name in PER_ATOM_RESULTS:
        if _RESULT_ARRAY + name in arrays:
            results[name] = arrays.pop(_RESULT_ARRAY + name)[order]
    atoms.arrays = {name: value[order] for name, value in arrays.items()}
    if results:
        for name in ("energy", "free_energy"):
            if name in results:
                results[name] = float(results[name])
        atoms.calc = SinglePointCalculator(atoms, **results)
    return atoms


def cut_back_shards(path: str | Path, keep: Callable[[dict], bool]) -> int:
    """Keep the complete frames for which ``keep(info)`` holds, up to the first that it
    does not; drop the rest, an incomplete last frame too (every rank's files
    shortened; run by one rank). Returns the frames kept."""
    path = Path(path)
    files = _index_lines(path)
    kept = set()
    for number, parts in _complete_frames(files).items():
        if number != len(kept) or not keep(parts[0][1]["info"]):
            break  # a frame missing before it (cut short), or one to drop
        kept.add(number)
    for rows, (lines, cut_short) in files.items():
        keeping = [line for line in lines if line["frame"] in kept]
        # rows written after the last line that lists them go too
        end = max(
        (line["offset"] + line["rows"] * rows_width(line["arrays"]) for line in keeping),
        default=0,
    )
        os.truncate(rows, end)
        if len(keeping) < len(lines) or cut_short:
            index = rows.with_suffix(".index")
            temporary = index.with_suffix(".cut")
            temporary.write_text("".join(json.dumps(line) + "\n" for line in keeping))
            os.replace(temporary, index)
    return len(kept)


def json_info(info: dict) -> dict:
    """The entries of ``atoms.info`` JSON can hold (numbers, strings, lists of them)."""
    kept = {}
    for key, value in info.items():
        try:
            kept[key] = json.loads(json.dumps(value, default=lambda a: np.asarray(a).tolist()))
        except (TypeError, ValueError):
            continue
    return kept
