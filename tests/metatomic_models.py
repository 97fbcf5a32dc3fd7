"""A test-only metatomic model: random weights, exported with metatomic's own API.

``tiny_metatomic(...)`` returns a real :class:`metatomic.torch.AtomisticModel` around
:class:`TinyMessagePassing` (TorchScript-compiled by ``AtomisticModel.save`` when
saved), in float64, that requests one or two neighbour lists and computes per-atom
energies (eV) for all or ``selected_atoms``:

- ``layers`` rounds of messages over the ``mp_cutoff`` list (full or half): each atom
  sums its neighbours' features weighted by a smooth radial function and, from the
  vectors, a vector feature whose squared norm enters the update (three-body-like, so
  forces are not central and the stress has off-diagonal terms);
- optionally a pair term over a second list (``pair_cutoff``, full or half), half of
  each pair's energy to either atom.

Its ``interaction_range`` is ``max(layers * mp_cutoff, pair_cutoff)``: the Euclidean
reach, which is what metatomic asks a model to declare. The lists are strict and the
radial functions vanish only at ``REACH`` times their cutoff, so the energy depends on
which pairs each list holds: a list built with the wrong cutoff changes it.
"""

# AtomisticModel compares forward's annotations with typing's List[System], Dict[...] and
# Optional[...]: no ``from __future__ import annotations`` and no builtin generics here
# ruff: noqa: UP006, UP035, UP045
import math
from typing import Dict, List, Optional, Tuple

import torch
from metatensor.torch import Labels, TensorBlock, TensorMap
from metatomic.torch import (
    AtomisticModel,
    ModelCapabilities,
    ModelMetadata,
    ModelOutput,
    NeighborListOptions,
    System,
)

SPECIES = (29, 47, 79)  # Cu, Ag, Au
REACH = 1.25  # the radial functions vanish at REACH x the list's cutoff


def _smooth_cutoff(r: torch.Tensor, cutoff: float) -> torch.Tensor:
    """Cosine cutoff, 1 at 0 and 0 (with zero slope) at ``cutoff`` and beyond."""
    inside = r < cutoff
    x = torch.where(inside, r / cutoff, torch.ones_like(r))
    return 0.5 * (torch.cos(math.pi * x) + 1.0)


class TinyMessagePassing(torch.nn.Module):
    """The module inside the exported model (follows ``metatomic.torch.ModelInterface``)."""

    def __init__(
        self,
        mp_cutoff: float,
        mp_full: bool,
        layers: int,
        pair_cutoff: float,
        pair_full: bool,
        features: int,
        seed: int,
    ):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)

        def random(*shape: int, scale: float = 1.0) -> torch.nn.Parameter:
            values = torch.randn(*shape, generator=generator, dtype=torch.float64)
            return torch.nn.Parameter(scale * values)

        self.mp_cutoff = mp_cutoff
        self.pair_cutoff = pair_cutoff
        self.mp_reach = REACH * mp_cutoff
        self.pair_reach = REACH * pair_cutoff
        self.has_pair = pair_cutoff > 0.0
        self.mp_options = NeighborListOptions(cutoff=mp_cutoff, full_list=mp_full, strict=True)
        self.mp_full = mp_full
        # a placeholder when there is no pair term (TorchScript wants one type)
        self.pair_options = NeighborListOptions(
            cutoff=pair_cutoff if self.has_pair else mp_cutoff, full_list=pair_full, strict=True
        )
        self.pair_full = pair_full
        type_index = torch.full((max(SPECIES) + 1,), -1, dtype=torch.int64)
        type_index[torch.tensor(SPECIES)] = torch.arange(len(SPECIES))
        self.register_buffer("type_index", type_index)
        self.widths = torch.nn.Parameter(
            torch.linspace(0.8, mp_cutoff, 4, dtype=torch.float64), requires_grad=False
        )
        self.embedding = random(len(SPECIES), features)
        self.layers = layers
        self.radial = random(layers, 4, features)
        self.self_weights = random(layers, features, features, scale=1 / math.sqrt(features))
        self.message_weights = random(layers, features, features, scale=1 / math.sqrt(features))
        self.vector_weights = random(layers, features, features, scale=0.3 / math.sqrt(features))
        self.readout = random(features, scale=0.5)
        self.reference = random(len(SPECIES), scale=0.5)  # per-species energy, eV
        self.pair_strength = random(len(SPECIES), len(SPECIES), scale=0.2)

    def requested_neighbor_lists(self) -> List[NeighborListOptions]:
        if self.has_pair:
            return [self.mp_options, self.pair_options]
        return [self.mp_options]

    @staticmethod
    def _pairs(system: System, options: NeighborListOptions, full: bool):
        """``(centre, neighbour, vectors)`` with both directions of every pair."""
        neighbors = system.get_neighbor_list(options)
        samples = neighbors.samples.values
        first = samples[:, 0].to(torch.int64)
        second = samples[:, 1].to(torch.int64)
        vectors = neighbors.values.reshape(-1, 3)
        if full:
            return first, second, vectors
        return (
            torch.cat([first, second]),
            torch.cat([second, first]),
            torch.cat([vectors, -vectors]),
        )

    def _energies(self, system: System) -> torch.Tensor:
        """Per-atom energies (eV) of every atom of ``system``."""
        n = len(system)
        kind = self.type_index[system.types.to(torch.int64)]
        h = self.embedding[kind]
        centre, neighbour, vectors = self._pairs(system, self.mp_options, self.mp_full)
        r = torch.linalg.vector_norm(vectors, dim=1)
        fc = _smooth_cutoff(r, self.mp_reach)
        basis = torch.exp(-((r[:, None] - self.widths[None, :]) ** 2)) * fc[:, None]
        for k in range(self.layers):
            weight = basis @ self.radial[k]  # (E, F)
            message = weight * h[neighbour]
            scalar = torch.zeros((n, h.shape[1]), dtype=h.dtype, device=h.device)
            scalar = scalar.index_add(0, centre, message)
            vector = torch.zeros((n, 3, h.shape[1]), dtype=h.dtype, device=h.device)
            vector = vector.index_add(0, centre, vectors[:, :, None] * message[:, None, :])
            h = torch.tanh(
                h @ self.self_weights[k]
                + scalar @ self.message_weights[k]
                + (vector * vector).sum(dim=1) @ self.vector_weights[k]
            )
        energies = h @ self.readout + self.reference[kind]
        if self.has_pair:
            centre, neighbour, vectors = self._pairs(system, self.pair_options, self.pair_full)
            r = torch.linalg.vector_norm(vectors, dim=1)
            strength = self.pair_strength[kind[centre], kind[neighbour]]
            pair = strength * torch.exp(-r) * _smooth_cutoff(r, self.pair_reach)
            # each direction carries half the pair's energy to its centre
            energies = energies.index_add(0, centre, 0.5 * pair)
        return energies

    def forward(
        self,
        systems: List[System],
        outputs: Dict[str, ModelOutput],
        selected_atoms: Optional[Labels],
    ) -> Dict[str, TensorMap]:
        results: Dict[str, TensorMap] = {}
        names: List[str] = []
        for name in outputs:
            if name == "energy" or name.startswith("energy/"):
                names.append(name)
        if len(names) == 0:
            return results
        all_energies = [self._energies(system) for system in systems]
        for name in names:
            # a variant is the same model with its energies scaled (so that it differs)
            scale = 1.0 if name == "energy" else 1.25
            per_atom = outputs[name].sample_kind == "atom"
            samples: List[torch.Tensor] = []
            values: List[torch.Tensor] = []
            for s, energies in enumerate(all_energies):
                atoms = torch.arange(energies.shape[0], device=energies.device)
                if selected_atoms is not None:
                    chosen = selected_atoms.values
                    atoms = chosen[chosen[:, 0] == s][:, 1].to(torch.int64)
                if per_atom:
                    samples.append(torch.stack([torch.full_like(atoms, s), atoms], dim=1))
                    values.append(scale * energies[atoms])
                else:
                    samples.append(torch.tensor([[s]], device=energies.device))
                    values.append(scale * energies[atoms].sum().reshape(1))
            device = all_energies[0].device
            block = TensorBlock(
                values=torch.cat(values).reshape(-1, 1),
                samples=Labels(
                    ["system", "atom"] if per_atom else ["system"],
                    torch.cat(samples).to(torch.int32),
                ),
                components=[],
                properties=Labels(["energy"], torch.tensor([[0]], device=device)),
            )
            results[name] = TensorMap(Labels(["_"], torch.tensor([[0]], device=device)), [block])
        return results


def tiny_metatomic(
    mp_cutoff: float = 3.0,
    mp_full: bool = True,
    layers: int = 2,
    pair_cutoff: float = 0.0,
    pair_full: bool = True,
    interaction_range: Optional[float] = None,
    features: int = 6,
    seed: int = 0,
    variants: Tuple[str, ...] = (),
) -> AtomisticModel:
    """A random-weight :class:`TinyMessagePassing` exported as an ``AtomisticModel``.

    ``variants`` adds outputs ``energy/<variant>`` beside ``energy``: the same
    energies times 1.25, for the ``variant=`` checks.
    """
    module = TinyMessagePassing(
        mp_cutoff, mp_full, layers, pair_cutoff, pair_full, features, seed
    ).eval()
    if interaction_range is None:
        interaction_range = max(layers * mp_cutoff, pair_cutoff)

    def energy(description: str) -> ModelOutput:
        return ModelOutput(
            unit="eV", sample_kind="atom", explicit_gradients=[], description=description
        )

    outputs = {"energy": energy("the energy")}
    outputs.update({f"energy/{name}": energy(f"{name}: 1.25 x energy") for name in variants})
    capabilities = ModelCapabilities(
        outputs=outputs,
        atomic_types=list(SPECIES),
        interaction_range=float(interaction_range),
        length_unit="angstrom",
        supported_devices=["cpu", "cuda"],
        dtype="float64",
    )
    metadata = ModelMetadata(name="tiny message passing (ase_shard tests)", authors=["ase_shard"])
    return AtomisticModel(module, metadata, capabilities)


class PositionsModel(torch.nn.Module):
    """A model that computes its pair distances from ``System.positions`` and ``cell``
    (and the cell shifts), not from the neighbour list's vectors: a pair potential
    over a full 3 Å list (energy ``exp(-r)`` to each atom of a pair)."""

    def __init__(self):
        super().__init__()
        self.options = NeighborListOptions(cutoff=3.0, full_list=True, strict=True)

    def requested_neighbor_lists(self) -> List[NeighborListOptions]:
        return [self.options]

    def forward(
        self,
        systems: List[System],
        outputs: Dict[str, ModelOutput],
        selected_atoms: Optional[Labels],
    ) -> Dict[str, TensorMap]:
        system = systems[0]
        neighbors = system.get_neighbor_list(self.options)
        pairs = neighbors.samples.values.to(torch.int64)
        shifts = pairs[:, 2:].to(system.positions.dtype)
        vectors = (
            system.positions[pairs[:, 1]] - system.positions[pairs[:, 0]] + shifts @ system.cell
        )
        pair = torch.exp(-torch.linalg.vector_norm(vectors, dim=1))
        energies = torch.zeros(len(system), dtype=pair.dtype).index_add(0, pairs[:, 0], pair)
        atoms = torch.arange(len(system))
        if selected_atoms is not None:
            atoms = selected_atoms.values[:, 1].to(torch.int64)
        if outputs["energy"].sample_kind == "atom":
            values = energies[atoms].reshape(-1, 1)
            pairs = torch.stack([0 * atoms, atoms], 1).to(torch.int32)
            samples = Labels(["system", "atom"], pairs)
        else:
            values = energies[atoms].sum().reshape(1, 1)
            samples = Labels(["system"], torch.tensor([[0]], dtype=torch.int32))
        block = TensorBlock(
            values=values,
            samples=samples,
            components=[],
            properties=Labels(["energy"], torch.tensor([[0]])),
        )
        return {"energy": TensorMap(Labels(["_"], torch.tensor([[0]])), [block])}

    @staticmethod
    def exported() -> AtomisticModel:
        capabilities = ModelCapabilities(
            outputs={"energy": ModelOutput(unit="eV", sample_kind="atom")},
            atomic_types=list(SPECIES),
            interaction_range=3.0,
            length_unit="angstrom",
            supported_devices=["cpu"],
            dtype="float64",
        )
        metadata = ModelMetadata(name="reads positions (ase_shard tests)")
        return AtomisticModel(PositionsModel().eval(), metadata, capabilities)
