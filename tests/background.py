"""Launches of a test module, run in the background while its other tests run.

Many tests of the serial suite each check one process tree they launch (``mpirun``,
a spawning Python, an example script) and spend their time waiting for it, while the
tests that run in-process keep one core of a 2-core machine busy and leave the other
idle. :func:`launch_in_background` starts the launches of a module's selected tests at
its first test, on ``lanes`` threads, in the order of ``cases``; each test then checks
the outcome of its own launch (``launches[request.node.name].result()``), or of a launch
it shares with other tests, with every assertion it made when it launched in the
foreground.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest


def launch_in_background(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    cases: dict[str, Callable[[Path], Any]],
    lanes: int,
    users: dict[str, tuple[str, ...]] | None = None,
) -> Iterator[dict[str, Future]]:
    """For a module-scoped fixture: ``cases[name](folder)``, ``lanes`` at a time, each
    with a fresh ``folder``, for every launch ``name`` that a selected test of the module
    checks: ``users[name]`` (by default the test called ``name``).

    Yields the futures by launch name; leaving waits for the launches still running.
    """
    module = request.module
    selected = {
        item.name for item in request.session.items if getattr(item, "module", None) is module
    }
    users = users or {}
    with ThreadPoolExecutor(max_workers=lanes) as pool:
        yield {
            name: pool.submit(case, tmp_path_factory.mktemp(re.sub(r"\W", "_", name)[:30]))
            for name, case in cases.items()
            if selected.intersection(users.get(name, (name,)))
        }
