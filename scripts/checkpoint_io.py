"""Checkpoints of distributed atoms against a rank-0 gather-and-write (issue 33).

Under ``mpirun -n P``: each rank builds its own share of an fcc Cu crystal of
``4 --size^3`` atoms (positions, momenta, numbers, masses, global ids; no rank
ever holds the whole), then, with ``--mode``:

- ``sharded``: ``ase_shard.checkpoint.write_checkpoint`` (each rank writes its own
  atoms) and ``read_checkpoint`` (each rank reads its share);
- ``gathered``: what a writer without per-rank files does: ``gather`` to rank 0,
  which writes the same arrays to one ``.npz``; then rank 0 reads it and
  ``distribute`` sends each rank its share.

Each phase is timed between barriers; each rank reports its resident memory after
building its share and its peak (``ru_maxrss``) at the end. One mode per process, so
that one mode's peak does not hide the other's::

    OMP_NUM_THREADS=1 mpirun --oversubscribe -n 4 python scripts/checkpoint_io.py \\
        --mode sharded --size 80 --dir /tmp/ck --json sharded.json
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import time
from pathlib import Path

import numpy as np
import psutil
from ase import units
from ase.md.verlet import VelocityVerlet
from mpi4py import MPI

from ase_shard.checkpoint import read_checkpoint, write_checkpoint
from ase_shard.comm import Comm
from ase_shard.distributed import GLOBAL_ID, DistributedAtoms, distribute, gather

A = 3.61  # Å, Cu
BASIS = np.array([[0, 0, 0], [0.5, 0.5, 0], [0.5, 0, 0.5], [0, 0.5, 0.5]])


def my_share(size: int, comm: Comm) -> DistributedAtoms:
    """This rank's contiguous block of the crystal's ``4 size^3`` atoms."""
    n = 4 * size**3
    first, last = n * comm.rank // comm.size, n * (comm.rank + 1) // comm.size
    ids = np.arange(first, last, dtype=np.int64)
    cell_index, site = np.divmod(ids, 4)
    i, rest = np.divmod(cell_index, size * size)
    j, k = np.divmod(rest, size)
    positions = (np.stack([i, j, k], axis=1) + BASIS[site]) * A
    atoms = DistributedAtoms(cell=np.eye(3) * A * size, pbc=True)
    rng = np.random.default_rng(comm.rank)
    atoms.arrays = {
        "numbers": np.full(len(ids), 29, dtype=np.int64),
        "positions": positions,
        GLOBAL_ID: ids,
    }
    atoms.set_masses(np.full(len(ids), 63.546))
    atoms.set_momenta(rng.normal(scale=0.1, size=(len(ids), 3)))
    atoms.comm, atoms.n_global = comm, n
    return atoms


def timed(comm: Comm, work) -> tuple[float, object]:
    """Seconds ``work()`` takes on the slowest rank (barriers around it), and its value."""
    comm.mpi.Barrier()
    start = time.perf_counter()
    value = work()
    comm.mpi.Barrier()
    return time.perf_counter() - start, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("sharded", "gathered"), required=True)
    parser.add_argument("--size", type=int, default=80, help="cells a side (80: 2,048,000)")
    parser.add_argument("--dir", default="checkpoint-io", help="scratch directory")
    parser.add_argument("--json", help="write the results here (rank 0)")
    args = parser.parse_args()
    comm = Comm(MPI.COMM_WORLD)
    directory = Path(args.dir) / args.mode
    if comm.is_root:
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
    atoms = my_share(args.size, comm)
    dyn = VelocityVerlet(atoms, 2 * units.fs)
    built = psutil.Process().memory_info().rss
    if args.mode == "sharded":
        write_s, _ = timed(comm, lambda: write_checkpoint(directory, atoms, dyn))
        read_s, saved = timed(comm, lambda: read_checkpoint(directory))
        back = saved.atoms
    else:

        def gather_and_write() -> None:
            whole = gather(atoms)
            if whole is not None:
                with open(directory / "whole.npz", "wb") as handle:
                    np.savez(handle, **whole.arrays)

        def read_and_distribute() -> DistributedAtoms:
            whole = None
            if comm.is_root:
                from ase import Atoms

                with np.load(directory / "whole.npz") as data:
                    whole = Atoms(cell=atoms.cell, pbc=True)
                    whole.arrays = {key: data[key] for key in data.files}
            return distribute(whole)

        write_s, _ = timed(comm, gather_and_write)
        read_s, back = timed(comm, read_and_distribute)
    assert back.n_global == atoms.n_global
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rows = comm.allgather({"built_rss_B": built, "peak_rss_B": peak, "atoms": len(atoms)})
    if comm.is_root:
        peaks = [row["peak_rss_B"] for row in rows]
        report = {
            "mode": args.mode,
            "ranks": comm.size,
            "atoms": atoms.n_global,
            "write_s": write_s,
            "read_s": read_s,
            "ranks_memory": rows,
            "root_peak_over_others_max": peaks[0] / max(peaks[1:]) if len(peaks) > 1 else 1.0,
        }
        print(
            f"{args.mode}: {atoms.n_global:,} atoms on {comm.size} ranks: write {write_s:.2f} s, "
            f"read {read_s:.2f} s; peak RSS per rank "
            + ", ".join(f"{p / 2**20:.0f}" for p in peaks)
            + f" MiB (rank 0 / the largest other {report['root_peak_over_others_max']:.2f})"
        )
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
