"""Run the example scripts with plain ``python`` and check what they print.

The scripts run as subprocesses (one rank, no mpirun) exactly as a user would
start them; the MPI runs of the same code are covered by ``make demo`` and the
``tests/test_sharded_*.py`` suites under mpirun. The scripts run two at a time in the
background from the module's first test on (:func:`launches`).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest
from ase.io import read
from background import launch_in_background

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
FLOAT = r"[-+]?\d+\.?\d*(?:[eE][-+]?\d+)?"


def run_example(name: str, *args: str, timeout: float = 120) -> str:
    """stdout of ``python examples/<name> args``; fails the test on error or timeout."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # a plain one-rank run: hide any launcher variables inherited from mpirun
    for key in list(env):
        if key.startswith(("OMPI_", "PMI_", "PMIX_", "PRTE_")):
            env.pop(key)
    try:
        done = subprocess.run(
            [sys.executable, str(EXAMPLES / name), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=EXAMPLES.parent,
        )
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"{name} did not finish within {timeout} s:\n{error.stdout}\n{error.stderr}")
    assert done.returncode == 0, f"{name} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def launch_md_distributed(folder: Path) -> tuple[str, Path]:
    traj = folder / "md.traj"
    out = run_example(
        "md_distributed.py",
        "--size",
        "3",
        "--steps",
        "10",
        "--write-every",
        "5",
        "--trajectory",
        str(traj),
    )
    return out, traj


def launch_md_7net0(folder: Path) -> str:
    pytest.importorskip("sevenn")
    return run_example("md_7net0.py", "--steps", "5", timeout=300)


def launch_md_7net0_d3(folder: Path) -> str:
    pytest.importorskip("sevenn")
    pytest.importorskip("dftd3")
    return run_example("md_7net0.py", "--steps", "5", "--d3", "pbe", timeout=300)


# Every test runs one example: the runs go two at a time in the background from the
# module's first test on, the longest first (tests/background.py); each test checks
# what its own run printed. One run is one process on one core.
LAUNCHES = {
    "test_md_with_pretrained_7net0": launch_md_7net0,
    "test_md_with_7net0_plus_d3": launch_md_7net0_d3,
    "test_md_demo_conserves_energy_and_reports": lambda folder: run_example(
        "md_cu.py", "--size", "3", "--steps", "20", "--print-every", "5"
    ),
    "test_md_distributed_logs_and_writes_every_interval": launch_md_distributed,
    "test_custom_model_forces_match_finite_difference": lambda folder: run_example(
        "custom_model.py"
    ),
}


@pytest.fixture(scope="module", autouse=True)
def launches(request, tmp_path_factory) -> Iterator[dict[str, Future]]:
    yield from launch_in_background(request, tmp_path_factory, LAUNCHES, lanes=2)


def test_custom_model_forces_match_finite_difference(launched: str):
    out = launched
    assert "1 MPI rank(s)" in out
    energy = re.search(rf"energy: ({FLOAT}) eV", out)
    assert energy and abs(float(energy.group(1))) > 0
    net = re.search(rf"sum of forces: ({FLOAT}) eV/Å", out)
    assert net and float(net.group(1)) < 1e-10
    check = re.search(
        rf"autograd ({FLOAT}) eV/Å, numeric ({FLOAT}) eV/Å, \|difference\| ({FLOAT}) eV/Å", out
    )
    assert check, out
    autograd, numeric, difference = (float(x) for x in check.groups())
    assert abs(autograd) > 1e-4  # a real force, not a trivially zero one
    assert difference < 1e-7 * max(1.0, abs(autograd))
    assert abs(autograd - numeric) < 1e-7


def test_md_demo_conserves_energy_and_reports(launched: str):
    out = launched
    assert "108 atoms on 1 MPI rank(s)" in out
    assert "model EMT" in out
    # header + one line per 5 steps, ending on step 20
    rows = [m.group(0).split() for m in re.finditer(rf"^\s+(\d+)\s+{FLOAT}\s.*$", out, re.M)]
    assert [int(row[0]) for row in rows] == [0, 5, 10, 15, 20]
    assert rows[0][-1] == "300.0"  # T at step 0: exactly the 300 K asked for
    drift = re.search(rf"energy drift: ({FLOAT}) eV/atom over 40 fs", out)
    assert drift, out
    assert abs(float(drift.group(1))) < 1e-3
    summary = re.search(
        rf"performance: ({FLOAT}) steps/s, {FLOAT} s wall, 1 rank\(s\), (\d+) decomposition", out
    )
    assert summary, out
    assert float(summary.group(1)) > 0
    assert int(summary.group(2)) >= 1


def test_md_with_pretrained_7net0(launched: str):
    out = launched
    assert "7net-0 (cutoff 5.0 Å, 5 layers)" in out
    first = re.search(rf"^\s+0\s+{FLOAT}\s+{FLOAT}\s+({FLOAT})$", out, re.M)
    assert first and first.group(1) == "300.0", out  # T at step 0: the 300 K asked for
    drift = float(re.search(r"drift ([-+0-9.e]+) eV/atom", out).group(1))
    assert abs(drift) < 1e-3


def test_md_with_7net0_plus_d3(launched: str):
    out = launched
    assert "7net-0 (cutoff 5.0 Å, 5 layers) + D3(BJ) pbe" in out
    drift = float(re.search(r"drift ([-+0-9.e]+) eV/atom", out).group(1))
    assert abs(drift) < 1e-3


def test_md_distributed_logs_and_writes_every_interval(launched: tuple[str, Path]):
    out, traj = launched
    assert "108 Cu atoms (EMT), distributed over 1 MPI rank(s)" in out
    times = [float(m.group(1)) for m in re.finditer(rf"^({FLOAT})\s+{FLOAT}\s+{FLOAT}", out, re.M)]
    assert times == [0.0, 0.01, 0.02]  # ps: every 5 steps of 2 fs
    assert "atoms per rank at the end: [108] (total 108)" in out
    assert "3 frame(s) written" in out
    frames = read(traj, ":")
    assert [len(frame) for frame in frames] == [108] * 3
