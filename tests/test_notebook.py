"""The example notebook runs headlessly, spawns its workers and leaves none behind.

Also: the notebook is committed with its outputs, and shutting spawned workers down
with a Jupyter kernel's shutdown prints no Open MPI abort banner ("Abort is in
progress...hit ctrl-c again to forcibly terminate"). The same for ``calc.close()`` in a
script is checked by tests/test_worker.py (``test_spawned_workers[close]``), in the run
that also checks the workers' forces.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import nbformat
import pytest
from background import launch_in_background
from nbclient import NotebookClient
from spawned import BANNER, assert_clean_shutdown

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "cu_nanoparticle.ipynb"


def _workers_alive(others: set[int] = frozenset()) -> bool:
    """Whether any spawned worker runs on this machine, but those with pids in ``others``."""
    listing = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return any(
        "worker_main" in line and "ps -eo" not in line and int(line.split()[0]) not in others
        for line in listing.splitlines()[1:]
    )


def _plain_environment() -> dict[str, str]:
    """This environment without launcher variables: a plain process even under mpirun."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for name in list(env):
        if name.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_")):
            env.pop(name)
    return env


PLAIN_ENV = _plain_environment()


def _code_outputs(notebook) -> list:
    return [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.outputs]


def test_notebook_runs_and_plots(monkeypatch, capfd, launches: dict[str, Future]) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    for name in [n for n in os.environ if n.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_"))]:
        monkeypatch.delenv(name)  # the kernel must be a plain process even under mpirun
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(notebook, timeout=300, kernel_name="python3").execute()

    outputs = _code_outputs(notebook)
    assert not [out for out in outputs if out.output_type == "error"]
    images = [out for out in outputs if "image/png" in out.get("data", {})]
    assert len(images) == 2
    text = "".join(out.get("text", "") for out in outputs)
    assert "3 ranks" in text
    drift = float(text.split("total-energy drift: ")[1].split()[0])
    assert abs(drift) < 1e-3
    # the kernel, prte and the workers write to this process's stderr
    assert BANNER not in capfd.readouterr().err

    # the kernel shutdown run in the background has spawned workers too: they are that
    # test's to check (right after its end), and none of this notebook's
    others = _background_pids(launches)
    deadline = time.monotonic() + 20
    while _workers_alive(others) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _workers_alive(others)


def test_committed_notebook_has_outputs() -> None:
    """The notebook is saved executed, so GitHub shows its text and plots."""
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(cell.execution_count is not None for cell in code), "re-run with outputs saved"
    outputs = _code_outputs(notebook)
    assert not [out for out in outputs if out.output_type == "error"]
    assert len([out for out in outputs if "image/png" in out.get("data", {})]) == 2
    text = "".join(out.get("text", "") for out in outputs)
    assert "3 ranks" in text and "total-energy drift" in text
    assert NOTEBOOK.stat().st_size < 300_000  # plots and a few lines, no logs


# Spawn two workers, evaluate, print the pids of prte and the workers, and end with
# nothing: the kernel's shutdown must stop them.
SPAWN = """
import json, os
import ase_shard
from ase.build import bulk
from ase_shard.models import EMT
from ase_shard.worker import _children, _launchers

atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(3)
atoms.calc = ase_shard.spawn(EMT(), workers=2)
atoms.get_potential_energy()
pids = [pid for launcher, _ in _launchers() for pid in [launcher, *_children(launcher)]]
print("PIDS", json.dumps(pids))
"""

# Executes SPAWN in a Jupyter kernel (what the notebook does); the kernel's stderr is ours.
KERNEL = """
import sys
import nbformat
from nbclient import NotebookClient

notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(sys.argv[1])])
NotebookClient(notebook, timeout=120, kernel_name="python3").execute()
print("".join(out.get("text", "") for out in notebook.cells[0].outputs))
"""


def _kernel_shutdown(folder: Path) -> tuple[subprocess.CompletedProcess, AssertionError | None]:
    """SPAWN in a Jupyter kernel, and what its checks found right after it ended: a
    clean exit and a clean shutdown (its ``prte`` and workers gone)."""
    args = [sys.executable, "-c", KERNEL, SPAWN]
    done = subprocess.run(args, capture_output=True, text=True, timeout=240, env=PLAIN_ENV)
    try:
        assert done.returncode == 0, done.stdout + done.stderr
        assert_clean_shutdown(done)
    except AssertionError as error:
        return done, error
    return done, None


# the kernel shutdown test's own Jupyter kernel runs in the background from the
# module's first test on, while the notebook runs in another (tests/background.py)
LAUNCHES = {"test_kernel_shutdown_prints_no_abort_banner": _kernel_shutdown}


@pytest.fixture(scope="module", autouse=True)
def launches(request, tmp_path_factory) -> Iterator[dict[str, Future]]:
    yield from launch_in_background(request, tmp_path_factory, LAUNCHES, lanes=1)


def _background_pids(launches: dict[str, Future]) -> set[int]:
    """The pids of ``prte`` and the workers of the background kernel shutdown run, once it
    has ended: that test checks them."""
    future = launches.get("test_kernel_shutdown_prints_no_abort_banner")
    if future is None or future.exception() is not None:
        return set()
    stdout = future.result()[0].stdout
    return set(json.loads(stdout.split("PIDS")[1].splitlines()[0])) if "PIDS" in stdout else set()


def test_kernel_shutdown_prints_no_abort_banner(launches: dict[str, Future]) -> None:
    """A kernel's shutdown stops prte and the workers quietly.

    Under ipykernel, prte (which Open MPI forks for MPI_Comm_spawn) is in the kernel's
    process group, and the kernel's shutdown sends SIGTERM to that group's processes
    again and again; unless spawn() stopped prte first, the second one prints the banner.
    (A script's ``calc.close()``: tests/test_worker.py, ``test_spawned_workers[close]``.)
    The checks run right after the kernel's process ends (:func:`_kernel_shutdown`).
    """
    _, error = launches["test_kernel_shutdown_prints_no_abort_banner"].result()
    if error is not None:
        raise error
