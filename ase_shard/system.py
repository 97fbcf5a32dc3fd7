"""Checks on the system every rank must agree on (pure numpy, no MPI)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from ase import Atoms
from ase.data import chemical_symbols

FINGERPRINT_FIELDS = ("number of atoms", "numbers", "positions", "cell", "pbc")


def validate_cell(cell: np.ndarray, pbc: np.ndarray) -> None:
    """Raise ``ValueError`` unless the periodic axes have finite, independent vectors."""
    if not np.isfinite(cell).all():
        raise ValueError(f"cell is not finite: {cell.tolist()}")
    periodic = np.flatnonzero(pbc)
    for axis in periodic:
        if np.linalg.norm(cell[axis]) == 0.0:
            raise ValueError(
                f"axis {axis} is periodic but its cell vector is zero; give a cell "
                "vector or set pbc False on that axis"
            )
    if len(periodic):
        singular = np.linalg.svd(cell[periodic], compute_uv=False)
        if singular[-1] <= 1e-10 * singular[0]:
            raise ValueError(
                f"the cell vectors of the periodic axes {periodic.tolist()} are linearly "
                "dependent (zero volume)"
            )


def validate_positions(positions: np.ndarray, ids: np.ndarray | None = None) -> None:
    """Raise ``ValueError`` if some position is not finite.

    ``ids`` are the global indices of the rows (default: the row numbers), so
    a rank that checks only its own atoms names them as the user knows them.
    """
    if np.isfinite(np.add.reduce(positions, axis=None)):
        return  # one pass in the common case (a sum is finite only if every term is)
    bad = np.flatnonzero(~np.isfinite(positions).all(axis=1))
    if len(bad):
        first = bad[0] if ids is None else ids[bad[0]]
        raise ValueError(
            f"positions of {len(bad)} atom(s) are not finite (first: atom {first}: "
            f"{positions[bad[0]].tolist()})"
        )


def validate_numbers(numbers: np.ndarray, atomic_types: Sequence[int] | None) -> None:
    """Raise ``ValueError`` if an element is not in ``atomic_types`` (``None`` accepts all)."""
    if atomic_types is None or len(numbers) == 0:
        return
    supported = np.zeros(max(int(numbers.max()), max(atomic_types)) + 1, dtype=bool)
    supported[np.asarray(atomic_types, dtype=np.int64)] = True
    unsupported = np.unique(numbers[~supported[numbers]])
    if len(unsupported):
        names = ", ".join(_symbol(z) for z in unsupported)
        known = ", ".join(_symbol(z) for z in sorted(atomic_types))
        raise ValueError(f"the model does not support {names} (it supports {known})")


def validate(atoms: Atoms, atomic_types: Sequence[int] | None) -> None:
    """Raise ``ValueError`` if ``atoms`` cannot be evaluated (all checks above)."""
    validate_positions(atoms.positions)
    validate_cell(atoms.cell.array, atoms.pbc)
    validate_numbers(atoms.numbers, atomic_types)


def _symbol(z: int) -> str:
    return chemical_symbols[z] if 0 <= z < len(chemical_symbols) else f"Z={z}"


def checksum(array: np.ndarray) -> tuple[int, int]:
    """Bitwise checksum of an array: wrapping sums of its 64-bit words and their squares.

    Any change of the bits of a few values changes it; a pass at memory speed
    (several times faster than a cryptographic hash), so ranks can compare
    their copies every step. Not a defence against deliberate collisions.
    """
    words = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    padding = (-len(words)) % 8
    if padding:
        words = np.concatenate([words, np.zeros(padding, np.uint8)])
    words = words.view(np.uint64)
    with np.errstate(over="ignore"):
        return int(words.sum(dtype=np.uint64)), int((words * words).sum(dtype=np.uint64))


def fingerprint(atoms: Atoms) -> tuple:
    """Bitwise digest of what the calculation depends on, one entry per field."""
    return (
        len(atoms),
        checksum(np.asarray(atoms.numbers, dtype=np.int64)),
        checksum(np.asarray(atoms.positions, dtype=np.float64)),
        checksum(np.asarray(atoms.cell.array, dtype=np.float64)),
        tuple(bool(p) for p in atoms.pbc),
    )


def differing_fields(reference: tuple, other: tuple) -> list[str]:
    """Names of the fingerprint fields in which ``other`` differs."""
    return [
        name for name, a, b in zip(FINGERPRINT_FIELDS, reference, other, strict=True) if a != b
    ]


def check_slices(size: int, rank: int, call: int) -> tuple[int, ...]:
    """The two index slices (of ``size`` equal ones) whose copies ``rank`` checks.

    Every rank checks its own slice ``rank`` and visits slice ``rank + v``
    (``v`` cycling through ``1 .. size - 1`` with ``call``), so each slice is
    checked by two ranks at every call and every rank has checked every slice
    after ``size - 1`` calls, at ``2 N / size`` atoms per rank and call.
    """
    if size < 2:
        return ()
    return (rank, (rank + 1 + call % (size - 1)) % size)


def slice_bounds(n_atoms: int, size: int, index: int) -> slice:
    """Atom indices of slice ``index`` of ``size`` near-equal ones."""
    return slice(index * n_atoms // size, (index + 1) * n_atoms // size)


def slice_checksums(atoms: Atoms, slices: Sequence[int], size: int) -> tuple:
    """``(positions, numbers)`` checksums of each of ``slices`` of ``atoms``."""
    n = len(atoms)
    return tuple(
        (
            checksum(np.asarray(atoms.positions[slice_bounds(n, size, k)], dtype=np.float64)),
            checksum(np.asarray(atoms.numbers[slice_bounds(n, size, k)], dtype=np.int64)),
        )
        for k in slices
    )


def slice_disagreements(
    views: Sequence[tuple], n_atoms: int, call: int
) -> list[tuple[str, str]]:
    """What two ranks' checksums of the same slice disagree on.

    ``views[r]`` is rank ``r``'s :func:`slice_checksums` of its
    :func:`check_slices`. Returns ``(field, description)`` pairs, ``field``
    being ``"positions"`` or ``"numbers"``.
    """
    size = len(views)
    found = []
    for index in range(size):
        visitor = (index - 1 - call % (size - 1)) % size
        home, visiting = views[index][0], views[visitor][1]
        span = slice_bounds(n_atoms, size, index)
        for field, a, b in zip(("positions", "numbers"), home, visiting, strict=True):
            if a != b:
                found.append(
                    (
                        field,
                        f"ranks {index} and {visitor}: {field} of atoms "
                        f"{span.start}-{span.stop - 1}",
                    )
                )
    return found
