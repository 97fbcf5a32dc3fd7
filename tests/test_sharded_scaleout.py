"""No serial rank: each rank checks and moves only its share (any rank count, or mpirun).

Each rank validates and votes over its own atoms; results travel only from
their owners (energies and forces, and per-atom stresses when asked for). (The
same-Atoms check compares every rank's whole copy at every call:
test_sharded_bad_inputs.py.)
"""

from __future__ import annotations

import pytest
from ase.calculators.emt import EMT as AseEMT
from sharded import COMM, assert_matches, cu_bulk

from ase_shard import ShardedCalculator
from ase_shard.models import EMT

pytestmark = pytest.mark.timeout(60)

SMALL_MOVE = 1e-4  # Å, far inside the skin: every call below reuses the decomposition




def test_per_atom_stresses_are_stored_only_when_asked_for() -> None:
    """Any call brings what ASE's EMT does (energies, forces); per-atom stresses only
    when asked for, and then exact."""
    atoms = cu_bulk()
    calc = ShardedCalculator(EMT())
    atoms.calc = calc
    atoms.get_potential_energy()
    assert {"energy", "free_energy", "energies", "forces", "stress"} <= set(calc.results)
    assert "stresses" not in calc.results
    assert_matches(atoms, AseEMT())  # asks for every property
    assert "stresses" in calc.results


def test_bytes_received_per_reuse_step() -> None:
    """A reuse step brings each rank the other owners' energies and forces, its ghosts'
    sums of both and one (energy, virial) row of compensated sums (pairs) per other
    rank: no broadcast of the whole result. EMT's
    kernel, taking each pair between two ranks on one of them, also brings its owned
    atoms' density sums from the ghosts (2 numbers each) and its ghosts' dE/dsigma (1)."""
    atoms = cu_bulk()
    calc = ShardedCalculator(EMT())
    atoms.calc = calc
    atoms.get_forces()
    rows = calc.layout.state.rows
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
