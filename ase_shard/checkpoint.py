"""Checkpoints: a run's whole state, written atomically, read on any number of ranks.

A checkpoint is a directory ``DIR/step-<step>/`` holding

- ``atoms-<k>.npz``: rows of atoms with every per-atom array (positions in Å,
  momenta, numbers, masses, tags, charges, custom arrays such as a driver's),
  each with its global id. :class:`~ase_shard.distributed.DistributedAtoms`
  are written by every rank, its own atoms into its own file: no rank holds
  more than its atoms. Replicated ``Atoms`` (the same on every rank) are
  written once, by rank 0.
- ``manifest.json``: the step, the cell, pbc and ``atoms.info``, the atoms in
  each file, the integrator's own state (:func:`dynamics_state`) and a record
  the caller adds (``ase-shard md``: the run's physics and options).

It is written into a hidden directory beside it and renamed when every file is
complete, so a kill mid-write leaves the checkpoints before it intact (the
half-written directory is ignored, and removed by the next write); the last
``keep`` are kept. Reading splits the files' rows among however many ranks
read: distributed atoms then migrate to their owners at the first force call.

The integrator's state: the Nosé-Hoover chains and MTK barostats' variables,
the seed of the noise keyed by atom (:data:`DYNAMICS_STATE`), ``nsteps``, and
the state of its random generator (rank 0's: the one that draws, where ranks
differ): continuing repeats the uninterrupted run's numbers, on distributed
atoms also on another number of ranks (:class:`ase_shard.noise.AtomNoise`).
Constraints are not written: the script that resumes sets them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from ase import Atoms

from ase_shard.comm import Comm
from ase_shard.distributed import GLOBAL_ID, DistributedAtoms, agreed_layout, with_global_ids
from ase_shard.io import json_info

FORMAT = 1
MANIFEST = "manifest.json"
_NAME = re.compile(r"^step-(\d+)$")
_TEMPORARY = ".writing-"  # prefix of a checkpoint being written
_ARRAY = "array:"  # prefix of the per-atom arrays' names in the files
# the integrators' own state beyond the atoms and ``nsteps``, by attribute path (ase.md):
DYNAMICS_STATE = (
    # Nosé-Hoover chains (NoseHooverChainNVT, IsotropicMTKNPT, MTKNPT): positions, momenta
    "_thermostat._eta",
    "_thermostat._p_eta",
    # the MTK barostats' chains
    "_barostat._xi",
    "_barostat._p_xi",
    # IsotropicMTKNPT: the log strain, its momentum and the cell they scale
    "_eps",
    "_p_eps",
    "_cell0",
    "_volume0",
    # MTKNPT: the cell and its momenta
    "_h",
    "_p_g",
    # Bussi: the energy it has exchanged with the bath so far (a diagnostic)
    "transferred_energy",
    # ase_shard.dynamics.Langevin on distributed atoms: the key of its noise
    "noise.seed",
)


@dataclass(frozen=True)
class Saved:
    """A checkpoint read back (:func:`read_checkpoint`).

    Attributes
    ----------
    atoms : Atoms or DistributedAtoms
        The atoms: every atom on every rank where they were replicated, else
        this rank's share (``distributed``), with momenta and every array.
    step : int
        The integrator's ``nsteps`` when it was written.
    path : Path
        The checkpoint's directory.
    ranks : int
        The ranks that wrote it.
    record : dict
        What the writer recorded beside the state (JSON).
    dynamics : dict
        The integrator's state (:func:`dynamics_state`); apply it with
        :func:`restore_dynamics`.
    rng_state : dict or None
        The state of the integrator's random generator (``None``: it had none).
    """

    atoms: Atoms
    step: int
    path: Path
    ranks: int
    record: dict
    dynamics: dict
    rng_state: dict | None


def dynamics_state(dyn: Any) -> dict:
    """The state of ``dyn`` (an ASE integrator) that its constructor does not rebuild
    from the atoms: ``nsteps`` and the :data:`DYNAMICS_STATE` it has, as JSON values."""
    state: dict[str, Any] = {"class": type(dyn).__name__, "nsteps": int(dyn.nsteps)}
    for path in DYNAMICS_STATE:
        owner, name = _owner(dyn, path)
        if owner is not None and hasattr(owner, name):
            value = getattr(owner, name)
            if np.ndim(value):
                state[path] = np.asarray(value).tolist()
            else:  # a seed stays an integer: a float keeps 53 of its bits
                is_integer = isinstance(value, int | np.integer)
                state[path] = int(value) if is_integer else float(value)
    return state


def restore_dynamics(dyn: Any, saved: Saved) -> None:
    """Give ``dyn``, made anew on ``saved.atoms`` with the written run's parameters, the
    state it had: ``nsteps``, :data:`DYNAMICS_STATE` and its random generator's state.

    Raises
    ------
    ValueError
        When ``dyn`` is of another class than the integrator written.
    """
    state = saved.dynamics
    if type(dyn).__name__ != state["class"]:
        raise ValueError(
            f"{saved.path} holds the state of a {state['class']}, not of a {type(dyn).__name__}"
        )
    dyn.nsteps = int(state["nsteps"])
    for path in DYNAMICS_STATE:
        if path in state:
            owner, name = _owner(dyn, path)
            value = state[path]
            setattr(owner, name, np.array(value) if isinstance(value, list) else value)
    rng = getattr(dyn, "rng", None)
    if rng is not None and saved.rng_state is not None:
        _set_rng_state(rng, saved.rng_state)


def _owner(dyn: Any, path: str) -> tuple[Any, str]:
    """The object holding attribute ``path`` (``"a.b"``: ``dyn.a``, ``"b"``), or ``None``."""
    *parents, name = path.split(".")
    owner = dyn
    for parent in parents:
        owner = getattr(owner, parent, None)
    return owner, name


def _bit_generator(rng: Any) -> Any:
    """The bit generator behind a numpy ``Generator``, a ``RandomState`` or the
    ``numpy.random`` module (its global ``RandomState``); ``None`` for anything else."""
    if rng is np.random:
        rng = np.random.mtrand._rand
    return getattr(rng, "bit_generator", None) or getattr(rng, "_bit_generator", None)


def _rng_state(rng: Any) -> dict | None:
    """A random generator's state as JSON values (``None``: not a numpy generator)."""
    bit_generator = _bit_generator(rng)
    if bit_generator is None:
        return None
    return json.loads(json.dumps(bit_generator.state, default=lambda a: np.asarray(a).tolist()))


def _set_rng_state(rng: Any, state: dict) -> None:
    """Set a generator's state from :func:`_rng_state`'s (in place: its holders see it)."""
    inner = state.get("state")
    if isinstance(inner, dict) and isinstance(inner.get("key"), list):  # MT19937
        state = {**state, "state": {**inner, "key": np.array(inner["key"], dtype=np.uint32)}}
    _bit_generator(rng).state = state


def checkpoints(directory: str | Path) -> list[Path]:
    """The complete checkpoints in ``directory``, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [
        (int(match.group(1)), path)
        for path in directory.iterdir()
        if (match := _NAME.match(path.name)) and (path / MANIFEST).is_file()
    ]
    return [path for _, path in sorted(found)]


def write_checkpoint(
    directory: str | Path,
    atoms: Atoms,
    dyn: Any,
    record: dict | None = None,
    keep: int = 2,
    comm: Any = None,
) -> Path:
    """Write the state of ``atoms`` and ``dyn`` to ``directory/step-<dyn.nsteps>``
    (collective: every rank calls it; the same error on every rank).

    Parameters
    ----------
    directory : str or Path
        Where the checkpoints go (made if missing; on a file system every rank sees).
    atoms : Atoms or DistributedAtoms
        The system ``dyn`` moves: every rank's copy of it, or every rank's share.
    dyn : ASE integrator
    record : dict, optional
        JSON values written beside the state (what the run was).
    keep : int
        Checkpoints kept in ``directory``, this one included (older ones are removed).
    comm : mpi4py communicator, optional
        The ranks of the run (default ``MPI.COMM_WORLD``; that of distributed atoms).

    Returns
    -------
    Path
        The checkpoint written (or found there already, for this step).
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1, not {keep}")
    distributed = isinstance(atoms, DistributedAtoms)
    comm = atoms.comm if distributed else Comm(comm)
    directory = Path(directory)
    step = int(dyn.nsteps)
    final = directory / f"step-{step:09d}"

    def begin() -> tuple[str, bool]:
        directory.mkdir(parents=True, exist_ok=True)
        if (final / MANIFEST).is_file():  # this step was written (a stop on a checkpoint step)
            return "", True
        temporary = directory / f"{_TEMPORARY}{step:09d}-{uuid.uuid4().hex[:8]}"
        temporary.mkdir()
        return str(temporary), False

    name, done = comm.decide(begin)
    if done:
        return final
    temporary = Path(name)
    writes_own = distributed and comm.size > 1

    def write_rows() -> int:
        if not writes_own and not comm.is_root:
            return 0
        arrays = atoms.arrays if distributed else with_global_ids(atoms).arrays
        path = temporary / f"atoms-{comm.rank if writes_own else 0:05d}.npz"
        with open(path, "wb") as handle:
            # prefixed: an array named like one of savez's parameters ("file") stays apart
            np.savez(handle, **{f"{_ARRAY}{key}": value for key, value in arrays.items()})
            handle.flush()
            os.fsync(handle.fileno())
        return len(atoms)

    if distributed:  # every rank's file holds the same arrays (zeros where a rank had none)
        agreed_layout(atoms, comm)
    counts = comm.share(write_rows)
    files = counts if writes_own else counts[:1]

    def finish() -> None:
        manifest = {
            "format": FORMAT,
            "step": step,
            "ranks": comm.size,
            "distributed": distributed,
            "n_atoms": int(sum(files)),
            "files": [int(n) for n in files],
            "cell": atoms.cell.array.tolist(),
            "pbc": atoms.pbc.tolist(),
            "info": json_info(atoms.info),
            "dynamics": dynamics_state(dyn),
            "rng_state": _rng_state(getattr(dyn, "rng", None)),
            "record": record or {},
        }
        _write_json(temporary / MANIFEST, manifest)
        os.rename(temporary, final)
        _fsync_directory(directory)
        for old in checkpoints(directory)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in directory.glob(_TEMPORARY + "*"):  # writes a kill interrupted
            if stale != temporary:
                shutil.rmtree(stale, ignore_errors=True)

    comm.decide(finish)
    return final


def read_checkpoint(
    directory: str | Path, comm: Any = None, distributed: bool | None = None
) -> Saved:
    """The newest complete checkpoint in ``directory`` (collective).

    Parameters
    ----------
    directory : str or Path
        A directory of checkpoints, or one checkpoint (``step-<step>``).
    comm : mpi4py communicator, optional
        The ranks that read (default ``MPI.COMM_WORLD``); as many as wrote it, or
        not.
    distributed : bool, optional
        Return each rank's share as :class:`DistributedAtoms` (default: as written).

    Raises
    ------
    FileNotFoundError
        When ``directory`` holds no complete checkpoint.
    """
    comm = Comm(comm)
    path = Path(directory)

    def find() -> tuple[str, dict]:
        chosen = path if (path / MANIFEST).is_file() else None
        if chosen is None:
            found = checkpoints(path)
            if not found:
                raise FileNotFoundError(f"{directory}: no complete checkpoint there")
            chosen = found[-1]
        manifest = json.loads((chosen / MANIFEST).read_text())
        if manifest.get("format") != FORMAT:
            raise ValueError(f"{chosen}: checkpoint format {manifest.get('format')}, not {FORMAT}")
        return str(chosen), manifest

    name, manifest = comm.decide(find)
    chosen = Path(name)
    distributed = manifest["distributed"] if distributed is None else distributed
    n_atoms, files = manifest["n_atoms"], manifest["files"]
    if distributed:  # this rank's contiguous share of the rows, from the files it spans
        first, last = (n_atoms * np.array([comm.rank, comm.rank + 1])) // comm.size
    else:
        first, last = 0, n_atoms

    starts = np.concatenate([[0], np.cumsum(files)]).astype(np.int64)

    def load() -> dict[str, np.ndarray]:
        wanted = [k for k in range(len(files)) if starts[k] < last and starts[k + 1] > first]
        parts = []
        # the first file at least, for the arrays' names and shapes on a rank with no rows
        for k in wanted or [0]:
            with np.load(chosen / f"atoms-{k:05d}.npz", allow_pickle=False) as data:
                lo = min(max(first - starts[k], 0), files[k])
                hi = max(min(last - starts[k], files[k]), lo)
                parts.append({key.removeprefix(_ARRAY): data[key][lo:hi] for key in data.files})
        return {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}

    arrays = comm.agree(load)
    info = dict(manifest["info"])
    if distributed:
        atoms = DistributedAtoms(cell=manifest["cell"], pbc=manifest["pbc"], info=info)
        atoms.arrays = arrays
        atoms.comm, atoms.n_global = comm, n_atoms
    else:
        order = np.argsort(arrays.pop(GLOBAL_ID), kind="stable")
        atoms = Atoms(cell=manifest["cell"], pbc=manifest["pbc"], info=info)
        atoms.arrays = {key: value[order] for key, value in arrays.items()}
    return Saved(
        atoms=atoms,
        step=int(manifest["step"]),
        path=chosen,
        ranks=int(manifest["ranks"]),
        record=manifest["record"],
        dynamics=manifest["dynamics"],
        rng_state=manifest["rng_state"],
    )


def _write_json(path: Path, value: dict) -> None:
    """Write ``value`` to ``path`` and flush it to the disk."""
    with open(path, "w") as handle:
        json.dump(value, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
