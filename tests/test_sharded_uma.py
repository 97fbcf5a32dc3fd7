"""UMA adapter at any rank count: fairchem's own calculator as the oracle, and 1 rank.

Plain pytest runs one rank; ``mpirun -n P python -m pytest --with-mpi`` runs P. Every
rank writes the same seeded tiny checkpoint in a directory of its own; rank 0
computes the references (FAIRChemCalculator in float64, and the adapter on
``MPI.COMM_SELF``) and broadcasts them.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("fairchem.core")

from ase.build import bulk  # noqa: E402
from oracles import ase_results, rel_err, relative_errors  # noqa: E402
from sharded import (  # noqa: E402
    assert_close_to,
    assert_identical_on_all_ranks,
    assert_ranks_own_nothing_iff_fewer_atoms,
    fewer_atoms_than_ranks,
    on_root,
    serial_comm,
)
from sync_count import rank_blocks  # noqa: E402
from test_uma import (  # noqa: E402
    RTOL64,
    fairchem_results,
    predict_unit,
    tiny_uma_file,
    uma_systems,
)

from ase_shard import ShardedCalculator  # noqa: E402
from ase_shard.inputs import ModelInputs  # noqa: E402
from ase_shard.models import UMA  # noqa: E402
from ase_shard.partition import PARTITIONS  # noqa: E402

# P ranks against one: the same network on the same graph, summed in other orders
RTOL_RANKS = 1e-10

_UNITS: dict[str, object] = {}


def oracle(path: str, atoms, task: str) -> dict[str, np.ndarray]:
    """fairchem's float64 results on rank 0 (one predict unit per file), broadcast."""

    def compute():
        if path not in _UNITS:
            _UNITS[path] = predict_unit(path)
        return fairchem_results(_UNITS[path], atoms, task)

    return on_root(compute)


@pytest.fixture(scope="module")
def tiny_file():
    # one block (two hops with the edge-degree embedding) of 3 Å: the halos of the small
    # periodic cells stay a few hundred nodes
    path = tiny_uma_file(num_layers=1, cutoff=3.0)
    yield path
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


@pytest.mark.parametrize("partition", PARTITIONS)
@pytest.mark.parametrize("name", ["bulk", "triclinic", "slab", "molecule"])
def test_tiny_float64(tiny_file, name: str, partition: str) -> None:
    """fairchem's calculator's results, and the one-rank adapter's to 1e-10 (per-layer
    halo, the default)."""
    check_against_fairchem(tiny_file, name, partition=partition)


@pytest.mark.parametrize("name", ["bulk", "slab"])
def test_tiny_float64_full_halo(tiny_file, name: str) -> None:
    """The full halo of blocks + 1 cutoffs, each block on the edges that reach an owned
    energy (graph.hops)."""
    check_against_fairchem(tiny_file, name, halo="full")


def check_against_fairchem(path: str, name: str, **options) -> None:
    atoms, task = uma_systems()[name]
    ref = oracle(path, atoms, task)
    model = UMA(path, task=task, dtype=torch.float64)
    one = on_root(lambda: ase_results(ShardedCalculator(model, comm=serial_comm()), atoms))
    calc = ShardedCalculator(model, **options)
    assert calc.settings.halo == options.get("halo", "layer")
    got = ase_results(calc, atoms)
    errors = relative_errors(got, ref)
    assert all(err <= RTOL64 for err in errors.values()), errors
    assert_close_to(got, one, RTOL_RANKS)
    assert_identical_on_all_ranks(got)


@pytest.mark.parametrize("halo", ["layer", "full"])
@pytest.mark.parametrize("name", ["one", "two"])
def test_tiny_with_ranks_that_own_nothing(tiny_file, name: str, halo: str) -> None:
    """Fewer atoms than ranks: the empty ranks take part (in the per-layer halo's
    exchanges too); the results are fairchem's."""
    atoms = fewer_atoms_than_ranks()[name]
    ref = oracle(tiny_file, atoms, "omat")
    calc = ShardedCalculator(UMA(tiny_file, task="omat", dtype=torch.float64), halo=halo)
    got = ase_results(calc, atoms)
    assert_ranks_own_nothing_iff_fewer_atoms(calc, len(atoms))
    assert_close_to(got, ref, RTOL64)
    assert_identical_on_all_ranks(got)


@pytest.mark.rank_independent
def test_split_full_halo_blocks_sum_to_one_block(tiny_file) -> None:
    """Three ranks' full-halo blocks in one process add up to one rank's, on periodic
    Cu/Ag/O: each block sees the whole system's composition (the experts' routing) only
    through the system inputs, and its ghosts are other images of the same atoms."""
    atoms = bulk("Cu", "fcc", a=3.7, cubic=True).repeat((3, 2, 2))
    atoms.numbers[[0, 7, 20, 33]] = [47, 8, 8, 47]
    atoms.rattle(0.1, seed=1)
    model = UMA(tiny_file, task="omat", dtype=torch.float64)
    system = ModelInputs.of(model).system_values(atoms, {})
    sums = []
    for n_ranks in (1, 3):
        blocks = rank_blocks(model, atoms, n_ranks)
        assert n_ranks == 1 or all(block.n_nodes > block.n_owned for block in blocks)
        total = np.zeros((len(atoms), 10))
        for block in blocks:
            columns = block.evaluate(
                atoms.positions[block.ids], atoms.cell.array, torch.float64, system=system
            )
            np.add.at(total, block.ids, np.asarray(columns).T)
        sums.append(total)
    whole, split = sums
    for rows in (slice(0, 1), slice(1, 4), slice(4, None)):  # energies, forces, virials
        assert rel_err(split[:, rows], whole[:, rows]) <= RTOL_RANKS
