"""``python tests/side_by_side.py -- COMMAND... [--then COMMAND...] [-- COMMAND... ...]``.

Runs lanes of commands at the same time: each ``--`` starts a lane, and ``--then`` adds a
command that its lane runs after the one before it has exited 0 (a lane is a ``&&``
chain). ``make test`` runs its pytest runs this way: the main one-process run keeps 1.5
of the machine's two cores busy on average and each mpirun run's ranks, when they wait,
give their core to the runs beside them (Open MPI's ``mpi_yield_when_idle``).

The first lane's output comes as it is written; each other command's is kept in a
temporary file and printed, under a header naming it, its exit status and its time,
once every lane has ended, so the outputs do not interleave. The exit status is 0 when every
command exited 0, otherwise that of the first failed command in command-line order.
Interrupted (Ctrl-C, SIGTERM), it ends the commands it started before it exits.
"""

from __future__ import annotations

import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO

USAGE = "usage: side_by_side.py -- COMMAND... [--then COMMAND...] [-- COMMAND... ...]"


@dataclass
class Step:
    """One command of a lane; ``status`` is None while it has not run (or not ended)."""

    command: list[str]
    log: IO[str] | None = None  # None: the command writes to this process's stdout
    status: int | None = None
    seconds: float = 0.0  # wall time from start to exit


@dataclass
class Lane:
    steps: list[Step] = field(default_factory=list)
    running: subprocess.Popen | None = None
    stopped: bool = False  # interrupted: start nothing more
    lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self) -> None:
        """Each step after the one before it has exited 0."""
        for step in self.steps:
            with self.lock:  # no step starts after stop() has looked
                if self.stopped:
                    return
                self.running = subprocess.Popen(
                    step.command,
                    stdout=step.log,
                    stderr=subprocess.STDOUT if step.log else None,
                )
            started = time.monotonic()
            step.status = self.running.wait()
            step.seconds = time.monotonic() - started
            if step.status:
                return

    def stop(self) -> None:
        with self.lock:
            self.stopped = True
            if self.running is not None:
                self.running.terminate()


def split_lanes(argv: Sequence[str]) -> list[list[list[str]]]:
    """``["--", "a", "--then", "b", "--", "c"]`` -> ``[[["a"], ["b"]], [["c"]]]``."""
    if not argv or argv[0] != "--":
        raise SystemExit(USAGE)
    lanes: list[list[list[str]]] = []
    for word in argv:
        if word == "--":
            lanes.append([[]])
        elif word == "--then":
            lanes[-1].append([])
        else:
            lanes[-1][-1].append(word)
    if not all(all(lane) for lane in lanes):
        raise SystemExit("side_by_side.py: an empty command before a '--' or '--then'")
    return lanes


def main(argv: Sequence[str]) -> int:
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # ends the commands too
    with tempfile.TemporaryDirectory(prefix="side-by-side-") as folder:
        lanes: list[Lane] = []
        for lane_index, commands in enumerate(split_lanes(argv)):
            lanes.append(Lane())
            for index, command in enumerate(commands):
                log = None if lane_index == 0 else open(f"{folder}/{lane_index}-{index}", "w+")
                lanes[-1].steps.append(Step(command, log))
        threads = [threading.Thread(target=lane.run) for lane in lanes]
        try:
            for thread in threads:
                thread.start()
            for thread in threads:
                while thread.is_alive():  # a timed join lets Ctrl-C and SIGTERM through
                    thread.join(timeout=0.5)
        except KeyboardInterrupt:
            for lane in lanes:
                lane.stop()
            for thread in threads:
                thread.join()
            return 130
        steps = [step for lane in lanes for step in lane.steps]
        for step in steps:
            if step.log is None:
                continue
            if step.status is not None:  # a step its lane never started has no output
                sys.stdout.write(
                    f"== ran beside the first, exit status {step.status} "
                    f"after {step.seconds:.0f} s: {shlex.join(step.command)}\n"
                )
                step.log.seek(0)
                sys.stdout.write(step.log.read())
                sys.stdout.flush()
            step.log.close()
    failed = [step for step in steps if step.status]
    for step in failed:
        print(
            f"side_by_side.py: exit status {step.status}: {shlex.join(step.command)}",
            file=sys.stderr,
        )
    for step in steps:
        if step.status is None:
            print(f"side_by_side.py: not run: {shlex.join(step.command)}", file=sys.stderr)
    if not failed:
        return 0
    status = failed[0].status
    return status if status > 0 else 128 - status  # killed by a signal: 128 + its number


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
