"""The compiled kernels of the built-in potentials (``ase_shard.kernels``), serially.

``ShardedCalculator`` on a CPU in float64 evaluates LJ, Morse and EMT through
their ``energy_forces`` (no autograd). The oracles: ASE's own calculators, and
the same model through the autograd path (the model wrapped so that it has no
``energy_forces``), on one block and on three ranks' blocks built in one
process, whose ghost columns carry what belongs to other ranks.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import bulk
from ase.calculators.emt import EMT as AseEMT
from oracles import ase_results, rel_err, relative_errors
from sync_count import Autograd, rank_blocks, split_reuse_step
from systems import AR, CASES, MORSE_CU

from ase_shard import ShardedCalculator, kernels
from ase_shard.block import RESULT_COLUMNS
from ase_shard.comm import Comm
from ase_shard.graph import EdgeList, Scratch, direct_forces
from ase_shard.kernels import plain_edges_together
from ase_shard.models import EMT, LennardJones, Morse

pytestmark = pytest.mark.skipif(Comm().size > 1, reason="serial: one process plays every rank")

RTOL_ASE = 1e-10
# the kernels and autograd differ in the order of their sums only
RTOL_AUTOGRAD = 1e-12
RTOL_ROUNDING = 1e-14  # one loop against another over the same pairs
PROPERTIES = ("energy", "energies", "forces", "stress", "stresses")


def _results(model: torch.nn.Module, atoms: Atoms) -> dict[str, np.ndarray]:
    atoms = atoms.copy()
    atoms.calc = calc = ShardedCalculator(model)
    names = PROPERTIES if atoms.cell.rank == 3 else ("energy", "energies", "forces")
    out = {name: np.asarray(calc.get_property(name, atoms)) for name in names}
    assert (calc._block._direct is not None) == (direct_forces(model) is not None)
    return out


def test_the_built_in_potentials_declare_it() -> None:
    for model in (LennardJones(), Morse(), EMT()):
        assert direct_forces(model) is model
    assert direct_forces(Autograd(EMT())) is None


@pytest.mark.parametrize("case_name", sorted(CASES))
def test_equals_ase_and_autograd(case_name: str) -> None:
    """Every test system (small cells with self-images, triclinic, slab, cluster with a
    lone atom, molecules without a cell): ASE's numbers and the autograd path's."""
    case = CASES[case_name]
    atoms = case.make_atoms()
    got = _results(case.make_model(), atoms)
    errors = relative_errors(got, ase_results(case.make_ase_calc(), atoms, case.has_stresses))
    assert max(errors.values()) <= RTOL_ASE, errors
    errors = relative_errors(got, _results(Autograd(case.make_model()), atoms))
    assert max(errors.values()) <= RTOL_AUTOGRAD, errors


@pytest.mark.parametrize("batch", [64, 700])
@pytest.mark.parametrize("shuffled", [False, True])
@pytest.mark.parametrize("alloy", [False, True])
def test_emt_second_pass_follows_the_first(
    monkeypatch: pytest.MonkeyPatch, batch: int, shuffled: bool, alloy: bool
) -> None:
    """EMT's second pass follows its first over the plain edges a batch behind, their
    pair terms in a ring (:func:`ase_shard.kernels._emt_sweep`). With batches small
    enough that the ring turns many times: ASE's numbers and the autograd path's, an
    alloy's too, the atoms in a lattice's order or shuffled, on one rank and three."""
    monkeypatch.setattr(kernels, "EXP_BATCH", batch)
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat((12, 4, 4))
    atoms.rattle(0.08, seed=4)
    if alloy:
        atoms.numbers[::3] = 79
    if shuffled:
        atoms = atoms[np.random.default_rng(5).permutation(len(atoms))]
    got = _results(EMT(), atoms)
    assert max(relative_errors(got, ase_results(AseEMT(), atoms)).values()) <= RTOL_ASE
    errors = relative_errors(got, _results(Autograd(EMT()), atoms))
    assert max(errors.values()) <= RTOL_AUTOGRAD, errors
    # three ranks' blocks built in this process, with autograd's: without a halo, each
    # takes its own end of an edge to a ghost (the halo's path runs under mpirun)
    kernel, _ = split_reuse_step(EMT(), atoms, 3)
    autograd, _ = split_reuse_step(Autograd(EMT()), atoms, 3)
    assert rel_err(kernel, autograd) <= RTOL_AUTOGRAD
    (block,) = rank_blocks(EMT(), atoms, 1)
    _, edges = _kernel_edges(block, atoms)
    sweep = kernels._emt_sweep(edges, edges.centre, edges.neighbour, split=False)
    assert len(sweep.frontier) > 10
    # the ring holds the terms of under half the plain edges: the list walks space in its
    # cells' order, whatever the atoms'
    assert sweep.rows < len(edges.plain) // 2


def _mixed_pbc_cu() -> Atoms:
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat((3, 2, 2))
    atoms.pbc = (True, False, True)
    atoms.rattle(0.08, seed=3)
    atoms.numbers[::5] = 79  # Au: an alloy, so the two ends of a pair differ
    return atoms


def _split_cases() -> dict[str, tuple]:
    ar = bulk("Ar", "fcc", a=5.26, cubic=True).repeat(3)
    ar.rattle(0.1, seed=2)
    cu = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(3)
    cu.rattle(0.08, seed=1)
    return {
        "lj": (lambda: LennardJones(**AR), ar),
        "lj_smooth": (lambda: LennardJones(**AR, smooth=True), ar),
        "morse": (lambda: Morse(**MORSE_CU), cu),
        "emt": (EMT, cu),
        "emt_alloy_mixed_pbc": (EMT, _mixed_pbc_cu()),
    }


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("ghosts_first", [False, True])
def test_plain_edges_together_as_a_stable_sort(dtype, ghosts_first: bool) -> None:
    """The plain edges (image 0) gathered in place, the others after them, each in their
    order (a stable sort by "has an image"); with ``ghosts_first``, the leading edges
    to ghosts stay where they are."""
    rng = np.random.default_rng(8)
    n_edges, n_owned, to_ghosts = 500, 40, 60 if ghosts_first else 0
    centre = rng.integers(0, n_owned, n_edges).astype(dtype)
    neighbour = rng.integers(0, n_owned, n_edges).astype(dtype)
    neighbour[:to_ghosts] = np.sort(rng.integers(n_owned, 70, to_ghosts))
    image = np.where(rng.random(n_edges) < 0.2, rng.integers(1, 9, n_edges), 0).astype(np.int8)
    edges = np.stack([centre, neighbour, image])
    # the oracle: the leading edges to ghosts, then the rest sorted by whether shifted
    rest = edges[:, to_ghosts:]
    expected = np.concatenate(
        [edges[:, :to_ghosts], rest[:, np.argsort(rest[2] != 0, kind="stable")]], axis=1
    )
    plain = plain_edges_together(centre, neighbour, image, n_owned, ghosts_first)
    assert np.array_equal(np.stack([centre, neighbour, image]), expected)
    assert plain == range(to_ghosts, to_ghosts + int((rest[2] == 0).sum()))
    assert centre.dtype == dtype and neighbour.dtype == dtype
    empty = (np.zeros(0, dtype), np.zeros(0, dtype), np.zeros(0, np.int8))
    assert plain_edges_together(*empty, 0, ghosts_first) == range(0)


def _kernel_edges(block, atoms) -> tuple[np.ndarray, EdgeList]:
    """A block's evaluation (virials per node) and the edge list its kernel was given."""
    model, listed = block._direct, []

    def listing(edges: EdgeList, out: np.ndarray) -> float:
        listed.append(edges)
        return type(model).energy_forces(model, edges, out)

    model.energy_forces = listing
    try:
        rows, cell = atoms.positions[block.ids], atoms.cell.array
        columns = block.evaluate(rows, cell, torch.float64, per_node_virials=True).copy()
    finally:
        del model.energy_forces
    (edges,) = listed
    return columns, edges


@pytest.mark.parametrize("name", sorted(_split_cases()))
@pytest.mark.parametrize("ranks", [1, 3])
def test_plain_edges_without_offsets_to_the_bit(name: str, ranks: int) -> None:
    """A block's plain edges (most of them) are evaluated by kernels that leave the
    offsets out: the same bits as with every edge's offset (image 0's is zero) added.
    EMT takes its plain edges in an order of its own in each pass
    (:func:`ase_shard.kernels._emt_sweep`): the same sums, to round-off."""
    make_model, atoms = _split_cases()[name]
    for block in rank_blocks(make_model(), atoms, ranks):
        columns, edges = _kernel_edges(block, atoms)
        assert 0 < len(edges.plain) < len(edges.centre)
        assert not edges.image[edges.plain.start : edges.plain.stop].any()
        every = np.zeros_like(columns)
        block._direct.energy_forces(dataclasses.replace(edges, plain=range(0)), every)
        if name.startswith("emt"):
            assert rel_err(columns, every) <= RTOL_ROUNDING
        else:
            assert np.array_equal(columns, every)


class _Stale(Scratch):
    """A block's scratch whose arrays come back with every bit set, as an earlier step
    might have left them (NaN in floats)."""

    def empty(self, name: str, shape: tuple[int, ...], dtype=np.float64) -> np.ndarray:
        array = super().empty(name, shape, dtype)
        array.reshape(-1).view(np.uint8).fill(0xFF)
        return array


@pytest.mark.parametrize("name", ["emt", "emt_alloy_mixed_pbc"])
@pytest.mark.parametrize("ranks", [1, 3])
def test_scratch_carries_nothing_between_steps(name: str, ranks: int) -> None:
    """EMT's pair terms live in the block's scratch from one step to the next: whatever
    an earlier step left there, the same bits as arrays of the call's own."""
    make_model, atoms = _split_cases()[name]
    for block in rank_blocks(make_model(), atoms, ranks):
        columns, edges = _kernel_edges(block, atoms)
        assert edges.scratch is block._scratch
        for scratch in (None, _Stale(), edges.scratch):
            again = np.zeros_like(columns)
            block._direct.energy_forces(dataclasses.replace(edges, scratch=scratch), again)
            assert np.array_equal(columns, again)


def test_scratch_keeps_an_array_while_its_shape_does() -> None:
    scratch = Scratch()
    first = scratch.empty("terms", (5, 2))
    assert scratch.empty("terms", (5, 2)) is first
    assert scratch.empty("other", (5, 2)) is not first
    assert scratch.empty("terms", (6, 2)).shape == (6, 2)
    assert scratch.empty("terms", (6, 2), np.int32).dtype == np.int32


def test_scratch_makes_a_plan_once() -> None:
    scratch, made = Scratch(), []

    def make() -> object:
        made.append(object())
        return made[-1]

    first = scratch.once("plan", make)
    assert scratch.once("plan", make) is first and len(made) == 1
    assert scratch.once("other plan", make) is not first


@pytest.mark.parametrize("name", sorted(_split_cases()))
@pytest.mark.parametrize("ranks", [1, 3])
def test_blocks_equal_autograd(name: str, ranks: int) -> None:
    """Each rank's block on its own (owned and ghost columns), summed per atom as the
    calculator does: the kernels put a pair's force on the node it belongs to, the
    autograd path half on each end, and the sums agree."""
    make_model, atoms = _split_cases()[name]
    kernel, blocks = split_reuse_step(make_model(), atoms, ranks)
    autograd, _ = split_reuse_step(Autograd(make_model()), atoms, ranks)
    assert all(block._direct is not None for block, _ in blocks)
    assert ranks == 1 or all(block.n_nodes > block.n_owned for block, _ in blocks)
    for rows in (slice(0, 1), slice(1, 4), slice(4, None)):  # energies, forces, virials
        assert rel_err(kernel[:, rows], autograd[:, rows]) <= RTOL_AUTOGRAD


@pytest.mark.parametrize("name", sorted(_split_cases()))
def test_virials_summed_in_registers(name: str) -> None:
    """Without per-node virials (their node sums kept narrower): the same energies and
    forces and the same virial columns' sum, to round-off (the compiler fuses multiplies
    and adds, ``fastmath={"contract"}``, where each loop lets it: not always alike)."""
    make_model, atoms = _split_cases()[name]
    (block,) = rank_blocks(make_model(), atoms, 1)
    rows, cell = atoms.positions[block.ids], atoms.cell.array
    per_node = block.evaluate(rows, cell, torch.float64, per_node_virials=True).copy()
    total = block.evaluate(rows, cell, torch.float64, per_node_virials=False)
    for rows in (slice(0, 1), slice(1, 4)):  # energies, forces
        assert rel_err(total[rows], per_node[rows]) <= RTOL_ROUNDING
    assert rel_err(total[4:].sum(axis=1), per_node[4:].sum(axis=1)) <= RTOL_AUTOGRAD


def _edges(n_nodes: int, n_owned: int, centre=(), neighbour=(), cutoff: float = 5.0) -> EdgeList:
    rng = np.random.default_rng(0)
    return EdgeList(
        positions=rng.uniform(0.0, 3.0, (n_nodes, 3)),
        numbers=np.full(n_nodes, 29, dtype=np.int64),
        centre=np.asarray(centre, dtype=np.int64),
        neighbour=np.asarray(neighbour, dtype=np.int64),
        image=np.zeros(len(centre), dtype=np.int16),
        offsets=np.zeros((1, 3)),
        n_owned=n_owned,
        cutoff=cutoff,
    )


@pytest.mark.parametrize("model", [LennardJones(), Morse(), EMT()], ids=["lj", "morse", "emt"])
def test_empty_block_and_lone_atoms(model: torch.nn.Module) -> None:
    """No nodes; nodes without edges (EMT: -E0 each); edges all beyond the cutoff."""
    out = np.zeros((RESULT_COLUMNS, 0))
    assert model.energy_forces(_edges(0, 0), out) == np.inf
    out = np.zeros((RESULT_COLUMNS, 3))
    assert model.energy_forces(_edges(3, 2), out) == np.inf
    lone = -EMT().table[29, 0].item() if isinstance(model, EMT) else 0.0
    np.testing.assert_array_equal(out[0], [lone, lone, 0.0])
    assert not out[1:].any()
    far = _edges(2, 2, centre=[0, 1], neighbour=[1, 0], cutoff=1e-3)
    out = np.zeros((RESULT_COLUMNS, 2))
    closest = model.energy_forces(far, out)
    assert closest == pytest.approx(np.sum((far.positions[1] - far.positions[0]) ** 2))
    np.testing.assert_array_equal(out[0], [lone, lone])
    assert not out[1:].any()


def test_emt_lone_atom_through_the_calculator() -> None:
    """An atom far from the others: EMT's energy -E0 (3.80 eV for Au), no force."""
    atoms = CASES["au_cluster_emt"].make_atoms()
    atoms.calc = ShardedCalculator(EMT())
    assert atoms.get_potential_energies()[-1] == pytest.approx(3.80, abs=1e-12)
    assert not atoms.get_forces()[-1].any()


def test_float32_takes_the_autograd_path() -> None:
    case = CASES["alloy_emt"]
    atoms = case.make_atoms()
    model = EMT()

    def not_in_float32(edges: EdgeList, out: np.ndarray) -> float:
        raise AssertionError("the kernel ran in float32")

    model.energy_forces = not_in_float32
    atoms.calc = ShardedCalculator(model, dtype=torch.float32)
    reference = ase_results(case.make_ase_calc(), atoms)
    assert rel_err(atoms.get_forces(), reference["forces"]) < 5e-5  # test_models.RTOL32


def test_min_distance_sees_the_kernels_shortest_edge() -> None:
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(2)
    atoms.positions[1] = atoms.positions[0] + [0.3, 0.0, 0.0]
    atoms.calc = ShardedCalculator(EMT(), min_distance=0.5)
    with pytest.raises(ValueError, match="closer than min_distance"):
        atoms.get_potential_energy()


def test_non_finite_kernel_output_names_the_atoms() -> None:
    atoms = CASES["ar_triclinic_lj"].make_atoms()
    model = LennardJones(**AR)
    kernel = model.energy_forces

    def poisoned(edges: EdgeList, out: np.ndarray) -> float:
        closest = kernel(edges, out)
        out[2, 1] = np.nan
        return closest

    model.energy_forces = poisoned
    atoms.calc = ShardedCalculator(model)
    with pytest.raises(FloatingPointError, match=r"non-finite .* for atoms \[\d+\] \(1 atoms\)"):
        atoms.get_forces()
