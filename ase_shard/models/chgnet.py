"""CHGNet (``chgnet``) as a ``ShardedCalculator`` model.

``chgnet`` is imported lazily, so this module imports without it::

    from ase_shard import ShardedCalculator
    from ase_shard.models import CHGNet

    atoms.calc = ShardedCalculator(CHGNet("0.3.0"))   # the weights shipped in the wheel

The adapter runs CHGNet's own modules (embeddings, Bessel and Fourier bases,
atom, bond and angle convolutions, readout and the fitted per-element
reference energies) on the rank's ``LocalGraph``, in place of CHGNet's
``CrystalGraphConverter`` and ``BatchedGraph``:

- the atom graph is the graph's edges (every pair within the atom-graph cutoff,
  6 Å for 0.3.0, both directions); an edge and its reverse share one
  undirected bond, found by their vectors (exact negatives of each other);
- the bond graph (CHGNet's three-body "line graph") pairs, at each centre, every
  two distinct edges shorter than the bond-graph cutoff (3 Å); its angles come
  from the edge vectors;
- the energy of atom ``i`` is CHGNet's site energy: the readout of its final
  features plus its element's reference energy, so the owned atoms' energies
  sum to CHGNet's total.

Forces and stress come from the calculator's gradient with respect to the edge
vectors, as CHGNet's come from positions and strain.

Halo: CHGNet has no per-layer exchange here (its bond features live on edges,
between atoms), so it runs with the full halo of ``n_conv`` atom-graph cutoffs.
That is its receptive field: a bond-graph update moves information at most one
bond-graph cutoff, never more than the atom-graph cutoff that the atom
convolution of the same layer spans.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ase_shard.graph import LocalGraph
from ase_shard.models.sum import Addable
from ase_shard.models.triplets import angle_pairs, pairs_within

# the pretrained models that ship inside the chgnet wheel (chgnet/pretrained/)
SHIPPED = ("0.3.0", "0.2.0", "r2scan")


def _load_chgnet(model: Any) -> torch.nn.Module:
    """A ``chgnet.model.CHGNet`` from a shipped name, a file, or the module itself."""
    try:
        from chgnet.model import CHGNet as ChgnetModel
    except ImportError as exc:  # pragma: no cover - exercised without chgnet only
        raise ImportError(
            "ase_shard.models.CHGNet needs the chgnet package (pip install chgnet)"
        ) from exc
    if isinstance(model, ChgnetModel):
        return model
    if isinstance(model, (str, os.PathLike)):
        name = os.fspath(model)
        if name in SHIPPED:
            return ChgnetModel.load(model_name=name, use_device="cpu", verbose=False)
        if os.path.isfile(name):
            return ChgnetModel.from_file(name)
        raise ValueError(
            f"CHGNet model {name!r} is neither a shipped model ({', '.join(SHIPPED)}) nor a file"
        )
    raise TypeError(
        "CHGNet expects a shipped model name such as '0.3.0', a checkpoint file or a "
        f"chgnet.model.CHGNet, not {type(model).__name__}"
    )


# Å: edge vectors are matched on a grid this fine; two atoms are never this close
# (the calculator refuses coincident ones)
MATCH_GRID = 2.0**-20


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    """torch's default dtype set to ``dtype`` while inside.

    CHGNet's angle basis (``chgnet.model.basis.Fourier``) makes its constant
    term from a tensor in the default dtype: float32 would round it in a
    float64 model (1e-8 relative in 0.3.0's forces).
    """
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def _reverse_edges(edge_index: torch.Tensor, edge_vectors: torch.Tensor) -> torch.Tensor:
    """Each edge's reverse: the edge centred on its neighbour with the opposite vector.

    ``-1`` where the reverse is not listed (the neighbour is beyond the halo's
    last hop). Vectors are compared on a grid of :data:`MATCH_GRID` Å: a ghost
    that is another periodic image of an atom has its own position, so the two
    directions of a bond through a folded image are opposite only to round-off.
    For the same reason the reverse of an edge to a folded image may end on
    another node of the centre's atom, and ``reverse`` need not be an
    involution. (Rounding is symmetric, so ``-v`` falls in the cell opposite to
    ``v``'s; a pair that straddles a cell edge is merely left unmatched.)
    """
    n_edges = edge_index.shape[1]
    grid = torch.round(edge_vectors.detach() / MATCH_GRID).to(torch.int64)
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


@dataclass(frozen=True)
class BondGraph:
    """CHGNet's bonds and three-body graph on a rank's edges.

    Attributes
    ----------
    directed2undirected : (E,) int64
        Each edge's bond: an edge and its reverse share one when each is the
        other's reverse; any other edge is a bond of its own.
    undirected2directed : (B,) int64
        One edge of each bond.
    rows : (A, 3) int64
        CHGNet's ``bond_graph``: ``[centre, bond i, bond j]`` for every ordered
        pair of two different edges at a centre, both shorter than the
        bond-graph cutoff; a bond's update sums the rows naming it as ``i``.
        A bond of its own also takes rows at its far end, with each other short
        edge there, so that it sums the angles at both of its ends, as CHGNet's
        bonds do.
    angle_edges : (2, A) int64
        The two edges whose angle a row has, seen from the row's centre...
    first_reversed : (A,) bool
        ... the first one reversed in the rows a bond of its own takes at its far end.
    """

    directed2undirected: torch.Tensor
    undirected2directed: torch.Tensor
    rows: torch.Tensor
    angle_edges: torch.Tensor
    first_reversed: torch.Tensor


def bond_graph(
    edge_index: torch.Tensor, edge_vectors: torch.Tensor, short: torch.Tensor, n_nodes: int
) -> BondGraph:
    """CHGNet's bond graph from a rank's edges (``short``: within the bond-graph cutoff)."""
    device = edge_index.device
    n_edges = edge_index.shape[1]
    edges = torch.arange(n_edges, device=device)
    reverse = _reverse_edges(edge_index, edge_vectors)
    paired = reverse >= 0
    paired[paired.clone()] = reverse[reverse[paired]] == edges[paired]
    bond = torch.where(paired, torch.minimum(edges, reverse), edges)
    _, directed2undirected = torch.unique(bond, return_inverse=True)
    n_bonds = int(directed2undirected.max()) + 1 if n_edges else 0
    undirected2directed = torch.empty(n_bonds, dtype=torch.int64, device=device)
    undirected2directed[directed2undirected] = edges
    # angles at each centre: ordered pairs of two different short edges
    centre = edge_index[0]
    candidates = short.nonzero().squeeze(1)
    first, second = angle_pairs(centre, candidates, n_nodes)
    targets = first
    flipped = torch.zeros_like(first, dtype=torch.bool)
    # a short edge without a reverse that pairs back (see _reverse_edges) is a bond of
    # its own: it also takes the angles at its far end, seen along the edge reversed
    # against each other short edge there (CHGNet's rows of its reverse edge)
    lone = (short & ~paired).nonzero().squeeze(1)
    if len(lone):
        far = edge_index[1, lone]
        there = torch.zeros(n_nodes, dtype=torch.bool, device=device)
        there[far] = True
        others = candidates[there[centre[candidates]]]
        a, b = pairs_within(torch.cat([far, centre[others]]), n_nodes)
        taken = (a < len(lone)) & (b >= len(lone))
        lone_edge, other = lone[a[taken]], others[b[taken] - len(lone)]
        # the reverse itself, where listed, is the same bond: not an angle
        vectors = edge_vectors.detach()
        gap = torch.linalg.vector_norm(vectors[other] + vectors[lone_edge], dim=1)
        angle = gap > MATCH_GRID
        lone_edge, other = lone_edge[angle], other[angle]
        targets = torch.cat([targets, lone_edge])
        first, second = torch.cat([first, lone_edge]), torch.cat([second, other])
        flipped = torch.cat([flipped, torch.ones_like(lone_edge, dtype=torch.bool)])
    rows = torch.stack(
        [
            torch.where(flipped, edge_index[1, first], centre[first]),
            directed2undirected[targets],
            directed2undirected[second],
        ],
        dim=1,
    )
    return BondGraph(
        directed2undirected, undirected2directed, rows, torch.stack([first, second]), flipped
    )


class CHGNet(Addable, torch.nn.Module):
    """A CHGNet potential (chgnet) following the ``ShardModel`` protocol.

    Parameters
    ----------
    model : str, os.PathLike or chgnet.model.CHGNet
        A model shipped inside the chgnet wheel (``"0.3.0"``, the default,
        ``"0.2.0"`` or ``"r2scan"``), a CHGNet checkpoint file, or a built
        ``chgnet.model.CHGNet`` (used as is, not copied).

    Attributes
    ----------
    cutoff : float
        The atom-graph cutoff (Å): 6 for 0.3.0.
    bond_cutoff : float
        The bond-graph (three-body) cutoff (Å): 3 for 0.3.0.
    num_layers : int
        CHGNet's atom convolutions (``n_conv``, 4): the halo spans
        ``num_layers * cutoff``.
    atomic_types : tuple of int
        The elements of CHGNet's embedding (H to Pu, 1-94).
    model : chgnet.model.CHGNet
        The wrapped network, float32 as loaded; ``ShardedCalculator(...,
        dtype=...)`` casts it.
    """

    supports_layer_halo = False

    def __init__(self, model: Any = "0.3.0"):
        super().__init__()
        network = _load_chgnet(model)
        if not network.mlp_first or network.pooling.average:
            raise ValueError(
                "only CHGNet models that read out per-atom energies and sum them "
                "(mlp_first, sum pooling) split into atoms; this one pools the crystal first"
            )
        reference = network.composition_model
        if reference is not None and reference.is_intensive != network.is_intensive:
            raise ValueError("the model's composition model and readout disagree on intensivity")
        network.eval()
        self.model = network
        converter = network.graph_converter
        self.cutoff = float(converter.atom_graph_cutoff)
        self.bond_cutoff = float(converter.bond_graph_cutoff)
        if self.bond_cutoff > self.cutoff:
            raise ValueError("the bond-graph cutoff exceeds the atom-graph cutoff")
        self.num_layers = int(network.n_conv)
        self.atomic_types: Sequence[int] = tuple(
            range(1, network.atom_embedding.embedding.num_embeddings + 1)
        )
        self.eval()

    def train(self, mode: bool = True) -> CHGNet:
        # an inference adapter: CHGNet's modules stay in eval mode
        return super().train(False)

    def forward(self, graph: LocalGraph) -> torch.Tensor:
        net = self.model
        edge_index, vectors = graph.edge_index, graph.edge_vectors
        n_nodes = graph.n_atoms
        lengths = torch.linalg.vector_norm(vectors, dim=1)
        bonds = bond_graph(edge_index, vectors, lengths < self.bond_cutoff, n_nodes)
        directed2undirected = bonds.directed2undirected
        bond_lengths = lengths.index_select(0, bonds.undirected2directed)
        expansion = net.bond_basis_expansion
        bond_bases_ag = expansion.rbf_expansion_ag(bond_lengths)
        bond_bases_bg = expansion.rbf_expansion_bg(bond_lengths)
        units = vectors / lengths[:, None]
        first = units.index_select(0, bonds.angle_edges[0])
        first = torch.where(bonds.first_reversed[:, None], -first, first)
        with _default_dtype(vectors.dtype):
            angle_bases = net.angle_basis_expansion(
                first, units.index_select(0, bonds.angle_edges[1])
            )
        angle_feas = net.angle_embedding(angle_bases)
        bond_graph_rows = bonds.rows
        atom_graph = edge_index.t()
        atom_feas = net.atom_embedding(graph.numbers - 1)
        bond_feas = net.bond_embedding(bond_bases_ag)
        bond_weights_ag = net.bond_weights_ag(bond_bases_ag)
        bond_weights_bg = net.bond_weights_bg(bond_bases_bg)
        for atom_layer, bond_layer, angle_layer in zip(
            net.atom_conv_layers[:-1], net.bond_conv_layers, net.angle_layers, strict=False
        ):
            atom_feas = atom_layer(
                atom_feas=atom_feas,
                bond_feas=bond_feas,
                bond_weights=bond_weights_ag,
                atom_graph=atom_graph,
                directed2undirected=directed2undirected,
            )
            if len(bond_graph_rows) and bond_layer is not None:
                bond_feas = bond_layer(
                    atom_feas=atom_feas,
                    bond_feas=bond_feas,
                    bond_weights=bond_weights_bg,
                    angle_feas=angle_feas,
                    bond_graph=bond_graph_rows,
                )
                if angle_layer is not None:
                    angle_feas = angle_layer(
                        atom_feas=atom_feas,
                        bond_feas=bond_feas,
                        angle_feas=angle_feas,
                        bond_graph=bond_graph_rows,
                    )
        atom_feas = net.atom_conv_layers[-1](
            atom_feas=atom_feas,
            bond_feas=bond_feas,
            bond_weights=bond_weights_ag,
            atom_graph=atom_graph,
            directed2undirected=directed2undirected,
        )
        if net.readout_norm is not None:
            atom_feas = net.readout_norm(atom_feas)
        energies = net.mlp(atom_feas).view(-1)
        if net.composition_model is not None:
            # the fitted per-element energies (eV), as CHGNet's site energies add them
            weight = net.composition_model.fc.weight[0]
            energies = energies + weight.index_select(0, graph.numbers - 1)
        return energies
