"""The local graph a model sees on one rank, and the model protocol."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

import numpy as np
import torch


@dataclass(frozen=True)
class Hops:
    """Message-passing hops from the owned nodes to the nodes and edges of a full halo.

    With them a model restricts each layer to what owned energies depend on,
    using plain slices and precomputed indices. A node is one hop from node
    ``i`` when an edge ``(i, j)`` brings its message into ``i``. Hops are
    counted along the edges listed at the last rebuild (every pair within
    ``cutoff + skin``), a superset of every later step's edges: a node is never
    more hops away than counted, so the sets below hold everything owned
    energies depend on (and maybe a little more, which changes only ghost
    values that nothing reads). Only ``edges`` changes between rebuilds.

    Attributes
    ----------
    edges : tuple of int
        ``edges[k]``, ``k = 0 .. num_layers - 1``: the edges centred on nodes
        within ``k`` hops are the first ``edges[k]`` columns of ``edge_index``
        (edges come sorted by their centre's hop count). ``edges[-1]`` is every
        edge: those centred ``num_layers`` or more hops out cannot reach an
        owned energy and are not listed.
    rows : tuple of int
        ``rows[k]``, ``k = 0 .. num_layers``: how many nodes are within ``k``
        hops (``rows[0]`` is ``n_owned``).
    order : torch.Tensor
        ``(rows[-1],)`` int64: the nodes within ``num_layers`` hops, by hop
        count (stable: the owned nodes first, in their places), so
        ``order[:rows[k]]`` are those within ``k`` hops.
    place : torch.Tensor
        ``(n,)`` int64: each node's index in ``order``; ``-1`` for nodes
        further out, which no listed edge touches.
    """

    edges: tuple[int, ...]
    rows: tuple[int, ...]
    order: torch.Tensor
    place: torch.Tensor


@dataclass(frozen=True)
class MeshSlabs:
    """How the ranks split one mesh's transform (:meth:`SystemFFT.plan`).

    ``order`` is the mesh's axes in the order transformed (a cyclic shift, the
    slabs' axis first); ``shape`` the mesh's shape in that order, ``(n0, n1,
    n2)``. ``planes`` (ascending indices along ``n0``) are the planes this rank
    touches: its part of the mesh is ``(len(planes), n1, n2)``, in and out.
    ``rows`` are this rank's wave numbers along ``n1``: its slab of the
    spectrum is ``(len(rows), n2 // 2 + 1, n0)``. ``touched`` is ``(ranks,
    n0)``: every rank's planes.
    """

    order: tuple[int, int, int]
    shape: tuple[int, int, int]
    planes: np.ndarray
    rows: slice
    touched: np.ndarray


class MeshTransform(Protocol):
    """The 3-D FFT of a mesh summed over every rank (``LocalGraph.system_fft``).

    Unnormalised both ways, a constant for autograd; collective: every rank
    calls :meth:`plan`, :meth:`forward` and then :meth:`inverse` for meshes of
    one shape (:class:`ase_shard.system_fft.SystemFFT`).
    """

    def plan(self, shape: Sequence[int], touched: Sequence[torch.Tensor]) -> MeshSlabs:
        """The split, from the planes along each axis (three bool tensors) where
        this rank's mesh may be nonzero."""

    def forward(self, slabs: MeshSlabs, partial: torch.Tensor) -> torch.Tensor:
        """``torch.fft.rfftn`` of the ranks' meshes summed, axes in ``slabs.order``,
        this rank's slab, ``(k1 in slabs.rows, k2, k0)``; ``partial`` is this rank's
        mesh on ``slabs.planes``."""

    def inverse(self, slabs: MeshSlabs, spectrum: torch.Tensor) -> torch.Tensor:
        """The real mesh (``irfftn``, ``norm="forward"``) on this rank's planes from
        every rank's slab of its spectrum."""


@dataclass
class LocalGraph:
    """One rank's block of atoms: owned nodes first, then ghost nodes.

    A node is one atom; periodic images of an atom are not extra nodes but
    edges whose vectors include the image shift, as in a periodic graph.

    Attributes
    ----------
    numbers : torch.Tensor
        ``(n,)`` int64 atomic numbers of all local nodes.
    edge_index : torch.Tensor
        ``(2, E)`` int64 directed edges ``(centre, neighbour)``, pairs within
        ``cutoff``: every edge centred on an owned node and, with the full halo
        and several layers, every edge centred on a ghost fewer than
        ``num_layers`` hops from an owned node (see ``hops``); further edges
        cannot change an owned energy. Between two such centres both
        directions are present (a full list).
    edge_vectors : torch.Tensor
        ``(E, 3)`` vectors ``r_neighbour - r_centre`` in Å, periodic images
        already applied. Differentiable: forces and stress are derived from
        ``dE/d edge_vectors``.
    n_owned : int
        Nodes ``[0, n_owned)`` are owned by this rank; their energies count.
    exchange : callable or None
        Per-layer halo (``halo="layer"``): every edge is centred on an owned
        node, and ``exchange(owned_features)`` turns ``(n_owned, ...)``
        features into ``(n, ...)`` ones whose ghost rows hold their owners'
        values. A message-passing model calls it between layers, the same
        number of times on every rank (it is collective). ``None`` (full
        halo): ghost features are computed locally; nothing to exchange.
    inputs : dict of str to torch.Tensor
        The per-atom arrays the model declares in ``per_atom_inputs``, one
        ``(n, ...)`` tensor each in the model's dtype (ghosts carry their
        owner's values).
    system : dict of str to torch.Tensor
        The per-system values the model declares in ``system_inputs``, the
        same on every rank, in the model's dtype.
    hops : Hops or None
        With the full halo and several layers, how far nodes and edges are
        from the owned nodes, for the model to skip work that cannot reach an
        owned energy with plain slices, without waiting for a GPU. ``None``
        where every edge is centred on an owned node (per-layer halo, one
        layer), in the padded graphs of ``torch.compile`` (the counts change
        every step) and in graphs built by hand; a model then computes on
        every node and edge. Optional: a model may ignore it.
    system_sum : callable or None
        ``system_sum(partial)`` adds a rank's ``partial`` tensor (any shape,
        the same on every rank) over all ranks of the evaluation and returns
        the sum in ``partial``'s dtype and device, identical on every rank.
        For a model whose energy is not a sum of per-atom terms (a readout of
        the mean of all atoms' features, as Orb's): it sums its owned nodes'
        part. Collective: every rank calls it the same number of times, also a
        rank that owns no atoms. The sum is a constant for autograd. ``None``
        where the graph holds the whole system (one process, graphs built by
        hand): the sum is ``partial`` itself.
    positions : torch.Tensor or None
        ``(n, 3)`` node positions in Å in the model's dtype (an owned node at
        its atom, a ghost at the image of its atom that its edges reach).
        Given only to a model that predicts its forces
        (:class:`PredictedForces`): they are not the gradient of an energy, so
        nothing forbids it absolute geometry; and to a model that declares
        ``uses_positions`` (a reciprocal-space sum), differentiable. ``None``
        for every other model, which sees geometry only through
        ``edge_vectors``.
    cell : torch.Tensor or None
        ``(3, 3)`` the system's cell in Å in the model's dtype (zeros where
        the ``Atoms`` have none), a constant: the calculator's stress comes
        from ``edge_vectors``, so a model that needs the cell in its energy
        forms it from them (the metatomic adapter takes from it only which
        periodic image an edge reaches). Differentiable for a model that
        declares ``uses_positions``. Given to every model by the calculator;
        ``None`` in graphs built by hand.
    system_fft : MeshTransform or None
        The 3-D FFT of a mesh summed over all ranks, split among them in
        slabs (:class:`ase_shard.system_fft.SystemFFT`: ``plan(shape,
        touched)`` cuts the slabs, ``forward(slabs, partial)`` gives this
        rank's slab of the spectrum, ``inverse(slabs, spectrum)`` the real mesh
        on the planes it touched), for a mesh-based reciprocal-space sum (PME). Collective, like
        ``system_sum``, and a constant for autograd. ``None`` where the graph
        holds the whole system: the transform is ``torch.fft.rfftn`` of the
        mesh itself.
    """

    numbers: torch.Tensor
    edge_index: torch.Tensor
    edge_vectors: torch.Tensor
    n_owned: int
    exchange: Callable[[torch.Tensor], torch.Tensor] | None = None
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    system: dict[str, torch.Tensor] = field(default_factory=dict)
    hops: Hops | None = None
    system_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
    positions: torch.Tensor | None = None
    cell: torch.Tensor | None = None
    system_fft: MeshTransform | None = None

    @property
    def n_atoms(self) -> int:
        """Number of local nodes (owned + ghosts)."""
        return int(self.numbers.shape[0])

    def within(
        self, cutoff: float, exchange: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> LocalGraph:
        """This graph with only its edges shorter than ``cutoff`` (Å), for a part of a
        model with a shorter reach (a sum's term, a charge model); ``exchange`` in place
        of this graph's, and no ``hops`` (they count this graph's edges)."""
        length = torch.linalg.vector_norm(self.edge_vectors.detach(), dim=1)
        kept = (length < float(cutoff)).nonzero().squeeze(1)
        return replace(
            self,
            edge_index=self.edge_index.index_select(1, kept),
            edge_vectors=self.edge_vectors.index_select(0, kept),
            exchange=exchange,
            hops=None,
        )


@runtime_checkable
class ShardModel(Protocol):
    """What ``ShardedCalculator`` needs from a ``torch.nn.Module``.

    ``cutoff`` (Å) is the range of one interaction; ``num_layers`` is the
    message-passing depth, so an atom's energy depends on atoms up to
    ``cutoff * num_layers`` away (the receptive field). ``atomic_types`` lists the
    supported atomic numbers, or is ``None`` when any element works.
    ``forward(graph)`` returns ``(n,)`` per-atom energies in eV for every local
    row. Messages flow into the centre ``edge_index[0]``: after one layer the
    energy of atom ``i`` may depend only on the edges centred on ``i``.

    Optional declarations: ``per_atom_inputs`` (names of ``Atoms`` arrays,
    e.g. ``("initial_charges",)``) and ``system_inputs`` (names looked up in
    ``atoms.info``, else the calculator's parameters, else the model's
    ``system_input_defaults``, e.g. ``("charge",)``) arrive as ``graph.inputs``
    and ``graph.system`` (see ``ase_shard.inputs``).

    A model that sets ``supports_layer_halo = True`` calls
    ``graph.exchange`` between its layers when it is not ``None``; it then
    runs with a one-cutoff halo (``ShardedCalculator(halo="layer")``).

    A model whose energy is not a sum of per-atom terms sums its owned nodes'
    part over the ranks with ``graph.system_sum`` (collective); one whose
    results the padded graphs of ``compile=...`` would change declares
    ``supports_compile = False`` and is refused there.

    A model whose forces and stress are outputs of its network, not the
    gradient of its energy, declares ``predicts_forces = True`` and returns a
    :class:`PredictedForces` instead of energies.

    A model whose energy depends on absolute positions and the cell, not only
    on edges (the reciprocal-space sum of Ewald or PME), declares
    ``uses_positions = True``: ``graph.positions`` and ``graph.cell`` are then
    differentiable, both strained by one strain tensor, and the calculator adds
    ``-dE/dpositions`` to the forces and ``dE/dstrain`` to the virial. What
    depends on every rank's atoms (structure factors, a charge mesh) goes
    through ``graph.system_sum``; since that sum is a constant for autograd,
    the model arranges its energy's gradient to be complete (see
    :class:`ase_shard.models.Coulomb`). Per-atom stresses are not defined for
    such a model (``calc.get_stresses()`` is refused).
    """

    cutoff: float
    num_layers: int
    atomic_types: Sequence[int] | None

    def __call__(self, graph: LocalGraph) -> torch.Tensor: ...


@dataclass(frozen=True)
class PredictedForces:
    """What ``forward`` returns for a model that declares ``predicts_forces = True``.

    Such a model's forces and stress are outputs of its network (Orb's direct
    models), so the calculator takes no gradient: it uses these as they are,
    each rank's for the atoms it owns. The model is called under
    ``torch.no_grad()`` (one that differentiates something itself enables
    grad) and gets ``graph.positions`` and ``graph.cell``. Every owned atom's
    force must be complete on its own rank, as its owned nodes' features are
    (nothing is added from other ranks); what depends on the whole system (a
    mean force removed, pooled features read out) goes through
    ``graph.system_sum``. Not with ``compile=...``.

    Attributes
    ----------
    energies : torch.Tensor
        ``(n_owned,)`` eV: the owned atoms' shares of the system's energy
        (``calc.results["energies"]``), adding up over all ranks to it.
    forces : torch.Tensor
        ``(n_owned, 3)`` eV/Å: the owned atoms' forces.
    virials : torch.Tensor
        ``(n_owned, 6)`` eV, Voigt xx, yy, zz, yz, xz, xy: the owned atoms'
        shares of the system's virial (stress × volume), adding up over all
        ranks to it; zeros where the cell has no volume. Per-atom stresses are
        not defined for such a model (``calc.get_stresses()`` is refused).
    """

    energies: torch.Tensor
    forces: torch.Tensor
    virials: torch.Tensor

    def check(self, n_owned: int, model: str) -> None:
        """Raise ``ValueError`` unless the shapes fit ``n_owned`` owned atoms."""
        wanted = {"energies": (n_owned,), "forces": (n_owned, 3), "virials": (n_owned, 6)}
        for name, shape in wanted.items():
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise ValueError(
                    f"{model} predicted {name} of shape {got}, not {shape} (one row per "
                    "owned atom)"
                )


def predicts_forces(model: ShardModel) -> bool:
    """Whether the model returns :class:`PredictedForces` (``predicts_forces = True``)."""
    return bool(getattr(model, "predicts_forces", False))


def uses_positions(model: ShardModel) -> bool:
    """Whether the model's energy reads absolute positions and the cell
    (``uses_positions = True``; a :class:`~ase_shard.models.Sum` with such a term)."""
    return bool(getattr(model, "uses_positions", False))


# what every model declares (see ShardModel); forward is checked apart
PROTOCOL = ("cutoff", "num_layers", "atomic_types")


def check_model(model: object) -> None:
    """Refuse what cannot be evaluated as a model, naming what is wrong.

    Raises ``TypeError`` when ``model`` is not a ``torch.nn.Module``, or is
    one that lacks part of the protocol (:class:`ShardModel`: ``cutoff``,
    ``num_layers``, ``atomic_types`` and its own ``forward``), and
    ``ValueError`` when a declaration is out of range (``cutoff`` not a
    positive, finite distance in Å, ``num_layers`` not a positive integer,
    ``atomic_types`` neither ``None`` nor atomic numbers). Checked when the
    calculator is made, so that a wrong model fails there and not at the first
    calculation.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            "the model must be a torch.nn.Module that follows the model protocol "
            f"(ase_shard.ShardModel: {', '.join(PROTOCOL)}, forward), not {_described(model)}"
        )
    name = type(model).__name__
    missing = [attribute for attribute in PROTOCOL if not hasattr(model, attribute)]
    if type(model).forward is torch.nn.Module.forward:
        missing.append("forward")
    if missing:
        raise TypeError(
            f"{name} does not follow the model protocol (ase_shard.ShardModel): it lacks "
            f"{', '.join(missing)}; a model declares cutoff (Å), num_layers and atomic_types "
            "and maps a LocalGraph to per-atom energies (docs/models.md)"
        )
    try:
        cutoff = float(model.cutoff)
    except (TypeError, ValueError):
        cutoff = np.nan
    if not (np.isfinite(cutoff) and cutoff > 0):
        raise ValueError(f"{name}.cutoff must be a positive distance in Å, not {model.cutoff!r}")
    layers = model.num_layers
    if isinstance(layers, bool) or not isinstance(layers, (int, np.integer)) or layers < 1:
        raise ValueError(f"{name}.num_layers must be a positive integer, not {layers!r}")
    types = model.atomic_types
    if types is not None:
        numbers = np.asarray(types)
        integral = numbers.dtype.kind in "iu" or numbers.size == 0
        if numbers.ndim != 1 or not integral or (numbers < 0).any():
            raise ValueError(
                f"{name}.atomic_types must be None (any element) or a sequence of atomic "
                f"numbers, not {types!r}"
            )


def _described(value: object) -> str:
    """What ``value`` is, for an error message, with the usual fix."""
    if value is None:
        return "None"
    if isinstance(value, type) and issubclass(value, torch.nn.Module):
        return f"the class {value.__name__}: pass an instance, {value.__name__}(...)"
    if callable(getattr(value, "get_potential_energy", None)):
        return (
            f"an ASE calculator ({type(value).__name__}): ShardedCalculator evaluates a torch "
            "model, e.g. ase_shard.models.EMT(), LennardJones(...), Morse(...), or an ML "
            "adapter (docs/models.md)"
        )
    if isinstance(value, (str, bytes, os.PathLike)):
        return f"{value!r}: load the model first (e.g. an ML adapter, docs/models.md)"
    if callable(value):
        return (
            f"the callable {getattr(value, '__qualname__', type(value).__name__)}: wrap it in "
            "a torch.nn.Module that declares the protocol's attributes"
        )
    return f"a {type(value).__name__}"


@dataclass(frozen=True)
class EdgeList:
    """A block's listed edges, on the host in float64, for models that sum their own forces.

    The edges are those of the last rebuild (every pair within ``cutoff +
    skin``), all centred on owned nodes, in no particular order: both
    directions of a pair between two of them, or with ``newton_pair`` (see
    :class:`DirectForces`) only the one from the lower node; a model keeps
    those shorter than ``cutoff``.

    Attributes
    ----------
    positions : (n, 3) float64 array
        Node positions in Å (owned nodes first, then ghosts).
    numbers : (n,) int64 array
    centre, neighbour : (E,) int64 arrays
    image : (E,) int8, int16 or int32 array
        Each edge's periodic image of its neighbour, a row of ``offsets``.
    offsets : (m, 3) float64 array
        Image offsets in Å: edge ``e``'s vector is
        ``positions[neighbour[e]] - positions[centre[e]] + offsets[image[e]]``.
    n_owned : int
    cutoff : float
        Å: edges this long or longer are left out.
    halo : GhostColumns, optional
        Given to a model that declares ``newton_pair`` when every rank
        evaluates this way and there are several: the block then lists a
        pair between two ranks on one of them only, and the model takes
        each edge to a ghost for both ends, exchanging the ghost ends'
        per-node sums through ``halo`` (collective: every rank calls the same
        exchanges in the same order; see :mod:`ase_shard.kernels`). Always
        given to a model of two stages (see :class:`DirectForces`), which
        exchanges its first stage's per-node values through it.
    per_node_virials : bool
        ``False`` when only the total virial is wanted (no per-atom stresses
        asked for): a model then adds it to node 0's virial columns alone, the
        only ones zeroed (:class:`DirectForces`).
    ids : (n,) int64 array, optional
        Each node's atom: its index in the whole system, the same on every
        rank (a term of several atoms can be taken by one rank, at its
        lowest atom). ``None``: the node indices are the atoms'.
    plain : range
        Edges known to have image 0 (no offset): a kernel may leave their
        offsets out (:func:`ase_shard.kernels._segments`). A block puts most
        of its edges there (:func:`ase_shard.kernels.plain_edges_together`);
        empty: none known.
    scratch : Scratch, optional
        The block's arrays kept from one evaluation to the next (until its
        rebuild); ``None``: a model allocates its own each call.
    """

    positions: np.ndarray
    numbers: np.ndarray
    centre: np.ndarray
    neighbour: np.ndarray
    image: np.ndarray
    offsets: np.ndarray
    n_owned: int
    cutoff: float
    halo: GhostColumns | None = None
    per_node_virials: bool = True
    ids: np.ndarray | None = None
    plain: range = range(0)
    scratch: Scratch | None = None


class Scratch:
    """Host arrays, and plans drawn from the list, that a model keeps between the
    evaluations of one block.

    A block lives from one rebuild to the next, and its list's length with it:
    an array sized by the list is allocated once, not at every step. glibc maps
    each allocation above 32 MiB afresh, and the system then zeroes every page
    of it that the step first touches: EMT's pair terms at 256,000 Cu atoms
    (176 MB) cost 8 % of its step so. The arrays go with the block.
    """

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}
        self._made: dict[str, object] = {}

    def empty(self, name: str, shape: tuple[int, ...], dtype=np.float64) -> np.ndarray:
        """An array of ``shape`` and ``dtype``, as the last call for ``name`` left it
        (uninitialised the first time, or when the shape or dtype changed)."""
        array = self._arrays.get(name)
        if array is None or array.shape != shape or array.dtype != dtype:
            self._arrays.pop(name, None)  # freed before its successor is allocated
            array = self._arrays[name] = np.empty(shape, dtype)
        return array

    def once(self, name: str, make: Callable[[], object]) -> object:
        """``make()``, called at the first call for ``name`` only: a plan drawn from the
        block's list, which lasts as long as the scratch."""
        if name not in self._made:
            self._made[name] = make()
        return self._made[name]


class GhostColumns(Protocol):
    """Per-node values between a block's ghost nodes and their owners, on the host.

    ``columns`` is a ``(k, n)`` float64 array: one row per quantity, one
    column per node (owned, then ghosts). Both calls are collective and end
    in :class:`ase_shard.exchange.PeerFailure` on every rank when another
    rank failed instead of joining (:class:`ase_shard.exchange.HaloExchange`).
    """

    def sum_ghost_columns(self, columns: np.ndarray) -> None:
        """Add every ghost column, on whichever rank, into its owner's column."""

    def copy_owner_columns(self, columns: np.ndarray) -> None:
        """Overwrite every ghost column with its owner's column."""


class DirectForces(Protocol):
    """Optional for one-layer and two-stage models: energies, forces and virials without autograd.

    ``energy_forces(edges, out)`` adds, for the edges of ``edges`` shorter than
    ``edges.cutoff``, the nodes' energies (eV, row 0), the forces (eV/Å,
    rows 1-3) and the virials (eV, rows 4-9, Voigt xx yy zz yz xz xy) to the
    zeroed ``(10, n)`` float64 array ``out``, and returns the smallest squared
    length (Å²) among all the listed edges (``inf`` without edges), for the
    calculator's distance check. Without ``edges.per_node_virials`` it adds
    the virials' sum to node 0's column of rows 4-9 and leaves the other
    columns of those rows alone: they are neither zeroed nor read. Sums over
    ranks must equal the autograd path's: each edge ``(i, j)`` with
    ``g = dE_i/dd`` gives ``+g`` to ``i``'s force and ``-g`` to ``j``'s, and
    ``sym(d ⊗ g) / 2`` to each one's virial; a
    pair potential may move a pair's contributions to the node they belong to
    instead, as both directions are listed on the ranks of their centres. A
    ghost's energy counts towards its owner's, like its force.

    A model that sets ``newton_pair = True`` (LAMMPS's ``newton_pair on``)
    takes a pair from one edge for both ends: it is given one edge per pair
    of owned nodes, and with ``edges.halo`` one rank's edge per pair between
    two ranks.

    A model of two stages (``num_layers = 2`` and ``supports_layer_halo``,
    e.g. D3: coordination numbers, then energies that need them at both
    ends) is given every edge centred on an owned node, both directions
    between two of them, and ``edges.halo`` (a :class:`GhostColumns`). It
    sums its first stage's per-node values over its owned nodes, copies them
    to the ghosts (``copy_owner_columns``), and adds the ghosts' derivatives
    of the energy w.r.t. them into their owners (``sum_ghost_columns``)
    before the forces of the first stage: the per-layer halo's exchange, on
    the host.

    ``ShardedCalculator`` uses it on CPU in float64, without ``torch.compile``,
    for a one-layer model (given no per-layer exchange), or a two-stage model
    with the per-layer halo when every rank evaluates on the host; anywhere else, and
    for ``forward``, the model's autograd path counts. The built-in potentials
    have it (``ase_shard.kernels``, ``ase_shard.d3_kernels``).
    """

    def energy_forces(self, edges: EdgeList, out: np.ndarray) -> float: ...


def direct_forces(model: ShardModel) -> DirectForces | None:
    """The model when it computes its own forces (:class:`DirectForces`), else ``None``."""
    layers = int(model.num_layers)
    stages = layers == 1 or (layers == 2 and supports_layer_halo(model))
    if stages and callable(getattr(model, "energy_forces", None)):
        return model
    return None


def takes_pairs_once(model: ShardModel) -> bool:
    """Whether the model computes its own forces taking each pair once (``newton_pair``)."""
    return direct_forces(model) is not None and bool(getattr(model, "newton_pair", False))


def supports_layer_halo(model: ShardModel) -> bool:
    """Whether the model exchanges ghost features between layers itself."""
    return bool(getattr(model, "supports_layer_halo", False))


def receptive_field(model: ShardModel) -> float:
    """Distance (Å) within which atoms influence an atom's energy: ``cutoff *
    num_layers``, or what a model of several terms declares (``receptive_field``,
    :class:`ase_shard.models.Sum`)."""
    declared = getattr(model, "receptive_field", None)
    if declared is not None:
        return float(declared)
    return float(model.cutoff) * int(model.num_layers)


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    """dtype of the model's floating parameters/buffers (float64 if it has none)."""
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.is_floating_point():
            return tensor.dtype
    return torch.float64


def model_digest(model: torch.nn.Module) -> str:
    """Digest of the model's parameters and buffers (names, dtypes and values)."""
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(str(tensor.dtype).encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()
