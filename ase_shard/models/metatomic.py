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

The ``System``'s positions are not known here (a ``LocalGraph`` carries only edge
vectors): they are NaN, the cell is zero and not periodic, and the pairs' cell shifts
are labels that tell the pairs apart, not images. Models that compute from the
neighbour-list vectors (the usual metatomic models, e.g. metatrain's) are exact; a
model that reads ``System.positions`` or ``System.cell`` gets NaN and the calculator
stops on the non-finite result. See docs/models.md, "metatomic".
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from ase_shard.graph import LocalGraph

# the sample names of a metatomic neighbour list (System.add_neighbor_list)
_PAIR_SAMPLES = ["first_atom", "second_atom", "cell_shift_a", "cell_shift_b", "cell_shift_c"]
# relative slack when counting how many lists' cutoffs the interaction range spans
_RANGE_SLACK = 1e-9
_DTYPES = {"float32": torch.float32, "float64": torch.float64}


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
    label: torch.Tensor  # (E,) int32: +k / -k, the pair and the direction
    half: torch.Tensor  # (E,) bool: the edges of a half list, one per pair
    one_way: torch.Tensor  # (E,) bool: reverse not listed, neighbour's edges not listed
    unpaired: torch.Tensor  # (E,) bool: reverse not listed, both ends' edges listed


def _lexicographically_positive(vectors: torch.Tensor) -> torch.Tensor:
    """``(E,)`` bool: whether each vector's first non-zero component is positive.

    Exactly one of ``v`` and ``-v`` is, for ``v != 0``: it picks one direction of a
    pair between an atom and its own periodic image.
    """
    x, y, z = vectors.unbind(dim=1)
    return (x > 0) | ((x == 0) & ((y > 0) | ((y == 0) & (z > 0))))


class Metatomic(torch.nn.Module):
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
        return _Pairs(
            centre, neighbour, vectors, label, first_way | lone, one_way, lone & ~one_way
        )

    def _neighbor_list(self, pairs: _Pairs, cutoff: float, full: bool) -> Any:
        """A metatomic neighbour list (``TensorBlock``) of the pairs shorter than ``cutoff``.

        Full: every listed edge, and the reverse of every edge to a node whose
        own edges are not listed. Half: one edge per pair.
        """
        from metatensor.torch import Labels, TensorBlock

        first, second, vectors, label = pairs.first, pairs.second, pairs.vectors, pairs.label
        if full:
            one_way = pairs.one_way.nonzero().squeeze(1)
            first, second = (
                torch.cat([first, second[one_way]]),
                torch.cat([second, first[one_way]]),
            )
            vectors = torch.cat([vectors, -vectors.index_select(0, one_way)])
            label = torch.cat([label, -label[one_way]])
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
            first, second, label = first[kept], second[kept], label[kept]
            vectors = vectors.index_select(0, kept)
        if cutoff < self.cutoff:
            inside = torch.linalg.vector_norm(vectors.detach(), dim=1) < cutoff
            inside = inside.nonzero().squeeze(1)
            first, second, label = first[inside], second[inside], label[inside]
            vectors = vectors.index_select(0, inside)
        # the pairs' cell shifts are labels telling pairs (and a pair's two
        # directions) apart, (k, 0, 0) and (-k, 0, 0); the System's cell is zero
        zeros = torch.zeros_like(label)
        samples = torch.stack(
            [first.to(torch.int32), second.to(torch.int32), label, zeros, zeros], dim=1
        )
        device = vectors.device
        return TensorBlock(
            values=vectors.reshape(-1, 3, 1),
            samples=Labels(_PAIR_SAMPLES, samples, assume_unique=True),
            components=[Labels(["xyz"], torch.arange(3, device=device).reshape(3, 1))],
            properties=Labels(["distance"], torch.zeros((1, 1), dtype=torch.int32, device=device)),
        )

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
        system = mta.System(
            types=graph.numbers.to(torch.int32),
            # unknown here: NaN, so that a model reading positions fails loudly
            positions=torch.full((n, 3), math.nan, dtype=self.dtype, device=device),
            cell=torch.zeros((3, 3), dtype=self.dtype, device=device),
            pbc=torch.zeros(3, dtype=torch.bool, device=device),
        )
        pairs = self._pairs(graph)
        listed = 0
        for request, cutoff, full in zip(self._requests, self._cutoffs, self._full, strict=True):
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
                "models that compute distances from System.positions and System.cell are "
                "not supported by the metatomic adapter (docs/models.md)"
            )
        atoms = block.samples.column("atom").to(torch.int64)
        return values.new_zeros(n).index_add(0, atoms, values)
