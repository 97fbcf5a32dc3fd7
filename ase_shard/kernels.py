"""Compiled CPU kernels of the built-in potentials: energies, forces and virials (numba).

The kernels walk a block's listed edges (every pair within ``cutoff + skin``
at the last rebuild), form each edge vector from the node positions, skip the
edges beyond the cutoff and sum the energy, force and virial of the rest into
the block's ``(10, n_nodes)`` result columns (see
:meth:`ase_shard.block.LocalBlock.evaluate` and
:class:`ase_shard.graph.DirectForces`): no autograd, no edge vectors kept. The
formulas are those of the torch models in :mod:`ase_shard.models`, whose
derivatives are written out here.

Every built-in potential takes a pair once, for both ends (``newton_pair``,
see :class:`ase_shard.graph.DirectForces`): a pair of owned atoms from its
edge with ``i < j``, an edge to an image of its own centre for itself, and a
pair between two ranks on one of them when the edges come with a halo
(:attr:`ase_shard.graph.EdgeList.halo`, Newton's third law across ranks as in
LAMMPS); the ghost end's share goes to the ghost's columns, which the
calculator sums into its owner. Without a halo each rank takes its own end of
an edge to a ghost.

Pair potentials (one pass): each end gets half the pair's energy, ``-+dE/dd``
as its force and half of the virial ``d ⊗ dE/dd``.

EMT (two passes): the energy of an atom depends on its density, so an edge
gives each end its own energy terms. The first pass sums the densities and
keeps three numbers per pair taken (two for one element) and a bit per
listed edge; the second, once both ends' ``dE/dsigma1`` are known, sums the
forces and virials. On one rank the second follows the first through the
list, its terms held in a ring (:func:`_emt_sweep`). Between them, with a
halo, the ghost ends' densities go to their owners and their ``dE/dsigma1``
come back.

The loops stay free of branches that the processor cannot predict (which
edges are within the cutoff: a fifth are not, in no pattern): an edge beyond
it adds zeros, or is left out of a list of the edges taken that is written
without a branch (each edge written where the next goes, kept by counting it).
Exponentials, which a compiled loop takes one at a time, are taken by numpy's
vectorised ``exp`` in batches, and multiplies and adds are fused
(``fastmath={"contract"}``; no other reordering, so the compensated sums stay
exact).

Compiled on first use and cached on disk by numba (``cache=True``). Divisions
follow numpy's rules (``error_model="numpy"``): coincident atoms give
non-finite numbers, which the block reports, rather than an exception here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numba
import numpy as np

from ase_shard.compiled import unsigned
from ase_shard.graph import EdgeList
from ase_shard.summation import (
    add_compensated,
    add_same_sign,
    compensated_step,
    same_sign_step,
)

# The columns of EMT's parameter table, one row per atomic number
# (``ase_shard.models.EMT`` fills it): lengths in Å, energies in eV,
# ``EMT_N0`` in 1/Å³; the last two are derived from the others as ASE's EMT does.
(
    EMT_E0,
    EMT_S0,
    EMT_V0,
    EMT_ETA2,
    EMT_KAPPA,
    EMT_LAMBDA,
    EMT_N0,
    EMT_INV12GAMMA1,
    EMT_NEGHALFV0OVERGAMMA2,
) = range(9)
EMT_COLUMNS = 9

# pair forms of :func:`pair_forces`
LJ_SHIFTED, LJ_SMOOTH, MORSE = 0, 1, 2

# edges a pair potential's kernel takes at a time: their vectors and terms stay in L1
PAIR_BATCH = 1024
# edges EMT's first pass takes at a time: 3 (5 for mixed elements) rows of this many
# float64 exponentials, with the batch's lengths and list of taken edges, 2.5 MiB; two
# compiled calls and one of numpy's per batch (8,192 edges a batch took 8 % longer a
# 32,000-atom pass, in the calls' own cost: each checks the types of its twenty
# arguments; since 27ff86e 16,384 to 262,144 edges, 65,536 or more the fastest)
EXP_BATCH = 65536
# EMT's batches of plain edges after which the second pass follows the first
# (:func:`_emt_sweep`): each time, a few compiled calls for the nodes complete; a
# larger ring for more. 32,000 Cu atoms, 1 to 8 tried: 2 the fastest kernel
SWEEP_BATCHES = 2


def pair_forces(kind: int, params: np.ndarray, edges: EdgeList, out: np.ndarray) -> float:
    """Add a pair potential's per-node energies, forces and virials to ``out``.

    Parameters
    ----------
    kind : int
        :data:`LJ_SHIFTED` (``params``: sigma Å, epsilon eV, ``u(rc)`` eV),
        :data:`LJ_SMOOTH` (sigma, epsilon, ``rc**2`` and ``ro**2`` in Å²) or
        :data:`MORSE` (epsilon eV, r0 Å, rho0, r_on Å, r_off Å).
    params : (k,) floats, k <= 5
    edges : EdgeList
        Every edge centred on an owned node.
    out : (10, n_nodes) float64 array
        Per-node energy (eV; a ghost's share belongs to its owner), force
        (eV/Å, 3 rows) and virial (eV, Voigt xx yy zz yz xz xy), added to.

    Returns
    -------
    float
        The smallest squared length (Å²) among all listed edges (``inf`` for none).
    """
    split = edges.halo is not None
    # a tuple of five, not an array: the compiled loop keeps them in registers (it would
    # reload an array's after every store to the sums, which might alias it)
    constants = tuple(float(value) for value in params) + (0.0,) * (5 - len(params))
    kernel = _pair_forces_per_node if edges.per_node_virials else _pair_forces
    positions, centre, neighbour, image, offsets = _arrays(edges)
    rows = _node_rows(len(positions), edges.per_node_virials)
    closest = np.inf
    for first, last, images in _segments(edges, image):
        closest = min(closest, kernel(
            kind, constants, edges.cutoff**2, positions, centre, neighbour, images, offsets,
            edges.n_owned, split, first, last, rows, out,
        ))  # fmt: skip
    _add_node_sums(out, rows)
    return closest


def _node_rows(n_nodes: int, per_node_virials: bool) -> np.ndarray:
    """Zeroed node-major sums a kernel adds to, its segments in turn, and then puts in the
    ``(10, n)`` result columns (:func:`_add_node_sums`): one node's sums in one or two
    cache lines. Energy and force, ``(n, 4)``, 32 bytes a node at the step's peak memory;
    with the virials per node ``(n, 10)``, 80 bytes (else a kernel sums them in registers).
    """
    return np.zeros((n_nodes, 10 if per_node_virials else 4))


def plain_edges_together(
    centre: np.ndarray, neighbour: np.ndarray, image: np.ndarray, n_owned: int, ghosts_first: bool
) -> range:
    """A block's list reordered in place (stable) so that its plain edges (image 0) lie
    together; where they lie (:attr:`ase_shard.graph.EdgeList.plain`).

    Parameters
    ----------
    centre, neighbour : (E,) int32 or int64 arrays
        The edges' nodes.
    image : (E,) int8, int16 or int32 array
        Their images (:func:`ase_shard.block.edge_images`).
    n_owned : int
    ghosts_first : bool
        The list begins with its edges to ghosts, grouped by ghost
        (:func:`ase_shard.shared_pairs.pairs_once`): they stay there, as they are.

    Returns
    -------
    range
        The plain edges: after the edges to ghosts (``ghosts_first``), the
        plain ones, then the others. A temporary for those others only (a few
        per cent, at the rebuild).
    """
    first, plain = _plain_together(centre, neighbour, image, n_owned, ghosts_first)
    return range(first, plain)


@numba.njit(cache=True)
def _plain_together(centre, neighbour, image, n_owned, ghosts_first):  # pragma: no cover
    """:func:`plain_edges_together`: the plain range's first and last edge (exclusive)."""
    n = len(image)
    first = 0
    if ghosts_first:
        while first < n and neighbour[first] >= n_owned:
            first += 1
    shifted = 0
    for e in range(first, n):
        shifted += image[e] != 0
    held_centre = np.empty(shifted, centre.dtype)
    held_neighbour = np.empty(shifted, neighbour.dtype)
    held_image = np.empty(shifted, image.dtype)
    plain = first
    k = 0
    for e in range(first, n):
        if image[e] == 0:
            centre[plain] = centre[e]
            neighbour[plain] = neighbour[e]
            plain += 1
        else:
            held_centre[k] = centre[e]
            held_neighbour[k] = neighbour[e]
            held_image[k] = image[e]
            k += 1
    centre[plain:] = held_centre
    neighbour[plain:] = held_neighbour
    image[first:plain] = 0
    image[plain:] = held_image
    return first, plain


def _segments(edges: EdgeList, image: np.ndarray) -> list[tuple[int, int, np.ndarray | None]]:
    """The ranges of edges a kernel walks in turn, each with the images it reads:
    ``None`` for the list's plain edges (:attr:`EdgeList.plain`), whose kernels add
    no offset.

    Each edge's offset is a byte and a row of a small table, read at every edge
    in the loop that gathers the edge vectors (and a dependency of its
    vectorised gathers): 32,000 Ar atoms on one rank, 9 % of the Lennard-Jones
    step. A kernel compiled for plain edges (``image`` None) leaves it out.
    """
    plain = edges.plain
    segments = [
        (0, plain.start, image),
        (plain.start, plain.stop, None),
        (plain.stop, len(image), image),
    ]
    return [(first, last, images) for first, last, images in segments if last > first]


def emt_forces(
    table: np.ndarray, rc: float, acut: float, beta: float, edges: EdgeList, out: np.ndarray
) -> float:
    """Add EMT's per-node energies, forces and virials to ``out``.

    Parameters
    ----------
    table : (119, 9) float64 array
        Per-element parameters (:func:`ase_shard.models.emt._parameter_table`).
    rc, acut, beta : float
        The logistic cutoff's midpoint (Å) and slope (1/Å), and EMT's ``beta``.
    edges, out
        As in :func:`pair_forces`.

    Returns
    -------
    float
        The smallest squared length (Å²) among all listed edges (``inf`` for none).
    """
    numbers = np.ascontiguousarray(edges.numbers, dtype=np.int64)
    positions, centre, neighbour, image, offsets = _arrays(edges)
    segments = _segments(edges, image)
    cutoff2, n_owned, halo = edges.cutoff**2, edges.n_owned, edges.halo
    split = halo is not None
    # the densities, the pair sums sigma2 (eV), and the rounding errors of both
    # (:mod:`ase_shard.summation`): with ~80 neighbours each, plain sums were the
    # energy's main noise
    sums = np.zeros((4, len(numbers)))
    dcohesive = np.zeros((1, len(numbers)))
    rows = None  # the second pass's node sums, zeroed just before it first adds to them
    # one element: a pair's density terms seen from its two ends are the same number,
    # and the kernels keep that ``element``'s parameters in registers
    mixed = len(numbers) > 0 and numbers.min() != numbers.max()
    element = int(numbers[0]) if len(numbers) else 0
    # per edge taken, in order: d(density w)/dr / r seen from the centre, 0.5 d(pair
    # w)/dr / r (the same seen from either end) and, where the elements are ``mixed``,
    # the first seen from the neighbour (without, it is the first: 8 bytes a pair
    # fewer). Whether each edge was taken is a bit: the second pass takes it from
    # there, with no branch and never a length that might round otherwise than here
    # (rows of zeros for the edges not taken instead held 0.14 kB an atom more, 32,000
    # to 256,000 Cu atoms; a byte per edge 0.04 kB). The plain edges' terms are held
    # only from the first pass to the second (:func:`_emt_sweep`), the others' until
    # the end
    plain = edges.plain
    sweep = _emt_sweep(edges, centre, neighbour, split)
    columns = 3 if mixed else 2
    # one row spare: a call of the second pass never takes them all from row 0
    held_terms = _kept(edges, "emt held terms", (len(centre) - len(plain) + 1, columns))
    plain_terms = _kept(edges, "emt terms", (sweep.rows + 1, columns))
    taken_edges = np.zeros((len(centre) + 7) // 8, np.uint8)
    # pass 1 in batches of edges: their exponentials by numpy's SIMD ``exp`` (under a
    # nanosecond each, against 5.7 for the compiled loop's scalar ``exp``: three per
    # edge were half of this pass), the rest compiled, before and after
    batch = min(len(centre), EXP_BATCH)
    radii = _kept(edges, "emt radii", (batch,))
    batch_edges = _kept(edges, "emt batch edges", (batch,), np.int64)  # its taken edges
    exponents = _kept(edges, "emt exponents", (5 if mixed else 3, batch))
    closest = np.inf

    def first_pass(start: int, stop: int, images, terms: np.ndarray, taken: int) -> int:
        nonlocal closest
        listed_closest, n_taken = _emt_exponents(
            table, rc, acut, beta, cutoff2, numbers, positions, centre, neighbour, images,
            offsets, n_owned, split, mixed, element, start, stop, batch_edges, radii, exponents,
        )  # fmt: skip
        closest = min(closest, listed_closest)
        np.exp(exponents[:, :n_taken], out=exponents[:, :n_taken])
        # a ring's rows run out at most once a batch: the edges up to its last row, the
        # rest from row 0 (no test of the row at every edge)
        turn = min(n_taken, len(terms) - taken)
        for first, last in ((0, turn), (turn, n_taken)):
            if last > first:
                taken = _emt_densities(
                    table, acut, beta, numbers, centre, neighbour, n_owned, split, mixed,
                    element, last - first, batch_edges[first:], radii[first:],
                    exponents[:, first:], taken, taken_edges, sums, terms,
                )  # fmt: skip
            taken = 0 if taken == len(terms) else taken
        return taken

    def energies(nodes: np.ndarray) -> None:
        if len(nodes):
            _emt_energies(table, beta, numbers, sums, nodes, out, dcohesive[0])

    def second_pass(first: int, last: int, images, terms: np.ndarray, taken: int) -> int:
        nonlocal rows
        if last > first and rows is None:
            # not sooner: zeroed before the first pass, they left the cache (two ranks:
            # a step 4 % longer)
            rows = _node_rows(len(numbers), edges.per_node_virials)  # (no energies: zero)
        # a ring's rows run out at most once a call: the edges up to the last row's
        # first, the rest from row 0 (no test of the row at every edge)
        turn = _ring_end(taken_edges, first, last, len(terms) - taken)
        for start, stop in ((first, turn), (turn, last)):
            if stop > start:
                taken = _emt_pair_forces(
                    positions, centre, neighbour, images, offsets, n_owned, split,
                    taken_edges, terms, dcohesive[0], start, stop, taken, rows, out,
                )  # fmt: skip
            taken = 0 if taken == len(terms) else taken
        return taken

    taken = written = read = 0
    done = plain.start
    acted = -2  # the batch by which the nodes complete have their energies (-2: none)
    n_batches = len(sweep.frontier)
    # without a halo the held edges first: a node's density is complete once the plain
    # edges reach its last, and its energy, its dcohesive and its edges' forces follow
    # (with one, all wait for the exchange: the list's order)
    held_first = sorted(segments, key=lambda segment: segment[2] is None)  # (stable)
    for first, last, images in segments if split else held_first:
        if images is not None:
            for start in range(first, last, EXP_BATCH):
                taken = first_pass(start, min(start + EXP_BATCH, last), images, held_terms, taken)
            continue
        energies(sweep.completed(acted, -1))  # the nodes without plain edges
        acted = -1
        for b, start in enumerate(range(first, last, EXP_BATCH)):
            written = first_pass(start, min(start + EXP_BATCH, last), None, plain_terms, written)
            if (b + 1) % SWEEP_BATCHES == 0 or b == n_batches - 1:
                energies(sweep.completed(acted, b))
                read = second_pass(done, sweep.frontier[b], None, plain_terms, read)
                done, acted = sweep.frontier[b], b
    if split:
        # a ghost's partial sums travel as one number each (not four): its owner adds
        # them to its own compensated sums
        sums[:2, n_owned:] += sums[2:, n_owned:]
        halo.sum_ghost_columns(sums[:2])
    energies(sweep.completed(acted, n_batches))
    sums = None  # spent: not held through the rest of the second pass
    if split:
        halo.copy_owner_columns(dcohesive)
    # the rest in the list's order
    taken = 0
    for first, last, images in segments:
        if images is None:
            second_pass(done, last, None, plain_terms, read)
        else:
            taken = second_pass(first, last, images, held_terms, taken)
    if rows is not None:
        _add_node_sums(out, rows)  # no energies here: their row is zero
    return closest


@dataclass(frozen=True)
class _Sweep:
    """How EMT's two passes over a block's plain edges follow one another
    (:func:`_emt_sweep`).

    Attributes
    ----------
    frontier : (B,) int64 array
        After the first pass over the plain edges' batch ``b`` (of
        :data:`EXP_BATCH`), the second may take them up to edge ``frontier[b]``:
        each end's density is complete by then.
    nodes : (n_owned,) int64 array
        The owned nodes in the order their densities are complete: before the
        plain edges, after each of their batches, at the end (after the ghosts'
        sums), from ``offsets``.
    offsets : (B + 3,) int64 array
    rows : int
        The most pair terms of plain edges held at once (rows a ring of them
        needs).
    """

    frontier: np.ndarray
    nodes: np.ndarray
    offsets: np.ndarray
    rows: int

    def completed(self, after: int, upto: int) -> np.ndarray:
        """The nodes complete after batch ``after`` and by batch ``upto`` (-1: before the
        first; ``B``: at the end)."""
        return self.nodes[self.offsets[after + 2] : self.offsets[upto + 2]]


def _emt_sweep(edges: EdgeList, centre: np.ndarray, neighbour: np.ndarray, split: bool) -> _Sweep:
    """EMT's plan for a block's list, drawn once and kept in its scratch.

    A pair's terms (16 bytes) were held from the first pass to the second for
    every edge taken: 0.55 kB an atom, a third of a step's peak memory (168 MiB
    at 256,000 Cu atoms), which the second pass read back from memory. A list
    walks space a region at a time (a cell list's order, whatever the atoms'),
    so a node's density is complete once the first pass has walked its last
    edge, a few thousand atoms later. The second pass follows the first over
    the plain edges, every :data:`SWEEP_BATCHES` batches, as far as their ends
    are complete, and their terms are held in a ring of the rows between the
    two (``_Sweep.rows``): 4.4 MiB at 32,000 Cu atoms, 12 MiB at 256,000. The
    other edges (images across the box's faces, ghosts: 5-10 %) go first and
    are held until the end. With a halo a node's density is complete only
    after the exchange (each rank's sums into the ghosts' owners): then every
    term is held to the end, as before.

    Drawn in two walks over the plain edges (2.4 ms at 32,000 Cu atoms, at each
    rebuild) and kept in the block's scratch.
    """
    plain = edges.plain

    def make() -> _Sweep:
        return _Sweep(*_sweep_plan(
            centre, neighbour, edges.n_owned, len(edges.positions), split, plain.start,
            plain.stop, EXP_BATCH, SWEEP_BATCHES,
        ))  # fmt: skip

    if edges.scratch is None:
        return make()
    # one list, its plain edges and its halo known
    return edges.scratch.once(f"emt sweep {plain.start} {plain.stop} {split}", make)


@numba.njit(cache=True)
def _sweep_plan(  # pragma: no cover - compiled
    centre, neighbour, n_owned, n_nodes, split, first, last, batch, group
):
    """:func:`_emt_sweep`'s arrays (``_Sweep``'s fields), over the plain edges
    ``first:last`` in batches of ``batch``."""
    n_batches = (last - first + batch - 1) // batch
    # the batch after which each node's density is complete: -1 before the plain edges,
    # n_batches at the end (the ghosts; with a halo, every node: after the exchange)
    complete = np.full(n_nodes, n_batches if split else -1, np.int64)
    complete[n_owned:] = n_batches
    frontier = np.full(n_batches, first, np.int64)
    if not split:
        for b in range(n_batches):  # a node's last edge is in its latest batch
            for e in range(first + b * batch, min(first + (b + 1) * batch, last)):
                i, j = _edge_ends(e, centre, neighbour)
                ends = _ends(i, j, unsigned(n_owned), split)
                if ends != 0:
                    complete[i] = b
                if ends == 2:
                    complete[j] = b
        ready = -1  # the latest batch after which every edge so far has both ends complete
        b = 0
        for e in range(first, last):
            i, j = _edge_ends(e, centre, neighbour)
            ends = _ends(i, j, unsigned(n_owned), split)
            needs = max(complete[i], complete[j]) if ends == 2 else complete[i]
            ready = max(ready, needs if ends != 0 else -1)
            while b < n_batches and ready > b:
                frontier[b] = e
                b += 1
        frontier[b:] = last
    rows = 0
    done = first
    for b in range(n_batches):
        rows = max(rows, min(first + (b + 1) * batch, last) - done)
        if (b + 1) % group == 0:
            done = frontier[b]
    # the owned nodes by the batch after which they are complete (counting sort)
    offsets = np.zeros(n_batches + 3, np.int64)
    for node in range(n_owned):
        offsets[complete[node] + 2] += 1
    for k in range(1, n_batches + 3):
        offsets[k] += offsets[k - 1]
    nodes = np.empty(n_owned, np.int64)
    filled = offsets.copy()
    for node in range(n_owned):
        slot = complete[node] + 1
        nodes[filled[slot]] = node
        filled[slot] += 1
    return frontier, nodes, offsets, max(rows, 1)


def _ring_end(taken_edges: np.ndarray, first: int, last: int, rows: int) -> int:
    """The edge after the ``rows``-th taken one of ``first:last`` (``last`` if fewer)."""
    if rows > last - first:
        return last
    return _nth_taken_end(taken_edges, first, last, rows)


@numba.njit(cache=True)
def _nth_taken_end(taken_edges, first, last, rows):  # pragma: no cover - compiled
    """:func:`_ring_end`: the bits counted a byte at a time where a byte lies whole."""
    count = 0
    e = first
    while e < last:
        if e & 7 == 0 and e + 8 <= last:
            byte = taken_edges[e >> 3]
            ones = 0
            for k in range(8):
                ones += (byte >> k) & 1
            if count + ones < rows:
                count += ones
                e += 8
                continue
        count += _taken(taken_edges, e)
        e += 1
        if count == rows:
            return e
    return last


def _kept(
    edges: EdgeList, name: str, shape: tuple[int, ...], dtype: type = np.float64
) -> np.ndarray:
    """An uninitialised array from the block's scratch (kept between its steps), or a
    fresh one where the edges come without."""
    if edges.scratch is None:
        return np.empty(shape, dtype)
    return edges.scratch.empty(name, shape, dtype)


def _arrays(edges: EdgeList) -> tuple[np.ndarray, ...]:
    """The edge list's arrays in the kernels' types, contiguous."""
    return (
        np.ascontiguousarray(edges.positions, dtype=np.float64),
        _indices(edges.centre),
        _indices(edges.neighbour),
        np.ascontiguousarray(edges.image),
        np.ascontiguousarray(edges.offsets, dtype=np.float64).reshape(-1, 3),
    )


def _indices(values: np.ndarray) -> np.ndarray:
    """Edge ends as the kernels take them: int32 (a block's lists) or int64, contiguous.

    Either is compiled as given: a conversion would copy the list at every step.
    """
    values = np.ascontiguousarray(values)
    return values if values.dtype in (np.int32, np.int64) else values.astype(np.int64)


@numba.njit(cache=True, inline="always")
def _edge_ends(e, centre, neighbour):  # pragma: no cover - compiled
    """Edge ``e``'s centre and neighbour rows (:func:`ase_shard.compiled.unsigned`)."""
    return unsigned(centre[unsigned(e)]), unsigned(neighbour[unsigned(e)])


@numba.njit(cache=True, error_model="numpy", inline="always")
def _edge(e, positions, centre, neighbour, image, offsets):  # pragma: no cover - compiled
    """Edge ``e``'s vector (Å); ``image`` None: a plain edge, no offset (:func:`_segments`;
    numba compiles the test away, and image 0's zero offset adds nothing: the same bits)."""
    i, j = _edge_ends(e, centre, neighbour)
    dx = positions[j, 0] - positions[i, 0]
    dy = positions[j, 1] - positions[i, 1]
    dz = positions[j, 2] - positions[i, 2]
    if image is None:
        return dx, dy, dz
    m = unsigned(image[unsigned(e)])
    return dx + offsets[m, 0], dy + offsets[m, 1], dz + offsets[m, 2]


@numba.njit(cache=True, error_model="numpy", inline="always")
def _add_virial(rows, node, c, dx, dy, dz):  # pragma: no cover - compiled
    """``c d ⊗ d`` into ``node``'s virial columns 4-9 of node-major sums (Voigt)."""
    rows[node, 4] += c * dx * dx
    rows[node, 5] += c * dy * dy
    rows[node, 6] += c * dz * dz
    rows[node, 7] += c * dy * dz
    rows[node, 8] += c * dx * dz
    rows[node, 9] += c * dx * dy


@numba.njit(cache=True, error_model="numpy", inline="always")
def _pair(kind, params, r2):  # pragma: no cover - compiled
    """Pair energy (eV) and its derivative w.r.t. ``r**2`` (eV/Å²)."""
    if kind == MORSE:
        epsilon, r0, rho0, r_on, r_off = params[0], params[1], params[2], params[3], params[4]
        r = math.sqrt(r2)
        expf = math.exp(rho0 * (1.0 - r / r0))
        energy = epsilon * expf * (expf - 2.0)
        denergy = -2.0 * epsilon * rho0 / r0 * expf * (expf - 1.0)
        s = 1.0 - (r - r_on) / (r_off - r_on)
        if s < 1.0:
            switch = s * s * s * (6.0 * s * s - 15.0 * s + 10.0)
            dswitch = -30.0 * s * s * (s - 1.0) * (s - 1.0) / (r_off - r_on)
            denergy = denergy * switch + energy * dswitch
            energy *= switch
        return energy, denergy / (2.0 * r)
    sigma, epsilon = params[0], params[1]
    inverse_r2 = 1.0 / r2  # one division a pair: the loop's slowest instruction
    c6 = sigma * sigma * inverse_r2
    c6 = c6 * c6 * c6
    energy = 4.0 * epsilon * (c6 * c6 - c6)
    denergy = -12.0 * epsilon * (2.0 * c6 * c6 - c6) * inverse_r2
    if kind == LJ_SHIFTED:
        return energy - params[2], denergy
    rc2, ro2 = params[2], params[3]
    if r2 < ro2:
        return energy, denergy
    scale = 1.0 / ((rc2 - ro2) * (rc2 - ro2) * (rc2 - ro2))
    switch = (rc2 - r2) * (rc2 - r2) * (rc2 + 2.0 * r2 - 3.0 * ro2) * scale
    dswitch = -6.0 * (rc2 - r2) * (r2 - ro2) * scale
    return energy * switch, denergy * switch + energy * dswitch


@numba.njit(cache=True, error_model="numpy", fastmath={"contract"})
def _pair_forces(  # pragma: no cover - compiled
    kind, params, cutoff2, positions, centre, neighbour, image, offsets, n_owned, split, first,
    last, rows, out,
):  # fmt: skip
    """Edges ``first`` to ``last``: each listed pair's energy and forces into the node-major
    ``rows`` (energy, force: ``(n, 4)``) and its virial (see :func:`pair_forces`),
    summed in registers and put in node 0's columns of ``out``.

    In batches of :data:`PAIR_BATCH` edges, three loops: the edge vectors and
    the pair terms (:func:`_pair_batch`), and the sums into the nodes (zeros
    added for an edge beyond the cutoff or not taken: a branch on the cutoff,
    mispredicted for a fifth of the edges, cost more than the additions).
    32,000 argon atoms: 9.7 ms against 12.7 in one loop. The virial in
    registers, as :func:`_emt_pair_forces` does it, saves twelve memory updates
    a pair (11 % of the evaluation); per-node virials are
    :func:`_pair_forces_per_node`'s, a kernel of its own (a test of which, in
    this loop, cost 12 %).
    """
    closest = np.inf
    # a node's energy is a plain sum of its pairs' halves, see :func:`_add_pair_energy_force`
    vxx = vyy = vzz = vyz = vxz = vxy = 0.0
    current = unsigned(0)  # the centre whose energy and force are summed in registers
    energy = fx = fy = fz = 0.0
    vectors, squares, halves, slopes, both = _batch_buffers()
    for start in range(first, last, PAIR_BATCH):
        n = min(PAIR_BATCH, last - start)
        closest = min(closest, _pair_batch(
            kind, params, cutoff2, positions, centre, neighbour, image, offsets, n_owned,
            split, start, n, vectors, squares, halves, slopes, both,
        ))  # fmt: skip
        for k in range(n):
            i, j = _edge_ends(start + k, centre, neighbour)
            dx, dy, dz = vectors[0, k], vectors[1, k], vectors[2, k]
            half, dpair = halves[k], slopes[k]
            # each end's share: half the energy, the force -+ dE/dd = -+ 2 pair'(r2) d
            # and half of the virial d ⊗ dE/dd. The centre's sums stay in registers
            # while its edges last (a list holds a centre's edges together): its row
            # is written once, not at every edge
            if i != current:
                _add_energy_force(rows, current, energy, fx, fy, fz)
                current = i
                energy = fx = fy = fz = 0.0
            energy += half
            fx += 2.0 * dpair * dx
            fy += 2.0 * dpair * dy
            fz += 2.0 * dpair * dz
            if both[k]:
                _add_pair_energy_force(rows, j, half, -2.0 * dpair, dx, dy, dz)
                dpair *= 2.0
            vxx, vyy, vzz, vyz, vxz, vxy = _virial_step(
                vxx, vyy, vzz, vyz, vxz, vxy, dpair, dx, dy, dz
            )
    _add_energy_force(rows, current, energy, fx, fy, fz)
    _add_total_virial(out, vxx, vyy, vzz, vyz, vxz, vxy)
    return closest


@numba.njit(cache=True, error_model="numpy", fastmath={"contract"})
def _pair_forces_per_node(  # pragma: no cover - compiled
    kind, params, cutoff2, positions, centre, neighbour, image, offsets, n_owned, split, first,
    last, rows, out,
):  # fmt: skip
    """:func:`_pair_forces` with each end's half of a pair's virial in its columns of
    ``rows`` (energy, force, virial: ``(n, 10)``)."""
    closest = np.inf
    vectors, squares, halves, slopes, both = _batch_buffers()
    for start in range(first, last, PAIR_BATCH):
        n = min(PAIR_BATCH, last - start)
        closest = min(closest, _pair_batch(
            kind, params, cutoff2, positions, centre, neighbour, image, offsets, n_owned,
            split, start, n, vectors, squares, halves, slopes, both,
        ))  # fmt: skip
        for k in range(n):
            i, j = _edge_ends(start + k, centre, neighbour)
            dx, dy, dz = vectors[0, k], vectors[1, k], vectors[2, k]
            half, dpair = halves[k], slopes[k]
            _add_pair_end(rows, i, half, 2.0 * dpair, dpair, dx, dy, dz)
            if both[k]:
                _add_pair_end(rows, j, half, -2.0 * dpair, dpair, dx, dy, dz)
    return closest


@numba.njit(cache=True, inline="always")
def _batch_buffers():  # pragma: no cover - compiled
    """A batch of edges' vectors (Å), squared lengths (Å², ``inf`` for an edge not
    taken), each end's half of the pair energy (eV), ``dE/d(r**2)`` (eV/Å²) and
    whether the edge stands for both ends (:func:`_pair_batch`)."""
    return (
        np.empty((3, PAIR_BATCH)),
        np.empty(PAIR_BATCH),
        np.empty(PAIR_BATCH),
        np.empty(PAIR_BATCH),
        np.empty(PAIR_BATCH, np.bool_),
    )


@numba.njit(cache=True, error_model="numpy", inline="always")
def _pair_batch(
    kind, params, cutoff2, positions, centre, neighbour, image, offsets, n_owned, split,
    start, n, vectors, squares, halves, slopes, both,
):  # fmt: skip  # pragma: no cover - compiled
    """The vectors and pair terms of edges ``start`` to ``start + n`` into the batch's
    buffers (:func:`_batch_buffers`); the smallest squared length (Å²) among them.

    Two loops: the edge vectors (gathered from the positions), then the pair terms
    with no branch, so the compiler vectorises it, its division included (an edge
    beyond the cutoff or not taken gets zeros).
    """
    closest = np.inf
    for k in range(n):
        e = start + k
        i, j = _edge_ends(e, centre, neighbour)
        ends = _ends(i, j, unsigned(n_owned), split)
        both[k] = ends == 2
        dx, dy, dz = _edge(e, positions, centre, neighbour, image, offsets)
        vectors[0, k], vectors[1, k], vectors[2, k] = dx, dy, dz
        squares[k] = dx * dx + dy * dy + dz * dz if ends != 0 else np.inf
        closest = min(closest, squares[k])
    for k in range(n):
        pair, dpair = _pair(kind, params, squares[k])
        inside = squares[k] < cutoff2
        halves[k] = 0.5 * pair if inside else 0.0
        slopes[k] = dpair if inside else 0.0
    return closest


@numba.njit(cache=True, error_model="numpy", inline="always")
def _virial_step(vxx, vyy, vzz, vyz, vxz, vxy, c, dx, dy, dz):  # pragma: no cover
    """A virial summed in registers (Voigt), plus ``c d ⊗ d``."""
    return (
        vxx + c * dx * dx,
        vyy + c * dy * dy,
        vzz + c * dz * dz,
        vyz + c * dy * dz,
        vxz + c * dx * dz,
        vxy + c * dx * dy,
    )


@numba.njit(cache=True, error_model="numpy", inline="always")
def _add_total_virial(out, vxx, vyy, vzz, vyz, vxz, vxy):  # pragma: no cover
    """A virial summed in registers into node 0's result columns (none without nodes)."""
    if out.shape[1] == 0:
        return
    out[4, 0] += vxx
    out[5, 0] += vyy
    out[6, 0] += vzz
    out[7, 0] += vyz
    out[8, 0] += vxz
    out[9, 0] += vxy


@numba.njit(cache=True, error_model="numpy", inline="always")
def _add_pair_energy_force(rows, node, energy, force, dx, dy, dz):  # pragma: no cover
    """One end's energy and force ``force d``.

    The energy is a plain sum: a pair's half is small against the node's energy and
    the node's against the total, whose ulp its rounding stays far below. The total
    is summed with compensation (:func:`ase_shard.summation.compensated_row_sums`),
    so it stays the same bits in any order of the edges (32,000 argon atoms, five
    shuffled lists: the same total, per-atom energies within 7e-17 eV). Where one
    node takes hundreds of pairs, its rounding shows: one atom and its ~1,200 images
    in a small cell, listed in two equivalent cells, 4.5e-15 relative (compensated:
    the same bits). Compensating each node's sum took 7 % of the kernel's time.
    """
    _add_energy_force(rows, node, energy, force * dx, force * dy, force * dz)


@numba.njit(cache=True, error_model="numpy", inline="always")
def _add_energy_force(rows, node, energy, fx, fy, fz):  # pragma: no cover - compiled
    """``node``'s energy (eV) and force (eV/Å) added to its sums."""
    rows[node, 0] += energy
    rows[node, 1] += fx
    rows[node, 2] += fy
    rows[node, 3] += fz


@numba.njit(cache=True, error_model="numpy", inline="always")
def _add_node_sums(out, rows):  # pragma: no cover - compiled
    """Node-major sums into the ``(10, n)`` result columns.

    ``(n, 10)``: all ten columns; ``(n, 4)``: energy and force only (the virials
    summed elsewhere).
    """
    for node in range(rows.shape[0]):
        for k in range(rows.shape[1]):
            out[k, node] += rows[node, k]


@numba.njit(cache=True, error_model="numpy", inline="always")
def _add_pair_end(rows, node, energy, force, virial, dx, dy, dz):  # pragma: no cover
    """One end's energy, force ``force d`` and virial ``virial d ⊗ d`` into its sums."""
    _add_pair_energy_force(rows, node, energy, force, dx, dy, dz)
    _add_virial(rows, node, virial, dx, dy, dz)


@numba.njit(cache=True, inline="always")
def _ends(i, j, n_owned, split):  # pragma: no cover - compiled
    """What edge ``(i, j)`` stands for: 0 nothing, 1 its centre's side, 2 both ends.

    A pair of owned nodes is taken once, by its edge with ``i < j`` (a list
    may hold only that one); an edge to an image of its own centre stands for
    itself. An edge to a ghost stands for both ends when ``split`` (its rank
    takes the pair), else for its centre's side (the ghost's owner takes the
    other side).
    """
    if j < n_owned:
        if j < i:
            return 0
        return 1 if j == i else 2
    return 2 if split else 1


@numba.njit(cache=True, inline="always")
def _taken(taken_edges, e):  # pragma: no cover - compiled
    """Edge ``e``'s bit of ``taken_edges`` (eight edges a byte, the first lowest): 0 or 1."""
    return (taken_edges[e >> 3] >> (e & 7)) & 1


@numba.njit(cache=True, inline="always")
def _flush_centre(sums, node, density, density_error, pair, pair_error):  # pragma: no cover
    """A centre's density and pair sums, each with its error, into its columns of ``sums``."""
    add_compensated(sums, 0, node, density, 2)
    sums[2, node] += density_error
    add_compensated(sums, 1, node, pair, 3)
    sums[3, node] += pair_error


@numba.njit(cache=True, error_model="numpy", fastmath={"contract"})
def _emt_exponents(  # pragma: no cover - compiled
    table, rc, acut, beta, cutoff2, numbers, positions, centre, neighbour, image, offsets,
    n_owned, split, mixed, element, start, stop, batch_edges, radii, exponents,
):
    """Pass 1a, edges ``start:stop``: the taken ones (listed and within the cutoff), in order,
    their indices into ``batch_edges``, their lengths into ``radii`` and the exponents of
    their exponentials into the columns of ``exponents``.

    Rows: the cutoff's, the density's and the pair term's seen from the centre;
    with ``mixed`` elements also the pair term's and the density's seen from the
    neighbour. Returns the smallest squared length (Å²) among the listed edges
    and the number of edges taken.

    Two loops: the squared lengths (gathered from the positions), each written
    where the next taken edge goes and kept by counting it (no branch on the
    cutoff, a fifth of the edges in no pattern), then the lengths and
    exponents, which for one element the compiler vectorises (its square roots
    included; in one loop, 7.4 ms of a 32,000-atom pass). Only the edges taken
    go on to the exponentials and the densities' loop (the others' zeros taken
    as well, 32,000 Cu atoms: 26.5-27.1 ms a kernel against 23.7-25.0).
    """
    closest = np.inf
    n_taken = 0
    for e in range(start, stop):
        i, j = _edge_ends(e, centre, neighbour)
        listed = _ends(i, j, unsigned(n_owned), split) != 0
        dx, dy, dz = _edge(e, positions, centre, neighbour, image, offsets)
        r2 = dx * dx + dy * dy + dz * dz
        closest = min(closest, r2 if listed else np.inf)
        radii[n_taken] = r2
        batch_edges[n_taken] = e
        n_taken += listed & (r2 < cutoff2)
    if mixed:
        _mixed_exponents(
            table, rc, acut, beta, numbers, centre, neighbour, n_taken, batch_edges, radii,
            exponents,
        )  # fmt: skip
    else:
        # in registers: the table's entries would be reloaded after every store
        eta2, s0 = table[element, EMT_ETA2], table[element, EMT_S0]
        kappa = table[element, EMT_KAPPA]
        _element_exponents(rc, acut, beta, eta2, s0, kappa, n_taken, radii, exponents)
    return closest, n_taken


@numba.njit(cache=True, error_model="numpy", fastmath={"contract"}, inline="always")
def _element_exponents(
    rc, acut, beta, eta2, s0, kappa, n, radii, exponents
):  # pragma: no cover - compiled
    """:func:`_emt_exponents`' second loop, one element: ``radii`` squared in, lengths out."""
    inverse_beta = 1.0 / beta
    for k in range(n):
        r = math.sqrt(radii[k])
        radii[k] = r
        exponents[0, k] = acut * (r - rc)
        exponents[1, k], exponents[2, k] = _exponents(r, beta, inverse_beta, eta2, s0, kappa)


@numba.njit(cache=True, error_model="numpy", fastmath={"contract"}, inline="always")
def _mixed_exponents(
    table, rc, acut, beta, numbers, centre, neighbour, n, batch_edges, radii, exponents
):  # pragma: no cover - compiled
    """:func:`_emt_exponents`' second loop, mixed elements (each end's parameters)."""
    inverse_beta = 1.0 / beta
    for k in range(n):
        i, j = _edge_ends(batch_edges[k], centre, neighbour)
        zi, zj = numbers[i], numbers[j]
        r = math.sqrt(radii[k])
        radii[k] = r
        exponents[0, k] = acut * (r - rc)
        exponents[1, k], exponents[2, k] = _exponents(
            r, beta, inverse_beta, table[zj, EMT_ETA2], table[zj, EMT_S0], table[zj, EMT_KAPPA]
        )
        exponents[4, k], exponents[3, k] = _exponents(
            r, beta, inverse_beta, table[zi, EMT_ETA2], table[zi, EMT_S0], table[zi, EMT_KAPPA]
        )


@numba.njit(cache=True, error_model="numpy", fastmath={"contract"}, inline="always")
def _exponents(r, beta, inverse_beta, eta2, s0, kappa):  # pragma: no cover - compiled
    """The exponents of an element's density and pair terms at ``r`` (Å)."""
    return -eta2 * (r - beta * s0), -kappa * (r * inverse_beta - s0)


@numba.njit(cache=True, error_model="numpy", fastmath={"contract"})
def _emt_densities(  # pragma: no cover - compiled
    table, acut, beta, numbers, centre, neighbour, n_owned, split, mixed, element, n_taken,
    batch_edges, radii, exponentials, taken, taken_edges, sums, terms,
):
    """Pass 1b, the ``n_taken`` edges :func:`_emt_exponents` took (``batch_edges``, in
    order): densities and pair sums into ``sums`` (4, n); each edge's bit of
    ``taken_edges`` set (:func:`_taken`, for pass 2), its terms into ``terms``
    from row ``taken`` on; returns the next row.

    ``exponentials`` holds :func:`_emt_exponents`'s rows, exponentiated. Rows 0
    and 1 of ``sums`` take the densities and pair sums, rows 2 and 3 their
    rounding errors (:func:`ase_shard.summation.compensated_step`). A centre's
    own terms are summed in registers while its edges follow one another (the
    lists are grouped by centre) and added to ``sums`` once, with their error;
    only the neighbours' ends go to memory edge by edge.
    """
    inverse_n0 = 1.0 / table[:, EMT_N0]  # divisions are slow: one per element, not per edge
    inverse_beta = 1.0 / beta
    eta2_0, kappa_0 = table[element, EMT_ETA2], table[element, EMT_KAPPA]
    halfv_0 = table[element, EMT_NEGHALFV0OVERGAMMA2]
    if n_taken == 0:
        return taken
    current = unsigned(centre[unsigned(batch_edges[0])])  # the centre summed in registers
    density_sum = density_error = pair_sum = pair_error = 0.0
    for k in range(n_taken):
        e = unsigned(batch_edges[k])
        i, j = _edge_ends(e, centre, neighbour)
        if i != current:
            _flush_centre(sums, current, density_sum, density_error, pair_sum, pair_error)
            current = i
            density_sum = density_error = pair_sum = pair_error = 0.0
        taken_edges[e >> 3] |= np.uint8(1) << (e & 7)
        u = exponentials[0, k]
        w = 1.0 / (1.0 + u)
        dw = -acut * u * w * w
        if mixed:
            zi, zj = numbers[i], numbers[j]
            chi = table[zj, EMT_N0] * inverse_n0[zi]
            kappa_i, kappa_j = table[zi, EMT_KAPPA], table[zj, EMT_KAPPA]
            eta2_j = table[zj, EMT_ETA2]
            es = table[zi, EMT_NEGHALFV0OVERGAMMA2] * chi * exponentials[2, k]
        else:  # in registers: the table's entries are reloaded after every store
            zi = zj = element
            chi, kappa_i, kappa_j, eta2_j = 1.0, kappa_0, kappa_0, eta2_0
            es = halfv_0 * exponentials[2, k]
        density = exponentials[1, k] * chi
        if zi == zj:
            eo = es  # chi is 1
        else:
            eo = table[zj, EMT_NEGHALFV0OVERGAMMA2] / chi * exponentials[3, k]
        pair = es + eo
        dpair = (kappa_j * es + kappa_i * eo) * inverse_beta * w
        density_sum, density_error = same_sign_step(density_sum, density_error, density * w)
        pair_sum, pair_error = same_sign_step(pair_sum, pair_error, pair * w)
        inverse_r = 1.0 / radii[k]
        row = unsigned(taken + k)
        terms[row, 0] = density * (dw - eta2_j * w) * inverse_r
        terms[row, 1] = 0.5 * (pair * dw - dpair) * inverse_r
        if _ends(i, j, unsigned(n_owned), split) == 2:
            if zi != zj:
                density = exponentials[4, k] / chi
            add_same_sign(sums, 0, j, density * w, 2)
            add_same_sign(sums, 1, j, pair * w, 3)
            if mixed:
                terms[row, 2] = density * (dw - table[zi, EMT_ETA2] * w) * inverse_r
    _flush_centre(sums, current, density_sum, density_error, pair_sum, pair_error)
    return taken + n_taken


def _emt_energies(
    table: np.ndarray,
    beta: float,
    numbers: np.ndarray,
    sums: np.ndarray,
    nodes: np.ndarray,
    out: np.ndarray,
    dcohesive: np.ndarray,
) -> None:
    """The energies of the owned ``nodes`` into ``out`` and their ``dE/dsigma1`` (none
    without neighbours).

    The energy's terms (several eV each, for an energy near zero) are added
    with their rounding errors, as are the sums they come from. The logarithm
    and the two exponentials of each node by numpy's vectorised functions,
    between compiled loops (one at a time in one loop: 0.77 ms at 32,000 Cu
    atoms, against 0.42).
    """
    values = np.empty((3, len(nodes)))
    _emt_energy_logs(table, numbers, sums, nodes, values[0])
    np.log(values[0], out=values[0])
    _emt_energy_exponents(table, beta, numbers, nodes, values)
    np.exp(values[1:], out=values[1:])
    _emt_energy_sums(table, beta, numbers, sums, nodes, values, out, dcohesive)


@numba.njit(cache=True, error_model="numpy", fastmath={"contract"})
def _emt_energy_logs(table, numbers, sums, nodes, arguments):  # pragma: no cover
    """The argument of each node's logarithm (1 for a node without neighbours)."""
    for k in range(len(nodes)):
        i = nodes[k]
        density = sums[0, i] + sums[2, i]
        arguments[k] = density * table[numbers[i], EMT_INV12GAMMA1] if density > 0.0 else 1.0


@numba.njit(cache=True, error_model="numpy", fastmath={"contract"})
def _emt_energy_exponents(table, beta, numbers, nodes, values):  # pragma: no cover
    """Row 0 of ``values`` (logarithms) in, each node's ``ds`` and the exponents of its
    two exponentials out (rows 0, 1 and 2)."""
    for k in range(len(nodes)):
        z = numbers[nodes[k]]
        ds = -values[0, k] / (beta * table[z, EMT_ETA2])
        values[0, k] = ds
        values[1, k] = -table[z, EMT_LAMBDA] * ds
        values[2, k] = -table[z, EMT_KAPPA] * ds


@numba.njit(cache=True, error_model="numpy", fastmath={"contract"})
def _emt_energy_sums(
    table, beta, numbers, sums, nodes, values, out, dcohesive
):  # fmt: skip  # pragma: no cover - compiled
    """:func:`_emt_energies`' last loop: the energies and ``dE/dsigma1`` from ``values``."""
    for k in range(len(nodes)):
        i = nodes[k]
        z = numbers[i]
        energy, error = compensated_step(0.5 * sums[1, i], 0.5 * sums[3, i], -table[z, EMT_E0])
        density = sums[0, i] + sums[2, i]
        if density > 0.0:
            e0, lmbda, kappa = table[z, EMT_E0], table[z, EMT_LAMBDA], table[z, EMT_KAPPA]
            scale = beta * table[z, EMT_ETA2]
            ds = values[0, k]
            lambda_term = values[1, k]
            kappa_term = 6.0 * table[z, EMT_V0] * values[2, k]
            energy, error = compensated_step(energy, error, e0 * (1.0 + lmbda * ds) * lambda_term)
            energy, error = compensated_step(energy, error, kappa_term)
            dcohesive_dds = -e0 * lmbda * lmbda * ds * lambda_term - kappa * kappa_term
            dcohesive[i] = -dcohesive_dds / (scale * density)
        out[0, i] += energy + error


@numba.njit(cache=True, error_model="numpy", fastmath={"contract"})
def _emt_pair_forces(  # pragma: no cover - compiled
    positions, centre, neighbour, image, offsets, n_owned, split, taken_edges, terms,
    dcohesive, first, last, taken, rows, out,
):
    """Pass 2, edges ``first`` to ``last``: forces and virials of the pairs taken in pass 1,
    once ``dcohesive`` is known, into the node-major ``rows`` (``(n, 10)`` with the
    virials per node, else ``(n, 4)``) and ``out``; ``taken``: the first of them in
    ``terms``, the next one returned.

    Every edge is walked: one not taken (``taken_edges``, from pass 1) adds
    zeros (a branch on the cutoff, here as in pass 1, cost more than its
    additions).

    ``dE_i/dd = c d`` gives ``+c d`` to ``i``, ``-c d`` to ``j`` and ``c d ⊗ d``
    halved to each; a pair taken for both ends adds the reverse edge's ``c`` (its
    density term is column 2 of ``terms``, or column 0 for one element).
    Without the virials per node they are summed in registers and put in node
    0's columns of ``out``: twelve memory updates a pair fewer (a quarter of
    this pass on 32,000 Cu atoms), the same column sums.
    """
    per_node_virials = rows.shape[1] == 10
    reverse = 2 if terms.shape[1] == 3 else 0  # the reverse edge's density term
    vxx = vyy = vzz = vyz = vxz = vxy = 0.0  # the virial, when not per node
    taken = unsigned(taken)
    for e in range(first, last):
        i, j = _edge_ends(e, centre, neighbour)
        dx, dy, dz = _edge(e, positions, centre, neighbour, image, offsets)
        # an edge not taken reads the next one's row (or the spare) and drops it
        c = dcohesive[i] * terms[taken, 0] + terms[taken, 1]
        if _ends(i, j, unsigned(n_owned), split) == 2:
            c += dcohesive[j] * terms[taken, reverse] + terms[taken, 1]
        taken_edge = _taken(taken_edges, e)
        c = c if taken_edge else 0.0
        taken += unsigned(taken_edge)
        rows[i, 1] += c * dx
        rows[i, 2] += c * dy
        rows[i, 3] += c * dz
        rows[j, 1] -= c * dx
        rows[j, 2] -= c * dy
        rows[j, 3] -= c * dz
        if per_node_virials:
            _add_virial(rows, i, 0.5 * c, dx, dy, dz)
            _add_virial(rows, j, 0.5 * c, dx, dy, dz)
        else:
            vxx, vyy, vzz, vyz, vxz, vxy = _virial_step(
                vxx, vyy, vzz, vyz, vxz, vxy, c, dx, dy, dz
            )
    if not per_node_virials:
        _add_total_virial(out, vxx, vyy, vzz, vyz, vxz, vxy)
    return taken
