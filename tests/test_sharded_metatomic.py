"""metatomic adapter at any rank count: sharded results equal metatomic's own calculator.

Plain pytest runs one rank; ``mpirun -n P python -m pytest --with-mpi`` runs P. Every
rank builds the same models (fixed seeds); rank 0 computes the references
(``metatomic_ase.MetatomicCalculator``) and broadcasts them. The PET models
(``tests/pet_models.py``) too: metatrain builds them on every rank, unscripted (a saved
PET loaded from its file spends seconds in TorchScript's first calls).
"""

from __future__ import annotations

import pytest

pytest.importorskip("metatomic.torch")
pytest.importorskip("metatomic_ase")

from metatomic_models import tiny_metatomic  # noqa: E402
from oracles import ase_results, rel_err, relative_errors  # noqa: E402
from pet_models import REACH, tiny_pet  # noqa: E402
from sharded import (  # noqa: E402
    COMM,
    assert_close_to,
    assert_identical_on_all_ranks,
    assert_ranks_own_nothing_iff_fewer_atoms,
    fewer_atoms_than_ranks,
    on_root,
)
from sync_count import split_reuse_step  # noqa: E402
from test_metatomic import MODELS, PETS, RTOL64, reference_results, tiny_systems  # noqa: E402

from ase_shard import ShardedCalculator  # noqa: E402
from ase_shard.models.metatomic import Metatomic  # noqa: E402
from ase_shard.partition import PARTITIONS  # noqa: E402


@pytest.fixture(scope="module")
def models():
    return {name: tiny_metatomic(**arguments) for name, arguments in MODELS.items()}


@pytest.fixture(scope="module")
def references(models):
    """metatomic's calculator on every model and ``tiny_systems()`` (rank 0's, broadcast)."""
    return on_root(
        lambda: {
            (name, system): reference_results(model, atoms)
            for name, model in models.items()
            for system, atoms in tiny_systems().items()
            if (name, system) in SHARDED
        }
    )


# a model with a half list and several layers can meet a graph that no half list
# represents (a ghost next to an owned atom's periodic image): only the molecule, and
# below the "two" atoms, where it is refused
SHARDED = [
    (name, system)
    for name in MODELS
    for system in ("bulk", "triclinic", "slab", "molecule")
    if system == "molecule" or name not in ("half", "mixed_half")
]
# every partition for the first model, the default (spatial) for the others
CASES = [
    (name, system, partition)
    for name, system in SHARDED
    for partition in (PARTITIONS if name == "full" else ["spatial"])
]


@pytest.mark.parametrize(("name", "system", "partition"), CASES)
def test_matches_metatomic_calculator(models, references, name, system, partition) -> None:
    atoms = tiny_systems()[system]
    calc = ShardedCalculator(Metatomic(models[name]), partition=partition)
    got = ase_results(calc, atoms)
    ref = references[name, system]
    assert set(got) == set(ref)
    errors = relative_errors(got, ref)
    assert max(errors.values()) <= RTOL64, errors
    assert_identical_on_all_ranks(got)


@pytest.fixture(scope="module")
def few_atoms_references(models):
    return on_root(
        lambda: {
            name: reference_results(models["full"], atoms)
            for name, atoms in fewer_atoms_than_ranks().items()
        }
    )


@pytest.mark.parametrize("name", ["one", "two"])
def test_ranks_that_own_nothing(models, few_atoms_references, name) -> None:
    """Fewer atoms than ranks: the empty ranks return no energy and the results are
    metatomic's (the lone atom's forces vanish by symmetry)."""
    atoms = fewer_atoms_than_ranks()[name]
    calc = ShardedCalculator(Metatomic(models["full"]))
    got = ase_results(calc, atoms)
    assert_ranks_own_nothing_iff_fewer_atoms(calc, len(atoms))
    assert_close_to(got, few_atoms_references[name], RTOL64)
    assert_identical_on_all_ranks(got)


def test_half_list_with_unpaired_edges_is_refused(models) -> None:
    """Two atoms in a small cell, two layers over a half list: at one rank the graph has
    no ghosts and the results are metatomic's; at several, a ghost sees the periodic
    images of an owned atom and the model is refused with the reason on every rank."""
    atoms = fewer_atoms_than_ranks()["two"]
    ref = on_root(lambda: reference_results(models["half"], atoms))
    calc = ShardedCalculator(Metatomic(models["half"]))
    if COMM.size == 1:
        assert_close_to(ase_results(calc, atoms), ref, RTOL64)
        return
    with pytest.raises(NotImplementedError, match="requests a half neighbour list"):
        ase_results(calc, atoms)


@pytest.mark.rank_independent
@pytest.mark.parametrize(
    ("name", "unfold"),
    [("full", False), ("half1", False), ("mixed", False), ("half", True), ("mixed_half", True)],
)
def test_split_blocks_sum_to_one_block(models, name, unfold) -> None:
    """Three ranks' full-halo blocks, built in one process (so plain pytest sees ghosts
    and pairs listed one way), add up to one rank's block: energies, forces, virials
    (unfolded into images: their sum; the split between atoms follows the paths that
    place the images). Unfolded, a half list over several layers is exact too (the
    images' pairs are all listed both ways)."""
    model = Metatomic(models[name], unfold=unfold)
    atoms = tiny_systems()["triclinic" if unfold else "slab"]
    whole, _ = split_reuse_step(model, atoms, 1)
    split, steps = split_reuse_step(model, atoms, 3)
    assert all(block.n_nodes > block.n_owned for block, _ in steps)
    for rows in (slice(0, 1), slice(1, 4)):  # energies, forces
        assert rel_err(split[:, rows], whole[:, rows]) <= RTOL64
    virials = slice(4, None)
    if unfold:
        assert rel_err(split[:, virials].sum(0), whole[:, virials].sum(0)) <= RTOL64
    else:
        assert rel_err(split[:, virials], whole[:, virials]) <= RTOL64


@pytest.fixture(scope="module")
def pets():
    """Each rank's adapters of the same PETs (fixed seeds), with the halo of their real
    reach."""
    return {
        featurizer: Metatomic(tiny_pet(featurizer), interaction_range=REACH[featurizer])
        for featurizer in PETS
    }


@pytest.fixture(scope="module")
def pet_references(pets):
    """metatomic's calculator on the PETs: ``tiny_systems()``, and the fewer-atoms
    systems for the feedforward one."""

    def compute() -> dict:
        refs = {}
        for featurizer, adapter in pets.items():
            systems = dict(tiny_systems())
            if featurizer == "feedforward":
                systems.update(fewer_atoms_than_ranks())
            for system, atoms in systems.items():
                refs[featurizer, system] = reference_results(adapter.model, atoms)
        return refs

    return on_root(compute)


SYSTEMS = ("bulk", "triclinic", "slab", "molecule")
# both featurizers on the four systems, the feedforward one with fewer atoms than ranks
PET_CASES = [
    *((featurizer, system) for featurizer in PETS for system in SYSTEMS),
    ("feedforward", "one"),
    ("feedforward", "two"),
]


@pytest.mark.parametrize(("featurizer", "system"), PET_CASES)
def test_pet_matches_metatomic_calculator(pets, pet_references, featurizer, system):
    """PET unfolded into periodic images on each rank: metatomic's results; with fewer
    atoms than ranks, the empty ranks own nothing."""
    atoms = {**tiny_systems(), **fewer_atoms_than_ranks()}[system]
    assert pets[featurizer].unfold
    calc = ShardedCalculator(pets[featurizer])
    got = ase_results(calc, atoms)
    assert_ranks_own_nothing_iff_fewer_atoms(calc, len(atoms))
    assert_close_to(got, pet_references[featurizer, system], RTOL64)
    assert_identical_on_all_ranks(got)
