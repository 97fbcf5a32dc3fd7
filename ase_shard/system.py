"""Checks on the system every rank must agree on (pure numpy, no MPI)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
from ase import Atoms
from ase.data import chemical_symbols

FINGERPRINT_FIELDS = ("number of atoms", "numbers", "positions", "cell", "pbc")


def validate(atoms: Atoms, atomic_types: Sequence[int] | None) -> None:
    """Raise ``ValueError`` if ``atoms`` cannot be evaluated.

    Checks finite positions, a non-degenerate cell on periodic axes and that
    every element is in ``atomic_types`` (``None`` accepts all).
    """
    positions = atoms.positions
    bad = np.flatnonzero(~np.isfinite(positions).all(axis=1))
    if len(bad):
        raise ValueError(
            f"positions of {len(bad)} atom(s) are not finite (first: atom {bad[0]}: "
            f"{positions[bad[0]].tolist()})"
        )
    cell = atoms.cell.array
    if not np.isfinite(cell).all():
        raise ValueError(f"cell is not finite: {cell.tolist()}")
    periodic = np.flatnonzero(atoms.pbc)
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
    if atomic_types is not None:
        unsupported = sorted(set(atoms.numbers.tolist()) - set(int(z) for z in atomic_types))
        if unsupported:
            names = ", ".join(_symbol(z) for z in unsupported)
            supported = ", ".join(_symbol(z) for z in sorted(atomic_types))
            raise ValueError(f"the model does not support {names} (it supports {supported})")


def _symbol(z: int) -> str:
    return chemical_symbols[z] if 0 <= z < len(chemical_symbols) else f"Z={z}"


def fingerprint(atoms: Atoms) -> tuple:
    """Bitwise digest of what the calculation depends on, one entry per field."""

    def digest(array: np.ndarray) -> bytes:
        return hashlib.blake2b(np.ascontiguousarray(array).tobytes(), digest_size=16).digest()

    return (
        len(atoms),
        digest(atoms.numbers.astype(np.int64)),
        digest(atoms.positions.astype(np.float64)),
        digest(atoms.cell.array.astype(np.float64)),
        digest(atoms.pbc.astype(bool)),
    )


def differing_fields(reference: tuple, other: tuple) -> list[str]:
    """Names of the fingerprint fields in which ``other`` differs."""
    return [
        name for name, a, b in zip(FINGERPRINT_FIELDS, reference, other, strict=True) if a != b
    ]
