"""Notebook-mode faults for ``tests/test_faults_launch.py``: ``python spawn.py MODE``.

The process spawns one worker, prints ``ready`` after one calculation, then
``fault`` and:

- ``kill`` / ``raise``: dies as in ``spmd.py`` without ``close()``;
- ``worker-kill``: SIGKILLs the worker and asks for another energy;
- ``bad-model``: (instead of the above) spawns a worker for a model class defined
  in ``__main__``, which it cannot unpickle, and prints the error it gets.
"""

import signal
import sys

import ase_shard  # first: sets up MPI before ASE picks its world

# isort: split

import psutil
from ase.build import bulk
from spmd import inject

from ase_shard.models import EMT


class LocalEMT(EMT):
    """Defined in ``__main__``: a spawned worker cannot import it."""


def main(mode: str) -> None:
    if mode == "bad-model":
        try:
            ase_shard.spawn(LocalEMT(), workers=1)
        except RuntimeError as error:
            print(f"RuntimeError: {error} (cause: {error.__cause__!r})", flush=True)
        return
    calc = ase_shard.spawn(EMT(), workers=1)
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(3)
    atoms.calc = calc
    atoms.get_potential_energy()
    print("ready", flush=True)
    print(f"fault {mode} in the driving process", flush=True)
    if mode == "worker-kill":
        tree = psutil.Process().children(recursive=True)
        workers = [p for p in tree if "worker_main" in p.cmdline()[-1]]
        workers[-1].send_signal(signal.SIGKILL)
        atoms.rattle(0.01, seed=1)
        atoms.get_potential_energy()
        print("driver: finished, which it must not", flush=True)
    else:
        inject(mode)


if __name__ == "__main__":
    main(sys.argv[1])
