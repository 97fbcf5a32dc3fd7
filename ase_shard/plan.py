"""What a run will need, before it runs: each rank's atoms, ghosts, edges, traffic and memory.

GPAW answers "will it fit?" with ``--dry-run``; LAMMPS prints each rank's
memory as a run starts. :func:`plan` answers before any rank allocates, in one
process: it partitions the structure as ``P`` ranks do at their first step
(the same functions), lists each rank's edges with the same search (one
rank's block at a time, dropped after counting), and prices them with a
calibration on this machine and the target device:

- **geometry, exact**: each rank's owned atoms, ghost atoms, listed edges and
  sent nodes are those of ``calc.balance`` at the run's first step;
- **traffic, exact**: the bytes each rank receives in a step that reuses its
  decomposition (energy and forces asked for), through the halo and with the
  results, are what :attr:`ase_shard.comm.Comm.received_bytes` grows by. The
  calibration records which exchanges the model's step makes and their bytes
  per row (:attr:`ase_shard.exchange.HaloExchange.crossings`); a rank receives
  a row per ghost node forward and per sent node in reverse;
- **memory, estimated**: per rank ``fixed + node_bytes * nodes + edge_bytes *
  edges``, and on a CPU ``+ held * atoms held + ROW_BYTES * rows + (row_bytes +
  NODE_RESULT_BYTES) * nodes``. ``fixed`` is this process's resident memory once
  the model is placed and its kernels are loaded (imports, weights, compiled
  code; on CUDA the device memory torch holds then); ``held`` the arrays the
  calculator, its layout and ASE's driver keep per atom a rank holds (every
  atom when replicated, its own when distributed), and the rows' and nodes'
  arrays outside the block, all on the host;
  ``node_bytes`` and ``edge_bytes`` the peak memory of building and
  evaluating two blocks cut from the structure (:func:`calibrate`), measured on
  the target device: the high-water mark of resident memory on a
  CPU (Linux), torch's peak allocation on CUDA.

The same calibration times the blocks' evaluation per node and per edge,
from which :meth:`Plan.projected_efficiency` projects the speed-up at larger
rank counts (its assumptions in its docstring). Not modelled: a ``Coulomb``
term's mesh (it grows with the cell, not the atoms), torch.compile's caches.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
from ase import Atoms

from ase_shard.bench.machine import PeakMemory, rss_mb
from ase_shard.block import LocalBlock, SumBlock
from ase_shard.calculator import listed_edges, new_block
from ase_shard.comm import Comm
from ase_shard.exchange import Crossing, HaloExchange
from ase_shard.graph import check_model, direct_forces
from ase_shard.halo import RankRows, local_rows, rank_rows
from ase_shard.inputs import ModelInputs, pack, row_width, unpack
from ase_shard.partition import choose_grid, frame_coordinates, spatial_owners
from ase_shard.placement import checked_dtype, placed
from ase_shard.settings import Settings

# atoms of the blocks cut from the structure to price a node and an edge: models that
# sum their own forces on the host (EMT, LJ: ~3 kB an atom) need thousands to rise above
# the allocator's noise; autograd models hold kilobytes an edge
CALIBRATION_ATOMS = {"host": 8000, "autograd": 300}
# result columns a step brings back per atom when energy and forces are asked for
# (energy, force): ase_shard.layouts.base.Layout.finish
RESULT_COLUMNS_PER_ATOM = 4
# a rank's compensated sums of energy and virial (7 values, 2 floats each), float64
PARTIAL_SUMS_BYTES = 7 * 2 * 8
# arrays per held atom besides the Atoms' own (bytes): the calculator's copy of the Atoms'
# arrays is counted from them; these are the results (energies 8, forces 24), the forces
# ASE's driver keeps (24), the gathered results and their reordering (2 x 32), the
# partition's frame coordinates (24 + 24 wrap shifts), owners (8), each atom's row in the
# gathered results (8)
HELD_BYTES_PER_ATOM = 8 + 24 + 24 + 64 + 48 + 8 + 8
# arrays per row of a rank outside its block (bytes): the rows' ids (8), image shifts
# (24) and nodes (8), kept between rebuilds (ase_shard.halo.RankRows)
ROW_BYTES = 8 + 24 + 8
# and per node: the results it sends back (energy and force, 32), besides its node row
# (position and inputs: Calibration.row_bytes)
NODE_RESULT_BYTES = RESULT_COLUMNS_PER_ATOM * 8


@dataclass(frozen=True)
class Calibration:
    """What this machine and device spend per node and per edge of a block.

    Attributes
    ----------
    device : str
    fixed_bytes : int
        This process's resident memory with the model placed and its kernels
        loaded (CPU), or torch's allocations on the device then (CUDA): on CUDA
        every memory figure of a plan is the device's.
    node_bytes, edge_bytes : float
        Peak memory a block adds per node and per listed edge (build and evaluate).
    node_seconds, edge_seconds : float
        Evaluation time per node and per listed edge (a step that reuses the block).
    crossings : tuple of Crossing
        The exchanges one step of the model makes, in order, with bytes per row.
    row_bytes : int
        Bytes of a node row (position and per-atom inputs), forwarded to the
        ghosts each step when the atoms are distributed.
    blocks : tuple of (nodes, edges, bytes, seconds)
        The two measured blocks.
    """

    device: str
    fixed_bytes: int
    node_bytes: float
    edge_bytes: float
    node_seconds: float
    edge_seconds: float
    crossings: tuple[Crossing, ...]
    row_bytes: int
    blocks: tuple[tuple[int, int, int, float], ...]


@dataclass(frozen=True)
class RankPlan:
    """One rank at the first step.

    Attributes
    ----------
    owned, ghosts, rows, edges, sent : int
        Owned atoms, ghost atoms (nodes of other ranks or of periodic images),
        all rows (images folded onto nodes included), listed edges (of a
        ``Sum``, every term's) and owned nodes sent to other ranks per exchange.
    peers : int
        Other ranks it exchanges ghosts with.
    halo_bytes : int
        Bytes received per step through the halo: ghost rows forward, sums of
        the nodes it sends back, per exchange of the step.
    result_bytes : int
        Bytes received per step with the results (other ranks' atoms' energies
        and forces where every rank holds every atom; everyone's partial sums).
    memory : int
        Estimated peak memory in bytes (on CUDA, the device's).
    seconds : float
        Estimated evaluation time per step (no communication).
    """

    owned: int
    ghosts: int
    rows: int
    edges: int
    sent: int
    peers: int
    halo_bytes: int
    result_bytes: int
    memory: int
    seconds: float


@dataclass(frozen=True)
class Plan:
    """A run of ``n_atoms`` on ``ranks`` ranks, rank by rank (:func:`plan`).

    Attributes
    ----------
    n_atoms, ranks : int
    distributed : bool
        Each rank holds its own atoms (:class:`~ase_shard.distributed.DistributedAtoms`)
        rather than all of them.
    grid : (int, int, int)
    per_rank : tuple of RankPlan
    calibration : Calibration
    held_bytes : float
        Bytes a rank keeps per atom it holds, beyond its block.
    """

    n_atoms: int
    ranks: int
    distributed: bool
    grid: tuple[int, int, int]
    per_rank: tuple[RankPlan, ...]
    calibration: Calibration
    held_bytes: float

    @property
    def peak_memory_per_rank(self) -> tuple[int, ...]:
        """Estimated peak memory of each rank, bytes."""
        return tuple(rank.memory for rank in self.per_rank)

    @property
    def halo_bytes_per_step(self) -> tuple[int, ...]:
        """Bytes each rank receives through the halo per step (exact)."""
        return tuple(rank.halo_bytes for rank in self.per_rank)

    def largest_system(self, memory_per_rank: float) -> int:
        """Atoms of this structure, scaled up, that fit ``memory_per_rank`` bytes a rank.

        The busiest rank's block per owned atom (its ghosts and edges included)
        is kept as the system grows (a conservative guess: the ghosts' share
        shrinks), and the held arrays grow with the atoms a rank holds.
        """
        busiest = max(self.per_rank, key=lambda rank: rank.memory)
        fixed = self.calibration.fixed_bytes
        held = self.held_bytes * (busiest.owned if self.distributed else self.n_atoms)
        block = (busiest.memory - fixed - held) / max(busiest.owned, 1)
        per_atom = block / self.ranks + self.held_bytes * (
            1 / self.ranks if self.distributed else 1
        )
        return max(int((memory_per_rank - fixed) / per_atom), 0)

    def projected_efficiency(
        self, one_rank: Plan, bandwidth: float = 5e9, latency: float = 5e-6
    ) -> float:
        """Projected parallel efficiency against ``one_rank`` (this system's one-rank plan).

        Assumptions: a core per rank; a step takes the busiest rank's evaluation
        (the calibration's time per node and per edge) plus its communication:
        each exchange of the step one message to and from each of its peers at
        ``latency`` seconds, the results' gather one from every rank, and its
        received bytes at ``bandwidth`` bytes/s; no overlap. Not counted: what a
        step costs besides the model's evaluation (checks, partition, Python),
        which one rank pays too. Defaults: shared memory on one node.
        """
        # the model's, the results' reverse and, distributed, the node rows forward
        exchanges = len(self.calibration.crossings) + 1 + self.distributed
        steps = []
        for rank in self.per_rank:
            messages = exchanges * rank.peers + (self.ranks - 1)
            wire = (rank.halo_bytes + rank.result_bytes) / bandwidth
            steps.append(rank.seconds + wire + messages * latency)
        return one_rank.per_rank[0].seconds / (self.ranks * max(steps))

    def table(self) -> str:
        """The plan as ``ase-shard plan`` prints it."""
        cal = self.calibration
        lines = [
            f"{self.n_atoms} atoms on {self.ranks} rank(s), grid {self.grid}, "
            + ("distributed" if self.distributed else "replicated")
            + f", {cal.device}",
            "  rank     owned    ghosts       edges   halo KiB/step   memory MiB",
        ]
        for r, rank in enumerate(self.per_rank):
            lines.append(
                f"  {r:<4} {rank.owned:>9} {rank.ghosts:>9} {rank.edges:>11} "
                f"{rank.halo_bytes / 1024:>15.1f} {rank.memory / 2**20:>12.0f}"
            )
        lines.append(
            f"  priced at {cal.fixed_bytes / 2**20:.0f} MiB fixed, {self.held_bytes:.0f} B per "
            f"atom held, {cal.node_bytes:.0f} B per node, {cal.edge_bytes:.0f} B per edge"
        )
        return "\n".join(lines)


def plan(
    atoms: Atoms,
    model: torch.nn.Module,
    ranks: int = 1,
    *,
    device: Any = None,
    dtype: Any = None,
    distributed: bool = False,
    skin: float = 0.5,
    halo: str | None = None,
    neighbor_list: str = "auto",
    calibration: Calibration | None = None,
    calibration_atoms: int | None = None,
) -> Plan:
    """Plan a run of ``atoms`` with ``model`` on ``ranks`` ranks, in this process.

    Parameters
    ----------
    atoms : ase.Atoms
    model : torch.nn.Module
        As :class:`~ase_shard.ShardedCalculator` takes it.
    ranks : int
    device, dtype, skin, halo, neighbor_list
        As for :class:`~ase_shard.ShardedCalculator` (``device`` default: CPU).
    distributed : bool
        Each rank holds its own atoms (:func:`ase_shard.distribute`).
    calibration : Calibration, optional
        One already measured here for this model, device and rank count (one or
        several), e.g. another plan's; else :func:`calibrate` measures it.
    calibration_atoms : int, optional
        Atoms of :func:`calibrate`'s blocks (default :data:`CALIBRATION_ATOMS`).

    Returns
    -------
    Plan
    """
    if int(ranks) != ranks or ranks < 1:
        raise ValueError(f"ranks must be a positive integer, not {ranks!r}")
    ranks = int(ranks)
    check_model(model)
    settings = Settings.checked(
        model,
        ranks,
        skin=skin,
        partition="spatial",
        balance="work",
        grid=None,
        halo=halo,
        compile=False,
        min_distance=0.0,
        neighbor_list=neighbor_list,
    )
    device = torch.device(device or "cpu")
    dtype = checked_dtype(dtype, model)
    model = placed(model, device, dtype)
    if calibration is None:
        calibration = calibrate(
            atoms, model, settings, device, dtype, several=ranks > 1, size=calibration_atoms
        )
    coords = frame_coordinates(atoms.positions, atoms.cell.array, atoms.pbc)
    grid = choose_grid(coords, atoms.pbc, ranks, settings.halo_width)
    owners = spatial_owners(coords, grid)
    held = _held_bytes(atoms)
    one = _one_process()
    per_rank = []
    for rows in rank_rows(coords, atoms.pbc, owners, ranks, settings.halo_width, settings.fold):
        # the rank's block, built as its own run builds it, counted and dropped
        edges = listed_edges(_block(atoms, model, settings, device, rows, one, ranks > 1)[0])
        ghosts, sent = rows.n_nodes - rows.n_owned, len(rows.send_index)
        traffic = _received_bytes(calibration, ghosts, sent, distributed)
        results = (ranks - 1) * PARTIAL_SUMS_BYTES
        if not distributed:
            results += (len(atoms) - rows.n_owned) * RESULT_COLUMNS_PER_ATOM * 8
        holds = rows.n_owned if distributed else len(atoms)
        memory = (
            calibration.fixed_bytes
            + calibration.node_bytes * rows.n_nodes
            + calibration.edge_bytes * edges
        )
        if device.type == "cpu":  # on a GPU, its memory: the arrays below are the host's
            memory += (
                held * holds
                + ROW_BYTES * len(rows.ids)
                + (calibration.row_bytes + NODE_RESULT_BYTES) * rows.n_nodes
            )
        seconds = calibration.node_seconds * rows.n_nodes + calibration.edge_seconds * edges
        per_rank.append(
            RankPlan(
                owned=rows.n_owned,
                ghosts=ghosts,
                rows=len(rows.ids),
                edges=edges,
                sent=sent,
                peers=int(np.count_nonzero((rows.send_counts > 0) | (rows.recv_counts > 0))),
                halo_bytes=traffic,
                result_bytes=results,
                memory=int(memory),
                seconds=seconds,
            )
        )
    return Plan(len(atoms), ranks, distributed, grid, tuple(per_rank), calibration, held)


def calibrate(
    atoms: Atoms,
    model: torch.nn.Module,
    settings: Settings,
    device: torch.device,
    dtype: torch.dtype,
    several: bool,
    size: int | None = None,
) -> Calibration:
    """Price a node and an edge of ``model`` (placed on ``device`` in ``dtype``) on two blocks cut
    from ``atoms``, built as a rank of ``several`` does (a pair between two ranks
    taken once, on the host): the ``size`` atoms nearest the middle (default
    :data:`CALIBRATION_ATOMS`) as a cluster (every node centres its edges), and the
    same atoms owned by one rank of the whole structure, with its ghosts and periodic
    images (most nodes are ghosts, which centre none): two blocks of different edges
    per node, which separate a node's cost from an edge's.

    First a block of a few atoms loads the kernels (compiled code, caches); then
    each block is built and evaluated twice under a memory meter, and once more
    timed and with its exchanges recorded. The ghosts get
    their features from owned nodes of the block (the values are not the system's;
    the sizes are).
    """
    if size is None:
        # the blocks' own test for their compiled kernels (LocalBlock)
        on_host = device.type == "cpu" and dtype == torch.float64
        on_host = on_host and direct_forces(model) is not None
        size = CALIBRATION_ATOMS["host" if on_host else "autograd"]
    size = min(size, len(atoms))
    one = _one_process()
    measure = partial(
        _measure_block, model=model, settings=settings, device=device, dtype=dtype, one=one,
        several=several,
    )
    measure(atoms, 4, True)  # loads the kernels
    meter = PeakMemory(device)
    meter.start()  # the allocator's free memory given back: what is in use
    if device.type == "cuda":
        fixed = torch.cuda.memory_allocated(device)
    else:
        fixed = round((rss_mb() or 0.0) * 2**20)
    blocks, crossings = [], []
    for cluster in (True, False):
        nodes, edges, peak, seconds, crossings = measure(atoms, size, cluster)
        blocks.append((nodes, edges, peak, seconds))
    node_bytes, edge_bytes = _per_node_and_edge([b[:3] for b in blocks])
    node_seconds, edge_seconds = _per_node_and_edge([(*b[:2], b[3]) for b in blocks])
    inputs = ModelInputs.of(model)
    arrays = inputs.per_atom_arrays(atoms) if inputs.per_atom else {}
    return Calibration(
        device=str(device),
        fixed_bytes=int(fixed),
        node_bytes=node_bytes,
        edge_bytes=edge_bytes,
        node_seconds=node_seconds,
        edge_seconds=edge_seconds,
        crossings=tuple(crossings),
        row_bytes=8 * row_width({name: a.shape[1:] for name, a in arrays.items()}),
        blocks=tuple(blocks),
    )


def _received_bytes(
    calibration: Calibration, ghosts: int, sent: int, distributed: bool
) -> int:
    """Bytes a rank with ``ghosts`` ghost nodes and ``sent`` sent nodes receives through
    the halo in a step: the model's exchanges, the node rows (distributed atoms), the
    ghosts' results back to their owners."""
    crossings = [
        *calibration.crossings,
        Crossing(False, RESULT_COLUMNS_PER_ATOM * 8),  # Layout.finish's reverse
    ]
    if distributed:
        crossings.append(Crossing(True, calibration.row_bytes))  # the ghosts' node rows
    return sum(c.row_bytes * (ghosts if c.forward else sent) for c in crossings)


def _per_node_and_edge(points: list[tuple[int, int, float]]) -> tuple[float, float]:
    """``(a, b)`` with ``value = a nodes + b edges`` through two measured blocks; a
    coefficient that comes out negative (noise, or blocks of one shape) is 0 and the
    other fits both by least squares."""
    (n1, e1, v1), (n2, e2, v2) = points
    det = n1 * e2 - n2 * e1
    if det != 0:
        a, b = (v1 * e2 - v2 * e1) / det, (n1 * v2 - n2 * v1) / det
        if a >= 0 and b >= 0:
            return float(a), float(b)
    per_edge = (e1 * v1 + e2 * v2) / max(e1 * e1 + e2 * e2, 1)
    per_node = (n1 * v1 + n2 * v2) / max(n1 * n1 + n2 * n2, 1)
    # keep the single coefficient that explains the two blocks best
    edge_error = abs(v1 - per_edge * e1) + abs(v2 - per_edge * e2)
    node_error = abs(v1 - per_node * n1) + abs(v2 - per_node * n2)
    return (0.0, float(per_edge)) if edge_error <= node_error else (float(per_node), 0.0)


def _measure_block(
    atoms: Atoms,
    size: int,
    cluster: bool,
    *,
    model: torch.nn.Module,
    settings: Settings,
    device: torch.device,
    dtype: torch.dtype,
    one: Comm,
    several: bool,
) -> tuple[int, int, int, float, list[Crossing]]:
    """Nodes, edges, peak bytes (build and evaluation), seconds of a reuse step and its
    exchanges, of the block of the ``size`` atoms of ``atoms`` nearest its middle: a
    ``cluster`` of them alone, or owned by one rank of two (built as a rank of
    ``several``)."""
    nearest = _nearest_middle(atoms, size)
    if cluster:
        atoms = _cluster(atoms, nearest)
    coords = frame_coordinates(atoms.positions, atoms.cell.array, atoms.pbc)
    owners = np.ones(len(atoms), dtype=np.int64)
    owners[np.arange(len(atoms)) if cluster else nearest] = 0
    rows = local_rows(coords, atoms.pbc, owners, 0, 2, settings.halo_width, settings.fold)
    # its ghosts come from its own first nodes, through a one-rank exchange to itself
    ghosts = rows.n_nodes - rows.n_owned
    rows.send_index = np.arange(ghosts, dtype=np.int64) % max(rows.n_owned, 1)
    rows.send_counts = rows.recv_counts = np.array([ghosts], dtype=np.int64)
    ids = rows.ids[: rows.n_nodes]
    positions = atoms.positions[ids]
    inputs = ModelInputs.of(model)
    node_inputs, system = None, None
    if inputs:
        arrays = inputs.per_atom_arrays(atoms)
        shapes = {name: list(a.shape[1:]) for name, a in arrays.items()}
        node_inputs = unpack(pack(arrays, ids), shapes) if arrays else None
        system = inputs.system_values(atoms, settings.parameters(model))
    meter = PeakMemory(device)
    meter.start()
    block, exchange = _block(atoms, model, settings, device, rows, one, several)
    # a rebuild's step and one that reuses the block (TorchScript optimises its graphs
    # in their second run)
    for _ in range(2):
        block.evaluate(positions, atoms.cell.array, dtype, node_inputs, system, False)
    peak = meter.stop()
    exchange.crossings = []
    start = time.perf_counter()
    block.evaluate(positions, atoms.cell.array, dtype, node_inputs, system, False)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    added = peak["cuda_peak_delta_mb"] if device.type == "cuda" else peak["peak_rss_delta_mb"]
    return rows.n_nodes, listed_edges(block), round(added * 2**20), seconds, exchange.crossings


def _block(
    atoms: Atoms,
    model: torch.nn.Module,
    settings: Settings,
    device: torch.device,
    rows: RankRows,
    one: Comm,
    several: bool,
) -> tuple[LocalBlock | SumBlock, HaloExchange]:
    """A rank's block of ``rows`` in this process, and the exchange plan it was given
    (over a one-rank communicator: it records, never sends)."""
    exchange = HaloExchange(
        one, rows.n_owned, rows.send_index, rows.send_counts, rows.recv_counts, device
    )
    ids = rows.ids[: rows.n_nodes]
    block = new_block(
        model,
        rows,
        atoms.numbers[ids],
        atoms.positions[ids],
        atoms.cell.array,
        settings,
        device,
        exchange,
        pair_halo=several and device.type == "cpu",
    )
    return block, exchange


def _held_bytes(atoms: Atoms) -> float:
    """Bytes a rank keeps per atom it holds beyond its block: the calculator's copy of
    the Atoms' arrays and :data:`HELD_BYTES_PER_ATOM`."""
    arrays = sum(array.nbytes for array in atoms.arrays.values()) / max(len(atoms), 1)
    return arrays + HELD_BYTES_PER_ATOM


def _nearest_middle(atoms: Atoms, size: int) -> np.ndarray:
    """The ``size`` atoms nearest the middle of ``atoms`` (wrapped into the cell)."""
    positions = atoms.get_positions(wrap=bool(atoms.pbc.any()))
    middle = (
        atoms.cell.array.sum(axis=0) / 2 if atoms.cell.rank == 3 else positions.mean(axis=0)
    )
    return np.argsort(np.linalg.norm(positions - middle, axis=1), kind="stable")[:size]


def _cluster(atoms: Atoms, ids: np.ndarray) -> Atoms:
    """The atoms ``ids`` of ``atoms`` (wrapped into the cell) alone, without periodicity."""
    ids = np.sort(ids)
    positions = atoms.get_positions(wrap=bool(atoms.pbc.any()))[ids]
    cut = Atoms(atoms.numbers[ids], positions, cell=atoms.cell, pbc=False)
    for name, array in atoms.arrays.items():
        if name not in cut.arrays:  # per-atom inputs (charges, magnetic moments, ...)
            cut.arrays[name] = array[ids]
    cut.info.update(atoms.info)
    return cut


def _one_process() -> Comm:
    """A one-rank communicator, also under mpirun (the plan talks to no other rank)."""
    mpi = sys.modules.get("mpi4py.MPI")
    return Comm(mpi.COMM_SELF if mpi is not None else None)


def report(
    atoms: Atoms,
    model: torch.nn.Module,
    rank_counts: list[int],
    *,
    memory_per_rank: float | None = None,
    **options: Any,
) -> tuple[str, list[dict[str, Any]]]:
    """``ase-shard plan``'s text and JSON: a :func:`plan` per rank count (``options``
    as it takes them), each with its projected efficiency against one rank and, given
    ``memory_per_rank`` (bytes), the largest system of this kind that fits.

    The calibration is measured once for one rank and once for several.
    """
    calibrations: dict[bool, Calibration] = {}

    def planned(ranks: int) -> Plan:
        several = ranks > 1
        made = plan(atoms, model, ranks, calibration=calibrations.get(several), **options)
        calibrations[several] = made.calibration
        return made

    one_rank = planned(1)
    lines, records = [], []
    for ranks in rank_counts:
        made = one_rank if ranks == 1 else planned(ranks)
        efficiency = made.projected_efficiency(one_rank)
        lines += [made.table(), f"  projected parallel efficiency {efficiency:.2f}"]
        record = asdict(made)
        record["projected_efficiency"] = efficiency
        if memory_per_rank is not None:
            fits = made.largest_system(memory_per_rank)
            lines.append(
                f"  the largest system of this kind within {memory_per_rank / 2**30:g} GiB "
                f"per rank: {fits} atoms"
            )
            record["largest_system"] = fits
        records.append(record)
    return "\n".join(lines), records
