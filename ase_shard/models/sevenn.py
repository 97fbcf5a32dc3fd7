"""SevenNet (``sevenn``) as a ``ShardedCalculator`` model.

``sevenn`` is imported lazily, so this module imports without it::

    from ase_shard import ShardedCalculator
    from ase_shard.models.sevenn import SevenNet

    atoms.calc = ShardedCalculator(SevenNet("7net-0"))   # the checkpoint shipped in the wheel

The adapter runs the SevenNet network itself (its ``AtomGraphSequential`` modules from the
edge embedding to the per-species energy rescale) on the rank's ``LocalGraph``: the graph's
``edge_vectors`` become SevenNet's ``EDGE_VEC`` directly, so forces and stress come from the
calculator's one gradient with respect to them, exactly as SevenNet's own
``ForceStressOutputFromEdge`` takes them from ``dE/d EDGE_VEC``. SevenNet's reduction to a
total energy and its force/stress output modules are not run.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from ase.data import atomic_numbers

from ase_shard.graph import LocalGraph
from ase_shard.models.sum import Addable

# module classes of an AtomGraphSequential that the adapter does not run:
# positions -> edge vectors (the calculator supplies the vectors), the sum to a total
# energy, and the force/stress outputs (the calculator differentiates)
_SKIPPED_MODULES = frozenset(
    {
        "EdgePreprocess",
        "AtomReduce",
        "ForceOutput",
        "ForceOutputFromEdge",
        "ForceStressOutput",
        "ForceStressOutputFromEdge",
        "_ModalInputPrepare",
    }
)


# node-level entries of SevenNet's data dict (sevenn._keys)
_NODE_KEYS = ("x", "node_attr", "atom_type", "atomic_numbers", "self_cont_tmp")


def _cast_outputs(module: torch.nn.Module, data: dict, dtype: torch.dtype) -> None:
    """Cast the floating outputs of a sevenn ``OnehotEmbedding`` to ``dtype`` in ``data``."""
    for key in (module.key_output, getattr(module, "key_additional_output", None)):
        if key is not None and data[key].is_floating_point() and data[key].dtype != dtype:
            data[key] = data[key].to(dtype)


def _checkpoint(model: str | os.PathLike):
    """sevenn's checkpoint of a path or pretrained name (the network not yet built)."""
    import sevenn.util

    # load_checkpoint takes an existing file as is; otherwise it resolves a pretrained
    # name (e.g. "7net-0") to the checkpoint shipped inside the sevenn package
    return sevenn.util.load_checkpoint(os.fspath(model))


def _config_modal_map(config: dict) -> dict | None:
    """The fidelities a checkpoint's config declares (``None``: a single one)."""
    return config.get("_modal_map") if config.get("use_modality") else None


def _modal_index(modal_map: dict | None, modal: str | None) -> int | None:
    """The index of fidelity ``modal`` (case-insensitive) in ``modal_map``; ``None`` for a
    single-fidelity model. A missing or unknown fidelity raises ``ValueError``."""
    if not modal_map:
        if modal is not None:
            raise ValueError(f"modal={modal!r} given, but the model has a single fidelity")
        return None
    if modal is None:
        raise ValueError(f"the model is multi-fidelity: pass modal= one of {list(modal_map)}")
    by_lower = {str(name).lower(): index for name, index in modal_map.items()}
    if modal.lower() not in by_lower:
        raise ValueError(f"unknown modal {modal!r}; the model has {list(modal_map)}")
    return int(by_lower[modal.lower()])


def _load_sevenn_model(model: Any, modal: str | None) -> tuple[torch.nn.Module, dict | None]:
    """An ``AtomGraphSequential`` (and its config) from a path, pretrained name or module.

    A checkpoint's fidelities are checked against ``modal`` before its network is
    built, which takes seconds.
    """
    from sevenn.nn.sequential import AtomGraphSequential

    if isinstance(model, AtomGraphSequential):
        return model, None
    if isinstance(model, (str, os.PathLike)):
        checkpoint = _checkpoint(model)
        _modal_index(_config_modal_map(checkpoint.config), modal)
        return checkpoint.build_model(), checkpoint.config
    raise TypeError(
        "SevenNet expects a checkpoint path, a pretrained name such as '7net-0' or a "
        f"sevenn AtomGraphSequential, not {type(model).__name__}"
    )


def _tensors_as_buffers(network: torch.nn.Module) -> None:
    """Register the plain tensor attributes of ``network``'s modules as buffers.

    sevenn keeps e.g. a non-trainable Bessel basis's coefficients as a plain
    attribute, which ``Module.to`` neither moves nor casts: on a GPU the
    forward would mix devices, in float64 it would use float32 coefficients.
    Non-persistent, so the state dict (and a checkpoint) stays as it was.
    """
    for module in network.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                delattr(module, name)
                module.register_buffer(name, value, persistent=False)


@dataclass(frozen=True)
class CheckpointOutline:
    """What a SevenNet checkpoint's config says of the adapter built from it (for
    ``ase-shard info``, without building the network: that takes seconds)."""

    cutoff: float  # Å
    num_layers: int
    atomic_types: tuple[int, ...]  # atomic numbers
    heads: tuple[str, ...]  # fidelities of a multi-fidelity checkpoint, else empty
    supports_layer_halo: bool = True


class SevenNet(Addable, torch.nn.Module):
    """A SevenNet potential (sevenn) following the ``ShardModel`` protocol.

    Parameters
    ----------
    model : str, os.PathLike or sevenn.nn.sequential.AtomGraphSequential
        A SevenNet checkpoint file, the name of a pretrained model whose checkpoint
        is available locally (``"7net-0"`` ships inside the ``sevenn`` package), or
        an already built model (it must carry ``type_map`` and ``cutoff``). A given
        module is used as is (not copied): it is put in eval mode and switched to
        unbatched input.
    modal : str, optional
        The fidelity of a multi-fidelity checkpoint (e.g. ``"PBE"`` or ``"R2SCAN"``
        for ``7net-mf-0``); required when the model has several, case-insensitive.

    Attributes
    ----------
    cutoff : float
        The model's radial cutoff (Å).
    num_layers : int
        Number of SevenNet convolution (interaction) layers.
    atomic_types : tuple of int
        Atomic numbers in the model's type map.
    model : AtomGraphSequential
        The wrapped network. Its dtype is whatever it was built with (SevenNet
        checkpoints are float32); ``ShardedCalculator(..., dtype=...)`` casts it.

    With a per-layer halo the node features entering every convolution after
    the first are taken from the atoms' owners (``graph.exchange``).
    """

    supports_layer_halo = True

    @staticmethod
    def outline(model: str | os.PathLike = "7net-0") -> CheckpointOutline:
        """A checkpoint's reach, elements and fidelities, read from its config (the
        network it builds has these: ``test_sevenn`` checks it for 7net-0)."""
        config = _checkpoint(model).config
        return CheckpointOutline(
            cutoff=float(config["cutoff"]),
            num_layers=int(config["num_convolution_layer"]),
            atomic_types=tuple(sorted(atomic_numbers[s] for s in config["chemical_species"])),
            heads=tuple(str(name) for name in _config_modal_map(config) or ()),
        )

    def __init__(self, model: Any = "7net-0", *, modal: str | None = None):
        super().__init__()
        network, config = _load_sevenn_model(model, modal)
        if network.type_map is None:
            raise ValueError("the SevenNet model has no type_map")
        cutoff = float(network.cutoff)
        if cutoff <= 0.0 and config is not None:
            cutoff = float(config.get("cutoff", 0.0))
        if cutoff <= 0.0:
            raise ValueError("the SevenNet model's cutoff is not set")
        network.set_is_batch_data(False)
        network.eval()
        _tensors_as_buffers(network)
        self.model = network
        self.cutoff = cutoff
        self.num_layers = sum(
            1 for module in network._modules.values() if "Convolution" in type(module).__name__
        )
        if self.num_layers < 1:
            raise ValueError("found no convolution layer in the SevenNet model")
        type_map = {int(z): int(index) for z, index in network.type_map.items()}
        self.atomic_types: Sequence[int] = tuple(sorted(type_map))
        z_to_type = torch.full((max(self.atomic_types) + 1,), -1, dtype=torch.int64)
        for z, index in type_map.items():
            z_to_type[z] = index
        self.register_buffer("z_to_type", z_to_type, persistent=False)
        self.modal = _modal_index(network.modal_map, modal)
        self._modules_to_run = [
            name
            for name, module in network._modules.items()
            if type(module).__name__ not in _SKIPPED_MODULES
        ]
        self.eval()

    def train(self, mode: bool = True) -> SevenNet:
        # an inference adapter: SevenNet's modules stay in eval mode
        return super().train(False)

    def _layer_edges(self, graph: LocalGraph) -> list[int]:
        """Per convolution, how many edges (a prefix of ``edge_index``) it needs.

        Messages flow from ``edge_index[1]`` into the centre ``edge_index[0]``. The
        last convolution needs only edges centred on owned atoms, the one before also
        those centred on their neighbours, and so on: edges centred
        ``num_layers - 1 - k`` or more hops from every owned atom cannot change an
        owned energy through convolution ``k``, so the full halo's ``graph.hops``
        (edges sorted by hop count) lets it skip them with a slice. Owned energies
        and their gradients are unchanged; ghost energies, which the calculator
        discards, are not meaningful. Without ``hops`` every convolution takes
        every edge (with the per-layer halo all are centred on owned atoms).
        """
        if graph.hops is None:
            return [graph.edge_index.shape[1]] * self.num_layers
        return [graph.hops.edges[self.num_layers - 1 - k] for k in range(self.num_layers)]

    def forward(self, graph: LocalGraph) -> torch.Tensor:
        import sevenn._keys as KEY

        numbers = graph.numbers
        device = numbers.device
        layer_edges = self._layer_edges(graph)
        data: dict[str, Any] = {
            # SevenNet's own preprocessing: atomic number -> one-hot index
            KEY.NODE_FEATURE: self.z_to_type[numbers],
            KEY.ATOMIC_NUMBERS: numbers,
            KEY.EDGE_IDX: graph.edge_index,
            KEY.EDGE_VEC: graph.edge_vectors,
            # filled on the device: a copy from the host would wait for queued work
            KEY.NUM_ATOMS: torch.full((), graph.n_atoms, dtype=torch.int64, device=device),
        }
        if self.modal is not None:
            data[KEY.MODAL_TYPE] = torch.full((), self.modal, dtype=torch.int64, device=device)
        edge_keys = (KEY.EDGE_IDX, KEY.EDGE_ATTR, KEY.EDGE_EMBEDDING)
        full_edges: dict[str, torch.Tensor] = {}
        modules = self.model._modules
        layer = 0
        for name in self._modules_to_run:
            module = modules[name]
            kind = type(module).__name__
            convolution = "Convolution" in kind
            if convolution:
                if layer and graph.exchange is not None:
                    features = data[KEY.NODE_FEATURE]
                    data[KEY.NODE_FEATURE] = graph.exchange(features[: graph.n_owned])
                if not full_edges:
                    full_edges = {key: data[key] for key in edge_keys}
                for key in edge_keys:
                    dim = 1 if key == KEY.EDGE_IDX else 0
                    data[key] = full_edges[key].narrow(dim, 0, layer_edges[layer])
                layer += 1
            data = module(data)
            if kind == "OnehotEmbedding":
                # sevenn's one-hot embedding always returns float32; follow the model's dtype
                _cast_outputs(module, data, graph.edge_vectors.dtype)
            if convolution and graph.exchange is not None:
                # per-layer halo: ghosts need no node-wise work, the next exchange
                # refreshes them; from here on node tensors hold the owned atoms only
                for key in _NODE_KEYS:
                    if key in data:
                        data[key] = data[key][: graph.n_owned]
        energies = data[KEY.ATOMIC_ENERGY].reshape(-1)
        return torch.cat([energies, energies.new_zeros(graph.n_atoms - energies.shape[0])])
