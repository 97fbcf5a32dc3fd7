"""The calculator's settings, checked once (pure, no MPI).

:class:`Settings` holds what ``ShardedCalculator``'s keyword arguments say,
checked and resolved against the model (the halo's default, its width); the
layouts, the block and ``calc.parameters`` read it from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Real
from typing import Any

import numpy as np

from ase_shard.balance import BALANCES
from ase_shard.graph import ShardModel, receptive_field, supports_layer_halo
from ase_shard.neighbors import NEIGHBOR_LISTS
from ase_shard.partition import PARTITIONS

HALOS = ("layer", "full")


@dataclass(frozen=True)
class Settings:
    """What a calculator does, fixed at construction.

    Attributes
    ----------
    skin : float
        Å beyond the halo's reach; the decomposition is reused until pair
        distances may have changed by more.
    partition : {"spatial", "contiguous"}
    balance : {"count", "work"}
        What the ``spatial`` partition's cuts balance (:mod:`ase_shard.balance`).
    grid : (int, int, int) or None
        The rank grid of ``spatial``; ``None``: chosen at each build.
    halo : {"layer", "full"}
    compile : bool or str
    min_distance : float
        Å; 0: only coincident atoms are refused.
    neighbor_list : str
    halo_reach : float
        Å the ghosts must cover beyond the skin: one cutoff with the layer
        halo, the receptive field with the full one.
    fold : bool
        Whether a foreign atom's images fold onto one ghost node: with the
        layer halo, and for one-layer models (a ghost is then only ever an
        edge's neighbour, the same atom whichever image the edge reaches).
    atomic_types : tuple of int or None
        The elements the model supports (``None``: any).
    """

    skin: float
    partition: str
    balance: str
    grid: tuple[int, int, int] | None
    halo: str
    compile: bool | str
    min_distance: float
    neighbor_list: str
    halo_reach: float
    fold: bool
    atomic_types: tuple[int, ...] | None

    @classmethod
    def checked(
        cls,
        model: ShardModel,
        ranks: int,
        *,
        skin: Any,
        partition: Any,
        balance: Any,
        grid: Any,
        halo: Any,
        compile: Any,
        min_distance: Any,
        neighbor_list: Any,
    ) -> Settings:
        """The settings of ``ShardedCalculator``'s arguments, or ``ValueError`` naming the
        first bad one; ``model`` has passed :func:`ase_shard.graph.check_model`."""
        if partition not in PARTITIONS:
            raise ValueError(f"partition must be one of {PARTITIONS}, not {partition!r}")
        if balance not in BALANCES:
            raise ValueError(f"balance must be one of {BALANCES}, not {balance!r}")
        skin = _length("skin", skin)
        min_distance = _length("min_distance", min_distance)
        if neighbor_list not in NEIGHBOR_LISTS:
            raise ValueError(
                f"neighbor_list must be one of {NEIGHBOR_LISTS}, not {neighbor_list!r}"
            )
        if halo is None:
            halo = "layer" if supports_layer_halo(model) else "full"
        if halo not in HALOS:
            raise ValueError(f"halo must be one of {HALOS}, not {halo!r}")
        if halo == "layer" and not supports_layer_halo(model) and model.num_layers > 1:
            raise ValueError(
                f"{type(model).__name__} does not exchange features between its layers "
                "(supports_layer_halo): use halo='full'"
            )
        return cls(
            skin=skin,
            partition=partition,
            balance=balance,
            grid=None if grid is None else rank_grid(grid, ranks),
            halo=halo,
            compile=compile,
            min_distance=min_distance,
            neighbor_list=neighbor_list,
            halo_reach=float(model.cutoff) if halo == "layer" else receptive_field(model),
            fold=halo == "layer" or int(model.num_layers) == 1,
            atomic_types=_types(model),
        )

    @property
    def halo_width(self) -> float:
        """Å the ghosts cover around a rank's atoms: the reach plus the skin."""
        return self.halo_reach + self.skin

    def parameters(self, model: ShardModel) -> dict[str, Any]:
        """``calc.parameters``: JSON-encodable, so that ``Trajectory`` can write them."""
        return {
            "skin": self.skin,
            "partition": self.partition,
            "balance": self.balance,
            "grid": list(self.grid) if self.grid else None,
            "halo": self.halo,
            "compile": self.compile,
            "min_distance": self.min_distance,
            "neighbor_list": self.neighbor_list,
            "model": type(model).__name__,
        }


def checked_timeout(timeout: Any) -> float | None:
    """``timeout`` (s) if it is a positive number or ``None``, else ``ValueError``."""
    if timeout is not None and not (isinstance(timeout, Real) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds or None, not {timeout!r}")
    return timeout


def _types(model: ShardModel) -> tuple[int, ...] | None:
    types = getattr(model, "atomic_types", None)
    return None if types is None else tuple(int(z) for z in types)


def _length(name: str, value: Any) -> float:
    """``value`` as a finite distance >= 0 (Å), or ``ValueError`` naming ``name``."""
    try:
        length = float(value)
    except (TypeError, ValueError):
        length = np.nan
    if not (np.isfinite(length) and length >= 0):
        raise ValueError(f"{name} must be a finite distance >= 0 Å, not {value!r}")
    return length


def rank_grid(grid: Any, size: int) -> tuple[int, int, int]:
    """``grid`` as three positive integers multiplying to ``size``, or ``ValueError``."""
    try:
        cells = tuple(int(p) for p in grid)
        integral = all(p == cell for p, cell in zip(grid, cells, strict=True))
    except (TypeError, ValueError):
        cells, integral = (), False
    if not integral or len(cells) != 3 or min(cells) < 1 or np.prod(cells) != size:
        raise ValueError(
            f"grid must be three positive integers that multiply to {size} ranks, not {grid!r}"
        )
    return cells
