"""Compiled CPU kernel of DFT-D3 dispersion: energies, forces and virials (numba).

The formulas are those of :class:`ase_shard.models.D3` (see its module), with
their derivatives written out; the block's edges, result columns and halo are
those of :class:`ase_shard.graph.DirectForces`. D3 has two stages, so the
kernel runs in passes with two halo exchanges between them:

1. coordination numbers: every owned node's ``CN`` from its edges within the
   CN cutoff; the ghosts' come from their owners (``copy_owner_columns``);
2. per node, the Gaussian reference weights ``w`` and ``dw/dCN``, and the
   node's C6 towards each element present summed over its own references
   (``C6_ij`` is then one sum over ``j``'s references, as in the torch model);
3. pairs: energy, the force and virial of ``dE/dd``, and ``dE/dCN`` of both
   ends through ``C6_ij``;
4. three-body (ATM) triangles, when ``s9 != 0``: at each owned centre, every
   two of its edges within the ATM cutoff whose third side is too, from the
   edges grouped by centre (built per call, one counting sort); energy, forces
   and virials on the corner's two edges (as autograd puts them), ``dE/dCN``
   of the three corners. A triangle of three different atoms is taken once,
   for its three corners;
5. the ghosts' ``dE/dCN`` summed into their owners (``sum_ghost_columns``),
   then the forces and virials of ``dE/dCN dCN/dd`` over the CN edges.

The edges are every edge centred on an owned node: a pair of owned nodes is
taken once, from its edge with ``i < j`` (:func:`ase_shard.kernels._ends`
without a split), for its pair energy and both ends' coordination numbers. A
triangle of three different atoms is taken once in the whole system, at its
corner with the lowest atom index (``EdgeList.ids``), by the rank that owns
that corner; what it gives a corner on another rank (energy, forces, virial,
``dE/dCN``) goes to that corner's ghost columns, which the block and pass 5
sum into the owner, so that two ranks share the triangles as they share the
atoms. A triangle with two images of one atom is taken at each corner, for
that corner. Each edge's ``dE/dd`` is split
between its ends' virials as the autograd path splits it
(:func:`ase_shard.block.sum_edge_gradients`), so per-atom virials agree too.
Lengths are in bohr and energies in Hartree inside, eV and Å out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numba
import numpy as np
from ase.units import Bohr, Hartree

from ase_shard.graph import EdgeList
from ase_shard.kernels import _add_node_sums, _arrays, _edge, _ends
from ase_shard.summation import compensated_row_sums

# D3's constants (ase_shard.models.d3 takes them from here)
COUNTING_STEEPNESS = 16.0  # s-dftd3's kcn
WEIGHTING_FACTOR = 4.0  # s-dftd3's wf, the Gaussian's width in CN
ATM_RADIUS_SCALE = 4.0 / 3.0  # s-dftd3's rs9

# damping forms
BJ, ZERO = 0, 1


@dataclass(frozen=True)
class D3Parameters:
    """A :class:`~ase_shard.models.D3`'s tables and parameters, as numpy arrays.

    Attributes
    ----------
    reference_cn : (Z, ref) float64 array
        Reference coordination numbers per atomic number (missing references: -1).
    reference_c6 : (Z, Z, ref, ref) float64 array
        Reference C6 coefficients, Hartree bohr^6.
    r4r2 : (Z,) float64 array
    covalent_radius : (Z,) float64 array
        bohr.
    vdw_radius : (Z, Z) float64 array
        Pairwise van der Waals radii, bohr.
    damping : int
        :data:`BJ` or :data:`ZERO`.
    s6, s8, s9, a1, a2, rs6, rs8, alp : float
        Damping parameters (those a damping does not use are 0).
    pair_cutoff, cn_cutoff, atm_cutoff : float
        Å.
    """

    reference_cn: np.ndarray
    reference_c6: np.ndarray
    r4r2: np.ndarray
    covalent_radius: np.ndarray
    vdw_radius: np.ndarray
    damping: int
    s6: float
    s8: float
    s9: float
    a1: float
    a2: float
    rs6: float
    rs8: float
    alp: float
    pair_cutoff: float
    cn_cutoff: float
    atm_cutoff: float


def d3_forces(params: D3Parameters, edges: EdgeList, out: np.ndarray) -> float:
    """Add D3's per-node energies, forces and virials to ``out``.

    Parameters
    ----------
    params : D3Parameters
    edges : EdgeList
        Every edge centred on an owned node (both directions between two of
        them). With ghost nodes, ``edges.halo`` must be given: the ghosts'
        coordination numbers come from their owners through it.
    out : (10, n_nodes) float64 array
        Per-node energy (eV), force (eV/Å, 3 rows) and virial (eV, Voigt xx yy
        zz yz xz xy), added to; a ghost's columns belong to its owner. Without
        ``edges.per_node_virials``, the virial's sum goes to node 0's columns alone.

    Returns
    -------
    float
        The smallest squared length (Å²) among all listed edges (``inf`` for none).
    """
    numbers = np.ascontiguousarray(edges.numbers, dtype=np.int64)
    n_nodes, n_owned, halo = len(numbers), edges.n_owned, edges.halo
    ids = np.arange(n_nodes) if edges.ids is None else np.asarray(edges.ids, dtype=np.int64)
    if halo is None and n_nodes > n_owned:
        raise ValueError("D3's kernel needs the halo (EdgeList.halo) for its ghost nodes")
    arrays = _arrays(edges)
    # the elements present, renumbered 0..S-1, and only their references
    present = np.zeros(len(params.reference_cn), dtype=bool)
    present[numbers] = True
    species = np.flatnonzero(present)
    kind = np.cumsum(present)[numbers] - 1
    valid = params.reference_cn[species] >= 0.0
    n_refs = int(valid.any(axis=0).nonzero()[0].max(initial=-1)) + 1
    reference_cn = np.ascontiguousarray(params.reference_cn[species, :n_refs])
    reference_c6 = np.ascontiguousarray(
        params.reference_c6[np.ix_(species, species)][:, :, :n_refs, :n_refs]
    )
    cutoffs = np.array([params.pair_cutoff, params.cn_cutoff, params.atm_cutoff]) / Bohr
    damping = np.array(
        [params.s6, params.s8, params.s9, params.a1, params.a2, params.rs6, params.rs8, params.alp]
    )

    cn = np.zeros((1, n_nodes))
    closest = _coordination_numbers(
        params.covalent_radius, cutoffs, edges.cutoff**2, numbers, *arrays, n_owned, cn[0]
    )
    if halo is not None:
        halo.copy_owner_columns(cn)
    weights, dweights, c6, dc6 = _node_c6(reference_cn, reference_c6, kind, cn[0])
    rows = np.zeros((n_nodes, 10))  # one node's sums together, as in the other kernels
    dcn = np.zeros((1, n_nodes))  # dE/dCN, Hartree
    _pairs(
        params.r4r2, params.vdw_radius, params.damping, damping, cutoffs, edges.cutoff**2,
        numbers, kind, weights, dweights, c6, dc6, *arrays, n_owned, rows, dcn[0],
    )  # fmt: skip
    if params.s9 != 0.0:
        start, listed = _centre_groups(cutoffs[2], edges.cutoff**2, *arrays, n_owned)
        _triangles(
            params.vdw_radius, damping, cutoffs[2], numbers, ids, kind, weights, dweights, c6,
            dc6, *arrays, start, listed, rows, dcn[0],
        )  # fmt: skip
    if halo is not None:
        halo.sum_ghost_columns(dcn)
    _coordination_forces(
        params.covalent_radius, cutoffs, edges.cutoff**2, numbers, *arrays, n_owned, dcn[0], rows
    )
    if edges.per_node_virials:
        _add_node_sums(out, rows)
    else:
        # only the virial's sum is wanted, in node 0's columns (DirectForces): a
        # compensated sum over the nodes, correctly rounded
        _add_node_sums(out, rows[:, :4])
        if n_nodes:
            pairs = compensated_row_sums(rows[:, 4:].T)
            out[4:, 0] += pairs[:, 0] + pairs[:, 1]
    return closest


@numba.njit(cache=True, error_model="numpy", inline="always")
def _count(covalent_radius, zi, zj, r):  # pragma: no cover - compiled
    """The counting function of a pair ``r`` bohr apart and its derivative (1/bohr)."""
    rc = covalent_radius[zi] + covalent_radius[zj]
    count = 1.0 / (1.0 + math.exp(-COUNTING_STEEPNESS * (rc / r - 1.0)))
    return count, -count * (1.0 - count) * COUNTING_STEEPNESS * rc / (r * r)


@numba.njit(cache=True, error_model="numpy")
def _coordination_numbers(  # pragma: no cover - compiled
    covalent_radius,
    cutoffs,
    cutoff2,
    numbers,
    positions,
    centre,
    neighbour,
    image,
    offsets,
    n_owned,
    cn,
):
    """Pass 1: the owned nodes' coordination numbers into ``cn``; the shortest edge (Å²)."""
    closest = np.inf
    for e in range(centre.shape[0]):
        i, j = centre[e], neighbour[e]
        dx, dy, dz = _edge(e, positions, centre, neighbour, image, offsets)
        r2 = dx * dx + dy * dy + dz * dz
        closest = min(closest, r2)
        ends = _ends(i, j, n_owned, False)
        if ends == 0 or r2 >= cutoff2:
            continue
        r = math.sqrt(r2) / Bohr
        if r > cutoffs[1]:
            continue
        count, _ = _count(covalent_radius, numbers[i], numbers[j], r)
        cn[i] += count
        if ends == 2:
            cn[j] += count
    return closest


@numba.njit(cache=True, error_model="numpy")
def _node_c6(reference_cn, reference_c6, kind, cn):  # pragma: no cover - compiled
    """Pass 2: every node's reference weights and its C6 towards each element present.

    Returns ``w``, ``dw/dCN`` (n, ref), and ``c6[n, s, b] = sum_a w[n, a]
    C6ref[kind n, s, a, b]`` with its derivative w.r.t. ``CN_n`` (n, S, ref).
    The Gaussians are shifted by their largest exponent before normalising, as
    in the torch model (no underflow far above every reference).
    """
    n, n_species, n_refs = cn.shape[0], reference_c6.shape[0], reference_cn.shape[1]
    weights = np.zeros((n, n_refs))
    dweights = np.zeros((n, n_refs))
    c6 = np.zeros((n, n_species, n_refs))
    dc6 = np.zeros((n, n_species, n_refs))
    exponent = np.empty(n_refs)
    for node in range(n):
        s = kind[node]
        largest = -np.inf
        for a in range(n_refs):
            exponent[a] = -np.inf
            if reference_cn[s, a] >= 0.0:
                delta = reference_cn[s, a] - cn[node]
                exponent[a] = -WEIGHTING_FACTOR * delta * delta
                largest = max(largest, exponent[a])
        norm = 0.0
        for a in range(n_refs):
            weights[node, a] = math.exp(exponent[a] - largest)
            norm += weights[node, a]
        # dw_a/dCN = w_a (g_a - sum_b w_b g_b), g_a = d(exponent_a)/dCN
        mean_slope = 0.0
        for a in range(n_refs):
            weights[node, a] /= norm
            if weights[node, a] > 0.0:
                mean_slope += (
                    weights[node, a] * 2.0 * WEIGHTING_FACTOR * (reference_cn[s, a] - cn[node])
                )
        for a in range(n_refs):
            if weights[node, a] > 0.0:
                slope = 2.0 * WEIGHTING_FACTOR * (reference_cn[s, a] - cn[node])
                dweights[node, a] = weights[node, a] * (slope - mean_slope)
        for t in range(n_species):
            for a in range(n_refs):
                w, dw = weights[node, a], dweights[node, a]
                for b in range(n_refs):
                    c6[node, t, b] += w * reference_c6[s, t, a, b]
                    dc6[node, t, b] += dw * reference_c6[s, t, a, b]
    return weights, dweights, c6, dc6


@numba.njit(cache=True, error_model="numpy", inline="always")
def _pair_c6(kind, weights, dweights, c6, dc6, i, j):  # pragma: no cover - compiled
    """``C6_ij`` (Hartree bohr^6) and its derivatives w.r.t. ``CN_i`` and ``CN_j``."""
    t = kind[j]
    value = dvalue_i = dvalue_j = 0.0
    for b in range(weights.shape[1]):
        value += c6[i, t, b] * weights[j, b]
        dvalue_i += dc6[i, t, b] * weights[j, b]
        dvalue_j += c6[i, t, b] * dweights[j, b]
    return value, dvalue_i, dvalue_j


@numba.njit(cache=True, error_model="numpy", inline="always")
def _pair_kernel(r4r2, vdw_radius, damping, p, zi, zj, r):  # pragma: no cover - compiled
    """Pair energy per unit C6 (1/bohr^6) at ``r`` bohr and its derivative (1/bohr^7)."""
    s6, s8 = p[0], p[1]
    q = 3.0 * r4r2[zi] * r4r2[zj]
    r2 = r * r
    r6 = r2 * r2 * r2
    r8 = r6 * r2
    if damping == BJ:
        radius = p[3] * math.sqrt(q) + p[4]
        radius2 = radius * radius
        radius6 = radius2 * radius2 * radius2
        f6 = 1.0 / (r6 + radius6)
        f8 = 1.0 / (r8 + radius6 * radius2)
        value = -(s6 * f6 + s8 * q * f8)
        return value, s6 * 6.0 * r6 / r * f6 * f6 + s8 * q * 8.0 * r8 / r * f8 * f8
    alp = p[7]
    radius = vdw_radius[zi, zj]
    u6 = 6.0 * (p[5] * radius / r) ** alp
    u8 = 6.0 * (p[6] * radius / r) ** (alp + 2.0)
    f6 = 1.0 / (1.0 + u6)
    f8 = 1.0 / (1.0 + u8)
    # d(f_n / r^n)/dr = f_n / r^n (alpha_n u_n f_n - n) / r
    term6 = s6 * f6 / r6
    term8 = s8 * q * f8 / r8
    value = -(term6 + term8)
    dvalue = -(term6 * (alp * u6 * f6 - 6.0) + term8 * ((alp + 2.0) * u8 * f8 - 8.0)) / r
    return value, dvalue


@numba.njit(cache=True, error_model="numpy", inline="always")
def _add_edge_vector_gradient(rows, i, j, gx, gy, gz, dx, dy, dz):  # pragma: no cover
    """An edge's ``dE/dd = g`` (eV/Å): ``+-g`` on its ends, half of ``sym(d ⊗ g)`` each."""
    rows[i, 1] += gx
    rows[i, 2] += gy
    rows[i, 3] += gz
    rows[j, 1] -= gx
    rows[j, 2] -= gy
    rows[j, 3] -= gz
    xx, yy, zz = 0.5 * dx * gx, 0.5 * dy * gy, 0.5 * dz * gz
    yz, xz, xy = 0.25 * (dy * gz + dz * gy), 0.25 * (dx * gz + dz * gx), 0.25 * (dx * gy + dy * gx)
    for node in (i, j):
        rows[node, 4] += xx
        rows[node, 5] += yy
        rows[node, 6] += zz
        rows[node, 7] += yz
        rows[node, 8] += xz
        rows[node, 9] += xy


@numba.njit(cache=True, error_model="numpy")
def _pairs(  # pragma: no cover - compiled
    r4r2,
    vdw_radius,
    damping,
    p,
    cutoffs,
    cutoff2,
    numbers,
    kind,
    weights,
    dweights,
    c6,
    dc6,
    positions,
    centre,
    neighbour,
    image,
    offsets,
    n_owned,
    rows,
    dcn,
):
    """Pass 3: pair energies, their forces and virials, and dE/dCN of both ends.

    A pair taken for both ends gives each half its energy; an edge that stands
    for its centre's side only (to a ghost, or to its centre's own image)
    gives its centre half, and half the derivatives.
    """
    # eV/Å per Hartree/bohr, over the length of d (Å) turned into bohr
    scale = Hartree / (Bohr * Bohr)
    for e in range(centre.shape[0]):
        i, j = centre[e], neighbour[e]
        ends = _ends(i, j, n_owned, False)
        if ends == 0:
            continue
        dx, dy, dz = _edge(e, positions, centre, neighbour, image, offsets)
        r2 = dx * dx + dy * dy + dz * dz
        if r2 >= cutoff2:
            continue
        r = math.sqrt(r2) / Bohr
        if r > cutoffs[0]:
            continue
        value, dvalue = _pair_kernel(r4r2, vdw_radius, damping, p, numbers[i], numbers[j], r)
        pair_c6, dc6_i, dc6_j = _pair_c6(kind, weights, dweights, c6, dc6, i, j)
        share = 1.0 if ends == 2 else 0.5  # of the pair energy this edge stands for
        energy = 0.5 * pair_c6 * value * Hartree
        rows[i, 0] += energy
        if ends == 2:
            rows[j, 0] += energy
        dcn[i] += share * value * dc6_i
        dcn[j] += share * value * dc6_j
        c = share * pair_c6 * dvalue * scale / r  # dE/dd = c d
        _add_edge_vector_gradient(rows, i, j, c * dx, c * dy, c * dz, dx, dy, dz)


@numba.njit(cache=True, error_model="numpy")
def _centre_groups(  # pragma: no cover - compiled
    atm_cutoff, cutoff2, positions, centre, neighbour, image, offsets, n_owned
):
    """The edges within the ATM cutoff grouped by centre: ``listed[start[i]:start[i + 1]]``."""
    start = np.zeros(n_owned + 1, dtype=np.int64)
    within = np.zeros(centre.shape[0], dtype=np.bool_)  # a byte an edge: no second sqrt
    for e in range(centre.shape[0]):
        dx, dy, dz = _edge(e, positions, centre, neighbour, image, offsets)
        r2 = dx * dx + dy * dy + dz * dz
        if r2 < cutoff2 and math.sqrt(r2) / Bohr <= atm_cutoff:
            within[e] = True
            start[centre[e] + 1] += 1
    for i in range(n_owned):
        start[i + 1] += start[i]
    listed = np.empty(start[n_owned], dtype=np.int64)
    filled = start[:n_owned].copy()
    for e in range(centre.shape[0]):
        if within[e]:
            listed[filled[centre[e]]] = e
            filled[centre[e]] += 1
    return start, listed


@numba.njit(cache=True, error_model="numpy")
def _triangles(  # pragma: no cover - compiled
    vdw_radius, p, atm_cutoff, numbers, ids, kind, weights, dweights, c6, dc6, positions,
    centre, neighbour, image, offsets, start, listed, rows, dcn,
):  # fmt: skip
    """Pass 4: ATM energies, forces and virials, and dE/dCN of the three corners.

    At centre ``i``, every two edges ``(i, j)``, ``(i, k)`` of its group whose
    third side ``j-k`` is within the cutoff give ``i`` a third of the
    triangle's energy, and its derivatives to those two edges (the torch
    model's ordered pairs, a sixth each, add up to the same). A triangle of
    three different nodes (atoms) is taken once instead, at its atom of
    lowest ``ids``, for every corner: each corner's third and its derivatives
    on that corner's two edges, as the corner would take them (its edges to
    ``i`` are ``i``'s reversed; the edge ``j-k`` is added directly), a ghost
    corner's in its ghost columns. A centre's edges (vectors,
    C6) are gathered once, and each edge's dE/dd and its far end's energy and
    dE/dCN summed over the centre's triangles before they reach the rows.
    """
    s9, exponent = p[2], (p[7] + 2.0) / 3.0
    inside = atm_cutoff * atm_cutoff
    radius_scale = ATM_RADIUS_SCALE * ATM_RADIUS_SCALE * ATM_RADIUS_SCALE
    third = 1.0 / 3.0
    n_centres = start.shape[0] - 1
    largest = 0
    for i in range(n_centres):
        largest = max(largest, start[i + 1] - start[i])
    # per edge of the centre: vector (bohr), r^2, far end, C6 and its two derivatives;
    # then the sums over triangles: dE/dd (Hartree/bohr) and the far end's dE/dCN
    vector = np.empty((largest, 3))
    length2 = np.empty(largest)
    far = np.empty(largest, dtype=np.int64)
    pair_c6 = np.empty((largest, 3))
    gradient = np.empty((largest, 3))
    far_dcn = np.empty(largest)
    far_energy = np.empty(largest)
    for i in range(n_centres):
        zi = numbers[i]
        m = start[i + 1] - start[i]
        for a in range(m):
            e = listed[start[i] + a]
            dx, dy, dz = _edge(e, positions, centre, neighbour, image, offsets)
            vector[a, 0], vector[a, 1], vector[a, 2] = dx / Bohr, dy / Bohr, dz / Bohr
            length2[a] = vector[a, 0] ** 2 + vector[a, 1] ** 2 + vector[a, 2] ** 2
            far[a] = neighbour[e]
            pair_c6[a, 0], pair_c6[a, 1], pair_c6[a, 2] = _pair_c6(
                kind, weights, dweights, c6, dc6, i, far[a]
            )
            gradient[a, 0] = gradient[a, 1] = gradient[a, 2] = 0.0
            far_dcn[a] = far_energy[a] = 0.0
        energy_i = dcn_i = 0.0
        for a in range(m):
            j, zj = far[a], numbers[far[a]]
            xij, yij, zij = vector[a, 0], vector[a, 1], vector[a, 2]
            r2_ij = length2[a]
            c6_ij = pair_c6[a, 0]
            for b in range(a + 1, m):
                k, zk = far[b], numbers[far[b]]
                whole = j != k and j != i and k != i
                if whole and (ids[j] < ids[i] or ids[k] < ids[i]):
                    continue  # the corner of lowest atom index takes the whole triangle
                xjk, yjk, zjk = vector[b, 0] - xij, vector[b, 1] - yij, vector[b, 2] - zij
                r2_jk = xjk * xjk + yjk * yjk + zjk * zjk
                if r2_jk > inside:
                    continue
                r2_ik = length2[b]
                c6_ik = pair_c6[b, 0]
                c6_jk, dc6_jk_j, dc6_jk_k = _pair_c6(kind, weights, dweights, c6, dc6, j, k)
                c9 = math.sqrt(abs(c6_ij * c6_ik * c6_jk))
                radius = radius_scale * (
                    vdw_radius[zi, zj] * vdw_radius[zi, zk] * vdw_radius[zj, zk]
                )
                r2 = r2_ij * r2_ik * r2_jk
                r1 = math.sqrt(r2)
                r3 = r2 * r1
                u = 6.0 * (radius / r1) ** exponent
                damp = 1.0 / (1.0 + u)
                sa = r2_ij + r2_jk - r2_ik
                sb = r2_ij - r2_jk + r2_ik
                sc = -r2_ij + r2_jk + r2_ik
                product = sa * sb * sc
                inverse5 = 1.0 / (r3 * r2)
                angular = 0.375 * product * inverse5 + 1.0 / r3
                energy = third * s9 * c9 * angular * damp  # the centre's third
                energy_i += energy
                # d(angular)/d(r2_xy) = 0.375 dP/dr2_xy / r^5 + dangular/dX X / r2_xy,
                # X = r2_ij r2_ik r2_jk; d(damp)/d(r2_xy) likewise through X
                scale = third * s9 * c9
                through_x = (-2.5 * 0.375 * product * inverse5 - 1.5 / r3) * damp
                through_x += angular * 0.5 * exponent * u * damp * damp
                bc, ac, ab = sb * sc, sa * sc, sa * sb
                d_ij = scale * (0.375 * (bc + ac - ab) * inverse5 * damp + through_x / r2_ij)
                d_ik = scale * (0.375 * (-bc + ac + ab) * inverse5 * damp + through_x / r2_ik)
                d_jk = scale * (0.375 * (bc - ac + ab) * inverse5 * damp + through_x / r2_jk)
                # dE/dC6 = E / (2 C6) through c9, of one corner's third or of all three
                de = 1.5 * energy if whole else 0.5 * energy
                dcn_i += de * (pair_c6[a, 1] / c6_ij + pair_c6[b, 1] / c6_ik)
                far_dcn[a] += de * (pair_c6[a, 2] / c6_ij + dc6_jk_j / c6_jk)
                far_dcn[b] += de * (pair_c6[b, 2] / c6_ik + dc6_jk_k / c6_jk)
                # i's third: dE/dd_ij = 2 d_ij v_ij - 2 d_jk v_jk, dE/dd_ik = 2 d_ik v_ik
                # + 2 d_jk v_jk (each d the derivative of a third w.r.t. a squared side)
                xik, yik, zik = vector[b, 0], vector[b, 1], vector[b, 2]
                if not whole:
                    gradient[a, 0] += 2.0 * (d_ij * xij - d_jk * xjk)
                    gradient[a, 1] += 2.0 * (d_ij * yij - d_jk * yjk)
                    gradient[a, 2] += 2.0 * (d_ij * zij - d_jk * zjk)
                    gradient[b, 0] += 2.0 * (d_ik * xik + d_jk * xjk)
                    gradient[b, 1] += 2.0 * (d_ik * yik + d_jk * yjk)
                    gradient[b, 2] += 2.0 * (d_ik * zik + d_jk * zjk)
                    continue
                # with j's (dE/dd_ji = 2 d_ij v_ji - 2 d_ik v_ik, dE/dd_jk = 2 d_jk v_jk +
                # 2 d_ik v_ik) and k's (dE/dd_ki = 2 d_ik v_ki - 2 d_ij v_ij, dE/dd_kj =
                # 2 d_jk v_kj + 2 d_ij v_ij) thirds; edge (j, i) is edge (i, j) with -dE/dd
                far_energy[a] += energy
                far_energy[b] += energy
                gradient[a, 0] += 4.0 * d_ij * xij - 2.0 * d_jk * xjk + 2.0 * d_ik * xik
                gradient[a, 1] += 4.0 * d_ij * yij - 2.0 * d_jk * yjk + 2.0 * d_ik * yik
                gradient[a, 2] += 4.0 * d_ij * zij - 2.0 * d_jk * zjk + 2.0 * d_ik * zik
                gradient[b, 0] += 4.0 * d_ik * xik + 2.0 * d_jk * xjk + 2.0 * d_ij * xij
                gradient[b, 1] += 4.0 * d_ik * yik + 2.0 * d_jk * yjk + 2.0 * d_ij * yij
                gradient[b, 2] += 4.0 * d_ik * zik + 2.0 * d_jk * zjk + 2.0 * d_ij * zij
                g = Hartree / Bohr
                _add_edge_vector_gradient(
                    rows, j, k,
                    g * (4.0 * d_jk * xjk + 2.0 * d_ik * xik - 2.0 * d_ij * xij),
                    g * (4.0 * d_jk * yjk + 2.0 * d_ik * yik - 2.0 * d_ij * yij),
                    g * (4.0 * d_jk * zjk + 2.0 * d_ik * zik - 2.0 * d_ij * zij),
                    xjk * Bohr, yjk * Bohr, zjk * Bohr,
                )  # fmt: skip
        rows[i, 0] += energy_i * Hartree
        dcn[i] += dcn_i
        for a in range(m):
            dcn[far[a]] += far_dcn[a]
            rows[far[a], 0] += far_energy[a] * Hartree
            # eV/Å on the edge's vector in Å
            g = Hartree / Bohr
            _add_edge_vector_gradient(
                rows, i, far[a], g * gradient[a, 0], g * gradient[a, 1], g * gradient[a, 2],
                vector[a, 0] * Bohr, vector[a, 1] * Bohr, vector[a, 2] * Bohr,
            )  # fmt: skip


@numba.njit(cache=True, error_model="numpy")
def _coordination_forces(  # pragma: no cover - compiled
    covalent_radius,
    cutoffs,
    cutoff2,
    numbers,
    positions,
    centre,
    neighbour,
    image,
    offsets,
    n_owned,
    dcn,
    rows,
):
    """Pass 5: the forces and virials of ``dE/dCN dCN/dd`` (``dcn`` complete on owned nodes)."""
    scale = Hartree / (Bohr * Bohr)
    for e in range(centre.shape[0]):
        i, j = centre[e], neighbour[e]
        ends = _ends(i, j, n_owned, False)
        if ends == 0:
            continue
        dx, dy, dz = _edge(e, positions, centre, neighbour, image, offsets)
        r2 = dx * dx + dy * dy + dz * dz
        if r2 >= cutoff2:
            continue
        r = math.sqrt(r2) / Bohr
        if r > cutoffs[1]:
            continue
        _, dcount = _count(covalent_radius, numbers[i], numbers[j], r)
        weight = dcn[i] + dcn[j] if ends == 2 else dcn[i]
        c = weight * dcount * scale / r  # dE/dd = c d
        _add_edge_vector_gradient(rows, i, j, c * dx, c * dy, c * dz, dx, dy, dz)
