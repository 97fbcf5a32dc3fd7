"""No serial rank: each rank checks and moves only its share (any rank count, or mpirun).

The same-Atoms check reads two slices per rank and call; results travel only
from their owners and only when ASE asks for them.
"""

from __future__ import annotations

import numpy as np
import pytest
from ase import Atoms
from ase.calculators.emt import EMT as AseEMT
from oracles import ase_results, relative_errors
from sharded import COMM, assert_identical_on_all_ranks, results
from systems import CASES

from ase_shard import ShardedCalculator
from ase_shard.models import EMT
from ase_shard.system import check_slices, slice_bounds

pytestmark = pytest.mark.timeout(60)

LAST = COMM.size - 1
SMALL_MOVE = 1e-4  # Å, far inside the skin: every call below reuses the decomposition


def _cu() -> Atoms:
    return CASES["cu_bulk_emt"].make_atoms()


def _assert_exact(atoms: Atoms) -> None:
    got = results(atoms)
    errors = relative_errors(got, ase_results(AseEMT(), atoms))
    assert max(errors.values()) <= 1e-10, errors
    assert_identical_on_all_ranks(got)


@pytest.mark.mpi(min_size=2)
def test_reuse_step_finds_a_rank_whose_atom_moved() -> None:
    """One atom of the last rank's own slice differs: found at the next reuse step."""
    atoms = _cu()
    calc = ShardedCalculator(EMT())
    atoms.calc = calc
    atoms.get_forces()
    atoms.positions += SMALL_MOVE
    if COMM.rank == LAST:
        atoms.positions[slice_bounds(len(atoms), COMM.size, LAST).start] += 1e-3
    with pytest.raises(ValueError, match=rf"ranks {LAST} and \d+: positions of atoms"):
        atoms.get_forces()
    assert calc.rebuilds == 1  # found before any rebuild
    atoms = _cu()
    atoms.calc = calc
    _assert_exact(atoms)


@pytest.mark.mpi(min_size=2)
def test_every_slice_is_checked_within_size_minus_one_calls() -> None:
    """The last rank's copy differs in slice 0, which it visits in turn."""
    atoms = _cu()
    atoms.calc = ShardedCalculator(EMT())
    atoms.get_forces()
    if COMM.rank == LAST:
        atoms.positions[slice_bounds(len(atoms), COMM.size, 0).start] += 1e-3
    found = None
    for call in range(1, COMM.size):
        atoms.positions += SMALL_MOVE  # the same move on every rank: a new calculation
        try:
            atoms.get_forces()
        except ValueError as error:
            found = call, str(error)
            break
    assert found is not None
    assert "positions of atoms" in found[1] and f"ranks 0 and {LAST}" in found[1]


def test_per_atom_stresses_are_stored_only_when_asked_for() -> None:
    """Any call brings what ASE's EMT does (energies, forces); per-atom stresses only
    when asked for, and then exact."""
    atoms = _cu()
    calc = ShardedCalculator(EMT())
    atoms.calc = calc
    atoms.get_potential_energy()
    assert {"energy", "free_energy", "energies", "forces", "stress"} <= set(calc.results)
    assert "stresses" not in calc.results
    _assert_exact(atoms)  # asks for every property
    assert "stresses" in calc.results


def test_bytes_received_per_reuse_step() -> None:
    """A reuse step brings each rank the other owners' energies and forces, its ghosts'
    sums of both and one (energy, virial) row of compensated sums (pairs) per other
    rank: no broadcast of the whole result. EMT's
    kernel, taking each pair between two ranks on one of them, also brings its owned
    atoms' density sums from the ghosts (2 numbers each) and its ghosts' dE/dsigma (1)."""
    atoms = _cu()
    calc = ShardedCalculator(EMT())
    atoms.calc = calc
    atoms.get_forces()
    rows = calc._state.rows
    others = COMM.size - 1
    for ask in atoms.get_forces, atoms.get_potential_energy:
        atoms.positions += SMALL_MOVE
        before = calc.comm.received_bytes
        ask()
        received = calc.comm.received_bytes - before
        expected = others * 7 * 2 * 8
        if others:
            expected += (len(rows.send_index) * 2 + rows.n_nodes - rows.n_owned) * 8
        per_atom = 4  # energy and force
        expected += (len(rows.send_index) + len(atoms) - rows.n_owned) * per_atom * 8
        assert received == expected
    assert calc.rebuilds == 1


def test_check_slices_cover_every_rank_and_slice() -> None:
    for size in range(2, 7):
        seen = set()
        for call in range(size - 1):
            checked = [check_slices(size, rank, call) for rank in range(size)]
            # every slice is checked by exactly two ranks, one of them its own
            counts = np.bincount([k for pair in checked for k in pair], minlength=size)
            assert (counts == 2).all()
            assert all(pair[0] == rank for rank, pair in enumerate(checked))
            seen |= {(rank, k) for rank, pair in enumerate(checked) for k in pair}
        assert seen == {(rank, k) for rank in range(size) for k in range(size)}
    assert check_slices(1, 0, 5) == ()
