"""``python tests/side_by_side.py -- COMMAND... [-- COMMAND...]``: commands at the same time.

``make test`` runs its one-process test runs this way: each keeps about one core busy
(the main one 1.5 on average), and the machine has two. The first command's output
comes as it is written; each other command's is kept in a temporary file and printed,
under a header naming it, once every command has ended, so the outputs do not
interleave. The exit status is 0 when every command exited 0, otherwise that of the
first one (in command-line order) that did not. Interrupted (Ctrl-C, SIGTERM), it
ends the commands it started before it exits.
"""

from __future__ import annotations

import shlex
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence


def split_commands(argv: Sequence[str]) -> list[list[str]]:
    """``["--", "a", "1", "--", "b"]`` -> ``[["a", "1"], ["b"]]``."""
    if not argv or argv[0] != "--":
        raise SystemExit("usage: side_by_side.py -- COMMAND... [-- COMMAND...]")
    commands: list[list[str]] = []
    for word in argv:
        if word == "--":
            commands.append([])
        else:
            commands[-1].append(word)
    if not all(commands):
        raise SystemExit("side_by_side.py: an empty command between two '--'")
    return commands


def main(argv: Sequence[str]) -> int:
    commands = split_commands(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # ends the commands too
    with tempfile.TemporaryDirectory(prefix="side-by-side-") as folder:
        logs = [open(f"{folder}/{index}.log", "w+") for index in range(1, len(commands))]
        processes: list[subprocess.Popen] = []
        try:
            processes.append(subprocess.Popen(commands[0]))
            for command, log in zip(commands[1:], logs, strict=True):
                processes.append(
                    subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
                )
            statuses = [process.wait() for process in processes]
        except KeyboardInterrupt:
            for process in processes:
                process.terminate()
            for process in processes:
                process.wait()
            return 130
        for command, log, status in zip(commands[1:], logs, statuses[1:], strict=True):
            sys.stdout.write(f"== ran beside the first, exit status {status}: ")
            sys.stdout.write(f"{shlex.join(command)}\n")
            log.seek(0)
            sys.stdout.write(log.read())
            sys.stdout.flush()
            log.close()
    failed = [
        (status, shlex.join(command))
        for command, status in zip(commands, statuses, strict=True)
        if status
    ]
    for status, command in failed:
        print(f"side_by_side.py: exit status {status}: {command}", file=sys.stderr)
    if not failed:
        return 0
    status = failed[0][0]
    return status if status > 0 else 128 - status  # killed by a signal: 128 + its number


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
