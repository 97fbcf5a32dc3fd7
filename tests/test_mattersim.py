"""MatterSim adapter in one process: mattersim's own calculator as the oracle.

The tiny models are mattersim's M3GNet with random weights (seeded, with random
per-element scales and shifts), small enough for the suite. mattersim's pretrained
checkpoints do not ship in its wheel (it downloads them), so none is tested here.
"""

from __future__ import annotations

import contextlib
import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("mattersim")

from ase import Atoms  # noqa: E402
from ase.build import bulk, fcc111, molecule  # noqa: E402
from oracles import ase_results, evaluate_periodic_graph, relative_errors  # noqa: E402

from ase_shard import ShardedCalculator  # noqa: E402
from ase_shard.models import MatterSim  # noqa: E402

RTOL64 = 1e-10
# float32 against float64, relative: round-off floors for the comparison with mattersim's
# own float32 error
F32_RTOL = {"energy": 1e-6, "energies": 1e-6, "forces": 1e-5, "stress": 1e-5}


def tiny_m3gnet(
    seed: int = 0,
    num_blocks: int = 2,
    units: int = 16,
    max_l: int = 3,
    max_n: int = 3,
    cutoff: float = 4.0,
    threebody_cutoff: float = 3.0,
) -> torch.nn.Module:
    """mattersim's M3GNet with random weights: by default small, with 4 Å two-body and
    3 Å three-body cutoffs, and random per-element scales and shifts (its AtomScaling).
    (MatterSim-v1's sizes are mattersim's defaults: 4 blocks, 128 units, max_l = max_n
    = 4, cutoffs 5 and 4 Å.)"""
    from mattersim.forcefield.m3gnet.m3gnet import M3Gnet

    torch.manual_seed(seed)
    network = M3Gnet(
        num_blocks=num_blocks,
        units=units,
        max_l=max_l,
        max_n=max_n,
        cutoff=cutoff,
        threebody_cutoff=threebody_cutoff,
        device="cpu",
    )
    scaling = network.normalizer
    with torch.no_grad():
        scaling.scale.uniform_(0.5, 1.5)
        scaling.shift.uniform_(-3.0, -1.0)
    return network.eval()


class _Float64Torch:
    """``torch`` for mattersim's graph converter and M3Gnet.forward, in float64.

    ``GraphConvertor`` makes its positions, cell and image offsets with
    ``torch.FloatTensor`` (float32); ``M3Gnet.forward`` casts the offsets to
    float32 again and meets the cell in ``torch.einsum``, which takes one dtype.
    Here ``FloatTensor`` gives float64 and ``einsum`` casts its operands to
    their common dtype (the offsets are integers: exact). Everything else is
    torch.
    """

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def FloatTensor(data) -> torch.Tensor:  # noqa: N802 - torch's name
        return torch.as_tensor(np.asarray(data), dtype=torch.float64)

    @staticmethod
    def einsum(equation: str, *operands: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(*(operand.dtype for operand in operands))
        return torch.einsum(equation, *(operand.to(dtype) for operand in operands))


@contextlib.contextmanager
def _mattersim_float64(network: torch.nn.Module):
    """mattersim's own graph and calculator code in float64 while inside.

    Besides :class:`_Float64Torch`: torch's default dtype is float64 (the strain
    ``Potential.forward`` adds is ``torch.eye`` of it) and the network's one-hot
    atom encoding is cast to float64 (``M3Gnet.one_hot_atoms`` makes it float32;
    0 and 1 are exact). The rest is mattersim's code unchanged.
    """
    import mattersim.datasets.utils.convertor as convertor
    import mattersim.forcefield.m3gnet.m3gnet as m3gnet

    default = torch.get_default_dtype()
    one_hot = network.one_hot_atoms
    try:
        convertor.torch = m3gnet.torch = _Float64Torch()
        torch.set_default_dtype(torch.float64)
        network.one_hot_atoms = lambda species: one_hot(species).double()
        yield
    finally:
        convertor.torch = m3gnet.torch = torch
        torch.set_default_dtype(default)
        del network.one_hot_atoms


def reference_calculator(network: torch.nn.Module):
    """mattersim's own ASE calculator on ``network``, in the network's dtype, keeping
    each calculation's per-atom energies (the AtomScaling's output, before M3Gnet.forward
    sums them) as ``energies``."""
    from mattersim.forcefield.potential import MatterSimCalculator, Potential

    class Reference(MatterSimCalculator):
        implemented_properties = [*MatterSimCalculator.implemented_properties, "energies"]

        def calculate(self, atoms=None, properties=None, system_changes=None):
            kept = []
            scaling = self.potential.model.normalizer
            hook = scaling.register_forward_hook(lambda m, i, out: kept.append(out.detach()))
            float64 = next(network.parameters()).dtype == torch.float64
            try:
                with _mattersim_float64(network) if float64 else contextlib.nullcontext():
                    # mattersim computes every property at once; "energies" is ours
                    wanted = [name for name in properties or [] if name != "energies"]
                    super().calculate(atoms, wanted, system_changes)
            finally:
                hook.remove()
            (energies,) = kept
            self.results["energies"] = energies.double().numpy()

    return Reference(potential=Potential(network, device="cpu"), device="cpu")


def mattersim_results(network, atoms: Atoms) -> dict[str, np.ndarray]:
    """What mattersim's calculator gives, in ASE's units (per-atom energies too)."""
    calc = reference_calculator(network)
    results = ase_results(calc, atoms)
    results["energies"] = np.asarray(calc.results["energies"], dtype=np.float64)
    return results


def mattersim_systems() -> dict[str, Atoms]:
    """A periodic triclinic alloy, a (T, T, F) slab, a cluster without a cell, ethanol
    and a triclinic Si cell: 8-12 atoms each."""
    alloy = bulk("Cu", "fcc", a=3.7).repeat((2, 2, 2))  # 8 atoms, triclinic cell
    alloy.numbers[[1, 4]] = [47, 79]
    alloy.rattle(0.1, seed=1)
    slab = fcc111("Ag", size=(2, 2, 3), vacuum=5.0, a=4.0)
    slab.numbers[[0, 5, 9]] = [29, 79, 29]
    slab.rattle(0.1, seed=2)
    cluster = bulk("Au", "fcc", a=4.0, cubic=True).repeat((2, 2, 1))
    cluster.numbers[[0, 2, 3, 5, 6]] = [29, 29, 47, 47, 29]
    cluster.rattle(0.1, seed=3)
    cluster.pbc = False
    cluster.cell = np.zeros((3, 3))
    ethanol = molecule("CH3CH2OH")
    ethanol.center(vacuum=4.0)
    ethanol.pbc = False
    silicon = bulk("Si", "diamond", a=5.43).repeat((2, 2, 1))  # primitive: triclinic
    silicon.rattle(0.05, seed=4)
    return {
        "bulk": alloy,
        "slab": slab,
        "cluster": cluster,
        "molecule": ethanol,
        "triclinic": silicon,
    }


@pytest.fixture(scope="module")
def tiny64():
    return tiny_m3gnet().double()


@pytest.mark.parametrize("name", ["bulk", "triclinic", "slab", "molecule", "cluster"])
def test_tiny_float64_matches_mattersim_calculator(tiny64, name: str) -> None:
    atoms = mattersim_systems()[name]
    ref = mattersim_results(tiny64, atoms)
    got = ase_results(ShardedCalculator(MatterSim(tiny64)), atoms)
    assert set(got) == set(ref)
    if not atoms.pbc.any():
        # mattersim puts a system without periodic axes into a cubic box of its own
        # (GraphConvertor.convert) and divides the virial by that box's volume
        ref.pop("stress", None)
    errors = relative_errors(got, ref)
    assert all(err <= RTOL64 for err in errors.values()), errors


@pytest.mark.parametrize("name", ["bulk", "cluster"])
def test_graph_without_hop_counts(tiny64, name: str) -> None:
    """A graph built by hand (no ``hops``: every node and edge computed, every row read
    out) gives mattersim's energies, per-atom energies and forces too."""
    atoms = mattersim_systems()[name]
    ref = mattersim_results(tiny64, atoms)
    got = evaluate_periodic_graph(MatterSim(tiny64), atoms)
    errors = relative_errors(got, {key: ref[key] for key in ("energy", "energies", "forces")})
    assert all(err <= RTOL64 for err in errors.values()), errors


def test_adapter_attributes(tiny64) -> None:
    model = MatterSim(tiny64)
    assert (model.cutoff, model.threebody_cutoff, model.num_layers) == (4.0, 3.0, 2)
    assert tuple(model.atomic_types) == tuple(range(1, 95))
    assert model.supports_layer_halo is False
    assert model.model is tiny64


def test_bad_models_are_refused(tmp_path, monkeypatch) -> None:
    from mattersim.forcefield.m3gnet.m3gnet import M3Gnet
    from mattersim.forcefield.potential import Potential

    monkeypatch.setenv("HOME", str(tmp_path))  # no downloaded checkpoints there
    with pytest.raises(FileNotFoundError, match="mattersim-1m.*not downloaded"):
        MatterSim("mattersim-1m")
    with pytest.raises(ValueError, match="neither a pretrained name"):
        MatterSim(str(tmp_path / "missing.pth"))
    with pytest.raises(TypeError, match="MatterSim expects a checkpoint file"):
        MatterSim(3)
    inverted = M3Gnet(num_blocks=1, units=8, cutoff=3.0, threebody_cutoff=4.0, device="cpu")
    with pytest.raises(ValueError, match="three-body cutoff .* exceeds"):
        MatterSim(inverted)
    other = Potential(inverted, device="cpu", model_name="graphormer")
    with pytest.raises(ValueError, match="only M3GNet potentials"):
        MatterSim(other)


@pytest.mark.parametrize("name", ["bulk", "slab", "molecule"])
def test_three_body_rows_are_mattersims(name: str) -> None:
    """The angles built from edges are mattersim's converter's (on the converter's own
    edges: one node per atom, every edge of every atom listed)."""
    from mattersim.datasets.utils.convertor import GraphConvertor

    from ase_shard.models.mattersim import three_body_rows

    data = GraphConvertor("m3gnet", 4.0, True, 3.0).convert(mattersim_systems()[name].copy())
    centre, neighbour = data.edge_index
    positions, cell = data.atom_pos.double(), data.cell[0].double()
    vectors = positions[neighbour] + data.pbc_offsets.double() @ cell - positions[centre]
    lengths = torch.linalg.vector_norm(vectors, dim=1)
    ij, ik = three_body_rows(centre, lengths, 3.0, len(positions))
    mine = set(zip(ij.tolist(), ik.tolist(), strict=True))
    theirs = {tuple(row) for row in data.three_body_indices.tolist()}
    assert len(mine) == len(ij) > 0
    assert mine == theirs


def test_checkpoint_file_and_pretrained_name(tiny64, tmp_path, monkeypatch) -> None:
    """A checkpoint saved by mattersim's Potential.save loads by path, and by the
    pretrained name once it lies where mattersim keeps its downloads."""
    from mattersim.forcefield.potential import Potential

    from ase_shard.presets import mattersim_checkpoint

    monkeypatch.setenv("HOME", str(tmp_path))
    path = mattersim_checkpoint("mattersim-5m")
    Potential(tiny_m3gnet(), device="cpu").save(str(path))
    atoms = mattersim_systems()["bulk"]
    ref = ase_results(ShardedCalculator(MatterSim(tiny64)), atoms)
    for model in (str(path), "MatterSim-v1.0.0-5M", "mattersim-5m"):
        got = ase_results(ShardedCalculator(MatterSim(model), dtype="float64"), atoms)
        errors = relative_errors(got, ref)
        assert all(err == 0.0 for err in errors.values()), (model, errors)


@pytest.mark.parametrize("name", ["triclinic", "molecule"])
def test_float32_is_as_close_as_mattersims_own(name: str) -> None:
    """In float32 (as mattersim runs): the adapter is as close to mattersim's calculator
    on the same weights in float64 as mattersim's own float32 run is (within a factor 2,
    or the float32 floors: measured on the Si cell, forces 4.1e-6 against mattersim's
    5.3e-6, stress 1.9e-6 against 1.9e-6)."""
    network = tiny_m3gnet()
    atoms = mattersim_systems()[name]
    exact = mattersim_results(copy.deepcopy(network).double(), atoms)
    theirs = relative_errors(mattersim_results(network, atoms), exact)
    got = ase_results(ShardedCalculator(MatterSim(network), dtype="float32"), atoms)
    if not atoms.pbc.any():
        exact.pop("stress", None)  # mattersim's own box (see above)
    ours = relative_errors(got, exact)
    assert all(ours[key] <= max(2 * theirs[key], F32_RTOL[key]) for key in exact), (ours, theirs)


def test_command_line_names(tmp_path, monkeypatch) -> None:
    """``--model mattersim:FILE`` and the pretrained names once downloaded."""
    from ase_shard.presets import CLIError, mattersim_checkpoint, resolve_model, same_model

    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(CLIError, match="not downloaded here.*mattersim:FILE"):
        resolve_model("mattersim-1m")
    with pytest.raises(CLIError, match="no MatterSim checkpoint file at"):
        resolve_model("mattersim:" + str(tmp_path / "missing.pth"))
    path = mattersim_checkpoint("mattersim-1m")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"")
    by_name = resolve_model("MatterSim-1M")
    by_file = resolve_model(f"mattersim:{path}")
    assert (by_name.kind, by_name.source) == ("mattersim", str(path))
    assert by_name.argument == "mattersim-1m"
    assert (by_file.kind, by_file.argument) == ("mattersim", f"mattersim:{path}")
    assert same_model(by_name, by_file)
    assert same_model(resolve_model(by_file.argument), by_file)
    assert resolve_model(str(path)).kind == "sevenn"  # a bare .pth stays SevenNet's
