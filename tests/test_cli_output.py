"""``ase-shard md`` output: trajectory formats, the log, the initial temperature,
restarts and warnings, checked against ASE's own calculators and ``ase.io`` read-back."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from ase import units
from ase.build import fcc111
from ase.calculators.emt import EMT
from ase.constraints import FixCom
from ase.io import read, write

from ase_shard.cli import main
from ase_shard.comm import Comm

pytestmark = [
    pytest.mark.skipif(Comm().size > 1, reason="runs ase-shard serially"),
    pytest.mark.timeout(120),
]
BASE = ["md", "--size", "2", "--no-progress"]


def test_extxyz_frames_hold_energy_forces_momenta(tmp_path: Path) -> None:
    out = tmp_path / "out.xyz"
    argv = [*BASE, "--steps", "6", "--interval", "2", "--trajectory", str(out)]
    assert main(argv) == 0
    frames = read(out, ":")
    assert [f.info["md_step"] for f in frames] == [0, 2, 4, 6]
    assert [f.info["md_time_fs"] for f in frames] == [0.0, 4.0, 8.0, 12.0]
    for frame in frames:
        energy, forces = frame.get_potential_energy(), frame.get_forces()
        assert np.abs(frame.get_momenta()).max() > 0
        frame.calc = EMT()
        assert energy == pytest.approx(frame.get_potential_energy(), abs=1e-6)
        np.testing.assert_allclose(forces, frame.get_forces(), atol=1e-6)


def test_any_multi_image_format(tmp_path: Path) -> None:
    out = tmp_path / "out.cif"
    assert main([*BASE, "--steps", "4", "--interval", "2", "--trajectory", str(out)]) == 0
    frames = read(out, ":")
    assert len(frames) == 3 and len(frames[0]) == 32


def test_single_image_format_exit_2(tmp_path: Path, capsys) -> None:
    assert main([*BASE, "--steps", "2", "--trajectory", str(tmp_path / "POSCAR")]) == 2
    assert "cannot append frames to format 'vasp'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("system", "ensemble"),
    [("cu-bulk", "nve"), ("cu-bulk", "langevin"), ("cu-cluster", "nvt-berendsen")],
)
def test_run_starts_at_exactly_the_temperature(system: str, ensemble: str, tmp_path) -> None:
    """Stationary, ZeroRotation (cluster) and FixCom (Langevin) remove degrees of freedom;
    atoms.get_temperature() with the run's constraints is the reference."""
    traj = tmp_path / "t.traj"
    argv = ["md", "--system", system, "--size", "2", "--ensemble", ensemble, "--steps", "0"]
    assert main([*argv, "--temperature", "437", "--trajectory", str(traj)]) == 0
    (first,) = read(traj, ":")
    if ensemble == "langevin":
        first.constraints = [FixCom()]
    assert first.get_temperature() == pytest.approx(437, rel=1e-10)


def test_log_columns_with_barostat(tmp_path: Path) -> None:
    """Each row against the frame of the same step, recomputed with ASE's EMT."""
    log, traj = tmp_path / "md.log", tmp_path / "md.traj"
    argv = [*BASE, "--ensemble", "npt-berendsen", "--steps", "4", "--interval", "2"]
    assert main([*argv, "--log", str(log), "--trajectory", str(traj)]) == 0
    header, *rows = log.read_text().splitlines()
    assert (
        header.split()
        == "# step time[ps] Etot/N[eV] Epot/N[eV] Ekin/N[eV] T[K] P[GPa] V[Å^3]".split()
    )
    frames = read(traj, ":")
    assert len(rows) == len(frames) == 3
    for row, frame in zip(rows, frames, strict=True):
        step, ps, etot, epot, ekin, temperature, pressure, volume = map(float, row.split())
        n = len(frame)
        frame.calc = EMT()
        assert step == frame.info["md_step"] and ps == pytest.approx(step * 2e-3)
        assert epot == pytest.approx(frame.get_potential_energy() / n, abs=1e-5)
        assert ekin == pytest.approx(frame.get_kinetic_energy() / n, abs=1e-5)
        assert etot == pytest.approx(epot + ekin, abs=2e-5)
        assert temperature == pytest.approx(frame.get_temperature(), abs=0.01)
        stress = frame.get_stress(include_ideal_gas=True)
        assert pressure == pytest.approx(-stress[:3].mean() / units.GPa, abs=1e-4)
        assert volume == pytest.approx(frame.get_volume(), abs=0.01)


def test_restart_continues_as_one_run(tmp_path: Path) -> None:
    """NVE: 10 steps, then --restart for 10 more, equals 20 steps in one go."""
    whole, split = tmp_path / "whole.traj", tmp_path / "split.traj"
    argv = [*BASE, "--interval", "5"]
    assert main([*argv, "--steps", "20", "--trajectory", str(whole)]) == 0
    assert main([*argv, "--steps", "10", "--trajectory", str(split)]) == 0
    restart = ["md", "--restart", str(split), "--steps", "10", "--interval", "5", "--no-progress"]
    assert main(restart) == 0
    one, two = read(whole, ":"), read(split, ":")
    assert [f.info["md_step"] for f in two] == [0, 5, 10, 15, 20]
    assert [f.info["md_time_fs"] for f in two] == [0.0, 10.0, 20.0, 30.0, 40.0]
    for a, b in zip(one, two, strict=True):
        np.testing.assert_allclose(a.positions, b.positions, rtol=0, atol=1e-12)
        np.testing.assert_allclose(a.get_momenta(), b.get_momenta(), rtol=0, atol=1e-12)
        np.testing.assert_array_equal(a.cell.array, b.cell.array)


def test_upto_lets_a_resubmitted_job_finish(tmp_path: Path, capsys) -> None:
    """--upto: the same --restart command, run twice, ends at step --steps (the second
    run exits at once), and the frames equal one uninterrupted run's."""
    whole, split = tmp_path / "whole.traj", tmp_path / "split.traj"
    argv = [*BASE, "--interval", "5"]
    assert main([*argv, "--steps", "20", "--trajectory", str(whole)]) == 0
    assert main([*argv, "--steps", "10", "--trajectory", str(split)]) == 0  # killed at 10
    resubmitted = ["md", "--restart", str(split), "--steps", "20", "--upto", "--interval", "5"]
    resubmitted.append("--no-progress")
    capsys.readouterr()
    assert main(resubmitted) == 0
    assert "10 x 2 fs" in capsys.readouterr().out  # the 10 steps left, not 20
    assert main(resubmitted) == 0
    assert "step 20 already reached (--upto), nothing to run" in capsys.readouterr().out
    one, two = read(whole, ":"), read(split, ":")
    assert [f.info["md_step"] for f in two] == [0, 5, 10, 15, 20]
    for a, b in zip(one, two, strict=True):
        np.testing.assert_allclose(a.positions, b.positions, rtol=0, atol=1e-12)
        np.testing.assert_allclose(a.get_momenta(), b.get_momenta(), rtol=0, atol=1e-12)


def test_restart_needs_a_step(tmp_path: Path, capsys) -> None:
    path = tmp_path / "plain.traj"
    write(path, fcc111("Cu", (2, 2, 3), vacuum=5.0))
    assert main(["md", "--restart", str(path), "--steps", "2"]) == 2
    assert "has no md_step" in capsys.readouterr().err


def test_barostat_warns_about_a_non_periodic_axis(tmp_path: Path, capsys) -> None:
    slab = tmp_path / "slab.traj"
    write(slab, fcc111("Cu", (2, 2, 3), a=3.61, vacuum=6.0))  # pbc True, True, False
    argv = ["md", str(slab), "--ensemble", "npt-berendsen", "--steps", "2", "--no-progress"]
    assert main(argv) == 0
    (warning,) = capsys.readouterr().err.splitlines()
    assert (
        warning.startswith("ase-shard md: warning: npt-berendsen") and "non-periodic c" in warning
    )


def test_log_and_progress_appear_in_step_order() -> None:
    """stdout (log) and stderr (progress) into one pipe: step numbers never go back."""
    command = [sys.executable, "-m", "ase_shard.cli", *BASE[:3], "--steps", "20"]
    command += ["--interval", "4", "--log", "-"]
    done = subprocess.run(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=100
    )
    assert done.returncode == 0, done.stdout
    steps = [
        int(m.group(1) or m.group(2))
        for m in re.finditer(
            r"^(?:\s*(\d+) +\d+\.\d{4} |\s*\d+% +(\d+)/20 steps)", done.stdout, re.M
        )
    ]
    assert len(steps) == 6 + 11 and steps == sorted(steps)
