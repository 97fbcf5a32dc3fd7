"""The only module that talks MPI.

``Comm`` wraps an mpi4py communicator (or stands in for one rank when mpi4py
is absent or the process was not started by an MPI launcher). Bulk data moves
as numpy buffers (``Scatterv``/``Allgatherv``/``Alltoallv``); only small
control messages are pickled. Every call's CPU time is added to
``Comm.mpi_cpu``, so phase timings can leave MPI waits out.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

# Open MPI refuses to start ranks as root without these (containers, CI runners).
ALLOW_RUN_AS_ROOT = {
    name: "1"
    for name in (
        "OMPI_ALLOW_RUN_AS_ROOT",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM",
        "PRTE_ALLOW_RUN_AS_ROOT",
        "PRTE_ALLOW_RUN_AS_ROOT_CONFIRM",
    )
}

# Variables that MPI launchers (Open MPI, MPICH/Hydra, PMIx, Slurm's PMI) set.
_LAUNCHER_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")


def launched_by_mpi() -> bool:
    """True when this process was started by ``mpirun``/``srun``."""
    return any(name in os.environ for name in _LAUNCHER_VARIABLES)


def init_mpi() -> None:
    """Import mpi4py early when under a launcher.

    ``ase.parallel.world`` picks mpi4py only if it is already imported when
    ASE first touches ``world``; importing it here keeps ASE's view of the
    world and ours the same.
    """
    if launched_by_mpi():
        try:
            from mpi4py import MPI  # noqa: F401
        except ImportError:
            pass


# Commands rank 0 broadcasts to serving ranks (worker and notebook modes).
CALCULATE = "calculate"
CLOSE = "close"


class CollectiveError(RuntimeError):
    """An error raised on some rank that could not be re-created by type."""


class Comm:
    """Collectives used by ase_shard over an mpi4py communicator, or one rank.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm, Comm or None
        ``None`` uses ``MPI.COMM_WORLD`` when mpi4py is loaded, else a
        single-rank stand-in.
    """

    def __init__(self, comm: Any = None):
        if isinstance(comm, Comm):
            comm = comm.mpi
        if comm is None and "mpi4py.MPI" in sys.modules:
            comm = sys.modules["mpi4py.MPI"].COMM_WORLD
        self.mpi = comm
        self.rank = comm.Get_rank() if comm is not None else 0
        self.size = comm.Get_size() if comm is not None else 1
        # CPU seconds spent inside MPI calls (waits included), for PhaseTimer
        self.mpi_cpu = 0.0
        # bytes of bulk data (buffers, not pickles) received from other ranks
        self.received_bytes = 0

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    @contextmanager
    def _call(self) -> Iterator[None]:
        """Charge the enclosed MPI call's CPU time to :attr:`mpi_cpu`."""
        start = time.process_time()
        try:
            yield
        finally:
            self.mpi_cpu += time.process_time() - start

    def bcast(self, obj: Any) -> Any:
        """Broadcast a small picklable object from rank 0."""
        if self.mpi is None:
            return obj
        with self._call():
            return self.mpi.bcast(obj, root=0)

    def allgather(self, obj: Any) -> list:
        """Every rank's small picklable object, in rank order."""
        if self.mpi is None:
            return [obj]
        with self._call():
            return self.mpi.allgather(obj)

    def gather(self, obj: Any) -> list | None:
        """Every rank's small object on rank 0 (``None`` elsewhere)."""
        if self.mpi is None:
            return [obj]
        with self._call():
            return self.mpi.gather(obj, root=0)

    def alltoall_counts(self, counts: np.ndarray) -> np.ndarray:
        """``counts[r]`` goes to rank ``r``; returns what each rank sent here."""
        counts = np.ascontiguousarray(counts, dtype=np.int64)
        if self.mpi is None:
            return counts.copy()
        recv = np.empty_like(counts)
        with self._call():
            self.mpi.Alltoall(counts, recv)
        return recv

    def allgather_rows(self, rows: np.ndarray, counts: Sequence[int]) -> np.ndarray:
        """Every rank's ``rows`` concatenated in rank order, on every rank.

        ``counts`` holds each rank's row count (known to all); one
        ``Allgatherv`` of bytes, so any dtype and row shape.
        """
        rows = np.ascontiguousarray(rows)
        if self.mpi is None:
            return rows
        recv = np.empty((int(np.sum(counts)), *rows.shape[1:]), dtype=rows.dtype)
        with self._call():
            self.mpi.Allgatherv(_bytes(rows), [_bytes(recv), _byte_sizes(recv, counts)])
        self.received_bytes += recv.nbytes - rows.nbytes
        return recv

    def gather_rows(self, rows: np.ndarray, counts: Sequence[int]) -> np.ndarray | None:
        """Every rank's ``rows`` concatenated in rank order on rank 0 (``None`` elsewhere).

        ``counts`` (rows per rank) is needed on rank 0 only.
        """
        rows = np.ascontiguousarray(rows)
        if self.mpi is None:
            return rows
        recv = None
        if self.is_root:
            recv = np.empty((int(np.sum(counts)), *rows.shape[1:]), dtype=rows.dtype)
        with self._call():
            if self.is_root:
                self.mpi.Gatherv(_bytes(rows), [_bytes(recv), _byte_sizes(recv, counts)], root=0)
            else:
                self.mpi.Gatherv(_bytes(rows), None, root=0)
        if self.is_root:
            self.received_bytes += recv.nbytes - rows.nbytes
        return recv

    def scatter_rows(
        self, rows: np.ndarray | None, counts: Sequence[int], row_shape: tuple, dtype
    ) -> np.ndarray:
        """Rank 0 sends rank ``r`` its block of ``counts[r]`` consecutive ``rows``.

        ``rows`` (rank 0 only) holds rank 0's rows, then rank 1's, ...; every
        rank passes ``counts`` (rows per rank), ``row_shape`` and ``dtype``.
        """
        recv = np.empty((int(counts[self.rank]), *row_shape), dtype=dtype)
        if self.mpi is None:
            recv[...] = rows
            return recv
        send = None
        if self.is_root:
            rows = np.ascontiguousarray(rows, dtype=dtype)
            send = [_bytes(rows), _byte_sizes(rows, counts)]
        with self._call():
            self.mpi.Scatterv(send, _bytes(recv), root=0)
        if not self.is_root:
            self.received_bytes += recv.nbytes
        return recv

    def alltoallv_rows(
        self, send: np.ndarray, send_counts: np.ndarray, recv_counts: np.ndarray
    ) -> np.ndarray:
        """Personalised all-to-all of rows (any dtype, any row shape).

        ``send`` holds the rows for rank 0, then rank 1, ... (``send_counts``
        of each); returns the rows received, grouped by sending rank.
        """
        send = np.ascontiguousarray(send)
        recv = np.empty((int(np.sum(recv_counts)), *send.shape[1:]), dtype=send.dtype)
        if self.mpi is None:
            recv[...] = send
            return recv
        # counted in bytes, so one call moves any dtype and feature shape
        with self._call():
            self.mpi.Alltoallv(
                [_bytes(send), _byte_sizes(send, send_counts)],
                [_bytes(recv), _byte_sizes(recv, recv_counts)],
            )
        self.received_bytes += recv.nbytes - int(_byte_sizes(recv, recv_counts)[0][self.rank])
        return recv

    def rendezvous(self, timeout: float | None, waiting_for: str) -> None:
        """Barrier that ends the MPI job if the other ranks do not arrive in time.

        Waiting ranks sleep between polls instead of spinning in MPI, so they
        leave the cores to the ranks still working. A collective that some
        ranks never enter (their ``Atoms`` diverged, one of them is stuck)
        would otherwise wait forever. After ``timeout``
        seconds (``None``: wait forever) this rank prints what it was waiting
        for and calls ``MPI_Abort``, so the job ends non-zero.
        """
        if self.mpi is None or self.size == 1:
            return
        with self._call():
            self._wait_for_all(timeout, waiting_for)

    def _wait_for_all(self, timeout: float | None, waiting_for: str) -> None:
        request = self.mpi.Ibarrier()
        start, pause = time.monotonic(), 1e-6
        while not request.Test():
            waited = time.monotonic() - start
            if timeout is not None and waited > timeout:
                sys.stderr.write(
                    f"ase_shard: rank {self.rank} waited {waited:.0f} s for the other ranks "
                    f"to {waiting_for}; aborting the MPI job\n"
                )
                sys.stderr.flush()
                self.mpi.Abort(1)
            time.sleep(pause)
            pause = min(2.0 * pause, 1e-3)  # quick when they are close, cheap when not

    def split_self(self) -> Any:
        """A new communicator holding only this rank (collective); ``None`` serially.

        The caller frees it (``.Free()``).
        """
        return None if self.mpi is None else self.mpi.Split(self.rank, 0)

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on any rank."""
        if self.mpi is None:
            return bool(flag)
        with self._call():
            return bool(self.mpi.allreduce(bool(flag), op=_lor()))

    def node_placement(self) -> tuple[int, int]:
        """``(rank, size)`` among the processes of this communicator on this node."""
        if self.mpi is None:
            return 0, 1
        from mpi4py import MPI

        local = self.mpi.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        try:
            return local.Get_rank(), local.Get_size()
        finally:
            local.Free()


def describe(error: BaseException, rank: int) -> tuple:
    """Picklable summary of an exception raised on ``rank``."""
    kind = type(error)
    return (kind.__module__, kind.__qualname__, str(error), rank)


def _exception_class(module: str, qualname: str) -> type:
    """The exception class named by ``module.qualname``, if importable."""
    target: Any = sys.modules.get(module)
    for part in qualname.split("."):
        target = getattr(target, part, None)
    if isinstance(target, type) and issubclass(target, BaseException):
        return target
    return CollectiveError


def rebuild(summaries: Sequence[tuple]) -> BaseException:
    """One exception for every rank from the summaries of the failed ranks.

    The first failing rank's exception type is kept when it can be re-created
    from a message; the message names the rank (and how many others failed).
    """
    module, qualname, message, rank = summaries[0]
    others = f"; {len(summaries) - 1} more rank(s) failed" if len(summaries) > 1 else ""
    text = f"{message} [rank {rank}{others}]"
    kind = _exception_class(module, qualname)
    try:
        error = kind(text)
    except Exception:
        error = None
    if not isinstance(error, BaseException):
        error = CollectiveError(f"{qualname}: {text}")
    return error


def _bytes(array: np.ndarray) -> np.ndarray:
    """The bytes of a C-contiguous array, as a flat uint8 view."""
    return array.reshape(-1).view(np.uint8)


def _byte_sizes(array: np.ndarray, counts: Sequence[int]) -> tuple:
    """``(sizes, offsets)`` in bytes of consecutive blocks of ``counts`` rows of ``array``."""
    row_bytes = array.dtype.itemsize * int(np.prod(array.shape[1:], dtype=np.int64))
    sizes = np.asarray(counts, dtype=np.int64) * row_bytes
    return sizes, np.concatenate([[0], np.cumsum(sizes)[:-1]])


def _lor():
    from mpi4py import MPI

    return MPI.LOR


def abort_job_on_uncaught_exception() -> bool:
    """Make an uncaught exception on one rank end the whole MPI job.

    Without this, a rank that dies of an exception waits in ``MPI_Finalize``
    for ranks that wait for it in a collective, and the job hangs. The hook
    prints which rank failed and the traceback, then has mpi4py call
    ``MPI_Abort`` once the interpreter exits (what ``python -m mpi4py`` does):
    ``atexit`` handlers still run first, so a worker-mode rank 0 still releases
    its servers. Installed only under an MPI launcher with more than one rank
    in ``MPI.COMM_WORLD``; calling it again changes nothing.

    Returns
    -------
    bool
        Whether the hook is installed.
    """
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not launched_by_mpi():
        return False
    world = mpi.COMM_WORLD
    if world.Get_size() < 2:
        return False
    previous = sys.excepthook
    if getattr(previous, "aborts_mpi_job", False):
        return True
    from mpi4py.run import set_abort_status

    def hook(kind, value, traceback) -> None:
        status = value if isinstance(value, KeyboardInterrupt) else 1
        set_abort_status(status)
        sys.stderr.write(
            f"ase_shard: uncaught {kind.__name__} on MPI rank {world.Get_rank()} of "
            f"{world.Get_size()}; the job is aborted (MPI_Abort) at exit\n"
        )
        previous(kind, value, traceback)

    hook.aborts_mpi_job = True
    sys.excepthook = hook
    return True
