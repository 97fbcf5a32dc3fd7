"""The only module that talks MPI.

``Comm`` wraps an mpi4py communicator (or stands in for one rank when mpi4py
is absent or the process was not started by an MPI launcher). Bulk data moves
as numpy buffers (``Scatterv``/``Allgatherv``/``Alltoallv``), and the halo's
``Alltoallv`` as CUDA tensors where MPI is CUDA-aware (:func:`cuda_aware_mpi`);
only small control messages are pickled. Every call's CPU time is added to
``Comm.mpi_cpu``, so phase timings can leave MPI waits out.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from ase_shard.memory import OutOfMemory, is_out_of_memory, out_of_memory

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


# Set by a rank to its own process id when it initialises MPI. A process that a rank
# starts (``subprocess``, ASE's socket clients) inherits the launcher's variables too; it
# finds a process id not its own here and stays out of the job: an MPI_Init there would
# join or break the rank's job.
_RANK_MARKER = "ASE_SHARD_MPI_RANK"


def launched_by_mpi() -> bool:
    """True when this process was started by ``mpirun``/``srun``, not by one of its ranks."""
    marker = os.environ.get(_RANK_MARKER)
    if marker is not None and marker != str(os.getpid()):
        return False
    return any(name in os.environ for name in _LAUNCHER_VARIABLES)


def init_mpi() -> None:
    """Import mpi4py early when under a launcher.

    ``ase.parallel.world`` picks mpi4py only if it is already imported when
    ASE first touches ``world``; importing it here keeps ASE's view of the
    world and ours the same.
    """
    if launched_by_mpi():
        os.environ[_RANK_MARKER] = str(os.getpid())
        try:
            from mpi4py import MPI  # noqa: F401
        except ImportError:
            pass


def check_ase_world() -> bool:
    """Warn once (on rank 0) if ASE fixed ``ase.parallel.world`` before MPI was set up.

    Under a launcher, ASE's ``world`` used before ``import ase_shard`` (or
    mpi4py) has already settled on a one-rank ``DummyMPI`` in every process:
    every rank then believes it is rank 0, and ``parprint``, ``Trajectory``
    and ASE's loggers print and write on every rank. Nothing can repair what
    was written meanwhile, so this says what to change. Returns whether it
    warned on any rank.
    """
    parallel, mpi = sys.modules.get("ase.parallel"), sys.modules.get("mpi4py.MPI")
    if parallel is None or mpi is None or not launched_by_mpi():
        return False
    world = getattr(parallel, "world", None)
    # ASE's lazy wrapper holds None until first used; a replaced world is itself
    chosen = world.comm if isinstance(world, parallel.MPI) else world
    size = mpi.COMM_WORLD.Get_size()
    if chosen is None or getattr(chosen, "size", size) == size:
        return False
    if mpi.COMM_WORLD.Get_rank() == 0:
        import warnings

        warnings.warn(
            f"ase.parallel.world was used before 'import ase_shard' and is "
            f"{type(chosen).__name__} with {getattr(chosen, 'size', '?')} rank(s), while "
            f"the job has {size}: every rank believes it is rank 0, so parprint, Trajectory "
            "and ASE's loggers print and write on every rank. Put 'import ase_shard' first "
            "in the script, before anything touches ase.parallel.world",
            RuntimeWarning,
            stacklevel=3,
        )
    return True


# "1" or "0": whether MPI takes CUDA device buffers, instead of asking the MPI library
CUDA_AWARE_MPI_VARIABLE = "ASE_SHARD_CUDA_AWARE_MPI"


def cuda_aware_mpi() -> bool:
    """Whether MPI may be handed CUDA device buffers (CUDA-aware MPI).

    ``ASE_SHARD_CUDA_AWARE_MPI=1`` or ``0`` decides when set. Otherwise the MPI
    library is asked, once MPI is initialised, through
    ``MPIX_Query_cuda_support()`` (Open MPI, MPICH and their derivatives;
    mpi4py does not wrap it). ``False`` without mpi4py, before ``MPI_Init``,
    and where the library has no such query.
    """
    setting = os.environ.get(CUDA_AWARE_MPI_VARIABLE, "").strip()
    if setting:
        if setting not in ("0", "1"):
            raise ValueError(f"{CUDA_AWARE_MPI_VARIABLE} must be 0 or 1, not {setting!r}")
        return setting == "1"
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized():
        return False
    return _query_cuda_support(mpi.__file__)


@functools.cache
def _query_cuda_support(extension: str) -> bool:
    """``MPIX_Query_cuda_support()`` of the MPI library that mpi4py's ``extension`` links."""
    import ctypes

    try:
        # a handle of the loaded extension also finds the symbols of the libmpi it
        # links, whichever path that was loaded from (no second copy is loaded)
        library = ctypes.CDLL(extension, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except (OSError, AttributeError):  # not loaded as a shared object; no RTLD_NOLOAD
        return False
    query = getattr(library, "MPIX_Query_cuda_support", None)
    if query is None:
        return False
    query.restype, query.argtypes = ctypes.c_int, []
    return bool(query())


T = TypeVar("T")

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
        if comm is not None and not callable(getattr(comm, "Get_rank", None)):
            # no communicator to agree on the error: under SPMD every rank passed the
            # same argument (if not, the exit hook stops waiting and aborts the job)
            raise raised_on_every_rank(
                TypeError(f"comm must be an mpi4py communicator or None, not {comm!r}")
            )
        self.mpi = comm
        self.rank = comm.Get_rank() if comm is not None else 0
        self.size = comm.Get_size() if comm is not None else 1
        # CPU seconds spent inside MPI calls (waits included), for PhaseTimer
        self.mpi_cpu = 0.0
        # bytes of bulk data (buffers, not pickles) received from other ranks
        self.received_bytes = 0
        # status votes cast so far in the current evaluation (see status)
        self._votes = 0

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def raised_together(self, error: BaseException) -> None:
        """Mark ``error``, raised by every rank of this communicator, when they are the job."""
        world = sys.modules["mpi4py.MPI"].COMM_WORLD if self.mpi is not None else None
        if world is not None and self.size == world.Get_size() > 1:
            raised_on_every_rank(error)

    def agree(self, own: Callable[[], T], failed: Failure | None = None) -> T:
        """``own()`` on every rank: this rank's value, or the same error on every rank.

        The collective vote: one allgather of each rank's failure (or none).
        ``own`` runs unless this rank has failed already (``failed``); any
        ``Exception`` it raises is this rank's failure. If some rank failed,
        every rank raises the first failing rank's error (:func:`reraise`),
        marked as raised together (:meth:`raised_together`), and no rank is
        left waiting in a later collective.
        """
        value, failed = self._run(own, failed)
        self._raise_failures(self.allgather(failed))
        return value

    def share(self, own: Callable[[], T], failed: Failure | None = None) -> list[T]:
        """:meth:`agree`, then every rank's value of ``own()`` in rank order (the same
        allgather, so values must be small and picklable)."""
        value, failed = self._run(own, failed)
        views = self.allgather((failed, value))
        self._raise_failures([view[0] for view in views])
        return [view[1] for view in views]

    def decide(self, own: Callable[[], T], root: int = 0) -> T:
        """``own()`` on ``root`` alone; its value on every rank, or its error on every rank.

        One broadcast (of a small picklable value).
        """
        outcome = self._run(own, None) if self.rank == root else None
        value, failed = self.bcast(outcome, root=root)
        self._raise_failures([failed])
        return value

    def _run(
        self, own: Callable[[], T], failed: Failure | None
    ) -> tuple[T | None, Failure | None]:
        """``(own(), None)``, or ``(None, failure)`` when this rank failed (or had)."""
        if failed is not None:
            return None, failed
        try:
            return own(), None
        except Exception as exc:  # e.g. out of memory on one rank: no rank may wait alone
            if is_out_of_memory(exc) and not isinstance(exc, OutOfMemory):
                exc = out_of_memory(exc, "in a collective step")
            return None, Failure.of(exc, self.rank)

    def _raise_failures(self, failures: Sequence[Failure | None]) -> None:
        failed = [failure for failure in failures if failure is not None]
        if failed:
            error = reraise(failed)
            self.raised_together(error)
            raise error

    @contextmanager
    def _call(self) -> Iterator[None]:
        """Charge the enclosed MPI call's CPU time to :attr:`mpi_cpu`."""
        start = time.process_time()
        try:
            yield
        finally:
            self.mpi_cpu += time.process_time() - start

    def bcast(self, obj: Any, root: int = 0) -> Any:
        """Broadcast a small picklable object from ``root``."""
        if self.mpi is None:
            return obj
        with self._call():
            return self.mpi.bcast(obj, root=root)

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

    def allreduce_counts(self, counts: np.ndarray) -> np.ndarray:
        """Element-wise sum of every rank's ``counts`` (int64; exact, so the same everywhere)."""
        counts = np.ascontiguousarray(counts, dtype=np.int64)
        if self.mpi is None:
            return counts.copy()
        total = np.empty_like(counts)
        with self._call():
            self.mpi.Allreduce(counts, total)
        return total

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

    def gather_rows(
        self, rows: np.ndarray, counts: Sequence[int], root: int = 0
    ) -> np.ndarray | None:
        """Every rank's ``rows`` concatenated in rank order on ``root`` (``None`` elsewhere).

        ``counts`` (rows per rank) is needed on ``root`` only.
        """
        rows = np.ascontiguousarray(rows)
        if self.mpi is None:
            return rows
        recv = None
        if self.rank == root:
            recv = np.empty((int(np.sum(counts)), *rows.shape[1:]), dtype=rows.dtype)
        with self._call():
            if self.rank == root:
                self.mpi.Gatherv(
                    _bytes(rows), [_bytes(recv), _byte_sizes(recv, counts)], root=root
                )
            else:
                self.mpi.Gatherv(_bytes(rows), None, root=root)
        if self.rank == root:
            self.received_bytes += recv.nbytes - rows.nbytes
        return recv

    def scatter_rows(
        self,
        rows: np.ndarray | None,
        counts: Sequence[int],
        row_shape: tuple,
        dtype,
        root: int = 0,
    ) -> np.ndarray:
        """``root`` sends rank ``r`` its block of ``counts[r]`` consecutive ``rows``.

        ``rows`` (``root`` only) holds rank 0's rows, then rank 1's, ...; every
        rank passes ``counts`` (rows per rank), ``row_shape`` and ``dtype``.
        """
        recv = np.empty((int(counts[self.rank]), *row_shape), dtype=dtype)
        if self.mpi is None:
            recv[...] = rows
            return recv
        send = None
        if self.rank == root:
            rows = np.ascontiguousarray(rows, dtype=dtype)
            send = [_bytes(rows), _byte_sizes(rows, counts)]
        with self._call():
            self.mpi.Scatterv(send, _bytes(recv), root=root)
        if self.rank != root:
            self.received_bytes += recv.nbytes
        return recv

    def alltoallv_rows(
        self,
        send: Any,
        send_counts: np.ndarray,
        recv_counts: np.ndarray,
        out: Any = None,
    ) -> Any:
        """Personalised all-to-all of rows (any dtype, any row shape).

        Parameters
        ----------
        send : (n, ...) array
            The rows for rank 0, then rank 1, ... (``send_counts`` of each). A
            numpy array; with ``out``, also a C-contiguous torch tensor, which
            mpi4py reads through DLPack (a CUDA tensor only where
            :func:`cuda_aware_mpi`, after its stream is synchronised).
        send_counts, recv_counts : (P,) int arrays
            Rows sent to / received from each rank.
        out : array, optional
            Where the received rows go, so that repeated exchanges allocate
            nothing: C-contiguous, of ``send``'s kind and dtype, with
            ``sum(recv_counts)`` rows shaped like ``send``'s. Default: a new
            numpy array.

        Returns
        -------
        The rows received, grouped by sending rank (``out`` when given).
        """
        if out is None or isinstance(send, np.ndarray):
            send = np.ascontiguousarray(send)
        shape = (int(np.sum(recv_counts)), *send.shape[1:])
        if out is None:
            recv = np.empty(shape, dtype=send.dtype)
        else:
            _check_rows_buffer("send", send, send.shape, send.dtype)  # a tensor is taken as it is
            _check_rows_buffer("out", out, shape, send.dtype)
            recv = out
        if self.mpi is None:
            recv[...] = send
            return recv
        from mpi4py import MPI

        # counted in bytes, so one call moves any dtype and feature shape
        with self._call():
            self.mpi.Alltoallv(
                [send, _byte_sizes(send, send_counts), MPI.BYTE],
                [recv, _byte_sizes(recv, recv_counts), MPI.BYTE],
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
            self._wait_for_all(self.mpi.Ibarrier(), timeout, waiting_for)

    def union(self, flags: np.ndarray, timeout: float | None, waiting_for: str) -> np.ndarray:
        """Element-wise OR of every rank's boolean ``flags``, waited for as in :meth:`rendezvous`.

        One non-blocking ``Allreduce``, which is the rendezvous too.
        """
        flags = np.ascontiguousarray(flags, dtype=np.uint8)
        if self.mpi is None or self.size == 1:
            return flags.astype(bool)
        from mpi4py import MPI

        union = np.empty_like(flags)
        with self._call():
            self._wait_for_all(self.mpi.Iallreduce(flags, union, op=MPI.BOR), timeout, waiting_for)
        return union.astype(bool)

    def _wait_for_all(self, request: Any, timeout: float | None, waiting_for: str) -> None:
        """Wait for the collective ``request``; abort the job after ``timeout`` s."""
        start = time.monotonic()
        if not _poll(request.Test, timeout):
            sys.stderr.write(
                f"ase_shard: rank {self.rank} waited {time.monotonic() - start:.0f} s for the "
                f"other ranks to {waiting_for}; aborting the MPI job\n"
            )
            sys.stderr.flush()
            self.mpi.Abort(1)

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

    def status(self, failed: bool, closing: bool = False) -> tuple[bool, bool]:
        """A status vote within a collective evaluation: one allreduce.

        Every halo exchange of an evaluation starts with one, and the
        evaluation ends with a ``closing`` one; a rank whose model raised
        casts its closing vote at once instead of joining further exchanges.

        Returns
        -------
        any_failed : bool
            Some rank voted ``failed``.
        together : bool
            Every rank cast this vote at the same point: the same exchange of
            the evaluation, or all closing it. A model that makes different
            exchanges on different ranks (a bug) is found at the first vote
            where the ranks part, instead of leaving one rank waiting in a
            collective the others never enter.
        """
        position = -1 if closing else self._votes
        self._votes = 0 if closing else self._votes + 1
        if self.mpi is None:
            return bool(failed), True
        from mpi4py import MPI

        votes = np.array([int(failed), position, -position], dtype=np.int64)
        result = np.empty_like(votes)
        with self._call():
            self.mpi.Allreduce(votes, result, op=MPI.MAX)
        any_failed, together = bool(result[0]), bool(result[1] == -result[2])
        if any_failed or not together:
            self._votes = 0  # every rank leaves the evaluation at this vote
        return any_failed, together

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


# (rank, size) on this node as launchers export them: Open MPI, MPICH/Hydra, Slurm
_NODE_LOCAL = (
    ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
)


def node_local_rank() -> tuple[int | None, int]:
    """This process's rank among the job's processes on its node, and their number.

    From the launcher's environment, so no collective is needed; ``(None, 1)``
    when no launcher says.
    """
    for rank, size in _NODE_LOCAL:
        if rank in os.environ and size in os.environ:
            try:
                return int(os.environ[rank]), int(os.environ[size])
            except ValueError:
                continue  # e.g. Slurm's "2(x3)" task counts
    return None, 1


# seconds a waiting rank calls ``test()`` back to back before it starts to sleep
SPIN = 1e-4


def _poll(test: Any, timeout: float | None) -> bool:
    """Call ``test()`` until it is true (then ``True``) or ``timeout`` s pass (``False``).

    Sleeps between polls instead of spinning in MPI, so waiting ranks leave
    the cores to the ranks still working; but first polls without a pause for
    :data:`SPIN` s. A non-blocking collective moves on only inside ``test()``,
    in a few rounds of messages, and the shortest sleep lasts 60-80 µs (the
    kernel's timer slack on Linux): sleeping from the first poll cost every
    collective ~0.2 ms where the ranks arrive together, as they do at each MD
    step's vote (32,000 Ar atoms on 2 ranks: 0.4 ms of a 6.5 ms step).
    """
    start, pause = time.monotonic(), 1e-6
    while not test():
        waited = time.monotonic() - start
        if waited < SPIN:
            continue
        if timeout is not None and waited > timeout:
            return False
        time.sleep(pause)
        # quick when they are close, cheap when not; the cap bounds how late a rank
        # leaves after the last one arrived (a 100 ms MD step of 1M atoms on 2 ranks
        # slept 6 ms with a 1 ms cap, 4.5 ms with this one; waking 5,000 times a
        # second costs about 1 % of a core)
        pause = min(2.0 * pause, 2e-4)
    return True


# set on an exception that every rank of MPI.COMM_WORLD raised together
_EVERY_RANK = "ase_shard_raised_on_every_rank"


def raised_on_every_rank(error: BaseException) -> BaseException:
    """Mark ``error`` as raised by every rank of the job at once (returns it).

    If it ends the script, the ranks exit together and only rank 0 prints it
    (:func:`abort_job_on_uncaught_exception`).
    """
    setattr(error, _EVERY_RANK, True)
    return error


@dataclass(frozen=True)
class Failure:
    """An exception raised on one rank, in a form that travels to the others (pickled).

    Attributes
    ----------
    module, qualname : str
        Where the exception's class is defined, to raise the same type elsewhere.
    message : str
    rank : int
        The rank that raised it.
    """

    module: str
    qualname: str
    message: str
    rank: int

    @classmethod
    def of(cls, error: BaseException, rank: int) -> Failure:
        kind = type(error)
        return cls(kind.__module__, kind.__qualname__, str(error), rank)


def _exception_class(module: str, qualname: str) -> type:
    """The exception class named by ``module.qualname``, if importable."""
    target: Any = sys.modules.get(module)
    for part in qualname.split("."):
        target = getattr(target, part, None)
    if isinstance(target, type) and issubclass(target, BaseException):
        return target
    return CollectiveError


def reraise(failures: Sequence[Failure]) -> BaseException:
    """One exception for every rank from the failures of the ranks that failed.

    The first failing rank's exception type is kept when it can be re-created
    from a message; the message names the rank (and how many others failed).
    """
    first = failures[0]
    others = f"; {len(failures) - 1} more rank(s) failed" if len(failures) > 1 else ""
    text = f"{first.message} [rank {first.rank}{others}]"
    kind = _exception_class(first.module, first.qualname)
    try:
        error = kind(text)
    except Exception:
        error = None
    if not isinstance(error, BaseException):
        error = CollectiveError(f"{first.qualname}: {text}")
    return error


def _bytes(array: np.ndarray) -> np.ndarray:
    """The bytes of a C-contiguous array, as a flat uint8 view."""
    return array.reshape(-1).view(np.uint8)


def _check_rows_buffer(name: str, array: Any, shape: tuple, dtype: Any) -> None:
    """Raise ``ValueError`` unless ``array`` is a C-contiguous ``shape`` array of ``dtype``.

    MPI reads and writes the raw bytes, so a buffer of another size, type or
    layout would be read or filled wrongly rather than fail.
    """
    shape = tuple(int(n) for n in shape)
    got = tuple(int(n) for n in array.shape)
    contiguous = (
        array.flags.c_contiguous if isinstance(array, np.ndarray) else array.is_contiguous()
    )
    if got != shape or array.dtype != dtype or not contiguous:
        layout = "" if contiguous else " non-contiguous"
        raise ValueError(
            f"alltoallv_rows: {name} must be a C-contiguous {type(array).__name__} of shape "
            f"{shape} and dtype {dtype}, got a{layout} one of shape {got} and dtype {array.dtype}"
        )


def _byte_sizes(array: np.ndarray, counts: Sequence[int]) -> tuple:
    """``(sizes, offsets)`` in bytes of consecutive blocks of ``counts`` rows of ``array``."""
    row_bytes = array.dtype.itemsize * math.prod(array.shape[1:])
    sizes = np.asarray(counts, dtype=np.int64) * row_bytes
    offsets = np.zeros_like(sizes)
    np.cumsum(sizes[:-1], out=offsets[1:])
    return sizes, offsets


def _lor():
    from mpi4py import MPI

    return MPI.LOR


# seconds ranks wait for each other at a common exit before aborting the job
EXIT_TIMEOUT = 10.0
_EXIT_TAG = 32001


def _all_ranks_exit(world: Any) -> bool:
    """Whether every rank of ``world`` reaches this point within :data:`EXIT_TIMEOUT` s.

    Point-to-point messages on their own tag, not a collective: a rank still
    inside some other collective must not be matched with this one.
    """
    from mpi4py import MPI

    if world.Get_rank() == 0:
        arrivals = [
            world.Irecv([bytearray(1), MPI.BYTE], source=rank, tag=_EXIT_TAG)
            for rank in range(1, world.Get_size())
        ]
        if not _poll(lambda: MPI.Request.Testall(arrivals), EXIT_TIMEOUT):
            return False
        for rank in range(1, world.Get_size()):
            world.Send([bytearray(1), MPI.BYTE], dest=rank, tag=_EXIT_TAG)
        return True
    arrival = world.Isend([bytearray(1), MPI.BYTE], dest=0, tag=_EXIT_TAG)
    release = world.Irecv([bytearray(1), MPI.BYTE], source=0, tag=_EXIT_TAG)
    if not _poll(release.Test, EXIT_TIMEOUT):
        return False
    arrival.Wait()  # rank 0 received it: complete at once
    return True


def abort_job_on_uncaught_exception() -> bool:
    """Make an uncaught exception on one rank end the whole MPI job.

    Without this, a rank that dies of an exception waits in ``MPI_Finalize``
    for ranks that wait for it in a collective, and the job hangs. The hook
    prints which rank failed and the traceback, then has mpi4py call
    ``MPI_Abort`` once the interpreter exits (what ``python -m mpi4py`` does):
    ``atexit`` handlers still run first, so a worker-mode rank 0 still releases
    its servers. An error that every rank raised together
    (:func:`raised_on_every_rank`) is printed by rank 0 alone and the ranks
    exit with status 1 without ``MPI_Abort``, once they have all checked in
    (within :data:`EXIT_TIMEOUT` s; else the job is aborted as above).
    Installed only under an MPI launcher with more than one rank in
    ``MPI.COMM_WORLD``; calling it again changes nothing.

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
        if getattr(value, _EVERY_RANK, False) and _all_ranks_exit(world):
            # one report for the job; each rank exits 1 and finalizes MPI normally
            if world.Get_rank() == 0:
                previous(kind, value, traceback)
            return
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
