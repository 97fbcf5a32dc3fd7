"""The MACE adapter equals mace-torch's ``MACECalculator`` at any rank count.

Runs with plain pytest (one rank) and under
``mpirun -n P python -m pytest --with-mpi tests/test_sharded_mace.py``. Every
rank builds the same random-weight model (seeded); rank 0 computes the
``MACECalculator`` reference and broadcasts it.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("mace")  # before e3nn: mace allows e3nn's pickled constants

from ase import Atoms  # noqa: E402
from sharded import (  # noqa: E402
    assert_close_to,
    assert_identical_on_all_ranks,
    assert_ranks_own_nothing_iff_fewer_atoms,
    fewer_atoms_than_ranks,
    on_root,
    results,
)
from sync_count import assert_block_syncs_only, assert_split_equals_whole, reuse_step  # noqa: E402
from test_mace import (  # noqa: E402
    RTOL,
    SYSTEMS,
    assert_matches,
    mace_reference,
    make_mace,
    save_model,
)

from ase_shard import ShardedCalculator  # noqa: E402
from ase_shard.models.mace import MACE  # noqa: E402


@pytest.fixture(scope="module")
def model_and_file(tmp_path_factory):
    model = make_mace("scale_shift", seed=11)
    return model, save_model(model, tmp_path_factory.mktemp("mace") / "mace.model")


@pytest.mark.parametrize("halo", ["layer", "full"])
@pytest.mark.parametrize(
    "system, partition",
    [("bulk", "spatial"), ("bulk", "contiguous"), ("slab", "spatial"), ("cluster", "spatial")],
)
def test_matches_mace_calculator(system: str, partition: str, halo: str, model_and_file) -> None:
    model, path = model_and_file
    atoms = SYSTEMS[system]()
    reference = on_root(lambda: mace_reference(path, atoms))
    atoms.calc = ShardedCalculator(MACE(model), partition=partition, halo=halo)
    got = results(atoms)
    assert_matches(got, reference)
    assert_identical_on_all_ranks(got)


def test_direction_sensitive_blocks(tmp_path) -> None:
    """Density blocks, ZBL and a species-pair distance transform, on the slab."""
    model = make_mace("density_zbl_agnesi", seed=12)
    path = save_model(model, tmp_path / "mace.model")
    atoms = SYSTEMS["slab"]()
    reference = on_root(lambda: mace_reference(path, atoms))
    atoms.calc = ShardedCalculator(MACE(model))
    got = results(atoms)
    assert_matches(got, reference)
    assert_identical_on_all_ranks(got)


@pytest.fixture(scope="module")
def few_atoms_references(model_and_file):
    """``MACECalculator`` on ``fewer_atoms_than_ranks()`` (rank 0's, broadcast)."""
    systems = fewer_atoms_than_ranks()
    return on_root(
        lambda: {name: mace_reference(model_and_file[1], atoms) for name, atoms in systems.items()}
    )


@pytest.mark.parametrize(
    "name, halo",
    [
        ("one", "layer"),
        ("two", "layer"),
        ("one", "full"),
        ("two", "full"),
    ],
)
def test_ranks_that_own_nothing(model_and_file, few_atoms_references, name, halo) -> None:
    """Fewer atoms than ranks: the empty ranks take part (and exchange, with the layer
    halo) and the results are MACE's."""
    atoms = fewer_atoms_than_ranks()[name]
    atoms.calc = calc = ShardedCalculator(MACE(model_and_file[0]), halo=halo)
    got = results(atoms)
    assert_ranks_own_nothing_iff_fewer_atoms(calc, len(atoms))
    assert_close_to(got, few_atoms_references[name], RTOL)
    assert_identical_on_all_ranks(got)


@pytest.mark.parametrize("halo", ["layer", "full"])
def test_few_atoms_and_an_isolated_one(model_and_file, halo: str) -> None:
    """A pair and an atom with no neighbours (E0 plus shift)."""
    model, path = model_and_file
    atoms = Atoms("CuAlAg", positions=[[0.0, 0.0, 0.0], [2.4, 0.3, 0.1], [9.0, 9.0, 9.0]])
    reference = on_root(lambda: mace_reference(path, atoms))
    atoms.calc = ShardedCalculator(MACE(model), halo=halo)
    got = results(atoms)
    assert_matches(got, reference)
    assert_identical_on_all_ranks(got)


@pytest.mark.parametrize("halo", ["layer", "full"])
def test_no_sync_in_a_reuse_step(model_and_file, halo: str) -> None:
    """The step waits for a GPU for the block's kept edges and results only."""
    atoms = SYSTEMS["bulk"]()
    atoms.calc = calc = ShardedCalculator(MACE(model_and_file[0]), halo=halo)
    assert_block_syncs_only(reuse_step(atoms), calc._block)


@pytest.mark.rank_independent
def test_split_full_halo_blocks_sum_to_one_block(model_and_file) -> None:
    """Three ranks' full-halo blocks in one process add up to one rank's, with each
    layer restricted by hop count (no sync) or whole (as compiled, without hops)."""
    model = MACE(model_and_file[0])
    atoms = SYSTEMS["cluster"]()
    assert_split_equals_whole(model, atoms, RTOL)
