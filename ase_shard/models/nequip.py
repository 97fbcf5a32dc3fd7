"""Adapter for models of the NequIP framework (NequIP and Allegro).

``nequip`` (and ``nequip-allegro`` for Allegro models) is imported lazily, so
this module imports without them. Wrap an in-memory model built by nequip's
model builders, or a local checkpoint (``.ckpt``) or package (``.nequip.zip``)
file that nequip's own ``load_saved_model`` reads::

    from ase_shard import ShardedCalculator
    from ase_shard.models.nequip import NequIP

    calc = ShardedCalculator(NequIP("model.nequip.zip"))

The adapter feeds nequip's energy model the local graph's edge vectors as
``edge_vectors`` (nequip then derives edge lengths from them and never needs
positions or a cell, exactly as in its LAMMPS ML-IAP integration) and returns
the per-atom energies ``atomic_energy``, per-type scale and shift included.
The calculator, not nequip's ``ForceStressOutput``, differentiates.

NequIP models with nequip's ghost-exchange hooks (one per interaction block,
no-ops in nequip's own calculator; the hooks its LAMMPS ML-IAP integration
fills) run with the per-layer halo: the adapter fills the hooks with
``graph.exchange`` and marks the owned atoms as nequip's local ones, so each
interaction block computes features for owned atoms only and receives the
ghosts' from their owners.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from ase_shard.graph import LocalGraph
from ase_shard.models.sum import Addable

# class names inside nequip models; compared by name so that models loaded
# from a ``.nequip.zip`` package (classes re-imported by torch.package) match
_CONV_LAYER = "ConvNetLayer"  # one NequIP message-passing layer
_ALLEGRO_MODULE = "Allegro_Module"  # Allegro: strictly local, one cutoff
_FORCE_OUTPUT = ("ForceStressOutput", "PartialForceOutput")
_GHOST_HOOK = "NoOpGhostExchangeModule"  # nequip's per-interaction-block exchange hook
# nequip's data key for LAMMPS ML-IAP: its ``nlocal`` is the number of local (owned) nodes
_LOCAL_NODES_KEY = "lmp_mliap_data"


class _Halo:
    """What nequip's interaction blocks and the exchange hooks need of a layer-halo
    evaluation; travels in the data dict under nequip's ML-IAP key."""

    def __init__(self, exchange, nlocal: int):
        self.exchange = exchange  # graph.exchange
        self.nlocal = nlocal  # owned nodes: nequip's local ones


class _GhostExchange(torch.nn.Module):
    """nequip's ghost-exchange hook calling ``graph.exchange``.

    Stateless: the exchange comes with the data (``_Halo``), so one model can
    serve several adapters, and without it (nequip's own calculator, the full
    halo) the hook is a no-op, as nequip's own.
    """

    def __init__(self, field: str):
        super().__init__()
        self.field = field

    def forward(self, data: dict, ghost_included: bool = False) -> dict:
        halo = data.get(_LOCAL_NODES_KEY)
        if not isinstance(halo, _Halo):
            return data
        features = data[self.field]
        if ghost_included:
            features = features[: halo.nlocal]
        data[self.field] = halo.exchange(features)
        return data


def _install_ghost_exchange(model: torch.nn.Module) -> bool:
    """Replace nequip's no-op ghost-exchange hooks in ``model`` (in place) by
    ``_GhostExchange``; returns whether the model has hooks (NequIP's interaction
    blocks in recent nequip; Allegro has none)."""
    hooks = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child).__name__ in (_GHOST_HOOK, _GhostExchange.__name__)
    ]
    for parent, name, child in hooks:
        if not isinstance(child, _GhostExchange):
            setattr(parent, name, _GhostExchange(child.field))
    return bool(hooks)


def _load(model, model_key: str | None):
    """A nequip ``GraphModel`` from a module or a local file."""
    if isinstance(model, torch.nn.Module):
        return model
    path = os.fspath(model)
    if not os.path.exists(path):
        # nequip.net ids would be downloaded by nequip; fetch them yourself
        raise FileNotFoundError(f"no nequip model file at {path!r}")
    from nequip.model.saved_models.load_utils import load_saved_model
    from nequip.utils.global_state import set_global_state

    set_global_state()
    kwargs = {} if model_key is None else {"model_key": model_key}
    return load_saved_model(path, compile_mode="eager", **kwargs)


def _energy_module(graph_model: torch.nn.Module) -> torch.nn.Module:
    """The energy model inside nequip's force/stress wrapper."""
    inner = getattr(graph_model, "model", graph_model)  # GraphModel.model
    if type(inner).__name__ in _FORCE_OUTPUT:
        inner = inner.func
    return inner


def _type_lookup(type_names, species_map: Mapping[str, str] | None) -> dict[int, int]:
    """Atomic number -> model type index."""
    from ase.data import atomic_numbers

    if species_map is None:
        unknown = [name for name in type_names if name not in atomic_numbers]
        if unknown:
            raise ValueError(
                f"model type names {unknown} are not chemical symbols: pass "
                "chemical_species_to_atom_type_map={'Cu': 'my_Cu', ...}"
            )
        species_map = {name: name for name in type_names}
    index = {name: i for i, name in enumerate(type_names)}
    lookup = {}
    for symbol, type_name in species_map.items():
        if symbol not in atomic_numbers:
            raise ValueError(f"invalid chemical symbol {symbol!r}")
        if type_name not in index:
            raise ValueError(f"{symbol!r} maps to {type_name!r}, not in {list(type_names)}")
        lookup[atomic_numbers[symbol]] = index[type_name]
    return lookup


class NequIP(Addable, torch.nn.Module):
    """Any NequIP-framework model (NequIP, Allegro) as a ``ShardedCalculator`` model.

    Parameters
    ----------
    model : torch.nn.Module or path
        A nequip ``GraphModel`` (as nequip's model builders return, e.g.
        ``nequip.model.NequIPGNNModel`` or ``allegro.model.AllegroModel``), or
        the path of a local ``.ckpt`` / ``.nequip.zip`` file.
    chemical_species_to_atom_type_map : dict, optional
        ``{chemical symbol: model type name}``, as for nequip's calculator.
        Default: the model's type names are chemical symbols.
    num_layers : int, optional
        Message-passing depth. Default: the number of NequIP convolution
        layers, or 1 for Allegro (strictly local: its receptive field is one
        cutoff however many Allegro layers it has).
    model_key : str, optional
        Which model of a multi-model checkpoint/package to load.

    ``supports_layer_halo`` is true for message-passing models with nequip's
    ghost-exchange hooks, which the adapter fills in place (they stay no-ops
    outside a sharded evaluation).

    The model computes in the dtype it was built with (``model_dtype``);
    ``model.to(dtype=...)`` (as ``ShardedCalculator(dtype=...)`` does) moves
    it between devices but never casts it. Edge vectors are handed to nequip
    in float64, as nequip's own data pipeline does (nequip casts where its
    float32 layers need it); ``ShardedCalculator(..., dtype=torch.float64)``
    keeps them float64 all the way, otherwise they pass through the model's
    dtype first.
    Per-edge-type cutoffs are honoured by pruning edges as nequip's
    ``NeighborListPruneTransform`` does (with boolean masks, whose sizes a GPU
    run waits for at every step).
    """

    def __init__(
        self,
        model,
        *,
        chemical_species_to_atom_type_map: Mapping[str, str] | None = None,
        num_layers: int | None = None,
        model_key: str | None = None,
    ):
        super().__init__()
        model = _load(model, model_key).eval()
        self.model = model
        self.energy_model = _energy_module(model)

        metadata = model.metadata
        self.cutoff = float(metadata["r_max"])
        self.type_names = list(metadata["type_names"].split(" "))
        self._dtype = {"float32": torch.float32, "float64": torch.float64}[metadata["model_dtype"]]

        kinds = [type(m).__name__ for m in model.modules()]
        self.is_strictly_local = _ALLEGRO_MODULE in kinds and _CONV_LAYER not in kinds
        if num_layers is None:
            if self.is_strictly_local:
                num_layers = 1
            elif _CONV_LAYER in kinds:
                num_layers = kinds.count(_CONV_LAYER)
            else:
                raise ValueError(
                    "cannot tell this nequip model's message-passing depth: pass num_layers="
                )
        self.num_layers = int(num_layers)
        self.supports_layer_halo = (
            _install_ghost_exchange(self.energy_model) and self.num_layers > 1
        )

        lookup = _type_lookup(self.type_names, chemical_species_to_atom_type_map)
        self.atomic_types = tuple(sorted(lookup))
        table = torch.full((119,), -1, dtype=torch.int64)
        for z, index in lookup.items():
            table[z] = index
        self.register_buffer("_type_of_z", table, persistent=False)

        self._pruner = None
        per_edge_type_cutoff = metadata.get("per_edge_type_cutoff")
        if per_edge_type_cutoff is not None:
            from nequip.data.transforms import NeighborListPruneTransform
            from nequip.nn.embedding.utils import cutoff_str_to_fulldict

            if isinstance(per_edge_type_cutoff, str):
                # metadata holds "c_11 c_12 ..."; the pruner needs the dict
                per_edge_type_cutoff = cutoff_str_to_fulldict(
                    per_edge_type_cutoff, self.type_names
                )
            self._pruner = NeighborListPruneTransform(
                r_max=self.cutoff,
                per_edge_type_cutoff=per_edge_type_cutoff,
                type_names=self.type_names,
            )

    # -- dtype and device -------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        """The nequip model's dtype (fixed when it was built)."""
        return self._dtype

    def _apply(self, fn, recurse=True):
        # ``ShardedCalculator`` calls ``model.to(device=..., dtype=...)``, and
        # picks the dtype from the first parameter (float64 spline tables come
        # first in a float32 Allegro model). A nequip model is built for one
        # ``model_dtype`` and keeps float64 parts inside a float32 model, so a
        # cast would change its numerics: only the device move is applied.
        probe = fn(torch.zeros((), dtype=self._dtype))
        if probe.dtype != self._dtype:
            device = probe.device
            return super()._apply(lambda t: t.to(device), recurse)
        return super()._apply(fn, recurse)

    # -- evaluation -------------------------------------------------------
    def forward(self, graph: LocalGraph) -> torch.Tensor:
        n, n_owned = graph.n_atoms, graph.n_owned
        types = self._type_of_z[graph.numbers]
        edge_index, vectors = graph.edge_index, graph.edge_vectors
        if graph.hops is not None:
            # full halo: only the rows within num_layers hops (owned rows first, in
            # place) reach an owned energy, the types of the furthest ones included;
            # every listed edge is centred within num_layers - 1 hops
            types = types.index_select(0, graph.hops.order)
            edge_index = graph.hops.place[edge_index]
        data = {
            "atom_types": types,
            "edge_index": edge_index,
            "edge_vectors": vectors.to(torch.float64),
        }
        if self._pruner is not None:
            data = self._pruner(data)
        if graph.exchange is not None:
            # layer halo: every edge is centred on an owned atom; nequip's
            # interaction blocks compute the owned ("local") nodes and the
            # hooks fetch the ghosts' features
            data[_LOCAL_NODES_KEY] = _Halo(graph.exchange, n_owned)
        energies = self.energy_model(data)["atomic_energy"].view(-1)[:n_owned]
        return torch.cat([energies, energies.new_zeros(n - n_owned)])


class Allegro(NequIP):
    """``NequIP`` for an Allegro model, checked to be strictly local.

    Allegro's energy of atom ``i`` depends only on the edges centred on ``i``,
    so its receptive field is one cutoff (``num_layers = 1``) for any number
    of Allegro layers; this class refuses a model that passes messages.
    """

    def __init__(self, model, **kwargs):
        super().__init__(model, **kwargs)
        if not self.is_strictly_local or self.num_layers != 1:
            raise ValueError("not a strictly local (Allegro) nequip model")
