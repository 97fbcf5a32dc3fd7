"""``calc.balance``: each rank's owned atoms, ghost atoms and listed edges, against counts
made without the calculator (the owners' histogram, the ghost rows' distinct foreign
atoms, ASE's neighbour list); and ``balance="work"``: cuts that even out the pairs of a
liquid beside its vapour, counted by ASE's neighbour list, cut again when the work
moves and only then, with ASE's results. Run plainly and under ``mpirun -n 2, 3, 4``."""

from __future__ import annotations

import numpy as np
import pytest
from ase.build import bulk
from ase.neighborlist import neighbor_list
from oracles import ase_results
from sharded import (
    COMM,
    assert_close_to,
    assert_ranks_own_nothing_iff_fewer_atoms,
    fewer_atoms_than_ranks,
    results,
)

from ase_shard import ShardedCalculator, distribute
from ase_shard.balance import NODE_WORK, REBALANCE_ABOVE, max_over_mean
from ase_shard.distributed import GLOBAL_ID
from ase_shard.md import ASE_CALCULATORS, MODELS
from ase_shard.models import EMT, LennardJones
from ase_shard.presets import SYSTEMS

SKIN = 0.5  # Å, ShardedCalculator's default


def _atoms():
    """500 rattled Cu atoms in an 18 Å cube: wider than twice any reach here, so no
    pair is listed twice as an atom's own periodic image."""
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(5)
    atoms.rattle(0.05, seed=3)
    return atoms


@pytest.mark.parametrize("make", [EMT, lambda: LennardJones(sigma=2.3, epsilon=0.4, rc=6.0)])
def test_balance_counts_each_ranks_work(make) -> None:
    atoms = _atoms()
    model = make()
    calc = ShardedCalculator(model, skin=SKIN)
    atoms.calc = calc
    atoms.get_forces()
    balance = calc.balance
    owners = calc.decomposition.owners
    assert balance.owned == tuple(np.bincount(owners, minlength=COMM.size))
    # a ghost is an atom of another rank that this rank evaluates (its images fold
    # onto it): the distinct foreign atoms among this rank's ghost rows
    rows = calc.decomposition.ghosts[COMM.rank].ids
    assert balance.ghosts[COMM.rank] == len(np.unique(rows[owners[rows] != COMM.rank]))
    # the built-in potentials list every pair within the reach once, on one rank
    pairs = len(neighbor_list("i", atoms, float(model.cutoff) + SKIN)) // 2
    assert sum(balance.edges) == pairs
    assert balance.imbalance == max(balance.edges) / np.mean(balance.edges)
    assert len(set(COMM.allgather(balance))) == 1  # every rank knows every rank's


def test_balance_with_distributed_atoms() -> None:
    atoms = _atoms()
    local = distribute(atoms if COMM.is_root else None)
    calc = ShardedCalculator(EMT(), skin=SKIN)
    local.calc = calc
    local.get_forces()
    balance = calc.balance
    assert balance.owned == tuple(COMM.allgather(len(local)))
    pairs = len(neighbor_list("i", atoms, float(EMT().cutoff) + SKIN)) // 2
    assert sum(balance.edges) == pairs


def _interface():
    """298 Ar atoms: a liquid slab (256) beside its vapour (42), in a 69 Å box."""
    return SYSTEMS["ar-interface"].build(4, 0)


def _pair_imbalance(atoms, owners: np.ndarray) -> float:
    """Most pairs within the cutoff centred on one rank's atoms over the mean (ASE's
    neighbour list of the whole system, as issue 32 counts a rank's work)."""
    centres = neighbor_list("i", atoms, float(MODELS["lj"]().cutoff))
    pairs = np.bincount(owners[centres], minlength=COMM.size)
    return pairs.max() / pairs.mean()


@pytest.mark.parametrize("distributed", [False, True], ids=["replicated", "distributed"])
def test_work_balance_evens_the_pairs_with_ase_results(distributed: bool) -> None:
    atoms = _interface()
    reference = ase_results(ASE_CALCULATORS["lj"](), atoms)
    imbalance = {}
    for balance in ("count", "work"):
        calc = ShardedCalculator(MODELS["lj"](), balance=balance)
        local = distribute(atoms if COMM.is_root else None) if distributed else atoms.copy()
        local.calc = calc
        local.get_forces()  # the first build cuts by count: no edges are known yet
        calc.request_rebuild()
        got = results(local)
        if distributed:  # each rank's atoms, by their global ids
            ids = np.concatenate(COMM.allgather(local.arrays[GLOBAL_ID]))
            owners = np.repeat(np.arange(COMM.size), COMM.allgather(len(local)))[np.argsort(ids)]
            mine = local.arrays[GLOBAL_ID]
            expected = {
                k: v if k in ("energy", "stress") else v[mine] for k, v in reference.items()
            }
        else:
            owners, expected = calc.decomposition.owners, reference
        assert_close_to(got, expected, 1e-10)
        imbalance[balance] = _pair_imbalance(atoms, owners)
        assert calc.balance.rebalances == (balance == "work" and COMM.size > 1)
    if COMM.size > 1:
        # count-balanced: the rank with the vapour has a third of the others' pairs or less
        assert imbalance["count"] > 1.15
        assert imbalance["work"] <= 1.05


def test_rebalances_when_the_work_moves_and_only_then() -> None:
    atoms = _interface()
    reference = ShardedCalculator(MODELS["lj"](), balance="count")
    calc = ShardedCalculator(MODELS["lj"]())  # balance="work", the default
    atoms.calc = calc
    atoms.get_forces()
    calc.request_rebuild()
    atoms.get_forces()  # cut by work where the ranks' work differs (not on one rank)
    assert calc.balance.rebalances == (COMM.size > 1)
    for _ in range(3):  # a vapour atom moves beyond half the skin: rebuilds, cuts kept
        atoms.positions[-1] += 0.3
        atoms.get_forces()
    assert calc.rebuilds == 5
    assert calc.balance.rebalances == (COMM.size > 1)
    # the liquid moves by a third of the box: the work the kept cuts give the ranks
    # changes; the rebuild measures it (and may cut at once where it had weighed the
    # atoms, still off balance by the measure), the next one cuts again
    atoms.positions[:, 2] += atoms.cell[2, 2] / 3.0
    atoms.get_forces()
    if COMM.size > 1:
        work_cuts = calc.layout.work_cuts
        assert calc.balance.rebalances == 2 or work_cuts.measured > REBALANCE_ABOVE
    calc.request_rebuild()
    got = results(atoms)
    assert calc.balance.rebalances == 2 * (COMM.size > 1)
    if COMM.size > 1:
        assert _pair_imbalance(atoms, calc.decomposition.owners) <= 1.05
    assert_close_to(got, results(_with(atoms, reference)), 1e-12)


def test_balanced_work_keeps_the_cuts_and_weighs_nothing() -> None:
    """Bulk: the work each rank's edges measure is even under the first cut (by count),
    so no atom is weighed and the cuts stay while the atoms move a little, over
    several rebuilds; ASE's results throughout. (The cuts pass through lattice
    planes, 50 atoms each here: moves of 0.02 Å carry enough of them across to
    tip 250 atoms a rank past :data:`REBALANCE_ABOVE`, and the atoms are weighed.)"""
    atoms = _atoms()
    calc = ShardedCalculator(EMT(), skin=SKIN)
    atoms.calc = calc
    atoms.get_forces()
    work_cuts = calc.layout.work_cuts
    first = None if work_cuts is None else work_cuts.cuts
    rng = np.random.default_rng(5)
    for _ in range(3):
        atoms.positions += rng.normal(0.0, 0.003, atoms.positions.shape)
        calc.request_rebuild()
        got = results(atoms)
        assert_close_to(got, ase_results(ASE_CALCULATORS["emt"](), atoms), 1e-10)
    assert calc.rebuilds == 4
    if COMM.size > 1:
        # the measure: every rank's edges (EMT lists a pair once: it counts at both
        # atoms) and its atoms
        balance = calc.balance
        work = 2 * np.asarray(balance.edges) + NODE_WORK * np.asarray(balance.owned)
        assert work_cuts.measured == max_over_mean(work) <= REBALANCE_ABOVE
        assert work_cuts.weights is None and balance.rebalances == 0
        assert work_cuts.cuts is first  # the first cut (by count), kept


def _with(atoms, calc):
    copy = atoms.copy()
    copy.calc = calc
    return copy


@pytest.mark.parametrize("distributed", [False, True], ids=["replicated", "distributed"])
def test_work_balance_of_a_sum_through_a_cell_change(distributed: bool) -> None:
    """A ``Sum`` (each term's edges weigh), cut again by work, then the cell scaled as a
    barostat scales it: ASE's ``SumCalculator`` of its ``LennardJones`` and
    ``MorsePotential`` to 1e-10 at each step."""
    from ase.calculators.mixing import SumCalculator

    from ase_shard.models import Sum

    atoms = _interface()
    model = Sum(MODELS["lj"](), MODELS["morse"]())
    reference = SumCalculator([ASE_CALCULATORS["lj"](), ASE_CALCULATORS["morse"]()])
    calc = ShardedCalculator(model)
    local = distribute(atoms if COMM.is_root else None) if distributed else atoms.copy()
    local.calc = calc
    for step in range(3):
        if step == 1:
            calc.request_rebuild()  # the first cut by work
        if step == 2:  # NPT: the cell and the atoms scaled together
            for system in (atoms, local):
                system.set_cell(system.cell.array * 1.01, scale_atoms=True)
        got = results(local)
        expected = ase_results(reference, atoms)
        if distributed:
            mine = local.arrays[GLOBAL_ID]
            expected = {
                k: v if k in ("energy", "stress") else v[mine] for k, v in expected.items()
            }
        assert_close_to(got, expected, 1e-10)
    assert calc.balance.rebalances == (COMM.size > 1)


def test_work_balance_with_empty_ranks() -> None:
    """Two atoms on up to 4 ranks: the cut by work leaves ranks empty, as the count
    does, with ASE's results."""
    atoms = fewer_atoms_than_ranks()["two"]
    atoms.numbers[:] = 18  # argon, for Lennard-Jones
    calc = ShardedCalculator(MODELS["lj"]())
    atoms.calc = calc
    atoms.get_forces()
    calc.request_rebuild()
    assert_close_to(results(atoms), ase_results(ASE_CALCULATORS["lj"](), atoms), 1e-10)
    assert_ranks_own_nothing_iff_fewer_atoms(calc, len(atoms))


def test_work_balance_with_the_layer_halo() -> None:
    """A message-passing model whose ghosts' features come from their owners between
    layers (``halo="layer"``), cut again by work: the one-graph periodic evaluation
    of the whole system, to 1e-10."""
    from oracles import evaluate_periodic_graph, relative_errors
    from toy_models import ToyMessagePassing

    atoms = _interface()
    model = ToyMessagePassing(cutoff=5.0, num_layers=2)
    oracle = evaluate_periodic_graph(model, atoms)
    atoms.calc = calc = ShardedCalculator(model, halo="layer")
    atoms.get_forces()
    calc.request_rebuild()
    got = results(atoms)
    errors = relative_errors(got, {key: oracle[key] for key in got if key in oracle})
    assert max(errors.values()) <= 1e-10, errors
    assert calc.balance.rebalances == (COMM.size > 1)
