"""Model inputs beyond positions: per-atom arrays and per-system values (pure numpy).

A model declares what it needs::

    per_atom_inputs = ("initial_charges",)   # Atoms arrays, travel with the atoms
    system_inputs = ("charge", "spin")       # atoms.info, else calculator parameters

A model may also give ``system_input_defaults``, a mapping from some of its
system names to functions of the ``Atoms`` that give the value when neither
``atoms.info`` nor the parameters do (a default charge, or a value derived from
the whole system such as its composition).

A per-atom name is an ``Atoms`` array (``atoms.arrays[name]``, e.g. a custom
array set with ``atoms.set_array``) or anything with an ``Atoms.get_<name>()``
getter (``initial_charges``, ``initial_magmoms``, ``velocities``, ``momenta``,
``masses``). A per-system value is ``atoms.info[name]``, else the calculator
parameter of that name (``ShardedCalculator(model, charge=1)``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence

import numpy as np
from ase import Atoms


class ModelInputs:
    """The extra inputs one model declares.

    Parameters
    ----------
    per_atom : sequence of str
        Names of per-atom arrays.
    system : sequence of str
        Names of per-system values.
    defaults : mapping of str to callable, optional
        For some system names, a function of the ``Atoms`` giving the value
        when neither ``atoms.info`` nor the parameters do.
    """

    def __init__(
        self,
        per_atom: Sequence[str] = (),
        system: Sequence[str] = (),
        defaults: Mapping[str, Callable[[Atoms], object]] | None = None,
    ):
        self.per_atom = tuple(per_atom)
        self.system = tuple(system)
        self.defaults = dict(defaults or {})

    @classmethod
    def of(cls, model) -> ModelInputs:
        """What ``model`` declares (nothing if it declares nothing)."""
        return cls(
            getattr(model, "per_atom_inputs", ()),
            getattr(model, "system_inputs", ()),
            getattr(model, "system_input_defaults", None),
        )

    def __bool__(self) -> bool:
        return bool(self.per_atom or self.system)

    def per_atom_arrays(self, atoms: Atoms) -> dict[str, np.ndarray]:
        """Each declared per-atom array as float64, shape ``(N, ...)``."""
        arrays = {}
        for name in self.per_atom:
            if name in atoms.arrays:
                value = atoms.arrays[name]
            elif callable(getattr(atoms, f"get_{name}", None)):
                value = getattr(atoms, f"get_{name}")()
            else:
                raise ValueError(
                    f"the model needs the per-atom array {name!r}: set it with "
                    f"atoms.set_array({name!r}, values)"
                )
            value = np.asarray(value, dtype=np.float64)
            if value.shape[:1] != (len(atoms),):
                raise ValueError(f"per-atom input {name!r} has shape {value.shape}")
            arrays[name] = value
        return arrays

    def system_values(self, atoms: Atoms, parameters: Mapping) -> dict[str, list]:
        """Each declared per-system value (as a nested list of floats)."""
        values = {}
        for name in self.system:
            value = atoms.info.get(name, parameters.get(name))
            if value is None and name in self.defaults:
                value = self.defaults[name](atoms)
            if value is None:
                raise ValueError(
                    f"the model needs the per-system value {name!r}: set atoms.info[{name!r}] "
                    f"or pass ShardedCalculator(..., {name}=value)"
                )
            value = np.asarray(value, dtype=np.float64)
            if not np.isfinite(value).all():
                raise ValueError(f"per-system input {name!r} is not finite: {value.tolist()}")
            values[name] = value.tolist()
        return values

    def digest(self, atoms: Atoms, parameters: Mapping) -> bytes:
        """Bitwise digest of every declared input (for change and rank checks)."""
        digest = hashlib.blake2b(digest_size=16)
        try:
            arrays = self.per_atom_arrays(atoms)
            system = self.system_values(atoms, parameters)
        except ValueError as exc:
            digest.update(str(exc).encode())  # invalid input: reported by the plan
            return digest.digest()
        for name, value in arrays.items():
            digest.update(name.encode())
            digest.update(str(value.shape).encode())
            digest.update(np.ascontiguousarray(value).tobytes())
        for name, value in system.items():
            digest.update(f"{name}={value!r}".encode())
        return digest.digest()


def take_rows(array: np.ndarray, rows: np.ndarray | slice) -> np.ndarray:
    """``array[rows]``: by ``np.take`` for an index array, several times faster for rows."""
    return array[rows] if isinstance(rows, slice) else np.take(array, rows, axis=0)


def pack(arrays: Mapping[str, np.ndarray], rows: np.ndarray | slice) -> np.ndarray:
    """Rows ``rows`` of the (one or more) per-atom arrays side by side, ``(n, k)`` float64."""
    columns = [take_rows(value, rows) for value in arrays.values()]
    # each array's width given, not inferred: a rank may pack no rows
    return np.concatenate(
        [column.reshape(len(column), int(np.prod(column.shape[1:]))) for column in columns],
        axis=1,
    )


def row_width(shapes: Mapping[str, Sequence[int]]) -> int:
    """Columns of a node row: the position (3, Å), then the arrays of per-atom ``shapes``
    packed (:func:`pack`)."""
    return 3 + sum(int(np.prod(shape, dtype=np.int64)) for shape in shapes.values())


def unpack(packed: np.ndarray, shapes: Mapping[str, Sequence[int]]) -> dict[str, np.ndarray]:
    """Inverse of :func:`pack` given each array's per-atom shape."""
    out, start = {}, 0
    for name, shape in shapes.items():
        width = int(np.prod(shape, dtype=np.int64))
        out[name] = packed[:, start : start + width].reshape(len(packed), *shape)
        start += width
    return out
