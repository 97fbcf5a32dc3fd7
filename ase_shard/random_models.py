"""Random-weight models for benchmarks: the real ML architectures, untrained.

``ase-shard bench --model sevennet|mace|nequip`` times the architectures of
SevenNet, MACE and NequIP at a chosen size (``cutoff`` in Å, ``channels``,
``num_layers``) without a trained checkpoint: the weights are drawn from
``seed``, so every rank builds the same model. What a step costs does not
depend on the weights; what it computes does not matter beyond agreeing with
the bare model. Each builder returns the ase_shard adapter in float64 and
needs its own package (``sevenn``, ``mace-torch``, ``nequip``), imported on
call.

:func:`no_edge_model` is the opposite end: a model that sees no pairs, so that
``ShardedCalculator`` with it costs what the framework itself costs
(``ase-shard bench --framework``).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
from ase.data import chemical_symbols

from ase_shard.models import LennardJones


def _symbols(numbers: Sequence[int]) -> list[str]:
    """The distinct elements of ``numbers``, as sorted chemical symbols."""
    return sorted(chemical_symbols[z] for z in np.unique(numbers))


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """torch's default dtype set to ``dtype`` inside, restored afterwards."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def random_sevennet_network(
    symbols: Sequence[str],
    *,
    cutoff: float,
    channels: int,
    num_layers: int,
    seed: int = 0,
    config: dict | None = None,
) -> torch.nn.Module:
    """A random-weight SevenNet ``AtomGraphSequential`` (``lmax`` 2), as built (float32).

    ``symbols`` in sorted order; ``config`` overrides entries of sevenn's default
    model configuration (keys from ``sevenn._keys``). Needs the ``sevenn``
    package; the same ``seed`` gives the same weights on every rank.
    """
    import sevenn._const as const
    import sevenn._keys as KEY
    import sevenn.util
    from sevenn.model_build import build_E3_equivariant_model

    settings = copy.deepcopy(const.DEFAULT_E3_EQUIVARIANT_MODEL_CONFIG)
    settings.update(sevenn.util.chemical_species_preprocess(list(symbols)))
    settings.update(
        {
            KEY.CUTOFF: cutoff,
            KEY.NODE_FEATURE_MULTIPLICITY: channels,
            KEY.LMAX: 2,
            KEY.IS_PARITY: False,
            KEY.NUM_CONVOLUTION: num_layers,
            KEY.USE_SPECIES_WISE_SHIFT_SCALE: True,
            **(config or {}),
        }
    )
    torch.manual_seed(seed)
    return build_E3_equivariant_model(settings)


def random_sevennet(
    numbers: Sequence[int],
    *,
    cutoff: float = 5.0,
    channels: int = 32,
    num_layers: int = 3,
    seed: int = 0,
) -> torch.nn.Module:
    """A random-weight SevenNet adapter of the real architecture (``lmax`` 2), float64."""
    import sevenn._keys as KEY

    from ase_shard.models.sevenn import SevenNet

    symbols = _symbols(numbers)
    network = random_sevennet_network(
        symbols,
        cutoff=cutoff,
        channels=channels,
        num_layers=num_layers,
        seed=seed,
        config={
            KEY.CONV_DENOMINATOR: 30.0,
            KEY.SHIFT: [-3.0] * len(symbols),  # eV per atom
            KEY.SCALE: [1.0] * len(symbols),
        },
    )
    return SevenNet(network.double())


def random_mace(
    numbers: Sequence[int],
    *,
    cutoff: float = 5.0,
    channels: int = 32,
    num_layers: int = 2,
    seed: int = 0,
) -> torch.nn.Module:
    """A random-weight ScaleShiftMACE (hidden ``Cx0e + Cx1o``, ``max_ell`` 2), float64.

    Needs the ``mace-torch`` package (its own environment, ``.venv-mace``).
    """
    # mace first: importing it lets torch.load read e3nn's pickled constants
    from mace import modules  # noqa: I001
    from e3nn import o3

    from ase_shard.models.mace import MACE

    elements = [int(z) for z in np.unique(numbers)]
    torch.manual_seed(seed)
    with _default_dtype(torch.float64):  # MACE's buffers take the default dtype
        network = modules.ScaleShiftMACE(
            r_max=cutoff,
            num_bessel=8,
            num_polynomial_cutoff=5,
            max_ell=2,
            interaction_cls=modules.interaction_classes["RealAgnosticResidualInteractionBlock"],
            interaction_cls_first=modules.interaction_classes[
                "RealAgnosticResidualInteractionBlock"
            ],
            num_interactions=num_layers,
            num_elements=len(elements),
            hidden_irreps=o3.Irreps(f"{channels}x0e+{channels}x1o"),
            MLP_irreps=o3.Irreps("16x0e"),
            atomic_energies=np.full(len(elements), -3.0),
            avg_num_neighbors=40.0,
            atomic_numbers=elements,
            correlation=3,
            gate=torch.nn.functional.silu,
            radial_MLP=[64, 64, 64],
            atomic_inter_scale=1.0,
            atomic_inter_shift=0.0,
        )
    return MACE(network)


def random_nequip(
    numbers: Sequence[int],
    *,
    cutoff: float = 5.0,
    channels: int = 32,
    num_layers: int = 3,
    seed: int = 0,
) -> torch.nn.Module:
    """A random-weight NequIP adapter of the real architecture (``l_max`` 1), float64.

    Needs the ``nequip`` package. nequip builds under its global state (float64
    default dtype); the previous default dtype is restored afterwards (the
    model's numerics do not depend on it).
    """
    from nequip.model import NequIPGNNModel
    from nequip.utils.global_state import set_global_state

    from ase_shard.models.nequip import NequIP

    symbols = _symbols(numbers)
    with _default_dtype(torch.float64):
        set_global_state()  # nequip builds under its global state (float64 default)
        network = NequIPGNNModel(
            seed=seed,
            model_dtype="float64",
            type_names=symbols,
            r_max=cutoff,
            avg_num_neighbors=20.0,
            per_type_energy_shifts=dict.fromkeys(symbols, -3.0),  # eV per atom
            per_type_energy_scales=dict.fromkeys(symbols, 1.0),
            num_layers=num_layers,
            l_max=1,
            num_features=channels,
            radial_mlp_width=32,
        )
    return NequIP(network.eval())


# the random-weight builders by ``--model`` name (:data:`ase_shard.presets.BENCH_MODELS`);
# each takes ``(numbers, *, cutoff, channels, num_layers, seed)``; ``no_edge_model``
# is :data:`ase_shard.presets.NO_EDGE`
ML_MODELS: dict[str, Callable[..., torch.nn.Module]] = {
    "sevennet": random_sevennet,
    "mace": random_mace,
    "nequip": random_nequip,
}


def no_edge_model() -> torch.nn.Module:
    """A model without pairs: Lennard-Jones cut off at 0.3 Å (``sigma`` 0.1 Å).

    No two atoms of a real structure are that close, so the model sees no
    edges and ``ShardedCalculator`` with it costs what the framework itself
    costs: validation, decomposition, scatter, an empty neighbour search and
    model, gather. Its halo is only ``0.3 Å + skin`` wide, thinner than a real
    model's, so ghost rows cost less than they would there.
    """
    return LennardJones(sigma=0.1, rc=0.3)
