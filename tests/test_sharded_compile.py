"""``ShardedCalculator(compile=...)``: padded graphs, equal to eager and to the one-graph
periodic evaluation (tests/oracles.py), few recompiles.

Uses dynamo's ``aot_eager`` backend (dynamo tracing, guards and AOTAutograd as
with inductor, without generating code) to stay fast; ``scripts/compile_md.py``
runs inductor. Runs at any rank count.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch._dynamo.utils
from oracles import evaluate_periodic_graph, relative_errors
from sharded import (
    COMM,
    assert_close_to,
    assert_identical_on_all_ranks,
    assert_ranks_own_nothing_iff_fewer_atoms,
    fewer_atoms_than_ranks,
    on_root,
    random_gas,
    results,
)
from toy_models import ToyMessagePassing

from ase_shard import ShardedCalculator
from ase_shard.padding import Capacities

RTOL = 1e-10


def assert_matches_oracle(got: dict, model, atoms) -> None:
    """``got`` equals the one-graph periodic evaluation of ``model`` (rank 0's, broadcast)."""
    oracle = on_root(lambda: evaluate_periodic_graph(model, atoms))
    errors = relative_errors(got, {key: oracle[key] for key in got})
    assert all(err <= RTOL for err in errors.values()), errors


@torch._dynamo.register_backend
def failing_backend(graph, example_inputs):
    """A compiler that always fails, as Triton or a C++ toolchain can on a new machine."""
    raise RuntimeError("this backend always fails")


@pytest.mark.rank_independent
def test_capacities_grow_geometrically() -> None:
    first = Capacities().grown(Capacities(10, 4, 100))
    assert first == Capacities(15, 6, 150)
    assert first.grown(Capacities(12, 6, 90)) == first
    assert first.grown(Capacities(16, 2, 151)) == Capacities(23, 6, 225)
    assert Capacities.largest([Capacities(1, 9, 3), Capacities(4, 2, 8)]) == Capacities(4, 9, 8)


def test_compiled_equals_eager_through_migration() -> None:
    """Layer-halo message passing, rebuilt every step: same numbers, one graph."""
    torch._dynamo.reset()
    atoms = random_gas((True, True, False), n_atoms=96)
    model = ToyMessagePassing(num_layers=3)
    eager, compiled = atoms.copy(), atoms.copy()
    # random moves bring atoms closer than any real structure: no min_distance
    eager.calc = ShardedCalculator(model, skin=0.2, min_distance=0)
    compiled.calc = calc = ShardedCalculator(model, skin=0.2, compile="aot_eager", min_distance=0)
    rng = np.random.default_rng(3)
    for _ in range(5):
        moves = rng.uniform(-0.6, 0.6, atoms.positions.shape)
        eager.positions += moves
        compiled.positions += moves
        got = results(compiled)
        errors = relative_errors(got, results(eager))
        assert all(err <= 1e-12 for err in errors.values()), errors
        assert_matches_oracle(got, model, compiled)
        assert_identical_on_all_ranks(got)
    assert calc.rebuilds == 5
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert 1 <= graphs <= 2
    assert len(set(COMM.allgather(graphs))) == 1


def test_a_backend_failure_runs_eagerly_with_a_warning() -> None:
    """torch.compile falls back to eager (suppress_errors): counted, warned, still exact."""
    torch._dynamo.reset()
    atoms = random_gas((True, True, True), n_atoms=48)
    model = ToyMessagePassing(num_layers=2)
    eager = ShardedCalculator(model, min_distance=0)
    compiled = ShardedCalculator(model, compile="failing_backend", min_distance=0)
    with pytest.warns(RuntimeWarning, match="could not compile part of ToyMessagePassing"):
        got = results(_attached(atoms, compiled))
    errors = relative_errors(got, results(_attached(atoms, eager)))
    assert all(err <= 1e-12 for err in errors.values()), errors
    assert_matches_oracle(got, model, atoms)
    assert compiled.compile_fallbacks >= 1
    assert eager.compile_fallbacks == 0


def _attached(atoms, calc):
    atoms = atoms.copy()
    atoms.calc = calc
    return atoms


def test_compiled_with_ranks_that_own_nothing() -> None:
    """One atom: from two ranks on, the empty ranks run the padded graph and join every
    exchange."""
    torch._dynamo.reset()
    atoms = fewer_atoms_than_ranks()["one"]
    model = ToyMessagePassing(cutoff=4.0, num_layers=3)
    atoms.calc = calc = ShardedCalculator(model, compile="aot_eager", halo="layer")
    got = results(atoms)
    assert_ranks_own_nothing_iff_fewer_atoms(calc, len(atoms))
    assert_close_to(got, on_root(lambda: evaluate_periodic_graph(model, atoms)), RTOL)
    assert_identical_on_all_ranks(got)


def test_a_sum_compiles_each_term_on_its_own_graphs() -> None:
    """Message passing (compiled on its own padded graphs, its layers exchanged) plus
    Coulomb with a charge model (eager: ``supports_compile = False``), both through the
    one halo exchange: the message passing's one-graph evaluation plus torch-pme's sum."""
    pytest.importorskip("torchpme")
    from oracles import ase_results, torchpme_results
    from test_coulomb import CUTOFF, coulomb_systems
    from toy_models import ChargeTransfer

    from ase_shard.models import Coulomb

    torch._dynamo.reset()
    atoms = coulomb_systems()["molten"]
    passing = ToyMessagePassing(num_layers=2)
    coulomb = Coulomb(charges=ChargeTransfer(), method="pme", cutoff=CUTOFF)

    def reference() -> dict:
        first = evaluate_periodic_graph(passing, atoms)
        second = torchpme_results(coulomb, atoms)
        return {key: first[key] + second[key] for key in second}

    ref = on_root(reference)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    calc = ShardedCalculator(passing + coulomb, compile="aot_eager", halo="layer")
    got = ase_results(calc, atoms)
    assert_close_to(got, ref, RTOL)
    assert_identical_on_all_ranks(got)
    assert calc.compile_fallbacks == 0
    # the message passing's padded graph only (Coulomb runs eagerly)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
    assert 1 <= graphs <= 2


def test_a_sum_runs_d3_eagerly_by_its_kernel() -> None:
    """EMT compiled beside D3, which does not run compiled (its lists are cut by data):
    D3 takes its compiled CPU kernel, and the sum equals ASE's EMT plus dftd3's D3."""
    pytest.importorskip("dftd3")
    from ase.calculators.emt import EMT as AseEMT
    from oracles import ase_results
    from sharded import cu_bulk
    from test_d3 import CUTOFFS, dftd3_results

    from ase_shard.models import D3, EMT

    torch._dynamo.reset()
    atoms = cu_bulk()
    d3 = D3(**CUTOFFS)

    def reference() -> dict:
        emt = ase_results(AseEMT(), atoms)
        dispersion = dftd3_results(atoms, "pbe", "bj", True, **CUTOFFS)
        return {key: emt[key] + dispersion[key] for key in dispersion}

    ref = on_root(reference)
    calc = ShardedCalculator(EMT() + d3, compile="aot_eager")
    got = ase_results(calc, atoms)
    assert_close_to({key: got[key] for key in ref}, ref, RTOL)
    assert calc.compile_fallbacks == 0
    assert [block._direct is not None for block in calc._term_blocks()] == [False, True]
