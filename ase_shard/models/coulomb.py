"""Electrostatics of point charges in a periodic cell, Ewald or PME, with torch-pme's kernels.

The energy is torch-pme's range-separated Coulomb sum (``torchpme.CoulombPotential``
with a Gaussian ``smearing``), ``E = sum_i q_i V_i``, ``V_i`` what torch-pme's
``EwaldCalculator`` and ``PMECalculator`` return:

- real space: ``1/2 sum_j q_j erfc(r_ij / (sqrt(2) smearing)) / r_ij`` over the pairs
  within ``cutoff``, a pair term on the graph's edges;
- reciprocal space: the Gaussian-smeared charges' potential at each atom, by an explicit
  sum over k-vectors (Ewald, wavelengths down to ``lr_wavelength``) or by a mesh of
  ``mesh_spacing`` (PME: Lagrange interpolation to and from the mesh, an FFT filter);
- minus each atom's self term and, for a cell that is not neutral, the energy of a
  uniform neutralising background (torch-pme's corrections).

Under domain decomposition each rank sums its owned atoms' structure factors (Ewald) or
spreads their charges on the mesh (PME); ``graph.system_sum`` adds the ranks' parts, one
``Allreduce``; each rank then takes its owned atoms' potentials from the whole. That sum
is a constant for autograd, so each rank's energy is written so that the ranks'
gradients add up to the whole one's (see :meth:`Coulomb._reciprocal`). Energies in eV
(charges in e, lengths in Å: torch-pme's ``prefactors.eV_A``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ase_shard.graph import LocalGraph, MeshSlabs
from ase_shard.models.sum import Addable

_METHODS = ("ewald", "pme")


class Coulomb(Addable, torch.nn.Module):
    """Ewald or PME electrostatic energy, as torch-pme's calculators give it.

    ``Coulomb(method="ewald")`` equals ``torchpme.EwaldCalculator(CoulombPotential(
    smearing, prefactor=eV_A), lr_wavelength)``, ``method="pme"`` equals
    ``torchpme.PMECalculator(CoulombPotential(...), mesh_spacing)`` (4-point Lagrange
    interpolation), both given every pair within ``cutoff``; the parameters are this
    object's attributes.

    Parameters
    ----------
    charges : str or torch.nn.Module
        The name of a per-atom array (``"initial_charges"``, or any ``atoms.arrays``
        entry), or a charge model: a module with ``cutoff`` (Å, at most ``cutoff``)
        whose ``forward(graph)`` returns ``(n,)`` charges in e from the edges within
        its cutoff of each node. Forces then include the charges' dependence on the
        positions.
    method : {"ewald", "pme"}
    cutoff : float
        Å, the real-space cutoff.
    accuracy : float
        The real-space and reciprocal-space sums are cut where their terms fall to
        about this relative size (``exp(-s^2)``, ``s = sqrt(ln(1 / accuracy))``):
        ``smearing = cutoff / (sqrt(2) s)`` and wave numbers up to ``k = sqrt(2) s /
        smearing``: ``lr_wavelength = pi / k`` (torch-pme's Ewald keeps
        ``L / lr_wavelength`` wave vectors along a cell vector of length ``L``, the
        shortest wavelength ``2 lr_wavelength``), ``mesh_spacing = 2 lr_wavelength / 3``
        (torch-pme's mesh has at least ``2 L / mesh_spacing`` points along it, a
        power of two). PME's 4-point interpolation adds its own error: against a
        converged Ewald sum about 1e-5 of the energy and 1e-4 to 1e-3 of the
        largest force (docs/models.md).

    Attributes
    ----------
    smearing, lr_wavelength, mesh_spacing : float
        Å: torch-pme's parameters.
    charges : str or None
        The per-atom array's name (``None`` with a charge model).
    charge_model : torch.nn.Module or None

    The cell must be periodic along all three axes. Per-atom energies are
    ``q_i V_i``; per-atom stresses are not defined (the reciprocal sum's virial has
    no per-atom split here).
    """

    uses_positions = True
    supports_compile = False
    atomic_types = None
    system_inputs = ("pbc",)
    system_input_defaults = {"pbc": lambda atoms: atoms.pbc}

    def __init__(
        self,
        charges: str | torch.nn.Module = "initial_charges",
        method: str = "ewald",
        cutoff: float = 8.0,
        accuracy: float = 1e-6,
    ) -> None:
        super().__init__()
        if method not in _METHODS:
            raise ValueError(f"method must be one of {_METHODS}, not {method!r}")
        if not 0.0 < accuracy < 1.0:
            raise ValueError(f"accuracy must be between 0 and 1, not {accuracy!r}")
        from torchpme import CoulombPotential
        from torchpme.prefactors import eV_A

        self.method = method
        self.cutoff = float(cutoff)
        self.accuracy = float(accuracy)
        s = math.sqrt(math.log(1.0 / accuracy))
        self.smearing = self.cutoff / (math.sqrt(2.0) * s)
        self.lr_wavelength = math.pi * self.smearing / (math.sqrt(2.0) * s)
        self.mesh_spacing = 2.0 * self.lr_wavelength / 3.0
        self.potential = CoulombPotential(smearing=self.smearing, prefactor=eV_A)
        self._kept_lattice: _MeshLattice | None = None
        if isinstance(charges, str):
            self.charge_model = None
            self.charges = charges
            self.per_atom_inputs = (charges,)
            self.num_layers = 1
        else:
            if float(charges.cutoff) > self.cutoff:
                raise ValueError(
                    f"the charge model's cutoff ({float(charges.cutoff):g} Å) is longer than "
                    f"Coulomb's ({self.cutoff:g} Å)"
                )
            self.charge_model = charges
            self.charges = None
            # the charges of a pair's far end come from that atom's own edges: a second layer
            self.num_layers = 2
            self.supports_layer_halo = True

    def extra_repr(self) -> str:
        charges = self.charges or type(self.charge_model).__name__
        return (
            f"charges={charges!r}, method={self.method!r}, cutoff={self.cutoff:g}, "
            f"smearing={self.smearing:.4f}, lr_wavelength={self.lr_wavelength:.4f}"
        )

    def forward(self, graph: LocalGraph) -> torch.Tensor:
        """Per-atom energies in eV, ``(n_atoms,)``; the owned atoms' are complete."""
        if graph.positions is None or graph.cell is None:
            raise ValueError(
                "Coulomb needs the graph's positions and cell (ShardedCalculator gives "
                "them to a model that declares uses_positions)"
            )
        periodic = graph.system.get("pbc")
        if periodic is None or not bool(periodic.all()) or graph.cell.det().abs() == 0.0:
            raise ValueError(
                "Coulomb needs a cell periodic along all three axes (atoms.pbc all True "
                "and a cell of nonzero volume): the Ewald and PME sums are of a 3-D lattice"
            )
        charges = self._charges(graph)
        centre, neighbour = graph.edge_index
        # the energies of owned atoms come from the edges centred on them: with the
        # full halo's hops those come first; without, every edge is centred on one
        owned_edges = graph.hops.edges[0] if graph.hops is not None else centre.shape[0]
        distance = torch.linalg.vector_norm(graph.edge_vectors[:owned_edges], dim=-1)
        pair = torch.nonzero(distance < self.cutoff).squeeze(-1)
        i, j = centre[pair], neighbour[pair]
        pair_energy = charges[i] * charges[j] * self.potential.sr_from_dist(distance[pair])
        energies = distance.new_zeros(graph.n_atoms).index_add(0, i, 0.5 * pair_energy)
        reciprocal = self._reciprocal(graph, charges[: graph.n_owned])
        # the owned atoms' rows come first
        return energies + torch.nn.functional.pad(reciprocal, (0, graph.n_atoms - graph.n_owned))

    def _charges(self, graph: LocalGraph) -> torch.Tensor:
        """``(n,)`` charges of the nodes in e (the owned ones' and their ghosts')."""
        if self.charge_model is None:
            return graph.inputs[self.charges].reshape(graph.n_atoms)
        charges = self.charge_model(graph.within(float(self.charge_model.cutoff)))
        if graph.exchange is not None:
            # per-layer halo: the ghosts' charges are their owners' (the exchange's
            # backward returns dE/dq to the owners)
            charges = graph.exchange(charges[: graph.n_owned])
        return charges

    def _reciprocal(self, graph: LocalGraph, charges: torch.Tensor) -> torch.Tensor:
        """``(n_owned,)`` reciprocal-space, self and background energies of the owned atoms.

        With ``phi`` the potential of the whole system's smeared charges, the energy is
        ``E = 1/2 sum_i q_i phi_i``, ``phi`` linear in the charges. Each rank takes the
        structure factors (or the charge mesh) of all ranks as a constant ``rho`` and
        returns ``x_i - x_i / 2`` (the second half held constant), ``x_i = q_i
        phi_i(rho)``: the sum over ranks is ``E``, and its gradient with respect to an
        atom's position or charge is the whole one's, ``rho``'s dependence on them
        giving, by symmetry, as much as ``phi_i``'s. The lattice's dependence (the
        kernel, the volume) appears in every ``x_i`` with ``rho`` held, so it would
        count twice: Ewald's kernel sees the cell with half its gradient; PME's is
        added once, as an explicit term (:meth:`_pme`).
        """
        if self.method == "pme":
            return self._pme(graph, charges)
        from torchpme.lib import generate_kvectors_for_ewald

        positions = graph.positions[: graph.n_owned]
        cell = graph.cell
        # the ranks' sums: constants for autograd (a system_sum's are; one process's too)
        total = graph.system_sum or (lambda partial: partial)
        ivolume = _half_gradient(cell).det().abs().reciprocal()
        basis = torch.linalg.vector_norm(cell.detach(), dim=1)
        ns = torch.ceil(basis / self.lr_wavelength).long()
        kvectors = generate_kvectors_for_ewald(ns=ns, cell=cell)
        phases = kvectors @ positions.T  # (k, i)
        waves = torch.stack([torch.cos(phases), torch.sin(phases)])  # (2, k, i)
        structure = total((waves @ charges).detach())  # (2, k)
        green = self.potential.lr_from_k_sq(_half_gradient(kvectors).square().sum(-1))
        potential = torch.einsum("fki,fk,k->i", waves, structure, green) * ivolume
        net_charge = total(charges.detach().sum())
        potential = potential - 2.0 * self.potential.background_correction() * net_charge * ivolume
        return self._shares(charges, potential)

    def _pme(self, graph: LocalGraph, charges: torch.Tensor) -> torch.Tensor:
        """:meth:`_reciprocal` by PME, with the lattice's gradient written out.

        The charge mesh ``rho`` lies in fractional coordinates, so a strain moves
        neither it nor the interpolation: the energy's strain derivative is the
        kernel's and the volume's alone. With ``rho_k`` the mesh's transform, ``E_k =
        1/(2V) sum_k G(k^2) |rho_k|^2`` (torch-pme's unnormalised transforms; the
        half of the spectrum that ``rfftn`` stores stands for the rest), and as
        ``k^2`` moves by ``-2 k_a k_b`` per unit strain ``eps_ab``, ``W_ab =
        dE/deps_ab = -delta_ab (E_k + E_background) - 1/V sum_k G'(k^2) |rho_k|^2
        k_a k_b``; the gradient with respect to the cell ``h`` is ``h^-T W``. Each
        rank sums ``W`` over its wave numbers, the ranks' parts are added, and each
        rank adds its share of atoms of the whole, so that the ranks' gradients add
        up to it once. The kernel's values and slope depend on the cell only and
        are kept until it changes (:class:`_MeshLattice`): an MD step at constant
        volume evaluates no kernel, and no gradient flows through the FFTs. The
        moments ``k_a k_b`` take one pass over the spectrum (``k`` is separable in
        the integer wave numbers). On several ranks each spreads its charges on
        the planes its atoms touch (along the slabs' axis) and gets the
        potential back on those: no rank holds the whole mesh.
        """
        from torchpme.lib import MeshInterpolator, get_ns_mesh

        positions = graph.positions[: graph.n_owned]
        cell = graph.cell
        total = graph.system_sum or (lambda partial: partial)
        ns = get_ns_mesh(cell.detach(), self.mesh_spacing)
        mesh = MeshInterpolator(cell, ns, interpolation_nodes=4, method="Lagrange")
        mesh.compute_weights(positions)
        # each atom's stencil: (nodes^3, atoms) mesh indices per axis and weights
        # (torch-pme's, as its points_to_mesh and mesh_to_points form them)
        stencil = (mesh.x_indices, mesh.y_indices, mesh.z_indices)
        weights = mesh.interpolation_weights
        weights = (
            weights[mesh.x_shifts, :, 0]
            * weights[mesh.y_shifts, :, 1]
            * weights[mesh.z_shifts, :, 2]
        )
        fft = graph.system_fft
        if fft is None:
            order, slabs = (0, 1, 2), None
            shape, indices = tuple(ns.tolist()), stencil
        else:
            # the planes along each axis that the owned atoms' stencils reach: this
            # rank's part of the mesh is its planes along the slabs' axis
            touched = []
            for count, reached in zip(ns.tolist(), stencil, strict=True):
                planes = torch.zeros(count, dtype=torch.bool, device=positions.device)
                planes[reached.reshape(-1)] = True
                touched.append(planes)
            slabs = fft.plan(ns.tolist(), touched)
            order = slabs.order
            at = torch.full((slabs.shape[0],), -1, dtype=torch.long, device=positions.device)
            at[torch.from_numpy(slabs.planes).to(positions.device)] = torch.arange(
                len(slabs.planes), device=positions.device
            )
            shape = (len(slabs.planes), *slabs.shape[1:])
            indices = (at[stencil[order[0]]], stencil[order[1]], stencil[order[2]])
        spread = torch.zeros(shape, dtype=cell.dtype, device=cell.device).index_put_(
            indices, (charges * weights).detach(), accumulate=True
        )
        # the transform of all ranks' charges: in one process the whole spectrum (kx,
        # ky, kz); on several ranks this rank's slab (k1 in slabs.rows, k2, k0) of the
        # mesh's axes taken in `order` (graph.system_fft)
        if fft is None:
            density_k = torch.fft.rfftn(spread)
        else:
            density_k = fft.forward(slabs, spread)
        # the spectrum is of the mesh with its axes in `order`: so are the k-vectors
        lattice = self._lattice(cell.detach()[list(order)], ns[list(order)], slabs)
        ivolume = cell.detach().det().abs().reciprocal()

        # the slab's part of W without the background: the kernel energy and the
        # G'-weighted moments k_a k_b of the power spectrum; the ranks' parts, their
        # net charges and atom counts are added in one sum
        power = torch.addcmul(density_k.real.square(), density_k.imag, density_k.imag)
        power.mul_(lattice.weights)
        kernel_energy = 0.5 * ivolume * torch.dot(power.reshape(-1), lattice.kernel.reshape(-1))
        moments = 0.5 * ivolume * lattice.second_moments(power.mul_(lattice.slope))
        identity = torch.eye(3, dtype=cell.dtype, device=cell.device)
        slab_gradient = -2.0 * moments - kernel_energy * identity
        owned = torch.stack([charges.detach().sum(), charges.new_tensor(float(graph.n_owned))])
        sums = total(torch.cat([owned.to(cell.dtype), slab_gradient.reshape(9)]))
        net_charge, n_atoms, strain_gradient = sums[0], sums[1], sums[2:].reshape(3, 3)
        background = -2.0 * self.potential.background_correction() * net_charge * ivolume
        strain_gradient = strain_gradient - 0.5 * background * net_charge * identity

        # filtered in place: the spectrum is not needed again
        filtered = torch.view_as_complex(
            torch.view_as_real(density_k).mul_(lattice.kernel.unsqueeze(-1))
        )
        if fft is None:
            potential_mesh = torch.fft.irfftn(filtered, s=shape, norm="forward")
        else:
            potential_mesh = fft.inverse(slabs, filtered)
        potential = (potential_mesh[indices] * weights).sum(0) * ivolume
        energies = self._shares(charges, potential + background)
        if graph.n_owned == 0:
            return energies
        # value 0, gradient the rank's share of the lattice's, spread over its atoms
        cell_gradient = torch.linalg.solve(cell.detach().T, strain_gradient)
        return energies + (cell_gradient * (cell - cell.detach())).sum() / n_atoms

    def _shares(self, charges: torch.Tensor, potential: torch.Tensor) -> torch.Tensor:
        """``x_i - x_i / 2 - self_i``, ``x_i = q_i phi_i``: see :meth:`_reciprocal`."""
        share = charges * potential
        self_energy = 0.5 * self.potential.self_contribution() * charges * charges
        return share - 0.5 * share.detach() - self_energy

    def _lattice(
        self, cell: torch.Tensor, ns: torch.Tensor, slabs: MeshSlabs | None
    ) -> _MeshLattice:
        """The PME kernel at this rank's wave numbers (kept while the cell is the same).

        ``cell`` and ``ns`` have their vectors in the order of the mesh's axes
        as transformed. Laid out like the spectrum: ``(k0, k1, k2)`` in one
        process, ``(k1 in slabs.rows, k2, k0)`` on several
        (:meth:`ase_shard.system_fft.SystemFFT.forward`).
        """
        rows = slice(None) if slabs is None else slabs.rows
        key = (tuple(ns.tolist()), slabs is None, rows.start, rows.stop)
        kept = self._kept_lattice
        if kept is not None and kept.key == key and torch.equal(kept.cell, cell):
            return kept
        from torchpme.lib import generate_kvectors_for_mesh

        # (n0, n1, n2 // 2 + 1, 3) from torch-pme: k = m0 b0 + m1 b1 + m2 b2, m the
        # integer frequencies and b the reciprocal vectors (2 pi h^-T)
        kvectors = generate_kvectors_for_mesh(cell=cell, ns=ns)
        k_squared = kvectors.square().sum(-1).requires_grad_()
        with torch.enable_grad():
            kernel = self.potential.kernel_from_k_sq(k_squared)
            (slope,) = torch.autograd.grad(kernel.sum(), k_squared)
        options = {"dtype": cell.dtype, "device": cell.device}
        counts = [int(n) for n in ns]
        frequencies = [n * torch.fft.fftfreq(n, **options) for n in counts[:2]] + [
            counts[2] * torch.fft.rfftfreq(counts[2], **options)
        ]
        # the half spectrum stands for the whole: the planes k2 = 0 and, for an even
        # count, k2 = n2 / 2 once, the others twice (their mirrors are not stored)
        weights = torch.full_like(frequencies[2], 2.0)
        weights[0] = 1.0
        if counts[2] % 2 == 0:
            weights[-1] = 1.0
        reciprocal = 2.0 * torch.pi * torch.linalg.inv(cell).T
        axes = [0, 1, 2] if slabs is None else [1, 2, 0]
        tables = torch.stack([kernel.detach(), slope])
        if slabs is None:
            weights = weights.reshape(1, 1, -1)
        else:
            tables = tables.permute(0, 2, 3, 1)[:, rows]
            frequencies[1] = frequencies[1][rows]
            weights = weights.reshape(1, -1, 1)
        self._kept_lattice = _MeshLattice(
            cell=cell.clone(),
            key=key,
            kernel=tables[0].contiguous(),
            slope=tables[1].contiguous(),
            weights=weights,
            frequencies=tuple(frequencies[axis] for axis in axes),
            reciprocal=reciprocal[axes],
        )
        return self._kept_lattice


@dataclass(frozen=True)
class _MeshLattice:
    """PME's reciprocal-space tables for one cell, mesh and slab (:meth:`Coulomb._pme`).

    ``kernel`` is torch-pme's ``G(k^2)`` (eV Å) at the slab's wave numbers and
    ``slope`` its ``G'(k^2)``, both shaped like the spectrum
    (:meth:`Coulomb._lattice`); ``weights``, broadcast along the half axis, is
    how many points of the whole spectrum each stored one stands for.
    ``frequencies`` are the integer wave numbers ``m`` along the spectrum's
    three axes, ``reciprocal`` the reciprocal vector (1/Å, with its 2 pi) of
    each: ``k = sum_u m_u reciprocal[u]``. ``key`` is the mesh's shape and the
    slab's bounds.
    """

    cell: torch.Tensor
    key: tuple
    kernel: torch.Tensor
    slope: torch.Tensor
    weights: torch.Tensor
    frequencies: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    reciprocal: torch.Tensor

    def second_moments(self, values: torch.Tensor) -> torch.Tensor:
        """``sum_k values_k k_a k_b`` (3, 3) of ``values`` laid out like the spectrum.

        ``k`` is separable in the frequencies, so one pass over ``values`` (their
        sums over the last axis weighted by 1, ``m`` and ``m^2``) gives every
        moment ``S_uv = sum values m_u m_v``; then ``B^T S B``.
        """
        first, second, last = self.frequencies
        powers = torch.stack([torch.ones_like(last), last, last * last], dim=1)
        reduced = values.reshape(-1, len(last)) @ powers  # (A * B, 3)
        plane, lengthwise, squared = reduced.reshape(len(first), len(second), 3).unbind(-1)
        s_aa, s_bb = first.square() @ plane.sum(1), second.square() @ plane.sum(0)
        s_ab = first @ plane @ second
        s_ac, s_bc = first @ lengthwise.sum(1), second @ lengthwise.sum(0)
        s_cc = squared.sum()
        outer = torch.stack([s_aa, s_ab, s_ac, s_ab, s_bb, s_bc, s_ac, s_bc, s_cc]).reshape(3, 3)
        return self.reciprocal.T @ outer @ self.reciprocal


def _half_gradient(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s value with half its gradient (see :meth:`Coulomb._reciprocal`)."""
    fixed = tensor.detach()
    return fixed + 0.5 * (tensor - fixed)
