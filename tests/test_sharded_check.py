"""``ase-shard check`` at any rank count: it passes for exact models and fails for a
calculator that differs.

Plain pytest runs one rank; ``mpirun -n P python -m pytest --with-mpi`` runs P (every
rank calls the command, as under ``mpirun -n P ase-shard check``).
"""

from __future__ import annotations

import re
from functools import partial

import numpy as np
import pytest
from ase.calculators.emt import EMT as AseEMT
from sharded import COMM

from ase_shard import md
from ase_shard.check import choose_elements, standard_geometries
from ase_shard.cli import main
from ase_shard.presets import CLIError

ROW = re.compile(r"^(bulk|triclinic|slab|cluster)\s+(\d+)\s+([TF]{3})\s+(.*)$", re.MULTILINE)


def table(output: str) -> dict[str, np.ndarray]:
    """The report's rows: system -> the six relative differences (NaN for '-')."""
    return {
        match[1]: np.array([np.nan if v == "-" else float(v) for v in match[4].split()])
        for match in ROW.finditer(output)
    }


def check(capsys, *argv: str) -> tuple[int, str]:
    code = main(["check", *argv])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("model", ["emt", "lj", "morse"])
def test_builtins_pass(capsys, model: str) -> None:
    """Against ASE's own EMT, LennardJones and MorsePotential: round-off on every
    geometry, and the same exit code on every rank."""
    code, out = check(capsys, "--model", model)
    assert COMM.allgather(code) == [0] * COMM.size
    if COMM.rank != 0:
        assert out == ""
        return
    rows = table(out)
    assert list(rows) == ["bulk", "triclinic", "slab", "cluster"], out
    values = np.concatenate(list(rows.values()))
    assert np.nanmax(values) <= 1e-12, out
    assert np.isnan(rows["cluster"][[2, 5]]).all()  # no cell, no stress
    assert f"{COMM.size} rank" in out and out.rstrip().endswith(": ok")


@pytest.mark.rank_independent
def test_metatomic_file(capsys, tmp_path) -> None:
    """A model file by KIND:PATH, against its package's calculator (metatomic's; at P
    ranks tests/test_sharded_metatomic.py checks the adapter)."""
    pytest.importorskip("metatomic.torch")
    from metatomic_models import tiny_metatomic

    path = tmp_path / "tiny.pt"
    tiny_metatomic(mp_cutoff=3.0, mp_full=True).save(str(path))
    code, out = check(capsys, "--model", f"metatomic:{path}", "--elements", "Au,Cu")
    assert COMM.allgather(code) == [0] * COMM.size
    if COMM.rank == 0:
        assert "elements Au Cu" in out
        assert np.nanmax(np.concatenate(list(table(out).values()))) <= 1e-12, out


def test_a_different_own_calculator_fails(capsys, monkeypatch) -> None:
    """ASE's EMT with ASAP's cutoff rule differs from ours by ~1e-3: exit code 1 on
    every rank, DIFFERS printed."""
    monkeypatch.setitem(md.ASE_CALCULATORS, "emt", partial(AseEMT, asap_cutoff=True))
    code, out = check(capsys, "--model", "emt")
    assert COMM.allgather(code) == [1] * COMM.size
    if COMM.rank == 0:
        assert out.rstrip().endswith(": DIFFERS")
        own = np.array([row[:3] for row in table(out).values()])
        assert np.nanmax(own) > 1e-5, out


@pytest.mark.rank_independent
def test_element_choice() -> None:
    assert choose_elements(None, None) == ["Cu", "Ag"]
    assert choose_elements([1, 6, 8, 29], None) == ["Cu", "C"]
    assert choose_elements([3, 4], None) == ["Li", "Be"]
    assert choose_elements([1, 8], "O,H") == ["O", "H"]
    with pytest.raises(CLIError, match="the model has no Cu"):
        choose_elements([1, 8], "Cu")
    with pytest.raises(CLIError, match="give chemical symbols"):
        choose_elements(None, "Cu,Xx")


@pytest.mark.rank_independent
@pytest.mark.parametrize("elements", [["Cu", "Ag"], ["H"], ["Si", "C", "O"]])
def test_standard_geometries(elements: list[str]) -> None:
    geometries = standard_geometries(elements)
    pbc = {name: tuple(atoms.pbc) for name, atoms in geometries.items()}
    assert pbc == {
        "bulk": (True,) * 3,
        "triclinic": (True,) * 3,
        "slab": (True, True, False),
        "cluster": (False,) * 3,
    }
    cell = geometries["triclinic"].cell
    assert not np.allclose(cell.angles(), 90.0) and cell.rank == 3
    assert geometries["cluster"].cell.rank == 0
    for atoms in geometries.values():
        assert set(atoms.get_chemical_symbols()) == set(elements)
        distances = atoms.get_all_distances(mic=atoms.pbc.any())
        assert distances[np.triu_indices(len(atoms), 1)].min() > 1.5
