"""pytest plugin: ASE's own tests, with ShardedCalculator in place of ASE's classical calculators.

Loaded by ``python -m tests.ase_conformance`` (see ``__main__.py``). It runs the test
files of the installed ASE that use ``EMT``, ``LennardJones`` or ``MorsePotential``
(chosen at run time by :func:`selected`, so an ASE upgrade brings its new tests), with
``ase.calculators.emt.EMT``, ``ase.calculators.lj.LennardJones`` and
``ase.calculators.morse.MorsePotential`` replaced, before any of ASE's test modules is
imported, by the :class:`ShardedCalculator` subclasses below: ASE's constructor
signature and ``parameters``, ase_shard's model.

Under ``mpirun -n P`` every rank runs every test (SPMD, as a user's script does), in its
own temporary directories, and the calculators span all ranks. ASE itself runs on each
rank as if alone: ``ase.parallel.world`` is one rank, as on rank 0 in ase_shard's worker
mode. ASE's tests are not written for a world of several ranks: with ASE's own
calculators and ASE's world of two ranks, tests fail that write files on rank 0 and read
them on every rank, expect a warning from a write that only rank 0 does, or start a
socket server on each rank. What the mpirun run checks is the calculator: each rank's
ASE drives it with its own copy of the atoms, so results that differed between ranks
would make the ranks' optimisations and MD part, and the calculator's same-Atoms check
fail. The ranks start every test together from the same random state (ASE's conftest
seeds NumPy for each test) and must agree on its outcome.

The failures that are not ours are listed in ``excused.py``; they are marked
``xfail(strict=True)``, so an excuse that no longer fails fails the run too.
``--record-reached FILE`` (one process) lists the tests that reached our calculators;
``--only-reached FILE`` (under mpirun) runs only those: the others run each rank's ASE
alone there and check nothing of ours.
``--ase-calculators`` runs the same tests with ASE's own calculators, for reference.
"""

from __future__ import annotations

import hashlib
import re
import sys
import tempfile
from pathlib import Path

import ase._4.calculators.emt
import ase.calculators.emt
import ase.calculators.lj
import ase.calculators.morse
import ase.optimize  # noqa: F401  (before ase._4.optimize, which cannot be imported first)
import ase.parallel
import ase.test
import numpy as np
import pytest

import ase_shard  # noqa: F401  (initialises MPI before ASE touches ase.parallel.world)
from ase_shard import ShardedCalculator, models
from ase_shard.comm import Comm
from tests.ase_conformance.excused import EXCUSED, EXCUSED_UNDER_MPI

ASE_TESTS = Path(ase.test.__file__).parent
# the plugin's own collectives, apart from the calculators': a rank that a failing test
# left inside a calculation cannot match them with the calculator's
_WORLD = sys.modules.get("mpi4py.MPI")
COMM = Comm(_WORLD.COMM_WORLD.Dup() if _WORLD is not None else None)
# ranks waiting longer than this (s) for each other at the start of a calculation abort
# the job with the calculator's message: a test that failed on some ranks only
RANKS_TIMEOUT = 120.0

ASE_EMT = ase.calculators.emt.EMT
ASE_LJ = ase.calculators.lj.LennardJones
ASE_MORSE = ase.calculators.morse.MorsePotential


def _model_parameters(cls: type, kwargs: dict) -> dict:
    """The potential's parameters among a constructor's keywords, ASE's defaults filled in."""
    return {
        name: kwargs.get(name, default) for name, default in cls.default_parameters.items()
    }


class _Swapped(ShardedCalculator):
    """A ShardedCalculator in place of one of ASE's; records the ASE tests that reach it."""

    def __init__(self, model, **kwargs):
        _reached()
        super().__init__(model, timeout=RANKS_TIMEOUT, **kwargs)

    def calculate(self, *args, **kwargs):
        _reached()
        super().calculate(*args, **kwargs)


class EMT(_Swapped):
    """``ase.calculators.emt.EMT(**kwargs)`` evaluated by ``ase_shard.models.EMT``."""

    default_parameters = dict(ASE_EMT.default_parameters)

    def __init__(self, **kwargs):
        if _model_parameters(EMT, kwargs)["asap_cutoff"]:
            raise NotImplementedError(
                "ase_shard.models.EMT implements asap_cutoff=False (ASE's default) only"
            )
        super().__init__(models.EMT(), **kwargs)


class LennardJones(_Swapped):
    """``ase.calculators.lj.LennardJones(**kwargs)`` evaluated by
    ``ase_shard.models.LennardJones``."""

    default_parameters = dict(ASE_LJ.default_parameters)

    def __init__(self, **kwargs):
        model = models.LennardJones(**_model_parameters(LennardJones, kwargs))
        super().__init__(model, **kwargs)
        # ASE stores the defaults it derives
        self.parameters.update(rc=model.rc, ro=model.ro)


class MorsePotential(_Swapped):
    """``ase.calculators.morse.MorsePotential(neighbor_list, **kwargs)`` evaluated by
    ``ase_shard.models.Morse``.

    ``neighbor_list`` (ASE's: the neighbour-search function) is accepted and unused:
    the calculator finds the neighbours itself.
    """

    default_parameters = dict(ASE_MORSE.default_parameters)

    def __init__(self, neighbor_list=None, **kwargs):
        model = models.Morse(**_model_parameters(MorsePotential, kwargs))
        super().__init__(model, **kwargs)


# where ASE's classes are looked up: the modules (ase.calculators.calculator.
# get_calculator_class, hence ASE's calculator factories, reads them there) and the
# ASE 4 adaptor, which took its class when ase._4 was imported
SWAPS = [
    (ase.calculators.emt, "EMT", EMT),
    (ase.calculators.lj, "LennardJones", LennardJones),
    (ase.calculators.morse, "MorsePotential", MorsePotential),
    (ase._4.calculators.emt.EMT, "wrapped_class", EMT),
]


def swap() -> None:
    """Put our classes where ASE's were; fail if a loaded module still holds one of ASE's."""
    for owner, name, ours in SWAPS:
        setattr(owner, name, ours)
    originals = {id(ASE_EMT), id(ASE_LJ), id(ASE_MORSE)}  # by identity: no __eq__ called
    holders = [
        f"{module_name}.{name}"
        for module_name, module in list(sys.modules.items())
        if module_name != __name__
        for name, value in list(vars(module).items())
        if id(value) in originals
    ]
    if holders:
        raise pytest.UsageError(f"loaded before the swap, these keep ASE's classes: {holders}")


# -- which of ASE's test files run ------------------------------------------------------

# a file is in when it names one of the three classes, or one of them by its calculator
# name ('emt', 'lj', 'morse': ASE's factories, NamedPackedCalculator). ``asap3.EMT`` is
# asap3's potential, which the swap does not replace: the files that name only it (ASE's
# MD, filter and minima-hopping tests that take the ``asap3`` fixture) never reach ours.
_USES = re.compile(
    r"(?<!asap3\.)\b(EMT|LennardJones|MorsePotential)\b|['\"](emt|lj|morse)['\"]"
)

# files that name them but never reach our classes
LEFT_OUT = {
    # `ase run emt` in a subprocess: ASE's own EMT, the swap cannot reach it
    "cli/test_run.py",
}


def selected(path: Path) -> bool:
    """Whether ASE's test file ``path`` runs in the conformance target."""
    relative = path.relative_to(ASE_TESTS).as_posix()
    return relative not in LEFT_OUT and _USES.search(path.read_text()) is not None


def ase_test_id(item: pytest.Item) -> str:
    """``item``'s id relative to ASE's test package: ``emt/test_emt.py::test_x[p]``."""
    return f"{item.path.relative_to(ASE_TESTS).as_posix()}::{item.name}"


# -- which of ASE's tests reach our calculators --------------------------------------------

# ASE's test running now (``ase_test_id``), and those that constructed one of our
# calculators or calculated with one. A selected file may never reach them (ASE's MD
# tests that use asap3's EMT, tests of other calculators in the same file): under
# mpirun such a test runs each rank's ASE alone, as in one process, and checks nothing
# of ours. ``--record-reached`` (one process) writes the list; ``--only-reached`` (the
# mpirun run) runs only the tests it names.
_running: str | None = None
_REACHED: set[str] = set()
# tests whose calculator is built only in a process they start, which the recording does
# not see: they always run
REACHED_IN_SUBPROCESS: dict[str, str] = {
    "calculator/socketio/test_python_interface.py::test_socketio_python": (
        "its socket client, a Python that ASE starts, unpickles and runs our EMT class; "
        "under mpirun, that process must not join the job"
    ),
}


def _reached() -> None:
    if _running is not None:
        _REACHED.add(_running)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _running
    _running = ase_test_id(item) if item.path.is_relative_to(ASE_TESTS) else None
    try:
        return (yield)
    finally:
        _running = None


def pytest_sessionfinish(session) -> None:
    record = session.config.option.record_reached
    if record and COMM.rank == 0:
        Path(record).write_text("".join(f"{test_id}\n" for test_id in sorted(_REACHED)))


def _only_reached(config, items: list[pytest.Item]) -> None:
    """Deselect ASE's tests that the ``--only-reached`` file does not name (excused ones
    stay: their strict xfail must still be checked)."""
    path = Path(config.option.only_reached)
    if not path.is_file():
        raise pytest.UsageError(
            f"--only-reached {path}: no such file; write it with a run in one process "
            f"and --record-reached {path}"
        )
    keep = set(path.read_text().split()).union(EXCUSED, EXCUSED_UNDER_MPI, REACHED_IN_SUBPROCESS)
    dropped = [
        item
        for item in items
        if item.path.is_relative_to(ASE_TESTS) and ase_test_id(item) not in keep
    ]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        dropped_ids = {id(item) for item in dropped}
        items[:] = [item for item in items if id(item) not in dropped_ids]


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--ase-calculators",
        action="store_true",
        help="run the selected tests with ASE's own calculators (reference)",
    )
    parser.addoption(
        "--record-reached",
        metavar="FILE",
        help="write to FILE the ids of ASE's tests that constructed or calculated with "
        "one of our calculators",
    )
    parser.addoption(
        "--only-reached",
        metavar="FILE",
        help="run only the ASE tests that FILE (from --record-reached) names, and the "
        "excused ones",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config) -> None:
    # before ASE's conftest and test modules are imported
    if not early_config.known_args_namespace.ase_calculators:
        swap()
    if COMM.size > 1:
        # each rank's ASE on its own (see the module's docstring); the calculators
        # still span every rank
        ase.parallel.world.comm = ase.parallel.DummyMPI()


def pytest_ignore_collect(collection_path: Path) -> bool | None:
    if collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        if collection_path.is_relative_to(ASE_TESTS) and not selected(collection_path):
            return True
    return None


def pytest_configure(config) -> None:
    if COMM.size > 1 and config.option.basetemp is None:
        # every rank cleans up its own temporary directories only
        config.option.basetemp = (
            Path(tempfile.gettempdir())
            / f"ase-shard-conformance-{COMM.size}ranks-rank{COMM.rank}"
        )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items: list[pytest.Item]) -> None:
    if config.option.ase_calculators:
        return
    collected = {ase_test_id(item): item for item in items if item.path.is_relative_to(ASE_TESTS)}
    files = {test_id.split("::")[0] for test_id in collected}
    stale = []
    named = ((EXCUSED, True), (EXCUSED_UNDER_MPI, COMM.size > 1), (REACHED_IN_SUBPROCESS, False))
    for tests, xfail_here in named:
        for test_id, reason in tests.items():
            item = collected.get(test_id)
            if item is None:
                file = ASE_TESTS / test_id.split("::")[0]
                if not (file.exists() and selected(file)) or test_id.split("::")[0] in files:
                    stale.append(test_id)  # its file does not run, or ran without it
            elif xfail_here:
                item.add_marker(pytest.mark.xfail(reason=reason, strict=True))
    if stale:
        raise pytest.UsageError(f"tests/ase_conformance names tests that do not run: {stale}")
    if config.option.only_reached:
        _only_reached(config, items)


def _random_state_digest() -> str:
    """A digest of NumPy's global random state."""
    kind, keys, position, has_gauss, cached = np.random.get_state()
    return hashlib.sha256(
        repr((kind, keys.tobytes(), position, has_gauss, cached)).encode()
    ).hexdigest()


_CALL_OUTCOME = pytest.StashKey[str]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        item.stash[_CALL_OUTCOME] = report.outcome
    return report


@pytest.fixture(autouse=True)
def _ranks_in_step(request, arbitrarily_seed_rng):
    """Under mpirun: the ranks start each test together, from the same random state, and
    end it together, with the same outcome.

    ``arbitrarily_seed_rng`` (ASE's conftest) seeds NumPy for each test; seeds that
    differed between ranks would give the ranks different atoms. A test that fails on
    some ranks only leaves the others inside it: they meet no more, and the job ends
    after ``RANKS_TIMEOUT`` with the name of the test.
    """
    if COMM.size == 1:
        yield
        return
    nodeid = request.node.nodeid
    COMM.rendezvous(RANKS_TIMEOUT, f"start {nodeid}")
    views = COMM.allgather((nodeid, _random_state_digest()))
    if any(view != views[0] for view in views):
        pytest.fail(f"the ranks run different tests or seeds: {views}")
    yield
    COMM.rendezvous(RANKS_TIMEOUT, f"finish {nodeid}")
    outcomes = COMM.allgather(request.node.stash.get(_CALL_OUTCOME, "not run"))
    if len(set(outcomes)) > 1:
        pytest.fail(f"the ranks' outcomes differ, rank by rank: {outcomes}")
