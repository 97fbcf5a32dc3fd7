"""Per-atom and per-system model inputs, at any rank count.

The oracle is the one-graph periodic evaluation with the same inputs; runs
under plain pytest (one rank) and ``mpirun -n P python -m pytest --with-mpi``.
"""

from __future__ import annotations

import numpy as np
import pytest
from oracles import evaluate_periodic_graph, relative_errors
from sharded import (
    COMM,
    assert_close_to,
    assert_identical_on_all_ranks,
    assert_ranks_own_nothing_iff_fewer_atoms,
    fewer_atoms_than_ranks,
    random_gas,
    results,
)
from toy_models import ChargedPairs

from ase_shard import ShardedCalculator
from ase_shard.inputs import ModelInputs

RTOL = 1e-10


def charged_gas(pbc, seed: int = 0):
    atoms = random_gas(pbc, seed=seed)
    rng = np.random.default_rng(seed + 100)
    atoms.set_initial_charges(rng.uniform(-1.0, 1.0, len(atoms)))
    atoms.set_array("spins", rng.uniform(-2.0, 2.0, len(atoms)))
    atoms.info["charge"] = 1.5
    return atoms


def oracle(atoms) -> dict:
    inputs = {"initial_charges": atoms.get_initial_charges(), "spins": atoms.arrays["spins"]}
    system = {"charge": atoms.info.get("charge", 1.5)}
    return evaluate_periodic_graph(ChargedPairs(), atoms, inputs=inputs, system=system)


def assert_matches_oracle(atoms) -> dict:
    got = results(atoms)
    ref = oracle(atoms)
    errors = relative_errors(got, {key: ref[key] for key in got})
    assert all(err <= RTOL for err in errors.values()), errors
    assert_identical_on_all_ranks(got)
    return got


@pytest.mark.parametrize("partition", ["spatial", "contiguous"])
@pytest.mark.parametrize(
    "pbc", [(True, True, True), (True, False, True), (False, False, False)], ids=str
)
def test_inputs_reach_owned_and_ghost_atoms(pbc, partition: str) -> None:
    atoms = charged_gas(pbc)
    atoms.calc = ShardedCalculator(ChargedPairs(), partition=partition)
    assert_matches_oracle(atoms)


@pytest.mark.parametrize("name", ["one", "two"])
def test_inputs_with_ranks_that_own_nothing(name: str) -> None:
    """Fewer atoms than ranks: an empty rank packs no rows of the per-atom inputs (an
    empty array once failed to take its width there, on that rank alone)."""
    atoms = fewer_atoms_than_ranks()[name]
    atoms.set_initial_charges([0.8, -0.3][: len(atoms)])
    atoms.set_array("spins", np.array([1.5, -0.5][: len(atoms)]))
    atoms.info["charge"] = 0.5
    atoms.calc = ShardedCalculator(ChargedPairs())
    got = results(atoms)
    # the lone atom's forces vanish by symmetry: compared absolutely
    assert_close_to(got, {key: value for key, value in oracle(atoms).items() if key in got}, RTOL)
    assert_identical_on_all_ranks(got)
    assert_ranks_own_nothing_iff_fewer_atoms(atoms.calc, len(atoms))


def test_changed_inputs_are_recomputed() -> None:
    """Every declared input triggers a new calculation, also those ASE ignores."""
    atoms = charged_gas((True, True, True))
    calc = ShardedCalculator(ChargedPairs(), skin=1.0)
    atoms.calc = calc
    energies = [assert_matches_oracle(atoms)["energy"]]

    charges = atoms.get_initial_charges()
    charges[7] += 0.5
    atoms.set_initial_charges(charges)  # ASE notices this one itself
    energies.append(assert_matches_oracle(atoms)["energy"])
    atoms.arrays["spins"][3] *= -1.0  # in place: ASE does not notice
    energies.append(assert_matches_oracle(atoms)["energy"])
    atoms.info["charge"] = -1.0  # atoms.info: ASE does not notice
    energies.append(assert_matches_oracle(atoms)["energy"])
    # small moves reuse the decomposition: inputs still travel with the atoms
    atoms.positions += np.random.default_rng(1).uniform(-0.2, 0.2, atoms.positions.shape)
    energies.append(assert_matches_oracle(atoms)["energy"])

    assert len(set(np.round(energies, 12).tolist())) == len(energies)
    assert calc.rebuilds == 1


def test_inputs_follow_migrating_atoms() -> None:
    """Large moves rebuild the decomposition; each atom keeps its own values."""
    atoms = charged_gas((True, True, False), seed=3)
    # random moves bring atoms closer than any real structure: no min_distance
    calc = ShardedCalculator(ChargedPairs(), skin=0.3, min_distance=0)
    atoms.calc = calc
    rng = np.random.default_rng(5)
    for _ in range(3):
        atoms.positions += rng.uniform(-1.5, 1.5, atoms.positions.shape)
        assert_matches_oracle(atoms)
    assert calc.rebuilds == 3


def test_system_value_from_calculator_parameters() -> None:
    atoms = charged_gas((True, True, True))
    del atoms.info["charge"]
    atoms.calc = ShardedCalculator(ChargedPairs(), charge=1.5)
    assert_matches_oracle(atoms)
    atoms.info["charge"] = 1.5  # atoms.info takes precedence: same value, same result
    assert_matches_oracle(atoms)


class DefaultCharge(ChargedPairs):
    """ChargedPairs whose charge defaults to 1.5 (a model's ``system_input_defaults``)."""

    system_input_defaults = {"charge": lambda atoms: 1.5}


def test_system_value_from_model_defaults() -> None:
    """A model's default comes after atoms.info and the calculator's parameters."""
    atoms = charged_gas((True, True, True))
    del atoms.info["charge"]
    atoms.calc = ShardedCalculator(DefaultCharge())
    assert_matches_oracle(atoms)
    inputs = ModelInputs.of(DefaultCharge())
    assert inputs.system_values(atoms, {}) == {"charge": 1.5}
    assert inputs.system_values(atoms, {"charge": 2}) == {"charge": 2.0}
    atoms.info["charge"] = 3
    assert inputs.system_values(atoms, {"charge": 2}) == {"charge": 3.0}


def test_missing_inputs_raise_on_every_rank() -> None:
    atoms = charged_gas((True, True, True))
    del atoms.info["charge"]
    atoms.calc = ShardedCalculator(ChargedPairs())
    with pytest.raises(ValueError, match=r"atoms.info\['charge'\]"):
        atoms.get_potential_energy()
    atoms.info["charge"] = 0.0
    del atoms.arrays["spins"]
    with pytest.raises(ValueError, match="set_array"):
        atoms.get_potential_energy()
    atoms.set_array("spins", np.full(len(atoms), np.nan))
    with pytest.raises(ValueError, match="not finite"):
        atoms.get_potential_energy()


@pytest.mark.mpi(min_size=2)
def test_inputs_differing_between_ranks_are_refused() -> None:
    atoms = charged_gas((True, True, True))
    atoms.arrays["spins"][0] += COMM.rank  # positions agree, one input does not
    atoms.calc = ShardedCalculator(ChargedPairs())
    with pytest.raises(ValueError, match="model inputs"):
        atoms.get_potential_energy()
