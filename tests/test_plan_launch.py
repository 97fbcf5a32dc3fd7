"""The plan's memory against the run's: fresh processes, real mpirun jobs.

Each case runs ``scripts/plan_memory.py`` for one model, rank count and mode: a fresh
serial process plans the run, a fresh ``mpirun`` job runs it (the first call, a step
that reuses the decomposition, ten small moves and one rebuild) and each rank reports
its peak resident memory. The plan's peak per rank must lie within 25 % of the
measured one (issue 31), and its part beyond the fixed one (imports, weights, loaded
kernels) within 0.6-1.5 of the run's (the fixed part, ~400 MB of torch and numba, would
hide a plan that priced nothing per atom); owned atoms, ghosts, edges and bytes are the
run's exactly. Run by plain pytest (``make test``'s serial step); the ML case, MACE, is
in tests/test_mace.py (its own environment, a lane beside this one);
docs/performance.md, "Planning a run", has the full table (7net-0 too).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ase_shard.comm import ALLOW_RUN_AS_ROOT, Comm

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "plan_memory.py"
ENV = {**os.environ, **ALLOW_RUN_AS_ROOT, "OMP_NUM_THREADS": "1"}
TIMEOUT_S = 600

pytestmark = [
    pytest.mark.timeout(TIMEOUT_S + 60),
    pytest.mark.skipif(Comm().size > 1, reason="launches its own mpirun"),
]


def assert_planned_memory(model: str, atoms: int, ranks: int, mode: str, tmp_path) -> None:
    """``scripts/plan_memory.py`` for one case, and the plan within its bounds."""
    report = tmp_path / "report.json"
    subprocess.run(
        [sys.executable, str(SCRIPT), "--models", model, "--atoms", str(atoms)]
        + ["--ranks", str(ranks), "--modes", mode, "--json", str(report)],
        check=True,
        env=ENV,
        timeout=TIMEOUT_S,
    )
    (case,) = json.loads(report.read_text())
    assert len(case["per_rank"]) == ranks
    for rank in case["per_rank"]:
        assert rank["geometry_exact"] and rank["halo_bytes_exact"], rank
        assert rank["received_bytes_exact"], rank
        assert 0.75 <= rank["ratio"] <= 1.25, rank
        assert 0.6 <= rank["marginal_ratio"] <= 1.5, rank


@pytest.mark.parametrize(
    ("model", "atoms", "ranks", "mode"),
    [
        ("emt", 32000, 3, "distributed"),
        ("lj", 32000, 2, "replicated"),
    ],
)
def test_planned_peak_memory_per_rank(model: str, atoms: int, ranks: int, mode: str, tmp_path):
    assert_planned_memory(model, atoms, ranks, mode, tmp_path)
