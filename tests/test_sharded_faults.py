"""Fault matrix, in-process part: failing models, bad input, degenerate geometry, a soak.

Every fault must end in the same clear error on every rank (never a hang) after
which the calculator still gives exact results, or, where the input is legal, in
ASE's results on every rank, bitwise equal. Runs at any rank count; ``make test``
runs it under mpirun with 2, 3 and 4 ranks. Faults that kill or orphan processes
need their own ``mpirun`` and live in ``test_faults_launch.py``; docs/reliability.md
lists every fault with the test that drives it. Faults already covered by
``test_sharded_errors.py`` and ``test_sharded_physics.py`` are not repeated here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import resource
import sys
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import bulk
from ase.calculators.emt import EMT as AseEMT
from ase.calculators.lj import LennardJones as AseLennardJones
from oracles import evaluate_periodic_graph, relative_errors
from sharded import COMM, assert_matches, cu_bulk, on_root, results
from soak import run_nve_soak
from systems import AR, CASES
from toy_models import ToyMessagePassing

from ase_shard import CollectiveError, OutOfMemory, ShardedCalculator
from ase_shard.exchange import ExchangeMismatch
from ase_shard.models import EMT, LennardJones
from ase_shard.partition import PARTITIONS
from ase_shard.plan import plan

pytestmark = pytest.mark.timeout(60)

RTOL = 1e-10
LAST = COMM.size - 1


# -- 1, 2: the model fails or returns non-finite numbers on some ranks ----------------


class Boom(Exception):
    """An exception type defined here: it must arrive on every rank as itself."""


class NeedsTwoArguments(Exception):
    """An exception that cannot be re-created from a message alone."""

    def __init__(self, code: int, detail: str):
        super().__init__(f"{code}: {detail}")


class FailInBackward(torch.autograd.Function):
    """Identity whose backward pass raises."""

    @staticmethod
    def forward(ctx, energies):
        return energies.clone()

    @staticmethod
    def backward(ctx, grad):
        raise Boom("backward failed")


class Faulty(torch.nn.Module):
    """ASE-equal EMT that misbehaves on ``ranks`` while ``armed``.

    ``fault``: ``raise`` (Boom in forward), ``raise-odd`` (an exception that
    needs two arguments), ``backward`` (Boom during autograd), ``nan-energy`` /
    ``inf-energy`` (the first owned atom's energy), ``nan-forces`` (a finite
    energy whose gradient is NaN), ``allocate`` (a scratch tensor of
    :data:`SCRATCH_BYTES`, which a rank with a memory limit cannot get).
    """

    def __init__(self, fault: str, ranks: set[int]):
        super().__init__()
        self.inner = EMT()
        self.cutoff, self.num_layers = self.inner.cutoff, 1
        self.atomic_types = self.inner.atomic_types
        self.fault, self.ranks, self.armed = fault, ranks, False

    def forward(self, graph):
        energies = self.inner(graph)
        if not self.armed or COMM.rank not in self.ranks:
            return energies
        if self.fault == "raise":
            raise Boom("model failed")
        if self.fault == "raise-odd":
            raise NeedsTwoArguments(7, "odd failure")
        if self.fault == "backward":
            return FailInBackward.apply(energies)
        if self.fault == "allocate":
            scratch = torch.empty(SCRATCH_BYTES, dtype=torch.uint8)
            return energies + scratch[:0].sum()
        bump = torch.zeros_like(energies)
        if self.fault == "nan-energy":
            bump[0] = torch.nan
        elif self.fault == "inf-energy":
            bump[0] = torch.inf
        else:  # nan-forces: sqrt(0 * x) is 0, its derivative 0 * inf = nan
            bump[0] = torch.sqrt(0.0 * graph.edge_vectors[0, 0])
        return energies + bump


def _fail_then_recover(model: Faulty, error: type, pattern: str, memory_plan=None) -> str:
    """A good call, a failing one (same rebuilds-free geometry), then exact again
    (``memory_plan``: the calculator's ``memory_plan``).

    Returns the message of the error, after checking it is the same on all ranks.
    """
    atoms = cu_bulk()
    calc = ShardedCalculator(model)
    calc.memory_plan = memory_plan
    atoms.calc = calc
    assert_matches(atoms, AseEMT())
    atoms.positions[0, 0] += 0.01  # within the skin: the failing call reuses the layout
    model.armed = True
    with pytest.raises(error, match=pattern) as caught:
        atoms.get_forces()
    message = str(caught.value)
    assert len(set(COMM.allgather(message))) == 1
    model.armed = False
    assert_matches(atoms, AseEMT())
    assert calc.rebuilds == 2  # the call after an error starts from a fresh layout
    return message


@pytest.mark.parametrize("fault", ["raise", "backward"])
def test_model_exception_on_one_rank(fault: str) -> None:
    pattern = rf"(model|backward) failed \[rank {LAST}\]$"
    _fail_then_recover(Faulty(fault, {LAST}), Boom, pattern)


def test_model_exception_on_two_ranks_names_both() -> None:
    more = "; 1 more rank(s) failed" if COMM.size > 1 else ""
    pattern = rf"model failed \[rank 0{re.escape(more)}\]$"
    _fail_then_recover(Faulty("raise", {0, LAST}), Boom, pattern)


# bytes: what the allocating model asks for, and how far above its address space a
# rank's memory limit sits (the rest of a step on cu_bulk needs a few MB)
SCRATCH_BYTES = 4 * 2**30
HEADROOM_BYTES = 2**30


@contextlib.contextmanager
def memory_limit(ranks: set[int], headroom: int = HEADROOM_BYTES) -> Iterator[None]:
    """On ``ranks``, an address-space limit ``headroom`` bytes above what the process
    maps now (``RLIMIT_AS``), lifted on leaving."""
    if COMM.rank not in ranks:
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/status") as status:
        mapped = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize"))
    resource.setrlimit(resource.RLIMIT_AS, (mapped + headroom, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.mark.skipif(sys.platform != "linux", reason="needs Linux's RLIMIT_AS and /proc")
def test_out_of_memory_on_one_rank() -> None:
    """Every rank asks for 4 GB; the last rank, limited to 1 GB more than it maps,
    cannot: every rank raises one OutOfMemory that names that rank, what it held, the
    plan's estimate for it and what to change, and the next call is exact again."""
    model = Faulty("allocate", set(range(COMM.size)))
    # one plan, rank 0's (each rank's own calibration measures its own memory)
    memory_plan = on_root(lambda: plan(cu_bulk(), model, COMM.size, calibration_atoms=24))
    share = memory_plan.per_rank[LAST]
    pattern = (
        rf"out of memory in its evaluation, holding {share.owned} owned atoms and "
        rf"{share.ghosts} ghosts, {share.edges} edges, {share.memory / 2**20:.0f} MiB planned "
        r"\(peak resident memory \d+ MiB\): .*can't allocate memory.*\. Run on "
        rf"more ranks, with a smaller skin, or in float32 .*ase-shard plan.*\[rank {LAST}\]$"
    )
    with memory_limit({LAST}):
        message = _fail_then_recover(model, OutOfMemory, pattern, memory_plan)
    assert issubclass(OutOfMemory, MemoryError) and str(SCRATCH_BYTES) in message


@pytest.mark.skipif(sys.platform != "linux", reason="needs Linux's RLIMIT_AS and /proc")
def test_out_of_memory_while_listing_edges() -> None:
    """864 Ar atoms with a 70 Å cutoff (17 million pairs, 136 MB listed once as int32),
    every rank limited to 64 MB more than it maps: a rank cannot list its edges at the
    rebuild (which ones depends on their ghosts), and every rank raises the same
    OutOfMemory, naming the first that failed, before any evaluates."""
    atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat(6)
    atoms.calc = ShardedCalculator(LennardJones(sigma=3.4, epsilon=0.0104, rc=70.0))
    pattern = (
        r"out of memory listing its edges, holding \d+ owned atoms and \d+ ghosts "
        r"\(peak resident memory \d+ MiB\): .*(Unable to allocate|can't allocate memory)"
        r".*\[rank \d+(; \d+ more rank\(s\) failed)?\]$"
    )
    with memory_limit(set(range(COMM.size)), headroom=64 * 2**20):
        with pytest.raises(OutOfMemory, match=pattern) as caught:
            atoms.get_forces()
    assert len(set(COMM.allgather(str(caught.value)))) == 1


def test_out_of_memory_reading_node_rows(monkeypatch) -> None:
    """A rank that cannot allocate its node rows at a step that reuses the
    decomposition (before the step's vote) stops every rank at that vote with its
    OutOfMemory; the next call is exact again."""
    atoms = cu_bulk()
    calc = ShardedCalculator(EMT())
    atoms.calc = calc
    assert_matches(atoms, AseEMT())
    node_rows = calc.layout.node_rows

    def failing(*args, **kwargs):
        if COMM.rank == LAST:
            raise MemoryError("no room for the rows")
        return node_rows(*args, **kwargs)

    monkeypatch.setattr(calc.layout, "node_rows", failing)
    atoms.positions[0, 0] += 0.01  # within the skin: the call reuses the decomposition
    pattern = (
        r"out of memory reading its atoms' rows, holding \d+ owned atoms and \d+ ghosts, "
        rf"\d+ edges .*no room for the rows.*\[rank {LAST}\]$"
    )
    with pytest.raises(OutOfMemory, match=pattern) as caught:
        atoms.get_forces()
    assert len(set(COMM.allgather(str(caught.value)))) == 1
    monkeypatch.undo()
    assert_matches(atoms, AseEMT())


def test_out_of_memory_in_a_vote() -> None:
    """An allocation that fails inside any of the calculator's votes (here numpy's
    refusal of 8 EiB on the last rank) is an OutOfMemory on every rank."""
    from ase_shard.comm import Comm

    def own() -> int:
        return np.empty(2**60, dtype=np.uint8).size if COMM.rank == LAST else 0

    with pytest.raises(
        OutOfMemory, match=rf"out of memory in a collective step .*\[rank {LAST}\]$"
    ):
        Comm().agree(own)


def test_exception_that_cannot_be_recreated() -> None:
    pattern = rf"NeedsTwoArguments: 7: odd failure \[rank {LAST}\]"
    _fail_then_recover(Faulty("raise-odd", {LAST}), CollectiveError, pattern)


@pytest.mark.parametrize("fault", ["nan-energy", "inf-energy", "nan-forces"])
def test_non_finite_model_output(fault: str) -> None:
    message = _fail_then_recover(Faulty(fault, {LAST}), FloatingPointError, "non-finite")
    assert f"rank {LAST}" in message
    assert re.search(r"atoms \[\d+", message), message


class FailsBetweenExchanges(EMT):
    """EMT whose compiled kernel fails on ``ranks``, while ``armed``, after its first
    exchange between ranks and before its second (see ``ase_shard.kernels``)."""

    def __init__(self, ranks: set[int]):
        super().__init__()
        self.ranks, self.armed = ranks, False

    def energy_forces(self, edges, out):
        if self.armed and COMM.rank in self.ranks:
            edges = dataclasses.replace(edges, halo=_SecondExchangeFails(edges.halo))
        return super().energy_forces(edges, out)


class _SecondExchangeFails:
    def __init__(self, halo):
        self.halo = halo

    def sum_ghost_columns(self, columns):
        self.halo.sum_ghost_columns(columns)

    def copy_owner_columns(self, columns):
        raise Boom("kernel failed")


@pytest.mark.skipif(COMM.size == 1, reason="one rank: the kernel exchanges nothing")
def test_kernel_exception_between_its_exchanges() -> None:
    """The other ranks wait in the kernel's second exchange: they stop there, not hang."""
    _fail_then_recover(FailsBetweenExchanges({LAST}), Boom, rf"kernel failed \[rank {LAST}\]$")


class SkipsExchanges(ToyMessagePassing):
    """A per-layer-halo model that, while ``armed``, makes no halo exchange on ``rank``:
    a model bug (MACE's adapter once cut its empty rank's backward short this way)."""

    def __init__(self, rank: int):
        super().__init__(cutoff=3.0, num_layers=3)
        self.rank, self.armed = rank, False

    def forward(self, graph):
        if self.armed and COMM.rank == self.rank:
            graph = dataclasses.replace(graph, exchange=None)
        return super().forward(graph)


@pytest.mark.mpi(min_size=2)
def test_a_rank_that_skips_exchanges_is_found_not_waited_for() -> None:
    """The other ranks' exchange votes meet the last rank's closing vote: every rank
    raises at that vote (before: the others waited in an exchange forever)."""
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(2)
    model = SkipsExchanges(LAST)
    atoms.calc = calc = ShardedCalculator(model, halo="layer")
    atoms.get_forces()
    atoms.positions[0, 0] += 0.01
    model.armed = True
    with pytest.raises(ExchangeMismatch, match="made different halo exchanges") as caught:
        atoms.get_forces()
    assert len(set(COMM.allgather(str(caught.value)))) == 1
    model.armed = False
    errors = relative_errors(results(atoms), evaluate_periodic_graph(model, atoms))
    assert max(errors.values()) <= 1e-10, errors
    assert calc.rebuilds == 2  # the call after an error starts from a fresh layout


# -- 3: bad or unusual input ----------------------------------------------------------


def test_non_finite_cell() -> None:
    atoms = cu_bulk()
    atoms.calc = ShardedCalculator(EMT())
    cell = atoms.cell.array.copy()
    atoms.cell[2, 2] = np.inf
    with pytest.raises(ValueError, match="cell is not finite"):
        atoms.get_potential_energy()
    atoms.cell = cell
    assert_matches(atoms, AseEMT())


@pytest.mark.parametrize("how", ["swapped", "mirrored"])
def test_left_handed_cell_is_legal(how: str) -> None:
    """A negative determinant is a legal cell: results equal ASE's, stress included."""
    atoms = CASES["ar_triclinic_lj"].make_atoms()
    if how == "swapped":
        atoms.set_cell(atoms.cell[[1, 0, 2]])
    else:
        atoms.set_cell(atoms.cell.array @ np.diag([1.0, 1.0, -1.0]), scale_atoms=True)
    assert np.linalg.det(atoms.cell.array) < 0
    atoms.calc = ShardedCalculator(LennardJones(**AR))
    assert_matches(atoms, AseLennardJones(**AR), stresses=True)


@pytest.mark.parametrize("distance", [1e3, 1e5])
@pytest.mark.parametrize("case_name", ["au_cluster_emt", "pt111_slab_emt"])
def test_atom_far_outside_non_periodic_box(case_name: str, distance: float) -> None:
    """A cluster in a box, or a slab, with one atom far out along a non-periodic axis."""
    atoms = CASES[case_name].make_atoms()
    axis = 2 if atoms.pbc.any() else 0
    if not atoms.pbc.any():
        atoms.center(vacuum=5.0)
    atoms.positions[3, axis] = distance
    atoms.calc = ShardedCalculator(EMT())
    assert_matches(atoms, AseEMT())


@pytest.mark.parametrize("number, name", [(0, "X"), (9, "F")])
def test_element_unknown_to_the_model(number: int, name: str) -> None:
    atoms = cu_bulk()
    atoms.calc = ShardedCalculator(EMT())
    atoms.numbers[4] = number
    with pytest.raises(ValueError, match=rf"does not support {name} \(it supports"):
        atoms.get_forces()
    atoms.numbers[4] = 29
    assert_matches(atoms, AseEMT())


def test_empty_atoms_without_cell_then_atoms() -> None:
    atoms = Atoms()
    atoms.calc = ShardedCalculator(EMT())
    assert atoms.get_potential_energy() == 0.0
    assert atoms.get_forces().shape == (0, 3)
    atoms.extend(cu_bulk())
    atoms.set_cell(cu_bulk().cell)
    atoms.pbc = True
    assert_matches(atoms, AseEMT())


def test_number_of_atoms_changes_between_calls() -> None:
    atoms = cu_bulk()
    calc = ShardedCalculator(EMT())
    atoms.calc = calc
    assert_matches(atoms, AseEMT())
    del atoms[[0, 17, 50]]
    assert_matches(atoms, AseEMT())
    atoms += Atoms("Au", positions=[[1.0, 1.2, 0.9]])
    assert_matches(atoms, AseEMT())
    del atoms[:]
    assert atoms.get_potential_energy() == 0.0
    atoms.extend(cu_bulk())
    assert_matches(atoms, AseEMT())
    assert calc.rebuilds == 5


def _spoil(atoms: Atoms, field: str) -> None:
    """Make ``atoms`` differ from the other ranks' copies in ``field``."""
    if field == "number of atoms":
        del atoms[-1]
    elif field == "numbers":
        atoms.numbers[2] = 79
    elif field == "cell":
        atoms.cell[0, 0] += 1e-9
    else:
        atoms.pbc = (True, True, False)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("field", ["number of atoms", "numbers", "cell", "pbc"])
def test_ranks_hold_different_atoms(field: str) -> None:
    """One rank's copy differs on the first call: every rank names that rank and field."""
    atoms = cu_bulk()
    calc = ShardedCalculator(EMT())
    atoms.calc = calc
    if COMM.rank == LAST:
        _spoil(atoms, field)
    with pytest.raises(ValueError, match=rf"different Atoms.*rank {LAST}: [^)]*{field}"):
        atoms.get_potential_energy()
    atoms = cu_bulk()
    atoms.calc = calc
    assert_matches(atoms, AseEMT())


# -- 4: degenerate geometry -----------------------------------------------------------


def _corner_of_huge_box() -> Atoms:
    """32 Cu atoms around one corner of a 500 Å periodic box (straddling the boundary)."""
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(2)
    atoms.rattle(stdev=0.05, seed=2)
    atoms.positions -= 3.6
    atoms.set_cell([500.0, 500.0, 500.0])
    atoms.pbc = True
    return atoms


def _periodic_chain() -> Atoms:
    """A rattled argon chain, periodic along x only, no cell on y and z."""
    atoms = Atoms(
        "Ar40",
        positions=[[3.8 * i, 0.0, 0.0] for i in range(40)],
        cell=[152.0, 0.0, 0.0],
        pbc=(True, False, False),
    )
    atoms.rattle(stdev=0.1, seed=3)
    return atoms


def _diagonal_chain() -> Atoms:
    """A rattled argon chain along the body diagonal, no cell at all."""
    atoms = Atoms("Ar40", positions=[[2.2 * i] * 3 for i in range(40)])
    atoms.rattle(stdev=0.1, seed=3)
    return atoms


def _thin_cell() -> Atoms:
    """Cu periodic in 3-D with a 3.6 Å cell vector against EMT's 5.9 Å cutoff."""
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((4, 4, 1))
    atoms.rattle(stdev=0.05, seed=2)
    return atoms


def _thin_triclinic_cell() -> Atoms:
    atoms = _thin_cell()
    atoms.set_cell(atoms.cell.array @ [[1, 0, 0], [0.3, 1, 0], [0.2, -0.25, 1]], scale_atoms=True)
    return atoms


DEGENERATE = {
    "corner_of_huge_box": (_corner_of_huge_box, EMT, AseEMT),
    "periodic_chain": (
        _periodic_chain,
        lambda: LennardJones(**AR, smooth=True),
        lambda: AseLennardJones(**AR, smooth=True),
    ),
    "diagonal_chain": (_diagonal_chain, lambda: LennardJones(**AR), lambda: AseLennardJones(**AR)),
    "thin_cell": (_thin_cell, EMT, AseEMT),
    "thin_triclinic_cell": (_thin_triclinic_cell, EMT, AseEMT),
}


@pytest.mark.parametrize("partition", PARTITIONS)
@pytest.mark.parametrize("name", sorted(DEGENERATE))
def test_degenerate_geometry(name: str, partition: str) -> None:
    make_atoms, make_model, make_ase_calc = DEGENERATE[name]
    atoms = make_atoms()
    atoms.calc = ShardedCalculator(make_model(), partition=partition)
    assert_matches(atoms, make_ase_calc())


# -- 7: soak (reduced; the full 10,000 steps: scripts/md_acceptance.py --case nve-soak) --


@pytest.mark.timeout(300)
@pytest.mark.parametrize("distributed", [False, True])
def test_nve_soak_short(distributed: bool) -> None:
    figures = run_nve_soak(repeat=4, steps=200, oracle_every=100, distributed=distributed)
    assert figures["steps"] == 200
    assert figures["conserved"] and figures["in_step"] and figures["all_owned"], figures
    assert figures["max_drift"] <= 2e-4, figures  # eV/atom; measured 4.2e-5
    assert figures["oracle_error"] <= RTOL, figures
    assert figures["rebuilds"] > 10, figures  # measured 29
    assert figures["owner_changes"] > 0 or COMM.size == 1, figures


def test_a_process_that_a_rank_starts_stays_out_of_the_job() -> None:
    """A subprocess of a rank (ASE's socket clients start one that unpickles our
    calculator) inherits the launcher's variables; importing ase_shard there must not
    initialise MPI (under mpirun that joined or crashed the job: ASE's
    ``socketio/test_python_interface.py`` ended in a segmentation fault) and its
    calculator runs on one rank, with ASE's EMT's answer. The last rank starts it (rank
    0 in one process; it is the same on every rank): a subprocess per rank, each
    importing torch, took 15 s at 4 ranks on 2 cores."""
    import subprocess
    import sys

    if COMM.rank != LAST:
        return

    script = (
        "import sys, ase_shard\n"
        "from ase.build import bulk\n"
        "from ase_shard.models import EMT\n"
        "atoms = bulk('Cu', cubic=True) * 2\n"
        "atoms.calc = ase_shard.ShardedCalculator(EMT())\n"
        "energy = float(atoms.get_potential_energy())\n"
        "print('mpi4py.MPI' in sys.modules, atoms.calc.comm.size, energy)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    atoms = bulk("Cu", cubic=True) * 2
    atoms.calc = AseEMT()
    loaded_mpi, ranks, energy = done.stdout.split()
    assert (loaded_mpi, ranks) == ("False", "1")
    assert float(energy) == pytest.approx(atoms.get_potential_energy(), rel=1e-12, abs=0)
