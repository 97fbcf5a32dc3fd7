"""The ``ase-shard`` command line, run in-process and once under ``mpirun -n 2``.

Trajectories written by ``ase-shard md`` are checked frame by frame against
ASE's own calculators (the oracle), with parameters spelled out here rather
than taken from the CLI. The runs under ``mpirun`` go in the background while the
in-process tests run (:func:`launches`).
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import torch
from ase.build import bulk
from ase.calculators.emt import EMT as AseEMT
from ase.calculators.lj import LennardJones as AseLennardJones
from ase.calculators.morse import MorsePotential as AseMorse
from ase.io import read, write
from background import launch_in_background

from ase_shard.cli import main
from ase_shard.comm import Comm
from ase_shard.md import Progress

pytestmark = [
    pytest.mark.skipif(Comm().size > 1, reason="runs ase-shard serially and under its own mpirun"),
    pytest.mark.timeout(120),
]

ORACLES = {
    "emt": AseEMT,
    "lj": lambda: AseLennardJones(sigma=3.4, epsilon=0.0104, rc=8.5, smooth=True),
    "morse": lambda: AseMorse(epsilon=0.35, r0=2.55, rho0=4.0),
}
SUMMARY = "ase-shard md summary"


def summary_field(text: str, name: str) -> str:
    """The value of ``name`` in the summary printed in ``text``."""
    match = re.search(rf"^  {re.escape(name)} +(.+)$", text, re.MULTILINE)
    assert match, f"no {name!r} line in:\n{text}"
    return match.group(1)


@pytest.mark.parametrize(
    ("system", "model", "ensemble", "n_atoms"),
    [
        ("cu-bulk", "emt", "nve", 32),
        ("cu-bulk", "emt", "langevin", 32),
        ("cu-bulk", "emt", "nvt-berendsen", 32),
        ("cu-bulk", "emt", "npt-berendsen", 32),
        ("cu-bulk", "morse", "nve", 32),
        ("cu-cluster", "emt", "nve", 55),
        ("cu-cluster", "emt", "langevin", 55),
        ("ar-liquid", "lj", "nve", 32),
        ("ar-liquid", "lj", "npt-berendsen", 32),
    ],
)
def test_md_trajectory_matches_ase(
    system: str, model: str, ensemble: str, n_atoms: int, tmp_path: Path, capsys
) -> None:
    """Summary printed; trajectory has steps/interval + 1 frames that ASE reproduces."""
    traj = tmp_path / "md.traj"
    size = "3" if system == "cu-cluster" else "2"
    argv = ["md", "--system", system, "--size", size, "--model", model, "--ensemble", ensemble]
    argv += ["--steps", "6", "--interval", "2", "--trajectory", str(traj)]
    assert main(argv) == 0

    out = capsys.readouterr().out
    assert out.count(SUMMARY) == 1
    assert summary_field(out, "atoms") == str(n_atoms)
    assert summary_field(out, "ranks") == "1"
    assert summary_field(out, "steps") == "6"
    if ensemble == "nve":
        assert "eV/atom" in summary_field(out, "Etot drift")
    else:  # thermostats: the temperature's mean and spread instead of a drift
        assert re.fullmatch(
            r"mean [\d.]+ K, standard deviation [\d.]+ K over 7 steps", summary_field(out, "T")
        )

    frames = read(traj, ":")
    assert len(frames) == 4
    assert not np.allclose(frames[0].positions, frames[-1].positions)
    if ensemble == "npt-berendsen":
        assert not np.array_equal(frames[0].cell.array, frames[-1].cell.array)
    for frame in frames:
        energy, forces = frame.get_potential_energy(), frame.get_forces()
        frame.calc = ORACLES[model]()
        assert energy == pytest.approx(frame.get_potential_energy(), rel=1e-10, abs=1e-9)
        np.testing.assert_allclose(forces, frame.get_forces(), rtol=1e-8, atol=1e-9)


def test_default_model_of_argon_is_lj(capsys) -> None:
    assert main(["md", "--system", "ar-liquid", "--size", "2", "--steps", "2"]) == 0
    assert "LennardJones" in capsys.readouterr().out


def test_md_reads_structure_file_and_keeps_its_momenta(tmp_path: Path, capsys) -> None:
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat((2, 2, 3))
    atoms.rattle(stdev=0.05, seed=3)
    atoms.set_momenta(np.random.default_rng(4).normal(scale=0.05, size=(len(atoms), 3)))
    structure = tmp_path / "cu.extxyz"
    write(structure, atoms, format="extxyz")
    log, traj = tmp_path / "md.log", tmp_path / "md.traj"

    argv = ["md", str(structure), "--steps", "4", "--interval", "4", "--trajectory", str(traj)]
    assert main([*argv, "--log", str(log), "--no-progress"]) == 0

    captured = capsys.readouterr()
    assert captured.err == ""  # --no-progress
    assert str(structure) in captured.out
    assert summary_field(captured.out, "atoms") == "48"
    first, _ = read(traj, ":")
    written = read(structure)
    np.testing.assert_array_equal(first.positions, written.positions)
    np.testing.assert_array_equal(first.get_momenta(), written.get_momenta())
    assert np.abs(first.get_momenta()).max() > 0.01
    assert len(log.read_text().splitlines()) == 3  # header, step 0, step 4


def test_progress_lines_when_not_a_terminal(capsys) -> None:
    assert main(["md", "--size", "2", "--steps", "10"]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert [line.split("%")[0].strip() for line in lines] == [str(p) for p in range(0, 101, 10)]
    assert "steps/s" in lines[-1] and "ETA" in lines[-1] and "Etot" in lines[-1]


def test_progress_bar_redraws_in_place() -> None:
    stream = io.StringIO()
    progress = Progress(4, stream, live=True)
    for step in range(5):
        progress.update(step, -3.5, 0.2 * (step + 1))
    progress.close()
    text = stream.getvalue()
    assert text.startswith("\r[") and text.endswith("\n") and text.count("\n") == 1
    assert "4/4 steps" in text and "[" + "#" * Progress.WIDTH + "]" in text


def test_npt_without_cell_exits_2(capsys) -> None:
    argv = ["md", "--system", "cu-cluster", "--size", "2", "--ensemble", "npt-berendsen"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert SUMMARY not in captured.out
    (line,) = captured.err.splitlines()
    assert line.startswith("ase-shard md: error: npt-berendsen") and "rank 0, not 3" in line


@pytest.mark.parametrize(
    "argv",
    [
        ["md", "missing.xyz"],
        ["md", "x.xyz", "--system", "cu-bulk"],
        ["md", "--system", "ar-liquid", "--size", "2", "--model", "emt"],  # from the calculator
    ],
)
def test_user_errors_exit_2(argv: list[str], capsys) -> None:
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith("ase-shard md: error: ")


def test_usage_errors_exit_2(capsys) -> None:
    assert main(["md", "--ensemble", "npt"]) == 2
    assert main([]) == 2
    assert "usage: ase-shard" in capsys.readouterr().err


def test_info_prints_versions(capsys) -> None:
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"^torch +{re.escape(torch.__version__)}$", out, re.MULTILINE)
    assert "ranks          1" in out and "rank 0" in out and "no MPI (serial" in out


def _mpirun() -> tuple[Path, dict[str, str]]:
    """The environment's ``mpirun`` (or a skip) and the environment to run it in as root."""
    mpirun = Path(sys.executable).parent / "mpirun"
    if not mpirun.exists():
        pytest.skip(f"no {mpirun}")
    env = dict(
        os.environ,
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMP_NUM_THREADS="1",
    )
    return mpirun, env


def _overlapping_atoms_on_two_ranks(folder: Path) -> subprocess.CompletedProcess:
    mpirun = Path(sys.executable).parent / "mpirun"
    if not mpirun.exists():
        pytest.skip(f"no {mpirun}")
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(3)
    atoms.positions[4] = atoms.positions[9]
    structure = folder / "overlap.xyz"
    write(structure, atoms)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    command = [str(mpirun), "--oversubscribe", "-n", "2", sys.executable, "-m", "ase_shard.cli"]
    command += ["md", str(structure), "--steps", "5"]
    return subprocess.run(
        ["timeout", "-k", "5", "100", *command],
        env=dict(env, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )


def _md_on_two_ranks(folder: Path, distributed: bool) -> tuple[subprocess.CompletedProcess, Path]:
    """MD on 2 ranks with or without ``--distributed``: the run and its trajectory.

    The replicated run prints its progress (:func:`test_md_under_mpirun_two_ranks`).
    """
    mpirun, env = _mpirun()
    path = folder / "md.traj"
    command = ["timeout", "-k", "5", "100", str(mpirun), "--oversubscribe", "-n", "2"]
    command += [sys.executable, "-m", "ase_shard.cli", "md", "--size", "3", "--steps", "30"]
    command += ["--interval", "10", "--skin", "0.1", "--trajectory", str(path)]
    command += ["--no-progress", "--distributed"] if distributed else []
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    return done, path


# the runs of the tests that launch their own mpirun: two at a time in the background
# from the module's first test on, while the in-process tests run (tests/background.py);
# each test checks the runs it uses
LAUNCHES = {
    "replicated": lambda folder: _md_on_two_ranks(folder, distributed=False),
    "distributed": lambda folder: _md_on_two_ranks(folder, distributed=True),
    "overlapping": _overlapping_atoms_on_two_ranks,
}
USERS = {
    "replicated": (
        "test_md_under_mpirun_two_ranks",
        "test_distributed_md_under_mpirun_matches_replicated",
    ),
    "distributed": ("test_distributed_md_under_mpirun_matches_replicated",),
    "overlapping": ("test_overlapping_atoms_under_mpirun_report_once",),
}


@pytest.fixture(scope="module", autouse=True)
def launches(request, tmp_path_factory) -> Iterator[dict[str, Future]]:
    yield from launch_in_background(request, tmp_path_factory, LAUNCHES, lanes=2, users=USERS)


def test_md_under_mpirun_two_ranks(launches: dict[str, Future]) -> None:
    """SPMD: both ranks run the CLI; rank 0 alone prints one summary saying 2 ranks.

    (The replicated run of :func:`test_distributed_md_under_mpirun_matches_replicated`.)
    """
    done, _ = launches["replicated"].result()
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(SUMMARY) == 1
    assert summary_field(done.stdout, "ranks") == "2"
    assert done.stderr.count("100%") == 1  # the progress lines come from rank 0 only
    # each rank's peak resident memory, as LAMMPS prints it: a torch process holds
    # more than 100 MiB, and this run far less than 10 GiB
    peaks = re.fullmatch(
        r"(\d+) / (\d+) / (\d+) MiB per rank \(min / mean / max\)",
        summary_field(done.stdout, "peak memory"),
    )
    low, mean, high = (int(value) for value in peaks.groups())
    assert 100 < low <= mean <= high < 10 * 1024
    # the load balance: edges per rank at the last rebuild, CPU outside MPI per rank
    edges = re.fullmatch(
        r"(\d+) / (\d+) / (\d+) \(min / mean / max; max / mean ([\d.]+); "
        r"(\d+) rebalance\(s\) by work\)",
        summary_field(done.stdout, "edges/rank"),
    )
    low, mean, high, ratio, _ = (float(value) for value in edges.groups())
    assert 0 < low <= mean <= high and ratio == pytest.approx(high / mean, abs=2e-3)
    work = re.fullmatch(
        r"([\d.]+) / ([\d.]+) / ([\d.]+) s of CPU outside MPI \(max / mean ([\d.]+)\)",
        summary_field(done.stdout, "work/rank"),
    )
    low, mean, high, ratio = (float(value) for value in work.groups())
    assert 0 < low <= mean <= high and ratio >= 1.0


def test_overlapping_atoms_under_mpirun_report_once(launches: dict[str, Future]) -> None:
    """Two atoms at one position: one error line from rank 0, exit 2, no traceback or abort."""
    done = launches["overlapping"].result()
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    message = "atoms 4 and 9 are 0 Å apart: coincident atoms (closer than 0.0001 Å)"
    assert output.count(message) == 1
    assert "Traceback" not in output and "MPI_ABORT" not in output


def test_distributed_md_under_mpirun_matches_replicated(launches: dict[str, Future]) -> None:
    """``--distributed`` writes the same frames as the replicated run (2 ranks each)."""
    frames = {}
    for mode in ("replicated", "distributed"):
        done, path = launches[mode].result()
        assert done.returncode == 0, done.stderr
        assert done.stdout.count(SUMMARY) == 1
        frames[mode] = read(path, ":")
    assert len(frames["distributed"]) == len(frames["replicated"]) == 4
    for got, want in zip(frames["distributed"], frames["replicated"], strict=True):
        assert got.info == want.info
        np.testing.assert_allclose(got.positions, want.positions, rtol=0, atol=1e-10)
        np.testing.assert_allclose(got.get_forces(), want.get_forces(), rtol=0, atol=1e-10)
        np.testing.assert_array_equal(got.numbers, want.numbers)


def test_distributed_berendsen_exits_2(capsys) -> None:
    argv = ["md", "--size", "2", "--steps", "1", "--ensemble", "nvt-berendsen", "--distributed"]
    assert main(argv) == 2
    assert "--distributed runs nve, langevin, nvt-bussi, nvt-nose-hoover, npt-mtk, not" in (
        capsys.readouterr().err
    )


def test_plan_prints_and_writes_every_rank_count(tmp_path: Path, capsys) -> None:
    """``ase-shard plan``: a table per rank count whose owned atoms add up to the
    system, the largest system within --memory and the projection, in text and JSON."""
    report = tmp_path / "plan.json"
    argv = ["plan", "--size", "4", "--ranks", "1", "3", "--memory", "64", "--json", str(report)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("ase-shard plan: cu-bulk N=4, emt\n256 atoms on 1 rank(s)")
    assert "256 atoms on 3 rank(s)" in out and "projected parallel efficiency" in out
    plans = json.loads(report.read_text())
    assert [len(p["per_rank"]) for p in plans] == [1, 3]
    for p in plans:
        assert sum(rank["owned"] for rank in p["per_rank"]) == 256
        assert f"within 64 GiB per rank: {p['largest_system']} atoms" in out
        # more than this, less than at 200 B an atom
        assert 256 < p["largest_system"] < 64 * 2**30 / 200


def test_md_plan_prints_the_runs_plan(capsys) -> None:
    """``ase-shard md --plan``: the plan of this run's ranks before the run, and the
    calculator keeps it for an out-of-memory message."""
    assert main(["md", "--size", "3", "--steps", "2", "--plan", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"ase-shard md: plan\n108 atoms on 1 rank\(s\).*\n  rank .*\n  0 +108 ", out)
