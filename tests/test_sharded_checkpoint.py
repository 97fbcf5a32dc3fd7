"""Checkpoints (``ase_shard.checkpoint``): a run stopped, written, read back into new
objects and resumed ends where the same run without a stop ends (ASE's integrators,
each with its own state: Langevin's and Bussi's random numbers, the Nosé-Hoover
chains, the MTK barostats); distributed atoms are written by every rank, its own
atoms only, and read on any number of ranks; a write is all or nothing. Run plainly
and under ``mpirun -n 2, 3, 4``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from ase import units
from ase.md.bussi import Bussi
from ase.md.langevin import Langevin as AseLangevin
from ase.md.nose_hoover_chain import MTKNPT
from ase.md.nose_hoover_chain import IsotropicMTKNPT as AseIsotropicMTKNPT
from ase.md.nose_hoover_chain import NoseHooverChainNVT as AseNoseHooverChainNVT
from ase.md.velocitydistribution import thermalize_momenta
from ase.md.verlet import VelocityVerlet
from sharded import COMM

from ase_shard import ShardedCalculator, distribute
from ase_shard.checkpoint import (
    MANIFEST,
    checkpoints,
    read_checkpoint,
    restore_dynamics,
    write_checkpoint,
)
from ase_shard.distributed import GLOBAL_ID, DistributedAtoms, gather
from ase_shard.dynamics import IsotropicMTKNPT, Langevin, NoseHooverChainNVT
from ase_shard.models import EMT

DT = 2 * units.fs
BEFORE, AFTER = 10, 20  # steps before the checkpoint and after it


def _langevin(atoms, rng):
    return (Langevin if isinstance(atoms, DistributedAtoms) else AseLangevin)(
        atoms, DT, temperature_K=600, friction=0.02 / units.fs, fixcm=False, rng=rng
    )


def _nose_hoover(atoms, rng):
    kind = NoseHooverChainNVT if isinstance(atoms, DistributedAtoms) else AseNoseHooverChainNVT
    return kind(atoms, DT, temperature_K=600, tdamp=40 * units.fs)


def _isotropic_mtk(atoms, rng):
    kind = IsotropicMTKNPT if isinstance(atoms, DistributedAtoms) else AseIsotropicMTKNPT
    return kind(
        atoms, DT, temperature_K=600, pressure_au=2e4 * units.bar, tdamp=40 * units.fs,
        pdamp=400 * units.fs,
    )


INTEGRATORS = {
    "nve": lambda atoms, rng: VelocityVerlet(atoms, DT),
    "langevin": _langevin,
    "bussi": lambda atoms, rng: Bussi(atoms, DT, temperature_K=600, taut=40 * units.fs, rng=rng),
    "nose-hoover": _nose_hoover,
    "isotropic-mtk": _isotropic_mtk,
    "mtk": lambda atoms, rng: MTKNPT(
        atoms, DT, temperature_K=600, pressure_au=2e4 * units.bar, tdamp=40 * units.fs,
        pdamp=400 * units.fs,
    ),
}
# ase_shard's drivers for distributed atoms (ASE's MTKNPT keeps per-atom arrays)
DISTRIBUTED = ("nve", "langevin", "bussi", "nose-hoover", "isotropic-mtk")


def _system(distributed: bool):
    """256 rattled Cu atoms at 600 K."""
    from ase.build import bulk

    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(4)
    atoms.rattle(0.05, seed=1)
    thermalize_momenta(atoms, temperature_K=600, rng=np.random.default_rng(3))
    return distribute(atoms) if distributed else atoms


def _whole(atoms):
    """Every atom, in the original order (on rank 0 for distributed atoms; else None)."""
    return gather(atoms) if isinstance(atoms, DistributedAtoms) else atoms


def _shared_dir(tmp_path: Path) -> Path:
    return Path(COMM.bcast(str(tmp_path)))


@pytest.mark.parametrize(
    ("name", "distributed"),
    [(name, False) for name in INTEGRATORS] + [(name, True) for name in DISTRIBUTED],
    ids=[f"{n}-replicated" for n in INTEGRATORS] + [f"{n}-distributed" for n in DISTRIBUTED],
)
def test_resumed_run_ends_where_the_uninterrupted_one_does(
    tmp_path: Path, name: str, distributed: bool
) -> None:
    make = INTEGRATORS[name]
    directory = _shared_dir(tmp_path)
    whole = _system(distributed)
    whole.calc = ShardedCalculator(EMT())
    make(whole, np.random.default_rng(9)).run(BEFORE + AFTER)

    atoms = _system(distributed)
    atoms.calc = ShardedCalculator(EMT())
    dyn = make(atoms, np.random.default_rng(9))
    dyn.run(BEFORE)
    write_checkpoint(directory, atoms, dyn)
    ends = {}
    for restore in (True, False):
        saved = read_checkpoint(directory)
        assert saved.step == BEFORE
        resumed = saved.atoms
        resumed.calc = ShardedCalculator(EMT())
        # new objects throughout, and a generator seeded otherwise: the state is the file's
        dyn = make(resumed, np.random.default_rng(12345))
        if restore:
            restore_dynamics(dyn, saved)
        else:
            dyn.nsteps = saved.step
        dyn.run(AFTER)
        assert dyn.nsteps == BEFORE + AFTER
        ends[restore] = _whole(resumed)
    expected = _whole(whole)
    if expected is not None:
        got = ends[True]
        assert np.abs(got.positions - expected.positions).max() <= 1e-10
        assert np.abs(got.get_momenta() - expected.get_momenta()).max() <= 1e-10
        assert np.abs(got.cell.array - expected.cell.array).max() <= 1e-10
        if name != "nve":  # the integrator's own state matters: without it the runs part
            assert np.abs(ends[False].positions - expected.positions).max() > 1e-6


def test_each_rank_writes_its_own_atoms_and_any_ranks_read_them(tmp_path: Path) -> None:
    """Distributed atoms: one file per rank holding that rank's atoms; read back whole on
    every rank, and in shares on 1..P ranks (a split of the run's ranks), the same atoms
    bit for bit."""
    from mpi4py import MPI

    directory = _shared_dir(tmp_path)
    atoms = _system(True)
    atoms.calc = ShardedCalculator(EMT())
    dyn = VelocityVerlet(atoms, DT)
    dyn.run(3)  # atoms have migrated to their domains
    path = write_checkpoint(directory, atoms, dyn, record={"note": "test"})
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["files"] == COMM.allgather(len(atoms))
    with np.load(path / f"atoms-{COMM.rank:05d}.npz") as own:
        assert np.array_equal(own[f"array:{GLOBAL_ID}"], atoms.arrays[GLOBAL_ID])
    expected = _whole(atoms)
    replicated = read_checkpoint(directory, distributed=False)
    assert replicated.record == {"note": "test"} and len(replicated.atoms) == 256
    for readers in range(1, COMM.size + 1):
        sub = MPI.COMM_WORLD.Split(0 if COMM.rank < readers else MPI.UNDEFINED, COMM.rank)
        if sub != MPI.COMM_NULL:
            saved = read_checkpoint(directory, comm=sub)
            share = saved.atoms
            assert isinstance(share, DistributedAtoms) and share.n_global == 256
            assert len(share) in (256 // readers, 256 // readers + 1)
            again = gather(share)
            if sub.Get_rank() == 0:
                for got in (again, replicated.atoms):
                    assert np.array_equal(got.positions, expected.positions)
                    assert np.array_equal(got.get_momenta(), expected.get_momenta())
                    assert np.array_equal(got.numbers, expected.numbers)
            sub.Free()
        COMM.bcast(None)  # the readers are done before the next split


def test_a_write_is_all_or_nothing_and_the_last_ones_are_kept(tmp_path: Path) -> None:
    """A checkpoint a kill cut short (no manifest: the rename never happened) and a
    half-written one are not read; the next write removes the half-written one; the
    last ``keep`` stay."""
    directory = _shared_dir(tmp_path)
    atoms = _system(False)
    atoms.calc = ShardedCalculator(EMT())
    dyn = VelocityVerlet(atoms, DT)
    write_checkpoint(directory, atoms, dyn, keep=2)
    if COMM.is_root:  # what kills at two moments of a write leave behind
        (directory / ".writing-000000099-deadbeef").mkdir()
        (directory / "step-000000050").mkdir()
    COMM.bcast(None)  # the leftovers are there before any rank reads
    assert read_checkpoint(directory).step == 0
    for _ in range(3):
        dyn.run(2)
        write_checkpoint(directory, atoms, dyn, keep=2)
    names = sorted(path.name for path in directory.iterdir())
    assert names == ["step-000000004", "step-000000006", "step-000000050"]
    assert [path.name for path in checkpoints(directory)] == names[:2]
    assert read_checkpoint(directory).step == 6
    # a step written already (a stop on a checkpoint step) is not written twice
    assert write_checkpoint(directory, atoms, dyn, keep=2) == directory / "step-000000006"
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        read_checkpoint(directory / "step-000000050")
