"""CHGNet adapter in one process: CHGNet's own calculator and graph converter as oracles.

The tiny models are CHGNet's architecture with random weights (seeded), small enough
for the suite; the pretrained 0.3.0 ships inside the chgnet wheel.
"""

from __future__ import annotations

import contextlib
import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("chgnet")

from ase import Atoms  # noqa: E402
from ase.build import bulk, molecule  # noqa: E402
from oracles import ase_results, relative_errors  # noqa: E402
from test_sevenn import tiny_systems  # noqa: E402

from ase_shard import ShardedCalculator  # noqa: E402
from ase_shard.models import CHGNet  # noqa: E402
from ase_shard.models.chgnet import bond_graph  # noqa: E402

RTOL64 = 1e-10
# float32 against float64, relative: round-off floors for the comparison with CHGNet's
# own float32 error
F32_RTOL = {"energy": 1e-6, "energies": 1e-6, "forces": 1e-5, "stress": 1e-5}


def tiny_chgnet(seed: int = 0, n_conv: int = 3) -> torch.nn.Module:
    """CHGNet's architecture, small and with random weights: 4 Å atom graph, 2.8 Å bonds."""
    from chgnet.model import CHGNet as ChgnetModel

    torch.manual_seed(seed)
    return ChgnetModel(
        atom_fea_dim=16,
        bond_fea_dim=16,
        angle_fea_dim=16,
        num_radial=7,
        num_angular=7,
        n_conv=n_conv,
        atom_conv_hidden_dim=16,
        bond_conv_hidden_dim=16,
        mlp_hidden_dims=(16, 16),
        atom_graph_cutoff=4.0,
        bond_graph_cutoff=2.8,
    )


@contextlib.contextmanager
def _chgnet_float64(network: torch.nn.Module):
    """CHGNet's own graph and calculator code in float64 while inside.

    chgnet builds its graph tensors in a module-level ``TORCH_DTYPE`` (float32)
    and its composition model rounds each structure's element fractions to
    float32 (``AtomRef._assemble_graphs``: 3e-7 eV on 12 atoms); here both are
    float64 (the fractions as chgnet forms them), everything else is chgnet's
    code unchanged.
    """
    import chgnet.graph.converter
    import chgnet.graph.crystalgraph
    import chgnet.model.model

    modules = (chgnet.graph.converter, chgnet.graph.crystalgraph, chgnet.model.model)
    saved = [module.TORCH_DTYPE for module in modules]
    default = torch.get_default_dtype()
    reference = network.composition_model

    def fractions(graphs):
        counts = [
            torch.bincount(graph.atomic_number - 1, minlength=reference.max_num_elements)
            for graph in graphs
        ]
        if reference.is_intensive:
            counts = [count / count.sum() for count in counts]
        return torch.stack(counts).double()

    try:
        for module in modules:
            module.TORCH_DTYPE = torch.float64
        torch.set_default_dtype(torch.float64)
        reference._assemble_graphs = fractions
        yield
    finally:
        for module, dtype in zip(modules, saved, strict=True):
            module.TORCH_DTYPE = dtype
        torch.set_default_dtype(default)
        del reference._assemble_graphs


def reference_calculator(network: torch.nn.Module):
    """CHGNet's own ASE calculator (site energies on), in the network's dtype."""
    from chgnet.model import CHGNetCalculator

    class Float64CHGNetCalculator(CHGNetCalculator):
        def calculate(self, atoms=None, properties=None, system_changes=None, task="efsm"):
            with _chgnet_float64(self.model):
                super().calculate(atoms, properties, system_changes, task)

    float64 = next(network.parameters()).dtype == torch.float64
    cls = Float64CHGNetCalculator if float64 else CHGNetCalculator
    return cls(network, use_device="cpu", return_site_energies=True)


def chgnet_results(network, atoms: Atoms) -> dict[str, np.ndarray]:
    """What CHGNet's calculator gives, in ASE's units (site energies as ``energies``)."""
    calc = reference_calculator(network)
    results = ase_results(calc, atoms)
    results["energies"] = np.asarray(calc.results["energies"], dtype=np.float64)
    return results


def chgnet_systems() -> dict[str, Atoms]:
    """The SevenNet tests' bulk, slab and cluster, a molecule and a triclinic Si cell."""
    systems = dict(tiny_systems())
    ethanol = molecule("CH3CH2OH")
    ethanol.center(vacuum=4.0)
    ethanol.pbc = False
    systems["molecule"] = ethanol
    silicon = bulk("Si", "diamond", a=5.43)  # primitive: triclinic
    silicon = silicon.repeat((2, 2, 1))
    silicon.rattle(0.05, seed=4)
    systems["triclinic"] = silicon
    return systems


@pytest.fixture(scope="module")
def tiny64():
    return tiny_chgnet().double()


def test_shipped_model_attributes() -> None:
    model = CHGNet("0.3.0")
    assert (model.cutoff, model.bond_cutoff, model.num_layers) == (6.0, 3.0, 4)
    assert tuple(model.atomic_types) == tuple(range(1, 95))


def test_bad_models_are_refused() -> None:
    with pytest.raises(ValueError, match="neither a shipped model"):
        CHGNet("0.9.9")
    with pytest.raises(TypeError, match="CHGNet expects a shipped model name"):
        CHGNet(3)
    from chgnet.model import CHGNet as ChgnetModel

    with pytest.raises(ValueError, match="pools the crystal first"):
        CHGNet(ChgnetModel(n_conv=2, mlp_first=False))


@pytest.mark.parametrize("name", ["bulk", "triclinic", "slab", "molecule"])
def test_bonds_and_angles_are_chgnets(name: str) -> None:
    """The bonds and the bond graph built from edges equal CHGNet's converter's (on the
    converter's own edges: one node per atom, every reverse listed)."""
    from pymatgen.io.ase import AseAtomsAdaptor

    net = tiny_chgnet()
    atoms = chgnet_systems()[name]
    graph = net.graph_converter(AseAtomsAdaptor.get_structure(atoms))
    positions = graph.atom_frac_coord.double() @ graph.lattice.double()
    centre, neighbour = graph.atom_graph.t().long()
    lattice = graph.lattice.double()
    vectors = positions[neighbour] - positions[centre] + graph.neighbor_image.double() @ lattice
    short = torch.linalg.vector_norm(vectors, dim=1) < net.graph_converter.bond_graph_cutoff
    bonds = bond_graph(torch.stack([centre, neighbour]), vectors, short, len(atoms))
    d2u, u2d = bonds.directed2undirected, bonds.undirected2directed
    # the same partition of directed edges into bonds (labels may differ)
    theirs = graph.directed2undirected.long()
    assert len(u2d) == int(theirs.max()) + 1
    pairs = torch.stack([d2u, theirs], 1).unique(dim=0)
    assert len(pairs) == len(u2d)
    assert torch.equal(d2u[u2d], torch.arange(len(u2d)))
    # the same angles: (centre, directed edge i, directed edge j), and their bonds
    assert bonds.rows.shape[0] > 0
    first, second = bonds.angle_edges
    mine = {(int(centre[a]), int(a), int(b)) for a, b in zip(first, second, strict=True)}
    bond_graph_rows = graph.bond_graph.long()
    chgnets = {(int(c), int(a), int(b)) for c, a, b in bond_graph_rows[:, [0, 2, 4]]}
    assert mine == chgnets
    assert torch.equal(bonds.rows[:, 1], d2u[first])
    assert torch.equal(bonds.rows[:, 2], d2u[second])


@pytest.mark.parametrize("name", ["bulk", "triclinic", "slab", "molecule"])
def test_tiny_float64_matches_chgnet_calculator(tiny64, name: str) -> None:
    atoms = chgnet_systems()[name]
    ref = chgnet_results(tiny64, atoms)
    got = ase_results(ShardedCalculator(CHGNet(tiny64)), atoms)
    assert set(got) == set(ref)
    errors = relative_errors(got, ref)
    assert all(err <= RTOL64 for err in errors.values()), errors


@pytest.mark.parametrize("name", ["triclinic", "molecule"])
def test_shipped_030_float32_is_as_close_as_chgnets_own(name: str) -> None:
    """The pretrained 0.3.0 in float32 (as loaded): the adapter is as close to CHGNet's
    calculator on the same weights in float64 as CHGNet's own float32 run is (within a
    factor 2: float32 round-off of different summation orders, measured 1.15e-5 against
    5.7e-6 in forces on the Si cell).

    (The adapter forms edge vectors in float64 and casts them; CHGNet forms positions in
    float32 from fractional coordinates: on ethanol its forces are 1e-4 relative off.)
    """
    model = CHGNet("0.3.0")
    atoms = chgnet_systems()[name]
    exact = chgnet_results(copy.deepcopy(model.model).double(), atoms)
    theirs = relative_errors(chgnet_results(model.model, atoms), exact)
    ours = relative_errors(ase_results(ShardedCalculator(model, dtype="float32"), atoms), exact)
    assert all(ours[key] <= max(2 * theirs[key], F32_RTOL[key]) for key in exact), (ours, theirs)
