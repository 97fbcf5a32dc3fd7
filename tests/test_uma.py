"""UMA adapter in one process: fairchem's own calculator (FAIRChemCalculator) as the oracle.

The tiny models are UMA's architecture (fairchem's eSCN-MD backbone with a mixture
of linear experts, and its per-dataset energy heads) with random weights (seeded),
saved as fairchem inference checkpoints that both fairchem's predict unit and the
adapter load. fairchem runs them in float64 (``base_precision_dtype``).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("fairchem.core")

from ase import Atoms  # noqa: E402
from ase.build import bulk, fcc111, molecule  # noqa: E402
from oracles import ase_results, relative_errors  # noqa: E402

from ase_shard import ShardedCalculator  # noqa: E402
from ase_shard.models import UMA  # noqa: E402

RTOL64 = 1e-10
DATASETS = ("omat", "omol")
# float32 against float64, relative: round-off floors for the comparison with
# fairchem's own float32 error
F32_RTOL = {"energy": 1e-6, "energies": 1e-6, "forces": 1e-5, "stress": 1e-5}

_TASK = "fairchem.core.units.mlip_unit.mlip_unit.Task"


def tiny_uma_config(heads: str = "moe", **backbone) -> dict:
    """A HydraModel config of UMA's architecture, small: 3.5 Å, 2 blocks, 3 experts."""
    mapping = {name: name for name in DATASETS}
    wrapper = {
        "moe": "fairchem.core.models.uma.escn_moe.DatasetSpecificMoEWrapper",
        "single": "fairchem.core.models.uma.escn_moe.DatasetSpecificSingleHeadWrapper",
    }[heads]
    head = {
        "module": wrapper,
        "head_cls": "fairchem.core.models.uma.escn_md.MLP_EFS_Head",
        "head_kwargs": {"wrap_property": False},
    }
    if heads == "moe":
        head["dataset_mapping"] = mapping
    else:
        head["dataset_names"] = list(DATASETS)
    options = {
        "model": "fairchem.core.models.uma.escn_moe.eSCNMDMoeBackbone",
        "max_num_elements": 100,
        "sphere_channels": 8,
        "hidden_channels": 8,
        "edge_channels": 8,
        "num_distance_basis": 8,
        "lmax": 2,
        "mmax": 2,
        "num_layers": 2,
        "cutoff": 3.5,
        "max_neighbors": 300,
        "otf_graph": True,
        "direct_forces": False,
        "regress_forces": True,
        "regress_stress": True,
        "num_experts": 3,
        "use_composition_embedding": True,
        "chg_spin_emb_type": "rand_emb",
        "dataset_mapping": mapping,
    }
    options.update(backbone)
    return {
        "_target_": "fairchem.core.models.base.HydraModel",
        "model_id": "UMA-tiny-test",
        "pass_through_head_outputs": True,
        "otf_graph": True,
        "backbone": options,
        "heads": {"energyandforcehead": head},
    }


def tiny_uma_tasks(references: torch.Tensor, mean: float = 0.7, rmsd: float = 1.3) -> list:
    """Energy (normalised, with element references), forces and stress tasks per dataset."""

    def normalizer(mean: float) -> dict:
        return {
            "_target_": "fairchem.core.modules.normalization.normalizer.Normalizer",
            "mean": mean,
            "rmsd": rmsd,
        }

    tasks = []
    for name in DATASETS:
        for prop, level, dim in (
            ("energy", "system", [1]),
            ("forces", "atom", [3]),
            ("stress", "system", [1, 9]),
        ):
            task = {
                "_target_": _TASK,
                "name": f"{name}_{prop}",
                "level": level,
                "property": prop,
                "out_spec": {
                    "_target_": "fairchem.core.units.mlip_unit.mlip_unit.OutputSpec",
                    "dim": dim,
                    "dtype": "float32",
                },
                "normalizer": normalizer(mean if prop == "energy" else 0.0),
                "datasets": [name],
            }
            if prop == "energy":
                task["element_references"] = {
                    "_target_": "fairchem.core.modules.normalization.element_references."
                    "ElementReferences",
                    "element_references": references,
                }
            tasks.append(task)
    return tasks


def write_tiny_uma(path: str, seed: int = 0, heads: str = "moe", tasks=None, **backbone) -> str:
    """A fairchem inference checkpoint of a random-weight tiny UMA at ``path``."""
    import hydra
    from fairchem.core.units.mlip_unit.api.inference import MLIPInferenceCheckpoint

    torch.manual_seed(seed)
    config = tiny_uma_config(heads, **backbone)
    model = hydra.utils.instantiate(config)
    references = torch.randn(100, dtype=torch.float64)
    checkpoint = MLIPInferenceCheckpoint(
        model_config=config,
        model_state_dict=model.state_dict(),
        ema_state_dict=torch.optim.swa_utils.AveragedModel(model).state_dict(),
        tasks_config=tiny_uma_tasks(references) if tasks is None else tasks,
    )
    torch.save(checkpoint, path)
    return path


def tiny_uma_file(seed: int = 0, heads: str = "moe", **backbone) -> str:
    """A tiny UMA checkpoint in a fresh directory of this process (no clash between ranks)."""
    directory = tempfile.mkdtemp(prefix="tiny-uma-")
    return write_tiny_uma(os.path.join(directory, "tiny.pt"), seed, heads, **backbone)


def predict_unit(path: str, dtype: torch.dtype = torch.float64):
    """fairchem's predict unit on the CPU, in ``dtype``, unmerged and uncompiled."""
    from fairchem.core.units.mlip_unit import MLIPPredictUnit
    from fairchem.core.units.mlip_unit.api.inference import InferenceSettings

    settings = InferenceSettings(
        merge_mole=False, compile=False, activation_checkpointing=False, base_precision_dtype=dtype
    )
    return MLIPPredictUnit(path, device="cpu", inference_settings=settings)


def fairchem_results(unit, atoms: Atoms, task: str) -> dict[str, np.ndarray]:
    """What FAIRChemCalculator gives, and fairchem's per-atom energies.

    The per-atom energies are the energy MLP's outputs in fairchem's own run
    (caught by a hook), denormalised and referenced as fairchem does the sum.
    """
    from fairchem.core.calculate.ase_calculator import FAIRChemCalculator

    model = unit.model.module
    head = model.output_heads["energyandforcehead"].head
    caught = []
    hook = head.energy_block.register_forward_hook(lambda m, i, out: caught.append(out))
    try:
        atoms = atoms.copy()
        atoms.calc = FAIRChemCalculator(unit, task_name=task)
        out = {
            "energy": np.asarray(atoms.get_potential_energy()),
            "forces": atoms.get_forces(),
        }
        if atoms.cell.rank == 3:
            out["stress"] = atoms.get_stress()
    finally:
        hook.remove()
    energy = model.tasks[f"{task}_energy"]
    node = caught[-1].detach().double().reshape(-1).numpy()
    refs = energy.element_references.element_references.double().numpy()
    mean, rmsd = float(energy.normalizer.mean), float(energy.normalizer.rmsd)
    out["energies"] = node * rmsd + mean / len(atoms) + refs[atoms.numbers]
    return out


def uma_systems() -> dict[str, tuple[Atoms, str]]:
    """Small systems and their task: bulk, a triclinic cell, a slab, a charged molecule."""
    cu = bulk("Cu", "fcc", a=3.7).repeat((2, 2, 2))  # 8 atoms, triclinic
    cu.numbers[[1, 4, 6]] = [47, 8, 47]
    cu.rattle(0.1, seed=1)
    silicon = bulk("Si", "diamond", a=5.43).repeat((2, 1, 1))  # primitive: triclinic
    silicon.numbers[1] = 6
    silicon.rattle(0.05, seed=4)
    slab = fcc111("Ag", size=(2, 2, 3), vacuum=5.0, a=4.0)  # pbc (T, T, F)
    slab.numbers[[0, 5, 9]] = [29, 79, 29]
    slab.rattle(0.1, seed=2)
    ethanol = molecule("CH3CH2OH")
    ethanol.rattle(0.05, seed=5)
    ethanol.info.update(charge=1, spin=2)
    return {
        "bulk": (cu, "omat"),
        "triclinic": (silicon, "omat"),
        "slab": (slab, "omat"),
        "molecule": (ethanol, "omol"),
    }


@pytest.fixture(scope="module")
def tiny_file():
    path = tiny_uma_file()
    yield path
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


@pytest.fixture(scope="module")
def unit64(tiny_file):
    return predict_unit(tiny_file)


@pytest.mark.parametrize("name", ["bulk", "triclinic", "slab", "molecule"])
def test_tiny_float64_matches_fairchem_calculator(tiny_file, unit64, name: str) -> None:
    atoms, task = uma_systems()[name]
    ref = fairchem_results(unit64, atoms, task)
    got = ase_results(ShardedCalculator(UMA(tiny_file, task=task, dtype=torch.float64)), atoms)
    assert set(got) == set(ref)
    errors = relative_errors(got, ref)
    assert all(err <= RTOL64 for err in errors.values()), errors


def test_charge_spin_and_task_select_what_fairchem_does(tiny_file, unit64) -> None:
    """The omol task reads charge and spin (defaults 0 and 1, as fairchem's); omat and
    omol give different energies for the same atoms."""
    atoms, _ = uma_systems()["molecule"]
    neutral = atoms.copy()
    neutral.info.clear()
    energies = {}
    for task, system in (("omol", atoms), ("omol", neutral), ("omat", neutral)):
        ref = fairchem_results(unit64, system, task)
        got = ase_results(
            ShardedCalculator(UMA(tiny_file, task=task, dtype=torch.float64)), system
        )
        errors = relative_errors(got, ref)
        assert all(err <= RTOL64 for err in errors.values()), (task, errors)
        energies[task, len(system.info)] = float(got["energy"])
    assert len(set(energies.values())) == 3, energies


def test_shared_head_and_pos_embedding(tmp_path) -> None:
    """A dataset-shared energy head (DatasetSpecificSingleHeadWrapper) and UMA's
    sinusoidal charge/spin embedding, on the slab."""
    path = write_tiny_uma(
        str(tmp_path / "single.pt"), seed=3, heads="single", chg_spin_emb_type="pos_emb"
    )
    atoms, task = uma_systems()["slab"]
    ref = fairchem_results(predict_unit(path), atoms, task)
    got = ase_results(ShardedCalculator(UMA(path, task=task, dtype=torch.float64)), atoms)
    errors = relative_errors(got, ref)
    assert all(err <= RTOL64 for err in errors.values()), errors


def test_adapter_attributes(tiny_file) -> None:
    model = UMA(tiny_file, task="omat")
    assert (model.cutoff, model.num_layers, model.max_neighbors) == (3.5, 3, 300)
    assert model.atomic_types is None and model.task == "omat" and model.supports_layer_halo
    assert model.system_inputs == ("charge", "spin", "uma_element_counts")
    # fairchem's defaults for charge and spin multiplicity
    assert model.system_input_defaults["spin"](Atoms()) == 0
    assert UMA(tiny_file, task="omol").system_input_defaults["spin"](Atoms()) == 1
    assert next(model.parameters()).dtype == torch.float32


def test_bad_models_are_refused(tmp_path, tiny_file) -> None:
    with pytest.raises(ValueError, match="is not a file"):
        UMA("uma-s-1p1")
    with pytest.raises(TypeError, match="inference checkpoint file or a fairchem HydraModel"):
        UMA(3)
    with pytest.raises(ValueError, match="several tasks"):
        UMA(tiny_file)
    with pytest.raises(ValueError, match="unknown task 'oc20'"):
        UMA(tiny_file, task="oc20")
    direct = write_tiny_uma(str(tmp_path / "direct.pt"), direct_forces=True, regress_stress=False)
    with pytest.raises(ValueError, match="direct-force model"):
        UMA(direct, task="omat")
    balanced = write_tiny_uma(str(tmp_path / "balanced.pt"), charge_balanced_channels=[1, 2])
    with pytest.raises(ValueError, match="balanced channels"):
        UMA(balanced, task="omat")


def test_bad_inputs_are_refused(tmp_path, tiny_file) -> None:
    """Non-integer charge; an atom with more neighbours than max_neighbors (fairchem would
    keep the nearest); the same model with a cap that does not bind matches fairchem."""
    atoms, task = uma_systems()["molecule"]
    atoms = atoms.copy()
    atoms.info["charge"] = 0.5
    atoms.calc = ShardedCalculator(UMA(tiny_file, task=task))
    with pytest.raises(ValueError, match="charge must be one integer"):
        atoms.get_potential_energy()
    capped = write_tiny_uma(str(tmp_path / "capped.pt"), max_neighbors=10)
    crowded, task = uma_systems()["bulk"]  # 12 neighbours within 3.5 Å
    crowded = crowded.copy()
    crowded.calc = ShardedCalculator(UMA(capped, task=task))
    with pytest.raises(ValueError, match="more than the model's max_neighbors=10"):
        crowded.get_potential_energy()
    sparse, task = uma_systems()["molecule"]
    ref = fairchem_results(predict_unit(capped), sparse, task)
    got = ase_results(ShardedCalculator(UMA(capped, task=task, dtype=torch.float64)), sparse)
    errors = relative_errors(got, ref)
    assert all(err <= RTOL64 for err in errors.values()), errors


@pytest.mark.parametrize("name", ["triclinic", "molecule"])
def test_float32_is_as_close_as_fairchems_own(tiny_file, unit64, name: str) -> None:
    """In float32 (fairchem's default precision) the adapter is as close to fairchem's
    float64 run as fairchem's own float32 run is (within a factor 2: float32 round-off
    of different summation orders)."""
    atoms, task = uma_systems()[name]
    exact = fairchem_results(unit64, atoms, task)
    theirs = relative_errors(
        fairchem_results(predict_unit(tiny_file, torch.float32), atoms, task), exact
    )
    ours = relative_errors(ase_results(ShardedCalculator(UMA(tiny_file, task=task)), atoms), exact)
    assert all(ours[key] <= max(2 * theirs[key], F32_RTOL[key]) for key in exact), (ours, theirs)


def test_cli_md_with_a_uma_file_matches_fairchem(tmp_path, unit64, capsys) -> None:
    """``ase-shard md --model uma:FILE --modality TASK``: the first frame's energy and
    forces are fairchem's (float64: the model is built in ``--dtype``, as fairchem builds
    its constant buffers in its precision); without ``--modality`` a two-task model is
    refused."""
    from ase.io import read, write

    from ase_shard.cli import main

    path = tmp_path / "tiny.pt"
    write_tiny_uma(str(path))
    atoms, task = uma_systems()["slab"]
    structure, traj = tmp_path / "slab.extxyz", tmp_path / "out.extxyz"
    write(structure, atoms)
    argv = ["md", str(structure), "--model", f"uma:{path}", "--steps", "1", "--interval", "1"]
    argv += ["--dtype", "float64", "--device", "cpu", "--no-progress"]
    assert main(argv) == 2
    assert "--modality" in capsys.readouterr().err
    assert main([*argv, "--modality", task, "--trajectory", str(traj)]) == 0
    assert "(UMA) on 1 rank(s) (cpu, float64)" in capsys.readouterr().out
    first = read(traj, 0)
    ref = fairchem_results(unit64, first, task)
    assert first.get_potential_energy() == pytest.approx(float(ref["energy"]), rel=1e-10)
    # extxyz keeps forces to 8 decimals
    np.testing.assert_allclose(first.get_forces(), ref["forces"], rtol=0, atol=1e-8)


def test_info_and_check_with_a_uma_file(tmp_path, capsys) -> None:
    """``info --model uma:FILE`` lists the checkpoint's tasks (read by fairchem's own
    loader: ``dataset_to_tasks``), and ``check`` compares with FAIRChemCalculator in
    float64 (exit 0); without ``--modality`` the first task is refused as ambiguous."""
    from ase_shard.cli import main

    path = tmp_path / "tiny.pt"
    write_tiny_uma(str(path))
    unit = predict_unit(str(path))
    tasks = sorted(unit.model.module.dataset_to_tasks)
    assert main(["info", "--model", f"uma:{path}"]) == 0
    line = capsys.readouterr().out
    assert "cutoff " in line and f"heads {', '.join(tasks)}" in line, line
    argv = ["check", "--model", f"uma:{path}", "--dtype", "float64", "--elements", "Cu,O"]
    assert main(argv) == 2
    assert "--modality" in capsys.readouterr().err
    assert main([*argv, "--modality", tasks[0]]) == 0
    out = capsys.readouterr().out
    assert "tolerance 1e-08 (float64): ok" in out, out
