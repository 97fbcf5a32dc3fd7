"""Orb-v3 (``orb-models``), conservative and direct, as a ``ShardedCalculator`` model.

``orb_models`` is imported lazily, so this module imports without it::

    from ase_shard import ShardedCalculator
    from ase_shard.models import Orb

    atoms.calc = ShardedCalculator(Orb(network))        # a Conservative/DirectForcefieldRegressor
    atoms.calc = ShardedCalculator(Orb("orb-v3-conservative-inf-omat-20250404.ckpt"))
    atoms.calc = ShardedCalculator(Orb("orb-v3-direct-20-omat-20250404.ckpt"))

The adapter runs orb's own modules on the rank's ``LocalGraph``, in place of
orb's ``ase_atoms_to_atom_graphs`` and ``ConservativeForcefieldRegressor.forward``:
the GNS backbone (``MoleculeGNS``: embeddings, Bessel and spherical-harmonic
edge features, attention interaction layers), the energy head's MLP and
normaliser, its fixed per-element reference energies and the ZBL pair
repulsion. A conservative model's forces and stress come from the calculator's
gradient with respect to the edge vectors, as orb's come from positions and a
strain; a direct model's are its heads' outputs (below).

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
  folded onto the owned node (a rank without ghosts, as one rank, takes each
  edge once into both ends, as orb does). And orb keeps, per
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

Orb's direct models (``DirectForcefieldRegressor``) predict forces and stress
with heads of their own (``predicts_forces``: the adapter returns
:class:`ase_shard.graph.PredictedForces`, and the calculator takes no
gradient). With the full halo an owned node's final features are exact on its
rank, so its force is the force head's MLP of them, less the mean over every
atom and, for a system without a cell (orb's test: all cell entries zero), the
net torque about the centre of the atoms, as orb's ``ForceHead`` removes them;
the stress is the stress head's MLP of the pooled features. Each sum over all
atoms (pooled features, mean force, centre; then the torque and the two
second moments of the positions it needs) is one ``system_sum``. Orb adds its
ZBL repulsion's own energy, forces and stress (``compute_gradients``); here an
owned atom gets the energy of the ZBL edges it sends, the force from those and
the ones it receives, and the virial of those it sends. The stress head's
stress enters the virials as equal shares of ``stress * volume``; per-atom
stresses are not defined.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch

from ase_shard.graph import LocalGraph, PredictedForces
from ase_shard.models.sum import Addable

PREFIX = "orb-v3-conservative-"
DIRECT_PREFIX = "orb-v3-direct-"


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


def direct_names() -> tuple[str, ...]:
    """Orb's pretrained direct Orb-v3 model names (``orb-v3-direct-...``)."""
    return tuple(name for name in _orb().ORB_PRETRAINED_MODELS if name.startswith(DIRECT_PREFIX))


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
            "Orb expects an orb regressor (Conservative- or DirectForcefieldRegressor), a "
            f"checkpoint file or a pretrained model name, not {type(model).__name__}"
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
            f"({', '.join(conservative_names() + direct_names())})"
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


class Orb(Addable, torch.nn.Module):
    """An Orb-v3 potential (orb-models) following the ``ShardModel`` protocol.

    Parameters
    ----------
    model : str, os.PathLike or orb_models regressor
        A built ``ConservativeForcefieldRegressor`` or
        ``DirectForcefieldRegressor`` (used as is, not copied), a checkpoint
        file (orb's ``.ckpt``: weights only, for the architecture that its
        name starts with or ``architecture``), or a pretrained name such as
        ``"orb-v3-conservative-inf-omat"`` or ``"orb-v3-direct-20-omat"``
        (from orb's download cache: there is no download here).
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
    predicts_forces : bool
        ``True`` for a direct model: ``forward`` returns
        :class:`ase_shard.graph.PredictedForces` (its heads' forces and
        stress), not per-atom energies.
    model : orb_models ConservativeForcefieldRegressor or DirectForcefieldRegressor
        The wrapped network; ``ShardedCalculator(..., dtype=...)`` casts it.
    """

    supports_layer_halo = False
    # the padded graphs of compile=... add spare owned rows, which would enter the mean
    supports_compile = False
    system_inputs: tuple[str, ...] = ()
    predicts_forces = False

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
            _check_direct_heads(network)
            self.predicts_forces = True
        elif not isinstance(network, ConservativeForcefieldRegressor):
            raise TypeError(
                "Orb expects an orb_models ConservativeForcefieldRegressor or "
                f"DirectForcefieldRegressor, not {type(network).__name__}"
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

    def _batch(self, numbers: torch.Tensor, senders, receivers, vectors: torch.Tensor, n_node):
        """What orb's modules read of an ``AtomGraphs``, for these nodes and edges.

        The cell is a unit one: only orb's ZBL with ``compute_gradients`` (the
        direct models') reads it, for a stress of its own that is not used.
        """
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
            system_features={"cell": torch.eye(3, dtype=dtype, device=numbers.device)[None]},
        )

    def forward(self, graph: LocalGraph) -> torch.Tensor | PredictedForces:
        # orb's ZBL term forms 14.3996 * Z_u * Z_v from integers in torch's default
        # dtype: float32 would round it in a float64 model (1e-10 relative in forces)
        with _default_dtype(graph.edge_vectors.dtype):
            if self.predicts_forces:
                return self._predicted(graph)
            return self._energies(graph)

    def _edges(self, graph: LocalGraph) -> tuple[torch.Tensor, torch.Tensor]:
        """The listed edges that enter orb's graph as sent, and as received (reversed).

        Sent: each node's nearest ``max_num_neighbors`` (orb's cap). Received:
        a listed edge reversed, where the neighbour's own nearest include the
        way back (a neighbour without listed edges is one hop beyond any node
        whose in-edges matter: its edge is taken).
        """
        centre = graph.edge_index[0]
        lengths = torch.linalg.vector_norm(graph.edge_vectors.detach(), dim=1)
        sent = capped_edges(centre, lengths, self.max_num_neighbors)
        kept = torch.zeros_like(centre, dtype=torch.bool)
        kept[sent] = True
        reverse = reverse_edges(graph.edge_index, graph.edge_vectors.detach())
        received = ((reverse < 0) | kept[reverse.clamp(min=0)]).nonzero().squeeze(1)
        return sent, received

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
        thrown away after each layer. A graph without ghosts (one rank: periodic
        images fold into edge shifts) has every node at its own atom, so there
        each of orb's edges enters once, summed into both ends, as in orb's own
        layers: half the edge work.
        """
        from orb_models.forcefield.nn_util import get_cutoff

        gns = self.model.model
        n_nodes = graph.n_atoms
        centre, neighbour = graph.edge_index
        edge_vectors = graph.edge_vectors
        shadows = graph.n_owned < n_nodes
        if shadows:
            senders = torch.cat([centre[sent], neighbour[received] + n_nodes])
            receivers = torch.cat([neighbour[sent] + n_nodes, centre[received]])
            vectors = torch.cat(
                [edge_vectors.index_select(0, sent), -edge_vectors.index_select(0, received)]
            )
        else:
            senders, receivers = centre[sent], neighbour[sent]
            vectors = edge_vectors.index_select(0, sent)
        batch = self._batch(graph.numbers, senders, receivers, vectors, None)
        nodes, edges = gns._encoder(gns.featurize_nodes(batch), gns.featurize_edges(batch))
        cutoff = get_cutoff(vectors.norm(dim=-1))
        for layer in gns.gnn_stacks:
            rows = torch.cat([nodes, nodes]) if shadows else nodes
            rows, edges = layer(rows, edges, senders, receivers, cutoff)
            nodes = rows[:n_nodes]
        return nodes

    def _energies(self, graph: LocalGraph) -> torch.Tensor:
        net = self.model
        numbers = graph.numbers
        n_nodes, n_owned = graph.n_atoms, graph.n_owned
        device = numbers.device
        sent, received = self._edges(graph)
        features = self._features(graph, sent, received)

        # the mean of every atom's features, over all ranks (owned nodes only)
        partial = torch.cat(
            [features[:n_owned].detach().sum(0), features.new_tensor([float(n_owned)])]
        )
        total = _summed(graph, partial)
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
            pair = zbl(self._batch(numbers, pair_edges[0], pair_edges[1], pair_vectors, ones))[
                "energy"
            ]
            energies = energies + (pair / n_atoms if zbl.node_aggregation == "mean" else pair)
        return energies

    def _predicted(self, graph: LocalGraph) -> PredictedForces:
        """Orb's direct heads (``DirectForcefieldRegressor.predict``) for the owned atoms."""
        net = self.model
        heads = net.heads
        n_owned = graph.n_owned
        sent, received = self._edges(graph)
        owned = self._features(graph, sent, received)[:n_owned]
        force_head = heads["forces"]
        forces = force_head.mlp(owned)  # normalised, as ForceHead.forward's
        positions = graph.positions[:n_owned]
        # every atom's: features, forces and positions added up, and how many atoms
        count = owned.new_tensor([float(n_owned)])
        total = _summed(graph, torch.cat([owned.sum(0), forces.sum(0), positions.sum(0), count]))
        width = owned.shape[1]
        features_sum, n_atoms = total[:width], total[-1]
        force_sum, position_sum = total[width : width + 3], total[width + 3 : width + 6]

        # EnergyHead.predict: its MLP of the pooled features, denormalised, and the
        # reference energies; each atom an equal share of the first
        energy_head = heads["energy"]
        pooled = features_sum / n_atoms if energy_head.atom_avg else features_sum
        energy = energy_head.normalizer.inverse(energy_head.mlp(pooled[None])).reshape(())
        if energy_head.atom_avg:
            energy = energy * n_atoms
        reference = energy_head.reference.linear.weight.reshape(-1)  # (118,): eV per element
        energies = energy / n_atoms + reference.index_select(0, graph.numbers[:n_owned])

        # ForceHead.predict: the mean force, then for a system without a cell the net
        # torque, removed (maybe_remove_net_force_and_torque), then denormalised
        if force_head.remove_mean:
            forces = forces - force_sum / n_atoms
        if force_head.remove_torque_for_nonpbc_systems and bool((graph.cell == 0).all()):
            forces = _without_torque(graph, forces, positions - position_sum / n_atoms)
        forces = force_head.normalizer.inverse(forces)

        # StressHead.predict, as equal shares of the virial stress * volume
        virials = forces.new_zeros((n_owned, 6))
        if "stress" in heads:
            head = heads["stress"]
            pooled = features_sum / n_atoms if head.node_aggregation == "mean" else features_sum
            stress = head.denormalize(head.mlp(pooled[None]), None).reshape(6)
            volume = torch.linalg.det(graph.cell).abs()
            virials = virials + stress * (volume / n_atoms)
        if net.pair_repulsion:
            pair = self._pair_terms(graph, sent, received)
            scale = 1 / n_atoms if net.pair_repulsion_fn.node_aggregation == "mean" else 1
            energies = energies + pair.energies * scale
            forces = forces + pair.forces * scale
            virials = virials + pair.virials * scale
        return PredictedForces(energies, forces, virials)

    def _pair_terms(
        self, graph: LocalGraph, sent: torch.Tensor, received: torch.Tensor
    ) -> PredictedForces:
        """Orb's ZBL repulsion for the owned atoms, as orb's direct models add it.

        orb sums a directed edge's energy into its sender and its force into
        both ends. An owned atom's energy is that of the edges it sends, its
        force from those and the ones it receives (each listed, reversed,
        among its own edges), its share of the virial that of the edges it
        sends: summed over the ranks, orb's virial. Forces and virials come
        from the gradient of each edge's energy with respect to its vector.
        """
        from orb_models.forcefield.forcefield_utils import torch_full_3x3_to_voigt_6_stress

        zbl = self.model.pair_repulsion_fn
        n_owned = graph.n_owned
        centre, neighbour = graph.edge_index
        # the edges centred on owned nodes, as sent and as received
        mine = [edges[centre.index_select(0, edges) < n_owned] for edges in (sent, received)]
        with torch.enable_grad():
            vectors = [
                graph.edge_vectors.index_select(0, edges).detach().requires_grad_(True)
                for edges in mine
            ]
            energies = []
            for edges, leaves in zip(mine, vectors, strict=True):
                # the owned nodes, then one node per edge for its other end: orb's ZBL on
                # one-node "systems" gives each owned node the energy of the edges it sends
                numbers = torch.cat(
                    [graph.numbers[:n_owned], graph.numbers.index_select(0, neighbour[edges])]
                )
                others = torch.arange(edges.shape[0], device=edges.device) + n_owned
                ones = torch.ones_like(numbers)
                batch = self._batch(numbers, centre[edges], others, leaves, ones)
                energies.append(zbl(batch)["energy"][:n_owned])
            both = energies[0].sum() + energies[1].sum()
            grads = torch.autograd.grad(both, vectors, allow_unused=True)
        grads = [
            torch.zeros_like(leaves) if grad is None else grad
            for grad, leaves in zip(grads, vectors, strict=True)
        ]
        forces = vectors[0].new_zeros((n_owned, 3))
        for edges, grad in zip(mine, grads, strict=True):
            forces.index_add_(0, centre[edges], grad)  # dE/dd: +g on the centre
        # d (x) dE/dd, in orb's Voigt form (off-diagonal pairs averaged)
        voigt = torch_full_3x3_to_voigt_6_stress(
            vectors[0].detach()[:, :, None] * grads[0][:, None]
        )
        virials = vectors[0].new_zeros((n_owned, 6)).index_add_(0, centre[mine[0]], voigt)
        return PredictedForces(energies[0].detach(), forces, virials)


def _summed(graph: LocalGraph, partial: torch.Tensor) -> torch.Tensor:
    """``partial`` added over every rank (``graph.system_sum``; itself in one process)."""
    return partial.detach() if graph.system_sum is None else graph.system_sum(partial)


def _without_torque(graph: LocalGraph, forces: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """orb's ``_remove_net_torque`` over every rank's owned atoms.

    ``forces`` and ``r`` (positions less the centre of all atoms) are the
    owned atoms'. The net torque and the positions' second moments are sums
    over all atoms: one ``system_sum``; every rank then solves the same
    3 x 3 system, as orb does for the whole molecule.
    """
    torque = torch.linalg.cross(r, forces).sum(0)
    squares = (r * r).sum(1).sum(0)
    outer = (r[:, :, None] * r[:, None, :]).sum(0)
    total = _summed(graph, torch.cat([torque, squares[None], outer.reshape(9)]))
    torque, squares, outer = total[:3], total[3], total[4:].reshape(3, 3)
    moments = outer - squares * torch.eye(3, dtype=outer.dtype, device=outer.device)
    try:
        mu = torch.linalg.solve(moments, -torque)
    except RuntimeError:  # singular, as orb handles it
        mu = torch.linalg.pinv(moments) @ -torque
    return forces + torch.linalg.cross(r, mu.expand_as(r))


def _check_direct_heads(network: torch.nn.Module) -> None:
    """Refuse a direct model with heads other than Orb-v3's energy, forces, stress and
    confidence (the latter not evaluated: orb's calculator reports it, this one does not)."""
    from orb_models.forcefield.forcefield_heads import (
        ConfidenceHead,
        EnergyHead,
        ForceHead,
        StressHead,
    )

    known = {
        "energy": EnergyHead,
        "forces": ForceHead,
        "stress": StressHead,
        "confidence": ConfidenceHead,
    }
    for name, head in network.heads.items():
        if not isinstance(head, known.get(name, ())):
            raise NotImplementedError(
                f"Orb's direct head {name!r} ({type(head).__name__}) is not supported: only "
                "Orb-v3's EnergyHead, ForceHead, StressHead and ConfidenceHead"
            )
    missing = [name for name in ("energy", "forces") if name not in network.heads]
    if missing:
        raise NotImplementedError(f"an Orb direct model without {' and '.join(missing)} heads")
