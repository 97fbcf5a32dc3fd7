"""The MACE adapter equals mace-torch's own ``MACECalculator`` (serial).

Small random-weight models of the real architecture are built here; no
pretrained weights are downloaded. ``tests/test_sharded_mace.py`` repeats the
comparison at any rank count.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
mace = pytest.importorskip("mace")  # before e3nn: mace allows e3nn's pickled constants

import numpy as np  # noqa: E402
import torch  # noqa: E402
from ase import Atoms  # noqa: E402
from ase.build import bulk, fcc111  # noqa: E402
from ase.cluster import Icosahedron  # noqa: E402
from e3nn import o3  # noqa: E402
from mace import modules  # noqa: E402
from mace.calculators import MACECalculator  # noqa: E402
from oracles import relative_errors  # noqa: E402
from sharded import results  # noqa: E402

from ase_shard import ShardedCalculator  # noqa: E402
from ase_shard.models.mace import MACE  # noqa: E402

RTOL = 1e-10
ELEMENTS = [13, 29, 47]  # Al, Cu, Ag

# name -> (model class, first interaction, later interactions, extra keyword arguments)
VARIANTS = {
    "scale_shift": (
        "ScaleShiftMACE",
        "RealAgnosticResidualInteractionBlock",
        "RealAgnosticResidualInteractionBlock",
        {"correlation": 3},
    ),
    "plain": (
        "MACE",
        "RealAgnosticInteractionBlock",
        "RealAgnosticResidualInteractionBlock",
        {"correlation": 2},
    ),
    # direction-sensitive pieces: source/target embeddings, ZBL to the receiver,
    # a distance transform of sender and receiver species
    "density_zbl_agnesi": (
        "ScaleShiftMACE",
        "RealAgnosticDensityInteractionBlock",
        "RealAgnosticDensityResidualInteractionBlock",
        {"correlation": 2, "pair_repulsion": True, "distance_transform": "Agnesi"},
    ),
    "one_layer": (
        "ScaleShiftMACE",
        "RealAgnosticResidualInteractionBlock",
        "RealAgnosticResidualInteractionBlock",
        {"correlation": 3, "num_interactions": 1},
    ),
}


def make_mace(
    variant: str = "scale_shift",
    *,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
    heads: list[str] | None = None,
    r_max: float = 4.5,
    channels: int = 8,
    max_ell: int = 1,
) -> torch.nn.Module:
    """A random-weight MACE of the real architecture.

    Hidden irreps ``{channels}x0e + {channels}x1o`` and spherical harmonics up
    to ``max_ell``; the tests use the small defaults, ``scripts/adapter_speed.py``
    a realistic size.
    """
    cls_name, first, later, extra = VARIANTS[variant]
    extra = dict(extra)
    n_heads = len(heads) if heads else 1
    atomic_energies = np.array([-1.5, -2.25, -3.1])
    scale, shift = 1.3, 0.2
    if heads:
        atomic_energies = np.stack([atomic_energies * (1 + 0.1 * h) for h in range(n_heads)])
        scale = [1.3 + 0.2 * h for h in range(n_heads)]
        shift = [0.2 - 0.1 * h for h in range(n_heads)]
        extra["heads"] = heads
    kwargs = dict(
        r_max=r_max,
        num_bessel=6,
        num_polynomial_cutoff=5,
        max_ell=max_ell,
        interaction_cls=modules.interaction_classes[later],
        interaction_cls_first=modules.interaction_classes[first],
        num_interactions=2,
        num_elements=len(ELEMENTS),
        hidden_irreps=o3.Irreps(f"{channels}x0e+{channels}x1o"),
        MLP_irreps=o3.Irreps("8x0e"),
        atomic_energies=atomic_energies,
        avg_num_neighbors=10.0,
        atomic_numbers=ELEMENTS,
        gate=torch.nn.functional.silu,
        radial_MLP=[16, 16],
    )
    kwargs.update(extra)
    if cls_name == "ScaleShiftMACE":
        kwargs.update(atomic_inter_scale=scale, atomic_inter_shift=shift)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # MACE's buffers take the default dtype
    try:
        model = getattr(modules, cls_name)(**kwargs)
    finally:
        torch.set_default_dtype(previous)
    # random-weight MACE readouts are tiny: enlarge them so interactions matter
    with torch.no_grad():
        for readout in model.readouts:
            for parameter in readout.parameters():
                parameter.mul_(3.0)
    return model.to(dtype)


def _mix_species(atoms: Atoms, seed: int) -> Atoms:
    rng = np.random.default_rng(seed)
    atoms.numbers = rng.choice(ELEMENTS, len(atoms), p=[0.3, 0.5, 0.2])
    atoms.rattle(stdev=0.1, seed=seed)
    return atoms


def bulk_system() -> Atoms:
    """32 atoms, fcc with mixed species, sheared into a triclinic cell."""
    atoms = bulk("Cu", "fcc", a=3.75, cubic=True).repeat(2)
    shear = np.array([[1.0, 0.0, 0.0], [0.08, 1.0, 0.0], [0.05, -0.04, 1.0]])
    atoms.set_cell(atoms.cell.array @ shear, scale_atoms=True)
    return _mix_species(atoms, seed=1)


def slab_system() -> Atoms:
    """fcc(111) slab, periodic in x and y only (vacuum along z)."""
    atoms = fcc111("Cu", size=(2, 3, 3), a=3.75, vacuum=5.0)
    atoms.pbc = (True, True, False)
    return _mix_species(atoms, seed=2)


def cluster_system() -> Atoms:
    """A 55-atom icosahedral cluster, no cell, no periodicity."""
    atoms = Icosahedron("Cu", noshells=3, latticeconstant=3.75)
    atoms.cell = np.zeros((3, 3))
    atoms.pbc = False
    return _mix_species(atoms, seed=3)


SYSTEMS = {"bulk": bulk_system, "slab": slab_system, "cluster": cluster_system}


def save_model(model: torch.nn.Module, path) -> str:
    torch.save(model, str(path))
    return str(path)


def mace_reference(path: str, atoms: Atoms, dtype: str = "float64", **kwargs) -> dict:
    """``MACECalculator`` results on a copy of ``atoms``.

    MACE replaces the cell vector of a non-periodic axis by a huge one, so its
    stress of a slab is divided by a different volume than ASE's cell volume.
    The stress reference of a cell with a non-periodic axis is therefore MACE's
    stress of the same cell made periodic, which is the same physics when the
    vacuum is wider than ``r_max`` (checked here: the energies agree).
    """
    atoms = atoms.copy()
    atoms.calc = MACECalculator(model_paths=path, device="cpu", default_dtype=dtype, **kwargs)
    out = {
        "energy": np.asarray(atoms.get_potential_energy()),
        "energies": atoms.get_potential_energies(),
        "forces": atoms.get_forces(),
    }
    if atoms.cell.rank == 3:
        if atoms.pbc.all():
            out["stress"] = atoms.get_stress()
        else:
            periodic = atoms.copy()
            periodic.pbc = True
            periodic.calc = atoms.calc
            np.testing.assert_allclose(
                periodic.get_potential_energies(), out["energies"], rtol=0, atol=1e-12
            )
            out["stress"] = periodic.get_stress()
    return out


def assert_matches(got: dict, ref: dict, rtol: float = RTOL) -> dict:
    errors = relative_errors(got, ref)
    assert all(err <= rtol for err in errors.values()), errors
    return errors


@pytest.fixture(scope="module")
def mace_models(tmp_path_factory):
    """``get(variant) -> (model, path of its .model file)``, built once per module."""
    cache = {}

    def get(variant: str):
        if variant not in cache:
            model = make_mace(variant)
            path = save_model(model, tmp_path_factory.mktemp(variant) / "mace.model")
            cache[variant] = (model, path)
        return cache[variant]

    return get


@pytest.mark.parametrize("system", sorted(SYSTEMS))
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_matches_mace_calculator(variant: str, system: str, mace_models) -> None:
    model, path = mace_models(variant)
    atoms = SYSTEMS[system]()
    reference = mace_reference(path, atoms)

    atoms.calc = ShardedCalculator(MACE(model))
    got = results(atoms)
    assert_matches(got, reference)
    assert ("stress" in got) == (system != "cluster")
    if "stress" in got:
        np.testing.assert_allclose(got["stresses"].sum(axis=0), got["stress"], atol=1e-14)


@pytest.mark.parametrize("head", [None, "pbe"])
def test_energy_call_leaves_what_mace_calculator_leaves(head, tmp_path) -> None:
    """After ``get_potential_energy``, every key MACECalculator fills (node_energy: the
    per-atom energy less its element's E0 of the head), with the same values."""
    model = make_mace("scale_shift", seed=6, heads=["pbe", "Default"])
    path = save_model(model, tmp_path / "heads.model")
    atoms, reference = bulk_system(), bulk_system()
    kwargs = {} if head is None else {"head": head}
    reference.calc = MACECalculator(
        model_paths=path, device="cpu", default_dtype="float64", **kwargs
    )
    atoms.calc = calc = ShardedCalculator(MACE(path, head=head))
    reference.get_potential_energy()
    atoms.get_potential_energy()
    expected = set(reference.calc.results)
    assert {"node_energy", "energies", "forces"} <= expected <= set(calc.results)
    assert_matches(calc.results, {k: reference.calc.results[k] for k in expected})
    np.testing.assert_allclose(atoms.calc.get_property("node_energy"), calc.results["node_energy"])


def test_model_file(tmp_path) -> None:
    model = make_mace("scale_shift", seed=4)
    path = save_model(model, tmp_path / "mace.model")
    adapter = MACE(path)
    assert adapter.cutoff == 4.5
    assert adapter.num_layers == 2
    assert adapter.atomic_types == tuple(ELEMENTS)
    assert not adapter.training
    assert next(adapter.parameters()).dtype == torch.float64

    atoms = bulk_system()
    reference = mace_reference(path, atoms)
    atoms.calc = ShardedCalculator(adapter)
    assert_matches(results(atoms), reference)


def test_float32_model_keeps_its_dtype(tmp_path) -> None:
    model = make_mace("scale_shift", dtype=torch.float32, seed=5)
    path = save_model(model, tmp_path / "mace32.model")
    atoms = bulk_system()
    calc = ShardedCalculator(MACE(path))
    assert calc.dtype == torch.float32
    atoms.calc = calc
    got = results(atoms)
    assert_matches(got, mace_reference(path, atoms, dtype="float32"), rtol=1e-5)
    # an explicit float64 evaluation equals MACECalculator promoting the model
    atoms.calc = ShardedCalculator(MACE(path), dtype=torch.float64)
    assert_matches(results(atoms), mace_reference(path, atoms, dtype="float64"))


@pytest.mark.parametrize("head", [None, "pbe", "Default"])
def test_heads(head, tmp_path) -> None:
    model = make_mace("scale_shift", seed=6, heads=["pbe", "Default"])
    path = save_model(model, tmp_path / "heads.model")
    adapter = MACE(path, head=head)
    assert adapter.head == (head or "Default")
    atoms = slab_system()
    kwargs = {} if head is None else {"head": head}
    reference = mace_reference(path, atoms, **kwargs)
    atoms.calc = ShardedCalculator(adapter)
    assert_matches(results(atoms), reference)


def test_rejects_unknown_head_and_models() -> None:
    with pytest.raises(ValueError, match="head"):
        MACE(make_mace("scale_shift", heads=["pbe", "Default"]), head="r2scan")
    with pytest.raises(ValueError, match="none is 'default'"):
        MACE(make_mace("scale_shift", heads=["pbe", "r2scan"]))
    with pytest.raises(TypeError, match="unsupported model class"):
        MACE(torch.nn.Linear(3, 1))


def test_unsupported_element_is_refused() -> None:
    atoms = bulk("Fe", "bcc", a=2.87, cubic=True)
    atoms.calc = ShardedCalculator(MACE(make_mace("scale_shift")))
    with pytest.raises(ValueError, match=r"does not support Fe \(it supports Al, Cu, Ag\)"):
        atoms.get_potential_energy()


def test_imports_without_mace() -> None:
    """``ase_shard.models.mace`` imports without mace; building one says what is missing."""
    code = (
        "import sys\n"
        "sys.modules['mace'] = None\n"
        "from ase_shard.models.mace import MACE\n"
        "try:\n"
        "    MACE('missing.model')\n"
        "except ImportError as exc:\n"
        "    assert 'mace-torch' in str(exc), exc\n"
        "else:\n"
        "    raise SystemExit('no ImportError')\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu(tmp_path) -> None:
    model = make_mace("scale_shift", seed=7)
    path = save_model(model, tmp_path / "mace.model")
    atoms = bulk_system()
    reference = mace_reference(path, atoms)
    atoms.calc = ShardedCalculator(MACE(path), device="cuda")
    assert_matches(results(atoms), reference, rtol=1e-9)


def test_planned_peak_memory_per_rank(tmp_path) -> None:
    """The plan of a random-weight MACE (2 layers, 32 channels, 5 Å) on 256 Cu atoms
    and 2 ranks, atoms distributed, against the run (tests/test_plan_launch.py)."""
    from test_plan_launch import assert_planned_memory

    assert_planned_memory("mace", 256, 2, "distributed", tmp_path)
