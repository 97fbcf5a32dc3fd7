"""Fault matrix, launched part: dying ranks and drivers end the job, with no orphans.

Each case starts its own ``timeout ... mpirun ...`` (or a spawning Python) on a
script of ``tests/fault_scripts`` in a session of its own, records every process
of the job while it runs (:class:`Members`: the launcher's descendants, polled, and
at the end everything still in its session), and checks the exit status, the time
from the injected fault (the ``fault`` line) to the end of the job, and that every
recorded process is gone, whatever the script printed. Run by plain pytest
(``make test``'s serial step); docs/reliability.md lists the outcomes and times.

The launches are independent process trees, so the module starts those of the
selected tests :data:`AT_ONCE` at a time (:func:`launches`): a job spends part of
its time starting up, waiting for a timeout or being torn down, and the other
core of a 2-core machine runs the next job meanwhile. Each test then checks the
outcome of its own launch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from ase_shard.comm import ALLOW_RUN_AS_ROOT, Comm

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).parent / "fault_scripts"
BIN = Path(sys.executable).parent
ENV = {**os.environ, **ALLOW_RUN_AS_ROOT, "OMP_NUM_THREADS": "1"}
RANKS = 2
# a job must end this soon after the fault (a hang runs into the timeout instead);
# measured 0.3-5 s on a loaded 2-core machine
BOUND_S = 45.0
TIMEOUT_S = 150
AT_ONCE = 3  # launches running at the same time (a job is idle part of its time)

pytestmark = [
    pytest.mark.timeout(TIMEOUT_S + 60),
    pytest.mark.skipif(Comm().size > 1, reason="launches its own mpirun"),
]


@dataclass
class Outcome:
    """What one launch did."""

    returncode: int
    lines: list[str] = field(default_factory=list)
    seconds_after_fault: float | None = None
    processes: int = 0  # the processes of the job that were seen (the launcher's not counted)
    leftovers: list[str] = field(default_factory=list)

    @property
    def output(self) -> str:
        return "\n".join(self.lines)


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


POLL_S = 0.2  # how often a launch's processes are listed while it runs


class Members:
    """Every process a launch started: the launcher's descendants, listed every
    :data:`POLL_S` while it runs (a process that leaves the session, as a daemon does,
    is seen while it is still a descendant), and at the end the processes still in its
    session (an orphan is no descendant any more, but keeps the session).

    Processes are kept as :class:`psutil.Process`, which remember their start time:
    a pid reused by an unrelated process later does not count.
    """

    def __init__(self, leader: int):
        self.leader = psutil.Process(leader)
        self.seen: dict[int, psutil.Process] = {}

    def poll(self) -> None:
        try:
            descendants = self.leader.children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for process in descendants:
            self.seen.setdefault(process.pid, process)

    def add_session(self) -> None:
        """The processes still in the leader's session (its id is the leader's pid)."""
        for process in psutil.process_iter():
            try:
                if os.getsid(process.pid) == self.leader.pid:
                    self.seen.setdefault(process.pid, process)
            except (ProcessLookupError, PermissionError):
                pass

    def alive(self) -> list[psutil.Process]:
        return [process for process in self.seen.values() if _alive(process)]


def launch(*args: str, timeout: int = TIMEOUT_S) -> Outcome:
    """Run ``args`` under ``timeout`` seconds; time the fault and look for survivors.

    Output is read on a thread, so a survivor that keeps the pipe open cannot
    block the test; survivors are reported, then killed by pid.
    """
    command = ["timeout", "-k", "5", str(timeout), *args]
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    members = Members(process.pid)
    fault_at: list[float] = []
    outcome = Outcome(returncode=-1)

    def read() -> None:
        for line in process.stdout:
            outcome.lines.append(line.rstrip())
            if line.startswith("fault") and not fault_at:
                fault_at.append(time.monotonic())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout + 30
    while process.poll() is None:
        members.poll()
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(command, timeout + 30)
        time.sleep(POLL_S)
    outcome.returncode = process.returncode
    ended = time.monotonic()
    members.add_session()
    reader.join(timeout=5)
    if fault_at:
        outcome.seconds_after_fault = ended - fault_at[0]
    outcome.processes = len(members.seen)
    grace = ended + 10
    while members.alive() and time.monotonic() < grace:
        time.sleep(0.2)
    for survivor in members.alive():
        try:
            outcome.leftovers.append(f"{survivor.pid} {' '.join(survivor.cmdline())}")
            survivor.kill()
        except psutil.NoSuchProcess:
            pass
    return outcome


def mpirun(script: str, *args: str, python: tuple[str, ...] = (), **kwargs) -> Outcome:
    """``script`` of tests/fault_scripts on ``RANKS`` ranks (``kwargs``: :func:`launch`)."""
    return launch(
        str(BIN / "mpirun"),
        "--oversubscribe",
        "-n",
        str(RANKS),
        sys.executable,
        *python,
        str(SCRIPTS / script),
        *args,
        **kwargs,
    )


def assert_nothing_left(outcome: Outcome, started: int) -> None:
    """At least ``started`` processes of the job were seen, and none is left."""
    assert outcome.processes >= started, (outcome.processes, outcome.output)
    assert not outcome.leftovers, outcome.leftovers


# the processes a launch starts at least: mpirun and its ranks; a driver and its worker
MPIRUN_STARTS = RANKS + 1
SPAWN_STARTS = 2


def assert_job_ended(outcome: Outcome, started: int = MPIRUN_STARTS) -> None:
    """Non-zero exit soon after the fault, nobody finished, no process left."""
    print(f"exit status {outcome.returncode}, {outcome.seconds_after_fault} s after the fault")
    assert outcome.returncode not in (0, 124), outcome.output
    assert outcome.seconds_after_fault is not None, outcome.output
    assert outcome.seconds_after_fault < BOUND_S, outcome.output
    assert "must not" not in outcome.output
    assert_nothing_left(outcome, started)


def spawn(mode: str) -> Outcome:
    """``tests/fault_scripts/spawn.py MODE`` in a plain Python (it spawns its workers)."""
    return launch(sys.executable, str(SCRIPTS / "spawn.py"), mode)


# every launch, by the name of the test that checks it
CASES: dict[str, Callable[[], Outcome]] = {
    "test_dying_rank_ends_the_job[kill]": lambda: mpirun("spmd.py", "kill"),
    "test_dying_rank_ends_the_job[raise]": lambda: mpirun("spmd.py", "raise"),
    "test_sys_exit_on_one_rank_under_mpi4py_runner": lambda: mpirun(
        "spmd.py", "sysexit", python=("-m", "mpi4py")
    ),
    "test_serve_fault_ends_the_job[kill]": lambda: mpirun("serve.py", "kill"),
    "test_serve_fault_ends_the_job[raise]": lambda: mpirun("serve.py", "raise"),
    "test_serve_fault_ends_the_job[worker-kill]": lambda: mpirun("serve.py", "worker-kill"),
    "test_spawn_fault_leaves_no_workers[kill]": lambda: spawn("kill"),
    "test_spawn_fault_leaves_no_workers[raise]": lambda: spawn("raise"),
    "test_spawn_fault_leaves_no_workers[worker-kill]": lambda: spawn("worker-kill"),
    "test_spawn_model_the_workers_cannot_load": lambda: spawn("bad-model"),
    # a hang fails fast
    "test_ranks_diverge_after_a_cached_call": lambda: mpirun("spmd.py", "diverge", timeout=60),
    "test_atom_a_billion_angstrom_away": lambda: mpirun("spmd.py", "far-atom", timeout=60),
    "test_error_on_every_rank_is_reported_once": lambda: mpirun("spmd.py", "overlap", timeout=60),
    "test_error_caught_on_one_rank_still_ends_the_job": lambda: mpirun(
        "spmd.py", "overlap-caught", timeout=90
    ),
}


@pytest.fixture(scope="module")
def launches(request) -> dict[str, Future]:
    """The launches of the selected tests of this module, :data:`AT_ONCE` at a time,
    started in the order the tests run."""
    module = request.module
    names = [
        item.name for item in request.session.items if getattr(item, "module", None) is module
    ]
    with ThreadPoolExecutor(max_workers=AT_ONCE) as pool:
        yield {name: pool.submit(CASES[name]) for name in names if name in CASES}


@pytest.fixture
def outcome(request, launches: dict[str, Future]) -> Outcome:
    """The outcome of this test's launch."""
    return launches[request.node.name].result()


# -- 5: a rank dies while the others wait in a collective -----------------------------


@pytest.mark.parametrize("mode", ["kill", "raise"])
def test_dying_rank_ends_the_job(mode: str, outcome: Outcome) -> None:
    assert_job_ended(outcome)
    if mode == "raise":
        assert f"uncaught RuntimeError on MPI rank {RANKS - 1} of {RANKS}" in outcome.output
        assert "RuntimeError: injected failure" in outcome.output


def test_sys_exit_on_one_rank_under_mpi4py_runner(outcome: Outcome) -> None:
    """``sys.exit(n)`` skips excepthooks; ``python -m mpi4py`` turns it into an abort."""
    assert_job_ended(outcome)


# -- 6: worker and notebook modes -----------------------------------------------------


@pytest.mark.parametrize("mode", ["kill", "raise", "worker-kill"])
def test_serve_fault_ends_the_job(mode: str, outcome: Outcome) -> None:
    assert_job_ended(outcome)


@pytest.mark.parametrize("mode", ["kill", "raise", "worker-kill"])
def test_spawn_fault_leaves_no_workers(mode: str, outcome: Outcome) -> None:
    assert_job_ended(outcome, SPAWN_STARTS)


def test_spawn_model_the_workers_cannot_load(outcome: Outcome) -> None:
    assert outcome.returncode == 0, outcome.output
    assert "could not load the model" in outcome.output
    assert "LocalEMT" in outcome.output and "[rank 1]" in outcome.output
    assert_nothing_left(outcome, SPAWN_STARTS)


# -- 3: input faults that end a process today ------------------------------------------


def test_ranks_diverge_after_a_cached_call(outcome: Outcome) -> None:
    """Only the last rank moved an atom: it alone calculates, waits, and ends the job."""
    assert_job_ended(outcome)
    assert f"ase_shard: rank {RANKS - 1} waited" in outcome.output
    assert "do all ranks hold the same Atoms" in outcome.output


def test_atom_a_billion_angstrom_away(outcome: Outcome) -> None:
    assert outcome.returncode == 0, outcome.output
    error = float(outcome.output.split("far-atom error=")[1].split()[0])
    assert error <= 1e-10
    assert_nothing_left(outcome, MPIRUN_STARTS)


# -- 4: an error every rank raised together ---------------------------------------------


def test_error_on_every_rank_is_reported_once(outcome: Outcome) -> None:
    """Every rank raises the same error: one traceback (rank 0's), exit 1, no MPI_Abort."""
    assert outcome.returncode == 1, outcome.output
    assert outcome.output.count("Traceback") == 1, outcome.output
    assert outcome.output.count("closer than min_distance") == 1, outcome.output
    assert "atoms 4 and 9 are 0.3464 Å apart" in outcome.output
    assert "MPI_ABORT" not in outcome.output and "uncaught" not in outcome.output
    assert_nothing_left(outcome, MPIRUN_STARTS)


def test_error_caught_on_one_rank_still_ends_the_job(outcome: Outcome) -> None:
    """One rank catches the shared error and waits: rank 0 stops waiting and aborts."""
    assert_job_ended(outcome)
    assert "MPI_ABORT" in outcome.output
