"""Stopping ``ase-shard md``: the blow-up guard (exit 1) and signals (exit 130).

Open MPI 5's ``mpirun`` does not forward SIGINT: it answers it by sending the
ranks SIGCONT, SIGTERM 0.25 s later and SIGKILL 0.25 s after that, stops
forwarding their output at once, and exits 1. It forwards SIGUSR1, which stops
``ase-shard md`` cleanly on every rank.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from ase.cluster import Icosahedron
from ase.io import read, write

from ase_shard.cli import main
from ase_shard.comm import Comm
from ase_shard.md import ESCAPE_DISTANCE, TEMPERATURE_FACTOR

pytestmark = [
    pytest.mark.skipif(Comm().size > 1, reason="runs ase-shard serially and under its mpirun"),
    pytest.mark.timeout(180),
]
MPIRUN = Path(sys.executable).parent / "mpirun"


def env() -> dict[str, str]:
    allow = ("OMPI", "PRTE")
    flags = {f"{p}_ALLOW_RUN_AS_ROOT{s}": "1" for p in allow for s in ("", "_CONFIRM")}
    return dict(os.environ, OMP_NUM_THREADS="1", **flags)


def test_huge_timestep_stops_with_exit_1(tmp_path: Path, capsys) -> None:
    """NVE at 1000 K with 30 fs steps heats up; the frames written are those before."""
    traj = tmp_path / "t.traj"
    argv = ["md", "--size", "2", "--temperature", "1000", "--timestep", "30", "--steps", "200"]
    assert main([*argv, "--trajectory", str(traj), "--interval", "1", "--no-progress"]) == 1
    captured = capsys.readouterr()
    assert "summary" not in captured.out
    (line,) = captured.err.splitlines()
    prefix = "ase-shard md: stopped: the run is unstable at step "
    assert line.startswith(prefix) and f"exceeds {TEMPERATURE_FACTOR:g} x 1000 K" in line
    step = int(line.removeprefix(prefix).split()[0])
    frames = read(traj, ":")
    assert [f.info["md_step"] for f in frames] == list(range(step))
    assert max(f.get_temperature() for f in frames) <= TEMPERATURE_FACTOR * 1000


def test_escaping_atom_stops_with_exit_1(tmp_path: Path, capsys) -> None:
    """One atom of a 147-atom cluster shot out at 20 eV leaves along a non-periodic axis."""
    cluster = Icosahedron("Cu", noshells=4, latticeconstant=3.61)
    outer = int(np.argmax(cluster.positions[:, 0] - cluster.get_center_of_mass()[0]))
    momenta = np.zeros((len(cluster), 3))
    momenta[outer, 0] = np.sqrt(2 * cluster.get_masses()[outer] * 20.0)
    cluster.set_momenta(momenta)
    structure = tmp_path / "shot.traj"
    write(structure, cluster)
    argv = ["md", str(structure), "--steps", "2000", "--no-progress"]
    assert main(argv) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert f"atom {outer} left the box along non-periodic axis x" in line
    assert ESCAPE_DISTANCE == 20.0  # the margin the message's span is built from


@contextlib.contextmanager
def launched(command: list[str], cwd: Path) -> Iterator[subprocess.Popen]:
    """``command`` running; on the way out, one still running gets SIGINT (mpirun then
    ends its ranks), and SIGKILL if that does not end it."""
    process = subprocess.Popen(
        command, cwd=cwd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate()


def wait_for_progress(process: subprocess.Popen) -> None:
    """Return once ``process`` has printed its first progress line on stderr."""
    for line in process.stderr:
        if "steps/s" in line:
            return


LONG_RUN = ["md", "--size", "2", "--steps", "100000", "--trajectory", "t.traj", "--interval", "7"]


def test_sigint_serial_exit_130_with_last_frame(tmp_path: Path) -> None:
    with launched([sys.executable, "-m", "ase_shard.cli", *LONG_RUN], tmp_path) as process:
        wait_for_progress(process)
        time.sleep(0.5)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    assert "Traceback" not in err
    last = err.splitlines()[-1]
    assert last.startswith("ase-shard md: interrupted at step ") and last.endswith(" of 100000")
    step = int(last.split()[-3])
    assert read(tmp_path / "t.traj", -1).info["md_step"] == step  # the step it stopped at
    assert "ase-shard md summary" in out


@pytest.mark.skipif(not MPIRUN.exists(), reason="no mpirun")
def test_sigusr1_to_mpirun_stops_both_ranks_cleanly(tmp_path: Path) -> None:
    command = [str(MPIRUN), "-n", "2", sys.executable, "-m", "ase_shard.cli", *LONG_RUN]
    with launched(command, tmp_path) as process:
        wait_for_progress(process)
        time.sleep(0.5)
        process.send_signal(signal.SIGUSR1)  # mpirun passes it on to the ranks
        out, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "interrupted at step" in line]
    assert len(lines) == 1  # rank 0 alone
    step = int(lines[0].split()[-3])
    assert read(tmp_path / "t.traj", -1).info["md_step"] == step
    assert out.count("ase-shard md summary") == 1


@pytest.mark.skipif(not MPIRUN.exists(), reason="no mpirun")
def test_sigint_to_mpirun_keeps_the_frames_written(tmp_path: Path) -> None:
    """Open MPI terminates the ranks itself and exits 1; every frame on disk is whole.

    The ranks take mpirun's SIGTERM as a stop request, so they may manage to write
    the frame of the step they stopped at before the SIGKILL."""
    command = [str(MPIRUN), "-n", "2", sys.executable, "-m", "ase_shard.cli", *LONG_RUN]
    with launched(command, tmp_path) as process:
        wait_for_progress(process)
        time.sleep(1.0)
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=60)
    assert process.returncode == 1
    steps = [f.info["md_step"] for f in read(tmp_path / "t.traj", ":")]
    assert steps[:-1] == [7 * k for k in range(len(steps) - 1)]
    assert steps[-1] % 7 == 0 or steps[-1] - steps[-2] < 7
