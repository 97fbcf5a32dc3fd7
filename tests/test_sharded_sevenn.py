"""SevenNet adapter at any rank count: sharded results equal SevenNet's own calculator.

Plain pytest runs one rank; ``mpirun -n P python -m pytest --with-mpi`` runs P. Every
rank builds the same models; rank 0 computes the references (``SevenNetCalculator``)
and broadcasts them.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("sevenn")

from ase.calculators.lj import LennardJones as AseLennardJones  # noqa: E402
from ase.calculators.mixing import SumCalculator  # noqa: E402
from oracles import ase_results, relative_errors  # noqa: E402
from sharded import (  # noqa: E402
    assert_close_to,
    assert_identical_on_all_ranks,
    assert_ranks_own_nothing_iff_fewer_atoms,
    fewer_atoms_than_ranks,
    on_root,
)
from sync_count import assert_block_syncs_only, assert_split_equals_whole, reuse_step  # noqa: E402
from systems import LJ_TAIL  # noqa: E402
from test_sevenn import (  # noqa: E402
    F32_RTOL,
    RTOL64,
    dilute_periodic,
    reference_calculator,
    tiny_sevennet,
    tiny_systems,
)

from ase_shard import ShardedCalculator  # noqa: E402
from ase_shard.models import LennardJones  # noqa: E402
from ase_shard.models.sevenn import SevenNet  # noqa: E402
from ase_shard.partition import PARTITIONS  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    return tiny_sevennet()


@pytest.fixture(scope="module")
def tiny_references(tiny):
    """SevenNet's calculator on ``tiny_systems()`` (rank 0's, broadcast)."""
    return on_root(
        lambda: {
            name: ase_results(reference_calculator(tiny), atoms)
            for name, atoms in tiny_systems().items()
        }
    )


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


@pytest.fixture(scope="module")
def sevennet0_calculator():
    """``get()``: SevenNet's own calculator on 7net-0 (float32), loaded at the first call
    (on rank 0 alone, inside ``on_root``) and kept for the module."""
    loaded = []

    def get():
        if not loaded:
            loaded.append(reference_calculator("7net-0"))
        return loaded[0]

    return get


def test_7net0_periodic(sevennet0, sevennet0_calculator) -> None:
    atoms = dilute_periodic(n_atoms=16, box=16.0, seed=1)
    ref = on_root(lambda: ase_results(sevennet0_calculator(), atoms))
    got = ase_results(ShardedCalculator(sevennet0), atoms)
    errors = relative_errors(got, ref)
    assert all(errors[key] <= F32_RTOL[key] for key in errors), errors
    assert_identical_on_all_ranks(got)


def test_7net0_layer_halo_equals_full_halo() -> None:
    """7net-0 in float64: the one-cutoff halo with exchanges and the 25 Å halo both give
    what SevenNet's own calculator gives on the same float64 network.

    Measured at 1 and 2 ranks, either halo: <= 8e-16 (energy, per-atom energies, forces) and
    2.3e-13 (stress). Both are handed one network, cast once: a deep copy of SevenNet's
    network (what ``ShardedCalculator`` makes when it casts) gives forces 1.6e-10 apart from
    the network cast in place, so the two must not be cast separately.
    """
    atoms = dilute_periodic(n_atoms=16, box=16.0, seed=1)
    network = reference_calculator("7net-0").model.double()
    ref = on_root(lambda: ase_results(reference_calculator(network), atoms))
    for halo in ("layer", "full"):
        got = ase_results(ShardedCalculator(SevenNet(network), halo=halo), atoms)
        errors = relative_errors(got, ref)
        assert all(err <= RTOL64 for err in errors.values()), (halo, errors)
        assert_identical_on_all_ranks(got)


@pytest.fixture(scope="module")
def few_atoms_references(tiny):
    """SevenNet's calculator on ``fewer_atoms_than_ranks()`` (rank 0's, broadcast)."""
    return on_root(
        lambda: {
            name: ase_results(reference_calculator(tiny), atoms)
            for name, atoms in fewer_atoms_than_ranks().items()
        }
    )


@pytest.mark.parametrize("halo", ["layer", "full"])
@pytest.mark.parametrize("name", ["one", "two"])
def test_tiny_with_ranks_that_own_nothing(tiny, few_atoms_references, name, halo) -> None:
    """Fewer atoms than ranks: the empty ranks take part (and exchange, with the layer
    halo) and the results are SevenNet's."""
    atoms = fewer_atoms_than_ranks()[name]
    calc = ShardedCalculator(SevenNet(tiny), halo=halo)
    got = ase_results(calc, atoms)
    assert_ranks_own_nothing_iff_fewer_atoms(calc, len(atoms))
    assert_close_to(got, few_atoms_references[name], RTOL64)
    assert_identical_on_all_ranks(got)


@pytest.mark.parametrize("halo", ["layer", "full"])
def test_no_sync_in_a_reuse_step(tiny, halo: str) -> None:
    """The step waits for a GPU for the block's kept edges and results only."""
    atoms = tiny_systems()["bulk"]
    atoms.calc = calc = ShardedCalculator(SevenNet(tiny), halo=halo)
    assert_block_syncs_only(reuse_step(atoms), calc._block)


@pytest.mark.rank_independent
def test_split_full_halo_blocks_sum_to_one_block(tiny) -> None:
    """Three ranks' full-halo blocks in one process add up to one rank's, with each
    layer restricted by hop count (no sync) or whole (as compiled, without hops)."""
    model = SevenNet(tiny)
    atoms = tiny_systems()["slab"]
    assert_split_equals_whole(model, atoms, RTOL64)


# ---------------------------------------------------------------- beside a pair term: Sum


@pytest.fixture(scope="module")
def sevennet_sum():
    """SevenNet + a Lennard-Jones tail, and SevenNet's own calculator + ASE's (rank 0's)."""
    # 3.5 Å, three message-passing layers (10.5 Å, past the pair term's 7.5), float64
    network = tiny_sevennet(num_layers=3)

    def reference() -> dict:
        ref = SumCalculator([reference_calculator(network), AseLennardJones(**LJ_TAIL)])
        return {name: ase_results(ref, atoms) for name, atoms in tiny_systems().items()}

    return SevenNet(network) + LennardJones(**LJ_TAIL), tiny_systems(), on_root(reference)


@pytest.mark.parametrize("halo", ["layer", "full"])
@pytest.mark.parametrize("name", ["bulk", "slab", "cluster"])
def test_message_passing_term_with_a_longer_pair_term(sevennet_sum, name: str, halo: str):
    """A three-layer SevenNet (3.5 Å) plus a 7.5 Å Lennard-Jones tail equal SevenNet's own
    calculator plus ASE's: with the layer halo the ghosts reach 7.5 Å, the longest
    cutoff, and SevenNet exchanges its features through them between layers; with the
    full halo they reach SevenNet's 10.5 Å."""
    model, atoms_of, references = sevennet_sum
    assert model.receptive_field == 10.5 and model.supports_layer_halo
    calc = ShardedCalculator(model, halo=halo)
    got = ase_results(calc, atoms_of[name])
    assert_close_to(got, references[name], RTOL64)
    assert_identical_on_all_ranks(got)


def test_7net0_plus_d3(sevennet0, sevennet0_calculator) -> None:
    """7net-0 + D3(BJ) with the three-body term (``7net-0 + D3()``, as ``ase-shard md
    --model 7net-0 --d3 pbe`` builds it) equals ASE's SumCalculator of SevenNet's own
    calculator and the dftd3 package's (energy, forces, stress: dftd3's gives no
    per-atom energies), to the float32 model's precision (the sum runs in 7net-0's
    float32); D3's cutoffs shortened alike in both (tests/test_d3.py)."""
    pytest.importorskip("dftd3")
    from test_d3 import CUTOFFS, dftd3_calculator, dftd3_results

    from ase_shard.models import D3

    atoms = dilute_periodic(n_atoms=16, box=16.0, seed=1)

    def reference() -> tuple[dict, dict]:
        dispersion = dftd3_calculator("pbe", "bj", True, **CUTOFFS)
        summed = atoms.copy()
        summed.calc = SumCalculator([sevennet0_calculator(), dispersion])
        ref = {
            "energy": np.asarray(summed.get_potential_energy()),
            "forces": summed.get_forces(),
            "stress": summed.get_stress(),
        }
        return ref, dftd3_results(atoms, "pbe", "bj", True, **CUTOFFS)

    ref, d3_alone = on_root(reference)
    assert abs(d3_alone["energy"]) > 1e-3 * abs(ref["energy"])  # D3 weighs in
    calc = ShardedCalculator(sevennet0 + D3(**CUTOFFS))
    got = ase_results(calc, atoms)
    assert calc.dtype == torch.float32
    errors = relative_errors(got, ref)
    assert all(errors[key] <= F32_RTOL[key] for key in errors), errors
    assert_identical_on_all_ranks(got)
