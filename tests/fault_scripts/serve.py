"""Worker-mode faults for ``tests/test_faults_launch.py``: ``mpirun -n P python serve.py MODE``.

Rank 0 drives a ``serve`` calculator, prints ``ready`` after one calculation,
then ``fault`` and:

- ``kill`` / ``raise``: dies as in ``spmd.py`` while the other ranks
  wait for its next command;
- ``worker-kill``: SIGKILLs the last (serving) rank and asks for another energy.
"""

import os
import signal
import sys

import ase_shard  # first: sets up MPI before ASE picks its world

# isort: split

from ase.build import bulk
from spmd import inject

from ase_shard.comm import Comm
from ase_shard.models import EMT


def main(mode: str) -> None:
    pids = Comm().allgather(os.getpid())
    calc = ase_shard.serve(EMT())
    if calc is None:
        print("served until released", flush=True)
        return
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(3)
    atoms.calc = calc
    atoms.get_potential_energy()
    print("ready", flush=True)
    print(f"fault {mode} on rank 0", flush=True)
    if mode == "worker-kill":
        os.kill(pids[-1], signal.SIGKILL)
        atoms.rattle(0.01, seed=1)
        atoms.get_potential_energy()
        print("rank 0: finished, which it must not", flush=True)
    else:
        inject(mode)


if __name__ == "__main__":
    main(sys.argv[1])
