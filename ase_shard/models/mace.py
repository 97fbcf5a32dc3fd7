"""Adapter for MACE models (``mace-torch``) to the ``ShardedCalculator`` protocol.

``mace`` is imported lazily: this module imports without it, and only building
an adapter needs it (to load a ``.model`` file or check an in-memory model).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence

import numpy as np
import torch

from ase_shard.graph import LocalGraph
from ase_shard.models.sum import Addable

_SUPPORTED = ("MACE", "ScaleShiftMACE")


def _mace_classes() -> tuple[type, type]:
    try:
        from mace.modules.models import MACE as MaceModel
        from mace.modules.models import ScaleShiftMACE
    except ImportError as exc:  # pragma: no cover - exercised without mace only
        raise ImportError(
            "ase_shard.models.MACE needs the mace-torch package (pip install mace-torch)"
        ) from exc
    return MaceModel, ScaleShiftMACE


def _load(path: str | os.PathLike, map_location) -> torch.nn.Module:
    _mace_classes()  # the pickle refers to mace's classes
    return torch.load(os.fspath(path), map_location=map_location, weights_only=False)


def _select_head(heads: Sequence[str], head: str | None) -> int:
    """Index of ``head`` in ``heads``, chosen as ``MACECalculator`` does by default."""
    heads = list(heads)
    if head is not None:
        if head not in heads:
            raise ValueError(f"head {head!r} not in the model's heads {heads}")
        return heads.index(head)
    if len(heads) == 1:
        return 0
    default = [i for i, name in enumerate(heads) if name.lower() == "default"]
    if not default:
        raise ValueError(f"the model has several heads {heads} and none is 'default'; pass head=")
    return default[0]


def _accepted(module: torch.nn.Module, names: Sequence[str]) -> frozenset[str]:
    """Which of ``names`` the module's ``forward`` takes (mace versions differ)."""
    parameters = inspect.signature(module.forward).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return frozenset(names)
    return frozenset(name for name in names if name in parameters)


class MACE(Addable, torch.nn.Module):
    """A MACE potential (``mace.modules.models.MACE`` or ``ScaleShiftMACE``).

    Runs MACE's own submodules (embedding, spherical harmonics, radial basis,
    interactions, symmetric products, readouts, atomic energies E0 and the
    scale/shift) on the local graph's edge vectors, and returns the per-atom
    energies MACE reports as ``node_energy``: E0 plus the (scaled and shifted)
    interaction energy. Forces and stress follow from the calculator's
    gradient with respect to the edge vectors, exactly as MACE derives them
    from positions and strain.

    Parameters
    ----------
    model : str, os.PathLike or torch.nn.Module
        A ``.model`` file written by ``torch.save`` (as MACE's training
        script does), or a MACE module in memory. The adapter uses the module
        itself (no copy): it is put in eval mode and its parameters stop
        requiring gradients, as in ``mace.calculators.MACECalculator``.
    head : str, optional
        Readout head of a multi-head model; by default the only head, or the
        one named "default" (case-insensitive), as ``MACECalculator`` chooses.
    map_location : optional
        Passed to ``torch.load`` for a file (default ``"cpu"``); the
        calculator moves the model to its device afterwards.

    Attributes
    ----------
    cutoff : float
        ``model.r_max`` in Å.
    num_layers : int
        ``model.num_interactions``: the receptive field is ``r_max`` times this.
    atomic_types : tuple of int
        ``model.atomic_numbers``, the elements the model supports.
    heads : tuple of str
        The model's readout heads (``("Default",)`` for a single-head model);
        ``head`` is the one used.

    The model's dtype is kept (``ShardedCalculator`` reads it from the
    parameters); ``ShardedCalculator(MACE(...), dtype=torch.float64)`` casts
    a float32 model, as ``MACECalculator(default_dtype="float64")`` does.
    Models with extra per-system inputs (``joint_embedding``: charge, spin,
    ...) and non-energy variants (dipoles, MACELES, PolarMACE) are not supported.
    With a per-layer halo, each interaction updates the owned atoms only and
    the ghosts' features come from their owners (``graph.exchange``).
    """

    supports_layer_halo = True

    def __init__(
        self,
        model: str | os.PathLike | torch.nn.Module,
        *,
        head: str | None = None,
        map_location="cpu",
    ) -> None:
        super().__init__()
        if isinstance(model, (str, os.PathLike)):
            model = _load(model, map_location)
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"expected a MACE torch.nn.Module or a .model path, got {type(model)}")
        mace_cls, scale_shift_cls = _mace_classes()
        if type(model) not in (mace_cls, scale_shift_cls):
            raise TypeError(
                f"unsupported model class {type(model).__module__}.{type(model).__qualname__}: "
                f"ase_shard.models.MACE adapts mace's {' and '.join(_SUPPORTED)}"
            )
        if hasattr(model, "joint_embedding"):
            raise NotImplementedError(
                "MACE models with a joint embedding (per-system inputs such as total "
                "charge or spin) are not supported"
            )
        self.model = model.eval()
        for parameter in self.model.parameters():
            parameter.requires_grad_(False)
        self.scale_shift = isinstance(model, scale_shift_cls)
        self.head_index = _select_head(getattr(model, "heads", None) or ["Default"], head)
        self.heads = tuple(str(name) for name in getattr(model, "heads", None) or ["Default"])
        self.head = self.heads[self.head_index]

        numbers = [int(z) for z in model.atomic_numbers.tolist()]
        self.cutoff = float(model.r_max)
        self.num_layers = int(model.num_interactions)
        self.atomic_types = tuple(numbers)
        # Z -> row of MACE's one-hot node attributes (-1: unsupported element)
        z_to_index = torch.full((max(numbers) + 1,), -1, dtype=torch.int64)
        z_to_index[torch.tensor(numbers)] = torch.arange(len(numbers))
        self.register_buffer("z_to_index", z_to_index, persistent=False)
        # E0 of the head by atomic number (eV), on the host: reference_energies is read
        # every step and must not wait for a device
        e0 = torch.atleast_2d(model.atomic_energies_fn.atomic_energies)[self.head_index]
        self._e0_by_z = np.full(max(numbers) + 1, np.nan)
        self._e0_by_z[numbers] = e0.detach().double().cpu().numpy()

        self._interaction_kwargs = [
            _accepted(block, ("cutoff", "first_layer", "lammps_class", "lammps_natoms"))
            for block in model.interactions
        ]
        self.eval()

    def reference_energies(self, numbers: np.ndarray) -> np.ndarray:
        """The atomic energies E0 (eV) of the head, for atoms of elements ``numbers``.

        ``ShardedCalculator`` reports ``node_energy = energies - E0``, as
        ``MACECalculator`` does.
        """
        return self._e0_by_z[numbers]

    def train(self, mode: bool = True) -> MACE:
        """Inference only: the wrapped model stays in eval mode."""
        super().train(mode)
        self.model.eval()
        return self

    def forward(self, graph: LocalGraph) -> torch.Tensor:
        """Per-atom energies in eV (E0 plus interaction energy), shape ``(n_atoms,)``.

        Only the owned rows are computed; ghost rows are returned as zeros (the
        calculator discards them). With a full halo, layer ``k`` of ``L`` runs
        only on the rows within ``L - k`` hops of an owned row (``graph.hops``:
        prefixes of rows and edges sorted by hop count), as the owned energies
        need nothing else: a halo of ``L`` cutoffs is mostly skipped in the last
        layers. With a per-layer halo every layer updates the owned rows and the
        exchange fills in the ghosts. Graphs without ``hops`` and exchange (the
        padded graphs of ``torch.compile``) are computed whole.
        """
        model = self.model
        vectors_in = graph.edge_vectors
        n, n_owned = graph.n_atoms, int(graph.n_owned)
        exchange = graph.exchange
        if n_owned == 0 and exchange is None:
            return vectors_in.new_zeros(n, dtype=self._energy_dtype(vectors_in))
        device = vectors_in.device
        n_layers = len(model.interactions)
        centre, neighbour = graph.edge_index
        hops = graph.hops
        if hops is None:
            # per-layer halo (every edge centred on an owned row; the exchange
            # fills the ghosts), or no hop counts: every row and edge, rows in place
            rows = [n_owned] + [n] * n_layers
            edges = [centre.shape[0]] * n_layers
            numbers = graph.numbers
        else:
            # rows ordered by hop count (owned rows keep their places), so the rows
            # a layer needs are a prefix, as are its edges (sorted by their centres')
            rows, edges = hops.rows, hops.edges
            numbers = graph.numbers.index_select(0, hops.order)
            centre = hops.place.index_select(0, centre)
            neighbour = hops.place.index_select(0, neighbour)

        # MACE's edges run sender -> receiver with vectors r_receiver - r_sender;
        # the local graph's run centre <- neighbour with r_neighbour - r_centre.
        edge_index = torch.stack([neighbour, centre])
        vectors = -vectors_in
        lengths = torch.linalg.norm(vectors, dim=-1, keepdim=True)

        n_rows = rows[n_layers]  # every row that sends a message to a needed row
        element = self.z_to_index[numbers[:n_rows]]
        node_attrs = torch.nn.functional.one_hot(element, len(self.atomic_types))
        node_attrs = node_attrs.to(vectors.dtype)
        node_heads = torch.full((n_rows,), self.head_index, dtype=torch.int64, device=device)
        owned = torch.arange(n_owned, device=device)
        owned_heads = node_heads[:n_owned]

        node_e0 = model.atomic_energies_fn(node_attrs[:n_owned])[owned, owned_heads]
        node_feats = model.node_embedding(node_attrs)
        edge_attrs = model.spherical_harmonics(vectors)
        radial = model.radial_embedding(lengths, node_attrs, edge_index, model.atomic_numbers)
        edge_feats, cutoff = radial if isinstance(radial, tuple) else (radial, None)
        if hasattr(model, "pair_repulsion"):
            pair_node_energy = model.pair_repulsion_fn(
                lengths[: edges[0]],
                node_attrs[: rows[1]],
                edge_index[:, : edges[0]],
                model.atomic_numbers,
            )[:n_owned]
        else:
            pair_node_energy = torch.zeros_like(node_e0)

        node_feats_list = []
        for i, (interaction, product) in enumerate(
            zip(model.interactions, model.products, strict=True)
        ):
            # layer i + 1 updates the rows within n_layers - i - 1 hops
            n_in, n_out = rows[n_layers - i], rows[n_layers - i - 1]
            if exchange is not None:
                n_out = n_owned  # the exchange below provides the ghosts
            n_edges = edges[n_layers - i - 1]
            optional = {
                "cutoff": None if cutoff is None else cutoff[:n_edges],
                "first_layer": i == 0,
            }
            accepted = self._interaction_kwargs[i]
            node_feats, sc = interaction(
                node_attrs=node_attrs[:n_in],
                node_feats=node_feats[:n_in],
                edge_attrs=edge_attrs[:n_edges],
                edge_feats=edge_feats[:n_edges],
                edge_index=edge_index[:, :n_edges],
                **{key: value for key, value in optional.items() if key in accepted},
            )
            node_feats = self._product(product, node_feats, sc, node_attrs, n_out)
            node_feats_list.append(node_feats[:n_owned])
            if exchange is not None and i < n_layers - 1:
                node_feats = exchange(node_feats[:n_owned])

        readout_energies = []
        for i, readout in enumerate(model.readouts):
            feat_idx = -1 if len(model.readouts) == 1 else i
            readout_energies.append(
                readout(node_feats_list[feat_idx], owned_heads)[owned, owned_heads]
            )

        if self.scale_shift:
            # as ScaleShiftMACE.forward's node_energy
            node_inter_es = torch.sum(torch.stack([pair_node_energy, *readout_energies]), dim=0)
            node_inter_es = model.scale_shift(node_inter_es, owned_heads)
            energies = node_e0.double() + node_inter_es.double()
        else:
            # as MACE.forward's node_energy
            energies = torch.sum(
                torch.stack([node_e0, pair_node_energy, *readout_energies], dim=-1), dim=-1
            )
        return torch.cat([energies, energies.new_zeros(n - n_owned)])

    @staticmethod
    def _product(
        product: torch.nn.Module,
        node_feats: torch.Tensor,
        sc: torch.Tensor | None,
        node_attrs: torch.Tensor,
        n_out: int,
    ) -> torch.Tensor:
        """MACE's product (symmetric contraction) on the first ``n_out`` rows.

        MACE reshapes its output with ``view(n, -1)``, which zero rows cannot
        take; a rank that owns nothing (per-layer halo) still needs the
        product's empty output for its next exchange, so it runs one zero row
        appended to its zero real rows and keeps none. The row is appended, not
        made alone: the output must still depend on this layer's input, or
        backward would skip the exchanges before it on this rank only.
        """
        if n_out == 0:

            def one_row(rows: torch.Tensor) -> torch.Tensor:
                return torch.cat([rows[:0], rows.new_zeros((1, *rows.shape[1:]))])

            sc = None if sc is None else one_row(sc)
            return product(
                node_feats=one_row(node_feats), sc=sc, node_attrs=one_row(node_attrs)
            )[:0]
        return product(
            node_feats=node_feats[:n_out],
            sc=None if sc is None else sc[:n_out],
            node_attrs=node_attrs[:n_out],
        )

    def _energy_dtype(self, vectors: torch.Tensor) -> torch.dtype:
        return torch.float64 if self.scale_shift else vectors.dtype
