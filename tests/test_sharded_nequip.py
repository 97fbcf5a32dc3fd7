"""NequIP and Allegro adapters at any rank count equal nequip's own calculator,
NequIP with the per-layer halo (its default) and the full halo.

Plain pytest runs one rank; ``mpirun -n P python -m pytest --with-mpi
tests/test_sharded_nequip.py`` runs P. Every rank builds the same seeded
models; rank 0 evaluates nequip's (serial) calculator as the reference and
broadcasts it.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

pytest.importorskip("nequip")
pytest.importorskip("allegro")

from oracles import ase_results  # noqa: E402
from sharded import (  # noqa: E402
    assert_close_to,
    assert_identical_on_all_ranks,
    assert_ranks_own_nothing_iff_fewer_atoms,
    fewer_atoms_than_ranks,
    on_root,
)
from sync_count import assert_block_syncs_only, assert_split_equals_whole, reuse_step  # noqa: E402
from test_nequip import (  # noqa: E402
    BUILDERS,
    RTOL64,
    SYSTEMS,
    _nequip_default_dtype,  # noqa: F401  (autouse fixture, applies here too)
    build_nequip,
    nequip_calculator,
    relative_errors,
)

from ase_shard import ShardedCalculator  # noqa: E402
from ase_shard.models.nequip import NequIP  # noqa: E402
from ase_shard.partition import PARTITIONS  # noqa: E402

_MODELS: dict = {}
_REFERENCES: dict = {}
# a deeper NequIP (3 layers: two exchanges per evaluation) with residual updates
_BUILDERS = {
    **{kind: build for kind, (build, _) in BUILDERS.items()},
    "nequip-3-resnet": lambda: build_nequip(num_layers=3, convnet_resnet=True),
}


# the adapter of each kind
_ADAPTERS = {
    **{kind: adapter for kind, (_, adapter) in BUILDERS.items()},
    "nequip-3-resnet": NequIP,
}


def _model(kind: str):
    """One seeded model per kind, shared by the adapter and the reference."""
    if kind not in _MODELS:
        _MODELS[kind] = _BUILDERS[kind]()
    return _MODELS[kind]


def _reference(kind: str, system: str) -> dict:
    """nequip's calculator (rank 0's, broadcast; cached across partitions)."""
    if (kind, system) not in _REFERENCES:
        atoms = SYSTEMS[system]()
        reference = on_root(lambda: ase_results(nequip_calculator(_model(kind)), atoms))
        _REFERENCES[kind, system] = reference
    return _REFERENCES[kind, system]


@pytest.mark.parametrize("partition", PARTITIONS)
@pytest.mark.parametrize("system", sorted(SYSTEMS))
@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_sharded_matches_nequip_calculator(kind: str, system: str, partition: str) -> None:
    adapter = BUILDERS[kind][1]
    atoms = SYSTEMS[system]()
    atoms.calc = ShardedCalculator(adapter(_model(kind)), partition=partition)
    got = ase_results(atoms.calc, atoms)
    errors = relative_errors(got, _reference(kind, system))
    assert all(err <= RTOL64 for err in errors.values()), errors
    assert_identical_on_all_ranks(got)


@pytest.mark.parametrize("partition", PARTITIONS)
@pytest.mark.parametrize("system", sorted(SYSTEMS))
@pytest.mark.parametrize("kind", ["nequip", "nequip-3-resnet"])
def test_layer_halo_equals_full_halo(kind: str, system: str, partition: str) -> None:
    """Ghost features exchanged between interaction blocks (one-cutoff halo) give
    what computing them locally (``num_layers`` cutoffs) and nequip give."""
    results = {}
    for halo in ("layer", "full"):
        atoms = SYSTEMS[system]()
        atoms.calc = ShardedCalculator(NequIP(_model(kind)), partition=partition, halo=halo)
        results[halo] = ase_results(atoms.calc, atoms)
        errors = relative_errors(results[halo], _reference(kind, system))
        assert all(err <= RTOL64 for err in errors.values()), (halo, errors)
        assert_identical_on_all_ranks(results[halo])
    errors = relative_errors(results["layer"], results["full"])
    assert all(err <= RTOL64 for err in errors.values()), errors


@pytest.mark.parametrize("name", ["one", "two"])
@pytest.mark.parametrize("kind", ["nequip-3-resnet", "allegro"])
def test_ranks_that_own_nothing(kind: str, name: str) -> None:
    """Fewer atoms than ranks: empty ranks join every exchange (NequIP's layer halo) or
    hold nothing (Allegro's full halo), and the results are nequip's calculator's."""
    atoms = fewer_atoms_than_ranks()[name]
    reference = on_root(lambda: ase_results(nequip_calculator(_model(kind)), atoms))
    atoms.calc = calc = ShardedCalculator(_ADAPTERS[kind](_model(kind)))
    got = ase_results(calc, atoms)
    assert_ranks_own_nothing_iff_fewer_atoms(calc, len(atoms))
    assert_close_to(got, reference, RTOL64)
    assert_identical_on_all_ranks(got)


@pytest.mark.parametrize(
    "kind, halo",
    [("nequip", "layer"), ("nequip", "full"), ("nequip-3-resnet", "full"), ("allegro", "full")],
)
def test_no_sync_in_a_reuse_step(kind: str, halo: str) -> None:
    """The step waits for a GPU for the block's kept edges and results only."""
    atoms = SYSTEMS["bulk"]()
    adapter = _ADAPTERS[kind](_model(kind))
    atoms.calc = calc = ShardedCalculator(adapter, halo=halo)
    assert_block_syncs_only(reuse_step(atoms), calc._block)


@pytest.mark.parametrize("kind", ["nequip-3-resnet", "allegro"])
@pytest.mark.rank_independent
def test_split_full_halo_blocks_sum_to_one_block(kind: str) -> None:
    """Three ranks' full-halo blocks in one process add up to one rank's, with each
    layer restricted by hop count (no sync) or whole (as compiled, without hops)."""
    model = _ADAPTERS[kind](_model(kind))
    atoms = SYSTEMS["cluster"]()
    assert_split_equals_whole(model, atoms, RTOL64)
