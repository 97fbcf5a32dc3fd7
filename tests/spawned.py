"""Checks shared by the tests that spawn MPI workers from a plain Python process."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

BANNER = "Abort is in progress"  # what Open MPI's prte prints on a second SIGTERM


def assert_clean_shutdown(done: subprocess.CompletedProcess) -> None:
    """No abort banner or error on stderr, and the 3 spawned processes gone within 20 s.

    ``done``'s stdout holds a line ``PIDS [prte, worker, worker]`` (JSON).
    """
    assert BANNER not in done.stderr, done.stderr
    assert "ERROR" not in done.stderr, done.stderr
    pids = json.loads(done.stdout.split("PIDS")[1].splitlines()[0])
    assert len(pids) == 3  # prte and two workers
    deadline = time.monotonic() + 20
    while (alive := [pid for pid in pids if Path(f"/proc/{pid}").exists()]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.2)
    assert not alive, f"left running: {alive}"
