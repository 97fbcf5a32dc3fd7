"""DFT-D3 at any rank count: the ``dftd3`` package's ASE calculator as the oracle.

Plain pytest runs one rank; ``mpirun -n P python -m pytest --with-mpi`` runs P. Rank 0
computes the references (``dftd3.ase.DFTD3``) and broadcasts them. With the per-layer
halo the ranks exchange their owned atoms' coordination numbers (and dE/dCN back), with
the full halo each counts its ghosts' itself; both must give dftd3's results to 1e-8
relative, bitwise alike on every rank.
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
from test_d3 import CUTOFFS, RTOL, d3_systems, dftd3_results  # noqa: E402

from ase_shard import ShardedCalculator  # noqa: E402
from ase_shard.distributed import distribute  # noqa: E402
from ase_shard.models import D3  # noqa: E402
from ase_shard.partition import PARTITIONS  # noqa: E402


@pytest.mark.parametrize("halo", ["layer", "full"])
@pytest.mark.parametrize("damping, atm", [("bj", True), ("zero", False)])
@pytest.mark.parametrize("system", ["crystal", "graphite", "slab", "triclinic", "molecule"])
def test_matches_dftd3(system: str, damping: str, atm: bool, halo: str) -> None:
    atoms = d3_systems()[system]
    ref = on_root(lambda: dftd3_results(atoms, "pbe", damping, atm, **CUTOFFS))
    calc = ShardedCalculator(D3("pbe", damping, atm, **CUTOFFS), halo=halo)
    got = ase_results(calc, atoms)
    assert_close_to(got, ref, RTOL)
    assert_identical_on_all_ranks(got)


@pytest.mark.parametrize("partition", PARTITIONS)
@pytest.mark.parametrize("halo", ["layer", "full"])
def test_partitions(partition: str, halo: str) -> None:
    """The slab with CO, cut either way (ghosts on both sides of the adsorbate)."""
    atoms = d3_systems()["slab"]
    ref = on_root(lambda: dftd3_results(atoms, "pbe", "bj", True, **CUTOFFS))
    calc = ShardedCalculator(D3("pbe", "bj", True, **CUTOFFS), partition=partition, halo=halo)
    got = ase_results(calc, atoms)
    assert_close_to(got, ref, RTOL)
    assert_identical_on_all_ranks(got)


@pytest.mark.parametrize("halo", ["layer", "full"])
@pytest.mark.parametrize("name", ["one", "two"])
def test_with_ranks_that_own_nothing(name: str, halo: str) -> None:
    """Fewer atoms than ranks: the empty ranks take part in the exchanges; the results
    are dftd3's (the lone atom's forces vanish, its energy and stress do not)."""
    atoms = fewer_atoms_than_ranks()[name]
    ref = on_root(lambda: dftd3_results(atoms, "pbe", "bj", True, **CUTOFFS))
    calc = ShardedCalculator(D3("pbe", "bj", True, **CUTOFFS), halo=halo)
    got = ase_results(calc, atoms)
    assert_ranks_own_nothing_iff_fewer_atoms(calc, len(atoms))
    assert_close_to(got, ref, RTOL)
    assert_identical_on_all_ranks(got)


@pytest.mark.parametrize("halo", ["layer", "full"])
def test_distributed_atoms(halo: str) -> None:
    """Distributed atoms (each rank holds its own): dftd3's results, the forces gathered."""
    atoms = d3_systems()["slab"]
    ref = on_root(lambda: dftd3_results(atoms, "pbe", "bj", True, **CUTOFFS))
    local = distribute(atoms if COMM.is_root else None)
    local.calc = ShardedCalculator(D3("pbe", "bj", True, **CUTOFFS), halo=halo)
    got = {"energy": np.asarray(local.get_potential_energy()), "stress": local.get_stress()}
    order = np.argsort(np.concatenate(COMM.allgather(local.get_global_ids())))
    got["forces"] = np.concatenate(COMM.allgather(local.get_forces()))[order]
    assert_close_to(got, ref, RTOL)
