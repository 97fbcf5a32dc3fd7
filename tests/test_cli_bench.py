"""``ase-shard bench`` display: the header's CPU counts, one system line, the PNG; the
report's ``source`` (the checkout that produced the timings)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ase_shard
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


def test_source_lists_the_modified_files_of_the_whole_package(tmp_path: Path) -> None:
    """``environment.source`` names the checkout's commit and every modified file of
    ``ase_shard/``, also outside the ``bench`` package that records it: a copy of the
    package in a fresh git repository, one file outside ``bench/`` changed."""
    checkout = tmp_path / "checkout"
    package = Path(ase_shard.__file__).parent
    shutil.copytree(package, checkout / "ase_shard", ignore=shutil.ignore_patterns("__pycache__"))
    git = ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["add", "ase_shard"], ["commit", "-q", "-m", "copy"]):
        subprocess.run([*git, *args], check=True, capture_output=True)
    head = [*git, "rev-parse", "HEAD"]
    commit = subprocess.run(head, check=True, capture_output=True, text=True)
    with open(checkout / "ase_shard" / "io.py", "a") as io:
        io.write("\n")
    probe = "import json\nfrom ase_shard.bench.machine import source_state\n"
    probe += "print(json.dumps(source_state()))"
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(checkout)},
    )
    source = json.loads(done.stdout.splitlines()[-1])
    assert source == {"commit": commit.stdout.strip(), "modified": ["ase_shard/io.py"]}
