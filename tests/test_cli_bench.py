"""``ase-shard bench`` display: the header's CPU counts, one system line, the PNG."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ase_shard.cli import main
from ase_shard.comm import Comm

pytestmark = [
    pytest.mark.skipif(Comm().size > 1, reason="runs ase-shard bench serially"),
    pytest.mark.timeout(180),
]


def test_header_names_machine_and_rank_cpus(tmp_path: Path, capsys) -> None:
    report, png = tmp_path / "b.json", tmp_path / "b.png"
    argv = ["bench", "--size", "2", "--reuse-steps", "2", "--rebuild-steps", "1"]
    argv += ["--ceiling-seconds", "0.05", "--json", str(report), "--plot", str(png)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    environment = json.loads(report.read_text())["environment"]
    assert environment["cpus"] == os.cpu_count()
    assert environment["cpus_per_rank"] == [affinity or os.cpu_count()]
    assert f"  {os.cpu_count()} CPUs, {environment['cpus_per_rank'][0]} usable per rank" in out
    assert out.count("cu-bulk N=2") == 1  # the start line does not repeat the summary's
    assert png.stat().st_size > 0
