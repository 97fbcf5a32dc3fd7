"""Worker mode (serve under mpirun) and notebook mode (spawn), with clean shutdown.

Each case runs in its own process tree under a timeout, then checks that no
worker process is left behind. A script's spawned workers also stop quietly: no
Open MPI abort banner and no error on stderr, and ``prte`` and both workers exit
(with a Jupyter kernel's shutdown instead: tests/test_notebook.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest
from background import launch_in_background
from spawned import assert_clean_shutdown

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ENV = {
    **os.environ,
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMP_NUM_THREADS": "1",
}
# a spawned worker's command line names this function
WORKER_MARK = "worker_main"

SPAWN_SCRIPT = """
import json
import numpy as np
import ase_shard
from ase.build import bulk
from ase.calculators.emt import EMT as AseEMT
from ase_shard.models import EMT
from ase_shard.worker import _children, _launchers

calc = ase_shard.spawn(EMT(), workers=2)
atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(3)
atoms.rattle(0.05, seed=1)
atoms.calc = calc
reference = atoms.copy()
reference.calc = AseEMT()
error = np.abs(atoms.get_forces() - reference.get_forces()).max()
owners = calc.decomposition.owners
print(f"ranks={{calc.comm.size}} error={{error:.1e}} owners={{sorted(set(owners.tolist()))}}")
pids = [pid for launcher, _ in _launchers() for pid in [launcher, *_children(launcher)]]
print("PIDS", json.dumps(pids))
{finish}
"""


# the spawning scripts, by test id: how each ends
FINISH = {"close": "calc.close()", "exit": ""}


def _leftover_workers() -> list[str]:
    listing = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in listing.splitlines() if WORKER_MARK in line and "ps -eo" not in line]


def _run(args: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    done = subprocess.run(args, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def _assert_no_orphans() -> None:
    deadline = time.monotonic() + 20
    while _leftover_workers() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _leftover_workers()


SERVE_RANKS = 3


def _serve_under_mpirun(folder: Path) -> subprocess.CompletedProcess:
    return _run(
        [
            str(BIN / "mpirun"),
            "--oversubscribe",
            "-n",
            str(SERVE_RANKS),
            sys.executable,
            "examples/worker_mode.py",
            "--size",
            "3",
            "--steps",
            "10",
        ]
    )


def _serve_without_close(folder: Path) -> subprocess.CompletedProcess:
    script = folder / "no_close.py"
    script.write_text(
        textwrap.dedent("""
        import ase_shard
        from ase.build import bulk
        from ase_shard.models import EMT
        calc = ase_shard.serve(EMT())
        if calc is not None:
            atoms = bulk("Cu", cubic=True).repeat(2)
            atoms.calc = calc
            print("energy", atoms.get_potential_energy())
    """)
    )
    return _run([str(BIN / "mpirun"), "--oversubscribe", "-n", "3", sys.executable, str(script)])


# one spawning script at a time: _assert_no_orphans looks at every process of the machine
_SPAWNING = threading.Lock()


def _spawned(folder: Path, name: str) -> subprocess.CompletedProcess:
    """The spawning script ending as :data:`FINISH` ``[name]`` says; right after it exits,
    its ``prte`` and workers must be gone (:func:`assert_clean_shutdown`) and no worker
    left anywhere (:func:`_assert_no_orphans`)."""
    script = folder / "spawn.py"
    script.write_text(SPAWN_SCRIPT.format(finish=FINISH[name]))
    with _SPAWNING:
        done = _run([sys.executable, str(script)])
        assert_clean_shutdown(done)
        _assert_no_orphans()
    return done


# Every test checks one launched process tree: the launches run two at a time in the
# background from the module's first test on, a spawning script next to an mpirun job
# that spawns nothing (tests/background.py); each test checks its own launch.
LAUNCHES = {
    "test_spawned_workers[close]": lambda folder: _spawned(folder, "close"),
    "test_serve_under_mpirun": _serve_under_mpirun,
    "test_spawned_workers[exit]": lambda folder: _spawned(folder, "exit"),
    "test_serve_releases_workers_at_exit_without_close": _serve_without_close,
}


@pytest.fixture(scope="module", autouse=True)
def launches(request, tmp_path_factory) -> Iterator[dict[str, Future]]:
    yield from launch_in_background(request, tmp_path_factory, LAUNCHES, lanes=2)


def test_serve_under_mpirun(launched: subprocess.CompletedProcess) -> None:
    ranks = SERVE_RANKS
    lines = [line for line in launched.stdout.splitlines() if line.startswith("ranks=")]
    assert lines == [lines[0]] and lines[0].startswith(f"ranks={ranks} atoms=108")
    drift = float(lines[0].split("drift=")[1].split()[0])
    assert abs(drift) < 1e-3


def test_serve_releases_workers_at_exit_without_close(
    launched: subprocess.CompletedProcess,
) -> None:
    assert launched.stdout.count("energy") == 1


@pytest.mark.parametrize("finish", list(FINISH))
def test_spawned_workers(finish: str, launched: subprocess.CompletedProcess) -> None:
    """Two spawned ranks compute exactly; close() or interpreter exit stops them, quietly.

    ``prte`` and the two workers (their pids printed by the script) are gone soon after
    (checked right after the script exits: :func:`_spawned`).
    """
    done = launched
    assert "ranks=3" in done.stdout and "owners=[1, 2]" in done.stdout, done.stdout
    error = float(done.stdout.split("error=")[1].split()[0])
    assert error < 1e-10
