"""fairchem's UMA (``fairchem-core``) as a ``ShardedCalculator`` model.

``fairchem`` is imported lazily, so this module imports without it::

    from ase_shard import ShardedCalculator
    from ase_shard.models import UMA

    model = UMA("uma-s-1p1.pt", task="omat")   # a checkpoint file (weights are not downloaded)
    atoms.calc = ShardedCalculator(model)

The adapter loads the checkpoint with fairchem's own loader (the EMA weights and
the tasks' normalizers and element references, as ``MLIPPredictUnit`` does) and
runs the backbone's own modules (eSCN-MD with mixture-of-linear-experts: the
charge, spin and dataset embeddings, the expert routing, the edge-degree
embedding, the message-passing blocks and the final norm) and the task's energy
MLP on the rank's ``LocalGraph``, in place of fairchem's radius graph:

- fairchem's edge ``(source, target)`` carries messages into ``target`` and has
  the vector ``r_source - r_target``: it is our edge ``(centre, neighbour)``
  reversed, with our vector;
- the energy of atom ``i`` is the task's energy MLP on its final scalar
  features, denormalised (times the normaliser's ``rmsd``, plus its ``mean``
  shared equally by the atoms) plus its element's reference energy, so the owned
  atoms' energies sum to fairchem's total; forces and stress come from the
  calculator's gradient with respect to the edge vectors (fairchem's
  conservative forces and stress are the gradients of the same energy);
- the system-level inputs are ``ShardedCalculator`` system inputs: ``charge``
  and ``spin`` (``atoms.info``, defaulting as ``FAIRChemCalculator`` does: 0,
  and a multiplicity of 1 for ``omol``, else 0) and the element counts of the
  whole system, which the mixture of experts is routed by (the composition
  embedding averages over every atom, not the rank's).

Halo: the per-layer halo by default (one cutoff of ghosts): the node features
are exchanged after the edge-degree embedding and between blocks, ``blocks``
exchanges a step; every block is a message pass into the centre plus node-wise
work. With ``halo="full"`` the full halo of ``num_layers = blocks + 1``
cutoffs: the edge-degree embedding that starts the node features already sums
over each atom's neighbours, so after ``L`` blocks an energy depends on atoms
``L + 1`` cutoffs away; the blocks then skip the edges that cannot reach an
owned energy (``graph.hops``).

fairchem's ``max_neighbors`` cap (300 in UMA) keeps the nearest neighbours of a
crowded atom; the adapter does not rank neighbours and refuses a graph where an
atom has more neighbours than the cap within the cutoff (far denser than any
real material at UMA's 6 Å).
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from ase_shard.graph import LocalGraph
from ase_shard.models.sum import Addable

# fairchem's ranges for the total charge and the spin multiplicity
# (fairchem.core.units.mlip_unit.api.inference)
CHARGE_RANGE = (-100, 100)
SPIN_RANGE = (0, 100)


def _fairchem() -> None:
    try:
        import fairchem.core  # noqa: F401
    except ImportError as exc:  # pragma: no cover - exercised without fairchem only
        raise ImportError(
            "ase_shard.models.UMA needs the fairchem-core package (pip install fairchem-core)"
        ) from exc


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    """torch's default dtype set to ``dtype`` while inside.

    fairchem builds the backbone's constant buffers (the SO(3) grids, the
    coefficient mappings) in the default dtype, as ``MLIPPredictUnit`` does
    with its ``base_precision_dtype``: built in float32 and cast, they would
    round a float64 model.
    """
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def load_hydra_model(path: str | os.PathLike, dtype: torch.dtype) -> torch.nn.Module:
    """fairchem's ``HydraModel`` from an inference checkpoint, with its tasks, in ``dtype``.

    As ``MLIPPredictUnit`` loads one on the CPU: fairchem's compatibility
    fix-ups and the EMA weights, the backbone configured for inference without
    activation checkpointing, then the checkpoint's tasks (normalisers,
    element references).
    """
    _fairchem()
    from fairchem.core.units.mlip_unit.api.inference import InferenceSettings
    from fairchem.core.units.mlip_unit.utils import (
        get_backbone_class_from_checkpoint,
        load_inference_model,
    )

    checkpoint = torch.load(os.fspath(path), map_location="cpu", weights_only=False)
    settings = InferenceSettings(
        activation_checkpointing=False, merge_mole=False, compile=False, base_precision_dtype=dtype
    )
    overrides = {
        "backbone": get_backbone_class_from_checkpoint(checkpoint).build_inference_settings(
            settings
        )
    }
    with _default_dtype(dtype):
        wrapper, checkpoint = load_inference_model(
            os.fspath(path), use_ema=True, overrides=overrides, preloaded_checkpoint=checkpoint
        )
        model = wrapper.module
        model.setup_tasks(checkpoint.tasks_config)
    return model.to(dtype)


def element_counts(atoms, size: int) -> list[float]:
    """How many atoms of each atomic number (``0 .. size - 1``) the whole system has."""
    if len(atoms) != atoms.get_global_number_of_atoms():
        raise ValueError(
            "UMA routes its experts by the composition of the whole system: every rank "
            "must hold every atom (not DistributedAtoms)"
        )
    numbers = np.asarray(atoms.numbers)
    if len(numbers) and (numbers.min() < 0 or numbers.max() >= size):
        raise ValueError(f"UMA embeds atomic numbers below {size}, not {sorted(set(numbers))}")
    return np.bincount(numbers, minlength=size).astype(np.float64).tolist()


class UMA(Addable, torch.nn.Module):
    """A fairchem UMA potential following the ``ShardModel`` protocol.

    Parameters
    ----------
    model : str, os.PathLike or fairchem HydraModel
        An inference checkpoint file (``MLIPInferenceCheckpoint``, e.g. a
        downloaded ``uma-s-1p1.pt``), or a loaded ``HydraModel`` with its tasks
        set up (copied, not changed). Pretrained names are not resolved: this
        adapter downloads nothing.
    task : str, optional
        The task (dataset) whose energy head and dataset embedding to use:
        ``"omat"``, ``"omol"``, ``"oc20"``, ``"odac"``, ``"omc"`` for UMA;
        optional when the model has a single one.
    dtype : torch.dtype
        Precision the checkpoint is built in (float32, as fairchem's default
        inference, or float64); ``ShardedCalculator(..., dtype=...)`` casts it
        later, but fairchem's constant buffers are exact only when built in it.

    Attributes
    ----------
    cutoff : float
        The backbone's cutoff (Å): 6 for UMA.
    num_layers : int
        The backbone's blocks plus one (its edge-degree embedding): the full
        halo spans ``num_layers * cutoff``; the per-layer halo exchanges the node
        features ``num_layers - 1`` times a step.
    atomic_types : None
        Any atomic number the embedding has (``max_num_elements``, checked per
        call).
    task : str
    heads : tuple of str
        Every task of the model (what ``ase-shard info`` lists).
    max_neighbors : int
        fairchem's neighbour cap, refused when reached.
    backbone : torch.nn.Module
        fairchem's ``eSCNMDMoeBackbone`` (or ``eSCNMDBackbone``), in eval mode.
    energy_block : torch.nn.Module
        The task's energy MLP (per atom).
    """

    supports_layer_halo = True

    @staticmethod
    def tasks(path: str | os.PathLike) -> tuple[str, ...]:
        """The tasks (``task=`` choices) of an inference checkpoint file, read from its
        tasks config without building the model."""
        checkpoint = torch.load(os.fspath(path), map_location="cpu", weights_only=False)
        names = {name for task in checkpoint.tasks_config for name in task["datasets"]}
        return tuple(sorted(names))

    def __init__(self, model: Any, task: str | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        _fairchem()
        if isinstance(model, (str, os.PathLike)):
            if not os.path.isfile(model):
                raise ValueError(
                    f"UMA model {os.fspath(model)!r} is not a file: pass a fairchem inference "
                    "checkpoint (pretrained names are not downloaded here)"
                )
            hydra = load_hydra_model(model, dtype)
        elif isinstance(model, torch.nn.Module) and hasattr(model, "backbone"):
            hydra = copy.deepcopy(model)
        else:
            raise TypeError(
                "UMA expects a fairchem inference checkpoint file or a fairchem HydraModel, "
                f"not {type(model).__name__}"
            )
        try:
            datasets = hydra.dataset_to_tasks
        except (AttributeError, RuntimeError) as exc:
            raise ValueError("the fairchem model has no tasks: call setup_tasks first") from exc
        if task is None:
            if len(datasets) != 1:
                raise ValueError(
                    f"the model has several tasks: pass task= one of {sorted(datasets)}"
                )
            task = next(iter(datasets))
        if task not in datasets:
            raise ValueError(f"unknown task {task!r}: the model has {sorted(datasets)}")
        self.task = str(task)
        self.heads = tuple(sorted(datasets))
        backbone = hydra.backbone
        self._check_backbone(backbone)
        backbone.backend.prepare_model_for_inference(backbone)
        self.backbone = backbone
        self.energy_block = self._energy_block(hydra, self.task)
        energy, derivatives = self._energy_task(hydra, self.task)
        rmsd = energy.normalizer.rmsd.detach().double()
        for other in derivatives:
            same = torch.equal(other.normalizer.rmsd.detach().double(), rmsd)
            if not same or float(other.normalizer.mean) != 0.0:
                raise ValueError(
                    f"task {other.name!r} is not scaled as the energy's gradient "
                    "(its normaliser differs from the energy's): not a conservative model"
                )
        self.register_buffer("rmsd", energy.normalizer.rmsd.detach().clone().reshape(()))
        self.register_buffer("mean", energy.normalizer.mean.detach().clone().reshape(()))
        references = torch.zeros(backbone.max_num_elements)
        if energy.element_references is not None:
            refs = energy.element_references.element_references.detach().reshape(-1)
            references = torch.zeros(max(len(refs), backbone.max_num_elements), dtype=refs.dtype)
            references[: len(refs)] = refs
        self.register_buffer("references", references)
        self.cutoff = float(backbone.cutoff)
        self.num_layers = len(backbone.blocks) + 1
        self.atomic_types: Sequence[int] | None = None
        self.max_neighbors = int(backbone.max_neighbors)
        self.experts = int(getattr(backbone, "num_experts", 0))
        size = int(backbone.max_num_elements)
        spin = 1 if self.task == "omol" else 0
        names = ["charge", "spin"]
        defaults: dict[str, Any] = {
            "charge": lambda atoms: 0,
            "spin": lambda atoms: spin,
        }
        # the whole system's element counts: for the composition embedding, and for
        # the atoms' shares of the normaliser's mean
        composition = self.experts and getattr(backbone, "use_composition_embedding", False)
        if composition or float(self.mean) != 0.0:
            names.append("uma_element_counts")
            defaults["uma_element_counts"] = lambda atoms: element_counts(atoms, size)
        self.system_inputs = tuple(names)
        self.system_input_defaults = defaults
        self.to(dtype)
        self.eval()

    @staticmethod
    def _check_backbone(backbone: torch.nn.Module) -> None:
        """Refuse what does not split into atoms."""
        config = getattr(backbone, "regress_config", None)
        if config is None or not hasattr(backbone, "blocks"):
            raise ValueError(
                f"not a UMA (eSCN-MD) backbone: {type(backbone).__name__}; the adapter runs "
                "fairchem's eSCNMDBackbone and eSCNMDMoeBackbone"
            )
        if config.direct_forces:
            raise ValueError(
                "a direct-force model: its forces are not the energy's gradient, which is "
                "what the adapter computes; use a conservative (autograd) UMA checkpoint"
            )
        if (
            backbone.charge_channel_end > backbone.charge_channel_start
            or backbone.spin_channel_end > backbone.spin_channel_start
        ):
            raise ValueError(
                "charge/spin-balanced channels sum features over the whole system in every "
                "block: not a local model, it cannot be split into atoms"
            )

    @staticmethod
    def _energy_task(hydra: torch.nn.Module, task: str):
        """The task's energy task, and its forces and stress tasks."""
        tasks = hydra.dataset_to_tasks[task]
        energy = [t for t in tasks if t.property == "energy"]
        if len(energy) != 1:
            raise ValueError(f"task {task!r} has {len(energy)} energy outputs, not one")
        return energy[0], [t for t in tasks if t.property in ("forces", "stress")]

    @staticmethod
    def _energy_block(hydra: torch.nn.Module, task: str) -> torch.nn.Module:
        """The energy MLP of the head that serves ``task``'s energy, for one atom at a time.

        UMA's heads wrap an ``MLP_EFS_Head`` per dataset: as a shared head
        (``DatasetSpecificSingleHeadWrapper``) or one expert per dataset
        (``DatasetSpecificMoEWrapper``), merged here for the task as fairchem
        merges it for single-task inference (its one-hot expert).
        """
        for head in hydra.output_heads.values():
            inner = getattr(head, "head", None)
            names = getattr(head, "dataset_names", ())
            if inner is None or task not in names or not hasattr(inner, "energy_block"):
                continue
            if getattr(inner, "reduce", "sum") != "sum":
                raise ValueError(
                    "the energy head averages over atoms: per-atom energies need a sum"
                )
            if hasattr(head, "dataset_name_to_exp"):
                dtype = next(head.parameters()).dtype
                head.merge_MOLE_model(
                    SimpleNamespace(dataset=[task], pos=torch.zeros(1, 3, dtype=dtype))
                )
            return inner.energy_block
        raise ValueError(
            f"no energy head (an MLP_EFS_Head in a dataset wrapper) serves task {task!r}"
        )

    def train(self, mode: bool = True) -> UMA:
        # an inference adapter: fairchem's modules stay in eval mode
        return super().train(False)

    def _system(self, graph: LocalGraph) -> tuple[torch.Tensor, torch.Tensor]:
        """The total charge and spin multiplicity, as fairchem's integer tensors."""
        values = []
        for name, (low, high) in (("charge", CHARGE_RANGE), ("spin", SPIN_RANGE)):
            value = graph.system[name].reshape(-1)
            if value.numel() != 1 or float(value) != round(float(value)):
                raise ValueError(f"UMA's {name} must be one integer, not {value.tolist()}")
            if not low <= float(value) <= high:
                raise ValueError(
                    f"UMA's {name} must be within {low} to {high}, not {float(value)}"
                )
            values.append(value.round().to(torch.int64))
        return values[0], values[1]

    def forward(self, graph: LocalGraph) -> torch.Tensor:
        net = self.backbone
        vectors = graph.edge_vectors
        n, n_owned = graph.n_atoms, int(graph.n_owned)
        exchange = graph.exchange
        if n_owned == 0:
            if exchange is None:
                return vectors.new_zeros(n)
            # the exchanges are collective: join each one, with no rows, and keep the
            # result on the autograd path so that the backward joins them too
            x = vectors.new_zeros((0, net.sph_feature_size, net.sphere_channels))
            for _ in range(self.num_layers - 1):
                x = exchange(x)
            return torch.cat([x[:0].sum(dim=(1, 2)), vectors.new_zeros(n)])
        numbers = graph.numbers
        device = numbers.device
        if int(numbers.max()) >= net.max_num_elements:
            raise ValueError(f"UMA embeds atomic numbers below {net.max_num_elements}")
        centre, neighbour = graph.edge_index
        if centre.numel() and int(torch.bincount(centre).max()) > self.max_neighbors:
            raise ValueError(
                f"an atom has more than the model's max_neighbors={self.max_neighbors} "
                f"neighbours within {self.cutoff} Å: fairchem would keep only the nearest, "
                "which this adapter does not do"
            )
        charge, spin = self._system(graph)
        batch = torch.zeros(n, dtype=torch.int64, device=device)
        csd = net.csd_embedding(charge=charge, spin=spin, dataset=[self.task])
        if self.experts:
            if "uma_element_counts" in graph.system:
                # the whole system's atomic numbers (sorted: the mean is over all of them)
                counts = graph.system["uma_element_counts"].round().to(torch.int64)
                every = torch.repeat_interleave(
                    torch.arange(len(counts), device=device), counts.to(device)
                )
            else:
                every = numbers
            net.set_MOLE_coefficients(
                atomic_numbers_full=every,
                batch_full=torch.zeros_like(every),
                csd_mixed_emb=csd,
            )
        edges = self._layer_edges(graph)
        # fairchem's edges come sorted by their target (the centre), which its scatters
        # into the nodes run faster on: sort ours alike within each hop prefix
        bounds = torch.tensor(sorted(set(edges)), device=device)
        prefix = torch.bucketize(torch.arange(centre.shape[0], device=device), bounds, right=True)
        order = torch.argsort(prefix * n + centre, stable=True)
        centre, neighbour = centre.index_select(0, order), neighbour.index_select(0, order)
        vectors = vectors.index_select(0, order)
        # fairchem's edges: (source, target) = (neighbour, centre), vector r_source - r_target
        edge_index = torch.stack([neighbour, centre])
        if edge_index.shape[1] == 0:
            # as fairchem does for a system without edges: one self-loop beyond the cutoff
            # (its envelope is zero), as its SO(2) layers do not take empty inputs
            edge_index = torch.zeros((2, 1), dtype=torch.int64, device=device)
            vectors = vectors.new_full((1, 3), 1.0 + self.cutoff)
            edges = [1] * self.num_layers
        distance = torch.linalg.vector_norm(vectors, dim=-1)
        wigner, wigner_inv = net._get_rotmat_and_wigner(vectors)
        coefficient_index = net.coefficient_index if net.mmax != net.lmax else None
        wigner, wigner_inv = net.backend.prepare_wigner(
            wigner, wigner_inv, net.mappingReduced, coefficient_index
        )
        x = torch.zeros(
            n, net.sph_feature_size, net.sphere_channels, device=device, dtype=vectors.dtype
        )
        x[:, 0, :] = net.sphere_embedding(numbers)
        sys_node_embedding = csd[batch]
        x[:, 0, :] = x[:, 0, :] + sys_node_embedding
        envelope = net.envelope(distance / net.cutoff).reshape(-1, 1)
        x_edge = torch.cat(
            (
                net.distance_expansion(distance),
                net.source_embedding(numbers[edge_index[0]]),
                net.target_embedding(numbers[edge_index[1]]),
            ),
            dim=1,
        )
        if wigner_inv.ndim == 3:
            envelope = envelope.unsqueeze(-1)
        wigner_inv_envelope = wigner_inv * envelope
        # message-passing step k (the edge-degree embedding, then each block) needs
        # the edges centred within num_layers - 1 - k hops of an owned atom
        k = edges[0]
        net.set_MOLE_sizes(nsystems=1, batch_full=batch, edge_index=edge_index[:, :k])
        x = net.edge_degree_embedding(x, x_edge[:k], edge_index[1, :k], wigner_inv_envelope[:k])
        x_edge_per_layer = net.backend.get_layer_radial_emb(x_edge, net)
        for i, block in enumerate(net.blocks):
            if exchange is not None:
                # per-layer halo: every edge is centred on an owned atom, so only the
                # owned rows are complete; the ghosts take their owners' features
                x = exchange(x[:n_owned])
            k = edges[i + 1]
            net.set_MOLE_sizes(nsystems=1, batch_full=batch, edge_index=edge_index[:, :k])
            x = block(
                x,
                x_edge_per_layer[i][:k],
                edge_index[:, :k],
                wigner[:k],
                wigner_inv_envelope[:k],
                total_atoms_across_gp_ranks=n,
                sys_node_embedding=sys_node_embedding,
                scatter_target=edge_index[1, :k],
                gp_ctx=None,
            )
        if exchange is not None:
            # the ghosts' rows are incomplete and nothing reads their energies
            x, numbers = x[:n_owned], numbers[:n_owned]
        x = net.norm(x)
        node_energy = self.energy_block(x.narrow(1, 0, 1).squeeze(1)).reshape(-1)
        energies = node_energy * self.rmsd + self.references[numbers].to(node_energy.dtype)
        if "uma_element_counts" in graph.system:
            # the normaliser's mean is per system: each atom takes an equal share
            energies = energies + self.mean / graph.system["uma_element_counts"].sum()
        return torch.cat([energies, energies.new_zeros(n - energies.shape[0])])

    def _layer_edges(self, graph: LocalGraph) -> list[int]:
        """Per message-passing step, how many edges (a prefix of ``edge_index``) it needs.

        With the full halo's ``graph.hops`` (edges sorted by their centre's hop
        count) step ``k`` needs only the edges centred within
        ``num_layers - 1 - k`` hops of an owned atom; the others cannot reach
        an owned energy. Without ``hops`` every step takes every edge.
        """
        n_edges = graph.edge_index.shape[1]
        if graph.hops is None:
            return [n_edges] * self.num_layers
        # at least one edge: fairchem's SO(2) layers do not take empty inputs, and an
        # edge centred further out changes only ghosts that nothing reads
        return [
            max(graph.hops.edges[self.num_layers - 1 - k], min(n_edges, 1))
            for k in range(self.num_layers)
        ]
