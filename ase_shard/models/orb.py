"""Orb-v3 (``orb-models``), conservative, as a ``ShardedCalculator`` model.

``orb_models`` is imported lazily, so this module imports without it::

    from ase_shard import ShardedCalculator
    from ase_shard.models import Orb

    atoms.calc = ShardedCalculator(Orb(network))        # a ConservativeForcefieldRegressor
    atoms.calc = ShardedCalculator(Orb("orb-v3-conservative-inf-omat-20250404.ckpt"))

The adapter runs orb's own modules on the rank's ``LocalGraph``, in place of
orb's ``ase_atoms_to_atom_graphs`` and ``ConservativeForcefieldRegressor.forward``:
the GNS backbone (``MoleculeGNS``: embeddings, Bessel and spherical-harmonic
edge features, attention interaction layers), the energy head's MLP and
normaliser, its fixed per-element reference energies and the ZBL pair
repulsion. Forces and stress come from the calculator's gradient with respect
to the edge vectors, as orb's come from positions and a strain.

Three things about Orb-v3 shape the adapter:

- **The energy is not a sum of atomic energies.** Orb's energy head reads out
  the *mean* of all atoms' final features through an MLP:
  ``E = N * f(mean_i h_i) + sum_i ref(Z_i) + mean_i V_i`` (``f``: MLP and
  de-normalisation; ``V_i``: atom ``i``'s ZBL pair energy, which orb also
  averages). Each rank adds its owned atoms' ``h_i`` and the calculator sums
  them over ranks (``LocalGraph.system_sum``, one small collective per step).
  Atom ``i``'s energy is then ``f(mean h) + ref(Z_i) + V_i / N`` plus a term
  that is zero in value and whose gradient is ``f'(mean h) . dh_i``: the
  owned energies add up to orb's energy and their gradients to orb's forces
  and stress. The per-atom energies are this adapter's split (orb defines
  none): an equal share of the network's energy, each atom's reference
  energy, and its ZBL share.
- **Messages flow both ways along an edge.** An interaction layer updates a
  node from the edges it sends *and* those it receives, so after one layer a
  node depends on the edges centred on its neighbours too. Each edge enters
  orb's layers twice, summed into its sender only and (as the reverse of one
  of the receiver's own edges) into its receiver only (:meth:`Orb._features`):
  on several ranks a ghost's edge may end on a far image of an owned atom,
  folded onto the owned node. And orb keeps, per
  centre, only its ``max_num_neighbors`` nearest neighbours within the radius
  (120 for the ``inf`` models, which in practice keeps every one, 20 for the
  ``20`` models, which drops many), so whether an edge into a node exists
  depends on the *neighbour's* ranking of its own neighbours. Both need the
  complete neighbour lists of the nodes one hop beyond those whose features
  matter: the adapter declares ``num_layers`` = message-passing steps + 1, so
  the full halo lists every edge of every node within that many hops, and
  applies orb's per-centre cap to those edges (nearest first, as orb's
  neighbour search; pairs at exactly equal distances at the cap may be broken
  differently, as between orb's own neighbour-search methods).
- **Orb's radius graph includes pairs up to ``radius + 1e-6`` Å**; the calculator
  lists pairs shorter than ``cutoff``. The difference is nothing: orb's
  attention weights and edge features vanish at the radius.

Only the conservative models (``ConservativeForcefieldRegressor``) are
supported. Orb's direct models predict forces (and stress) as outputs of the
network, minus the system's mean force (and, for molecules, its net torque):
``ShardedCalculator``'s model protocol returns per-atom energies, from whose
gradient it takes forces, so it has no place for them (see docs/models.md).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch

from ase_shard.graph import LocalGraph

PREFIX = "orb-v3-conservative-"


def _orb():
    """``orb_models.forcefield``'s pretrained module, or a clear ImportError."""
    try:
        from orb_models.forcefield import pretrained
    except ImportError as exc:  # pragma: no cover - exercised without orb-models only
        raise ImportError(
            "ase_shard.models.Orb needs the orb-models package (pip install orb-models)"
        ) from exc
    return pretrained


def conservative_names() -> tuple[str, ...]:
    """Orb's pretrained conservative Orb-v3 model names (``orb-v3-conservative-...``)."""
    return tuple(name for name in _orb().ORB_PRETRAINED_MODELS if name.startswith(PREFIX))


def architecture_of(path: str) -> str:
    """The pretrained model a checkpoint's file name starts with (orb's own names, such
    as ``orb-v3-conservative-inf-omat-20250404.ckpt``), or ``ValueError``."""
    stem = os.path.basename(path)
    names = _orb().ORB_PRETRAINED_MODELS
    # the longest match: "orb-v3-conservative-inf-omat" before any shorter name
    matches = sorted((name for name in names if stem.startswith(name)), key=len)
    if not matches:
        raise ValueError(
            f"cannot tell the Orb architecture of {path!r}: orb checkpoints hold weights only; "
            "name the architecture, Orb(path, architecture='orb-v3-conservative-inf-omat'), "
            "or keep orb's file name (it starts with the model's name)"
        )
    return matches[-1]


def _load_orb(model: Any, architecture: str | None) -> torch.nn.Module:
    """An orb regressor from a module, a checkpoint file, or a pretrained name."""
    pretrained = _orb()
    if isinstance(model, torch.nn.Module):
        return model
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(
            "Orb expects an orb regressor (ConservativeForcefieldRegressor), a checkpoint "
            f"file or a pretrained model name, not {type(model).__name__}"
        )
    name = os.fspath(model)
    names = pretrained.ORB_PRETRAINED_MODELS
    if os.path.isfile(name):
        weights, architecture = name, architecture or architecture_of(name)
    elif name in names:
        # orb's default weights address: loads from orb's download cache where they are
        weights, architecture = None, name
    else:
        raise ValueError(
            f"Orb model {name!r} is neither a checkpoint file nor a pretrained name "
            f"({', '.join(conservative_names())})"
        )
    if architecture not in names:
        raise ValueError(f"unknown Orb architecture {architecture!r}")
    builder = names[architecture]
    options = {"device": "cpu", "precision": "float32-highest", "compile": False}
    saved = torch.get_default_dtype()
    try:
        # orb's loader sets torch's default dtype for the whole process: put it back
        if weights is None:
            return builder(**options)
        return builder(weights_path=weights, **options)
    finally:
        torch.set_default_dtype(saved)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    """torch's default dtype set to ``dtype`` while inside."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


# Å: edge vectors are matched on a grid this fine; two atoms are never this close
# (the calculator refuses coincident ones)
MATCH_GRID = 2.0**-20


def reverse_edges(edge_index: torch.Tensor, edge_vectors: torch.Tensor) -> torch.Tensor:
    """Each edge's reverse: the listed edge centred on its neighbour with the opposite vector.

    ``-1`` where the neighbour has no such listed edge (it centres none: it is
    beyond the halo's last hop). Vectors are compared on a grid of
    :data:`MATCH_GRID` Å (edges through periodic images are opposite only to
    round-off; a pair that straddles a grid line is left unmatched, as if its
    neighbour listed no edges).
    """
    n_edges = edge_index.shape[1]
    grid = torch.round(edge_vectors / MATCH_GRID).to(torch.int64)
    centre, neighbour = edge_index
    keys = torch.cat(
        [
            torch.cat([centre[:, None], grid], dim=1),
            torch.cat([neighbour[:, None], -grid], dim=1),
        ]
    )
    _, key = torch.unique(keys, dim=0, return_inverse=True)
    # an edge's own key is unique (one neighbour at one place around a centre)
    edge_of_key = torch.full((2 * n_edges,), -1, dtype=torch.int64, device=centre.device)
    edge_of_key[key[:n_edges]] = torch.arange(n_edges, device=centre.device)
    return edge_of_key[key[n_edges:]]


def capped_edges(centre: torch.Tensor, lengths: torch.Tensor, cap: int) -> torch.Tensor:
    """Indices of the edges among each centre's ``cap`` shortest (orb's neighbour cap)."""
    n_edges = centre.shape[0]
    order = torch.argsort(lengths, stable=True)
    order = order[torch.argsort(centre[order], stable=True)]
    sorted_centre = centre[order]
    counts = torch.bincount(sorted_centre)
    start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(n_edges, device=centre.device) - start[sorted_centre]
    return torch.sort(order[rank < cap]).values


class Orb(torch.nn.Module):
    """An Orb-v3 conservative potential (orb-models) following the ``ShardModel`` protocol.

    Parameters
    ----------
    model : str, os.PathLike or orb_models ConservativeForcefieldRegressor
        A built regressor (used as is, not copied), a checkpoint file (orb's
        ``.ckpt``: weights only, for the architecture that its name starts
        with or ``architecture``), or a pretrained name such as
        ``"orb-v3-conservative-inf-omat"`` (from orb's download cache: there
        is no download here).
    architecture : str, optional
        The pretrained name whose architecture a checkpoint file holds.
    max_num_neighbors : int, optional
        Orb's per-centre neighbour cap; default the model's ``system_config``.
    radius : float, optional
        Orb's graph radius in Å; default the model's ``system_config``.

    Attributes
    ----------
    cutoff : float
        Orb's graph radius (Å): 6 for Orb-v3.
    message_passing_steps : int
        Orb's interaction layers (5 for Orb-v3).
    num_layers : int
        ``message_passing_steps + 1``: the halo also covers the complete
        neighbour lists of the last hop's nodes (see the module's notes).
    max_num_neighbors : int
    atomic_types : tuple of int
        1-117 (orb's 118 one-hot classes are indexed by atomic number).
    model : orb_models ConservativeForcefieldRegressor
        The wrapped network; ``ShardedCalculator(..., dtype=...)`` casts it.
    """

    supports_layer_halo = False
    # the padded graphs of compile=... add spare owned rows, which would enter the mean
    supports_compile = False
    system_inputs: tuple[str, ...] = ()

    def __init__(
        self,
        model: Any = "orb-v3-conservative-inf-omat",
        *,
        architecture: str | None = None,
        max_num_neighbors: int | None = None,
        radius: float | None = None,
    ):
        super().__init__()
        network = _load_orb(model, architecture)
        from orb_models.forcefield.conservative_regressor import ConservativeForcefieldRegressor
        from orb_models.forcefield.direct_regressor import DirectForcefieldRegressor

        if isinstance(network, DirectForcefieldRegressor):
            raise NotImplementedError(
                "Orb's direct models (DirectForcefieldRegressor) predict forces as network "
                "outputs, not as the gradient of an energy: ShardedCalculator's models return "
                "per-atom energies and it takes forces from their gradient, so only the "
                "conservative Orb-v3 models (orb-v3-conservative-*) are supported"
            )
        if not isinstance(network, ConservativeForcefieldRegressor):
            raise TypeError(
                "Orb expects an orb_models ConservativeForcefieldRegressor, not "
                f"{type(network).__name__}"
            )
        config = network.system_config
        if config is None and (radius is None or max_num_neighbors is None):
            raise ValueError(
                "the Orb model has no system_config: give radius and max_num_neighbors"
            )
        self.cutoff = float(radius if radius is not None else config.radius)
        self.max_num_neighbors = int(
            max_num_neighbors if max_num_neighbors is not None else config.max_num_neighbors
        )
        if self.max_num_neighbors < 1:
            raise ValueError(f"max_num_neighbors must be positive, not {self.max_num_neighbors}")
        gns = network.model
        if gns.conditioner is not None:
            # Orb-v3 omol's charge and spin conditioning is not wired here
            raise NotImplementedError(
                "Orb models conditioned on charge and spin (orb-v3-*-omol) are not supported"
            )
        if gns.edge_feature_names and set(gns.edge_feature_names) != {"feat"}:
            raise NotImplementedError(
                f"extra Orb edge features {gns.edge_feature_names} are not supported"
            )
        if gns.node_feature_names and set(gns.node_feature_names) != {"feat"}:
            raise NotImplementedError(
                f"extra Orb node features {gns.node_feature_names} are not supported"
            )
        network.eval()
        self.model = network
        self.message_passing_steps = len(gns.gnn_stacks)
        self.num_layers = self.message_passing_steps + 1
        self.atomic_types: Sequence[int] = tuple(range(1, 118))
        self.eval()

    def train(self, mode: bool = True) -> Orb:
        # an inference adapter: orb's modules stay in eval mode
        return super().train(False)

    def _batch(self, graph: LocalGraph, senders, receivers, vectors: torch.Tensor, n_node):
        """What orb's modules read of an ``AtomGraphs``, for this rank's nodes and edges."""
        numbers = graph.numbers
        dtype = vectors.dtype
        return SimpleNamespace(
            senders=senders,
            receivers=receivers,
            n_node=n_node,
            n_edge=torch.tensor([senders.shape[0]], device=numbers.device),
            node_features={
                "atomic_numbers": numbers,
                "atomic_numbers_embedding": torch.nn.functional.one_hot(numbers, 118).to(dtype),
            },
            edge_features={"vectors": vectors},
            system_features={},
        )

    def forward(self, graph: LocalGraph) -> torch.Tensor:
        # orb's ZBL term forms 14.3996 * Z_u * Z_v from integers in torch's default
        # dtype: float32 would round it in a float64 model (1e-10 relative in forces)
        with _default_dtype(graph.edge_vectors.dtype):
            return self._energies(graph)

    def _features(
        self, graph: LocalGraph, sent: torch.Tensor, received: torch.Tensor
    ) -> torch.Tensor:
        """Orb's GNS (``MoleculeGNS.forward``'s steps) on this rank's nodes: final features.

        Each of orb's directed edges enters twice: as ``sent``, one of its
        sender's listed edges, summed into the sender only, and as
        ``received``, the reverse of one of its receiver's listed edges,
        summed into the receiver only. Each copy's latent is updated from its
        two nodes, which are the atoms at its two ends, so both copies carry
        orb's latent of the edge. (Summing one copy into both ends would be
        wrong here: a ghost's edge may end on an image of an owned atom far
        from the owned atom itself, folded onto the owned node.) The copies
        reach orb's interaction layers as edges between the nodes and shadow
        rows ``n .. 2n - 1`` holding the same features, whose own sums are
        thrown away after each layer.
        """
        from orb_models.forcefield.nn_util import get_cutoff

        gns = self.model.model
        n_nodes = graph.n_atoms
        centre, neighbour = graph.edge_index
        senders = torch.cat([centre[sent], neighbour[received] + n_nodes])
        receivers = torch.cat([neighbour[sent] + n_nodes, centre[received]])
        edge_vectors = graph.edge_vectors
        vectors = torch.cat(
            [edge_vectors.index_select(0, sent), -edge_vectors.index_select(0, received)]
        )
        batch = self._batch(graph, senders, receivers, vectors, None)
        nodes, edges = gns._encoder(gns.featurize_nodes(batch), gns.featurize_edges(batch))
        cutoff = get_cutoff(vectors.norm(dim=-1))
        for layer in gns.gnn_stacks:
            both, edges = layer(torch.cat([nodes, nodes]), edges, senders, receivers, cutoff)
            nodes = both[:n_nodes]
        return nodes

    def _energies(self, graph: LocalGraph) -> torch.Tensor:
        net = self.model
        numbers = graph.numbers
        n_nodes, n_owned = graph.n_atoms, graph.n_owned
        device = numbers.device
        centre = graph.edge_index[0]
        lengths = torch.linalg.vector_norm(graph.edge_vectors.detach(), dim=1)
        # orb's edges sent by each node: its nearest max_num_neighbors
        sent = capped_edges(centre, lengths, self.max_num_neighbors)
        kept = torch.zeros_like(centre, dtype=torch.bool)
        kept[sent] = True
        # those it receives: a listed edge reversed, where the neighbour's own nearest
        # include the way back (a neighbour without listed edges is one hop beyond any
        # node whose in-edges matter: its edge is taken)
        reverse = reverse_edges(graph.edge_index, graph.edge_vectors.detach())
        received = ((reverse < 0) | kept[reverse.clamp(min=0)]).nonzero().squeeze(1)
        features = self._features(graph, sent, received)

        # the mean of every atom's features, over all ranks (owned nodes only)
        partial = torch.cat(
            [features[:n_owned].detach().sum(0), features.new_tensor([float(n_owned)])]
        )
        total = partial.detach() if graph.system_sum is None else graph.system_sum(partial)
        n_atoms = total[-1]
        head = net.heads[net.energy_name]
        pooled = total[:-1] / n_atoms if head.atom_avg else total[:-1]
        with torch.enable_grad():
            pooled = pooled.detach().requires_grad_(True)
            # EnergyHead.forward on the pooled features, then its denormalize less
            # the reference energies (added per atom below)
            network_energy = head.normalizer.inverse(head.mlp(pooled[None])).reshape(())
            if head.atom_avg:
                network_energy = network_energy * n_atoms
            (slope,) = torch.autograd.grad(network_energy, pooled)
        if head.atom_avg:
            slope = slope / n_atoms  # d pooled / d h_i
        # value: an equal share; gradient: f'(pooled) . dh_i
        energies = network_energy.detach() / n_atoms + (
            (features - features.detach()) * slope
        ).sum(1)
        reference = head.reference.linear.weight.reshape(-1)  # (118,): eV per element
        energies = energies + reference.index_select(0, numbers)
        if net.pair_repulsion:
            zbl = net.pair_repulsion_fn
            # one "system" per node: orb's ZBL then returns each node's own pair energy
            ones = torch.ones(n_nodes, dtype=torch.int64, device=device)
            pair_edges = graph.edge_index.index_select(1, sent)
            pair_vectors = graph.edge_vectors.index_select(0, sent)
            pair = zbl(self._batch(graph, pair_edges[0], pair_edges[1], pair_vectors, ones))[
                "energy"
            ]
            energies = energies + (pair / n_atoms if zbl.node_aggregation == "mean" else pair)
        return energies
