"""Sums of models at any rank count: ASE's ``SumCalculator`` of each term's own calculator.

Plain pytest runs one rank; ``mpirun -n P python -m pytest --with-mpi`` runs P (2, 3
and 4 in ``make test``). Rank 0 computes the references, ASE's ``SumCalculator`` of
ASE's EMT, Lennard-Jones and Morse, and broadcasts them. A message-passing model in a
sum: ``tests/test_sharded_sevenn.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from ase.build import bulk
from ase.calculators.emt import EMT as AseEMT
from ase.calculators.lj import LennardJones as AseLennardJones
from ase.calculators.mixing import SumCalculator
from ase.calculators.morse import MorsePotential as AseMorse
from oracles import ase_results, relative_errors
from sharded import (
    COMM,
    assert_close_to,
    assert_identical_on_all_ranks,
    assert_ranks_own_nothing_iff_fewer_atoms,
    fewer_atoms_than_ranks,
    on_root,
    results,
)
from systems import CASES, LJ_TAIL, MORSE_CU

from ase_shard import ShardedCalculator
from ase_shard.block import SumBlock
from ase_shard.distributed import distribute
from ase_shard.models import EMT, LennardJones, Morse, Sum

RTOL64 = 1e-10


def builtin_sum() -> Sum:
    """EMT + a Lennard-Jones tail + Morse: three cutoffs (5.9, 7.5 and 6.9 Å)."""
    return EMT() + LennardJones(**LJ_TAIL) + Morse(**MORSE_CU)


def builtin_reference() -> SumCalculator:
    return SumCalculator([AseEMT(), AseLennardJones(**LJ_TAIL), AseMorse(**MORSE_CU)])


def systems() -> dict:
    """Bulk Cu, a triclinic fcc cell, a Pt(111) slab (T, T, F) and a Au cluster with a
    lone atom (no cell)."""
    triclinic = bulk("Cu", "fcc", a=3.6).repeat((3, 3, 3))
    triclinic.rattle(0.05, seed=3)
    return {
        "bulk": CASES["cu_bulk_emt"].make_atoms(),
        "triclinic": triclinic,
        "slab": CASES["pt111_slab_emt"].make_atoms(),
        "cluster": CASES["au_cluster_emt"].make_atoms(),
    }


@pytest.fixture(scope="module")
def builtin_references():
    return on_root(
        lambda: {
            name: ase_results(builtin_reference(), atoms)
            for name, atoms in {**systems(), **fewer_atoms_than_ranks()}.items()
        }
    )


@pytest.mark.parametrize("name", ["bulk", "triclinic", "slab", "cluster", "one", "two"])
def test_builtin_terms_match_ase_sum(builtin_references, name: str) -> None:
    """Energy, per-atom energies, forces and stress of EMT + LJ + Morse equal ASE's
    SumCalculator of the three; fewer atoms than ranks leave ranks empty."""
    atoms = {**systems(), **fewer_atoms_than_ranks()}[name]
    calc = ShardedCalculator(builtin_sum())
    got = ase_results(calc, atoms)
    assert_close_to(got, builtin_references[name], RTOL64)
    assert_identical_on_all_ranks(got)
    assert_ranks_own_nothing_iff_fewer_atoms(calc, len(atoms))


def test_each_term_lists_its_own_edges() -> None:
    """Each term's block lists the pairs within its own cutoff plus the skin, not the
    longest one: EMT's fewer than the Lennard-Jones tail's."""
    model = builtin_sum()
    atoms = systems()["bulk"]
    calc = ShardedCalculator(model, skin=0.3)
    atoms.calc = calc
    atoms.get_potential_energy()
    block = calc._block
    assert isinstance(block, SumBlock)
    counts = []
    for term, term_block in zip(model.terms, block.blocks, strict=True):
        assert term_block.model is term
        positions = atoms.positions
        ids = term_block.ids
        centre, neighbour = term_block.centre.numpy(), term_block.neighbour.numpy()
        assert centre.size
        # edges within the term's cutoff + skin (minimum image of the bulk's 10.8 Å cell)
        d = positions[ids[neighbour]] - positions[ids[centre]]
        d -= np.rint(d @ np.linalg.inv(atoms.cell.array)) @ atoms.cell.array
        assert np.linalg.norm(d, axis=1).max() < float(term.cutoff) + 0.3
        counts.append(COMM.allgather(centre.size))
    emt, lj, morse = (sum(count) for count in counts)
    assert emt < morse < lj


def test_distributed_atoms(builtin_references) -> None:
    """Distributed atoms (each rank holds its own): the same results."""
    atoms = systems()["triclinic"]
    local = distribute(atoms if COMM.is_root else None)
    local.calc = ShardedCalculator(builtin_sum())
    got = results(local)
    order = np.argsort(np.concatenate(COMM.allgather(local.get_global_ids())))
    for name in ("energies", "forces"):
        got[name] = np.concatenate(COMM.allgather(got[name]))[order]
    ref = builtin_references["triclinic"]
    errors = relative_errors({name: got[name] for name in ref}, ref)
    assert max(errors.values()) <= RTOL64, errors


@pytest.mark.rank_independent
def test_declarations() -> None:
    """A sum's reach is its longest term's; nested sums and ``+`` flatten; a term that
    predicts its forces is refused."""
    emt, lj = EMT(), LennardJones(**LJ_TAIL)
    model = Sum(Sum(emt, lj), Morse(**MORSE_CU))
    assert len(model.terms) == 3 and (emt + model).terms[0] is emt
    assert model.cutoff == model.receptive_field == 7.5 and model.num_layers == 1
    assert model.atomic_types == emt.atomic_types  # LJ and Morse take any element

    class Predicting(EMT):
        predicts_forces = True

    with pytest.raises(ValueError, match="predicts its forces"):
        Sum(emt, Predicting())
