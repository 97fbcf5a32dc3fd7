"""Test set-up shared by serial runs and runs under mpirun.

Besides the set-up, three things every run of ``make test`` uses:

- ``--skip-budget``: the run fails when a test is skipped for a reason that is not in
  :data:`ALLOWED_SKIPS` (a missing package, a missing ``mpirun`` or a broken environment
  must fail ``make test``, not turn whole families into skips).
- the ``rank_independent`` marker: a test whose outcome cannot depend on the rank count
  (buffers, counters, one process playing every rank) runs in one process only; under
  mpirun with several ranks it is deselected, not skipped.
- ``--exchange-report PATH``: under mpirun, which tests moved bulk data between ranks
  (some rank's :attr:`ase_shard.comm.Comm.received_bytes` grew during the test), as
  JSON written by rank 0 and one summary line.
"""

import json
import re
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

import ase_shard  # noqa: F401  (initialises MPI before ASE touches ase.parallel.world)
from ase_shard.comm import Comm

sys.path.insert(0, str(Path(__file__).parent))  # tests import oracles/systems/toy_models

_COMM = Comm()
if _COMM.size > 1:
    torch.set_num_threads(1)

# The only reasons a test of ``make test`` may be skipped, by name: what no run of
# ``make test`` can give on a machine without a GPU, and tests that ``make test`` runs at
# another rank count (the reason says which). Anything else fails the skip budget.
ALLOWED_SKIPS = {
    "CUDA only": re.compile(r"needs (a )?CUDA( device| and CUDA-aware MPI)?$"),
    "under mpirun only": re.compile(
        r"one rank: the kernel exchanges nothing$|needs a communicator smaller than the atoms'$"
        r"|need --with-mpi option to run$"  # pytest-mpi: @pytest.mark.mpi in a serial run
    ),
    # tests/test_peers.py: a system MPICH on the loader's path leaves nothing to check
    "system MPICH": re.compile(r"libmpi\.so\.12 is on the loader's path$"),
}


def pytest_addoption(parser) -> None:
    group = parser.getgroup("ase_shard")
    group.addoption(
        "--skip-budget",
        action="store_true",
        help="fail the run when a test is skipped for a reason not in conftest.ALLOWED_SKIPS",
    )
    group.addoption(
        "--exchange-report",
        metavar="PATH",
        help="under mpirun: write which tests moved bulk data between ranks to PATH (JSON)",
    )


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers",
        "rank_independent: the same outcome at any rank count; runs in one process only "
        "(deselected under mpirun with several ranks)",
    )
    if _COMM.size > 1 and config.option.basetemp is None:
        # ranks of one job must not clean up each other's temporary directories
        config.option.basetemp = (
            Path(tempfile.gettempdir()) / f"ase-shard-pytest-{_COMM.size}ranks-rank{_COMM.rank}"
        )
    if config.option.skip_budget:
        config.pluginmanager.register(SkipBudget(), "ase_shard_skip_budget")
    if config.option.exchange_report:
        config.pluginmanager.register(
            ExchangeReport(Path(config.option.exchange_report)), "ase_shard_exchange_report"
        )


def pytest_collection_modifyitems(config, items) -> None:
    if _COMM.size == 1:
        return
    kept, deselected = [], []
    for item in items:
        (deselected if item.get_closest_marker("rank_independent") else kept).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


def allowed_skip(reason: str) -> str | None:
    """The name of the :data:`ALLOWED_SKIPS` entry that allows ``reason``, if any."""
    reason = reason.removeprefix("Skipped: ")
    return next((name for name, rule in ALLOWED_SKIPS.items() if rule.search(reason)), None)


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)


class SkipBudget:
    """Fails the session when a test or module was skipped for a reason not allowed."""

    def __init__(self) -> None:
        self.refused: list[str] = []

    def _check(self, report) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            reason = _skip_reason(report)
            if allowed_skip(reason) is None:
                self.refused.append(f"{report.nodeid}: {reason}")

    def pytest_runtest_logreport(self, report) -> None:
        self._check(report)

    def pytest_collectreport(self, report) -> None:
        self._check(report)

    def pytest_sessionfinish(self, session) -> None:
        if self.refused and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.refused:
            terminalreporter.section("skip budget exceeded", sep="=", red=True, bold=True)
            terminalreporter.line(
                f"{len(self.refused)} skipped for a reason not in conftest.ALLOWED_SKIPS "
                f"({', '.join(ALLOWED_SKIPS)}):"
            )
            for line in self.refused:
                terminalreporter.line(f"  {line}")


class _ReceivedBytes:
    """Stands in for ``Comm.received_bytes``: every increase of any Comm's count is
    also added to :attr:`total` (this process's bulk bytes received from other ranks)."""

    total = 0
    slot = "_received_bytes_counted"

    def __get__(self, comm, owner=None):
        return self if comm is None else comm.__dict__.get(self.slot, 0)

    def __set__(self, comm, value) -> None:
        _ReceivedBytes.total += max(0, value - comm.__dict__.get(self.slot, 0))
        comm.__dict__[self.slot] = value


class ExchangeReport:
    """Per test (set-up, call and tear-down), the bytes this rank received from others
    and its wall seconds; at the end every rank's go to rank 0, which writes the report:
    per test id, ``bytes`` and ``seconds`` by rank."""

    def __init__(self, path: Path):
        self.path = path
        self.tests: dict[str, tuple[int, float]] = {}
        Comm.received_bytes = _ReceivedBytes()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item):
        received, start = _ReceivedBytes.total, time.perf_counter()
        yield
        self.tests[item.nodeid] = (_ReceivedBytes.total - received, time.perf_counter() - start)

    def pytest_sessionfinish(self, session) -> None:
        every_rank = _COMM.gather(self.tests)
        if not _COMM.is_root:
            return
        tests = {
            test: {
                "bytes": [rank.get(test, (0, 0.0))[0] for rank in every_rank],
                "seconds": [round(rank.get(test, (0, 0.0))[1], 3) for rank in every_rank],
            }
            for test in sorted(set().union(*every_rank))
        }
        exchanged = [test for test, seen in tests.items() if max(seen["bytes"]) > 0]
        self.path.write_text(
            json.dumps(
                {"ranks": _COMM.size, "exchanged": len(exchanged), "tests": tests}, indent=1
            )
        )
        print(
            f"\nexchange report ({_COMM.size} ranks): {len(exchanged)} of {len(tests)} tests "
            f"moved data between ranks; {self.path}"
        )


@pytest.fixture
def launched(request, launches):
    """What this test's launch returned, in modules that start their launches in the
    background (a module-scoped ``launches`` fixture, see tests/background.py)."""
    return launches[request.node.name].result()
