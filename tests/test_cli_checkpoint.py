"""``ase-shard md --checkpoint DIR`` and ``--resume DIR``: a run killed with SIGKILL at
random moments and resumed each time ends where the same run without a stop ends, its
trajectory and log whole (no frame or row twice, none missing); NVE on distributed atoms
resumed on 2, then 3, then 1 rank(s); SIGTERM, also in the middle of a write, leaves a
checkpoint to resume from; options that would change the run are refused."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from ase.io import read

from ase_shard import checkpoint as checkpoint_module
from ase_shard.checkpoint import checkpoints, read_checkpoint
from ase_shard.cli import main
from ase_shard.io import read_frames

pytestmark = pytest.mark.timeout(600)
MPIRUN = Path(sys.executable).parent / "mpirun"
STEPS = 300
RUN = ["md", "--system", "cu-bulk", "--size", "3", "--steps", str(STEPS), "--timestep", "2",
       "--trajectory", "run.traj", "--interval", "10", "--log", "run.log", "--no-progress"]


def env() -> dict[str, str]:
    allow = ("OMPI", "PRTE")
    flags = {f"{p}_ALLOW_RUN_AS_ROOT{s}": "1" for p in allow for s in ("", "_CONFIRM")}
    return dict(os.environ, OMP_NUM_THREADS="1", **flags)


def command(ranks: int, *argv: str) -> list[str]:
    """``ase-shard`` with ``argv`` on ``ranks`` ranks."""
    return [str(MPIRUN), "--oversubscribe", "-n", str(ranks), sys.executable, "-m",
            "ase_shard.cli", *argv]


def finish(folder: Path, ranks: int, *argv: str) -> subprocess.CompletedProcess:
    done = subprocess.run(command(ranks, *argv), cwd=folder, env=env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done


def logged_step(folder: Path) -> int:
    """The step of the last whole row of ``run.log`` (-1 before the first)."""
    path = folder / "run.log"
    rows = path.read_text().splitlines(keepends=True) if path.exists() else []
    rows = [row for row in rows if row.endswith("\n") and not row.startswith("#")]
    return int(rows[-1].split()[0]) if rows else -1


def killed_at_a_random_step(folder: Path, ranks: int, argv: list[str], rng) -> int:
    """Launch ``argv`` and SIGKILL all its processes once ``run.log`` shows a step drawn
    at random 20-80 steps past where it stood; returns that step."""
    target = max(logged_step(folder), 0) + rng.randrange(20, 80)
    process = subprocess.Popen(command(ranks, *argv), cwd=folder, env=env(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while logged_step(folder) < target:
        assert process.poll() is None, process.stderr.read()  # it must not end first
        assert time.monotonic() < deadline
        time.sleep(0.005)
    # as a batch system ends a job: every process at once (Open MPI puts each rank in a
    # process group of its own, so killing mpirun's group would leave the ranks running)
    launcher = psutil.Process(process.pid)
    family = [*launcher.children(recursive=True), launcher]
    for each in family:
        each.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    psutil.wait_procs(family, timeout=60)
    return target


def assert_same_run(resumed: Path, uninterrupted: Path) -> None:
    """The last frames agree to 1e-10 Å (positions, momenta, cell); the frames' steps
    and the log's rows are the uninterrupted run's, each once."""
    got, expected = read(resumed / "run.traj", ":"), read(uninterrupted / "run.traj", ":")
    assert [f.info["md_step"] for f in got] == [f.info["md_step"] for f in expected]
    assert np.abs(got[-1].positions - expected[-1].positions).max() <= 1e-10
    assert np.abs(got[-1].get_momenta() - expected[-1].get_momenta()).max() <= 1e-10
    assert np.abs(got[-1].cell.array - expected[-1].cell.array).max() <= 1e-10
    rows = [
        [line.split()[0] for line in (folder / "run.log").read_text().splitlines()]
        for folder in (resumed, uninterrupted)
    ]
    assert rows[0] == rows[1]


@pytest.mark.parametrize(
    "ensemble, kills",
    [("nve", 3), ("langevin", 1), ("nvt-bussi", 1), ("nvt-nose-hoover", 1), ("npt-mtk", 1)],
)
def test_killed_and_resumed_equals_one_run(tmp_path: Path, ensemble: str, kills: int) -> None:
    """Each ensemble's state (thermostat, barostat, random stream) through one kill, and
    a run killed three times, resumed each time (NVE): a kill costs a launch of about
    6 s, and these were the one-process run's longest tests."""
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    whole.mkdir()
    stopped.mkdir()
    argv = [*RUN, "--ensemble", ensemble]
    finish(whole, 2, *argv)
    rng = random.Random(ensemble)
    launches = [[*argv, "--checkpoint", "ck", "--checkpoint-every", "20"]]
    launches += [["md", "--resume", "ck", "--no-progress"]] * (kills - 1)
    for launch in launches:
        killed_at_a_random_step(stopped, 2, launch, rng)
    done = finish(stopped, 2, "md", "--resume", "ck", "--no-progress")
    assert "ase-shard md: ck from step" in done.stdout
    assert_same_run(stopped, whole)
    assert len(checkpoints(stopped / "ck")) == 2  # --checkpoint-keep
    assert read_checkpoint(stopped / "ck").step == STEPS
    if ensemble == "nve":  # resubmitted once more: nothing left to run
        again = finish(stopped, 2, "md", "--resume", "ck", "--no-progress")
        assert f"step {STEPS} already reached" in again.stdout


def test_distributed_nve_resumed_on_other_rank_counts(tmp_path: Path) -> None:
    """2 ranks to step 100, 3 ranks to 200, 1 rank to 300, each rank writing its own atoms
    of each frame (``run.shards``): the uninterrupted 2-rank run's frames (gathered to
    rank 0, ``run.traj``), the last within 1e-8 Å (the forces' sums run in another order
    on other ranks); ``ase-shard convert`` writes the frames as extended XYZ."""
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    whole.mkdir()
    stopped.mkdir()
    argv = [*RUN, "--distributed", "--checkpoint", "ck", "--checkpoint-every", "50"]
    finish(whole, 2, *argv)
    sharded = ["run.shards" if word == "run.traj" else word for word in argv]
    finish(stopped, 2, *["100" if word == str(STEPS) else word for word in sharded])
    finish(stopped, 3, "md", "--resume", "ck", "--steps", "200", "--no-progress")
    finish(stopped, 1, "md", "--resume", "ck", "--steps", str(STEPS), "--no-progress")
    got, expected = read_frames(stopped / "run.shards"), read(whole / "run.traj", ":")
    assert [f.info["md_step"] for f in got] == [f.info["md_step"] for f in expected]
    assert np.abs(got[-1].positions - expected[-1].positions).max() <= 1e-8
    assert np.abs(got[-1].get_forces() - expected[-1].get_forces()).max() <= 1e-8
    done = finish(stopped, 1, "convert", "run.shards", "run.xyz")
    assert f"{len(got)} frame(s) to run.xyz" in done.stdout
    converted = read(stopped / "run.xyz", ":")
    assert [f.info["md_step"] for f in converted] == [f.info["md_step"] for f in got]
    assert np.abs(converted[-1].positions - got[-1].positions).max() <= 1e-8


def test_sigterm_to_the_ranks_mid_run_leaves_a_checkpoint_to_resume(tmp_path: Path) -> None:
    """SIGTERM to every rank, as a batch system sends it at the time limit: the ranks
    stop at the end of a step, write its checkpoint and exit 130; resumed, the run ends
    as the one without a stop."""
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    whole.mkdir()
    stopped.mkdir()
    argv = [*RUN, "--ensemble", "langevin", "--checkpoint", "ck", "--checkpoint-every", "1000"]
    finish(whole, 2, *argv)
    process = subprocess.Popen(command(2, *argv), cwd=stopped, env=env(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while logged_step(stopped) < 100:
        assert process.poll() is None, process.stderr.read()
        time.sleep(0.005)
    for rank in psutil.Process(process.pid).children(recursive=True):
        rank.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    step = read_checkpoint(stopped / "ck").step
    assert 100 <= step < STEPS and f"interrupted at step {step} of {STEPS}" in err
    finish(stopped, 2, "md", "--resume", "ck", "--no-progress")
    got, expected = read(stopped / "run.traj", ":"), read(whole / "run.traj", ":")
    assert np.abs(got[-1].positions - expected[-1].positions).max() <= 1e-10
    # the frame of the stop step (off the interval) is the one extra
    extra = {f.info["md_step"] for f in got} - {f.info["md_step"] for f in expected}
    assert extra <= {step} and len(got) == len(expected) + len(extra)


def test_sigterm_in_a_write_leaves_a_checkpoint_to_resume(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """SIGTERM arrives while the step-40 checkpoint is being written: the write finishes,
    the run stops at the end of that step (exit 130) and the resumed run ends as one
    without a stop (in one process: the signal raised in the middle of the file)."""
    (tmp_path / "whole").mkdir()
    monkeypatch.chdir(tmp_path / "whole")
    argv = [*RUN, "--ensemble", "langevin", "--checkpoint", "ck", "--checkpoint-every", "20"]
    assert main(argv) == 0
    (tmp_path / "stopped").mkdir()
    monkeypatch.chdir(tmp_path / "stopped")
    savez = np.savez

    def interrupted_savez(handle, **arrays):
        if "step-" not in handle.name and "000000040" in handle.name:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler only asks to stop
        savez(handle, **arrays)

    with monkeypatch.context() as patch:
        patch.setattr(checkpoint_module.np, "savez", interrupted_savez)
        assert main(argv) == 130
    assert f"interrupted at step 40 of {STEPS}" in capsys.readouterr().err
    assert read_checkpoint("ck").step == 40
    assert main(["md", "--resume", "ck", "--no-progress"]) == 0
    assert_same_run(tmp_path / "stopped", tmp_path / "whole")


def test_resume_refuses_what_would_change_the_run(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    argv = ["md", "--size", "2", "--steps", "4", "--ensemble", "langevin", "--no-progress"]
    assert main([*argv, "--checkpoint", "ck"]) == 0
    capsys.readouterr()
    refused = {
        ("--timestep", "1"): "continues a run with --timestep 2.0, not 1.0",
        ("--ensemble", "nve"): "continues a run with --ensemble langevin, not nve",
        ("--model", "morse"): "was written with --model emt, not morse",
        ("--temperature", "500"): "was written with --temperature 300.0, not 500.0",
        ("--seed", "7"): "continues a run with --seed 42, not 7",
        ("--dtype", "float32"): "was written with --dtype (none), not float32",
        ("--size", "3"): "give no STRUCTURE, --system, --size or --restart",
    }
    for option, message in refused.items():
        assert main(["md", "--resume", "ck", *option]) == 2, option
        assert message in capsys.readouterr().err, option
    # the recorded values given again, and options that leave the physics alone, are fine
    assert main(["md", "--resume", "ck", "--timestep", "2", "--steps", "6", "--balance",
                 "count", "--no-progress"]) == 0
    assert read_checkpoint("ck").step == 6
    assert main(["md", "--resume", "empty", "--no-progress"]) == 2
    assert "empty: no complete checkpoint there" in capsys.readouterr().err
    # --restart from a trajectory refuses another dtype likewise (the frames record it)
    assert main([*argv, "--dtype", "float32", "--trajectory", "t.traj"]) == 0
    assert main(["md", "--restart", "t.traj", "--dtype", "float64", "--no-progress"]) == 2
    assert "was written with --dtype float32, not float64" in capsys.readouterr().err


def test_restart_from_a_sharded_trajectory(tmp_path: Path, monkeypatch, capsys) -> None:
    """``--restart NAME.shards`` continues from its last frame and appends to it; the
    frames equal a ``.traj`` written by the same two commands (one process)."""
    monkeypatch.chdir(tmp_path)
    argv = ["md", "--size", "2", "--steps", "20", "--interval", "5", "--distributed",
            "--no-progress"]
    for name in ("run.shards", "run.traj"):
        assert main([*argv, "--trajectory", name]) == 0
        assert main(["md", "--restart", name, "--steps", "10", "--interval", "5",
                     "--no-progress"]) == 0
    assert "run.shards from step 20" in capsys.readouterr().out
    got, expected = read_frames("run.shards"), read("run.traj", ":")
    steps = [0, 5, 10, 15, 20, 25, 30]
    assert [f.info["md_step"] for f in got] == [f.info["md_step"] for f in expected] == steps
    for frame, reference in zip(got, expected, strict=True):
        assert np.array_equal(frame.positions, reference.positions)
        assert np.array_equal(frame.get_momenta(), reference.get_momenta())
        assert np.array_equal(frame.get_forces(), reference.get_forces())
