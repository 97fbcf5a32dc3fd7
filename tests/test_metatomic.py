"""metatomic adapter (serial): ``ShardedCalculator(Metatomic(...))`` equals metatomic's own
ASE calculator (``metatomic_ase.MetatomicCalculator``) on the same exported model.

The models are small random-weight message-passing networks exported with metatomic's
own API (``tests/metatomic_models.py``) in float64: full and half neighbour lists, and
two lists of different cutoffs, given the graph as it is or unfolded into periodic
images; and metatrain's PET (PET-MAD's architecture, ``tests/pet_models.py``), which
computes from positions, exported with ``PET.export``. Results must agree to 1e-10
relative.
"""

from __future__ import annotations

import functools
import math
import warnings

import numpy as np
import pytest

pytest.importorskip("metatomic.torch")
pytest.importorskip("metatomic_ase")

import torch  # noqa: E402
from ase import Atoms  # noqa: E402
from ase.build import bulk  # noqa: E402
from metatomic_models import PositionsModel, tiny_metatomic  # noqa: E402
from oracles import ase_results, rel_err, relative_errors  # noqa: E402
from pet_models import REACH, tiny_pet  # noqa: E402
from sync_count import split_reuse_step  # noqa: E402
from systems import ag_slab, au_cluster  # noqa: E402

from ase_shard import ShardedCalculator  # noqa: E402
from ase_shard.graph import LocalGraph  # noqa: E402
from ase_shard.models.metatomic import Metatomic  # noqa: E402

RTOL64 = 1e-10

# name -> arguments of tiny_metatomic
MODELS = {
    # two message-passing layers over one full list: interaction_range 6 Å
    "full": dict(mp_cutoff=3.0, mp_full=True),
    # the same over a half list
    "half": dict(mp_cutoff=3.0, mp_full=False),
    # one layer over a half list
    "half1": dict(mp_cutoff=3.0, mp_full=False, layers=1),
    # two layers over a 2.7 Å full list and a pair term over a 5.4 Å full list:
    # interaction_range 5.4 Å is one 5.4 Å cutoff but two hops of the short list
    "mixed": dict(mp_cutoff=2.7, mp_full=True, pair_cutoff=5.4, pair_full=True),
    # the same with a half list for the pair term
    "mixed_half": dict(mp_cutoff=2.7, mp_full=True, pair_cutoff=5.4, pair_full=False),
}


def reference_results(model, atoms: Atoms, **kwargs) -> dict[str, np.ndarray]:
    """What metatomic's own ASE calculator (the oracle) gives for ``atoms``."""
    from metatomic_ase import MetatomicCalculator

    with warnings.catch_warnings():
        # metatomic_ase warns that a slab's stress is "likely to be wrong": it is the
        # strain derivative over the cell volume, as ShardedCalculator's
        warnings.filterwarnings("ignore", message="stress requested but likely")
        return ase_results(MetatomicCalculator(model, **kwargs), atoms)


def tiny_systems() -> dict[str, Atoms]:
    """Small Cu/Ag/Au systems: periodic bulk, a general triclinic cell, a (T, T, F)
    slab and a non-periodic molecule-like cluster (cell all zero); fresh copies."""
    return {name: atoms.copy() for name, atoms in _tiny_systems().items()}


@functools.cache
def _tiny_systems() -> dict[str, Atoms]:
    # built once: placing the triclinic cell's atoms by rejection takes seconds
    bulk_atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((2, 2, 1))  # 16 atoms
    bulk_atoms.numbers[[1, 6, 11]] = [47, 79, 47]
    bulk_atoms.rattle(0.1, seed=1)

    rng = np.random.default_rng(4)
    cell = np.array([[5.2, 0.0, 0.0], [1.9, 4.8, 0.0], [-1.1, 1.4, 5.0]])
    triclinic = Atoms(cell=cell, pbc=True)
    while len(triclinic) < 10:  # no two atoms (or images) closer than 2 Å
        trial = triclinic + Atoms("Cu", positions=[rng.uniform(0.0, 1.0, 3) @ cell])
        if len(trial) == 1 or trial.get_distances(-1, range(len(trial) - 1), mic=True).min() > 2:
            triclinic = trial
    triclinic.numbers = rng.choice([29, 47, 79], len(triclinic))

    slab = ag_slab()  # pbc (T, T, F)
    cluster = au_cluster(rng)
    return {"bulk": bulk_atoms, "triclinic": triclinic, "slab": slab, "molecule": cluster}


@pytest.fixture(scope="module")
def models():
    return {name: tiny_metatomic(**arguments) for name, arguments in MODELS.items()}


def test_adapter_attributes(models) -> None:
    full = Metatomic(models["full"])
    assert full.cutoff == 3.0 and full.num_layers == 2
    assert tuple(full.atomic_types) == (29, 47, 79)
    assert full.energy_output == "energy" and full.dtype == torch.float64
    assert not full.unfold  # it computes from the neighbour-list vectors
    assert not full.training and not full.model.training
    # the halo of the largest cutoff, as many times as the shortest list's hops need
    mixed = Metatomic(models["mixed"])
    assert mixed.cutoff == 5.4 and mixed.num_layers == 2
    assert mixed.cutoff * mixed.num_layers >= mixed.interaction_range == 5.4


@pytest.mark.parametrize("unfold", [False, True])
@pytest.mark.parametrize("system", ["bulk", "triclinic", "slab", "molecule"])
@pytest.mark.parametrize("name", list(MODELS))
def test_matches_metatomic_calculator(models, name: str, system: str, unfold: bool) -> None:
    """The graph as it is, and unfolded into periodic images (what a model that reads
    positions gets): one list or two, full or half."""
    atoms = tiny_systems()[system]
    ref = reference_results(models[name], atoms)
    got = ase_results(ShardedCalculator(Metatomic(models[name], unfold=unfold)), atoms)
    assert set(got) == set(ref)
    errors = relative_errors(got, ref)
    assert max(errors.values()) <= RTOL64, errors
    # nothing is zero by accident
    assert np.abs(ref["forces"]).max() > 1e-2
    assert system == "molecule" or np.abs(ref["stress"][3:]).max() > 1e-4


def test_exported_file_and_scripted_model(models, tmp_path) -> None:
    """A saved export (loaded by path) and its TorchScript module (torch.jit.load) give
    the Python model's results."""
    path = tmp_path / "tiny.pt"
    models["half"].save(str(path))
    atoms = tiny_systems()["triclinic"]
    ref = reference_results(models["half"], atoms)
    for model in (Metatomic(path), Metatomic(str(path)), Metatomic(torch.jit.load(str(path)))):
        got = ase_results(ShardedCalculator(model), atoms)
        errors = relative_errors(got, ref)
        assert max(errors.values()) <= RTOL64, errors


def test_variant() -> None:
    model = tiny_metatomic(variants=("pbe",))
    atoms = tiny_systems()["bulk"]
    adapter = Metatomic(model, variant="pbe")
    assert adapter.energy_output == "energy/pbe"
    ref = reference_results(model, atoms, variants={"energy": "pbe"})
    got = ase_results(ShardedCalculator(adapter), atoms)
    errors = relative_errors(got, ref)
    assert max(errors.values()) <= RTOL64, errors
    default = ase_results(ShardedCalculator(Metatomic(model)), atoms)
    assert np.isclose(got["energy"], 1.25 * default["energy"], rtol=1e-12)
    with pytest.raises(ValueError, match="variant 'r2scan'"):
        Metatomic(model, variant="r2scan")


def test_pairs_are_listed_once() -> None:
    """An edge and its exact reverse are one pair (labels +k and -k; an atom and its own
    image too); an edge to a node whose own edges are not listed gets its reverse in a
    full list; a half list has one edge per pair."""
    adapter = Metatomic(tiny_metatomic())
    v = torch.tensor(
        [[1.0, 0.5, 0.0], [-1.0, -0.5, 0.0], [0.0, -2.9, 0.0], [0.0, 2.9, 0.0], [0.3, 1.1, 2.0]],
        dtype=torch.float64,
    )
    graph = LocalGraph(
        numbers=torch.tensor([29, 47, 79]),
        edge_index=torch.tensor([[0, 1, 0, 0, 1], [1, 0, 0, 0, 2]]),
        edge_vectors=v,
        n_owned=2,
    )
    pairs = adapter._pairs(graph)
    labels = pairs.shifts[:, 0].tolist()
    assert not pairs.shifts[:, 1:].any()  # labels (k, 0, 0), not images
    assert labels[0] == -labels[1] > 0 and labels[3] == -labels[2] > 0 and labels[4] > 0
    assert len({abs(label) for label in labels}) == 3
    assert pairs.half.tolist() == [True, False, False, True, True]
    assert pairs.one_way.tolist() == [False] * 4 + [True] and not pairs.unpaired.any()
    full = adapter._neighbor_list(pairs, 3.0, True)
    half = adapter._neighbor_list(pairs, 2.5, False)
    assert full.values.shape == (6, 3, 1) and half.values.shape == (2, 3, 1)
    assert full.samples.values[5].tolist() == [2, 1, -labels[4], 0, 0]
    assert torch.equal(full.values[5, :, 0], -v[4])
    assert half.samples.values[:, 2].tolist() == [labels[0], labels[4]]  # 2.9 Å left out


def test_half_list_refuses_unpaired_edges() -> None:
    """Between two nodes whose edges are listed, an edge whose reverse is not listed
    (it goes to another node: a ghost next to a periodic image of an owned atom)
    cannot be put in a half list."""
    adapter = Metatomic(tiny_metatomic(mp_full=False))
    v = torch.tensor([[1.0, 0.5, 0.0], [-1.0, 0.5, 0.0]], dtype=torch.float64)
    graph = LocalGraph(
        numbers=torch.tensor([29, 47]),
        # 0 -> 1 at v, and 1 -> 0 at another vector (to an image of 0)
        edge_index=torch.tensor([[0, 1], [1, 0]]),
        edge_vectors=v,
        n_owned=1,
    )
    pairs = adapter._pairs(graph)
    assert pairs.unpaired.tolist() == [True, True] and not pairs.one_way.any()
    with pytest.raises(NotImplementedError, match="requests a half neighbour list"):
        adapter._neighbor_list(pairs, 3.0, False)
    assert adapter._neighbor_list(pairs, 3.0, True).values.shape == (2, 3, 1)


def test_edge_vectors_are_not_modified(models) -> None:
    vectors = torch.tensor([[1.0, 0.5, -0.3], [-1.0, -0.5, 0.3]], dtype=torch.float64)
    graph = LocalGraph(
        numbers=torch.tensor([29, 79]),
        edge_index=torch.tensor([[0, 1], [1, 0]]),
        edge_vectors=vectors.clone().requires_grad_(True),
        n_owned=2,
    )
    energies = Metatomic(models["full"])(graph)
    assert energies.shape == (2,) and energies.dtype == torch.float64
    assert energies.requires_grad
    assert torch.equal(graph.edge_vectors.detach(), vectors)


def test_ghost_rows_are_zero(models) -> None:
    """The owned atoms' energies only (selected_atoms): ghost rows stay zero."""
    vectors = torch.tensor([[1.0, 0.5, -0.3], [-1.0, -0.5, 0.3]], dtype=torch.float64)
    graph = LocalGraph(
        numbers=torch.tensor([29, 79]),
        edge_index=torch.tensor([[0], [1]]),
        edge_vectors=vectors[:1].clone().requires_grad_(True),
        n_owned=1,
    )
    energies = Metatomic(models["full"])(graph)
    assert energies[1] == 0.0 and energies[0] != 0.0


def test_refused_models() -> None:
    with pytest.raises(ValueError, match="interaction_range is infinite"):
        Metatomic(tiny_metatomic(interaction_range=math.inf))
    with pytest.raises(TypeError, match="exported metatomic model"):
        Metatomic(torch.nn.Linear(2, 2))
    with pytest.raises(FileNotFoundError, match="no metatomic model file"):
        Metatomic("/nonexistent/model.pt")


def test_dtype_is_the_declared_one(models) -> None:
    with pytest.raises(ValueError, match="cannot be cast to torch.float32"):
        ShardedCalculator(Metatomic(models["full"]), dtype=torch.float32)
    calc = ShardedCalculator(Metatomic(models["full"]), dtype="float64")
    assert calc.dtype == torch.float64


def test_model_reading_positions_is_unfolded() -> None:
    """A model that computes its vectors from positions, the cell and the cell shifts is
    found out (NaN positions give NaN energies) and gets the graph unfolded into
    periodic images: metatomic's results. Forced onto the graph as it is (NaN
    positions, no gradient through the edge vectors), it is refused, saying why."""
    model = PositionsModel.exported()
    adapter = Metatomic(model)
    assert adapter.unfold
    for system in ("bulk", "slab"):
        atoms = tiny_systems()[system]
        errors = relative_errors(
            ase_results(ShardedCalculator(adapter), atoms), reference_results(model, atoms)
        )
        assert max(errors.values()) <= RTOL64, errors
    atoms = tiny_systems()["bulk"]
    atoms.calc = ShardedCalculator(Metatomic(model, unfold=False))
    with pytest.raises(RuntimeError, match="unfold=True"):
        atoms.get_potential_energy()


# PET, metatrain's architecture (PET-MAD's): residual and feedforward featurizers
PETS = ("residual", "feedforward")


@pytest.fixture(scope="module")
def pets():
    return {featurizer: tiny_pet(featurizer) for featurizer in PETS}


def pet_adapter(model, featurizer: str) -> Metatomic:
    """The adapter with the halo of PET's real reach (``pet_models.REACH``)."""
    return Metatomic(model, interaction_range=REACH[featurizer])


@pytest.mark.parametrize("system", ["bulk", "triclinic", "slab", "molecule"])
@pytest.mark.parametrize("featurizer", PETS)
def test_pet_matches_metatomic_calculator(pets, featurizer: str, system: str) -> None:
    atoms = tiny_systems()[system]
    adapter = pet_adapter(pets[featurizer], featurizer)
    assert adapter.unfold  # PET computes its vectors from the positions
    assert adapter.num_layers == round(REACH[featurizer] / adapter.cutoff)
    ref = reference_results(pets[featurizer], atoms)
    got = ase_results(ShardedCalculator(adapter), atoms)
    assert set(got) == set(ref)
    errors = relative_errors(got, ref)
    assert max(errors.values()) <= RTOL64, errors
    assert np.abs(ref["forces"]).max() > 1e-2
    assert system == "molecule" or np.abs(ref["stress"][3:]).max() > 1e-4


def test_whole_system_is_given_with_its_cell(pets, monkeypatch) -> None:
    """On one rank (no ghosts) a model that reads positions gets the system as
    metatomic's calculator gives it: one node per atom, the atoms' cell on the periodic
    axes the pairs cross (zero rows elsewhere), and each pair's integer cell shift
    placing its second atom at the edge vector from its first."""
    adapter = pet_adapter(pets["residual"], "residual")
    seen = []
    periodic_system = adapter._periodic_system

    def spy(graph):
        system, pairs = periodic_system(graph)
        seen.append((graph.n_atoms, system, pairs))
        return system, pairs

    monkeypatch.setattr(adapter, "_periodic_system", spy)
    for name, pbc in (("triclinic", [1, 1, 1]), ("slab", [1, 1, 0]), ("molecule", [0, 0, 0])):
        atoms = tiny_systems()[name]
        atoms.calc = ShardedCalculator(adapter)
        atoms.get_potential_energy()
        n_nodes, system, pairs = seen[-1]
        assert n_nodes == len(atoms)
        assert system.pbc.tolist() == [bool(axis) for axis in pbc]
        cell = system.cell.detach()
        assert torch.allclose(cell, torch.tensor(atoms.cell.array * np.c_[pbc]), atol=1e-12)
        first, second = pairs.first, pairs.second
        placed = system.positions[second] - system.positions[first]
        placed = placed + pairs.shifts.to(cell.dtype) @ cell
        assert torch.allclose(placed, pairs.vectors, atol=1e-12, rtol=0)
        assert pbc == [0, 0, 0] or pairs.shifts.abs().max() > 0


def test_pet_feedforward_reaches_past_its_interaction_range(pets) -> None:
    """metatrain's PET with the feedforward featurizer declares ``num_gnn_layers *
    cutoff`` but depends on atoms one cutoff further: three ranks' blocks (built in one
    process, so with ghosts) with the halo it declares are off from one rank's, which
    has no ghosts (so REACH is needed, and this test tells when metatrain changes); with
    the residual featurizer the declared range is the reach."""
    atoms = tiny_systems()["triclinic"]
    for featurizer, off in (("feedforward", True), ("residual", False)):
        declared = Metatomic(pets[featurizer])
        assert declared.interaction_range == REACH["residual"]
        whole, _ = split_reuse_step(declared, atoms, 1)
        split, steps = split_reuse_step(declared, atoms, 3)
        assert all(block.n_nodes > block.n_owned for block, _ in steps)
        error = rel_err(split[:, :4], whole[:, :4])  # energies and forces
        assert (error > 1e-8) == off, (featurizer, error)
        if off:
            reach = Metatomic(pets[featurizer], interaction_range=REACH[featurizer])
            split, _ = split_reuse_step(reach, atoms, 3)
            assert rel_err(split[:, :4], whole[:, :4]) <= RTOL64
    with pytest.raises(ValueError, match="shorter than"):
        Metatomic(pets["residual"], interaction_range=REACH["residual"] - 0.1)


def test_cli_interaction_range_sets_the_halo_and_is_recorded(pets, tmp_path, capsys) -> None:
    """``ase-shard md --model metatomic:FILE --interaction-range R`` gives the adapter R
    (its frames hold metatomic's energies), records R, and a restart keeps it and refuses
    another; a range shorter than declared, or for another model, exits 2."""
    from ase.io import read

    from ase_shard.cli import main

    path = tmp_path / "pet.pt"
    pets["feedforward"].save(str(path))
    reach = REACH["feedforward"]
    traj = tmp_path / "run.traj"
    run = ["md", "--system", "cu-bulk", "--size", "2", "--steps", "2", "--interval", "1"]
    model = ["--model", f"metatomic:{path}", "--no-progress"]
    assert main([*run, *model, "--interaction-range", str(reach), "--trajectory", str(traj)]) == 0
    frames = read(traj, ":")
    assert [frame.info["md_interaction_range_A"] for frame in frames] == [reach] * 3
    frame = frames[-1]
    ref = reference_results(pets["feedforward"], frame)
    assert abs(frame.get_potential_energy() - ref["energy"]) <= RTOL64 * abs(ref["energy"])
    assert main(["md", "--restart", str(traj), "--steps", "1", "--no-progress"]) == 0
    assert read(traj, -1).info["md_interaction_range_A"] == reach
    capsys.readouterr()
    for arguments, message in (
        (["--restart", str(traj), "--interaction-range", "9"], "written with --interaction-range"),
        ([*model, "--interaction-range", "3"], "shorter than the 7.2 Å the model declares"),
        (["--model", "emt", "--interaction-range", "9"], "applies to metatomic models, not emt"),
    ):
        assert main(["md", "--steps", "1", *arguments]) == 2
        assert message in capsys.readouterr().err
