"""MatterSim (``mattersim``'s M3GNet) as a ``ShardedCalculator`` model.

``mattersim`` is imported lazily, so this module imports without it::

    from ase_shard import ShardedCalculator
    from ase_shard.models import MatterSim

    atoms.calc = ShardedCalculator(MatterSim("my-finetuned.pth"))  # a checkpoint file

The adapter runs mattersim's own M3GNet modules (atom embedding, smooth Bessel
edge basis, spherical three-body basis, the ``MainBlock`` interactions, the
gated readout and the per-element ``AtomScaling``) on the rank's
``LocalGraph``, in place of mattersim's ``GraphConvertor`` and
``batch_to_dict``:

- the two-body graph is the graph's edges (every pair within ``cutoff``, 5 Å
  for MatterSim-v1, both directions), each edge with its own features (M3GNet's
  edges are directed: an edge and its reverse share nothing, so unlike CHGNet
  no edge needs its reverse);
- the three-body graph is every ordered pair ``(ij, ik)`` of two different
  edges centred on the same atom, both no longer than ``threebody_cutoff``
  (4 Å), as mattersim's ``compute_threebody_indices`` forms it; the angle
  between them comes from the edge vectors;
- the energy of atom ``i`` is M3GNet's per-atom energy after its
  ``AtomScaling`` (per-element scale and shift, eV), the terms mattersim sums
  into the total, so the owned atoms' energies sum to mattersim's energy.

Forces and stress come from the calculator's gradient with respect to the edge
vectors, as mattersim's come from positions and strain.

Halo: the full halo of ``num_blocks`` two-body cutoffs. In one block, atom
``i``'s features take messages from its edges ``(i, j)``; an edge's update
reads the features of ``i`` and ``j`` and its three-body term reads, for each
other short edge ``(i, k)`` at ``i``, the angle, the length ``r_ik`` and the
features of ``i`` itself; ``k`` lies within the three-body cutoff of ``i``,
inside the two-body cutoff. So one block moves information at most one
two-body cutoff, and ``num_blocks`` of them span ``num_blocks * cutoff``, the
``LocalGraph`` receptive field.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ase_shard.graph import LocalGraph
from ase_shard.models.sum import Addable
from ase_shard.models.triplets import angle_pairs
from ase_shard.presets import MATTERSIM_CHECKPOINTS, mattersim_checkpoint

# mattersim clamps an angle's cosine this far inside [-1, 1] before acos (M3Gnet.forward)
COS_MARGIN = 1e-7


def _load_m3gnet(model: Any) -> torch.nn.Module:
    """A ``mattersim`` ``M3Gnet`` from a pretrained name, a checkpoint file, a
    ``Potential`` or the module itself."""
    try:
        from mattersim.forcefield.m3gnet.m3gnet import M3Gnet
        from mattersim.forcefield.potential import Potential
    except ImportError as exc:  # pragma: no cover - exercised without mattersim only
        raise ImportError(
            "ase_shard.models.MatterSim needs the mattersim package (pip install mattersim)"
        ) from exc
    if isinstance(model, Potential):
        if model.model_name != "m3gnet":
            raise ValueError(f"only M3GNet potentials split into atoms, not {model.model_name!r}")
        model = model.model
    if isinstance(model, M3Gnet):
        return model
    if isinstance(model, (str, os.PathLike)):
        name = os.fspath(model)
        path = mattersim_checkpoint(name)
        if path is not None and not path.is_file():
            # mattersim would try to download it: say where it belongs instead
            raise FileNotFoundError(
                f"MatterSim model {name!r} is not downloaded on this machine (mattersim "
                f"keeps it at {path}; the wheel does not ship it): give a checkpoint file"
            )
        path = path or Path(name)
        if not path.is_file():
            raise ValueError(
                f"MatterSim model {name!r} is neither a pretrained name "
                f"({', '.join(MATTERSIM_CHECKPOINTS)}) nor a file"
            )
        # mattersim's own loader (M3Gnet(**model_args), load_state_dict), on the host
        potential = Potential.from_checkpoint(str(path), device="cpu", load_training_state=False)
        return potential.model
    raise TypeError(
        "MatterSim expects a checkpoint file, a pretrained name such as 'mattersim-1m', "
        f"a mattersim Potential or M3Gnet, not {type(model).__name__}"
    )


def three_body_rows(
    centre: torch.Tensor, lengths: torch.Tensor, threebody_cutoff: float, n_nodes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """M3GNet's three-body rows on a rank's edges: ``(ij, ik)`` edge indices.

    Every ordered pair of two different edges centred on one node, both no
    longer than ``threebody_cutoff`` (Å), as mattersim's
    ``compute_threebody_indices`` forms them on its own graph (``<=``: its
    test). Each node whose features matter has all its edges listed, so its
    rows are complete.
    """
    candidates = (lengths <= threebody_cutoff).nonzero().squeeze(1)
    return angle_pairs(centre, candidates, n_nodes)


class MatterSim(Addable, torch.nn.Module):
    """A MatterSim (M3GNet) potential following the ``ShardModel`` protocol.

    Parameters
    ----------
    model : str, os.PathLike, mattersim Potential or M3Gnet
        A MatterSim checkpoint file (``.pth``, as ``Potential.save`` writes
        it), a pretrained name (``"mattersim-1m"``, ``"mattersim-5m"``: only
        where mattersim has already downloaded it, as nothing is fetched here),
        a ``mattersim.forcefield.potential.Potential`` or a built
        ``mattersim.forcefield.m3gnet.m3gnet.M3Gnet`` (used as is, not copied).

    Attributes
    ----------
    cutoff : float
        The two-body cutoff (Å): 5 for MatterSim-v1.
    threebody_cutoff : float
        The three-body (angle) cutoff (Å): 4 for MatterSim-v1.
    num_layers : int
        M3GNet's interaction blocks (``num_blocks``, 4): the halo spans
        ``num_layers * cutoff``.
    atomic_types : tuple of int
        The elements of its one-hot embedding (1 to ``max_z``, 94).
    model : mattersim M3Gnet
        The wrapped network, float32 as loaded; ``ShardedCalculator(...,
        dtype=...)`` casts it.
    """

    supports_layer_halo = False

    def __init__(self, model: Any):
        super().__init__()
        network = _load_m3gnet(model)
        network.eval()
        self.model = network
        arguments = network.model_args
        self.cutoff = float(arguments["cutoff"])
        self.threebody_cutoff = float(arguments["threebody_cutoff"])
        if self.threebody_cutoff > self.cutoff:
            raise ValueError(
                f"the three-body cutoff ({self.threebody_cutoff} Å) exceeds the two-body "
                f"cutoff ({self.cutoff} Å): the graph would not hold its angles"
            )
        self.num_layers = len(network.graph_conv)
        self.atomic_types: Sequence[int] = tuple(range(1, int(network.max_z) + 1))
        self.eval()

    def train(self, mode: bool = True) -> MatterSim:
        # an inference adapter: mattersim's modules stay in eval mode
        return super().train(False)

    def forward(self, graph: LocalGraph) -> torch.Tensor:
        """Per-atom energies in eV (readout after ``AtomScaling``), shape ``(n_atoms,)``.

        With the full halo's hop counts (``graph.hops``), block ``k`` of ``L``
        updates only the nodes within ``L - 1 - k`` hops of an owned node and the
        edges and angles centred on them (prefixes of nodes, edges and
        three-body rows sorted by hop count), as the owned energies need nothing
        else; only the owned rows are read out, ghost rows are zeros (the
        calculator discards them). Without ``hops`` every node and edge is
        computed and every row read out.
        """
        net = self.model
        vectors = graph.edge_vectors
        n_nodes, n_edges = graph.n_atoms, graph.edge_index.shape[1]
        n_blocks = len(net.graph_conv)
        device = vectors.device
        centre, neighbour = graph.edge_index
        hops = graph.hops
        if hops is None:
            rows, edges = [n_nodes] * (n_blocks + 1), [n_edges] * n_blocks
            numbers, n_out = graph.numbers, n_nodes
        else:
            # nodes ordered by hop count (owned nodes keep their places), so the nodes a
            # block updates are a prefix, as are their edges (sorted by their centres')
            rows, edges = hops.rows, hops.edges
            numbers, n_out = graph.numbers.index_select(0, hops.order), graph.n_owned
            centre = hops.place.index_select(0, centre)
            neighbour = hops.place.index_select(0, neighbour)
        edge_index = torch.stack([centre, neighbour])
        lengths = torch.linalg.vector_norm(vectors, dim=1)
        ij, ik = three_body_rows(centre, lengths, self.threebody_cutoff, rows[n_blocks])
        # the rows come grouped by centre, centres in node order: those of the nodes
        # within h hops are the first ones (one count per block, read back at once)
        ends = torch.searchsorted(centre.index_select(0, ij), torch.tensor(rows, device=device))
        triples = ends.tolist()
        # mattersim points its edge vectors the other way (centre - neighbour); the
        # cosine between two edges of one centre is the same
        cos_jik = (vectors[ij] * vectors[ik]).sum(dim=1) / (lengths[ij] * lengths[ik])
        cos_jik = torch.clamp(cos_jik, min=-1.0 + COS_MARGIN, max=1.0 - COS_MARGIN)
        # one-hot of 0 and 1: exact in any dtype
        atom_attr = net.atom_embedding(net.one_hot_atoms(numbers).to(vectors.dtype))
        edge_attr_zero = net.rbf(lengths)
        edge_attr = net.edge_encoder(edge_attr_zero)
        three_basis = net.sbf(lengths[ik], torch.acos(cos_jik))
        three_body_indices = torch.stack([ij, ik], dim=1)
        # per-graph counts, as batch_to_dict gives them for one graph; with the totals
        # and the three-body edge map given, the blocks use none of them
        num_bonds = torch.full((1,), n_edges, dtype=torch.int64, device=device)
        num_atoms = torch.full((1,), rows[n_blocks], dtype=torch.int64, device=device)
        num_triple_ij = torch.bincount(ij, minlength=n_edges)[:, None]
        edge_lengths = lengths[:, None]
        for k, block in enumerate(net.graph_conv):
            # block k updates the nodes within n_blocks - 1 - k hops, from their edges
            # and angles and from the nodes one hop further out
            depth = n_blocks - 1 - k
            n_in, n_e, n_t = rows[depth + 1], edges[depth], triples[depth]
            atom_attr, edge_attr = block(
                atom_attr[:n_in],
                edge_attr[:n_e],
                edge_attr_zero[:n_e],
                edge_index[:, :n_e],
                three_basis[:n_t],
                three_body_indices[:n_t],
                edge_lengths[:n_e],
                num_bonds,
                num_triple_ij,
                num_atoms,
                total_num_atoms=n_in,
                total_num_bonds=n_e,
                # each row's sum goes to its edge ij (mattersim's repeat_interleave of
                # arange by num_triple_ij, for rows sorted by ij: ours are not)
                three_body_edge_map=ij[:n_t],
            )
        energies = net.final(atom_attr[:n_out]).view(-1)
        # the fitted per-element scale and shift (eV), as M3Gnet.forward applies them
        energies = net.normalizer(energies, numbers[:n_out])
        return torch.cat([energies, energies.new_zeros(n_nodes - n_out)])
