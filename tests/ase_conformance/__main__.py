"""``python -m tests.ase_conformance [pytest options]``: ASE's own tests with our calculator.

Run from the repository root, in one process or under ``mpirun -n P``; see ``swap.py``.
The test directory is given by path, not ``--pyargs``: pytest would also load the
``conftest.py`` of ``tests/`` under the working directory.
"""

import os
import sys
from pathlib import Path

import ase.test
import pytest

import ase_shard  # noqa: F401  (initialises MPI before ASE touches ase.parallel.world)

ASE_TESTS = Path(ase.test.__file__).parent
# subprocesses that unpickle our calculator classes (ASE's PySocketIOClient) import them
# from tests.ase_conformance.swap, from their own working directory
REPOSITORY = str(Path(__file__).resolve().parents[2])
os.environ["PYTHONPATH"] = os.pathsep.join(
    [REPOSITORY, *filter(None, [os.environ.get("PYTHONPATH")])]
)

sys.exit(
    pytest.main(
        ["-p", "tests.ase_conformance.swap", "-p", "no:cacheprovider", str(ASE_TESTS)]
        + sys.argv[1:]
    )
)
