"""Fixed-size local graphs for ``torch.compile`` (pure torch, no MPI).

A compiled model is specialised to its input shapes; a new node or edge count
would recompile it, and a rank recompiling alone would fall out of step with
the others' collectives. So the graph a compiled model sees has capacities:
owned nodes, ghost nodes and edges padded to sizes that every rank agrees on
and that grow geometrically only when some rank outgrows them.

Padding is inert: padding nodes have an element the model supports, no real
edge touches them, and every padding edge is a self-edge of the first padding
node (a periodic-image-like edge of half the cutoff). Their energies are not
summed and no gradient flows from them into real atoms.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from ase_shard.graph import LocalGraph, predicts_forces

GROWTH = 1.5  # capacity factor when outgrown (and headroom at the first build)


@dataclass(frozen=True)
class Capacities:
    """Padded sizes of one local graph: owned nodes, ghost nodes, edges."""

    owned: int = 0
    ghosts: int = 0
    edges: int = 0

    def grown(self, needed: Capacities) -> Capacities:
        """Capacities that fit ``needed``; unchanged when they already do."""

        def grow(capacity: int, need: int) -> int:
            return capacity if need <= capacity else max(need, math.ceil(GROWTH * capacity))

        if self == Capacities():
            return Capacities(
                *(math.ceil(GROWTH * n) for n in (needed.owned, needed.ghosts, needed.edges))
            )
        return Capacities(
            grow(self.owned, needed.owned),
            grow(self.ghosts, needed.ghosts),
            grow(self.edges, needed.edges),
        )

    @staticmethod
    def largest(all_needed: list[Capacities]) -> Capacities:
        """The element-wise maximum over ranks."""
        return Capacities(
            *(max(getattr(c, f) for c in all_needed) for f in ("owned", "ghosts", "edges"))
        )


def pad_graph(
    graph: LocalGraph, capacity: Capacities, fill_number: int, cutoff: float
) -> LocalGraph:
    """``graph`` with nodes ``[owned, padding, ghosts, padding]`` and padded edges.

    ``capacity.owned`` must exceed ``graph.n_owned`` (one padding node carries
    the padding edges). The returned graph's ``n_owned`` is ``capacity.owned``:
    the caller keeps only the first real ``n_owned`` energies. It carries no
    ``hops``: their counts change every step and would recompile the model,
    which therefore computes on every node and edge.
    """
    n_owned, n = graph.n_owned, graph.n_atoms
    n_ghosts, n_edges = n - n_owned, graph.edge_index.shape[1]
    device = graph.numbers.device
    owned_pad, ghost_pad = capacity.owned - n_owned, capacity.ghosts - n_ghosts
    edge_pad = capacity.edges - n_edges
    if owned_pad < 1 or ghost_pad < 0 or edge_pad < 0:
        raise ValueError(
            f"graph of {n_owned}+{n_ghosts} nodes, {n_edges} edges exceeds {capacity}"
        )

    def nodes(values: torch.Tensor, fill) -> torch.Tensor:
        def block(rows: int) -> torch.Tensor:
            return torch.full((rows, *values.shape[1:]), fill, dtype=values.dtype, device=device)

        return torch.cat([values[:n_owned], block(owned_pad), values[n_owned:], block(ghost_pad)])

    # real node k sits at slot k (owned) or k + owned_pad (ghost)
    slot = torch.arange(n, device=device)
    slot[n_owned:] += owned_pad
    pad_index = torch.full((2, edge_pad), n_owned, dtype=torch.int64, device=device)
    vectors = graph.edge_vectors
    pad_vectors = torch.zeros((edge_pad, 3), dtype=vectors.dtype, device=device)
    pad_vectors[:, 0] = 0.5 * cutoff
    return LocalGraph(
        numbers=nodes(graph.numbers, fill_number),
        edge_index=torch.cat([slot[graph.edge_index], pad_index], dim=1),
        edge_vectors=torch.cat([vectors, pad_vectors]),
        n_owned=capacity.owned,
        exchange=graph.exchange,
        inputs={name: nodes(value, 0.0) for name, value in graph.inputs.items()},
        system=graph.system,
        hops=None,
        system_sum=graph.system_sum,
        cell=graph.cell,
        system_fft=graph.system_fft,
    )


class CompiledModel:
    """A model run through ``torch.compile`` on padded graphs, and what it needs.

    Parameters
    ----------
    model : torch.nn.Module
    backend : str
        ``torch.compile``'s backend.

    Attributes
    ----------
    compiled : callable
        The compiled model; the block gives it graphs padded to :attr:`capacity`.
    capacity : Capacities
        The padded sizes every rank uses; they grow only when some rank
        outgrows them, so the ranks recompile together, rarely.
    fallbacks : int
        Frames torch.compile gave up on (they ran eagerly) while this model ran.

    Raises
    ------
    ValueError
        For a model that declares ``supports_compile = False``: one whose
        results the padding rows would change (Orb's mean over owned nodes),
        and for one that predicts its forces (``PredictedForces``: one row per
        owned atom, spare rows included).
    """

    def __init__(self, model: torch.nn.Module, backend: str):
        if not runs_compiled(model):
            raise ValueError(
                f"{type(model).__name__} does not run compiled (compile=...): the padded "
                "graphs' spare rows would change its results; run it without compile"
            )
        # a frame dynamo cannot compile runs eagerly instead of raising; counted and
        # warned about in count_fallbacks
        torch._dynamo.config.suppress_errors = True
        self.compiled = torch.compile(model, backend=backend, dynamic=False)
        self.name = type(model).__name__
        self.capacity = Capacities()
        self.fallbacks = 0
        self._failed = _failed_frames()

    def grow(self, every_rank_needs: list[Capacities]) -> Capacities:
        """The capacities after every rank's needs (the same on every rank)."""
        self.capacity = self.capacity.grown(Capacities.largest(every_rank_needs))
        return self.capacity

    def count_fallbacks(self) -> None:
        """Warn when torch.compile gave up on part of the model (it then runs eagerly)."""
        failed = _failed_frames()
        if failed > self._failed:
            self.fallbacks += failed - self._failed
            self._failed = failed
            warnings.warn(
                f"torch.compile could not compile part of {self.name}; that part runs "
                f"eagerly, {self.fallbacks} time(s) so far (calc.compile_fallbacks); "
                "torch._dynamo's warning in the log says why",
                RuntimeWarning,
                stacklevel=3,
            )


def runs_compiled(model: torch.nn.Module) -> bool:
    """Whether ``torch.compile`` may run the model on padded graphs (see
    :class:`CompiledModel`)."""
    return getattr(model, "supports_compile", True) is not False and not predicts_forces(model)


def _failed_frames() -> int:
    """Frames torch.compile has given up on in this process (they ran eagerly)."""
    frames = torch._dynamo.utils.counters["frames"]
    return frames["total"] - frames["ok"]
