"""SPMD faults for ``tests/test_faults_launch.py``: ``mpirun -n P python spmd.py MODE``.

Every rank evaluates a small Cu crystal; rank 0 prints ``ready``, and a second
later the last rank prints ``fault`` and injects ``MODE``:

- ``kill``: SIGKILL itself; ``sysexit``: ``sys.exit(2)``; ``raise``: an
  uncaught ``RuntimeError``.
  Meanwhile the other ranks enter the next calculation and would wait forever.
- ``diverge``: after a cached call, the last rank alone moves an atom; every
  rank asks for the energy again. The others return their (valid) cache, the
  last rank waits for them at the start of the calculation, gives up after the
  calculator's ``timeout`` (2 s here, after a first call that waits up to a minute)
  and aborts the job.
- ``far-atom``: no fault; a cluster with one atom 1e9 Å away, checked against
  ASE's EMT (rank 0 prints the largest relative error).
- ``overlap``: two atoms 0.35 Å apart under ``min_distance=0.5``; every rank
  raises the same ValueError and lets it end the script (one report, exit
  status 1, no MPI_Abort).
- ``overlap-caught``: the same, but the last rank catches the error and waits
  in another collective: rank 0 gives up on it (after 2 s here instead of
  ``EXIT_TIMEOUT``'s 10 s: the last rank never comes) and aborts the job.
"""

import os
import signal
import sys
import time

import ase_shard  # noqa: F401  (first: sets up MPI before ASE picks its world)
import ase_shard.comm

# isort: split

import numpy as np
from ase.build import bulk
from ase.calculators.emt import EMT as AseEMT

from ase_shard import ShardedCalculator
from ase_shard.comm import Comm
from ase_shard.models import EMT


def inject(mode: str) -> None:
    """Die in the way ``mode`` names (shared by the worker-mode scripts)."""
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "sysexit":
        sys.exit(2)
    raise RuntimeError("injected failure")


def far_atom(comm: Comm) -> None:
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(2)
    atoms.pbc = False
    atoms.rattle(stdev=0.05, seed=1)
    atoms.positions[3] = [1e9, 0.0, 0.0]
    atoms.calc = ShardedCalculator(EMT())
    forces = atoms.get_forces()
    if comm.is_root:
        reference = atoms.copy()
        reference.calc = AseEMT()
        error = np.abs(forces - reference.get_forces()).max() / np.abs(forces).max()
        print(f"far-atom error={error:.1e}", flush=True)


def overlap(comm: Comm, caught: bool) -> None:
    if caught:
        ase_shard.comm.EXIT_TIMEOUT = 2.0  # how long rank 0 waits for the last rank
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(3)
    atoms.positions[4] = atoms.positions[9] + 0.2
    atoms.calc = ShardedCalculator(EMT(), min_distance=0.5)  # off by default
    if comm.is_root:
        print("fault overlap", flush=True)
    try:
        atoms.get_potential_energy()
    except ValueError:
        if not (caught and comm.rank == comm.size - 1):
            raise
        comm.allgather(None)  # the other ranks never come
        print(f"rank {comm.rank}: finished, which it must not", flush=True)


def main(mode: str) -> None:
    comm = Comm()
    if mode == "far-atom":
        far_atom(comm)
        return
    if mode.startswith("overlap"):
        overlap(comm, caught=mode == "overlap-caught")
        return
    last = comm.size - 1
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(3)
    # the first call waits for ranks that are still importing; then the waits are short
    atoms.calc = ShardedCalculator(EMT(), timeout=60.0)
    atoms.get_potential_energy()
    comm.allgather(None)
    atoms.calc.timeout = 2.0 if mode == "diverge" else 5.0
    if comm.is_root:
        print("ready", flush=True)
    time.sleep(1.0)
    if mode == "diverge":
        if comm.rank == last:
            print(f"fault {mode} on rank {last}", flush=True)
            atoms.positions[0, 0] += 0.01
        atoms.get_potential_energy()
        if comm.rank == last:
            print(f"rank {comm.rank}: calculated alone, which it must not", flush=True)
        return
    if comm.rank == last:
        print(f"fault {mode} on rank {last}", flush=True)
        inject(mode)
    atoms.rattle(0.01, seed=1)
    atoms.get_potential_energy()  # the other ranks wait here for the failed one
    print(f"rank {comm.rank}: finished, which it must not", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
