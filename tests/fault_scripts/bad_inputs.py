"""Bad inputs under mpirun, for ``tests/test_bad_inputs_launch.py``:
``mpirun -n P python bad_inputs.py MODE``.

Every rank runs the same script; rank 0 prints ``ready`` first (the launcher
snapshots the process tree then). ``ase.parallel`` is imported before
``ase_shard``, as scripts that import ASE first do; only ``world`` mode uses it
before. ``MODE``:

- ``constructor``: ``ShardedCalculator(EMT(), partition="random")``, uncaught.
- ``model``: ``ShardedCalculator(None)``, uncaught.
- ``comm``: ``ShardedCalculator(EMT(), comm="world")``, uncaught.
- ``distribute``: ``distribute()`` of an ``Atoms`` with a constraint, uncaught.
- ``diverge``: the last rank's copy of one atom differs by 0.4 Å on a reuse step
  that every rank calculates, uncaught.
- ``world``: ASE's ``world`` is used before ``import ase_shard``; every rank
  then prints with ``parprint`` (which should print on rank 0 only).
Every uncaught error is the same on every rank: one report, exit status 1.
"""

import sys

# imported but not used: ASE's world is still to be chosen, and import ase_shard in time
from ase.parallel import parprint

if sys.argv[1] == "world":
    parprint("parprint before import ase_shard")  # fixes ase.parallel.world: too early

import ase_shard  # noqa: E402, F401  (sets up MPI before ASE's world is used)

# isort: split

from ase.build import bulk  # noqa: E402
from ase.constraints import FixAtoms  # noqa: E402

from ase_shard import ShardedCalculator  # noqa: E402
from ase_shard.comm import Comm  # noqa: E402
from ase_shard.distributed import distribute  # noqa: E402
from ase_shard.models import EMT  # noqa: E402


def main(mode: str) -> None:
    comm = Comm()
    if comm.is_root:
        print("ready", flush=True)
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(3)
    atoms.rattle(0.05, seed=1)
    if mode == "constructor":
        ShardedCalculator(EMT(), partition="random")
    elif mode == "model":
        ShardedCalculator(None)
    elif mode == "comm":
        ShardedCalculator(EMT(), comm="world")
    elif mode == "distribute":
        atoms.set_constraint(FixAtoms([0]))
        distribute(atoms)
    elif mode == "diverge":
        atoms.calc = ShardedCalculator(EMT())
        atoms.get_potential_energy()
        atoms.positions += 1e-4  # every rank: a reuse step
        if comm.rank == comm.size - 1:
            atoms.positions[40] += 0.4
        parprint(f"energy {atoms.get_potential_energy()}", flush=True)
    elif mode == "world":
        parprint(f"parprint after import ase_shard: rank {comm.rank}", flush=True)


main(sys.argv[1])
