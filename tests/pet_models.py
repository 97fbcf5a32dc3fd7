"""A test-only PET (metatrain's architecture, PET-MAD's): random weights, small, float64.

``tiny_pet(featurizer)`` builds metatrain's ``PET`` with the hyperparameters metatrain
ships (those of PET-MAD's architecture: attention over each atom's neighbours, edge
messages in both directions, a bump cutoff function) but narrow layers, for Cu, Ag
and Au, and exports it with metatrain's own ``PET.export`` as a metatomic
``AtomisticModel``. Its weights are random (``torch.manual_seed``), its composition
baseline zero: nothing is trained.

PET computes its edge vectors from ``System.positions`` and the cell shifts, not from
the neighbour-list values, so the adapter gives it positions (the system on one rank,
the graph unfolded into periodic images on a rank with ghosts). With
``featurizer_type="feedforward"`` (metatrain's default) an atom's energy depends on
atoms one cutoff further than the ``interaction_range`` PET declares (``num_gnn_layers *
cutoff``): ``REACH`` gives both featurizers' real reach.
"""

from __future__ import annotations

import copy

import torch

SPECIES = (29, 47, 79)  # Cu, Ag, Au
CUTOFF = 3.6  # Å: the fcc Cu tests' first shell (2.55 Å) and most of the second (3.6 Å)
LAYERS = 2  # message-passing (GNN) layers, as PET-MAD's


def pet_hypers(featurizer: str, **sizes) -> dict:
    """metatrain's default PET hyperparameters, narrowed (``sizes`` overrides any)."""
    from metatrain.utils.architectures import get_default_hypers

    hypers = copy.deepcopy(get_default_hypers("pet")["model"])
    narrow = {"d_pet": 8, "d_head": 8, "d_node": 8, "d_feedforward": 8, "num_heads": 2}
    hypers.update(cutoff=CUTOFF, num_gnn_layers=LAYERS, featurizer_type=featurizer)
    hypers.update({**narrow, "num_attention_layers": 1, **sizes})
    return hypers


# Å: how far an atom's energy depends on others, for each featurizer (see the docstring)
REACH = {"residual": LAYERS * CUTOFF, "feedforward": (LAYERS + 1) * CUTOFF}


def tiny_pet(featurizer: str = "feedforward", seed: int = 0, **sizes):
    """A random-weight float64 PET exported with ``PET.export`` (an ``AtomisticModel``);
    ``sizes``: hyperparameters in place of the narrow ones (:func:`pet_hypers`)."""
    from metatrain.pet import PET
    from metatrain.utils.data import DatasetInfo
    from metatrain.utils.data.target_info import get_energy_target_info

    info = DatasetInfo(
        length_unit="angstrom",
        atomic_types=list(SPECIES),
        targets={
            "energy": get_energy_target_info("energy", {"quantity": "energy", "unit": "eV"})
        },
    )
    torch.manual_seed(seed)
    model = PET(pet_hypers(featurizer, **sizes), info).to(torch.float64)
    # the composition and scaler tables from atomic number to index leave the entries
    # of other numbers uninitialised (torch.empty): unused, but ShardedCalculator checks
    # that every rank's model is the same, buffers included
    for name, table in model.named_buffers():
        if name.endswith("type_to_index"):
            unused = torch.ones_like(table, dtype=torch.bool)
            unused[list(SPECIES)] = False
            table[unused] = -1
    return model.export()
