"""What a benchmark reads of the process and the machine it runs on.

- memory: this process's resident memory now (:func:`rss_mb`) and its peak
  over one phase (:class:`PeakMemory`), in MiB;
- the machine's own speed-up limit on ``P`` ranks (:class:`Ceiling`): a fixed
  single-thread loop (:func:`spin`) on rank 0 alone against the same loop
  split over the ranks;
- the environment a report records: the load average, the CPUs a process may
  run on, the commit of the checkout that produced the timings.

:func:`on_root` is how rank-0-only work is timed: the other ranks wait
without spinning, so they take no CPU from it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import math
import os
import platform
import resource
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

import ase_shard
from ase_shard.comm import Comm

# rows x width of the ceiling's tanh/matmul loop: small enough for the L2 cache
_CEILING_SHAPE = (256, 64)

# ----------------------------------------------------------------------- memory

_LIBC = ctypes.CDLL(ctypes.util.find_library("c"))


def _release_memory() -> None:
    """Collect garbage and hand freed heap back to the OS (glibc), so a phase's peak
    starts from what is still in use."""
    gc.collect()
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


def rss_mb() -> float | None:
    """Resident memory of this process now (MiB), ``None`` without ``/proc``."""
    try:
        with open("/proc/self/statm") as statm:
            pages = int(statm.read().split()[1])
    except OSError:
        return None
    return pages * resource.getpagesize() / 2**20


def _reset_rss_peak() -> bool:
    """Reset this process's peak resident memory to its current one (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return True


class PeakMemory:
    """Peak memory of this process over one phase of the benchmark.

    ``ru_maxrss`` is a high-water mark over the process's life; on Linux it is
    reset at :meth:`start` (``/proc/self/clear_refs``), elsewhere a phase's
    peak includes every earlier phase (``reset`` is then false). On CUDA the
    peak of ``torch.cuda.max_memory_allocated`` is reported too, and its rise
    over what was allocated at :meth:`start` (torch's cache emptied first).
    """

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.device = device
        self.reset = False
        self.start_mb: float | None = None
        self.cuda_start_mb = 0.0

    def start(self) -> None:
        _release_memory()
        self.reset = _reset_rss_peak()
        self.start_mb = rss_mb()
        if self.cuda:
            torch.cuda.empty_cache()  # the previous subject's cached blocks are not this one's
            torch.cuda.reset_peak_memory_stats(self.device)
            self.cuda_start_mb = torch.cuda.memory_allocated(self.device) / 2**20

    def stop(self) -> dict:
        """``peak_rss_mb``, ``start_rss_mb``, their difference and (CUDA) ``cuda_peak_mb``
        and ``cuda_peak_delta_mb``."""
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak_mb = peak / (2**20 if platform.system() == "Darwin" else 2**10)
        out = {
            "peak_rss_mb": peak_mb,
            "start_rss_mb": self.start_mb,
            "peak_rss_delta_mb": None if self.start_mb is None else peak_mb - self.start_mb,
            "peak_reset": self.reset,
        }
        if self.cuda:
            out["cuda_peak_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
            out["cuda_peak_delta_mb"] = out["cuda_peak_mb"] - self.cuda_start_mb
        return out


# ----------------------------------------------------------------------- rank 0 alone


def on_root(comm: Comm, compute: Callable[[], Any]) -> Any:
    """``compute()`` on rank 0 while the other ranks wait; its value on rank 0
    (``None`` elsewhere). An error on rank 0 is raised on every rank."""
    value, error = None, None
    if comm.is_root:
        try:
            value = compute()
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
    # waiting ranks sleep: spinning would take CPU from rank 0's timings
    comm.rendezvous(None, "finish rank 0's measurement")
    error = comm.bcast(error)
    if error is not None:
        raise RuntimeError(f"rank 0 failed while the other ranks waited: {error}")
    return value


# ----------------------------------------------------------------------- the ceiling


def spin(iterations: int) -> None:
    """The ceiling's fixed single-thread work: ``iterations`` of tanh(x @ w)."""
    x = torch.full(_CEILING_SHAPE, 0.5, dtype=torch.float64)
    w = torch.full((_CEILING_SHAPE[1], _CEILING_SHAPE[1]), 1.0 / _CEILING_SHAPE[1])
    w = w.to(torch.float64)
    for _ in range(iterations):
        x = torch.tanh(x @ w + 0.1)


class Ceiling:
    """The machine's own speed-up limit on ``comm.size`` ranks, sampled between steps.

    A fixed amount of single-thread work (calibrated on rank 0 to last
    ``seconds``) runs on rank 0 alone while the others wait, then split evenly
    over all ranks, each timed from a common start to the slowest rank's end.
    :meth:`sample` takes one of each; the benchmark samples after every round
    of steps, so the ceiling sees the load the steps saw. ``speedup`` is the
    median over samples of serial time / split time.
    """

    def __init__(self, comm: Comm, seconds: float):
        self.comm = comm
        size = comm.size

        def calibrate() -> int:
            start = time.perf_counter()
            spin(64)
            per_iteration = (time.perf_counter() - start) / 64
            return size * max(1, math.ceil(seconds / per_iteration / size))

        self.iterations = comm.bcast(on_root(comm, calibrate))
        self.serial: list[float] = []
        self.split: list[float] = []

    def sample(self) -> None:
        """One serial run on rank 0 and one split run on all ranks."""
        comm = self.comm

        def serial_run() -> float:
            start = time.perf_counter()
            spin(self.iterations)
            return time.perf_counter() - start

        self.serial.append(comm.bcast(on_root(comm, serial_run)))
        comm.allgather(None)
        start = time.perf_counter()
        spin(self.iterations // comm.size)
        self.split.append(max(comm.allgather(time.perf_counter() - start)))

    def result(self) -> dict:
        """Iterations, the samples, their medians and ``speedup`` (median of ratios)."""
        serial, split = np.array(self.serial), np.array(self.split)
        return {
            "iterations": self.iterations,
            "serial_samples_s": self.serial,
            "split_samples_s": self.split,
            "serial_s": float(np.median(serial)),
            "split_s": float(np.median(split)),
            "speedup": float(np.median(serial / split)),
        }


# ----------------------------------------------------------------------- the environment


def source_state() -> dict | None:
    """The git commit of the ``ase_shard`` checkout and its modified files (``None``
    outside a git checkout): what code produced the timings."""
    package = Path(ase_shard.__file__).parent

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "-C", str(package), *args], capture_output=True, text=True, timeout=30
        )
        if done.returncode != 0:
            raise OSError(done.stderr)
        return done.stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        status = git("status", "--porcelain", "--untracked-files=no", "--", ".")
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "modified": [line[3:] for line in status.splitlines()]}


def load_average() -> float | None:
    """The 1-minute load average (``None`` where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def usable_cpus() -> int:
    """CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
