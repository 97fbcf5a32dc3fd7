"""Worker mode: rank 0 alone runs ASE while the other ranks serve.

Two ways in:

- ``serve(model, ...)`` under ``mpirun``: rank 0 gets a calculator to drive,
  every other rank serves inside the call until rank 0 closes it.
- ``spawn(model, workers=N, ...)`` from a plain Python or Jupyter process:
  starts N local worker ranks through MPI spawn (no mpirun needed) and returns
  a calculator that drives them; the notebook process itself computes nothing.
"""

from __future__ import annotations

import atexit
import io
import os
import shutil
import sys
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ase_shard.calculator import ShardedCalculator
from ase_shard.comm import ALLOW_RUN_AS_ROOT, Failure, reraise


def serve(model: torch.nn.Module, **kwargs: Any) -> ShardedCalculator | None:
    """Split an ``mpirun`` job into one driving rank and serving ranks.

    Parameters
    ----------
    model : torch.nn.Module
        The potential (see :class:`ase_shard.graph.ShardModel`).
    **kwargs
        Passed to :class:`ShardedCalculator` (identical on every rank).

    Returns
    -------
    ShardedCalculator on rank 0; ``None`` on the other ranks once rank 0 has
    closed the calculator (``calc.close()``, ``with calc:`` or interpreter exit).

    ASE's ``world`` becomes a one-rank communicator in every process, so ASE
    drivers on rank 0 do not broadcast into ranks that are serving.
    """
    calc = ShardedCalculator(model, **kwargs)
    _isolate_ase_world()
    calc.drive_workers()
    return _drive_or_serve(calc)


def spawn(model: torch.nn.Module, workers: int = 2, **kwargs: Any) -> ShardedCalculator:
    """Start ``workers`` local MPI ranks that evaluate ``model`` for this process.

    Parameters
    ----------
    model : torch.nn.Module
        Sent to the workers (pickled with ``torch.save``).
    workers : int
        Number of ranks to start; this process drives and computes nothing.
    **kwargs
        Passed to :class:`ShardedCalculator` on every rank; ``grid`` must
        multiply to ``workers``.

    Returns
    -------
    ShardedCalculator whose ``close()`` (also ``with calc:`` and interpreter
    exit) stops the workers.

    Raises
    ------
    RuntimeError
        If the workers cannot unpickle the model (the cause names the error and
        the worker rank); the workers have exited by then.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, not {workers}")
    _prepare_spawn_environment()
    from mpi4py import MPI

    intercomm = MPI.COMM_SELF.Spawn(
        sys.executable,
        args=["-c", "from ase_shard.worker import worker_main; worker_main()"],
        maxprocs=workers,
    )
    comm = intercomm.Merge(high=False)

    def release() -> None:
        comm.Free()
        intercomm.Disconnect()

    try:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        comm.bcast((buffer.getvalue(), kwargs), root=0)
        failed = [error for error in comm.allgather(None) if error is not None]
        if failed:
            raise RuntimeError(
                "the spawned workers could not load the model; its class must be "
                "importable by a fresh Python process (defined in a module, not in "
                "the notebook or __main__)"
            ) from reraise(failed)
        # this process drives and computes nothing: it takes no GPU, nor a model copy on one
        calc = _spawned_calculator(model, comm, {**kwargs, "device": "cpu"}, on_close=release)
    except BaseException:
        release()  # the workers leave too: they disconnect after a failed start
        raise
    _spawned.add(calc)
    _stop_before_kernel_shutdown()
    return _drive_or_serve(calc)


# calculators started by spawn() in this process, for a Jupyter kernel's shutdown
_spawned: weakref.WeakSet = weakref.WeakSet()


def _stop_before_kernel_shutdown() -> None:
    """In a Jupyter kernel, stop the workers and Open MPI before the kernel's own clean-up.

    ``MPI_Comm_spawn`` from a singleton forks Open MPI's ``prte`` launcher into this
    process's process group; it lives until this process exits. On a shutdown request
    ipykernel sends SIGTERM, again and again, to every process in its group before it
    exits: the first signal makes ``prte`` abort, the second makes it print "Abort is in
    progress...hit ctrl-c again to forcibly terminate", the third kills it (and the
    workers, if still running). So, at the shutdown request and before that clean-up,
    close every spawned calculator, finalize MPI and let ``prte`` exit as it does when
    this process exits. The kernel is going away, so MPI need not be usable afterwards.
    """
    kernel = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    kernel = getattr(kernel, "kernel", None)
    if kernel is None or getattr(kernel, "_ase_shard_stops_workers", False):
        return
    do_shutdown = kernel.do_shutdown

    def stop_then_shut_down(restart):
        _stop_spawned()
        return do_shutdown(restart)

    kernel.do_shutdown = stop_then_shut_down
    kernel._ase_shard_stops_workers = True


def _stop_spawned(timeout: float = 10.0) -> None:
    """Close the spawned calculators, finalize MPI and wait for ``prte`` to exit."""
    for calc in list(_spawned):
        try:
            calc.close()
        except Exception:
            pass  # a worker that died is prte's to report
    from mpi4py import MPI

    if MPI.Is_finalized():
        return
    launchers = _launchers()
    deadline = time.monotonic() + timeout
    # the workers finalize MPI through prte: let them exit first
    while any(_children(pid) for pid, _ in launchers) and time.monotonic() < deadline:
        time.sleep(0.05)
    MPI.Finalize()
    for pid, pipe_fds in launchers:
        for fd in pipe_fds:
            os.close(fd)  # prte watches this pipe to learn that this process has gone
        while pipe_fds and time.monotonic() < deadline:
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    break
            except ChildProcessError:
                break
            time.sleep(0.05)


def _children(pid: int) -> list[int]:
    """Process ids whose parent is ``pid`` (Linux ``/proc``; empty elsewhere)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            stat = entry.read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[1]) == pid:
            found.append(int(entry.parent.name))
    return found


def _launchers() -> list[tuple[int, list[int]]]:
    """This process's ``prte`` children and our ends of their ``--keepalive`` pipes."""
    found = []
    for pid in _children(os.getpid()):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            if Path(args[0]).name != "prte" or "--keepalive" not in args:
                continue
            pipe = os.readlink(f"/proc/{pid}/fd/{args[args.index('--keepalive') + 1]}")
        except (OSError, IndexError, ValueError):
            continue
        ours = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{fd}") == pipe:
                    ours.append(int(fd))
            except OSError:
                pass
        found.append((pid, ours))
    return found


def _spawned_calculator(
    model, comm, kwargs: dict, on_close: Callable[[], None] | None = None
) -> ShardedCalculator:
    """The calculator of a spawned job (every rank): the parent drives and owns nothing;
    ``grid`` (if given) is the workers'."""
    grid = kwargs.pop("grid", None)
    calc = ShardedCalculator(model, comm=comm, **kwargs)
    calc.drive_workers(root_computes=False, grid=grid, on_close=on_close)
    return calc


def _drive_or_serve(calc: ShardedCalculator) -> ShardedCalculator | None:
    """Rank 0 gets the driving calculator; the others serve until it is closed."""
    if calc.comm.is_root:
        atexit.register(calc.close)
        return calc
    calc.serve()
    return None


def _isolate_ase_world() -> None:
    from ase.parallel import DummyMPI, world

    world.comm = DummyMPI()


def _prepare_spawn_environment() -> None:
    """Let a singleton Open MPI process find ``prte`` and, as root, run at all."""
    bin_dir = Path(sys.executable).parent
    if shutil.which("prte") is None and (bin_dir / "prte").exists():
        os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        for name, value in ALLOW_RUN_AS_ROOT.items():
            os.environ.setdefault(name, value)


def worker_main() -> None:
    """Entry point of a spawned worker: serve the parent until it closes.

    A model that does not load, or a calculator that cannot be built, ends the
    worker quietly after it has told the parent (which raises) or after the
    parent raised the same error itself; either way the worker disconnects and
    exits, so no worker outlives a failed ``spawn``.

    The worker finalizes MPI right after it disconnects and exits without the
    interpreter's teardown (seconds with torch loaded, on a busy machine): the
    parent's kernel waits for its workers before it lets ``prte`` go.
    """
    from mpi4py import MPI

    parent = MPI.Comm.Get_parent()
    comm = parent.Merge(high=True)
    payload, kwargs = comm.bcast(None, root=0)
    model, error = None, None
    try:
        # a model sent from a GPU loads here too; the calculator places it
        model = torch.load(io.BytesIO(payload), weights_only=False, map_location="cpu")
    except Exception as exc:
        error = Failure.of(exc, comm.Get_rank())
    if not any(comm.allgather(error)):
        try:
            _drive_or_serve(_spawned_calculator(model, comm, kwargs))
        except Exception:
            pass  # the same arguments made the parent raise this error
    comm.Free()
    parent.Disconnect()
    MPI.Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
