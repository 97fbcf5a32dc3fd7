"""``ase_shard.io.ShardedTrajectory``: every rank writes its own atoms of each frame, and
``read_frames`` gives back the frames ``ase_shard.io.Trajectory`` (gathered to rank 0)
writes of the same run, bit for bit; a frame a kill cut short is skipped, and dropped
when the trajectory goes on. Run plainly and under ``mpirun -n 2, 3, 4``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from ase import units
from ase.build import bulk
from ase.io import read
from ase.md.velocitydistribution import thermalize_momenta
from ase.md.verlet import VelocityVerlet
from sharded import COMM

from ase_shard import ShardedCalculator, distribute
from ase_shard.io import ShardedTrajectory, Trajectory, read_frames
from ase_shard.models import EMT


def _local():
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(4)
    atoms.rattle(0.05, seed=1)
    thermalize_momenta(atoms, temperature_K=600, rng=np.random.default_rng(3))
    local = distribute(atoms)
    local.calc = ShardedCalculator(EMT())
    return local


def test_each_rank_writes_its_atoms_and_the_frames_are_the_gathered_ones(tmp_path: Path):
    folder = Path(COMM.bcast(str(tmp_path)))
    local = _local()
    dyn = VelocityVerlet(local, 2 * units.fs)
    with (
        ShardedTrajectory(folder / "run.shards") as shards,
        Trajectory(folder / "gathered.traj") as gathered,
    ):
        dyn.attach(lambda: shards.write(local, {"step": dyn.nsteps}), interval=4)
        dyn.attach(gathered.write, interval=4, atoms=local)
        dyn.run(12)
    # this rank's last line: its atoms of the last frame, no one else's
    index = folder / "run.shards" / f"rank-{COMM.rank:05d}.index"
    last = json.loads(index.read_text().splitlines()[-1])
    assert last["frame"] == 3 and last["rows"] == len(local) and last["n_atoms"] == 256
    COMM.allgather(None)  # every rank's files are closed (a barrier)
    if COMM.is_root:
        frames = read_frames(folder / "run.shards")
        expected = read(folder / "gathered.traj", ":", parallel=False)
        assert [f.info["step"] for f in frames] == [0, 4, 8, 12] and len(expected) == 4
        for got, want in zip(frames, expected, strict=True):
            assert np.array_equal(got.positions, want.positions)
            assert np.array_equal(got.get_momenta(), want.get_momenta())
            assert np.array_equal(got.numbers, want.numbers)
            assert np.array_equal(got.get_forces(), want.get_forces())
            assert got.get_potential_energy() == want.get_potential_energy()
            assert np.array_equal(got.cell.array, want.cell.array)
        assert [f.info["step"] for f in read_frames(folder / "run.shards", slice(-2, None))] == [
            8,
            12,
        ]


def test_a_frame_cut_short_is_skipped_and_dropped_when_it_goes_on(tmp_path: Path) -> None:
    """A kill in the middle of a frame: some rank's line of it is missing (here rank 0's
    last). Readers see the frames before it; a trajectory opened to go on drops it and
    numbers the next frame in its place."""
    folder = Path(COMM.bcast(str(tmp_path)))
    local = _local()
    local.get_forces()
    with ShardedTrajectory(folder / "run.shards") as shards:
        for step in range(3):
            shards.write(local, {"step": step})
    COMM.allgather(None)  # a barrier: every rank has written
    index = folder / "run.shards" / "rank-00000.index"
    if COMM.is_root:
        lines = index.read_text().splitlines(keepends=True)
        index.write_text("".join(lines[:-1]) + lines[-1][:20])  # the line half-written
    COMM.allgather(None)  # a barrier: cut before any rank reads
    assert [f.info["step"] for f in read_frames(folder / "run.shards")] == [0, 1]
    with ShardedTrajectory(folder / "run.shards", "a") as shards:
        assert shards.frames == 2
        shards.write(local, {"step": 7})
    COMM.allgather(None)  # a barrier: every rank has written
    frames = read_frames(folder / "run.shards")
    assert [f.info["step"] for f in frames] == [0, 1, 7]
    assert np.array_equal(frames[2].positions, frames[1].positions)
