"""SevenNet adapter (serial): ``ShardedCalculator(SevenNet(...))`` equals SevenNet's own
ASE calculator on the same weights.

A tiny random-weight SevenNet of the real architecture runs in float64 and must agree
to 1e-10; the pretrained 7net-0 (float32, shipped inside the ``sevenn`` wheel) agrees
to float32 round-off, asserted with ``F32_RTOL``.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("sevenn")

import torch  # noqa: E402
from ase import Atoms  # noqa: E402
from ase.build import bulk  # noqa: E402
from oracles import ase_results, relative_errors  # noqa: E402
from systems import ag_slab, au_cluster  # noqa: E402

from ase_shard import ShardedCalculator  # noqa: E402
from ase_shard.models.sevenn import SevenNet  # noqa: E402

warnings.filterwarnings("ignore", message="No tensor product accelerator")

RTOL64 = 1e-10
# 7net-0 is float32: both calculators sum per-edge float32 terms in a different order
# (different neighbour lists, explicit ghost rows here); measured errors are ~1e-8
# (energy) and ~5e-7 (forces, stress), relative to the largest component
F32_RTOL = {"energy": 1e-6, "energies": 5e-6, "forces": 5e-6, "stress": 5e-6}
SPECIES = ["Ag", "Au", "Cu"]


def tiny_sevennet(seed: int = 0, cutoff: float = 3.5, num_layers: int = 2, channels: int = 8):
    """A random-weight SevenNet (real architecture, ``lmax`` 2) in float64.

    ``channels`` is the node feature multiplicity and the width of the radial
    weight network; the tests use the small default, ``scripts/adapter_speed.py``
    a realistic size.
    """
    import sevenn._keys as KEY

    from ase_shard.random_models import random_sevennet_network

    model = random_sevennet_network(
        SPECIES,
        cutoff=cutoff,
        channels=channels,
        num_layers=num_layers,
        seed=seed,
        config={
            KEY.CONVOLUTION_WEIGHT_NN_HIDDEN_NEURONS: [channels, channels],
            KEY.CONV_DENOMINATOR: 8.0,
            KEY.SHIFT: [-2.5, -3.1, -3.7],  # eV per atom, per species (sorted symbols)
            KEY.SCALE: [1.3, 0.7, 1.9],
        },
    )
    with torch.no_grad():  # random, not zero, shift/scale and denominator
        for param in model.parameters():
            if param.numel() and param.dim() == 1 and param.numel() <= 3:
                param.add_(0.1 * torch.rand_like(param))
    return model.double()


@contextlib.contextmanager
def _float64_onehot():
    """sevenn's ``OnehotEmbedding`` returns float32 whatever the model dtype; patch it to
    return float64 (the only change SevenNet needs to run in float64)."""
    from sevenn.nn.node_embedding import OnehotEmbedding

    original = OnehotEmbedding.forward

    def forward(self, data):
        data = original(self, data)
        for key in (self.key_output, self.key_additional_output):
            if key is not None and data[key].is_floating_point():
                data[key] = data[key].to(torch.float64)
        return data

    OnehotEmbedding.forward = forward
    try:
        yield
    finally:
        OnehotEmbedding.forward = original


def reference_calculator(model):
    """SevenNet's own ASE calculator; float64 input when the model is float64."""
    import sevenn.util
    from sevenn.atom_graph_data import AtomGraphData
    from sevenn.calculator import SevenNetCalculator
    from sevenn.train.dataload import unlabeled_atoms_to_graph

    class Float64SevenNetCalculator(SevenNetCalculator):
        # SevenNetCalculator.calculate casts its input to float32; this is the same
        # steps with float64 tensors
        def calculate(self, atoms=None, properties=None, system_changes=None):
            SevenNetCalculator.__base__.calculate(self, atoms, properties, system_changes)
            graph = unlabeled_atoms_to_graph(atoms, self.cutoff, with_shift=False)
            data = AtomGraphData(
                **{k: sevenn.util.dtype_correct(v, torch.float64) for k, v in graph.items()}
            )
            data.to(self.device)
            with _float64_onehot():
                self.results = self.output_to_results(self.model(data))

    if isinstance(model, str):
        return SevenNetCalculator(model, device="cpu")
    dtype = next(model.parameters()).dtype
    cls = Float64SevenNetCalculator if dtype == torch.float64 else SevenNetCalculator
    return cls(model, file_type="model_instance", device="cpu")


def tiny_systems() -> dict[str, Atoms]:
    """Small Ag/Au/Cu systems: periodic triclinic bulk, a (T, T, F) slab, a cluster."""
    rng = np.random.default_rng(7)

    bulk_atoms = bulk("Cu", "fcc", a=3.7).repeat((2, 2, 2))  # 8 atoms, triclinic cell
    bulk_atoms.numbers[[1, 4]] = [47, 79]
    bulk_atoms.rattle(0.1, seed=1)

    slab = ag_slab()  # pbc (T, T, F)
    cluster = au_cluster(rng)
    return {"bulk": bulk_atoms, "slab": slab, "cluster": cluster}


def dilute_periodic(n_atoms: int = 64, box: float = 18.0, seed: int = 0) -> Atoms:
    """``n_atoms`` H/C/O/Cu at least 1.6 Å apart in a periodic cube (a cheap halo for 7net-0).

    A dense crystal is too expensive here: 7net-0's receptive field is 5 x 5 Å, and
    the halo rows of a small dense periodic cell at one rank run into the tens of
    thousands.
    """
    rng = np.random.default_rng(seed)
    positions: list[np.ndarray] = []
    while len(positions) < n_atoms:
        trial = rng.uniform(0.0, box, 3)
        gaps = [(trial - p + box / 2) % box - box / 2 for p in positions]
        if all(np.linalg.norm(g) > 1.6 for g in gaps):
            positions.append(trial)
    numbers = rng.choice([1, 6, 8, 29], n_atoms)
    return Atoms(numbers=numbers, positions=positions, cell=[box] * 3, pbc=True)


@pytest.fixture(scope="module")
def tiny():
    return tiny_sevennet()


def test_adapter_attributes(tiny) -> None:
    model = SevenNet(tiny)
    assert model.cutoff == 3.5
    assert model.num_layers == 2
    assert tuple(model.atomic_types) == (29, 47, 79)
    assert not model.training and not tiny.training


@pytest.mark.parametrize("name", ["bulk", "slab", "cluster"])
def test_tiny_float64_matches_sevennet_calculator(tiny, name: str) -> None:
    atoms = tiny_systems()[name]
    ref = ase_results(reference_calculator(tiny), atoms)
    got = ase_results(ShardedCalculator(SevenNet(tiny)), atoms)
    if "stress" not in got:
        ref.pop("stress", None)
    errors = relative_errors(got, ref)
    assert all(err <= RTOL64 for err in errors.values()), errors
    # nothing is zero by accident
    assert np.abs(ref["forces"]).max() > 1e-3


def test_edge_vectors_are_not_modified(tiny) -> None:
    from ase_shard.graph import LocalGraph

    vectors = torch.tensor([[1.0, 0.5, -0.3], [-1.0, -0.5, 0.3]], dtype=torch.float64)
    graph = LocalGraph(
        numbers=torch.tensor([29, 79]),
        edge_index=torch.tensor([[0, 1], [1, 0]]),
        edge_vectors=vectors.clone().requires_grad_(True),
        n_owned=2,
    )
    energies = SevenNet(tiny)(graph)
    assert energies.shape == (2,) and energies.dtype == torch.float64
    assert torch.equal(graph.edge_vectors.detach(), vectors)


def test_modal_is_checked(tiny) -> None:
    with pytest.raises(ValueError, match="single fidelity"):
        SevenNet(tiny, modal="PBE")


@pytest.fixture(scope="module")
def sevennet0():
    return SevenNet("7net-0")


def test_7net0_attributes(sevennet0) -> None:
    assert sevennet0.cutoff == 5.0
    assert sevennet0.num_layers == 5
    assert len(sevennet0.atomic_types) == 89
    assert next(sevennet0.parameters()).dtype == torch.float32
    # what `ase-shard info` reads from the checkpoint's config is what the network has
    outline = SevenNet.outline("7net-0")
    assert (outline.cutoff, outline.num_layers) == (sevennet0.cutoff, sevennet0.num_layers)
    assert outline.atomic_types == tuple(sevennet0.atomic_types)
    assert outline.heads == () and sevennet0.modal is None


def test_7net0_matches_sevennet_calculator(sevennet0) -> None:
    atoms = dilute_periodic(64)
    ref = ase_results(reference_calculator("7net-0"), atoms)
    got = ase_results(ShardedCalculator(sevennet0), atoms)
    errors = relative_errors(got, ref)
    assert all(errors[key] <= F32_RTOL[key] for key in errors), errors


def test_non_trainable_bessel_coefficients_follow_the_dtype() -> None:
    """sevenn keeps them as a plain attribute; the adapter makes them move and cast."""
    import sevenn._keys as KEY

    from ase_shard.random_models import random_sevennet_network

    radial = {KEY.RADIAL_BASIS_NAME: "bessel", "bessel_basis_num": 8, "trainable_coeff": False}
    config = {
        KEY.RADIAL_BASIS: radial,
        KEY.CONV_DENOMINATOR: 8.0,
        KEY.SHIFT: [-2.5, -3.1, -3.7],
        KEY.SCALE: [1.3, 0.7, 1.9],
    }
    network = random_sevennet_network(SPECIES, cutoff=3.5, channels=8, num_layers=2, config=config)
    calc = ShardedCalculator(SevenNet(network), dtype=torch.float64)
    floating = [
        (f"{name}.{key}", value.dtype)
        for name, module in calc.model.named_modules()
        for key, value in [*vars(module).items(), *module._buffers.items()]
        if isinstance(value, torch.Tensor) and value.is_floating_point()
    ]
    assert any(name.endswith("coeffs") for name, _ in floating)
    assert all(dtype == torch.float64 for _, dtype in floating), floating
