"""Torch potentials for ``ShardedCalculator``.

``LennardJones``, ``Morse`` and ``EMT`` re-implement ASE's calculators, ``D3`` the ``dftd3``
package's DFT-D3 dispersion, ``Coulomb`` Ewald and PME electrostatics with torch-pme's
kernels. ``SevenNet``, ``MACE``, ``NequIP``, ``CHGNet``, ``Metatomic``, ``UMA``, ``Orb`` and
``MatterSim`` wrap machine-learned potentials. Their packages are imported only when a
model is built (extras ``ase-shard[d3]``, ``[coulomb]``, ``[sevenn]``, ``[mace]``,
``[nequip]``, ``[chgnet]``, ``[metatomic]``, ``[fairchem]``, ``[orb]``, ``[mattersim]``).
``Sum`` (or ``+``) adds models, each at its own cutoff.
"""

from ase_shard.models.chgnet import CHGNet
from ase_shard.models.coulomb import Coulomb
from ase_shard.models.d3 import D3
from ase_shard.models.emt import EMT
from ase_shard.models.lj import LennardJones
from ase_shard.models.mace import MACE
from ase_shard.models.mattersim import MatterSim
from ase_shard.models.metatomic import Metatomic
from ase_shard.models.morse import Morse
from ase_shard.models.nequip import Allegro, NequIP
from ase_shard.models.orb import Orb
from ase_shard.models.sevenn import SevenNet
from ase_shard.models.sum import Sum
from ase_shard.models.uma import UMA

__all__ = [
    "Allegro",
    "CHGNet",
    "Coulomb",
    "D3",
    "EMT",
    "LennardJones",
    "MACE",
    "MatterSim",
    "Metatomic",
    "Morse",
    "NequIP",
    "Orb",
    "SevenNet",
    "Sum",
    "UMA",
]
