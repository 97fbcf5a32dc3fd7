"""``ase-shard md`` with an option that adds a term to the model (``--d3``, ``--coulomb``).

:func:`run_with_term` runs two steps, checks that every frame records the option and
that a restart keeps it; :func:`assert_refused` checks one-line refusals (exit 2).
"""

from __future__ import annotations

from pathlib import Path

from ase import Atoms
from ase.io import read, write

from ase_shard.cli import main


def run_with_term(
    folder: Path, atoms: Atoms, model: str, option: str, value: str
) -> tuple[Path, Path, Atoms]:
    """``ase-shard md START --model model --option value`` for two steps, then a restart
    of one: every frame records ``md_<option> = value``. Returns the start file, the
    trajectory and the first run's last frame (to compare with an oracle)."""
    start = folder / "start.extxyz"
    write(start, atoms)
    traj = folder / "run.traj"
    run = ["md", str(start), "--model", model, "--steps", "2", "--interval", "1", "--no-progress"]
    assert main([*run, f"--{option}", value, "--trajectory", str(traj)]) == 0
    frames = read(traj, ":")
    assert [frame.info[f"md_{option}"] for frame in frames] == [value] * 3
    assert main(["md", "--restart", str(traj), "--steps", "1", "--no-progress"]) == 0
    assert read(traj, -1).info[f"md_{option}"] == value
    return start, traj, frames[-1]


def assert_refused(capsys, cases: list[tuple[list[str], str]]) -> None:
    """Each ``ase-shard md --steps 1 ARGUMENTS`` exits 2, its error naming ``message``."""
    capsys.readouterr()
    for arguments, message in cases:
        assert main(["md", "--steps", "1", *arguments]) == 2
        assert message in capsys.readouterr().err
