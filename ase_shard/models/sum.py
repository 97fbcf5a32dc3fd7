"""A sum of models, each with its own cutoff and depth: ``Sum(mlip, D3())``, ``mlip + d3``.

``ShardedCalculator`` gives every term its own block of edges, listed at the term's own
cutoff (an MLIP's graph is not searched at a dispersion cutoff), over the same owned
atoms and ghosts: the halo covers the largest reach of any term, and the terms' energies,
forces, virials and per-atom values add up (:class:`ase_shard.block.SumBlock`)::

    from ase_shard import ShardedCalculator
    from ase_shard.models import EMT, LennardJones, Sum

    atoms.calc = ShardedCalculator(Sum(EMT(), LennardJones(epsilon=0.01, sigma=3.0)))

See docs/models.md, "Sums of models".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ase_shard.graph import (
    LocalGraph,
    check_model,
    predicts_forces,
    receptive_field,
    uses_positions,
)


class Addable:
    """``model + other`` is ``Sum(model, other)`` (a mixin of the package's models; a
    model of another package added to one of them works from either side)."""

    def __add__(self, other: torch.nn.Module) -> Sum:
        return Sum(self, other)

    def __radd__(self, other: torch.nn.Module) -> Sum:
        return Sum(other, self)


class Sum(Addable, torch.nn.Module):
    """The sum of ``terms``' energies (and so of their forces and stress).

    Parameters
    ----------
    *terms : torch.nn.Module
        Models that follow the ``ShardModel`` protocol (a ``Sum`` among them adds its
        own terms). Not models that predict their forces (Orb's direct heads): their
        forces are not the gradient of an energy that the sum's other terms share.

    Attributes
    ----------
    terms : torch.nn.ModuleList
    cutoff : float
        Å: the longest of the terms' cutoffs.
    num_layers : int
        The deepest term's.
    receptive_field : float
        Å: the longest reach of any term (``cutoff * num_layers`` of each), which the
        full halo covers.
    atomic_types : tuple of int or None
        The elements every term supports (``None``: any).
    supports_layer_halo : bool
        Whether every term of several layers exchanges its features between them:
        then the halo is one (longest) cutoff and each such term exchanges through it.
    uses_positions : bool
        Whether a term's energy reads absolute positions (a ``Coulomb`` term).

    The terms are evaluated in one dtype, the calculator's (``ShardedCalculator(...,
    dtype=...)``, by default the first term's). With ``compile=...`` each term is
    compiled on its own padded graphs; a term that does not run compiled
    (``supports_compile = False``, e.g. ``Coulomb``) runs eagerly beside the others.
    """

    def __init__(self, *terms: torch.nn.Module) -> None:
        super().__init__()
        flat: list[torch.nn.Module] = []
        for term in terms:
            flat.extend(term.terms if isinstance(term, Sum) else [term])
        if not flat:
            raise ValueError("Sum needs at least one term")
        for term in flat:
            check_model(term)
            if predicts_forces(term):
                raise ValueError(
                    f"Sum: {type(term).__name__} predicts its forces, which are not the "
                    "gradient of an energy; sum it with the other terms' forces yourself"
                )
        self.terms = torch.nn.ModuleList(flat)
        self.cutoff = max(float(term.cutoff) for term in flat)
        self.num_layers = max(int(term.num_layers) for term in flat)
        self.receptive_field = max(receptive_field(term) for term in flat)
        self.atomic_types = _common_types([term.atomic_types for term in flat])
        self.supports_layer_halo = all(
            int(term.num_layers) == 1 or bool(getattr(term, "supports_layer_halo", False))
            for term in flat
        )
        self.uses_positions = any(uses_positions(term) for term in flat)
        self.per_atom_inputs = _union(getattr(term, "per_atom_inputs", ()) for term in flat)
        self.system_inputs = _union(getattr(term, "system_inputs", ()) for term in flat)
        defaults: dict = {}
        for term in flat:
            defaults.update(getattr(term, "system_input_defaults", None) or {})
        self.system_input_defaults = defaults

    def forward(self, graph: LocalGraph) -> torch.Tensor:
        """Per-atom energies in eV, ``(n_atoms,)``: each term's on the graph's edges
        shorter than its cutoff.

        For a graph built by hand, with every edge that each term needs (a full halo's
        hop-sorted edges are one term's only). ``ShardedCalculator`` instead gives each
        term its own block of edges at its own cutoff.
        """
        total = graph.edge_vectors.new_zeros(graph.n_atoms)
        for term in self.terms:
            exchange = graph.exchange if getattr(term, "supports_layer_halo", False) else None
            part = graph.within(float(term.cutoff), exchange)
            total = total + term(part)
        return total

    def extra_repr(self) -> str:
        return f"cutoff={self.cutoff:g}, receptive_field={self.receptive_field:g}"


def _common_types(types: Sequence[Sequence[int] | None]) -> tuple[int, ...] | None:
    """The atomic numbers in every declared list; ``None`` where no term restricts."""
    declared = [set(int(z) for z in listed) for listed in types if listed is not None]
    if not declared:
        return None
    return tuple(sorted(set.intersection(*declared)))


def _union(names) -> tuple[str, ...]:
    """The names of every term's declaration, each once, in order of first appearance."""
    seen: dict[str, None] = {}
    for declared in names:
        seen.update(dict.fromkeys(declared))
    return tuple(seen)
