"""The plan's arithmetic, in one process: its fit, its extrapolation and its projection.

The plan's geometry and traffic against real runs: tests/test_sharded_plan.py; its
memory against real runs: tests/test_plan_launch.py.
"""

from __future__ import annotations

import pytest
from ase.build import bulk

from ase_shard.models import EMT
from ase_shard.plan import _per_node_and_edge, plan

pytestmark = pytest.mark.timeout(120)


def copper(repeat: int):
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(repeat)
    atoms.rattle(0.02, seed=3)
    return atoms


def test_per_node_and_edge_recovers_a_linear_cost() -> None:
    """Two blocks of different edges per node give both costs back; where noise would
    make one negative, the other alone explains the blocks."""
    blocks = [(100, 4000, 100 * 300 + 4000 * 40), (250, 3000, 250 * 300 + 3000 * 40)]
    assert _per_node_and_edge(blocks) == pytest.approx((300, 40))
    # the exact solution would price an edge at -10 B: the nodes alone (1,580 B each,
    # their least squares) miss the blocks by 4,000 B, the edges alone by 19,000
    node, edge = _per_node_and_edge([(100, 4000, 160_000), (100, 4400, 156_000)])
    assert (node, edge) == (pytest.approx(1580), 0.0)


@pytest.mark.parametrize("distributed", [False, True])
def test_largest_system_extrapolates_to_a_larger_plan(distributed: bool) -> None:
    """What the plan of 4,000 atoms on 2 ranks says fits the peak that the plan of
    13,500 atoms gives its busiest rank is within 20 % of 13,500 atoms, and not more
    (its ghosts per atom are the smaller system's, 3,150 per 6,750 owned at 13,500
    atoms but 1,400 per 2,000 at 4,000: a conservative guess, by as much as a ghost
    costs against an owned atom in the calibration)."""
    small = plan(copper(10), EMT(), 2, distributed=distributed)
    large = plan(copper(15), EMT(), 2, distributed=distributed, calibration=small.calibration)
    fits = small.largest_system(max(large.peak_memory_per_rank))
    assert 0.8 * large.n_atoms <= fits <= large.n_atoms
    # and the smaller plan's own peak is its own size
    assert small.largest_system(max(small.peak_memory_per_rank)) == pytest.approx(
        small.n_atoms, rel=1e-3
    )


def test_projected_efficiency_is_the_busiest_ranks_share() -> None:
    """Without communication costs the projection is one rank's time over P times the
    busiest rank's; communication only lowers it; more ranks on a small system lower it."""
    atoms = copper(8)
    one = plan(atoms, EMT(), 1)
    two = plan(atoms, EMT(), 2)
    free = two.projected_efficiency(one, bandwidth=float("inf"), latency=0.0)
    busiest = max(rank.seconds for rank in two.per_rank)
    assert free == pytest.approx(one.per_rank[0].seconds / (2 * busiest))
    assert two.projected_efficiency(one) < free
    four = plan(atoms, EMT(), 4, calibration=two.calibration)
    assert four.projected_efficiency(one) < two.projected_efficiency(one)
    assert one.projected_efficiency(one) == pytest.approx(1.0, abs=1e-3)
