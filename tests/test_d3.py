"""DFT-D3 (serial): ``ShardedCalculator(D3(...))`` equals the ``dftd3`` package's ASE
calculator (s-dftd3, ``dftd3.ase.DFTD3``) with the same method, damping, three-body term and
real-space cutoffs.

Systems: a molecular crystal, graphite, a Cu(111) slab with CO on top, a triclinic cell of
mixed elements and a molecule without a cell, at short cutoffs (9.7 Å pairs, 7.9 Å
coordination numbers, 5.3 Å triangles: s-dftd3's 31.75 / 21.17 / 21.17 Å make millions of
triangles here); s-dftd3's default cutoffs on the molecule and, without the three-body
term, on graphite. Energy, forces and stress must agree to 1e-8 relative (measured: about
1e-14). The calculator evaluates D3 by its compiled kernel (``ase_shard.d3_kernels``) on a
CPU in float64; the torch model (autograd, the path devices take) is held to dftd3 too,
wrapped so that it has no kernel, and the two give the same per-atom energies and virials.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

pytest.importorskip("dftd3")
pytest.importorskip("tad_dftd3")

from ase import Atoms  # noqa: E402
from ase.build import add_adsorbate, fcc111, molecule  # noqa: E402
from ase.units import Bohr  # noqa: E402
from oracles import ase_results, relative_errors  # noqa: E402
from sync_count import Autograd  # noqa: E402

from ase_shard import ShardedCalculator  # noqa: E402
from ase_shard.block import RESULT_COLUMNS  # noqa: E402
from ase_shard.graph import EdgeList, direct_forces  # noqa: E402
from ase_shard.models import D3  # noqa: E402

# measured <= 5e-14; the acceptance is 1e-8, and tighter than 1e-9 catches radii in
# another bohr (CODATA 2014 against mctc-lib's 2018: 1e-9 relative)
RTOL = 1e-11

# Å: pair, coordination-number and three-body cutoffs of the short-cutoff cases. Not
# multiples of a cell vector's length: s-dftd3 counts a pair exactly at its cutoff,
# ShardedCalculator's lists leave it out (the triclinic cell's 5 Å vector at 10 Å did).
CUTOFFS = dict(cutoff=9.7, cn_cutoff=7.9, atm_cutoff=5.3)

# (damping, three-body term)
VARIANTS = [("bj", False), ("bj", True), ("zero", False), ("zero", True)]
# the compiled kernel, and the torch model by autograd
PATHS = ["kernel", "autograd"]


def d3_model(path: str, *args, **kwargs):
    """``D3(*args, **kwargs)``, or on the ``"autograd"`` path without its kernel."""
    model = D3(*args, **kwargs)
    return model if path == "kernel" else Autograd(model)


def d3_results(path: str, atoms: Atoms, *args, stresses: bool = False, **kwargs) -> dict:
    """:func:`ase_results` of ``ShardedCalculator(d3_model(path, ...))``, on that path."""
    calc = ShardedCalculator(d3_model(path, *args, **kwargs))
    got = ase_results(calc, atoms, stresses)
    assert (calc._block._direct is not None) == (path == "kernel")
    return got


def dftd3_calculator(method: str, damping: str, atm: bool, **cutoffs: float):
    """The oracle: ``dftd3``'s ASE calculator with these settings.

    ``cutoffs`` (Å): ``cutoff``, ``cn_cutoff`` and ``atm_cutoff``, as :class:`D3` takes
    them; none given leaves s-dftd3's defaults.
    """
    from dftd3.ase import DFTD3

    names = {"cutoff": "disp2", "cn_cutoff": "cn", "atm_cutoff": "disp3"}
    return DFTD3(
        method=method,
        damping="d3" + damping,
        params_tweaks={"method": method, "atm": atm},
        realspace_cutoff={names[key]: value for key, value in cutoffs.items()},
    )


def dftd3_results(atoms: Atoms, method: str, damping: str, atm: bool, **cutoffs: float) -> dict:
    """Energy (eV), forces (eV/Å) and, with a cell, stress (eV/Å³) from ``dftd3``."""
    atoms = atoms.copy()
    atoms.calc = dftd3_calculator(method, damping, atm, **cutoffs)
    out = {"energy": np.asarray(atoms.get_potential_energy()), "forces": atoms.get_forces()}
    if atoms.cell.rank == 3:
        out["stress"] = atoms.get_stress()
    return out


def d3_systems() -> dict[str, Atoms]:
    """Fresh copies of the five test systems, atoms wrapped into their cells.

    Wrapped, because s-dftd3 takes the lattice translations within its cutoff of
    atoms inside the cell: it may miss pairs near the cutoff between atoms outside.
    """
    return {name: atoms.copy() for name, atoms in _d3_systems().items()}


@functools.cache
def _d3_systems() -> dict[str, Atoms]:
    rng = np.random.default_rng(30)

    # molecular crystal: methanol and ammonia in a small monoclinic cell
    crystal = molecule("CH3OH")
    ammonia = molecule("NH3")
    ammonia.translate([3.2, 2.6, 2.4])
    crystal += ammonia
    crystal.set_cell([[5.6, 0.0, 0.0], [0.0, 5.4, 0.0], [0.8, 0.0, 5.8]])
    crystal.pbc = True
    crystal.rattle(0.05, seed=1)

    # AB graphite
    a, c = 2.464, 6.711
    graphite = Atoms(
        "C4",
        scaled_positions=[[0, 0, 0.25], [0, 0, 0.75], [1 / 3, 2 / 3, 0.25], [2 / 3, 1 / 3, 0.75]],
        cell=[[a, 0.0, 0.0], [-a / 2, a * np.sqrt(3) / 2, 0.0], [0.0, 0.0, c]],
        pbc=True,
    )
    graphite.rattle(0.05, seed=2)

    # Cu(111), three layers, CO on top; pbc (T, T, F)
    slab = fcc111("Cu", size=(2, 2, 3), vacuum=5.0)
    add_adsorbate(slab, molecule("CO"), 1.9, "ontop")
    slab.rattle(0.03, seed=3)

    # a general triclinic cell of H, C, N, O and Cu, no two atoms closer than 1.2 Å
    cell = np.array([[5.0, 0.0, 0.0], [1.7, 4.6, 0.0], [-1.2, 1.3, 4.8]])
    triclinic = Atoms(cell=cell, pbc=True)
    while len(triclinic) < 8:
        trial = triclinic + Atoms("H", positions=[rng.uniform(0.0, 1.0, 3) @ cell])
        if len(trial) == 1 or trial.get_distances(-1, range(len(trial) - 1), mic=True).min() > 1.2:
            triclinic = trial
    triclinic.numbers = rng.choice([1, 6, 7, 8, 29], len(triclinic))

    ethanol = molecule("CH3CH2OH")  # no cell
    ethanol.rattle(0.05, seed=5)

    systems = {
        "crystal": crystal,
        "graphite": graphite,
        "slab": slab,
        "triclinic": triclinic,
        "molecule": ethanol,
    }
    for atoms in systems.values():
        atoms.wrap()
    return systems


def assert_matches_dftd3(got: dict, ref: dict) -> None:
    """``got`` equals ``ref`` to ``RTOL``; its per-atom energies add up to its energy."""
    errors = relative_errors(got, ref)
    assert max(errors.values()) <= RTOL, errors
    assert abs(got["energies"].sum() - got["energy"]) <= 1e-12 * abs(got["energy"])


def test_declarations() -> None:
    """The cutoffs default to s-dftd3's; the graph's is the largest one in use."""
    model = D3()
    assert (model.pair_cutoff, model.cn_cutoff, model.atm_cutoff) == (
        60.0 * Bohr,
        40.0 * Bohr,
        40.0 * Bohr,
    )
    assert model.cutoff == 60.0 * Bohr
    assert model.num_layers == 2 and model.supports_layer_halo
    assert direct_forces(model) is model and direct_forces(Autograd(model)) is None
    assert D3(atm=False, cutoff=5.0, cn_cutoff=7.0, atm_cutoff=9.0).cutoff == 7.0
    assert D3(atm=True, cutoff=5.0, cn_cutoff=7.0, atm_cutoff=9.0).cutoff == 9.0
    assert model.damping_parameters == pytest.approx(
        dict(s6=1.0, s8=0.7875, s9=1.0, a1=0.4289, a2=4.4407, alp=14.0)
    )
    assert D3(atm=False).damping_parameters["s9"] == 0.0
    with pytest.raises(ValueError, match="damping"):
        D3(damping="bjm")
    with pytest.raises(KeyError, match="unknown functional"):
        D3(method="not-a-functional")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("damping, atm", VARIANTS)
@pytest.mark.parametrize("system", ["crystal", "graphite", "slab", "triclinic", "molecule"])
def test_matches_dftd3(system: str, damping: str, atm: bool, path: str) -> None:
    atoms = d3_systems()[system]
    ref = dftd3_results(atoms, "pbe", damping, atm, **CUTOFFS)
    got = d3_results(path, atoms, "pbe", damping, atm, **CUTOFFS)
    assert_matches_dftd3(got, ref)
    # nothing is zero by accident
    assert np.abs(ref["forces"]).max() > 1e-4
    assert system == "molecule" or np.abs(ref["stress"]).max() > 1e-5


@pytest.mark.parametrize("damping", ["bj", "zero"])
def test_three_body_term_counts(damping: str) -> None:
    """The ATM term changes the energy and forces by much more than the tolerance."""
    atoms = d3_systems()["crystal"]
    two = dftd3_results(atoms, "pbe", damping, False, **CUTOFFS)
    three = dftd3_results(atoms, "pbe", damping, True, **CUTOFFS)
    assert max(relative_errors(three, two).values()) > 1e3 * RTOL


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("damping", ["bj", "zero"])
def test_another_functional(damping: str, path: str) -> None:
    """B3LYP's parameters, looked up by name as ``dftd3`` does."""
    atoms = d3_systems()["crystal"]
    ref = dftd3_results(atoms, "b3lyp", damping, True, **CUTOFFS)
    got = d3_results(path, atoms, "b3lyp", damping, True, **CUTOFFS)
    assert_matches_dftd3(got, ref)


@pytest.mark.parametrize("damping, atm", VARIANTS)
@pytest.mark.parametrize("system", ["crystal", "graphite", "slab", "triclinic", "molecule"])
def test_kernel_equals_autograd(system: str, damping: str, atm: bool) -> None:
    """Per-atom energies and virials (dftd3 has neither) of the kernel and of autograd:
    each edge's dE/dd split between its ends alike."""
    atoms = d3_systems()[system]
    args = ("pbe", damping, atm)
    stresses = atoms.cell.rank == 3
    got = d3_results("kernel", atoms, *args, stresses=stresses, **CUTOFFS)
    ref = d3_results("autograd", atoms, *args, stresses=stresses, **CUTOFFS)
    errors = relative_errors(got, ref)
    assert max(errors.values()) <= RTOL, errors
    assert system == "molecule" or np.abs(ref["stresses"]).max() > 1e-5


def _edges(n_nodes: int, n_owned: int, centre=(), neighbour=(), cutoff: float = 5.0) -> EdgeList:
    rng = np.random.default_rng(0)
    return EdgeList(
        positions=rng.uniform(0.0, 3.0, (n_nodes, 3)),
        numbers=np.full(n_nodes, 29, dtype=np.int64),
        centre=np.asarray(centre, dtype=np.int64),
        neighbour=np.asarray(neighbour, dtype=np.int64),
        image=np.zeros(len(centre), dtype=np.int16),
        offsets=np.zeros((1, 3)),
        n_owned=n_owned,
        cutoff=cutoff,
    )


def test_kernel_without_pairs() -> None:
    """No nodes; lone nodes; edges beyond the cutoff: nothing, and the shortest edge.
    Ghost nodes without the halo that brings their coordination numbers: refused."""
    model = D3(**CUTOFFS)
    assert model.energy_forces(_edges(0, 0), np.zeros((RESULT_COLUMNS, 0))) == np.inf
    out = np.zeros((RESULT_COLUMNS, 2))
    assert model.energy_forces(_edges(2, 2), out) == np.inf
    far = _edges(2, 2, centre=[0, 1], neighbour=[1, 0], cutoff=1e-3)
    closest = model.energy_forces(far, out)
    assert closest == pytest.approx(np.sum((far.positions[1] - far.positions[0]) ** 2))
    assert not out.any()
    with pytest.raises(ValueError, match="halo"):
        model.energy_forces(_edges(3, 2), np.zeros((RESULT_COLUMNS, 3)))


@pytest.mark.parametrize(
    "system, damping, atm",
    [("molecule", "bj", True), ("molecule", "zero", True), ("graphite", "bj", False)],
)
@pytest.mark.parametrize("path", PATHS)
def test_default_cutoffs(system: str, damping: str, atm: bool, path: str) -> None:
    """s-dftd3's own cutoffs (31.75 Å pairs, 21.17 Å coordination numbers and triangles),
    unset on both sides; graphite's 4 atoms then have about 60,000 edges."""
    atoms = d3_systems()[system]
    ref = dftd3_results(atoms, "pbe", damping, atm)
    got = d3_results(path, atoms, "pbe", damping, atm)
    assert_matches_dftd3(got, ref)


def test_cli_d3_adds_dispersion_and_is_recorded(tmp_path, capsys) -> None:
    """``ase-shard md --model emt --d3 pbe`` runs EMT + D3(BJ, three-body term): its frames
    hold the energy of ASE's SumCalculator of ASE's EMT and dftd3's calculator, and record
    ``pbe``; a restart keeps it and refuses another; an unknown functional exits 2."""
    from ase.calculators.emt import EMT as AseEMT
    from ase.calculators.mixing import SumCalculator
    from md_terms import assert_refused, run_with_term

    start, traj, frame = run_with_term(tmp_path, molecule("CH3CH2OH"), "emt", "d3", "pbe")
    reference = frame.copy()
    reference.calc = SumCalculator([AseEMT(), dftd3_calculator("pbe", "bj", True)])
    expected = reference.get_potential_energy()
    assert abs(frame.get_potential_energy() - expected) <= RTOL * abs(expected)
    np.testing.assert_allclose(frame.get_forces(), reference.get_forces(), rtol=0, atol=1e-10)
    assert_refused(
        capsys,
        [
            (["--restart", str(traj), "--d3", "r2scan"], "written with --d3 pbe, not r2scan"),
            (
                [str(start), "--model", "emt", "--d3", "no-such-functional"],
                "--d3 no-such-functional",
            ),
        ],
    )
