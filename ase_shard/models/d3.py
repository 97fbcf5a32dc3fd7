"""Grimme's DFT-D3 dispersion, matching the ``dftd3`` package's ASE calculator (s-dftd3).

The energy is s-dftd3's real-space sum, term by term:

- coordination numbers ``CN_i = sum_j 1 / (1 + exp(-16 (rc_ij / r_ij - 1)))`` over the
  pairs within ``cn_cutoff``, ``rc_ij`` the sum of the two D3 covalent radii (Pyykkö's,
  scaled by 4/3);
- ``C6_ij = sum_ab w_ia w_jb C6ref[Z_i, Z_j, a, b]``, the reference weights a Gaussian
  ``exp(-4 (CN_i - CNref_a)^2)`` normalised over the element's references;
- the pair energy ``-C6_ij (s6 f6(r) + s8 q_ij f8(r))``, ``q_ij = 3 r4r2_i r4r2_j``
  (``C8 = q C6``) within ``cutoff``, with rational (Becke-Johnson) damping
  ``f_n = 1 / (r^n + R0^n)``, ``R0 = a1 sqrt(q_ij) + a2``, or zero damping
  ``f_n = 1 / (r^n (1 + 6 (rs_n R0_ij / r)^alpha_n))``, ``R0_ij`` the pairwise van der
  Waals radii, ``alpha_6 = alp``, ``alpha_8 = alp + 2``, ``rs_8 = 1``;
- with ``atm=True``, the Axilrod-Teller-Muto three-body term of every triangle whose
  three sides lie within ``atm_cutoff``: ``s9 sqrt(C6_ij C6_ik C6_jk)
  (3 cos_i cos_j cos_k + 1) / (r_ij r_ik r_jk)^3`` damped by
  ``1 / (1 + 6 (R0_ijk / (r_ij r_ik r_jk))^((alp + 2) / 3))``, ``R0_ijk`` the product
  of the three pairwise van der Waals radii scaled by 4/3, for either damping.

The reference C6 table, reference coordination numbers, r4/r2 values, covalent and
pairwise van der Waals radii come from ``tad-dftd3`` (and its ``tad-mctc``), the
functional's damping parameters from the parameter file it ships (s-dftd3's own); none
is retyped here. Lengths are in bohr inside (``ase.units.Bohr``, as ``dftd3.ase``
converts), energies in Hartree, returned in eV.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from ase.units import CODATA, Bohr, Hartree

from ase_shard import d3_kernels
from ase_shard.graph import EdgeList, LocalGraph
from ase_shard.models.sum import Addable
from ase_shard.models.triplets import angle_pairs

# s-dftd3's defaults (dftd3_cutoff), in Å: two-body 60 bohr, three-body and CN 40 bohr
DEFAULT_CUTOFF = 60.0 * Bohr
DEFAULT_ATM_CUTOFF = 40.0 * Bohr
DEFAULT_CN_CUTOFF = 40.0 * Bohr

# mctc-lib's bohr in Å (mctc_io_convert), which s-dftd3's radii are in: hbar / (me c alpha)
# from CODATA 2018, computed as there (ASE's 2018 units derive alpha from mu0, 3e-12 off)
_CODATA_2018 = CODATA["2018"]
_FINE_STRUCTURE_2018 = 7.2973525693e-3
_MCTC_BOHR = (
    _CODATA_2018["_hplanck"]
    / (2.0 * math.pi)
    / (_CODATA_2018["_me"] * _CODATA_2018["_c"] * _FINE_STRUCTURE_2018)
    * 1e10
)
_DAMPINGS = ("bj", "zero")


class D3(Addable, torch.nn.Module):
    """DFT-D3 dispersion energy of a functional, as ``dftd3.ase.DFTD3`` gives it.

    ``D3(method, damping, atm, cutoff, cn_cutoff, atm_cutoff)`` equals
    ``DFTD3(method=method, damping="d3" + damping, params_tweaks={"method": method,
    "atm": atm}, realspace_cutoff={"disp2": cutoff, "disp3": atm_cutoff, "cn":
    cn_cutoff})``, whose defaults are these cutoffs' defaults.

    A two-stage model: coordination numbers on the atoms first, then pair and triple
    energies that need the coordination numbers of both (all three) ends. It declares
    two layers and exchanges the coordination numbers itself (``supports_layer_halo``):
    with the per-layer halo, each rank counts its owned atoms' and takes its ghosts'
    from their owners (``graph.exchange``, whose gradient brings dE/dCN back to them);
    with the full halo, the ghosts' are counted from their own edges. On a CPU in
    float64 with the per-layer halo the calculator evaluates it by a compiled kernel
    instead (:meth:`energy_forces`, :mod:`ase_shard.d3_kernels`: the same formulas with
    their derivatives written out, the exchanges on the host); elsewhere by autograd.

    Parameters
    ----------
    method : str
        Functional whose damping parameters to use (s-dftd3's names: ``"pbe"``,
        ``"b3lyp"``, ``"r2scan"``, ...).
    damping : str
        ``"bj"`` (rational) or ``"zero"``.
    atm : bool
        Add the three-body ATM term (s9 = 1, as ``dftd3``'s ``atm=True``).
    cutoff : float
        Å: pairs within it have two-body energy.
    cn_cutoff : float
        Å: pairs within it count towards coordination numbers.
    atm_cutoff : float
        Å: triangles whose three sides are within it have three-body energy.

    Attributes
    ----------
    cutoff : float
        Å: the largest of the three cutoffs, the graph's edges (the protocol's cutoff).
    pair_cutoff, cn_cutoff, atm_cutoff : float
        Å: the three cutoffs.
    damping_parameters : dict of str to float
        The damping parameters (s6, s8, s9, a1, a2 or rs6, rs8, alp).
    """

    num_layers = 2
    supports_layer_halo = True
    # its pair and triangle lists are cut by data (torch.nonzero): compiled, they would
    # recompile at every step; in a compiled Sum it runs eagerly (by its kernel on CPUs)
    supports_compile = False

    def __init__(
        self,
        method: str = "pbe",
        damping: str = "bj",
        atm: bool = True,
        cutoff: float = DEFAULT_CUTOFF,
        cn_cutoff: float = DEFAULT_CN_CUTOFF,
        atm_cutoff: float = DEFAULT_ATM_CUTOFF,
    ) -> None:
        super().__init__()
        if damping not in _DAMPINGS:
            raise ValueError(f"damping must be one of {_DAMPINGS}, not {damping!r}")
        from tad_dftd3 import data, defaults, param, reference
        from tad_mctc.data import radii
        from tad_mctc.units.length import AU2AA

        dd = {"dtype": torch.float64, "device": torch.device("cpu")}
        values = param.get_functional_params(method, damping=damping, **dd)
        self.damping_parameters = {key: float(value) for key, value in values.items()}
        # dftd3 loads a method's parameters without the three-body term unless asked
        self.damping_parameters["s9"] = 1.0 if atm else 0.0
        self.method, self.damping, self.atm = method, damping, bool(atm)
        self.pair_cutoff = float(cutoff)
        self.cn_cutoff = float(cn_cutoff)
        self.atm_cutoff = float(atm_cutoff)
        self.cutoff = max(self.pair_cutoff, self.cn_cutoff, self.atm_cutoff if atm else 0.0)
        self.atomic_types = tuple(range(1, defaults.MAX_ELEMENT))

        tables = reference.Reference(**dd)
        # one row per atomic number (row 0 unused); missing references have CN -1
        self.register_buffer("reference_cn", tables.cn)
        self.register_buffer("reference_c6", tables.c6)  # (Z, Z, ref, ref), Hartree bohr^6
        # sqrt(0.5 sqrt(Z) <r^4>/<r^2>) per element, so that C8 = 3 r4r2_i r4r2_j C6
        self.register_buffer("r4r2", data.R4R2(**dd))
        # s-dftd3's radii are in mctc-lib's bohr, tad-mctc's in CODATA 2014's, 4e-10
        # shorter (energies move by up to 1e-9): back to Å with tad-mctc's, on with
        # mctc-lib's. tad-mctc stores the pairwise van der Waals radii in float32;
        # s-dftd3 gives them to 4 decimals in Å, which rounding recovers.
        angstrom_to_bohr = 1.0 / _MCTC_BOHR
        covalent_radius = radii.COV_D3(**dd) * AU2AA * angstrom_to_bohr
        vdw_radius = torch.round(radii.VDW_PAIRWISE(**dd) * AU2AA, decimals=4) * angstrom_to_bohr
        self.register_buffer("covalent_radius", covalent_radius)  # bohr
        self.register_buffer("vdw_radius", vdw_radius)  # (Z, Z) bohr

    def extra_repr(self) -> str:
        return (
            f"method={self.method!r}, damping={self.damping!r}, atm={self.atm}, "
            f"cutoff={self.pair_cutoff:.4f}, cn_cutoff={self.cn_cutoff:.4f}, "
            f"atm_cutoff={self.atm_cutoff:.4f}"
        )

    def forward(self, graph: LocalGraph) -> torch.Tensor:
        """Per-atom energies in eV, shape ``(n_atoms,)``.

        The energies of owned atoms are complete; ghost rows are not meaningful.
        """
        n, n_owned = graph.n_atoms, graph.n_owned
        numbers = graph.numbers
        centre, neighbour = graph.edge_index
        distance = torch.linalg.vector_norm(graph.edge_vectors, dim=-1) / Bohr

        cn = self._coordination_numbers(graph, distance)
        if graph.exchange is not None:
            # per-layer halo: every edge is centred on an owned atom, so the ghosts'
            # numbers are their owners'; the exchange's backward returns dE/dCN to them
            cn = graph.exchange(cn[:n_owned])
        weights = self._reference_weights(numbers, cn)
        # C6 between node a and every element s present: the per-pair C6 is then one
        # weighted sum over b per pair, not a (ref x ref) table per pair
        species, kind = torch.unique(numbers, return_inverse=True)
        table = self.reference_c6[species][:, species]  # (S, S, ref, ref)
        c6_to_species = torch.einsum("na,nsab->nsb", weights, table[kind])

        def c6(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
            return (c6_to_species[first, kind[second]] * weights[second]).sum(-1)

        # only edges centred on owned atoms give owned energies: with the full halo's
        # hops those come first; without, every edge is computed (ghost rows discarded)
        owned_edges = graph.hops.edges[0] if graph.hops is not None else centre.shape[0]
        pair = torch.nonzero(distance[:owned_edges] <= self.pair_cutoff / Bohr).squeeze(-1)
        i, j = centre[pair], neighbour[pair]
        pair_energy = c6(i, j) * self._pair_kernel(numbers[i], numbers[j], distance[pair])
        energies = distance.new_zeros(n).index_add(0, i, 0.5 * pair_energy)
        if self.damping_parameters["s9"] != 0.0:
            energies = energies + self._atm(graph, distance, owned_edges, c6)
        return energies * Hartree

    def energy_forces(self, edges: EdgeList, out: np.ndarray) -> float:
        """Energies (eV), forces (eV/Å) and virials (eV) by a compiled kernel.

        See :class:`ase_shard.graph.DirectForces`: every edge centred on an owned
        node, the ghosts' coordination numbers and dE/dCN through ``edges.halo``
        (:mod:`ase_shard.d3_kernels`); returns the shortest listed edge's squared
        length (Å²).
        """
        p = self.damping_parameters
        # a damping's parameters; those of the other one are 0
        names = ("s6", "s8", "s9", "a1", "a2", "rs6", "rs8", "alp")

        def host(name: str) -> np.ndarray:
            return getattr(self, name).detach().cpu().numpy()

        params = d3_kernels.D3Parameters(
            reference_cn=host("reference_cn"),
            reference_c6=host("reference_c6"),
            r4r2=host("r4r2"),
            covalent_radius=host("covalent_radius"),
            vdw_radius=host("vdw_radius"),
            damping=d3_kernels.BJ if self.damping == "bj" else d3_kernels.ZERO,
            **{name: p.get(name, 0.0) for name in names},
            pair_cutoff=self.pair_cutoff,
            cn_cutoff=self.cn_cutoff,
            atm_cutoff=self.atm_cutoff,
        )
        return d3_kernels.d3_forces(params, edges, out)

    def _coordination_numbers(self, graph: LocalGraph, distance: torch.Tensor) -> torch.Tensor:
        """``(n,)`` D3 coordination numbers of every node that centres edges."""
        centre, neighbour = graph.edge_index
        counted = torch.nonzero(distance <= self.cn_cutoff / Bohr).squeeze(-1)
        i, j = centre[counted], neighbour[counted]
        rc = self.covalent_radius[graph.numbers[i]] + self.covalent_radius[graph.numbers[j]]
        count = torch.sigmoid(d3_kernels.COUNTING_STEEPNESS * (rc / distance[counted] - 1.0))
        return distance.new_zeros(graph.n_atoms).index_add(0, i, count)

    def _reference_weights(self, numbers: torch.Tensor, cn: torch.Tensor) -> torch.Tensor:
        """``(n, ref)`` Gaussian weights of each node's references, normalised.

        s-dftd3 divides ``exp(-4 dCN^2)`` by its sum and, where that underflows (a CN
        far above every reference's), gives the largest reference weight 1. Shifting
        the exponents by their largest first (the normalised weights do not change)
        gives the same without underflow, and a finite gradient.
        """
        reference_cn = self.reference_cn[numbers]
        exponent = -d3_kernels.WEIGHTING_FACTOR * (reference_cn - cn.unsqueeze(-1)) ** 2
        exponent = torch.where(reference_cn >= 0.0, exponent, -torch.inf)
        shift = exponent.max(dim=-1, keepdim=True).values.detach()
        gaussian = torch.exp(exponent - shift)
        return gaussian / gaussian.sum(dim=-1, keepdim=True)

    def _pair_kernel(
        self, first: torch.Tensor, second: torch.Tensor, distance: torch.Tensor
    ) -> torch.Tensor:
        """Pair energy per unit C6 (1 / bohr^6) of two elements ``distance`` (bohr) apart."""
        p = self.damping_parameters
        q = 3.0 * self.r4r2[first] * self.r4r2[second]
        r2 = distance * distance
        r6 = r2 * r2 * r2
        if self.damping == "bj":
            radius = p["a1"] * torch.sqrt(q) + p["a2"]
            radius2 = radius * radius
            radius6 = radius2 * radius2 * radius2
            return -(p["s6"] / (r6 + radius6) + p["s8"] * q / (r6 * r2 + radius6 * radius2))
        radius = self.vdw_radius[first, second]
        f6 = 1.0 / (1.0 + 6.0 * (p["rs6"] * radius / distance) ** p["alp"])
        f8 = 1.0 / (1.0 + 6.0 * (p["rs8"] * radius / distance) ** (p["alp"] + 2.0))
        return -(p["s6"] * f6 / r6 + p["s8"] * q * f8 / (r6 * r2))

    def _atm(
        self,
        graph: LocalGraph,
        distance: torch.Tensor,
        owned_edges: int,
        c6: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """``(n,)`` three-body energies (Hartree): a third of each triangle to each corner.

        At centre ``i``, every ordered pair of two edges ``(i, j)``, ``(i, k)`` within
        ``atm_cutoff`` whose third side ``j-k`` is too is a triangle: each one at ``i``
        comes twice, so ``i`` takes a sixth of its energy per pair. Only the first
        ``owned_edges`` edges are centres' (see :meth:`forward`); ``c6(a, b)`` gives
        the C6 of node pairs.
        """
        numbers = graph.numbers
        centre, neighbour = graph.edge_index
        cutoff = self.atm_cutoff / Bohr
        candidates = torch.nonzero(distance[:owned_edges] <= cutoff).squeeze(-1)
        first, second = angle_pairs(centre, candidates, graph.n_atoms)
        vectors = graph.edge_vectors / Bohr
        side_jk = vectors[second] - vectors[first]
        r2_jk = (side_jk * side_jk).sum(-1)
        closed = torch.nonzero(r2_jk <= cutoff * cutoff).squeeze(-1)
        first, second, r2_jk = first[closed], second[closed], r2_jk[closed]
        i, j, k = centre[first], neighbour[first], neighbour[second]
        r2_ij, r2_ik = distance[first] ** 2, distance[second] ** 2

        c9 = torch.sqrt(torch.abs(c6(i, j) * c6(i, k) * c6(j, k)))
        zi, zj, zk = numbers[i], numbers[j], numbers[k]
        radius = d3_kernels.ATM_RADIUS_SCALE**3 * (
            self.vdw_radius[zi, zj] * self.vdw_radius[zi, zk] * self.vdw_radius[zj, zk]
        )
        r2 = r2_ij * r2_ik * r2_jk
        r1 = torch.sqrt(r2)
        r3 = r2 * r1
        exponent = (self.damping_parameters["alp"] + 2.0) / 3.0
        damping = 1.0 / (1.0 + 6.0 * (radius / r1) ** exponent)
        angular = (
            0.375
            * (r2_ij + r2_jk - r2_ik)
            * (r2_ij - r2_jk + r2_ik)
            * (-r2_ij + r2_jk + r2_ik)
            / (r3 * r2)
            + 1.0 / r3
        )
        triangle = self.damping_parameters["s9"] * c9 * angular * damping
        return distance.new_zeros(graph.n_atoms).index_add(0, i, triangle / 6.0)
