"""NequIP and Allegro adapters equal nequip's own ASE calculator (one rank).

Small random-weight models of the real architectures are built here with
nequip's model builders (no weights are downloaded). The helpers are shared
with ``test_sharded_nequip.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

pytest.importorskip("nequip")
pytest.importorskip("allegro")

import torch  # noqa: E402
from ase import Atoms  # noqa: E402
from ase.build import bulk, fcc111  # noqa: E402
from oracles import ase_results, relative_errors  # noqa: E402

from ase_shard import ShardedCalculator  # noqa: E402
from ase_shard.models.nequip import Allegro, NequIP  # noqa: E402

TYPE_NAMES = ["Cu", "Ag", "Au"]
RTOL64 = 1e-10
# float32 models (measured: energy <= 2e-9, per-atom energies <= 3e-8, forces
# and stress <= 6e-7): the sums over edges and atoms run in a different order,
# and with float32 edge vectors those are rounded once more
RTOL32 = {"energy": 1e-7, "energies": 1e-6, "forces": 1e-5, "stress": 1e-5}

_COMMON = {
    "seed": 7,
    "type_names": TYPE_NAMES,
    "r_max": 4.0,
    "avg_num_neighbors": 20.0,
    "per_type_energy_scales": {"Cu": 1.0, "Ag": 1.5, "Au": 2.0},
    "per_type_energy_shifts": {"Cu": -3.0, "Ag": -2.5, "Au": -4.0},
}


@pytest.fixture(autouse=True, scope="module")
def _nequip_default_dtype():
    """nequip's models expect its global state (default dtype float64), which it applies only
    once per process; set it for this module and undo it for later modules."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def _global_state() -> None:
    from nequip.utils.global_state import set_global_state

    set_global_state()


def build_nequip(model_dtype: str = "float64", **overrides):
    """A 2-layer NequIP model (l_max 1, 8 features) with random weights."""
    from nequip.model import NequIPGNNModel

    _global_state()
    kwargs = {
        **_COMMON,
        "model_dtype": model_dtype,
        "num_layers": 2,
        "l_max": 1,
        "num_features": 8,
        "radial_mlp_width": 16,
        **overrides,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return NequIPGNNModel(**kwargs).eval()


def build_allegro(model_dtype: str = "float64", **overrides):
    """A 2-layer Allegro model (l_max 1, spline embedding) with random weights."""
    from allegro.model import AllegroModel

    _global_state()
    kwargs = {
        **_COMMON,
        "model_dtype": model_dtype,
        "l_max": 1,
        "num_layers": 2,
        "num_scalar_features": 8,
        "num_tensor_features": 4,
        "allegro_mlp_hidden_layers_width": 16,
        "readout_mlp_hidden_layers_width": 8,
        "radial_chemical_embed": {
            "_target_": "allegro.nn.TwoBodySplineScalarEmbed",
            "num_splines": 8,
            "spline_span": 6,
        },
        **overrides,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AllegroModel(**kwargs).eval()


BUILDERS = {"nequip": (build_nequip, NequIP), "allegro": (build_allegro, Allegro)}


def nequip_calculator(model):
    """nequip's own ASE calculator on ``model`` (its neighbour list, its autograd)."""
    from nequip.integrations.ase import NequIPCalculator
    from nequip.integrations.utils import basic_transforms

    metadata = model.metadata
    type_names = metadata["type_names"].split(" ")
    transforms = basic_transforms(
        metadata, float(metadata["r_max"]), type_names, {t: t for t in type_names}
    )
    return NequIPCalculator(model, device="cpu", transforms=transforms)


def make_bulk() -> Atoms:
    """32 atoms of fcc Cu with Au substitutions, rattled (periodic, 7.4 Å box)."""
    atoms = bulk("Cu", "fcc", a=3.7, cubic=True).repeat(2)
    atoms.numbers[[1, 6, 11, 17, 22, 30]] = 79
    atoms.rattle(0.1, seed=1)
    return atoms


def make_slab() -> Atoms:
    """Ag(111) 2x2x3 with Cu, vacuum along z: pbc (T, T, F)."""
    atoms = fcc111("Ag", (2, 2, 3), vacuum=5.0)
    atoms.numbers[:3] = 29
    atoms.rattle(0.1, seed=2)
    return atoms


def make_cluster() -> Atoms:
    """32 Au/Ag atoms, no cell, no pbc."""
    atoms = bulk("Au", "fcc", a=4.0, cubic=True).repeat(2)
    atoms.numbers[::3] = 47
    atoms.rattle(0.1, seed=3)
    return Atoms(numbers=atoms.numbers, positions=atoms.positions)


SYSTEMS = {"bulk": make_bulk, "slab": make_slab, "cluster": make_cluster}


def compare(kind: str, system: str, model_dtype: str = "float64", **calc_kwargs):
    """Relative errors of ShardedCalculator(adapter) against NequIPCalculator."""
    build, adapter = BUILDERS[kind]
    atoms = SYSTEMS[system]()
    reference = atoms.copy()
    reference.calc = nequip_calculator(build(model_dtype))
    atoms.calc = ShardedCalculator(adapter(build(model_dtype)), **calc_kwargs)
    return relative_errors(ase_results(atoms.calc, atoms), ase_results(reference.calc, reference))


@pytest.mark.parametrize("system", sorted(SYSTEMS))
@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_matches_nequip_calculator_float64(kind: str, system: str) -> None:
    errors = compare(kind, system)
    assert ("stress" in errors) == (system != "cluster")
    assert all(err <= RTOL64 for err in errors.values()), errors


@pytest.mark.parametrize("edge_dtype", [None, torch.float64], ids=["default", "float64"])
@pytest.mark.parametrize("system", ["bulk", "slab"])
@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_matches_nequip_calculator_float32(kind: str, system: str, edge_dtype) -> None:
    errors = compare(kind, system, "float32", dtype=edge_dtype)
    assert all(err <= RTOL32[key] for key, err in errors.items()), errors


def test_declared_attributes() -> None:
    nequip = NequIP(build_nequip(num_layers=3))
    assert (nequip.cutoff, nequip.num_layers) == (4.0, 3)
    assert nequip.atomic_types == (29, 47, 79)
    assert nequip.dtype == torch.float64
    allegro = Allegro(build_allegro(num_layers=3))
    assert (allegro.cutoff, allegro.num_layers) == (4.0, 1)  # strictly local
    assert NequIP(build_allegro()).num_layers == 1
    # ghost-exchange hooks: NequIP runs with the one-cutoff halo, Allegro needs none
    assert nequip.supports_layer_halo and not allegro.supports_layer_halo
    assert not NequIP(build_nequip(num_layers=1)).supports_layer_halo
    assert ShardedCalculator(nequip).parameters["halo"] == "layer"
    with pytest.raises(ValueError, match="strictly local"):
        Allegro(build_nequip())


def test_filled_hooks_leave_the_model_unchanged_elsewhere() -> None:
    """The adapter fills the model's ghost-exchange hooks in place; nequip's own
    calculator on that model still gives what it gives on an untouched one."""
    wrapped = build_nequip(num_layers=3, convnet_resnet=True)
    NequIP(wrapped)
    NequIP(wrapped)  # a second adapter of the same model
    kinds = {type(m).__name__ for m in wrapped.modules()}
    assert "_GhostExchange" in kinds and "NoOpGhostExchangeModule" not in kinds
    results = []
    for model in (wrapped, build_nequip(num_layers=3, convnet_resnet=True)):
        atoms = make_bulk()
        atoms.calc = nequip_calculator(model)
        results.append(ase_results(atoms.calc, atoms))
    errors = relative_errors(*results)
    assert all(err <= 1e-14 for err in errors.values()), errors


def test_dtype_is_kept_and_device_moves() -> None:
    model = NequIP(build_allegro("float32"))
    model.to(dtype=torch.float64)  # as ShardedCalculator(dtype=float64) does
    assert model.dtype == torch.float32
    dtypes = {p.dtype for p in model.model.parameters()}
    assert torch.float32 in dtypes  # nothing was cast
    model.to("cpu")


def test_type_map_and_unsupported_species() -> None:
    model = build_nequip(
        type_names=["A", "B", "C"],
        per_type_energy_scales={"A": 1.0, "B": 1.5, "C": 2.0},
        per_type_energy_shifts={"A": -3.0, "B": -2.5, "C": -4.0},
    )
    with pytest.raises(ValueError, match="not chemical symbols"):
        NequIP(model)
    adapter = NequIP(model, chemical_species_to_atom_type_map={"Cu": "A", "Au": "C"})
    assert adapter.atomic_types == (29, 79)
    atoms = make_bulk()
    atoms.calc = ShardedCalculator(adapter)
    reference = atoms.copy()
    reference.calc = nequip_calculator(build_nequip())  # same weights, types named Cu Ag Au
    errors = relative_errors(
        ase_results(atoms.calc, atoms), ase_results(reference.calc, reference)
    )
    assert all(err <= RTOL64 for err in errors.values()), errors
    atoms.numbers[0] = 47  # Ag is not mapped
    with pytest.raises(ValueError, match=r"does not support Ag \(it supports Cu, Au\)"):
        atoms.get_potential_energy()


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_per_edge_type_cutoff(kind: str) -> None:
    build, adapter = BUILDERS[kind]
    cutoffs = {"Cu": 3.2, "Ag": {"Cu": 3.0, "Ag": 4.0, "Au": 3.6}, "Au": 3.4}
    atoms = make_bulk()
    atoms.numbers[[2, 9, 25]] = 47
    reference = atoms.copy()
    reference.calc = nequip_calculator(build(per_edge_type_cutoff=cutoffs))
    atoms.calc = ShardedCalculator(adapter(build(per_edge_type_cutoff=cutoffs)))
    errors = relative_errors(
        ase_results(atoms.calc, atoms), ase_results(reference.calc, reference)
    )
    assert all(err <= RTOL64 for err in errors.values()), errors

    # the same edges reach nequip's energy model as in nequip's calculator
    cluster = make_cluster()
    cluster.numbers[[2, 9, 25]] = 29
    wrapped = adapter(build(per_edge_type_cutoff=cutoffs))
    seen = []
    wrapped.energy_model.register_forward_pre_hook(
        lambda module, args: seen.append(args[0]["edge_index"].shape[1])
    )
    cluster.calc = ShardedCalculator(wrapped)
    cluster.get_potential_energy()
    full = {"Cu": dict.fromkeys(TYPE_NAMES, 3.2), "Au": dict.fromkeys(TYPE_NAMES, 3.4)}
    full["Ag"] = cutoffs["Ag"]
    symbols = cluster.get_chemical_symbols()
    distances = cluster.get_all_distances()
    expected = sum(
        0 < distances[i, j] <= full[symbols[i]][symbols[j]]
        for i in range(len(cluster))
        for j in range(len(cluster))
    )
    assert seen == [expected]
    assert expected < ((distances > 0) & (distances < 4.0)).sum()  # some were pruned


def test_imports_without_nequip() -> None:
    code = (
        "import sys\n"
        "for name in ('nequip', 'allegro', 'e3nn'):\n"
        "    sys.modules[name] = None\n"
        "from ase_shard.models.nequip import NequIP, Allegro\n"
        "assert 'nequip' not in [m.split('.')[0] for m in sys.modules if sys.modules[m]]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
