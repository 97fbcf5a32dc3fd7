"""What a model is, for ``ase-shard info``: its reach, elements and heads.

Built from the adapter itself (:func:`ase_shard.md.build_model`), so the listing says
what a run with that ``--model`` would use; a SevenNet checkpoint from its config
(:meth:`ase_shard.models.SevenNet.outline`), which its network is built from.
"""

from __future__ import annotations

from collections.abc import Sequence

from ase.data import chemical_symbols

from ase_shard.md import build_model
from ase_shard.presets import ModelSpec


def element_ranges(numbers: Sequence[int]) -> str:
    """Elements as symbols in order of atomic number, three or more consecutive ones
    as a range: ``[1, 2, 3, 5, 29]`` -> ``"H-Li, B, Cu"``."""
    numbers = sorted(set(int(z) for z in numbers))
    runs: list[list[int]] = []
    for z in numbers:
        if runs and z == runs[-1][-1] + 1:
            runs[-1].append(z)
        else:
            runs.append([z])
    parts = []
    for run in runs:
        if len(run) >= 3:
            parts.append(f"{chemical_symbols[run[0]]}-{chemical_symbols[run[-1]]}")
        else:
            parts.extend(chemical_symbols[z] for z in run)
    return ", ".join(parts)


def describe(spec: ModelSpec) -> str:
    """One line: cutoff and layers (and the halo they allow), elements, heads.

    A UMA checkpoint with several tasks is built with its first task: they share
    elements and reach.
    """
    if spec.kind == "sevenn":
        from ase_shard.models import SevenNet

        # from the checkpoint's config, which the network is built from: four shipped
        # checkpoints took 20 s to build
        model = SevenNet.outline(spec.source)
        heads = tuple(model.heads)
    elif spec.kind == "uma":
        from ase_shard.models import UMA

        heads = UMA.tasks(spec.source)
        model = build_model(spec, heads[0] if heads else None)
    else:
        model = build_model(spec, None)
        heads = tuple(getattr(model, "heads", ()))
    halo = "layer halo" if getattr(model, "supports_layer_halo", False) else "full halo"
    layers = int(model.num_layers)
    reach = f"cutoff {model.cutoff:g} Å x {layers} layer{'s' if layers > 1 else ''} ({halo})"
    types = getattr(model, "atomic_types", None)
    elements = (
        "any element"
        if types is None
        else f"{len(set(types))} element{'s' if len(set(types)) > 1 else ''}: "
        f"{element_ranges(types)}"
    )
    line = f"{reach}; {elements}"
    if getattr(model, "predicts_forces", False):
        line += "; forces and stress predicted (not the energy's gradient)"
    if len(heads) > 1:
        line += f"; heads {', '.join(heads)}"
    return line
