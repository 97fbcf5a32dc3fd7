"""ASE drivers that run on :class:`~ase_shard.distributed.DistributedAtoms`.

Atoms migrate between ranks inside the force call, so a driver may keep no
per-atom array across it, and every sum over atoms must run over all ranks.
ASE's ``VelocityVerlet`` and ``Bussi`` already obey both rules; the classes
here are thin subclasses of ASE's own that do too:

- :class:`Langevin` carries its velocities and random kicks through the force
  call in ``atoms.arrays`` and draws each atom's noise by its global id and the
  step, the same on any number of ranks;
- :class:`NoseHooverChainNVT` and :class:`IsotropicMTKNPT` re-read positions,
  momenta and masses from the atoms after every force call and sum the kinetic
  terms of the thermostat and barostat over ranks;
- :class:`FIRE` keeps its velocities in ``atoms.arrays`` and takes its dot
  products over ranks;
- :class:`DistributedOptimizable`, what distributed atoms give every optimiser,
  takes the force norm over ranks.

On a plain ``Atoms`` each behaves as ASE's class, bit for bit (sums are then
local). ASE's ``MDLogger`` works on distributed atoms as it is (it asks the
atoms for global numbers and writes on rank 0); so does ``Bussi``, whose noise
rank 0 broadcasts over ``ase.parallel.world`` (the atoms' communicator must
then be ``MPI.COMM_WORLD``, the default).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from ase import Atoms
from ase.md import langevin, nose_hoover_chain
from ase.optimize import fire
from ase.optimize.optimize import OptimizableAtoms

from ase_shard.distributed import GLOBAL_ID, DistributedAtoms
from ase_shard.noise import AtomNoise

# per-atom arrays that carry a driver's state through force calls (they migrate)
LANGEVIN_VELOCITIES = "ase_shard_langevin_velocities"
LANGEVIN_KICKS = "ase_shard_langevin_kicks"
FIRE_VELOCITIES = "ase_shard_fire_velocities"


def over_ranks(atoms: Atoms, value: Any) -> Any:
    """``value``, a rank's share of a sum over atoms, summed over all ranks.

    Collective for :class:`DistributedAtoms` (the same bits on every rank);
    ``value`` itself for any other atoms, whose sums are whole already.
    """
    return atoms.sum_over_ranks(value) if isinstance(atoms, DistributedAtoms) else value


class Langevin(langevin.Langevin):
    """ASE's Langevin (NVT) dynamics, also on :class:`DistributedAtoms`.

    Same parameters as :class:`ase.md.langevin.Langevin`. On distributed atoms
    the noise of an atom at a step is keyed by its global id and the step
    (:class:`~ase_shard.noise.AtomNoise`, its seed one number drawn from
    ``rng`` on rank 0): whichever rank holds an atom draws the same numbers for
    it, so a run is the same on any number of ranks (to round-off) and resumes
    from a checkpoint exactly; it equals ASE's own ``Langevin`` on the gathered
    atoms given these numbers. ``fixcm`` removes the total random momentum and
    displacement over all ranks. Temperature and friction must be scalars there
    (per-atom values would not follow migrating atoms).
    """

    distributed_safe = True

    def __init__(self, atoms: Atoms, timestep: float, *args: Any, **kwargs: Any):
        super().__init__(atoms, timestep, *args, **kwargs)
        if isinstance(atoms, DistributedAtoms):
            if np.ndim(self.temp) or np.ndim(self.fr):
                raise ValueError(
                    "Langevin on DistributedAtoms takes a scalar temperature and friction: "
                    "per-atom values would not follow atoms migrating between ranks"
                )
            draw = getattr(self.rng, "integers", None) or self.rng.randint
            # drawn on rank 0 (its generator is the one a checkpoint keeps), for all
            self.noise = AtomNoise(atoms.comm.decide(lambda: int(draw(2**63, dtype=np.int64))))

    def step(self, forces: np.ndarray | None = None) -> np.ndarray:
        """One step (ASE's Eq. 23 of Vanden-Eijnden and Ciccotti); forces in eV/Å.

        ASE's ``step`` keeps velocities, masses and random kicks of the local
        atoms across its force call and broadcasts per-atom noise from rank 0;
        this override carries them through the force call in ``atoms.arrays``
        instead and sums ``fixcm`` corrections over ranks. Plain ``Atoms`` run
        ASE's own ``step``.
        """
        atoms = self.atoms
        if not isinstance(atoms, DistributedAtoms):
            return super().step(forces)
        if forces is None:
            forces = atoms.get_forces(md=True)
        # masses (and the per-atom noise amplitudes made from them) of the atoms held now
        self.masses = atoms.get_masses()[:, np.newaxis]
        self.updatevars()
        self.v = atoms.get_velocities()
        ids = atoms.arrays[GLOBAL_ID]
        xi = self.noise.normals(ids, self.nsteps, draw=0)
        eta = self.noise.normals(ids, self.nsteps, draw=1)
        self.rnd_pos = self.c5 * eta
        self.rnd_vel = self.c3 * xi - self.c4 * eta
        if self.fix_com:
            natoms = atoms.get_global_number_of_atoms()
            factor = np.sqrt(natoms / (natoms - 1.0))
            self.rnd_pos -= over_ranks(atoms, self.rnd_pos.sum(axis=0)) / natoms
            self.rnd_vel -= over_ranks(atoms, (self.rnd_vel * self.masses).sum(axis=0)) / (
                self.masses * natoms
            )
            self.rnd_pos *= factor
            self.rnd_vel *= factor
        self.v += self.c1 * forces / self.masses - self.c2 * self.v + self.rnd_vel
        x = atoms.get_positions()
        atoms.set_positions(x + self.dt * self.v + self.rnd_pos)
        self.v = (atoms.get_positions() - x - self.rnd_pos) / self.dt
        # atoms may migrate in this force call: their state travels with them
        atoms.set_array(LANGEVIN_VELOCITIES, self.v)
        atoms.set_array(LANGEVIN_KICKS, self.rnd_vel)
        forces = atoms.get_forces(md=True)
        self.v = atoms.arrays.pop(LANGEVIN_VELOCITIES)
        self.rnd_vel = atoms.arrays.pop(LANGEVIN_KICKS)
        self.masses = atoms.get_masses()[:, np.newaxis]
        self.v += self.c1 * forces / self.masses - self.c2 * self.v + self.rnd_vel
        atoms.set_momenta(self.v * self.masses)
        return forces


class _Thermostat(nose_hoover_chain.NoseHooverChainThermostat):
    """ASE's Nose-Hoover chain thermostat with its kinetic sum over all ranks."""

    def __init__(self, atoms: Atoms, **kwargs: Any):
        super().__init__(**kwargs)
        self._atoms = atoms

    def _integrate_p_eta_j(self, p: np.ndarray, j: int, delta2: float, delta4: float) -> None:
        # ASE's method, with np.sum(p**2 / m) over local atoms replaced by the
        # sum over ranks; the sum sits in the middle of the method, so all of it
        # is restated here.
        if j < self._tchain - 1:
            self._p_eta[j] *= np.exp(-delta4 * self._p_eta[j + 1] / self._Q[j + 1])
        if j == 0:
            twice_kinetic = over_ranks(self._atoms, np.sum(p**2 / self._masses))
            g_j = twice_kinetic - 3 * self._num_atoms_global * self._kT
        else:
            g_j = self._p_eta[j - 1] ** 2 / self._Q[j - 1] - self._kT
        self._p_eta[j] += delta2 * g_j
        if j < self._tchain - 1:
            self._p_eta[j] *= np.exp(-delta4 * self._p_eta[j + 1] / self._Q[j + 1])


class _FollowsAtoms:
    """Re-reads ASE's Nose-Hoover integrators' per-atom state from the atoms.

    ASE's ``NoseHooverChainNVT`` and ``MTKNPT`` classes keep positions
    ``_q``, momenta ``_p`` and masses across force calls and write ``_q`` and
    ``_p`` to the atoms just before each; reading them back after each force
    (or stress) call, and at the start of a step, follows atoms that
    migrated, and changes nothing otherwise.
    """

    def _sum_thermostat_over_ranks(
        self, temperature_K: float, tdamp: float, tchain: int, tloop: int
    ) -> None:
        """Replace ASE's thermostat by the same one with its kinetic sum over ranks."""
        self._thermostat = _Thermostat(
            self.atoms,
            num_atoms_global=self.atoms.get_global_number_of_atoms(),
            masses=self.masses,
            temperature_K=temperature_K,
            tdamp=tdamp,
            tchain=tchain,
            tloop=tloop,
        )

    def _reload(self) -> None:
        atoms = self.atoms
        self._q = atoms.get_positions()
        self._p = atoms.get_momenta()
        self.masses = atoms.get_masses()[:, np.newaxis]
        self._thermostat._masses = self.masses

    def step(self) -> None:
        self._reload()
        super().step()

    def _get_forces(self) -> np.ndarray:
        forces = super()._get_forces()
        self._reload()
        return forces


class NoseHooverChainNVT(_FollowsAtoms, nose_hoover_chain.NoseHooverChainNVT):
    """ASE's Nose-Hoover chain NVT dynamics, also on :class:`DistributedAtoms`.

    Parameters are those of :class:`ase.md.nose_hoover_chain.NoseHooverChainNVT`
    (``timestep`` and ``tdamp`` in ASE time units, ``temperature_K`` in K).
    """

    distributed_safe = True

    def __init__(
        self,
        atoms: Atoms,
        timestep: float,
        temperature_K: float,
        tdamp: float,
        tchain: int = 3,
        tloop: int = 1,
        **kwargs: Any,
    ):
        super().__init__(atoms, timestep, temperature_K, tdamp, tchain, tloop, **kwargs)
        self._sum_thermostat_over_ranks(temperature_K, tdamp, tchain, tloop)


class IsotropicMTKNPT(_FollowsAtoms, nose_hoover_chain.IsotropicMTKNPT):
    """ASE's isotropic MTK NPT dynamics, also on :class:`DistributedAtoms`.

    Parameters are those of :class:`ase.md.nose_hoover_chain.IsotropicMTKNPT`
    (``pressure_au`` in eV/Å³). The stress with its ideal-gas part comes from
    ``atoms.get_stress(include_ideal_gas=True)``, whole already on
    distributed atoms.
    """

    distributed_safe = True

    def __init__(
        self,
        atoms: Atoms,
        timestep: float,
        temperature_K: float,
        pressure_au: float,
        tdamp: float,
        pdamp: float,
        tchain: int = 3,
        pchain: int = 3,
        tloop: int = 1,
        ploop: int = 1,
        **kwargs: Any,
    ):
        super().__init__(
            atoms,
            timestep,
            temperature_K,
            pressure_au,
            tdamp,
            pdamp,
            tchain,
            pchain,
            tloop,
            ploop,
            **kwargs,
        )
        self._sum_thermostat_over_ranks(temperature_K, tdamp, tchain, tloop)

    def _get_pressure(self) -> float:
        pressure = super()._get_pressure()
        self._reload()
        return pressure

    def _integrate_p_cell(self, delta: float) -> None:
        # ASE's method with the kinetic sum over ranks (it is one line of three)
        pressure = self._get_pressure()
        volume = self._get_volume()
        twice_kinetic = over_ranks(self.atoms, np.sum(self._p**2 / self.masses))
        force = (
            3 * volume * (pressure - self._pressure_au) + twice_kinetic / self._num_atoms_global
        )
        self._p_eps += delta * force


class DistributedOptimizable(OptimizableAtoms):
    """ASE's optimisable view of distributed atoms, with the force norm over all ranks
    (what ``DistributedAtoms.__ase_optimizable__`` gives every optimiser)."""

    def gradient_norm(self, gradient: np.ndarray) -> float:
        forces = gradient.reshape(-1, 3)
        local = np.sqrt((forces * forces).sum(axis=1).max(initial=0.0))
        return max(self.atoms.comm.allgather(float(local)))

    def ndofs(self) -> int:
        return 3 * len(self.atoms)


class FIRE(fire.FIRE):
    """ASE's FIRE optimiser, also on :class:`DistributedAtoms`.

    Parameters are those of :class:`ase.optimize.FIRE`. On distributed atoms
    the velocities live in ``atoms.arrays["ase_shard_fire_velocities"]`` (so
    they migrate with their atoms), dot products and the step length are
    taken over all ranks, and convergence uses the largest force on any rank.
    ``downhill_check`` and ``restart`` are refused there (they keep per-atom
    positions, or write one rank's velocities).
    """

    distributed_safe = True

    def __init__(self, atoms: Atoms, *args: Any, **kwargs: Any):
        super().__init__(atoms, *args, **kwargs)
        if isinstance(atoms, DistributedAtoms) and (self.downhill_check or self.restart):
            raise ValueError(
                "FIRE on DistributedAtoms supports neither downhill_check nor restart files"
            )

    def _dot(self, a: np.ndarray, b: np.ndarray) -> float:
        return over_ranks(self.atoms, float(np.vdot(a, b)))

    def step(self, f: np.ndarray | None = None) -> None:
        """One FIRE step.

        ASE's ``step`` keeps the velocities of the local atoms across the
        force calls between steps and takes local dot products; this override
        carries the velocities in ``atoms.arrays`` and sums the dot products
        over ranks. Plain ``Atoms`` run ASE's own ``step``.
        """
        atoms = self.atoms
        if not isinstance(atoms, DistributedAtoms):
            return super().step(f)
        force = -self._get_gradient(f)
        if self.vel is None:
            self.vel = np.zeros(self.optimizable.ndofs())
        else:
            self.vel = atoms.get_array(FIRE_VELOCITIES).ravel()
            if self._dot(force, self.vel) > 0.0:
                speed = np.sqrt(self._dot(self.vel, self.vel))
                norm = np.sqrt(self._dot(force, force))
                self.vel = (1.0 - self.a) * self.vel + self.a * force / norm * speed
                if self.Nsteps > self.Nmin:
                    self.dt = min(self.dt * self.finc, self.dtmax)
                    self.a *= self.fa
                self.Nsteps += 1
            else:
                self.vel[:] = 0.0
                self.a = self.astart
                self.dt *= self.fdec
                self.Nsteps = 0
        self.vel += self.dt * force
        dr = self.dt * self.vel
        normdr = np.sqrt(self._dot(dr, dr))
        if normdr > self.maxstep:
            dr = self.maxstep * dr / normdr
        atoms.set_array(FIRE_VELOCITIES, self.vel.reshape(-1, 3))
        self.optimizable.set_x(self.optimizable.get_x() + dr)
