"""What ``ase-shard`` knows by name: models, built-in systems and their defaults.

Below the command line (:mod:`ase_shard.cli`), the MD driver (:mod:`ase_shard.md`)
and the benchmark (:mod:`ase_shard.bench`), which all resolve the same names.
Torch-free, so that parsing and ``--help`` need no torch: the models themselves
are built by the modules that run them.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from ase.parallel import parprint

if TYPE_CHECKING:
    from ase import Atoms


class CLIError(Exception):
    """A user error: reported as one line, exit code 2."""


# ----------------------------------------------------------------------------- models

BUILTIN_MODELS = ("emt", "lj", "morse")
# random-weight models of the real architectures (ase_shard.random_models.ML_MODELS)
BENCH_MODELS = ("sevennet", "mace", "nequip")
NO_EDGE = "no-edge"  # a model without pairs: ase_shard.random_models.no_edge_model

# SevenNet's pretrained checkpoints by sevenn's names (sevenn._const), relative to
# sevenn/pretrained_potentials or ~/.cache/sevennet; only those found there are
# offered, because sevenn would download the others
SEVENN_CHECKPOINTS = {
    "7net-0": "SevenNet_0__11Jul2024/checkpoint_sevennet_0.pth",
    "7net-0_22may2024": "SevenNet_0__22May2024/checkpoint_sevennet_0.pth",
    "7net-l3i5": "SevenNet_l3i5/checkpoint_l3i5.pth",
    "7net-mf-0": "SevenNet_MF_0/checkpoint_sevennet_mf_0.pth",
    "7net-mf-ompa": "SevenNet_MF_ompa/checkpoint_sevennet_mf_ompa.pth",
    "7net-omat": "SevenNet_omat/checkpoint_sevennet_omat.pth",
    "7net-omni": "SevenNet_omni/checkpoint_sevennet_omni.pth",
    "7net-omni-i8": "SevenNet_omni_i8/checkpoint_sevennet_omni_i8.pth",
    "7net-omni-i12": "SevenNet_omni_i12/checkpoint_sevennet_omni_i12.pth",
}
# CHGNet's pretrained models by --model name: the weights ship inside the chgnet wheel
CHGNET_MODELS = {
    "chgnet": "0.3.0",
    "chgnet-0.3.0": "0.3.0",
    "chgnet-0.2.0": "0.2.0",
    "chgnet-r2scan": "r2scan",
}
# Orb-v3 by --model orb:FILE (orb's .ckpt holds weights only, for the architecture its
# file name starts with; the ending alone is NequIP's) or orb:NAME (orb's download cache)
ORB_PREFIX = "orb:"
ORB_MODELS = (
    "orb-v3-conservative-inf-omat",
    "orb-v3-conservative-20-omat",
    "orb-v3-conservative-inf-mpa",
    "orb-v3-conservative-20-mpa",
    "orb-v3-direct-inf-omat",
    "orb-v3-direct-20-omat",
    "orb-v3-direct-inf-mpa",
    "orb-v3-direct-20-mpa",
)
# MatterSim's pretrained checkpoints by --model name -> the file mattersim downloads
# into MATTERSIM_FOLDER on first use; they do not ship in the wheel, so only those
# already downloaded are offered
MATTERSIM_CHECKPOINTS = {
    "mattersim-1m": "mattersim-v1.0.0-1M.pth",
    "mattersim-5m": "mattersim-v1.0.0-5M.pth",
}
MATTERSIM_FOLDER = "~/.local/mattersim/pretrained_models"
# model files by name ending -> (adapter kind, what the file is)
MODEL_FILES = {
    ".pth": ("sevenn", "SevenNet checkpoint"),
    ".model": ("mace", "MACE model"),
    ".nequip.zip": ("nequip", "NequIP/Allegro package"),
    ".ckpt": ("nequip", "NequIP/Allegro checkpoint"),
}
# model files named KIND:PATH, for endings that several packages use (.pt, .pth)
PREFIXED_FILES = {
    "sevenn": "SevenNet checkpoint",
    "mace": "MACE model",
    "nequip": "NequIP/Allegro package or checkpoint",
    "metatomic": "exported metatomic model (e.g. PET-MAD)",
    "uma": "fairchem UMA inference checkpoint (task: --modality)",
    "mattersim": "MatterSim checkpoint",
}
# adapter kind -> (module it imports, its distribution)
ADAPTER_PACKAGES = {
    "sevenn": ("sevenn", "sevenn"),
    "mace": ("mace", "mace-torch"),
    "nequip": ("nequip", "nequip"),
    "chgnet": ("chgnet", "chgnet"),
    "metatomic": ("metatomic.torch", "metatomic-torch"),
    "uma": ("fairchem.core", "fairchem-core"),
    "orb": ("orb_models", "orb-models"),
    # the module the adapter loads (mattersim's top level imports none of it)
    "mattersim": ("mattersim.forcefield", "mattersim"),
}
# fcc argon at the density of the liquid near its boiling point, 1.40 g/cm³
ARGON_LIQUID_A = 5.74


@dataclass(frozen=True)
class ModelSpec:
    """A resolved ``--model``: ``kind`` is ``builtin``, ``bench`` (random weights),
    ``sevenn``, ``mace``, ``nequip``, ``chgnet``, ``metatomic``, ``uma``, ``orb`` or
    ``mattersim``; ``source`` the name (CHGNet's own, e.g. ``0.3.0``, for ``chgnet``;
    orb's for ``orb:NAME``) or the file path;
    ``label`` what the run prints; ``argument`` the ``--model`` value that finds
    the model again from any directory (the name, or the file's absolute path),
    which ``ase-shard md`` records in its frames for ``--restart``."""

    kind: str
    source: str
    label: str
    argument: str


def same_model(a: ModelSpec, b: ModelSpec) -> bool:
    """Whether two resolved ``--model`` values are one model: the same built-in, or
    the same file (a shipped checkpoint by name or by path)."""
    if a.kind != b.kind:
        return False
    if a.kind in ("builtin", "bench", "chgnet") or (a.kind == "orb" and a.source in ORB_MODELS):
        return a.source == b.source
    return os.path.realpath(a.source) == os.path.realpath(b.source)


def sevenn_directory() -> Path | None:
    """sevenn's ``pretrained_potentials`` directory, found without importing sevenn."""
    spec = importlib.util.find_spec("sevenn")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "pretrained_potentials"


def shipped_checkpoints() -> dict[str, Path]:
    """Pretrained SevenNet checkpoints present on this machine, by name."""
    places = [sevenn_directory(), Path("~/.cache/sevennet").expanduser()]
    found = {}
    for name, relative in SEVENN_CHECKPOINTS.items():
        for place in places:
            if place is not None and (place / relative).is_file():
                found[name] = place / relative
                break
    return found


def mattersim_checkpoint(name: str) -> Path | None:
    """Where mattersim keeps the pretrained checkpoint ``name`` (``mattersim-1m``,
    ``mattersim-5m``, or mattersim's own ``mattersim-v1.0.0-1m[.pth]``; any case),
    whether or not it is there; ``None`` for another name."""
    key = name.lower()
    for short, filename in MATTERSIM_CHECKPOINTS.items():
        if key in (short, filename.lower(), filename.lower().removesuffix(".pth")):
            return Path(MATTERSIM_FOLDER).expanduser() / filename
    return None


def downloaded_mattersim() -> dict[str, Path]:
    """MatterSim's pretrained checkpoints that mattersim has downloaded here, by name."""
    found = {name: mattersim_checkpoint(name) for name in MATTERSIM_CHECKPOINTS}
    return {name: path for name, path in found.items() if path.is_file()}


def model_choices(bench: bool = False) -> list[str]:
    """The model names ``--model`` takes here (besides model files)."""
    extra = [*BENCH_MODELS, NO_EDGE] if bench else []
    chgnet = list(CHGNET_MODELS) if importlib.util.find_spec("chgnet") else []
    mattersim = list(downloaded_mattersim()) if importlib.util.find_spec("mattersim") else []
    return [*BUILTIN_MODELS, *extra, *shipped_checkpoints(), *chgnet, *mattersim]


def resolve_model(name: str, bench: bool = False) -> ModelSpec:
    """``--model NAME``: a built-in potential, a shipped checkpoint or a model file
    (named after its kind by its ending, or as ``KIND:PATH``).

    Raises
    ------
    CLIError
        One line listing the choices, for a name that is none of these.
    """
    key = name.lower()  # sevenn's names are case-insensitive (7net-MF-0)
    if key in BUILTIN_MODELS:
        return ModelSpec("builtin", key, key, key)
    if bench and key in (*BENCH_MODELS, NO_EDGE):
        return ModelSpec("bench", key, key, key)
    shipped = shipped_checkpoints()
    if key in shipped:
        return ModelSpec("sevenn", str(shipped[key]), key, key)
    if key in CHGNET_MODELS:
        return ModelSpec("chgnet", CHGNET_MODELS[key], key, key)
    checkpoint = mattersim_checkpoint(key)
    if checkpoint is not None:
        if not checkpoint.is_file():
            raise CLIError(
                f"--model {name}: not downloaded here (mattersim keeps it at {checkpoint}; "
                f"its wheel does not ship it): give --model mattersim:FILE"
            )
        return ModelSpec("mattersim", str(checkpoint), key, key)
    if key.startswith(ORB_PREFIX):
        source = name[len(ORB_PREFIX) :]
        if os.path.isfile(source):
            return ModelSpec("orb", source, name, ORB_PREFIX + os.path.abspath(source))
        if source.lower() in ORB_MODELS:
            return ModelSpec("orb", source.lower(), key, key)
        raise CLIError(
            f"--model {name}: not a file, nor one of orb's Orb-v3 models "
            f"({', '.join(ORB_MODELS)})"
        )
    kind, colon, path = name.partition(":")
    if colon and kind in PREFIXED_FILES:
        if not os.path.isfile(path):
            raise CLIError(f"--model {name}: no {PREFIXED_FILES[kind]} file at {path!r}")
        return ModelSpec(kind, path, name, f"{kind}:{os.path.abspath(path)}")
    prefixes = ", ".join([*(f"{kind}:PATH" for kind in PREFIXED_FILES), "orb:FILE|NAME"])
    if os.path.isfile(name):
        for ending, (kind, _) in MODEL_FILES.items():
            if name.endswith(ending):
                return ModelSpec(kind, name, name, os.path.abspath(name))
        endings = ", ".join(f"{e} ({what})" for e, (_, what) in MODEL_FILES.items())
        raise CLIError(
            f"model file {name!r}: name it after its kind ({endings}) or say the kind: "
            f"{prefixes}"
        )
    hint = " (sevenn downloads it; not available offline)" if key in SEVENN_CHECKPOINTS else ""
    raise CLIError(
        f"unknown model {name!r}{hint}: choose {', '.join(model_choices(bench))}, "
        f"a model file ({', '.join(MODEL_FILES)}), or {prefixes}"
    )


# ---------------------------------------------------------------------------- systems

# ase-shard md --ensemble: ASE's VelocityVerlet, Langevin, Bussi, NoseHooverChainNVT,
# NVTBerendsen, IsotropicMTKNPT and NPTBerendsen (ase_shard.md.make_dynamics)
ENSEMBLES = (
    "nve",
    "langevin",
    "nvt-bussi",
    "nvt-nose-hoover",
    "nvt-berendsen",
    "npt-mtk",
    "npt-berendsen",
)


@dataclass(frozen=True)
class Defaults:
    """What suits a kind of system when the command line does not say."""

    model: str
    temperature: float  # K
    compressibility: float  # 1/bar, for the Berendsen barostat


@dataclass(frozen=True)
class System:
    """A built-in system: ``build(size, seed)``, its default size and defaults."""

    build: Callable[[int, int], Atoms]
    size: int
    size_help: str
    defaults: Defaults


def _cu_bulk(size: int, seed: int) -> Atoms:
    from ase.build import bulk

    return bulk("Cu", "fcc", a=3.61, cubic=True).repeat(size)


def _cu_cluster(size: int, seed: int) -> Atoms:
    from ase.cluster import Icosahedron

    return Icosahedron("Cu", noshells=size, latticeconstant=3.61)


def _ar_liquid(size: int, seed: int) -> Atoms:
    from ase.build import bulk

    atoms = bulk("Ar", "fcc", a=ARGON_LIQUID_A, cubic=True).repeat(size)
    atoms.rattle(stdev=0.2, seed=seed)
    return atoms


def _ar_interface(size: int, seed: int) -> Atoms:
    """The liquid of ``ar-liquid`` as a slab in a box three times as long along z, and a
    sixth as many atoms again as its vapour in the rest: a liquid-vapour interface."""
    from ase import Atoms

    atoms = _ar_liquid(size, seed)
    length = atoms.cell[2, 2]
    atoms.cell[2, 2] = 3.0 * length
    # the liquid's planes are at 0 (its first) and length - a / 2 (its last): 3.4 Å clear
    clear = (length - ARGON_LIQUID_A / 2.0 + 3.4, 3.0 * length - 3.4)
    gas = _scattered(len(atoms) // 6, atoms.cell, clear, 3.4, seed)
    return atoms + Atoms("Ar" * len(gas), positions=gas)


def _cu_slab_gas(size: int, seed: int) -> Atoms:
    """An N x N x N Cu(100) slab with 20 Å of vacuum, N^2 / 2 N2 molecules in it."""
    from ase import Atoms
    from ase.build import fcc100

    atoms = fcc100("Cu", size=(size, size, size), a=3.61, vacuum=10.0, periodic=True)
    top = atoms.positions[:, 2].max()
    # one point per molecule, 4 Å clear of the slab (and its image across the box)
    centres = _scattered(size * size // 2, atoms.cell, (top + 4.0, top + 16.0), 4.0, seed)
    axes = np.random.default_rng(seed).normal(size=(len(centres), 3))
    half_bond = 0.55 * axes / np.linalg.norm(axes, axis=1, keepdims=True)  # N2: 1.10 Å
    pairs = np.stack([centres - half_bond, centres + half_bond], axis=1).reshape(-1, 3)
    return atoms + Atoms("N" * len(pairs), positions=pairs)


def _cu_particle(size: int, seed: int) -> Atoms:
    """The Cu icosahedron of ``cu-cluster`` in a periodic box twice its width."""
    atoms = _cu_cluster(size, seed)
    width = np.ptp(atoms.positions, axis=0).max()
    atoms.center(vacuum=width / 2.0)
    atoms.pbc = True
    return atoms


def _scattered(
    count: int, cell: np.ndarray, z_range: tuple[float, float], spacing: float, seed: int
) -> np.ndarray:
    """``count`` random points (Å) across the cell's first two vectors, between the
    heights ``z_range``, no two closer than ``spacing`` Å (an orthogonal cell)."""
    rng = np.random.default_rng(seed)
    points = np.zeros((0, 3))
    while len(points) < count:
        trial = rng.uniform(0.0, 1.0, 3) * [cell[0, 0], cell[1, 1], 1.0]
        trial[2] = z_range[0] + trial[2] * (z_range[1] - z_range[0])
        gap = points - trial
        gap[:, :2] -= np.round(gap[:, :2] / [cell[0, 0], cell[1, 1]]) * [cell[0, 0], cell[1, 1]]
        if not len(points) or np.min(np.linalg.norm(gap, axis=1)) >= spacing:
            points = np.vstack([points, trial])
    return points


COPPER = Defaults("emt", 300.0, 7e-7)
ARGON = Defaults("lj", 180.0, 2e-4)
SYSTEMS = {
    "cu-bulk": System(_cu_bulk, 10, "4 N^3 atoms of fcc Cu", COPPER),
    "cu-cluster": System(_cu_cluster, 11, "Cu icosahedron of N shells", COPPER),
    "ar-liquid": System(_ar_liquid, 10, "4 N^3 Ar atoms", ARGON),
    # heterogeneous systems, for the load balance (ase_shard.balance)
    "ar-interface": System(
        _ar_interface, 6, "4 N^3 liquid Ar atoms beside their vapour", Defaults("lj", 100.0, 2e-4)
    ),
    "cu-slab-gas": System(_cu_slab_gas, 8, "N^3 Cu slab with N^2 / 2 N2 molecules", COPPER),
    "cu-particle": System(_cu_particle, 8, "Cu icosahedron of N shells in a box", COPPER),
}
FILE_DEFAULTS = COPPER  # EMT, 300 K, a metal's compressibility


def load_system(args: argparse.Namespace) -> tuple[Atoms, Defaults, str]:
    """The ``Atoms`` of STRUCTURE or ``--system`` (identical on every rank), their
    defaults and a label, from the parsed ``ase-shard`` arguments (``command``,
    ``structure``, ``system``, ``size``, ``seed``); ``ase_shard.cli.check_system_args``
    has checked them.

    An (extended) XYZ file without ``Lattice`` runs as an isolated cluster, with no
    cell and no periodic axis: rank 0 says so on stderr, as a crystal that lost its
    cell would otherwise run silently. Other formats say whether there is a cell.
    """
    if args.structure is not None:
        from ase.io.formats import filetype

        atoms = read_structure(args.structure, "structure file")
        xyz = filetype(args.structure, read=False) == "extxyz"  # .xyz and .extxyz
        if xyz and atoms.cell.rank == 0 and not atoms.pbc.any():
            parprint(
                f"ase-shard {args.command}: warning: {args.structure} has no Lattice: no cell "
                "and no periodic boundaries, so it runs as an isolated cluster (for a crystal, "
                'add Lattice="..." and pbc="T T T" to its comment line)',
                file=sys.stderr,
                flush=True,
            )
        return atoms, FILE_DEFAULTS, args.structure
    name = args.system or "cu-bulk"
    system = SYSTEMS[name]
    size = system.size if args.size is None else args.size
    return system.build(size, args.seed), system.defaults, f"{name} N={size}"


def read_structure(path: str, role: str) -> Atoms:
    """The last image of ``path`` (``ase.io.read``, identical on every rank).

    Raises
    ------
    CLIError
        Naming ``role`` (what the file is for), the file and what ``ase.io`` said,
        for any file it cannot read. ``ase.io.read`` reads on rank 0 and hands the
        outcome, an error included, to every rank.
    """
    from ase.io import read

    try:
        return read(path)
    except Exception as exc:
        said = " ".join(str(exc).split())
        reason = f"{type(exc).__name__}: {said}" if said else f"{type(exc).__name__} (no message)"
        raise CLIError(f"{role} {path}: ase.io.read cannot read it: {reason}") from None
