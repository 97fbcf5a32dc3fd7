"""Orb-v3 adapter in one process: orb's own ASE calculator (ORBCalculator) as the oracle.

The tiny models are Orb-v3's conservative and direct architectures (orb's own builders,
``orb_v3_conservative_architecture`` and ``orb_v3_direct_architecture``) with random
weights (seeded) and small sizes, in float64 on both sides. Their graph radius is 4 Å,
shorter than the 6 Å that orb's Bessel basis and attention envelope are built for (fixed
in orb's builder): edge features do not vanish at the radius, which changes nothing in
a comparison on one structure but keeps the halo of the sharded tests small.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("orb_models")

from ase import Atoms  # noqa: E402
from ase.build import bulk, fcc111, molecule  # noqa: E402
from ase.calculators.calculator import PropertyNotImplementedError  # noqa: E402
from oracles import ase_results, relative_errors  # noqa: E402

from ase_shard import ShardedCalculator  # noqa: E402
from ase_shard.models import Orb  # noqa: E402
from ase_shard.models.orb import architecture_of, capped_edges  # noqa: E402

RTOL64 = 1e-10


def _tiny(architecture: str, seed: int, steps: int, cap: int, radius: float, **options):
    """Orb-v3's ``architecture`` ("conservative" or "direct"), small, random weights."""
    from orb_models.forcefield import pretrained
    from orb_models.forcefield.atomic_system import SystemConfig

    torch.manual_seed(seed)
    return getattr(pretrained, f"orb_v3_{architecture}_architecture")(
        latent_dim=16,
        base_mlp_hidden_dim=16,
        base_mlp_depth=1,
        head_mlp_hidden_dim=16,
        head_mlp_depth=1,
        num_message_passing_steps=steps,
        system_config=SystemConfig(radius=radius, max_num_neighbors=cap),
        device="cpu",
        **options,
    )


def tiny_orb(
    seed: int = 0, steps: int = 2, cap: int = 120, radius: float = 4.0, **options
) -> torch.nn.Module:
    """Orb-v3's conservative architecture, small and with random weights."""
    return _tiny("conservative", seed, steps, cap, radius, **options)


def tiny_direct(
    seed: int = 0, steps: int = 2, cap: int = 120, radius: float = 4.0
) -> torch.nn.Module:
    """Orb-v3's direct architecture, small and with random weights; its force and stress
    heads' normalisers are not the identity (orb denormalises after removing the mean
    force and the net torque)."""
    network = _tiny("direct", seed, steps, cap, radius)
    forces, stress = network.heads["forces"], network.heads["stress"]
    for normalizer, mean, std in (
        (forces.normalizer, 0.05, 0.3),
        (stress.diag_normalizer, -0.02, 0.4),
        (stress.offdiag_normalizer, 0.01, 0.2),
    ):
        normalizer.bn.running_mean.fill_(mean)
        normalizer.bn.running_var.fill_(std**2)
    return network


def orb_calculator(network: torch.nn.Module):
    """orb's own ASE calculator, its graph and features in the network's dtype.

    orb builds its graph and features in torch's default dtype (and its ZBL term
    forms ``14.3996 * Z_u * Z_v`` in it): float64 while a float64 network runs.
    """
    from orb_models.forcefield.calculator import ORBCalculator

    dtype = next(network.parameters()).dtype

    class Calculator(ORBCalculator):
        def calculate(self, atoms=None, properties=None, system_changes=None):
            saved = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                super().calculate(atoms, properties, system_changes)
            finally:
                torch.set_default_dtype(saved)

    return Calculator(network, device="cpu")


def orb_results(network: torch.nn.Module, atoms: Atoms) -> dict[str, np.ndarray]:
    """Energy, forces and (rank-3 cells) stress from orb's calculator.

    orb refuses mixed periodicity: a (T, T, F) slab is given to it fully periodic,
    the same graph when its vacuum is wider than the radius (checked).
    """
    atoms = atoms.copy()
    if atoms.pbc.any() and not atoms.pbc.all():
        gaps = atoms.cell.lengths()[~atoms.pbc] - np.ptp(atoms.positions, axis=0)[~atoms.pbc]
        assert (gaps > network.system_config.radius).all()
        atoms.pbc = True
    atoms.calc = orb_calculator(network)
    ref = {"energy": np.asarray(atoms.get_potential_energy()), "forces": atoms.get_forces()}
    if atoms.cell.rank == 3:
        ref["stress"] = atoms.get_stress()
    return ref


def orb_systems() -> dict[str, Atoms]:
    """The SevenNet tests' Cu/Ag/Au triclinic bulk, (T, T, F) slab and cluster (the same
    structures: sevenn need not be installed here), and ethanol."""
    rng = np.random.default_rng(7)
    crystal = bulk("Cu", "fcc", a=3.7).repeat((2, 2, 2))  # 8 atoms, triclinic cell
    crystal.numbers[[1, 4]] = [47, 79]
    crystal.rattle(0.1, seed=1)
    slab = fcc111("Ag", size=(2, 2, 3), vacuum=5.0, a=4.0)  # pbc (T, T, F)
    slab.numbers[[0, 5, 9]] = [29, 79, 29]
    slab.rattle(0.1, seed=2)
    cluster = bulk("Au", "fcc", a=4.0, cubic=True).repeat((2, 2, 1))
    cluster.numbers[rng.choice(len(cluster), 6, replace=False)] = [29, 29, 47, 47, 29, 47]
    cluster.rattle(0.1, seed=3)
    cluster.pbc = False
    cluster.cell = np.zeros((3, 3))
    systems = {"bulk": crystal, "slab": slab, "cluster": cluster}
    ethanol = molecule("CH3CH2OH")
    ethanol.center(vacuum=4.0)
    ethanol.pbc = False
    systems["molecule"] = ethanol
    return systems


@pytest.fixture(scope="module")
def tiny64():
    return tiny_orb().double()


@pytest.fixture(scope="module")
def direct64():
    return tiny_direct().double()


@pytest.fixture(scope="module")
def capped64():
    """At most 6 neighbours: fewer than the 12 nearest of the fcc systems, so the cap
    drops edges and the graph is not symmetric."""
    return tiny_orb(seed=1, cap=6).double()


def test_attributes(tiny64) -> None:
    model = Orb(tiny64)
    assert (model.cutoff, model.max_num_neighbors) == (4.0, 120)
    # messages flow both ways along an edge: one hop more than orb's 2 steps
    assert (model.message_passing_steps, model.num_layers) == (2, 3)
    assert tuple(model.atomic_types) == tuple(range(1, 118))
    assert Orb(tiny64, max_num_neighbors=20, radius=3.5).max_num_neighbors == 20


def test_refusals() -> None:
    direct = tiny_direct(steps=1)
    direct.heads["dipole"] = torch.nn.Linear(16, 3)
    with pytest.raises(NotImplementedError, match="direct head 'dipole'"):
        Orb(direct)
    with pytest.raises(NotImplementedError, match="charge and spin"):
        Orb(tiny_orb(steps=1, has_charge_spin_cond=True))
    with pytest.raises(ValueError, match="neither a checkpoint file nor a pretrained name"):
        Orb("orb-v9")
    with pytest.raises(TypeError, match="Orb expects"):
        Orb(3)
    with pytest.raises(ValueError, match="cannot tell the Orb architecture"):
        architecture_of("/somewhere/weights.ckpt")
    assert architecture_of("/w/orb-v3-conservative-inf-omat-20250404.ckpt") == (
        "orb-v3-conservative-inf-omat"
    )


def test_compile_is_refused(tiny64, direct64) -> None:
    """torch.compile's padded graphs carry spare owned rows: they would enter the mean."""
    for network in (tiny64, direct64):
        with pytest.raises(ValueError, match="Orb does not run compiled"):
            ShardedCalculator(Orb(network), compile=True)


def test_checkpoint_file_by_its_name(tmp_path, monkeypatch, tiny64) -> None:
    """A weights-only checkpoint loads into the architecture its file name starts with
    (orb's own loader, here with a tiny architecture under a name of its own)."""
    from orb_models.forcefield import pretrained

    def tiny_builder(weights_path, device, precision, compile):
        return pretrained.load_model(
            tiny_orb(seed=5), weights_path, device, precision=precision, compile=compile
        )

    monkeypatch.setitem(pretrained.ORB_PRETRAINED_MODELS, "orb-v3-conservative-tiny", tiny_builder)
    path = tmp_path / "orb-v3-conservative-tiny-20260101.ckpt"
    torch.save(tiny_orb(seed=3).state_dict(), path)
    saved = torch.get_default_dtype()
    model = Orb(path)
    assert torch.get_default_dtype() == saved
    for name, value in tiny_orb(seed=3).state_dict().items():
        assert torch.equal(model.model.state_dict()[name], value), name


def test_cap_keeps_each_centres_nearest() -> None:
    centre = torch.tensor([1, 0, 1, 1, 0, 2])
    lengths = torch.tensor([3.0, 2.0, 1.0, 2.0, 1.0, 5.0])
    assert capped_edges(centre, lengths, 2).tolist() == [1, 2, 3, 4, 5]
    assert capped_edges(centre, lengths, 1).tolist() == [2, 4, 5]


@pytest.mark.parametrize("name", ["bulk", "slab", "cluster", "molecule"])
def test_tiny_float64_matches_orb_calculator(tiny64, name: str) -> None:
    atoms = orb_systems()[name]
    ref = orb_results(tiny64, atoms)
    got = ase_results(ShardedCalculator(Orb(tiny64)), atoms)
    errors = relative_errors(got, ref)
    assert all(err <= RTOL64 for err in errors.values()), errors
    # the adapter's per-atom split adds up to orb's energy
    assert abs(got["energies"].sum() - ref["energy"]) <= RTOL64 * abs(ref["energy"])


@pytest.mark.parametrize("name", ["bulk", "slab", "cluster", "molecule"])
def test_direct_float64_matches_orb_calculator(direct64, name: str) -> None:
    """A direct model's forces and stress are its heads' outputs: the mean force removed,
    and for the cluster (no cell) the net torque; ZBL's own terms added."""
    atoms = orb_systems()[name]
    ref = orb_results(direct64, atoms)
    model = Orb(direct64)
    assert model.predicts_forces and not Orb(tiny_orb(steps=1)).predicts_forces
    calc = ShardedCalculator(model)
    got = ase_results(calc, atoms)
    errors = relative_errors(got, ref)
    assert all(err <= RTOL64 for err in errors.values()), errors
    assert abs(got["energies"].sum() - ref["energy"]) <= RTOL64 * abs(ref["energy"])
    # a predicted stress has no per-atom split
    assert "stresses" not in calc.implemented_properties
    with pytest.raises(PropertyNotImplementedError, match="stresses"):
        calc.get_property("stresses", atoms)


@pytest.mark.parametrize("name", ["bulk", "cluster"])
def test_capped_float64_matches_orb_calculator(capped64, name: str) -> None:
    atoms = orb_systems()[name]
    ref = orb_results(capped64, atoms)
    got = ase_results(ShardedCalculator(Orb(capped64)), atoms)
    errors = relative_errors(got, ref)
    assert all(err <= RTOL64 for err in errors.values()), errors


def test_float32_as_close_as_orbs_own(tiny64) -> None:
    """The model in float32 (ShardedCalculator's dtype): as close to orb's float64
    results as orb's own float32 run is (within a factor 4 and a float32 floor)."""
    atoms = orb_systems()["bulk"]
    exact = orb_results(tiny64, atoms)
    network32 = tiny_orb()
    theirs = relative_errors(orb_results(network32, atoms), exact)
    ours = relative_errors(
        ase_results(ShardedCalculator(Orb(tiny_orb()), dtype="float32"), atoms), exact
    )
    assert all(ours[key] <= max(4 * theirs[key], 1e-5) for key in exact), (ours, theirs)


def test_builder_reaches_pretrained_shapes() -> None:
    """Orb-v3's pretrained conservative builders are the ones the adapter loads."""
    from ase_shard.models.orb import conservative_names

    names = conservative_names()
    assert "orb-v3-conservative-inf-omat" in names and "orb-v3-conservative-20-omat" in names
    assert not any("direct" in name for name in names)


def test_command_line_finds_orb_files_and_names(tmp_path, monkeypatch, capsys) -> None:
    """``--model orb:FILE`` (orb's ``.ckpt`` ending alone means NequIP) and ``orb:NAME``;
    ``info --models`` lists them."""
    from orb_models.forcefield import pretrained

    from ase_shard.cli import main
    from ase_shard.md import build_model
    from ase_shard.presets import CLIError, resolve_model

    def tiny_builder(weights_path, device, precision, compile):
        return pretrained.load_model(
            tiny_orb(), weights_path, device, precision=precision, compile=compile
        )

    monkeypatch.setitem(pretrained.ORB_PRETRAINED_MODELS, "orb-v3-conservative-tiny", tiny_builder)
    path = tmp_path / "orb-v3-conservative-tiny-20260101.ckpt"
    torch.save(tiny_orb().state_dict(), path)
    spec = resolve_model(f"orb:{path}")
    assert (spec.kind, spec.source, spec.argument) == ("orb", str(path), f"orb:{path}")
    model = build_model(spec, None)
    assert isinstance(model, Orb) and model.num_layers == 3
    assert resolve_model(str(path)).kind == "nequip"
    named = resolve_model("orb:orb-v3-conservative-inf-omat")
    assert (named.kind, named.source) == ("orb", "orb-v3-conservative-inf-omat")
    named = resolve_model("orb:orb-v3-direct-20-omat")
    assert (named.kind, named.source) == ("orb", "orb-v3-direct-20-omat")
    with pytest.raises(CLIError, match="nor one of orb's Orb-v3 models"):
        resolve_model("orb:orb-v3-direct-omol")
    assert main(["info", "--models"]) == 0
    assert "orb            orb:FILE.ckpt" in capsys.readouterr().out

    # a direct model's checkpoint, by its file name
    def direct_builder(weights_path, device, precision, compile):
        return pretrained.load_model(
            tiny_direct(), weights_path, device, precision=precision, compile=compile
        )

    monkeypatch.setitem(pretrained.ORB_PRETRAINED_MODELS, "orb-v3-direct-tiny", direct_builder)
    path = tmp_path / "orb-v3-direct-tiny-20260101.ckpt"
    torch.save(tiny_direct(seed=4).state_dict(), path)
    assert build_model(resolve_model(f"orb:{path}"), None).predicts_forces
    assert main(["info", "--model", f"orb:{path}"]) == 0
    assert "forces and stress predicted" in capsys.readouterr().out
