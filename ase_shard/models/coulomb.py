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

import torch

from ase_shard.graph import LocalGraph
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
        count twice: the kernel sees the cell with half its gradient.
        """
        from torchpme.lib import (
            KSpaceFilter,
            MeshInterpolator,
            generate_kvectors_for_ewald,
            get_ns_mesh,
        )

        positions = graph.positions[: graph.n_owned]
        cell = graph.cell
        kernel_cell = _half_gradient(cell)
        # the ranks' sums: constants for autograd (a system_sum's are; one process's too)
        total = graph.system_sum or (lambda partial: partial)
        ivolume = kernel_cell.det().abs().reciprocal()
        if self.method == "ewald":
            basis = torch.linalg.vector_norm(cell.detach(), dim=1)
            ns = torch.ceil(basis / self.lr_wavelength).long()
            kvectors = generate_kvectors_for_ewald(ns=ns, cell=cell)
            phases = kvectors @ positions.T  # (k, i)
            waves = torch.stack([torch.cos(phases), torch.sin(phases)])  # (2, k, i)
            structure = total((waves @ charges).detach())  # (2, k)
            green = self.potential.lr_from_k_sq(_half_gradient(kvectors).square().sum(-1))
            potential = torch.einsum("fki,fk,k->i", waves, structure, green) * ivolume
        else:
            ns = get_ns_mesh(cell.detach(), self.mesh_spacing)
            mesh = MeshInterpolator(cell, ns, interpolation_nodes=4, method="Lagrange")
            mesh.compute_weights(positions)
            density = total(mesh.points_to_mesh(charges.detach().unsqueeze(-1)).detach())
            kspace = KSpaceFilter(
                kernel_cell, ns, kernel=self.potential, fft_norm="backward", ifft_norm="forward"
            )
            potential = mesh.mesh_to_points(kspace.forward(density)).squeeze(-1) * ivolume
        net_charge = total(charges.detach().sum())
        potential = potential - 2.0 * self.potential.background_correction() * net_charge * ivolume
        share = charges * potential
        self_energy = 0.5 * self.potential.self_contribution() * charges * charges
        return share - 0.5 * share.detach() - self_energy


def _half_gradient(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s value with half its gradient (see :meth:`Coulomb._reciprocal`)."""
    fixed = tensor.detach()
    return fixed + 0.5 * (tensor - fixed)
