"""The plan at any rank count: its geometry and traffic are the run's, exactly.

Plain pytest runs one rank; ``mpirun -n P python -m pytest --with-mpi`` runs P. Every
rank plans the run of P ranks in its own process (:func:`ase_shard.plan.plan`), then
runs it: each rank's owned atoms, ghosts, listed edges and sent nodes at the first
step are ``calc.balance``'s and the layout's, and the bytes it receives in a step that
reuses the decomposition are what its halo and its communicator counted, for every
system of ``systems.CASES`` (bulk, alloy, slab, cluster, triclinic, a cell of two
atoms: empty ranks at 3 and 4), a ``Sum``, and SevenNet with either halo, with the
atoms on every rank or distributed. (Memory against the run's:
tests/test_plan_launch.py.)
"""

from __future__ import annotations

import numpy as np
import pytest
from sharded import COMM
from systems import CASES, LJ_TAIL

from ase_shard import ShardedCalculator, distribute
from ase_shard.models import LennardJones, Morse
from ase_shard.plan import plan

pytestmark = pytest.mark.timeout(300)

MODES = ("replicated", "distributed")
SMALL_MOVE = 1e-4  # Å, far inside the skin: the step reuses the decomposition


def assert_run_is_planned(atoms, model, mode: str, **options) -> None:
    """The plan of ``atoms`` with ``model`` on this job's ranks against its run."""
    planned = plan(
        atoms, model, COMM.size, distributed=mode == "distributed", calibration_atoms=24,
        **options,
    )
    if mode == "distributed":
        atoms = distribute(atoms)
    calc = ShardedCalculator(model, **options)
    atoms.calc = calc
    atoms.get_forces()
    balance, counts = calc.balance, calc.layout.state.counts
    assert [(r.owned, r.ghosts, r.edges, r.sent) for r in planned.per_rank] == [
        (balance.owned[k], balance.ghosts[k], balance.edges[k], counts[k, 3])
        for k in range(COMM.size)
    ]
    assert [r.rows for r in planned.per_rank] == list(counts[:, 0])
    # a step that reuses the decomposition (the same moves on every rank replicated)
    rng = np.random.default_rng(COMM.rank if mode == "distributed" else 0)
    halo, received = calc.halo.plan.received_bytes, calc.comm.received_bytes
    atoms.positions = atoms.positions + rng.uniform(-SMALL_MOVE, SMALL_MOVE, (len(atoms), 3))
    atoms.get_forces()
    assert calc.rebuilds == 1
    mine = planned.per_rank[COMM.rank]
    assert calc.halo.plan.received_bytes - halo == mine.halo_bytes
    assert calc.comm.received_bytes - received == mine.halo_bytes + mine.result_bytes
    assert (mine.halo_bytes > 0) == (COMM.size > 1 and mine.ghosts > 0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_plan_is_the_runs_geometry_and_traffic(name: str, mode: str) -> None:
    case = CASES[name]
    assert_run_is_planned(case.make_atoms(), case.make_model(), mode)


@pytest.mark.parametrize("mode", MODES)
def test_plan_of_a_sum(mode: str) -> None:
    """Each term's edges at its own cutoff are counted, and each term's exchanges."""
    atoms = CASES["ar_triclinic_lj"].make_atoms()
    model = LennardJones(**LJ_TAIL) + Morse(
        epsilon=0.01, r0=3.8, rho0=6.0, rcut1=4.0, rcut2=4.5
    )
    assert_run_is_planned(atoms, model, mode)


@pytest.mark.parametrize("halo", ["layer", "full"])
@pytest.mark.parametrize("mode", MODES)
def test_plan_of_sevennet(mode: str, halo: str) -> None:
    """A message-passing model: the per-layer halo's exchanges (features forward,
    their gradients back, per layer) are recorded and priced; the full halo lists the
    ghosts' edges out to the receptive field."""
    pytest.importorskip("sevenn")
    from test_sevenn import tiny_sevennet, tiny_systems

    from ase_shard.models.sevenn import SevenNet

    assert_run_is_planned(tiny_systems()["bulk"], SevenNet(tiny_sevennet()), mode, halo=halo)
