"""A test-only calculator that moves distributed atoms between ranks in every calculation.

It stands in for ShardedCalculator on DistributedAtoms in driver tests: it
evaluates an ordinary ASE calculator on the whole (gathered) system on rank 0,
broadcasts the results, then migrates every atom to a random owner (drawn from
a generator seeded alike on every rank) and returns the local rows in the new
local order. A driver that keeps per-atom state across a force call, or sums
over local atoms only, goes wrong under it at once.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from ase import Atoms
from ase.calculators.calculator import Calculator, all_changes

from ase_shard.distributed import GLOBAL_ID, DistributedAtoms, migrate

PER_ATOM = ("forces", "energies")


class MigratingCalculator(Calculator):
    """ASE's ``make()`` calculator on the whole system; atoms migrate in every calculation.

    Parameters
    ----------
    make : callable
        Returns the ASE calculator for the gathered ``Atoms``; called once, and
        the calculator is kept (as a one-rank reference run keeps its own, so
        that e.g. EMT's neighbour-list updates, and its sums, match).
    seed : int
        Seed of the owner draws; must be the same on every rank.
    """

    implemented_properties = ["energy", "free_energy", "energies", "forces", "stress"]

    def __init__(self, make: Callable[[], Calculator], seed: int = 0):
        super().__init__()
        self.whole_calc = make()  # used on rank 0 only
        self.rng = np.random.default_rng(seed)
        self.calculations = 0
        self.moved = 0  # atoms that changed rank, over all calculations (this rank's sends)

    def check_state(self, atoms: DistributedAtoms, tol: float = 1e-15) -> list[str]:
        """Changes since the last calculation; any rank's change counts on every rank."""
        changes = super().check_state(atoms, tol)
        if any(atoms.comm.allgather(bool(changes))):
            return changes or ["positions"]
        return changes

    def calculate(
        self,
        atoms: DistributedAtoms | None = None,
        properties: list[str] | None = None,
        system_changes: list[str] = all_changes,
    ) -> None:
        super().calculate(atoms, properties, system_changes)
        comm = atoms.comm
        parts = comm.allgather((atoms.arrays[GLOBAL_ID], atoms.numbers, atoms.positions))
        results = None
        if comm.is_root:
            ids = np.concatenate([part[0] for part in parts])
            order = np.argsort(ids)
            whole = Atoms(
                numbers=np.concatenate([part[1] for part in parts])[order],
                positions=np.concatenate([part[2] for part in parts])[order],
                cell=atoms.cell,
                pbc=atoms.pbc,
            )
            whole.calc = self.whole_calc
            names = [
                n for n in self.implemented_properties if n in whole.calc.implemented_properties
            ]
            if whole.cell.rank < 3 and "stress" in names:
                names.remove("stress")
            results = {name: whole.calc.get_property(name, whole) for name in names}
        results = comm.bcast(results)
        owners = self.rng.integers(comm.size, size=atoms.n_global)
        local_owners = owners[atoms.arrays[GLOBAL_ID]]
        self.moved += int(np.count_nonzero(local_owners != comm.rank))
        migrate(atoms, local_owners)
        # the atoms changed under ASE's cache: remember them as they are now
        self.atoms = atoms.copy()
        ids = atoms.arrays[GLOBAL_ID]
        self.results = {
            name: value[ids] if name in PER_ATOM else value for name, value in results.items()
        }
        self.results.setdefault("free_energy", self.results["energy"])
        self.calculations += 1


class Einstein(Calculator):
    """Every atom tied to its own site by a spring: E = k/2 |r - r0|² (eV).

    A cheap potential for thermostat statistics (equipartition: the kinetic
    and potential temperatures both equal the bath's).

    Parameters
    ----------
    sites : (n, 3) array
        Rest positions in Å, in the order of the atoms evaluated.
    k : float
        Spring constant in eV/Å².
    """

    implemented_properties = ["energy", "free_energy", "energies", "forces"]

    def __init__(self, sites: np.ndarray, k: float):
        super().__init__()
        self.sites, self.k = sites, k

    def calculate(self, atoms=None, properties=None, system_changes=all_changes) -> None:
        super().calculate(atoms, properties, system_changes)
        displacement = atoms.positions - self.sites
        energies = 0.5 * self.k * (displacement**2).sum(axis=1)
        self.results = {
            "energy": energies.sum(),
            "free_energy": energies.sum(),
            "energies": energies,
            "forces": -self.k * displacement,
        }
