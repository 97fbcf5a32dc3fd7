"""Adapter for metatomic models (``metatomic-torch``) to the ``ShardedCalculator`` protocol.

``metatomic.torch`` is imported lazily, so this module imports without it::

    from ase_shard import ShardedCalculator
    from ase_shard.models.metatomic import Metatomic

    atoms.calc = ShardedCalculator(Metatomic("model.pt"))  # an exported AtomisticModel

Any exported metatomic ``AtomisticModel`` runs on a rank's ``LocalGraph``: the adapter
builds one metatomic ``System`` holding every local node (owned and ghosts), stores in
it each neighbour list the model requests, made from the graph's edges, and asks for
the per-atom ``energy`` of the owned atoms only (``selected_atoms``). The lists'
values are rows of ``graph.edge_vectors`` (negated for the reverse direction of a
pair), so the calculator's gradient with respect to the edge vectors gives forces and
stress, as the gradient with respect to positions and strain gives them in
``metatomic_ase.MetatomicCalculator``.

For a model that computes from the neighbour-list vectors the ``System``'s positions
are NaN, the cell is zero and not periodic, and the pairs' cell shifts are labels that
tell the pairs apart, not images. A model that computes its vectors from
``System.positions``, the cell and the cell shifts, as metatrain's PET (PET-MAD's
architecture) does, gets positions that are sums of edge vectors along a spanning tree:
on a rank without ghosts (one rank) the system as metatomic's calculator gives it (one
node per atom, the cell, integer shifts from ``LocalGraph.cell``); on a rank with ghosts
the graph unfolded into explicit periodic images, as metatomic's LAMMPS interface gives
it ghosts (one node per image within ``num_layers`` hops of an owned atom, no cell, no
shifts). The adapter finds which kind a model is by evaluating it once on two atoms
with NaN positions (``unfold=`` overrides). See docs/models.md, "metatomic".
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from ase_shard.graph import LocalGraph
from ase_shard.models.sum import Addable

# the sample names of a metatomic neighbour list (System.add_neighbor_list)
_PAIR_SAMPLES = ["first_atom", "second_atom", "cell_shift_a", "cell_shift_b", "cell_shift_c"]
# relative slack when counting how many lists' cutoffs the interaction range spans
_RANGE_SLACK = 1e-9
_DTYPES = {"float32": torch.float32, "float64": torch.float64}
# Å: two images placed by sums of edge vectors along different paths are the same atom
# image when closer than this (the sums differ by rounding, ~1e-12 Å); images of
# distinct atoms are at least 1e-4 Å apart (ShardedCalculator refuses closer atoms)
_SAME_IMAGE = 1e-6
# Å: what a path of edge vectors around a loop may leave beyond a lattice vector
# (rounding: float32 sums over long paths reach ~1e-5 Å; a missing cell leaves Å)
_LATTICE_MISFIT = 1e-3


def _metatomic() -> Any:
    try:
        import metatomic.torch as mta
    except ImportError as exc:  # pragma: no cover - exercised without metatomic only
        raise ImportError(
            "ase_shard.models.Metatomic needs the metatomic-torch package "
            "(pip install metatomic-torch)"
        ) from exc
    return mta


def _load(model: Any, extensions_directory: str | os.PathLike | None) -> torch.nn.Module:
    """A Python ``AtomisticModel`` from a file, a scripted export or an ``AtomisticModel``."""
    mta = _metatomic()
    if isinstance(model, (str, bytes, os.PathLike)):
        path = os.fsdecode(model)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no metatomic model file at {path!r}")
        directory = None if extensions_directory is None else os.fspath(extensions_directory)
        return mta.load_atomistic_model(path, extensions_directory=directory)
    if isinstance(model, mta.AtomisticModel):
        return model
    if isinstance(model, torch.nn.Module) and mta.is_atomistic_model(model):
        # a scripted AtomisticModel (torch.jit.load of an export): wrapped as
        # load_atomistic_model does
        return mta.AtomisticModel(model, model.metadata(), model.capabilities())
    raise TypeError(
        "Metatomic expects the path of an exported metatomic model (.pt) or a "
        f"metatomic.torch.AtomisticModel, not {type(model).__name__}"
    )


class _Pairs(NamedTuple):
    """The graph's edges with their pair labels (see ``Metatomic._pairs``)."""

    first: torch.Tensor  # (E,) int64 centres
    second: torch.Tensor  # (E,) int64 neighbours
    vectors: torch.Tensor  # (E, 3) edge vectors, Å
    shifts: torch.Tensor  # (E, 3) int32 cell shifts: (+k, 0, 0) / (-k, 0, 0) labels
    half: torch.Tensor  # (E,) bool: the edges of a half list, one per pair
    one_way: torch.Tensor  # (E,) bool: reverse not listed, neighbour's edges not listed
    unpaired: torch.Tensor  # (E,) bool: reverse not listed, both ends' edges listed


def _pair_block(samples: torch.Tensor, vectors: torch.Tensor) -> Any:
    """A metatomic neighbour list: ``(P, 5)`` int32 samples (first, second, shift) and
    ``(P, 3)`` vectors."""
    from metatensor.torch import Labels, TensorBlock

    device = vectors.device
    return TensorBlock(
        values=vectors.reshape(-1, 3, 1),
        samples=Labels(_PAIR_SAMPLES, samples.to(device), assume_unique=True),
        components=[Labels(["xyz"], torch.arange(3, device=device).reshape(3, 1))],
        properties=Labels(["distance"], torch.zeros((1, 1), dtype=torch.int32, device=device)),
    )


def _lexicographically_positive(vectors: torch.Tensor) -> torch.Tensor:
    """``(E,)`` bool: whether each vector's first non-zero component is positive.

    Exactly one of ``v`` and ``-v`` is, for ``v != 0``: it picks one direction of a
    pair between an atom and its own periodic image.
    """
    x, y, z = vectors.unbind(dim=1)
    return (x > 0) | ((x == 0) & ((y > 0) | ((y == 0) & (z > 0))))


class _Images(NamedTuple):
    """The graph unfolded into explicit periodic images (see ``_unfold``)."""

    nodes: torch.Tensor  # (M,) int64: the graph node of each image, owned nodes first
    positions: torch.Tensor  # (M, 3): sums of edge vectors, differentiable
    first: torch.Tensor  # (P,) int64 pairs of images, both directions of each
    second: torch.Tensor  # (P,) int64


def _frame(
    centre: np.ndarray, neighbour: np.ndarray, n: int, n_owned: int
) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """A breadth-first spanning tree of each connected part of the graph holding an owned
    node, from its lowest node (owned: owned nodes come first), over the edges taken
    either way.

    Returns the tree's levels (node indices, level 0 the roots), each node's parent
    edge as an index into ``concatenate([edges, reversed edges])`` (-1 at the roots
    and the nodes not reached) and each node's part (-1: not reached).
    """
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    ones = np.ones(centre.shape[0], dtype=np.int8)
    _, part = connected_components(
        coo_matrix((ones, (centre, neighbour)), shape=(n, n)), directed=True, connection="weak"
    )
    lowest = np.full(part.max(initial=-1) + 1, n)
    np.minimum.at(lowest, part, np.arange(n))
    roots = lowest[lowest < n_owned]
    source = np.concatenate([centre, neighbour])
    target = np.concatenate([neighbour, centre])
    parent = np.full(n, -1)
    reached = np.zeros(n, dtype=bool)
    reached[roots] = True
    levels = [roots]
    while True:
        frontier = np.zeros(n, dtype=bool)
        frontier[levels[-1]] = True
        step = np.flatnonzero(frontier[source] & ~reached[target])
        if not step.size:
            break
        new, first = np.unique(target[step], return_index=True)
        parent[new] = step[first]
        reached[new] = True
        levels.append(new)
    return levels, parent, np.where(reached, part, -1)


def _placed(
    vectors: torch.Tensor, centre: np.ndarray, neighbour: np.ndarray, n: int, n_owned: int
) -> tuple[torch.Tensor, np.ndarray]:
    """Each node placed by the spanning tree of :func:`_frame`: its parent's position plus
    the edge vector, from its part's root at the origin.

    Returns ``(n, 3)`` positions, sums of ``vectors`` (differentiable; zeros at the nodes
    not reached), and each node's part (-1: not reached).
    """
    levels, parent, part = _frame(centre, neighbour, n, n_owned)
    device = vectors.device
    steps = torch.cat([vectors, -vectors])
    source = np.concatenate([centre, neighbour])
    positions = vectors.new_zeros((n, 3))
    for level in levels[1:]:
        edge = parent[level]
        step = positions.index_select(0, torch.as_tensor(source[edge], device=device))
        step = step + steps.index_select(0, torch.as_tensor(edge, device=device))
        positions = positions.index_copy(0, torch.as_tensor(level, device=device), step)
    return positions, part


class Metatomic(Addable, torch.nn.Module):
    """A metatomic ``AtomisticModel`` following the ``ShardModel`` protocol.

    Parameters
    ----------
    model : str, os.PathLike or metatomic.torch.AtomisticModel
        An exported model file (``AtomisticModel.save``), loaded with
        ``metatomic.torch.load_atomistic_model``, or a model in memory (a Python
        ``AtomisticModel`` or a scripted one, e.g. from ``torch.jit.load``). The
        model is used as is, not copied.
    variant : str, optional
        The variant of the energy output, e.g. ``"pbe"`` for ``energy/pbe``; by
        default the model's default energy, chosen as ``metatomic.torch.pick_output``
        (and ``MetatomicCalculator(variants={"energy": variant})``) choose.
    extensions_directory : str or os.PathLike, optional
        Where the TorchScript extensions of an exported model are, when it needs
        some that are not installed (``AtomisticModel.save(collect_extensions=...)``).
    check_consistency : bool
        Passed to the model: metatomic's checks of inputs and outputs at every
        evaluation (slow; for debugging a model).
    unfold : bool, optional
        Whether the model gets positions (``True``: for models that compute from
        ``System.positions``, as metatrain's PET): the system with its cell and cell
        shifts on a rank without ghosts, the graph unfolded into explicit periodic
        images on a rank with ghosts; or one node per graph node with NaN positions and
        the edge vectors as neighbour-list values (``False``: for models that compute
        from those). By default the model is evaluated once on two atoms with NaN
        positions, and gets positions when its energy is not finite or differs from
        the one with real positions.
    interaction_range : float, optional
        Å: the model's reach when it is longer than the one it declares
        (``capabilities().interaction_range``; shorter is refused). metatrain's PET with
        ``featurizer_type="feedforward"`` reaches one cutoff further than it declares
        (docs/models.md, "metatomic").

    Attributes
    ----------
    cutoff : float
        Å: the largest cutoff among the model's requested neighbour lists.
    num_layers : int
        ``ceil(interaction_range / shortest requested cutoff)``: the most
        neighbour-list hops through which an atom's energy can depend on another
        atom, so ``cutoff * num_layers >= interaction_range`` and the full halo
        covers the model's declared reach (see docs/models.md).
    atomic_types : tuple of int
        The model's ``capabilities().atomic_types`` (atomic numbers).
    energy_output : str
        The name of the output used, e.g. ``"energy"`` or ``"energy/pbe"``.
    heads : tuple of str
        The model's energy outputs (variants), ``energy_output`` among them.
    model : AtomisticModel
        The wrapped model.
    unfold : bool
        Whether the model gets positions, unfolded where there are ghosts (see above).

    The model runs in the dtype it declares (``capabilities().dtype``), which
    ``ShardedCalculator`` uses by default; asking for another (``dtype=``) raises
    ``ValueError``, as ``MetatomicCalculator`` never casts a model either. Only the
    full halo is supported (the model cannot exchange ghost features between its
    layers). Models that need extra inputs (``requested_inputs``: charges, spin,
    ...), lack per-atom energies, or declare an infinite interaction range
    (long-range terms) are refused.
    """

    def __init__(
        self,
        model: Any,
        *,
        variant: str | None = None,
        extensions_directory: str | os.PathLike | None = None,
        check_consistency: bool = False,
        unfold: bool | None = None,
        interaction_range: float | None = None,
    ) -> None:
        super().__init__()
        mta = _metatomic()
        model = _load(model, extensions_directory)
        capabilities = model.capabilities()
        if capabilities.dtype not in _DTYPES:
            raise ValueError(f"the model declares an unsupported dtype {capabilities.dtype!r}")
        dtype = _DTYPES[capabilities.dtype]
        # the first floating tensor of the module, so that ShardedCalculator's default
        # dtype (that of the first parameter) is the declared one whatever the weights
        self._declared_dtype = torch.nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
        self.model = model.eval()
        self.check_consistency = bool(check_consistency)
        self.supported_devices = tuple(str(device) for device in capabilities.supported_devices)

        outputs = capabilities.outputs
        if not any(name == "energy" or name.startswith("energy/") for name in outputs):
            raise ValueError(f"the model has no energy output (its outputs: {sorted(outputs)})")
        self.heads = tuple(
            str(name) for name in outputs if name == "energy" or name.startswith("energy/")
        )
        try:
            self.energy_output = str(mta.pick_output("energy", outputs, variant))
        except RuntimeError as exc:
            raise ValueError(f"variant {variant!r}: {exc}") from None
        if outputs[self.energy_output].sample_kind != "atom":
            raise ValueError(
                f"the model's {self.energy_output!r} output is per system only: "
                "ShardedCalculator needs per-atom energies (sample_kind='atom')"
            )
        inputs = model.requested_inputs(use_new_names=True)
        if len(inputs):
            raise NotImplementedError(
                f"the model requests extra inputs {sorted(inputs)}, which the metatomic "
                "adapter does not provide"
            )

        self._requests = list(model.requested_neighbor_lists())
        if not self._requests:
            raise ValueError(
                "the model requests no neighbour list: ShardedCalculator needs a cutoff"
            )
        # cutoffs in Å, the graph's (and ModelEvaluationOptions') length unit
        self._cutoffs = [float(request.engine_cutoff("angstrom")) for request in self._requests]
        self._full = [bool(request.full_list) for request in self._requests]
        self.cutoff = max(self._cutoffs)
        if not self.cutoff > 0.0:
            raise ValueError(f"the model's neighbour-list cutoffs are {self._cutoffs} Å")

        length_unit = capabilities.length_unit
        to_angstrom = (
            1.0 if not length_unit else mta.unit_conversion_factor(length_unit, "angstrom")
        )
        self.interaction_range = float(capabilities.interaction_range) * to_angstrom
        if interaction_range is not None:
            if not float(interaction_range) >= self.interaction_range:
                raise ValueError(
                    f"interaction_range={interaction_range!r} Å is shorter than the "
                    f"{self.interaction_range:g} Å the model declares"
                )
            self.interaction_range = float(interaction_range)
        if not math.isfinite(self.interaction_range):
            raise ValueError(
                "the model's interaction_range is infinite (long-range terms): "
                "it cannot be evaluated on spatial domains with a finite halo"
            )
        hops = self.interaction_range / min(self._cutoffs)
        self.num_layers = max(1, math.ceil(hops * (1.0 - _RANGE_SLACK)))
        self.atomic_types: Sequence[int] = tuple(int(z) for z in capabilities.atomic_types)
        self._length_unit = "angstrom"
        self.eval()
        self.unfold = self._reads_positions() if unfold is None else bool(unfold)

    # -- placement -------------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model declares (``capabilities().dtype``)."""
        return self._declared_dtype.dtype

    def to(self, *args: Any, **kwargs: Any) -> Metatomic:
        """``Module.to``, refusing another dtype than the declared one and devices the
        model does not support (``capabilities().supported_devices``)."""
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is not None and dtype != self.dtype:
            raise ValueError(
                f"the metatomic model declares {self.dtype} and runs in it; it cannot be "
                f"cast to {dtype} (leave ShardedCalculator's dtype at None)"
            )
        if device is not None and torch.device(device).type not in self.supported_devices:
            raise ValueError(
                f"the metatomic model supports the devices {list(self.supported_devices)}, "
                f"not {torch.device(device).type}"
            )
        return super().to(*args, **kwargs)

    def train(self, mode: bool = True) -> Metatomic:
        """Inference only: the wrapped model stays in eval mode."""
        return super().train(False)

    # -- evaluation ------------------------------------------------------------------

    def _pairs(self, graph: LocalGraph) -> _Pairs:
        """The graph's edges as metatomic pairs, each labelled by the pair it belongs to.

        Two edges are one pair when one is the exact reverse of the other (same
        nodes swapped, negated vector); ``label`` is ``+k`` for the pair's first
        direction (from the lower node; between an atom and its own image, the
        direction whose vector is lexicographically positive) and ``-k`` for the
        other, ``k = 1, 2, ...``: metatomic's ``(first, second, shift)`` and its
        reverse ``(second, first, -shift)``.
        """
        centre, neighbour = graph.edge_index
        vectors = graph.edge_vectors
        device = centre.device
        is_centre = torch.zeros(graph.n_atoms, dtype=torch.bool, device=device)
        is_centre[centre] = True
        detached = vectors.detach()
        first_way = (centre < neighbour) | (
            (centre == neighbour) & _lexicographically_positive(detached)
        )
        # the pair's key: its first direction's nodes and vector (reverses are exact
        # negations: the calculator forms both from the same offsets); + 0.0 turns -0.0
        # into 0.0, which the rows compare by
        sign = torch.where(first_way, 1.0, -1.0).to(detached.dtype)[:, None]
        low = torch.where(first_way, centre, neighbour)
        high = torch.where(first_way, neighbour, centre)
        keys = torch.cat(
            [
                low[:, None].to(detached.dtype),
                high[:, None].to(detached.dtype),
                sign * detached + 0.0,
            ],
            dim=1,
        )
        _, pair, count = torch.unique(keys, dim=0, return_inverse=True, return_counts=True)
        label = (pair + 1).to(torch.int32)
        label = torch.where(first_way, label, -label)
        lone = count[pair] == 1
        # an edge whose reverse is not listed: to a node whose own edges are not
        # listed (a ghost at the edge of the halo), or, between two nodes whose edges
        # are listed, to a periodic image of an owned atom from a ghost (the
        # calculator folds an owned atom's images onto it but keeps one ghost node
        # per image of a foreign atom, so the reverse is listed to another node)
        one_way = lone & ~is_centre[neighbour]
        zeros = torch.zeros_like(label)
        return _Pairs(
            centre,
            neighbour,
            vectors,
            torch.stack([label, zeros, zeros], dim=1),
            first_way | lone,
            one_way,
            lone & ~one_way,
        )

    def _neighbor_list(self, pairs: _Pairs, cutoff: float, full: bool) -> Any:
        """A metatomic neighbour list (``TensorBlock``) of the pairs shorter than ``cutoff``.

        Full: every listed edge, and the reverse of every edge to a node whose
        own edges are not listed. Half: one edge per pair.
        """
        first, second, vectors, shifts = pairs.first, pairs.second, pairs.vectors, pairs.shifts
        if full:
            one_way = pairs.one_way.nonzero().squeeze(1)
            first, second = (
                torch.cat([first, second[one_way]]),
                torch.cat([second, first[one_way]]),
            )
            vectors = torch.cat([vectors, -vectors.index_select(0, one_way)])
            shifts = torch.cat([shifts, -shifts[one_way]])
        else:
            if bool(pairs.unpaired.any()):
                raise NotImplementedError(
                    "the metatomic model requests a half neighbour list, and this rank's graph "
                    "lists some pairs between a ghost and a periodic image of an owned atom "
                    "in one direction only (several ranks, full halo, several layers): a "
                    "half list cannot give both ends each of their neighbours once. Run it "
                    "on one rank, or with a cell large enough for the halo (docs/models.md)"
                )
            kept = pairs.half.nonzero().squeeze(1)
            first, second, shifts = first[kept], second[kept], shifts[kept]
            vectors = vectors.index_select(0, kept)
        if cutoff < self.cutoff:
            inside = torch.linalg.vector_norm(vectors.detach(), dim=1) < cutoff
            inside = inside.nonzero().squeeze(1)
            first, second, shifts = first[inside], second[inside], shifts[inside]
            vectors = vectors.index_select(0, inside)
        nodes = torch.stack([first, second], dim=1).to(torch.int32)
        return _pair_block(torch.cat([nodes, shifts], dim=1), vectors)

    def _reads_positions(self) -> bool:
        """Whether the model computes from ``System.positions``: its energies of two atoms
        at half the shortest cutoff, with NaN positions, are not finite or differ from
        those with the positions the neighbour lists' vectors imply."""
        mta = _metatomic()
        tensors = [*self.model.parameters(), *self.model.buffers()]
        device = tensors[0].device if tensors else torch.device("cpu")
        vector = torch.tensor([[0.5 * min(self._cutoffs), 0.0, 0.0]], dtype=self.dtype)
        output = mta.ModelOutput(unit="eV", sample_kind="atom", explicit_gradients=[])
        options = mta.ModelEvaluationOptions(
            length_unit=self._length_unit, outputs={self.energy_output: output}
        )
        energies = []
        for positions in (torch.full((2, 3), math.nan, dtype=self.dtype), vector.new_zeros(2, 3)):
            positions[1:] += vector
            system = mta.System(
                types=torch.full((2,), int(self.atomic_types[0]), dtype=torch.int32),
                positions=positions,
                cell=torch.zeros((3, 3), dtype=self.dtype),
                pbc=torch.zeros(3, dtype=torch.bool),
            ).to(device)
            for request, full in zip(self._requests, self._full, strict=True):
                pairs = [[0, 1, 0, 0, 0], [1, 0, 0, 0, 0]] if full else [[0, 1, 0, 0, 0]]
                vectors = torch.cat([vector, -vector])[: len(pairs)]
                block = _pair_block(torch.tensor(pairs, dtype=torch.int32), vectors)
                system.add_neighbor_list(request, block.to(device))
            try:
                with torch.no_grad():
                    results = self.model([system], options, check_consistency=False)
            except RuntimeError:  # e.g. a model checking that positions are finite
                return True
            energies.append(results[self.energy_output].block().values.cpu())
        with_nan, energy = energies
        return not (
            bool(torch.isfinite(with_nan).all())
            and torch.allclose(with_nan, energy, rtol=1e-6, atol=0.0)
        )

    def _unfold(self, graph: LocalGraph) -> _Images:
        """The graph unfolded into explicit periodic images, as LAMMPS gives ghosts.

        Each connected part of the graph holding an owned node is placed by a spanning
        tree from its lowest node (a node's position: its parent's plus the edge
        vector), so an owned node's position is one of its atom's periodic images.
        From the owned nodes (images ``0 .. n_owned - 1``), ``num_layers`` times, each
        image of the last level gets its node's edges: the neighbour at its position
        plus the edge vector is an image already made (closer than ``_SAME_IMAGE``,
        whatever node brought it: a foreign atom's image can be two ghost nodes) or a
        new one. Images up to ``num_layers - 1`` hops from an owned one have all their
        node's pairs; those ``num_layers`` hops out, the reverses of the pairs to them.

        Positions are sums of ``graph.edge_vectors`` (differentiable): where the edge
        vectors are those of atoms that move or a cell that is strained, the images'
        positions are those atoms' translated, so the gradient with respect to the
        edge vectors gives the model's forces and stress (not the split of the virial
        between atoms).
        """
        from scipy.spatial import cKDTree

        vectors = graph.edge_vectors
        device = vectors.device
        n, n_owned = graph.n_atoms, int(graph.n_owned)
        centre, neighbour = (index.cpu().numpy() for index in graph.edge_index)
        flat = vectors.detach().to(torch.float64).cpu().numpy()

        def indices(values: np.ndarray) -> torch.Tensor:
            return torch.as_tensor(values, dtype=torch.int64, device=device)

        frame, part = _placed(vectors, centre, neighbour, n, n_owned)
        frame_points = frame.detach().to(torch.float64).cpu().numpy()
        # the parts apart, for finding images by position (each part has its own origin)
        reach = np.abs(frame_points).max(initial=0.0) + (self.num_layers + 1) * self.cutoff
        apart = np.array([2.0 * reach + 1.0, 0.0, 0.0])

        owned = np.arange(n_owned)
        nodes = [owned]
        positions = [frame[:n_owned]]
        points = [frame_points[owned] + part[owned, None] * apart]
        by_centre = np.argsort(centre, kind="stable")
        counts = np.bincount(centre, minlength=n)
        starts = np.cumsum(counts) - counts
        firsts, seconds = [], []
        base, made = 0, n_owned  # the first image of this level, the images made
        for level in range(self.num_layers):
            here = nodes[level]
            count = counts[here]
            if np.any((count == 0) & (here >= n_owned)):
                raise RuntimeError(
                    f"a ghost {level} hops from an owned atom has no listed edges: the "
                    "graph's halo is shallower than the metatomic model's num_layers"
                )
            centres = np.repeat(np.arange(len(here)), count)
            within = np.arange(centres.shape[0]) - np.repeat(np.cumsum(count) - count, count)
            edge = by_centre[np.repeat(starts[here], count) + within]
            point = points[level][centres] + flat[edge]
            distance, image = cKDTree(np.concatenate(points)).query(
                point, distance_upper_bound=_SAME_IMAGE
            )
            image = np.where(np.isfinite(distance), image, -1)
            new = np.flatnonzero(image < 0)
            first = np.arange(new.shape[0])  # the first of the new ones at the same point
            if new.shape[0] > 1:
                pairs = cKDTree(point[new]).query_pairs(_SAME_IMAGE, output_type="ndarray")
                np.minimum.at(first, pairs[:, 1], pairs[:, 0])
            kept = np.flatnonzero(first == np.arange(new.shape[0]))
            number = np.zeros(new.shape[0], dtype=np.int64)
            number[kept] = np.arange(kept.shape[0])
            image[new] = made + number[first]
            kept = new[kept]
            nodes.append(neighbour[edge[kept]])
            points.append(point[kept])
            step = positions[level].index_select(0, indices(centres[kept]))
            positions.append(step + vectors.index_select(0, indices(edge[kept])))
            firsts.append(base + centres)
            seconds.append(image)
            base, made = base + here.shape[0], made + kept.shape[0]
        first, second = np.concatenate(firsts), np.concatenate(seconds)
        # the reverse of each pair to an image whose own pairs are not listed
        key, back = first * made + second, second * made + first
        lone = ~np.isin(back, key)
        first, second = (
            np.concatenate([first, second[lone]]),
            np.concatenate([second, first[lone]]),
        )
        return _Images(
            indices(np.concatenate(nodes)), torch.cat(positions), indices(first), indices(second)
        )

    def _periodic_system(self, graph: LocalGraph) -> tuple[Any, _Pairs]:
        """A graph with no ghosts as metatomic's own calculator gives the system: the
        atoms' positions, the cell, periodicity and each pair's cell shift.

        The positions are sums of ``graph.edge_vectors`` along a spanning tree (see
        :func:`_placed`), so each part of the system is one of its periodic images. What
        a path leaves of an edge vector is a lattice vector, ``shift @ cell``: its
        integer shift from ``graph.cell``, and the cell's rows by least squares over the
        edges with a non-zero shift (differentiable: a strain of the edge vectors strains
        it). An axis no edge crosses is not periodic and its row is zero; nothing of the
        model's then depends on it. Moving atoms or straining the cell moves every
        position and cell row with them, so the calculator's gradient with respect to
        the edge vectors gives the model's forces and stress exactly; the split of the
        virial between atoms (per-atom stresses) follows the tree's paths.
        """
        mta = _metatomic()
        vectors = graph.edge_vectors
        device = vectors.device
        centre, neighbour = graph.edge_index
        n = graph.n_atoms
        positions, _ = _placed(vectors, centre.cpu().numpy(), neighbour.cpu().numpy(), n, n)
        # what the tree's path leaves of each edge vector
        path = positions.index_select(0, neighbour) - positions.index_select(0, centre)
        lattice = vectors - path
        cell = np.zeros((3, 3)) if graph.cell is None else graph.cell.cpu().numpy()
        cell = cell.astype(np.float64)
        flat = lattice.detach().cpu().numpy().astype(np.float64)
        shifts = np.rint(flat @ np.linalg.pinv(cell))
        misfit = np.abs(flat - shifts @ cell).max(initial=0.0)
        if not misfit < _LATTICE_MISFIT:
            raise ValueError(
                f"the graph's edge vectors close loops {misfit:.3g} Å away from a lattice "
                "vector of graph.cell: the graph needs the system's cell"
            )
        crossing = np.flatnonzero(shifts.any(axis=1))
        crossed = shifts[crossing]
        normal = torch.as_tensor(np.linalg.pinv(crossed.T @ crossed), dtype=vectors.dtype)
        crossed_t = torch.as_tensor(crossed.T, dtype=vectors.dtype)
        steps = lattice.index_select(0, torch.as_tensor(crossing, device=device))
        # the rows of axes no edge crosses come out zero (pinv of a zero block)
        lattice_cell = normal.to(device) @ (crossed_t.to(device) @ steps)
        system = mta.System(
            types=graph.numbers.to(torch.int32),
            positions=positions,
            cell=lattice_cell,
            pbc=torch.as_tensor(crossed.any(axis=0), device=device),
        )
        pairs = self._pairs(graph)
        pairs = pairs._replace(shifts=torch.as_tensor(shifts, dtype=torch.int32, device=device))
        return system, pairs

    def _image_neighbor_list(
        self, images: _Images, vectors: torch.Tensor, cutoff: float, full: bool
    ) -> Any:
        """A neighbour list of the unfolded images' pairs shorter than ``cutoff`` (a half
        list: from the lower image), with no cell shifts."""
        first, second = images.first, images.second
        keep = None if full else first < second
        if cutoff < self.cutoff:
            inside = torch.linalg.vector_norm(vectors.detach(), dim=1) < cutoff
            keep = inside if keep is None else keep & inside
        if keep is not None:
            kept = keep.nonzero().squeeze(1)
            first, second, vectors = first[kept], second[kept], vectors.index_select(0, kept)
        zeros = torch.zeros_like(first)
        samples = torch.stack([first, second, zeros, zeros, zeros], dim=1).to(torch.int32)
        return _pair_block(samples, vectors)

    def forward(self, graph: LocalGraph) -> torch.Tensor:
        """Per-atom energies in eV, shape ``(n_atoms,)``: the owned atoms' from the
        model, zeros for the ghosts (the calculator discards those rows)."""
        mta = _metatomic()
        from metatensor.torch import Labels

        if graph.exchange is not None:
            raise ValueError("the metatomic adapter runs with the full halo only")
        vectors = graph.edge_vectors
        n, n_owned = graph.n_atoms, int(graph.n_owned)
        if vectors.dtype != self.dtype:
            raise ValueError(
                f"the metatomic model declares {self.dtype}, the graph is {vectors.dtype}"
            )
        if n_owned == 0:
            return vectors.new_zeros(n)
        device = vectors.device
        cell = torch.zeros((3, 3), dtype=self.dtype, device=device)
        pbc = torch.zeros(3, dtype=torch.bool, device=device)
        listed = 0
        pairs = None
        if self.unfold and n_owned == n:
            # the whole system, no ghosts: positions, cell and shifts, no images
            system, pairs = self._periodic_system(graph)
        elif self.unfold:
            images = self._unfold(graph)
            types = graph.numbers.index_select(0, images.nodes).to(torch.int32)
            positions = images.positions
            system = mta.System(types=types, positions=positions, cell=cell, pbc=pbc)
            pair_vectors = positions.index_select(0, images.second) - positions.index_select(
                0, images.first
            )
            for request, cutoff, full in zip(
                self._requests, self._cutoffs, self._full, strict=True
            ):
                neighbors = self._image_neighbor_list(images, pair_vectors, cutoff, full)
                system.add_neighbor_list(request, neighbors)
        else:
            # unknown here: NaN, so that a model reading positions fails loudly
            positions = torch.full((n, 3), math.nan, dtype=self.dtype, device=device)
            system = mta.System(
                types=graph.numbers.to(torch.int32), positions=positions, cell=cell, pbc=pbc
            )
            pairs = self._pairs(graph)
        if pairs is not None:
            for request, cutoff, full in zip(
                self._requests, self._cutoffs, self._full, strict=True
            ):
                neighbors = self._neighbor_list(pairs, cutoff, full)
                listed += neighbors.values.shape[0]
                system.add_neighbor_list(request, neighbors)

        owned = torch.arange(n_owned, dtype=torch.int32, device=device)
        selected = Labels(
            ["system", "atom"],
            torch.stack([torch.zeros_like(owned), owned], dim=1),
            assume_unique=True,
        )
        output = mta.ModelOutput(unit="eV", sample_kind="atom", explicit_gradients=[])
        options = mta.ModelEvaluationOptions(
            length_unit=self._length_unit,
            outputs={self.energy_output: output},
            selected_atoms=selected,
        )
        results = self.model([system], options, check_consistency=self.check_consistency)
        block = results[self.energy_output].block()
        values = block.values.reshape(-1)
        if (
            vectors.requires_grad
            and torch.is_grad_enabled()
            and listed
            and not values.requires_grad
        ):
            raise RuntimeError(
                "the metatomic model's energies do not depend on the neighbour-list vectors: "
                "a model that computes distances from System.positions needs the graph "
                "unfolded into periodic images, Metatomic(..., unfold=True) (docs/models.md)"
            )
        atoms = block.samples.column("atom").to(torch.int64)
        return values.new_zeros(n).index_add(0, atoms, values)
