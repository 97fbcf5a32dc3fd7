"""metatomic adapter at any rank count: sharded results equal metatomic's own calculator.

Plain pytest runs one rank; ``mpirun -n P python -m pytest --with-mpi`` runs P. Every
rank builds the same models (fixed seeds); rank 0 computes the references
(``metatomic_ase.MetatomicCalculator``) and broadcasts them.
"""

from __future__ import annotations

import pytest

pytest.importorskip("metatomic.torch")
pytest.importorskip("metatomic_ase")

from metatomic_models import tiny_metatomic  # noqa: E402
from oracles import ase_results, rel_err, relative_errors  # noqa: E402
from sharded import (  # noqa: E402
    COMM,
    assert_close_to,
    assert_identical_on_all_ranks,
    assert_ranks_own_nothing_iff_fewer_atoms,
    fewer_atoms_than_ranks,
    on_root,
)
from sync_count import split_reuse_step  # noqa: E402
from test_metatomic import MODELS, RTOL64, reference_results, tiny_systems  # noqa: E402

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
@pytest.mark.parametrize("name", ["full", "half1", "mixed"])
def test_split_blocks_sum_to_one_block(models, name) -> None:
    """Three ranks' full-halo blocks, built in one process (so plain pytest sees ghosts
    and pairs listed one way), add up to one rank's block: energies, forces, virials."""
    model = Metatomic(models[name])
    atoms = tiny_systems()["slab"]
    whole, _ = split_reuse_step(model, atoms, 1)
    split, steps = split_reuse_step(model, atoms, 3)
    assert all(block.n_nodes > block.n_owned for block, _ in steps)
    for rows in (slice(0, 1), slice(1, 4), slice(4, None)):  # energies, forces, virials
        assert rel_err(split[:, rows], whole[:, rows]) <= RTOL64
