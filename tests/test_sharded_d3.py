"""DFT-D3 at any rank count: the ``dftd3`` package's ASE calculator as the oracle.

Plain pytest runs one rank; ``mpirun -n P python -m pytest --with-mpi`` runs P. Rank 0
computes the references (``dftd3.ase.DFTD3``) and broadcasts them. With the per-layer
halo the ranks exchange their owned atoms' coordination numbers (and dE/dCN back), with
the full halo each counts its ghosts' itself; both must give dftd3's results to 1e-8
relative, bitwise alike on every rank. The per-layer halo takes the compiled kernel (its
exchanges on the host), or autograd for the model without it (``graph.exchange``); the
full halo takes autograd. The three give the same per-atom energies and virials.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("dftd3")
pytest.importorskip("tad_dftd3")

from oracles import ase_results  # noqa: E402
from sharded import (  # noqa: E402
    COMM,
    assert_close_to,
    assert_identical_on_all_ranks,
    assert_ranks_own_nothing_iff_fewer_atoms,
    fewer_atoms_than_ranks,
    on_root,
)
from test_d3 import CUTOFFS, RTOL, d3_model, d3_systems, dftd3_calculator, dftd3_results  # noqa: E402

from ase_shard import ShardedCalculator  # noqa: E402
from ase_shard.block import SumBlock  # noqa: E402
from ase_shard.distributed import distribute  # noqa: E402
from ase_shard.models import D3, EMT  # noqa: E402
from ase_shard.partition import PARTITIONS  # noqa: E402

# how D3 is evaluated: (halo, the model's path as test_d3.d3_model takes it); the full
# halo evaluates even the model with a kernel by autograd
EVALUATIONS = {
    "kernel": ("layer", "kernel"),
    "layer-autograd": ("layer", "autograd"),
    "full-autograd": ("full", "kernel"),
}


def d3_calculator(evaluation: str, *args, **options) -> ShardedCalculator:
    """A calculator of ``D3(*args, **CUTOFFS)`` evaluated as ``evaluation`` says."""
    halo, path = EVALUATIONS[evaluation]
    return ShardedCalculator(d3_model(path, *args, **CUTOFFS), halo=halo, **options)


def assert_evaluated_as(calc: ShardedCalculator, evaluation: str) -> None:
    """The calculator's block took the kernel exactly for ``"kernel"``."""
    assert (calc._block._direct is not None) == (evaluation == "kernel")


@pytest.mark.parametrize("evaluation", sorted(EVALUATIONS))
@pytest.mark.parametrize("damping, atm", [("bj", True), ("zero", False)])
@pytest.mark.parametrize("system", ["crystal", "graphite", "slab", "triclinic", "molecule"])
def test_matches_dftd3(system: str, damping: str, atm: bool, evaluation: str) -> None:
    atoms = d3_systems()[system]
    ref = on_root(lambda: dftd3_results(atoms, "pbe", damping, atm, **CUTOFFS))
    calc = d3_calculator(evaluation, "pbe", damping, atm)
    got = ase_results(calc, atoms)
    assert_evaluated_as(calc, evaluation)
    assert_close_to(got, ref, RTOL)
    assert_identical_on_all_ranks(got)


@pytest.mark.parametrize("damping", ["bj", "zero"])
@pytest.mark.parametrize("system", ["crystal", "slab", "triclinic"])
def test_per_atom_values(system: str, damping: str) -> None:
    """Per-atom energies and virials (dftd3 has neither) alike on the three paths: the
    kernel's ghost ends and triangles split as autograd splits them, whichever rank."""
    atoms = d3_systems()[system]
    got = {}
    for evaluation in EVALUATIONS:
        calc = d3_calculator(evaluation, "pbe", damping, True)
        got[evaluation] = ase_results(calc, atoms, stresses=True)
        assert_evaluated_as(calc, evaluation)
    for evaluation in ("layer-autograd", "full-autograd"):
        assert_close_to(got["kernel"], got[evaluation], RTOL)
    assert_identical_on_all_ranks(got["kernel"])


def test_in_a_sum() -> None:
    """EMT + D3: each term's block takes its kernel (D3's with the per-layer halo); the
    results are ASE's SumCalculator of ASE's EMT and dftd3's."""
    from ase.calculators.emt import EMT as AseEMT
    from ase.calculators.mixing import SumCalculator

    def reference() -> dict:
        copy = atoms.copy()
        copy.calc = SumCalculator([AseEMT(), dftd3_calculator("pbe", "bj", True, **CUTOFFS)])
        return {"energy": copy.get_potential_energy(), "forces": copy.get_forces()}

    atoms = d3_systems()["slab"]
    ref = on_root(reference)
    calc = ShardedCalculator(EMT() + D3("pbe", "bj", True, **CUTOFFS))
    got = ase_results(calc, atoms)
    assert isinstance(calc._block, SumBlock)
    assert all(block._direct is not None for block in calc._block.blocks)
    assert calc._block.blocks[1]._halo is not None
    assert_close_to(got, ref, RTOL)
    assert_identical_on_all_ranks(got)


@pytest.mark.parametrize("partition", PARTITIONS)
@pytest.mark.parametrize("evaluation", sorted(EVALUATIONS))
def test_partitions(partition: str, evaluation: str) -> None:
    """The slab with CO, cut either way (ghosts on both sides of the adsorbate)."""
    atoms = d3_systems()["slab"]
    ref = on_root(lambda: dftd3_results(atoms, "pbe", "bj", True, **CUTOFFS))
    calc = d3_calculator(evaluation, "pbe", "bj", True, partition=partition)
    got = ase_results(calc, atoms)
    assert_close_to(got, ref, RTOL)
    assert_identical_on_all_ranks(got)


@pytest.mark.parametrize("evaluation", sorted(EVALUATIONS))
@pytest.mark.parametrize("name", ["one", "two"])
def test_with_ranks_that_own_nothing(name: str, evaluation: str) -> None:
    """Fewer atoms than ranks: the empty ranks take part in the exchanges; the results
    are dftd3's (the lone atom's forces vanish, its energy and stress do not)."""
    atoms = fewer_atoms_than_ranks()[name]
    ref = on_root(lambda: dftd3_results(atoms, "pbe", "bj", True, **CUTOFFS))
    calc = d3_calculator(evaluation, "pbe", "bj", True)
    got = ase_results(calc, atoms)
    assert_evaluated_as(calc, evaluation)
    assert_ranks_own_nothing_iff_fewer_atoms(calc, len(atoms))
    assert_close_to(got, ref, RTOL)
    assert_identical_on_all_ranks(got)


@pytest.mark.parametrize("evaluation", sorted(EVALUATIONS))
def test_distributed_atoms(evaluation: str) -> None:
    """Distributed atoms (each rank holds its own): dftd3's results, the forces gathered."""
    atoms = d3_systems()["slab"]
    ref = on_root(lambda: dftd3_results(atoms, "pbe", "bj", True, **CUTOFFS))
    local = distribute(atoms if COMM.is_root else None)
    local.calc = calc = d3_calculator(evaluation, "pbe", "bj", True)
    got = {"energy": np.asarray(local.get_potential_energy()), "stress": local.get_stress()}
    order = np.argsort(np.concatenate(COMM.allgather(local.get_global_ids())))
    got["forces"] = np.concatenate(COMM.allgather(local.get_forces()))[order]
    assert_evaluated_as(calc, evaluation)
    assert_close_to(got, ref, RTOL)
