"""How long ranks wait for each other when they do identical work between votes.

    mpirun -n 2 .venv/bin/python scripts/sync_skew.py --work-ms 40 15 --steps 60

Every rank runs the benchmark ceiling's fixed single-thread loop
(:func:`ase_shard.bench.machine.spin`, calibrated to ``--work-ms`` per segment) and then
joins one ``allreduce``, for each segment of a step, as EMT's kernel does between
its passes. Identical work on every rank: whatever a rank waits in the votes is
the machine's skew between its cores, not the work's. Prints, per rank, the
median time of each segment (with the 10th-90th percentiles) and the mean wait
per step in each vote, in ms.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from mpi4py import MPI

from ase_shard.bench.machine import spin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work-ms", type=float, nargs="+", default=[40.0, 15.0])
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    start = time.perf_counter()
    spin(200)
    # every rank uses rank 0's calibration, so the work is the same everywhere
    per_iteration = comm.bcast((time.perf_counter() - start) / 200)
    iterations = [max(1, round(ms * 1e-3 / per_iteration)) for ms in args.work_ms]
    work, waits = [], []
    for _ in range(args.steps):
        comm.Barrier()
        step_work, step_waits = [], []
        for count in iterations:
            start = time.perf_counter()
            spin(count)
            done = time.perf_counter()
            comm.allreduce(0)
            step_work.append(done - start)
            step_waits.append(time.perf_counter() - done)
        work.append(step_work)
        waits.append(step_waits)
    gathered = comm.gather((np.array(work) * 1e3, np.array(waits) * 1e3))
    if comm.rank != 0:
        return
    for rank, (work_ms, wait_ms) in enumerate(gathered):
        segments = "  ".join(
            f"work {np.median(w):.1f} [{np.percentile(w, 10):.1f}-{np.percentile(w, 90):.1f}]"
            f" wait {v.mean():.2f}"
            for w, v in zip(work_ms.T, wait_ms.T, strict=True)
        )
        print(f"rank {rank}: {segments}  (ms; waits are means per step)")


if __name__ == "__main__":
    main()
