"""No serial rank: each rank checks and moves only its share (any rank count, or mpirun).

Each rank validates and votes over its own atoms; results travel only from
their owners and only when ASE asks for them. (The same-Atoms check compares
every rank's whole copy at every call: test_sharded_bad_inputs.py.)
"""

from __future__ import annotations

import pytest
from ase import Atoms
from ase.calculators.emt import EMT as AseEMT
from oracles import ase_results, relative_errors
from sharded import COMM, assert_identical_on_all_ranks, results
from systems import CASES

from ase_shard import ShardedCalculator
from ase_shard.models import EMT

pytestmark = pytest.mark.timeout(60)

SMALL_MOVE = 1e-4  # Å, far inside the skin: every call below reuses the decomposition


def _cu() -> Atoms:
    return CASES["cu_bulk_emt"].make_atoms()


def _assert_exact(atoms: Atoms) -> None:
    got = results(atoms)
    errors = relative_errors(got, ase_results(AseEMT(), atoms))
    assert max(errors.values()) <= 1e-10, errors
    assert_identical_on_all_ranks(got)


def test_only_requested_per_atom_results_are_stored() -> None:
    """Forces alone bring no per-atom energies or stresses; asking brings them, exact."""
    atoms = _cu()
    calc = ShardedCalculator(EMT())
    atoms.calc = calc
    atoms.get_forces()
    assert {"energy", "free_energy", "forces", "stress"} <= set(calc.results)
    assert not {"energies", "stresses"} & set(calc.results)
    _assert_exact(atoms)  # asks for every property
    assert {"energies", "stresses"} <= set(calc.results)


def test_bytes_received_per_reuse_step() -> None:
    """A reuse step brings each rank the other owners' forces, its ghosts' force sums and
    one (energy, virial) row per other rank: no broadcast of the whole result. EMT's
    kernel, taking each pair between two ranks on one of them, also brings its owned
    atoms' density sums from the ghosts (2 numbers each) and its ghosts' dE/dsigma (1)."""
    atoms = _cu()
    calc = ShardedCalculator(EMT())
    atoms.calc = calc
    atoms.get_forces()
    rows = calc._state.rows
    others = COMM.size - 1
    for ask, per_atom in ((atoms.get_forces, 3), (atoms.get_potential_energy, 0)):
        atoms.positions += SMALL_MOVE
        before = calc.comm.received_bytes
        ask()
        received = calc.comm.received_bytes - before
        expected = others * 7 * 8
        if others:
            expected += (len(rows.send_index) * 2 + rows.n_nodes - rows.n_owned) * 8
        if per_atom:
            ghost_sums = len(rows.send_index) * per_atom * 8
            expected += ghost_sums + (len(atoms) - rows.n_owned) * per_atom * 8
        assert received == expected
    assert calc.rebuilds == 1
