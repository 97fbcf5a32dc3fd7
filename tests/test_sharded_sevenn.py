"""SevenNet adapter at any rank count: sharded results equal SevenNet's own calculator.

Plain pytest runs one rank; ``mpirun -n P python -m pytest --with-mpi`` runs P. Every
rank builds the same models and computes the reference (``SevenNetCalculator``) itself.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("sevenn")

from oracles import ase_results, relative_errors  # noqa: E402
from sharded import assert_identical_on_all_ranks  # noqa: E402
from sync_count import assert_block_syncs_only, assert_split_equals_whole, reuse_step  # noqa: E402
from test_sevenn import (  # noqa: E402
    F32_RTOL,
    RTOL64,
    dilute_periodic,
    reference_calculator,
    tiny_sevennet,
    tiny_systems,
)

from ase_shard import ShardedCalculator  # noqa: E402
from ase_shard.models.sevenn import SevenNet  # noqa: E402
from ase_shard.partition import PARTITIONS  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    return tiny_sevennet()


@pytest.fixture(scope="module")
def tiny_references(tiny):
    return {
        name: ase_results(reference_calculator(tiny), atoms)
        for name, atoms in tiny_systems().items()
    }


@pytest.mark.parametrize("halo", ["layer", "full"])
@pytest.mark.parametrize("partition", PARTITIONS)
@pytest.mark.parametrize("name", ["bulk", "slab", "cluster"])
def test_tiny_float64(tiny, tiny_references, name: str, partition: str, halo: str) -> None:
    atoms = tiny_systems()[name]
    calc = ShardedCalculator(SevenNet(tiny), partition=partition, halo=halo)
    got = ase_results(calc, atoms)
    ref = {key: value for key, value in tiny_references[name].items() if key in got}
    assert set(ref) == set(got)
    errors = relative_errors(got, ref)
    assert all(err <= RTOL64 for err in errors.values()), errors
    assert_identical_on_all_ranks(got)


@pytest.fixture(scope="module")
def sevennet0():
    return SevenNet("7net-0")


def test_7net0_periodic(sevennet0) -> None:
    atoms = dilute_periodic(n_atoms=16, box=16.0, seed=1)
    ref = ase_results(reference_calculator("7net-0"), atoms)
    got = ase_results(ShardedCalculator(sevennet0), atoms)
    errors = relative_errors(got, ref)
    assert all(errors[key] <= F32_RTOL[key] for key in errors), errors
    assert_identical_on_all_ranks(got)


def test_7net0_layer_halo_equals_full_halo(sevennet0) -> None:
    """7net-0 in float64: the one-cutoff halo with exchanges equals the 25 Å halo."""
    atoms = dilute_periodic(n_atoms=16, box=16.0, seed=1)
    got = {
        halo: ase_results(ShardedCalculator(sevennet0, halo=halo, dtype=torch.float64), atoms)
        for halo in ("layer", "full")
    }
    errors = relative_errors(got["layer"], got["full"])
    assert all(err <= RTOL64 for err in errors.values()), errors
    assert_identical_on_all_ranks(got["layer"])


@pytest.mark.parametrize("halo", ["layer", "full"])
def test_no_sync_in_a_reuse_step(tiny, halo: str) -> None:
    """The step waits for a GPU for the block's kept edges and results only."""
    atoms = tiny_systems()["bulk"]
    atoms.calc = calc = ShardedCalculator(SevenNet(tiny), halo=halo)
    assert_block_syncs_only(reuse_step(atoms), calc._block)


def test_split_full_halo_blocks_sum_to_one_block(tiny) -> None:
    """Three ranks' full-halo blocks in one process add up to one rank's, with each
    layer restricted by hop count (no sync) or whole (as compiled, without hops)."""
    model = SevenNet(tiny)
    atoms = tiny_systems()["slab"]
    assert_split_equals_whole(model, atoms, RTOL64)
