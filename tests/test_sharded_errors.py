"""Bad input and failing ranks raise one clear error on every rank, never a hang.

Runs at any rank count; ``make test`` runs it under mpirun with 2, 3 and 4
ranks. Each test has a short timeout so a hang fails fast.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import bulk
from oracles import ase_results, relative_errors
from sharded import COMM, cu_bulk, results
from systems import CASES

from ase_shard import ShardedCalculator
from ase_shard.models import EMT, LennardJones

pytestmark = pytest.mark.timeout(60)



def _assert_usable(atoms: Atoms) -> None:
    """The calculator attached to ``atoms`` gives exact results after an error."""
    errors = relative_errors(
        results(atoms), ase_results(CASES["cu_bulk_emt"].make_ase_calc(), atoms)
    )
    assert max(errors.values()) <= 1e-10, errors


def test_non_finite_positions() -> None:
    atoms = cu_bulk()
    atoms.calc = ShardedCalculator(EMT())
    good = atoms.positions.copy()
    atoms.positions[5, 1] = np.nan
    with pytest.raises(ValueError, match=r"not finite \(first: atom 5"):
        atoms.get_forces()
    atoms.positions[5, 1] = np.inf
    with pytest.raises(ValueError, match="not finite"):
        atoms.get_potential_energy()
    atoms.positions = good
    _assert_usable(atoms)


def test_zero_cell_vector_on_periodic_axis() -> None:
    atoms = Atoms("Ar2", positions=[[0, 0, 0], [1.2, 0, 0]], cell=[5.0, 5.0, 0.0], pbc=True)
    atoms.calc = ShardedCalculator(LennardJones())
    with pytest.raises(ValueError, match="axis 2 is periodic but its cell vector is zero"):
        atoms.get_potential_energy()


def test_degenerate_periodic_cell() -> None:
    cell = [[4.0, 0, 0], [8.0, 0, 0], [0, 0, 4.0]]
    atoms = Atoms("Ar2", positions=[[0, 0, 0], [1.2, 0, 0]], cell=cell, pbc=True)
    atoms.calc = ShardedCalculator(LennardJones())
    with pytest.raises(ValueError, match="linearly dependent"):
        atoms.get_potential_energy()


def test_unsupported_element() -> None:
    atoms = cu_bulk()
    atoms.calc = ShardedCalculator(EMT())
    atoms.numbers[[3, 7]] = [92, 26]
    with pytest.raises(ValueError, match="does not support Fe, U"):
        atoms.get_potential_energy()
    atoms.numbers[[3, 7]] = 29
    _assert_usable(atoms)


@pytest.mark.mpi(min_size=2)
def test_ranks_with_different_atoms() -> None:
    atoms = cu_bulk()
    atoms.calc = ShardedCalculator(EMT())
    if COMM.rank == COMM.size - 1:
        atoms.positions[0] += 0.01
    with pytest.raises(ValueError, match=rf"rank {COMM.size - 1}: positions"):
        atoms.get_potential_energy()
    atoms.positions = cu_bulk().positions
    _assert_usable(atoms)


class FailsOnOneRank(torch.nn.Module):
    """LennardJones that raises inside ``forward`` on one rank while ``armed``."""

    def __init__(self, rank: int):
        super().__init__()
        self.inner = EMT()
        self.cutoff, self.num_layers = self.inner.cutoff, 1
        self.atomic_types = self.inner.atomic_types
        self.rank, self.armed = rank, True

    def forward(self, graph):
        if self.armed and COMM.rank == self.rank:
            raise FloatingPointError("model blew up")
        return self.inner(graph)


def test_model_error_on_one_rank_raises_everywhere() -> None:
    failing_rank = COMM.size - 1
    model = FailsOnOneRank(failing_rank)
    atoms = cu_bulk()
    atoms.calc = ShardedCalculator(model)
    with pytest.raises(FloatingPointError, match=rf"model blew up \[rank {failing_rank}\]"):
        atoms.get_forces()
    model.armed = False
    _assert_usable(atoms)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="partition"):
        ShardedCalculator(EMT(), partition="random")
    with pytest.raises(ValueError, match="multiply"):
        ShardedCalculator(EMT(), grid=(COMM.size + 1, 1, 1))
    for half in (torch.float16, torch.bfloat16):
        with pytest.raises(ValueError, match="dtype=torch.float32"):
            ShardedCalculator(EMT(), dtype=half)
    # a half-precision model is refused unless a supported dtype is asked for
    with pytest.raises(ValueError, match="half"):
        ShardedCalculator(EMT().to(torch.bfloat16))
    assert ShardedCalculator(EMT().to(torch.bfloat16), dtype=torch.float32).dtype == torch.float32


def test_empty_atoms() -> None:
    atoms = bulk("Cu", cubic=True)[[]]
    atoms.calc = ShardedCalculator(EMT())
    assert atoms.get_potential_energy() == 0.0
    assert atoms.get_forces().shape == (0, 3)
    assert (atoms.get_stress() == 0.0).all()


@pytest.mark.mpi(min_size=2)
def test_ranks_with_different_model_weights() -> None:
    from toy_models import ToyMessagePassing

    with pytest.raises(ValueError, match=r"parameters on ranks \[1"):
        ShardedCalculator(ToyMessagePassing(seed=COMM.rank))


@pytest.mark.mpi(min_size=2)
def test_unseeded_thermostat_is_named_not_hung() -> None:
    """Each rank draws its own noise without a shared seed: a clear error, no hang."""
    import warnings

    from ase.md.langevinbaoab import LangevinBAOAB
    from ase.units import fs

    atoms = cu_bulk()
    atoms.calc = ShardedCalculator(EMT())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ASE warns that it seeded an rng itself
        dynamics = LangevinBAOAB(atoms, timestep=2 * fs, temperature_K=300, T_tau=50 * fs)
    with pytest.raises(ValueError, match=r"positions.*seed random numbers identically"):
        dynamics.run(3)
