"""The local graph a model sees on one rank, and the model protocol."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


@dataclass
class LocalGraph:
    """One rank's block of atoms: owned nodes first, then ghost nodes.

    A node is one atom; periodic images of an atom are not extra nodes but
    edges whose vectors include the image shift, as in a periodic graph.

    Attributes
    ----------
    numbers : torch.Tensor
        ``(n,)`` int64 atomic numbers of all local nodes.
    edge_index : torch.Tensor
        ``(2, E)`` int64 directed edges ``(centre, neighbour)``; both directions
        of every pair within ``cutoff`` are present (a full list).
    edge_vectors : torch.Tensor
        ``(E, 3)`` vectors ``r_neighbour - r_centre`` in Å, periodic images
        already applied. Differentiable: forces and stress are derived from
        ``dE/d edge_vectors``.
    n_owned : int
        Nodes ``[0, n_owned)`` are owned by this rank; their energies count.
    exchange : callable or None
        Per-layer halo (``halo="layer"``): every edge is centred on an owned
        node, and ``exchange(owned_features)`` turns ``(n_owned, ...)``
        features into ``(n, ...)`` ones whose ghost rows hold their owners'
        values. A message-passing model calls it between layers, the same
        number of times on every rank (it is collective). ``None`` (full
        halo): ghost features are computed locally; nothing to exchange.
    inputs : dict of str to torch.Tensor
        The per-atom arrays the model declares in ``per_atom_inputs``, one
        ``(n, ...)`` tensor each in the model's dtype (ghosts carry their
        owner's values).
    system : dict of str to torch.Tensor
        The per-system values the model declares in ``system_inputs``, the
        same on every rank, in the model's dtype.
    """

    numbers: torch.Tensor
    edge_index: torch.Tensor
    edge_vectors: torch.Tensor
    n_owned: int
    exchange: Callable[[torch.Tensor], torch.Tensor] | None = None
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    system: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def n_atoms(self) -> int:
        """Number of local nodes (owned + ghosts)."""
        return int(self.numbers.shape[0])


@runtime_checkable
class ShardModel(Protocol):
    """What ``ShardedCalculator`` needs from a ``torch.nn.Module``.

    ``cutoff`` (Å) is the range of one interaction; ``num_layers`` is the
    message-passing depth, so an atom's energy depends on atoms up to
    ``cutoff * num_layers`` away (the receptive field). ``atomic_types`` lists the
    supported atomic numbers, or is ``None`` when any element works.
    ``forward(graph)`` returns ``(n,)`` per-atom energies in eV for every local
    row. Messages flow into the centre ``edge_index[0]``: after one layer the
    energy of atom ``i`` may depend only on the edges centred on ``i``.

    Optional declarations: ``per_atom_inputs`` (names of ``Atoms`` arrays,
    e.g. ``("initial_charges",)``) and ``system_inputs`` (names looked up in
    ``atoms.info``, else the calculator's parameters, e.g. ``("charge",)``)
    arrive as ``graph.inputs`` and ``graph.system`` (see ``ase_shard.inputs``).

    A model that sets ``supports_layer_halo = True`` calls
    ``graph.exchange`` between its layers when it is not ``None``; it then
    runs with a one-cutoff halo (``ShardedCalculator(halo="layer")``).
    """

    cutoff: float
    num_layers: int
    atomic_types: Sequence[int] | None

    def __call__(self, graph: LocalGraph) -> torch.Tensor: ...


def supports_layer_halo(model: ShardModel) -> bool:
    """Whether the model exchanges ghost features between layers itself."""
    return bool(getattr(model, "supports_layer_halo", False))


def receptive_field(model: ShardModel) -> float:
    """Distance (Å) within which atoms influence an atom's energy."""
    return float(model.cutoff) * int(model.num_layers)


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    """dtype of the model's floating parameters/buffers (float64 if it has none)."""
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.is_floating_point():
            return tensor.dtype
    return torch.float64


def model_digest(model: torch.nn.Module) -> str:
    """Digest of the model's parameters and buffers (names, dtypes and values)."""
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(str(tensor.dtype).encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()
