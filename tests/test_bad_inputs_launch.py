"""Bad inputs under mpirun, as a whole job prints them: one report, never every rank's.

Each case runs ``tests/fault_scripts/bad_inputs.py MODE`` on :data:`RANKS` ranks
(its own ``timeout ... mpirun``, with the leftover-process check of
``test_faults_launch.launch``) and checks the exit status and the output lines.
Run by plain pytest (``make test``'s serial step); the launches run in the
background while the module's first test waits. docs/reliability.md quotes the
line counts (before: 42-54 lines, every rank's traceback and ``MPI_ABORT``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from concurrent.futures import Future

import pytest
from background import launch_in_background
from test_faults_launch import BIN, SCRIPTS, Outcome, launch

from ase_shard.comm import Comm

RANKS = 3
# Open MPI's note that a process exited with a non-zero status, after the report
LAUNCHER_NOTE_LINES = 7
WORLD_WARNING = "ase.parallel.world was used before 'import ase_shard'"

pytestmark = [
    pytest.mark.skipif(Comm().size > 1, reason="launches its own mpirun"),
    pytest.mark.timeout(400),
]


def _bad_inputs(mode: str) -> Outcome:
    script = str(SCRIPTS / "bad_inputs.py")
    mpirun = (str(BIN / "mpirun"), "--oversubscribe", "-n", str(RANKS))
    return launch(*mpirun, sys.executable, script, mode, timeout=120)


MODES = ("constructor", "model", "comm", "distribute", "diverge", "world")


@pytest.fixture(scope="module")
def launches(request, tmp_path_factory) -> Iterator[dict[str, Future]]:
    cases = {mode: (lambda folder, mode=mode: _bad_inputs(mode)) for mode in MODES}
    late = "test_world_warning_only_when_late"
    users = {mode: (f"test_uncaught_error_is_reported_once[{mode}]", late) for mode in MODES}
    users["world"] = ("test_world_used_before_import_is_named_once",)
    yield from launch_in_background(request, tmp_path_factory, cases, lanes=2, users=users)


# each error as rank 0 prints it, once
MESSAGES = {
    "constructor": "ValueError: partition must be one of ('spatial', 'contiguous'), not "
    "'random' [rank 0; 2 more rank(s) failed]",
    "model": "TypeError: the model must be a torch.nn.Module that follows the model protocol",
    "comm": "TypeError: comm must be an mpi4py communicator or None, not 'world'",
    "distribute": "ValueError: distribute: constraints are not supported on distributed atoms",
    "diverge": "ValueError: ranks hold different Atoms than rank 0 (rank 2: positions of 1 "
    "atom(s) from atom 40; by up to 0.4 Å)",
}


@pytest.mark.parametrize("mode", list(MESSAGES))
def test_uncaught_error_is_reported_once(mode: str, launches: dict[str, Future]) -> None:
    """Every rank raises the same error: rank 0 alone prints it, exit 1, no MPI_Abort."""
    outcome, message = launches[mode].result(), MESSAGES[mode]
    print(f"{mode}: exit status {outcome.returncode}, {len(outcome.lines)} lines")
    assert outcome.returncode == 1, outcome.output
    assert outcome.output.count("Traceback") == 1, outcome.output
    assert outcome.output.count(message) == 1, outcome.output
    assert "MPI_ABORT" not in outcome.output and "uncaught" not in outcome.output
    # the diverged job printed no result (before: "energy 2.19976313259936")
    assert not any(line.startswith("energy ") for line in outcome.lines), outcome.output
    # nothing but rank 0's "ready", one traceback and the launcher's note ("ready" is
    # stdout, the traceback stderr: mpirun forwards them apart, in either order)
    assert outcome.lines.count("ready") == 1, outcome.output
    lines = [line for line in outcome.lines if line != "ready"]
    start = lines.index("Traceback (most recent call last):")
    end = next(i for i, line in enumerate(lines) if message in line)
    assert start == 0, outcome.output
    assert len(lines) - end - 1 <= LAUNCHER_NOTE_LINES, outcome.output
    assert not outcome.leftovers, outcome.leftovers


def test_world_used_before_import_is_named_once(launches: dict[str, Future]) -> None:
    outcome = launches["world"].result()
    assert outcome.returncode == 0, outcome.output
    assert outcome.output.count(WORLD_WARNING) == 1, outcome.output
    assert "Put 'import ase_shard' first" in outcome.output
    # what the warning is about: every rank believes it is rank 0
    assert outcome.output.count("parprint after import ase_shard") == RANKS


def test_world_warning_only_when_late(launches: dict[str, Future]) -> None:
    """Scripts that import ase.parallel, but use its world only after import ase_shard,
    get no warning."""
    for mode in MODES[:-1]:
        assert WORLD_WARNING not in launches[mode].result().output
