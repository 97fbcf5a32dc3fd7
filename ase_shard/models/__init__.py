"""Torch re-implementations of interatomic potentials for ``ShardedCalculator``."""

from ase_shard.models.emt import EMT
from ase_shard.models.lj import LennardJones
from ase_shard.models.morse import Morse

__all__ = ["EMT", "LennardJones", "Morse"]
