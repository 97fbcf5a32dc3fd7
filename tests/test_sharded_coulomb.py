"""Coulomb (Ewald and PME) at any rank count: torch-pme's own calculators as the oracle.

Plain pytest runs one rank; ``mpirun -n P python -m pytest --with-mpi`` runs P (2, 3
and 4 in ``make test``). Rank 0 computes the references (``tests/oracles.py``'s
``torchpme_results``: torch-pme's ``EwaldCalculator`` or ``PMECalculator`` on the whole
system, in one process) and broadcasts them. The ranks sum their structure factors or
charge meshes; with charges from a model, the ghosts' charges come from their owners
(per-layer halo) or from their own edges (full halo) and dE/dq flows back.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("torchpme")

from ase.calculators.lj import LennardJones as AseLennardJones  # noqa: E402
from oracles import ase_results, relative_errors, torchpme_results  # noqa: E402
from sharded import (  # noqa: E402
    COMM,
    assert_close_to,
    assert_identical_on_all_ranks,
    assert_ranks_own_nothing_iff_fewer_atoms,
    fewer_atoms_than_ranks,
    on_root,
)
from test_coulomb import CUTOFF, RTOL, coulomb_systems  # noqa: E402
from toy_models import ChargeTransfer  # noqa: E402

from ase_shard import ShardedCalculator  # noqa: E402
from ase_shard.distributed import distribute  # noqa: E402
from ase_shard.models import Coulomb, LennardJones  # noqa: E402

# a repulsive wall for NaCl in sums (sigma ~ the Na-Cl contact)
REPULSION = {"epsilon": 0.05, "sigma": 2.6, "rc": 6.0}


@pytest.mark.parametrize("method", ["ewald", "pme"])
@pytest.mark.parametrize("system", ["rocksalt", "molten", "triclinic"])
def test_matches_torchpme(system: str, method: str) -> None:
    atoms = coulomb_systems()[system]
    model = Coulomb(method=method, cutoff=CUTOFF)
    ref = on_root(lambda: torchpme_results(model, atoms))
    got = ase_results(ShardedCalculator(model), atoms)
    assert_close_to(got, ref, RTOL)
    assert_identical_on_all_ranks(got)


@pytest.mark.parametrize("method", ["ewald", "pme"])
def test_net_charge(method: str) -> None:
    """A cell that is not neutral: torch-pme's uniform background, on every rank."""
    atoms = coulomb_systems()["rocksalt"]
    atoms.set_initial_charges(atoms.get_initial_charges() + np.linspace(0.0, 0.3, len(atoms)))
    model = Coulomb(method=method, cutoff=CUTOFF)
    ref = on_root(lambda: torchpme_results(model, atoms))
    got = ase_results(ShardedCalculator(model), atoms)
    assert_close_to(got, ref, RTOL)


@pytest.mark.parametrize("halo", ["layer", "full"])
@pytest.mark.parametrize("method", ["ewald", "pme"])
def test_predicted_charges(method: str, halo: str) -> None:
    """Charges from a model: the ghosts' come from their owners or their own edges, and
    the forces carry dE/dq back through them (the oracle differentiates torch-pme's
    energy through the same model's charges on the whole system)."""
    atoms = coulomb_systems()["molten"]
    model = Coulomb(charges=ChargeTransfer(), method=method, cutoff=CUTOFF)
    ref = on_root(lambda: torchpme_results(model, atoms))
    got = ase_results(ShardedCalculator(model, halo=halo), atoms)
    assert_close_to(got, ref, RTOL)
    assert_identical_on_all_ranks(got)


@pytest.mark.parametrize("name", ["one", "two"])
def test_with_ranks_that_own_nothing(name: str) -> None:
    """Fewer atoms than ranks: the empty ranks add zero structure factors and mesh."""
    atoms = fewer_atoms_than_ranks()[name]
    atoms.set_initial_charges([0.7, -0.4][: len(atoms)])
    model = Coulomb(cutoff=CUTOFF)
    ref = on_root(lambda: torchpme_results(model, atoms))
    calc = ShardedCalculator(model)
    got = ase_results(calc, atoms)
    assert_ranks_own_nothing_iff_fewer_atoms(calc, len(atoms))
    assert_close_to(got, ref, RTOL)


def test_distributed_atoms() -> None:
    """Distributed atoms (each rank holds its own, charges travelling with them)."""
    atoms = coulomb_systems()["triclinic"]
    model = Coulomb(method="pme", cutoff=CUTOFF)
    ref = on_root(lambda: torchpme_results(model, atoms))
    local = distribute(atoms if COMM.is_root else None)
    local.calc = ShardedCalculator(model)
    got = {"energy": local.get_potential_energy(), "stress": local.get_stress()}
    order = np.argsort(np.concatenate(COMM.allgather(local.get_global_ids())))
    for name, value in (
        ("energies", local.get_potential_energies()),
        ("forces", local.get_forces()),
    ):
        got[name] = np.concatenate(COMM.allgather(value))[order]
    errors = relative_errors(got, ref)
    assert max(errors.values()) <= RTOL, errors


def test_in_a_sum() -> None:
    """A Lennard-Jones wall + Ewald: ASE's Lennard-Jones plus torch-pme's sum."""
    atoms = coulomb_systems()["molten"]
    coulomb = Coulomb(cutoff=CUTOFF)

    def reference() -> dict:
        wall = ase_results(AseLennardJones(**REPULSION, smooth=False), atoms)
        ewald = torchpme_results(coulomb, atoms)
        return {key: value + ewald[key] for key, value in wall.items()}

    ref = on_root(reference)
    got = ase_results(ShardedCalculator(LennardJones(**REPULSION) + coulomb), atoms)
    assert_close_to(got, ref, RTOL)


@pytest.mark.mpi(min_size=2)
def test_a_rank_that_fails_between_the_transposes_stops_the_others(monkeypatch) -> None:
    """The last rank's first inverse transform raises (as one out of memory would),
    between the mesh's two transposes: the others stop at the second's vote with its
    error instead of waiting in its all-to-all; the next call is exact."""
    atoms = coulomb_systems()["rocksalt"]
    model = Coulomb(method="pme", cutoff=CUTOFF)
    ref = on_root(lambda: torchpme_results(model, atoms))
    last = COMM.size - 1
    transform = torch.fft.ifft

    def fails_on_the_last_rank(*args, **kwargs):
        if COMM.rank == last:
            raise ValueError("transform failed")
        return transform(*args, **kwargs)

    calc = ShardedCalculator(model)
    atoms.calc = calc
    monkeypatch.setattr(torch.fft, "ifft", fails_on_the_last_rank)
    with pytest.raises(ValueError, match=rf"transform failed \[rank {last}\]$") as caught:
        atoms.get_forces()
    assert len(set(COMM.allgather(str(caught.value)))) == 1
    monkeypatch.undo()
    assert_close_to(ase_results(calc, atoms), ref, RTOL)
