"""Checks on the system every rank must agree on (pure numpy, no MPI)."""

from __future__ import annotations

import zlib
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
    """Bitwise checksum of an array: the CRC-32 of its bytes and the sum of its 64-bit words.

    The sum (modulo 2**64) changes whenever exactly one word changed (an atom moved on one
    rank, round-off); the CRC also changes when the same values moved to other
    places (atoms permuted, coordinates swapped), which sums cannot see. Both
    run at memory speed, so ranks can compare their whole copies at every
    call: for 32,000 positions the CRC takes 0.15 ms here (zlib's is the
    fastest standard hash at hand: SHA-1 0.38 ms, BLAKE2s 1.3 ms), the sum
    0.01 ms. Not a defence against deliberate collisions.
    """
    data = np.ascontiguousarray(array)
    words = data.reshape(-1).view(np.uint8)
    padding = (-len(words)) % 8
    if padding:
        words = np.concatenate([words, np.zeros(padding, np.uint8)])
    return zlib.crc32(data), int(words.view(np.uint64).sum(dtype=np.uint64))


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


def slice_bounds(n_atoms: int, size: int, index: int) -> slice:
    """Atom indices of slice ``index`` of ``size`` near-equal ones."""
    return slice(index * n_atoms // size, (index + 1) * n_atoms // size)
