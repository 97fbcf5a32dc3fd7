"""NVE soak of a hot Lennard-Jones fluid: no lost atoms, energy conserved, ranks in step.

Shared by ``tests/test_sharded_faults.py`` (a short run under ``make test``) and
``scripts/md_acceptance.py --case nve-soak`` (the full 10,000-step run).
"""

from __future__ import annotations

import time

import numpy as np
from ase import Atoms, units
from ase.build import bulk
from ase.calculators.lj import LennardJones as AseLennardJones
from ase.md.velocitydistribution import Stationary, thermalize_momenta
from ase.md.verlet import VelocityVerlet
from oracles import ase_results, relative_errors
from sharded import COMM, identical_on_all_ranks, on_root

from ase_shard import ShardedCalculator
from ase_shard.distributed import distribute
from ase_shard.models import LennardJones

# argon with ASE's smooth cutoff (ro = 0.66 rc): forces are continuous, so NVE conserves
ARGON = {"sigma": 3.4, "epsilon": 0.0104, "rc": 8.5, "smooth": True}


def hot_argon_fluid(repeat: int, seed: int = 5) -> Atoms:
    """Rattled fcc argon at reduced density 0.6, 1,000 K momenta, tagged with atom ids.

    It melts within a few hundred femtoseconds and settles near 500 K (about
    4 epsilon/kB): a hot, dense fluid whose atoms cross rank domains often.
    """
    atoms = bulk("Ar", "fcc", a=6.4, cubic=True).repeat(repeat)
    atoms.rattle(stdev=0.05, seed=seed)  # non-zero forces from the first check on
    atoms.new_array("ids", np.arange(len(atoms)))
    thermalize_momenta(atoms, temperature_K=1000.0, rng=np.random.default_rng(seed))
    Stationary(atoms)
    return atoms


def _global_order(atoms: Atoms, values: dict) -> dict:
    """Distributed atoms: per-atom ``values`` of all ranks, in the original atom order."""
    parts = COMM.allgather((atoms.arrays["ids"], values))
    order = np.argsort(np.concatenate([ids for ids, _ in parts]))
    return {
        name: np.concatenate([part[name] for _, part in parts])[order] for name in values
    }


def run_nve_soak(
    repeat: int,
    steps: int,
    oracle_every: int,
    timestep_fs: float = 5.0,
    skin: float = 1.0,
    distributed: bool = False,
) -> dict:
    """VelocityVerlet on :func:`hot_argon_fluid` with checks at every step.

    Every step: all ranks hold bitwise the same positions, momenta, energy and
    forces, and every atom has a non-zero energy (an atom that no rank owned
    would get exactly zero). Every ``oracle_every`` steps and at the end: energy,
    per-atom energies, forces, stress and per-atom stresses against ASE's
    ``LennardJones`` (so no atom was lost or counted twice). At each rebuild,
    rank 0 counts atoms whose owner rank changed.

    With ``distributed``, each rank holds only its own atoms
    (:func:`ase_shard.distributed.distribute`): the ranks must agree bitwise on
    the energy, total energy and stress every step; per-atom values are
    gathered by id for the checks against ASE; owner changes are the atoms
    each rank received at each rebuild.

    Returns
    -------
    dict
        Figures, identical on every rank: ``atoms``, ``steps``, ``conserved``
        (count, numbers and ids unchanged), ``in_step`` (every step bitwise
        equal), ``all_owned`` (no zero per-atom energy), ``max_drift`` (max
        ``|Etot - Etot0| / N``, eV/atom), ``end_drift`` (signed, at the end),
        ``oracle_error`` (worst relative error vs ASE), ``oracle_checks``,
        ``rebuilds``, ``owner_changes``, ``temperature`` (K, at the end),
        ``mean_displacement`` (Å) and ``seconds``.
    """
    atoms = hot_argon_fluid(repeat)
    n, numbers, start = len(atoms), atoms.numbers.copy(), atoms.positions.copy()
    if distributed:
        atoms = distribute(atoms)
    calc = ShardedCalculator(LennardJones(**ARGON), skin=skin)
    atoms.calc = calc
    dyn = VelocityVerlet(atoms, timestep=timestep_fs * units.fs)
    oracle = AseLennardJones(**ARGON)
    track = {"totals": [], "in_step": True, "all_owned": True, "errors": []}
    owners = {"builds": 0, "last": None, "changes": 0}

    def observe() -> None:
        forces, energies = atoms.get_forces(), atoms.get_potential_energies()
        track["totals"].append(atoms.get_total_energy())
        if distributed:
            track["in_step"] &= identical_on_all_ranks(
                track["totals"][-1], atoms.get_potential_energy(), atoms.get_stress()
            )
            track["all_owned"] &= all(COMM.allgather(bool((energies != 0.0).all())))
        else:
            track["in_step"] &= identical_on_all_ranks(
                atoms.positions, atoms.get_momenta(), energies, forces
            )
            track["all_owned"] &= bool((energies != 0.0).all())
        if calc.rebuilds != owners["builds"] and (distributed or COMM.is_root):
            owners["builds"] = calc.rebuilds
            now = atoms.arrays["ids"].copy() if distributed else calc.decomposition.owners
            if owners["last"] is not None and distributed:
                arrived = np.setdiff1d(now, owners["last"]).size
                owners["changes"] += sum(COMM.allgather(arrived))
            elif owners["last"] is not None:
                owners["changes"] += int((now != owners["last"]).sum())
            owners["last"] = now
        if dyn.nsteps % oracle_every == 0 or dyn.nsteps == steps:
            per_atom = {"energies": energies, "forces": forces, "stresses": atoms.get_stresses()}
            if distributed:
                per_atom = _global_order(atoms, {**per_atom, "positions": atoms.positions})
            got = {
                "energy": np.asarray(atoms.get_potential_energy()),
                "stress": atoms.get_stress(),
                **per_atom,
            }
            system = Atoms(numbers, positions=got.pop("positions", atoms.positions))
            system.cell, system.pbc = atoms.cell, atoms.pbc
            reference = on_root(lambda: ase_results(oracle, system, stresses=True))
            track["errors"].append(max(relative_errors(got, reference).values()))

    dyn.attach(observe, interval=1)
    elapsed = time.perf_counter()
    dyn.run(steps)
    elapsed = time.perf_counter() - elapsed
    totals = np.array(track["totals"])
    final = {"ids": atoms.arrays["ids"], "numbers": atoms.numbers, "positions": atoms.positions}
    if distributed:
        final = _global_order(atoms, final)
    return {
        "atoms": n,
        "steps": dyn.nsteps,
        "conserved": bool(
            len(final["ids"]) == n
            and (final["numbers"] == numbers).all()
            and (final["ids"] == np.arange(n)).all()
        ),
        "in_step": track["in_step"],
        "all_owned": track["all_owned"],
        "max_drift": float(np.abs(totals - totals[0]).max() / n),
        "end_drift": float((totals[-1] - totals[0]) / n),
        "oracle_error": max(track["errors"]),
        "oracle_checks": len(track["errors"]),
        "rebuilds": calc.rebuilds,
        "owner_changes": COMM.bcast(owners["changes"]),
        "temperature": atoms.get_temperature(),
        "mean_displacement": float(np.linalg.norm(final["positions"] - start, axis=1).mean()),
        "seconds": COMM.bcast(elapsed),
    }
