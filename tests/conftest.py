"""Test set-up shared by serial runs and runs under mpirun."""

import sys
import tempfile
from pathlib import Path

import pytest
import torch

import ase_shard  # noqa: F401  (initialises MPI before ASE touches ase.parallel.world)
from ase_shard.comm import Comm

sys.path.insert(0, str(Path(__file__).parent))  # tests import oracles/systems/toy_models

_COMM = Comm()
if _COMM.size > 1:
    torch.set_num_threads(1)


def pytest_configure(config) -> None:
    if _COMM.size > 1 and config.option.basetemp is None:
        # ranks of one job must not clean up each other's temporary directories
        config.option.basetemp = (
            Path(tempfile.gettempdir()) / f"ase-shard-pytest-{_COMM.size}ranks-rank{_COMM.rank}"
        )


@pytest.fixture
def launched(request, launches):
    """What this test's launch returned, in modules that start their launches in the
    background (a module-scoped ``launches`` fixture, see tests/background.py)."""
    return launches[request.node.name].result()
