"""``tests/side_by_side.py``, which ``make test`` runs its one-process runs with."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("side_by_side.py")
PYTHON = [sys.executable, "-c"]


def side_by_side(*commands: list[str]) -> subprocess.CompletedProcess:
    argv = [word for command in commands for word in ("--", *command)]
    return subprocess.run(
        [sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=60
    )


def test_commands_run_together_and_their_outputs_do_not_interleave(tmp_path) -> None:
    """The second command waits for a file that the first writes only after the second
    has started: run one after the other, they would time out."""
    flag = tmp_path / "second-started"
    first = (
        "import pathlib, time\n"
        f"flag = pathlib.Path({str(flag)!r})\n"
        "deadline = time.time() + 20\n"
        "while not flag.exists() and time.time() < deadline: time.sleep(0.01)\n"
        "assert flag.exists()\n"
        "print('first done')\n"
    )
    second = (
        "import pathlib, sys\n"
        # flushed: without PYTHONUNBUFFERED, stdout into a pipe waits in Python's buffer
        # until exit, after stderr's line
        "print('second line 1', flush=True)\n"
        f"pathlib.Path({str(flag)!r}).touch()\n"
        "print('second line 2', file=sys.stderr)\n"
    )
    done = side_by_side([*PYTHON, first], [*PYTHON, second])
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "first done"
    assert re.match(r"== ran beside the first, exit status 0 after \d+ s: ", lines[1])
    # after the header (the second command, over several lines), its output, in order
    assert lines[-2:] == ["second line 1", "second line 2"]


@pytest.mark.parametrize(
    ("statuses", "expected"), [((0, 3, 5), 3), ((2, 0, 0), 2), ((0, 0, 0), 0)]
)
def test_exit_status_is_the_first_failure(statuses: tuple[int, ...], expected: int) -> None:
    done = side_by_side(*([*PYTHON, f"raise SystemExit({status})"] for status in statuses))
    assert done.returncode == expected
    for status in statuses:
        assert (f"side_by_side.py: exit status {status}:" in done.stderr) == bool(status)


def test_a_lane_runs_its_commands_in_order_and_stops_at_a_failure(tmp_path) -> None:
    """``--then`` waits for the command before it (the second reads the file the first
    wrote) and does not run after a failure; the lane beside it runs on regardless."""
    written = f"pathlib.Path({str(tmp_path / 'written')!r})"
    write = [*PYTHON, f"import pathlib, time; time.sleep(0.5); {written}.touch()"]
    check = [*PYTHON, f"import pathlib; assert {written}.exists(); print('after')"]
    fail = [*PYTHON, "raise SystemExit(4)"]
    never = [*PYTHON, "print('never')"]
    argv = ["--", *write, "--then", *check, "--", *fail, "--then", *never]
    argv += ["--", *PYTHON, "print('beside')"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 4
    assert done.stdout.splitlines()[0] == "after"
    assert "never" not in done.stdout
    assert "beside" in done.stdout
    assert "side_by_side.py: exit status 4:" in done.stderr
    assert "side_by_side.py: not run: " in done.stderr and "never" in done.stderr
