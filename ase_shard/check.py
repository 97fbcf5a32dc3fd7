"""``ase-shard check``: is a model exact under ase_shard, on this machine?

Run with the rank count to check, e.g. ``mpirun -n 4 ase-shard check --model my.model``:

- on rank 0, one rank of ``ShardedCalculator`` against the model's own ASE
  calculator (``SevenNetCalculator``, ``MACECalculator``, ``NequIPCalculator``,
  ``CHGNetCalculator``, ``MetatomicCalculator``; ASE's ``EMT``/``LennardJones``/
  ``MorsePotential`` for the built-ins) on the same weights;
- all ranks against that one rank;

on four small standard geometries built from the model's elements: a periodic
cubic bulk, a general triclinic cell, a slab (pbc T, T, F) and a cluster (no
cell). Rank 0 prints, per geometry, the relative differences of energy, forces
and stress (largest absolute difference over the largest absolute value), and
the exit code says whether all are within the tolerance of the dtype.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from ase import Atoms
from ase.build import bulk, fcc111
from ase.calculators.calculator import Calculator
from ase.cluster import Icosahedron
from ase.data import atomic_numbers, chemical_symbols, covalent_radii

from ase_shard.calculator import ShardedCalculator
from ase_shard.comm import Comm
from ase_shard.md import ASE_CALCULATORS, build_model, make_calculator
from ase_shard.presets import CLIError, ModelSpec

# relative differences (see relative_difference) allowed, by the model's dtype: float64
# results agree to round-off; float32 ones differ by summation order, ~1e-6 of the
# largest force, and the packages' own calculators cast inputs their own way
TOLERANCE = {torch.float64: 1e-8, torch.float32: 1e-5}
# the elements a geometry takes from a model that has them, in this order: common
# metals first (dense, many neighbours), then what molecular models know
PREFERRED = ("Cu", "Ag", "Au", "Ni", "Pd", "Pt", "Al", "Fe", "Si", "C", "O", "N", "H")
# nearest-neighbour distance of the geometries, Å: from the elements' covalent radii,
# kept within a range where every model has neighbours and no atoms overlap
NEAREST = (2.2, 3.2)
QUANTITIES = ("energy", "forces", "stress")


@dataclass(frozen=True)
class Differences:
    """Relative differences (see :func:`relative_difference`); ``stress`` is ``None``
    for geometries without a 3D cell."""

    energy: float
    forces: float
    stress: float | None

    def largest(self) -> float:
        return max(value for value in (self.energy, self.forces, self.stress) if value is not None)


@dataclass(frozen=True)
class Row:
    """One geometry's line of the report."""

    system: str
    atoms: int
    pbc: str
    own: Differences  # one rank against the model's own calculator
    ranks: Differences  # all ranks against one rank


def relative_difference(value: np.ndarray, reference: np.ndarray) -> float:
    """``max |value - reference| / max |reference|`` (the absolute difference when the
    reference is all zero)."""
    value, reference = np.asarray(value, float), np.asarray(reference, float)
    error = float(np.max(np.abs(value - reference)))
    scale = float(np.max(np.abs(reference)))
    return error / scale if scale > 0.0 else error


def differences(got: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> Differences:
    stress = "stress" in reference
    return Differences(
        relative_difference(got["energy"], reference["energy"]),
        relative_difference(got["forces"], reference["forces"]),
        relative_difference(got["stress"], reference["stress"]) if stress else None,
    )


def results(calc: Calculator, atoms: Atoms) -> dict[str, np.ndarray]:
    """Energy (eV), forces (eV/Å) and, with a 3D cell, stress (eV/Å³) of ``atoms``."""
    atoms = atoms.copy()
    atoms.calc = calc
    out = {"energy": np.asarray(atoms.get_potential_energy()), "forces": atoms.get_forces()}
    if atoms.cell.rank == 3:
        out["stress"] = atoms.get_stress()
    return out


def choose_elements(atomic_types: Sequence[int] | None, requested: str | None) -> list[str]:
    """``--elements`` (comma-separated symbols, each one the model knows), or up to
    two of the model's elements, :data:`PREFERRED` ones first."""
    known = None if atomic_types is None else {chemical_symbols[z] for z in atomic_types}
    if requested is not None:
        symbols = [symbol.strip() for symbol in requested.split(",") if symbol.strip()]
        unknown = [s for s in symbols if s not in atomic_numbers]
        if not symbols or unknown:
            raise CLIError(f"--elements {requested!r}: give chemical symbols, e.g. Cu,Ag")
        missing = [s for s in symbols if known is not None and s not in known]
        if missing:
            raise CLIError(f"--elements: the model has no {', '.join(missing)}")
        return symbols
    if known is None:  # a model for any element (LJ, Morse)
        return ["Cu", "Ag"]
    ordered = [s for s in PREFERRED if s in known]
    ordered += sorted(known - set(ordered), key=atomic_numbers.__getitem__)
    return ordered[:2]


def standard_geometries(elements: Sequence[str], seed: int = 7) -> dict[str, Atoms]:
    """Four small rattled geometries of ``elements`` (mixed at random, each present).

    ``bulk``: 32 atoms, cubic fcc, periodic. ``triclinic``: 27 atoms, the fcc
    primitive cell (60° angles), sheared, periodic. ``slab``: 27 atoms, fcc(111)
    with 6 Å of vacuum, pbc (T, T, F). ``cluster``: 13-atom icosahedron, no cell.
    """
    rng = np.random.default_rng(seed)
    radius = float(np.mean([covalent_radii[atomic_numbers[s]] for s in elements]))
    nearest = float(np.clip(2.0 * radius, *NEAREST))
    a = nearest * np.sqrt(2.0)  # fcc lattice constant
    cubic = bulk("X", "fcc", a=a, cubic=True).repeat(2)
    triclinic = bulk("X", "fcc", a=a).repeat(3)
    shear = np.eye(3)
    shear[0, 1], shear[2, 0] = 0.12, -0.08
    triclinic.set_cell(triclinic.cell.array @ shear, scale_atoms=True)
    slab = fcc111("X", size=(3, 3, 3), a=a, vacuum=6.0)
    cluster = Icosahedron("X", noshells=2, latticeconstant=a)
    cluster.cell = np.zeros((3, 3))  # a molecule: no cell at all
    geometries = {"bulk": cubic, "triclinic": triclinic, "slab": slab, "cluster": cluster}
    for atoms in geometries.values():
        symbols = rng.permutation(np.resize(np.asarray(elements), len(atoms)))
        atoms.set_chemical_symbols(list(symbols))
        atoms.rattle(stdev=0.05 * nearest, seed=int(rng.integers(2**31)))
    return geometries


def own_calculator(spec: ModelSpec, modality: str | None, dtype: torch.dtype) -> Calculator:
    """The model's own ASE calculator, from the same built-in, name or file, on the CPU
    and (where the package lets one choose) in ``dtype``."""
    kind, source = spec.kind, spec.source
    if kind == "builtin":
        return ASE_CALCULATORS[source]()
    if kind == "sevenn":
        from sevenn.calculator import SevenNetCalculator

        return SevenNetCalculator(source, modal=modality, device="cpu")
    if kind == "mace":
        from mace.calculators import MACECalculator

        precision = "float64" if dtype == torch.float64 else "float32"
        return MACECalculator(
            model_paths=source, device="cpu", default_dtype=precision, head=modality
        )
    if kind == "nequip":
        from nequip.integrations.ase import NequIPCalculator

        return NequIPCalculator._from_saved_model(source, device="cpu")
    if kind == "chgnet":
        from chgnet.model import CHGNet, CHGNetCalculator

        return CHGNetCalculator(CHGNet.load(model_name=source, use_device="cpu"), use_device="cpu")
    if kind == "metatomic":
        from metatomic_ase import MetatomicCalculator

        return MetatomicCalculator(source, device="cpu")
    if kind == "uma":
        from fairchem.core.calculate.ase_calculator import FAIRChemCalculator
        from fairchem.core.units.mlip_unit import MLIPPredictUnit
        from fairchem.core.units.mlip_unit.api.inference import InferenceSettings

        # as the adapter runs it: experts unmerged, not compiled, in dtype
        settings = InferenceSettings(
            merge_mole=False, compile=False, activation_checkpointing=False,
            base_precision_dtype=dtype,
        )
        unit = MLIPPredictUnit(source, device="cpu", inference_settings=settings)
        return FAIRChemCalculator(unit, task_name=modality)
    raise CLIError(f"--model {spec.label}: no own ASE calculator known to compare with")


def _serial_comm() -> object | None:
    """A one-rank communicator: ``MPI.COMM_SELF`` under MPI, else none."""
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi.COMM_SELF if mpi is not None else None


def run(args: argparse.Namespace, spec: ModelSpec) -> int:
    """Every rank: the model on all ranks; rank 0: on one rank and with its own
    calculator. Rank 0 prints the report; 0 when every difference is within
    :data:`TOLERANCE`, else 1 (on every rank)."""
    comm = Comm()
    model = build_model(spec, args.modality, args.dtype, args.interaction_range)
    calc = make_calculator(model, args)
    dtype = calc.dtype
    elements = choose_elements(getattr(model, "atomic_types", None), args.elements)
    geometries = standard_geometries(elements)
    shared = {name: results(calc, atoms) for name, atoms in geometries.items()}

    def reference_rows() -> list[Row]:
        serial = ShardedCalculator(
            model, comm=_serial_comm(), device=args.device, dtype=dtype, skin=args.skin
        )
        own = own_calculator(spec, args.modality, dtype)
        rows = []
        for name, atoms in geometries.items():
            one = results(serial, atoms)
            rows.append(
                Row(
                    name,
                    len(atoms),
                    "".join("T" if p else "F" for p in atoms.pbc),
                    differences(one, results(own, atoms)),
                    differences(shared[name], one),
                )
            )
        return rows

    rows = comm.decide(reference_rows)
    tolerance = TOLERANCE[dtype]
    worst = max(max(row.own.largest(), row.ranks.largest()) for row in rows)
    if comm.is_root:
        print(
            "\n".join(
                report(spec, type(calc.model).__name__, dtype, comm.size, elements, rows)
            ),
            flush=True,
        )
        verdict = "ok" if worst <= tolerance else "DIFFERS"
        name = str(dtype).removeprefix("torch.")
        print(f"largest {worst:.1e}, tolerance {tolerance:.0e} ({name}): {verdict}", flush=True)
    return 0 if worst <= tolerance else 1


def report(
    spec: ModelSpec,
    adapter: str,
    dtype: torch.dtype,
    ranks: int,
    elements: Sequence[str],
    rows: Sequence[Row],
) -> list[str]:
    """The table rank 0 prints."""

    def cells(d: Differences) -> str:
        values = (d.energy, d.forces, d.stress)
        return "  ".join(f"{'-' if v is None else f'{v:.1e}':>8}" for v in values)

    heading = "  ".join(f"{q:>8}" for q in QUANTITIES)
    lines = [
        f"ase-shard check: {spec.label} ({adapter}), {str(dtype).removeprefix('torch.')}, "
        f"{ranks} rank{'s' if ranks > 1 else ''}, elements {' '.join(elements)}",
        "relative differences, max |a - b| / max |b|:",
        f"{'':<22}{'1 rank vs own calculator':<30}{f'{ranks} vs 1 rank':<30}",
        f"{'system':<10}{'atoms':>5} {'pbc':>5} {heading}    {heading}",
    ]
    lines += [
        f"{row.system:<10}{row.atoms:>5} {row.pbc:>5} {cells(row.own)}    {cells(row.ranks)}"
        for row in rows
    ]
    if ranks == 1:
        lines.append("(one process: run under mpirun -n P to compare P ranks with one)")
    return lines
