"""Test set-up shared by serial runs and runs under mpirun."""

import sys
from pathlib import Path

import torch

import ase_shard  # noqa: F401  (initialises MPI before ASE touches ase.parallel.world)
from ase_shard.comm import Comm

sys.path.insert(0, str(Path(__file__).parent))  # tests import oracles/systems/toy_models

if Comm().size > 1:
    torch.set_num_threads(1)
