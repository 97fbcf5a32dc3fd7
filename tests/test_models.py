"""Serial checks of the torch potentials against ASE's own calculators.

The oracle evaluates each model on one periodic graph holding every atom
(``oracles.evaluate_periodic_graph``): no partition, no halo, no MPI.
"""

from __future__ import annotations

import pytest
import torch
from oracles import ase_results, evaluate_periodic_graph, relative_errors
from systems import CASES, _au_cluster_with_lone_atom, _emt_alloy

from ase_shard.models import EMT, LennardJones

RTOL64 = 1e-10
# Measured worst case over the float32 cases below: 8.1e-6 (EMT alloy stress);
# LJ and Morse stay under 2e-6. Single precision rounds each edge vector and
# term to ~6e-8, and EMT's energy is a difference of terms of several eV, so
# the error is relative to a much smaller result. Near-equilibrium Cu, where
# per-atom energies are ~0.03 eV, reaches 2.6e-4, hence the alloy is used here.
RTOL32 = 5e-5


def _compare(case_name: str, rtol: float = RTOL64, dtype: torch.dtype = torch.float64) -> None:
    case = CASES[case_name]
    atoms = case.make_atoms()
    got = evaluate_periodic_graph(case.make_model().to(dtype), atoms, dtype)
    ref = ase_results(case.make_ase_calc(), atoms, case.has_stresses)
    errors = relative_errors(got, ref)
    assert all(err <= rtol for err in errors.values()), errors


@pytest.mark.parametrize("case_name", sorted(CASES))
def test_model_matches_ase(case_name: str) -> None:
    _compare(case_name)


@pytest.mark.parametrize("case_name", ["alloy_emt", "ar_triclinic_lj_smooth", "c60_morse"])
def test_float32(case_name: str) -> None:
    _compare(case_name, rtol=RTOL32, dtype=torch.float32)


def test_emt_alloy_uses_every_element() -> None:
    assert set(_emt_alloy().numbers) == set(EMT.atomic_types)
    assert len(EMT.atomic_types) == 11


def test_emt_lone_atom_energy_is_minus_e0() -> None:
    atoms = _au_cluster_with_lone_atom()
    energies = evaluate_periodic_graph(EMT(), atoms)["energies"]
    assert energies[-1] == pytest.approx(3.80, abs=1e-12)


def test_lj_default_cutoffs() -> None:
    model = LennardJones(sigma=2.0)
    assert model.cutoff == pytest.approx(6.0)
    assert model.ro == pytest.approx(0.66 * 6.0)


def test_emt_buffer_follows_model_dtype() -> None:
    model = EMT()
    assert model.table.dtype == torch.float64
    assert model.to(torch.float32).table.dtype == torch.float32
