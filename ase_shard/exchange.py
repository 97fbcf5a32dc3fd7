"""Communication between ranks within a step: LAMMPS's four verbs.

:class:`Halo` is one rank's communication, kept by the calculator for its
life; a step calls its verbs in LAMMPS's order (``Verlet::run``)::

    exchange  atoms move to their new owners, with all their arrays (rebuilds,
              distributed atoms only)
    borders   record the plan: which owned nodes each rank sends, which ghost
              nodes it receives (rebuilds)
    forward   owners' rows to their ghost copies (every step)
    reverse   ghost copies' sums to their owners (every step)

The plan ``borders`` records is a :class:`HaloExchange`, replayed until the
next rebuild, also by the model between its layers (per-layer halo, as torch
custom ops) and by kernels between their passes.

Forward copies every owned node's features into its ghost copies on other
ranks; backward sums the gradients of those ghost copies back into the owner.
Both directions are one ``Alltoallv`` of rows (:attr:`HaloExchange.transport`):
CPU tensors in place, device tensors through host buffers that are allocated
once and reused (:class:`StagingBuffers`, page-locked on CUDA), or handed to
MPI directly where it is CUDA-aware. The same
plan sums the ghost nodes' results (forces, virials) into their owners
(:meth:`HaloExchange.reverse_columns`), and kernels that evaluate a pair
between two ranks once exchange per-node sums through it between their passes.

Every rank must run the same exchanges, forward and backward, or the
collectives would pair up wrongly and hang. Two rules make sure of it:

- an exchange's output always requires grad (it depends on a *token*), so
  backward reaches every exchange on every rank, also on a rank whose features
  do not depend on its (possibly zero) edges;
- each exchange starts with a status vote. A rank whose model raised votes
  "failed" once instead of joining further exchanges; the others then raise
  :class:`PeerFailure` at that vote, and all ranks leave evaluation together.
"""

from __future__ import annotations

import itertools
import math
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from ase_shard.comm import Comm, cuda_aware_mpi
from ase_shard.distributed import DistributedAtoms, migrate
from ase_shard.halo import RankRows


class Halo:
    """One rank's communication of a step: LAMMPS's four verbs over a recorded plan.

    Parameters
    ----------
    comm : Comm
    device : torch.device
        Where the model's features live (the plan's index tensors go there).

    Attributes
    ----------
    plan : HaloExchange or None
        The plan of the last :meth:`borders`, replayed by :meth:`forward` and
        :meth:`reverse` until the next one; ``None`` before the first.
    """

    def __init__(self, comm: Comm, device: torch.device):
        self.comm = comm
        self.device = torch.device(device)
        self.plan: HaloExchange | None = None
        # kept across rebuilds: a compiled model specialises on its exchange's handle
        self._handle: int | None = None

    def exchange(self, atoms: DistributedAtoms, owners: np.ndarray) -> None:
        """Send each local atom, with every per-atom array, to rank ``owners[i]``.

        Afterwards ``atoms`` holds the atoms this rank owns (collective; see
        :func:`ase_shard.distributed.migrate`).
        """
        migrate(atoms, owners)

    def borders(self, rows: RankRows) -> HaloExchange:
        """Record the exchange plan of this rank's ``rows`` (collective).

        Each rank knows the ghosts it needs (``rows.requests``, by owner); an
        all-to-all tells each owner which of its nodes to send where, unless
        ``rows`` already says (``send_index``, in worker mode from rank 0).
        """
        if rows.send_index is None:
            rows.send_counts = self.comm.alltoall_counts(rows.recv_counts)
            rows.send_index = self.comm.alltoallv_rows(
                rows.requests, rows.recv_counts, rows.send_counts
            )
        self.plan = HaloExchange(
            self.comm,
            rows.n_owned,
            rows.send_index,
            rows.send_counts,
            rows.recv_counts,
            self.device,
            self._handle,
        )
        self._handle = self.plan.handle
        return self.plan

    def forward(self, owned: np.ndarray) -> np.ndarray:
        """The owned nodes' ``(n_owned, k)`` rows followed by the ghost nodes' (collective)."""
        return np.concatenate([owned, self.plan.forward_rows(owned)])

    def reverse(self, columns: np.ndarray) -> np.ndarray:
        """The owned nodes' ``(k, n_owned)`` columns with their ghost copies' added
        (collective; :meth:`HaloExchange.reverse_columns`)."""
        return self.plan.reverse_columns(columns)

    def forget(self) -> None:
        """Drop the plan (after a failed step, every rank starts afresh)."""
        self.plan = None


class PeerFailure(RuntimeError):
    """Another rank failed during a collective evaluation (its error is reported)."""


class ExchangeMismatch(PeerFailure):
    """The ranks made different halo exchanges in one evaluation (a model bug).

    A :class:`PeerFailure`: every rank raises it at the same vote, so none casts
    a further one.
    """


def check_status(any_failed: bool, together: bool, where: str) -> None:
    """Raise for a status vote (:meth:`ase_shard.comm.Comm.status`) that is not all clear."""
    if any_failed:
        raise PeerFailure(f"another rank failed {where}")
    if not together:
        raise ExchangeMismatch(
            f"the ranks made different halo exchanges in one evaluation (found {where}): "
            "a model must make the same exchanges, forward and backward, on every rank, "
            "also on a rank that owns no atoms"
        )


TRANSPORTS = ("host", "pinned", "pageable", "device")


def choose_transport(device: torch.device) -> str:
    """How the halo rows of tensors on ``device`` reach MPI (see :class:`HaloExchange`)."""
    device = torch.device(device)
    if device.type == "cpu":
        return "host"
    if device.type == "cuda":
        return "device" if cuda_aware_mpi() else "pinned"
    return "pageable"  # other accelerators: torch pins host memory for CUDA only


class StagingBuffers:
    """Host buffers that carry halo rows between a device and MPI, reused across exchanges.

    One send and one receive buffer of bytes, allocated on first use and
    replaced by a larger one only when an exchange needs more: the
    exchanges of one plan (every layer, forward and backward, every step
    until the next rebuild) allocate no host memory once each size has been
    seen. Rows go in and out as ``(n, bytes per row)`` uint8 tensors.

    Parameters
    ----------
    pin : bool
        Page-locked buffers (needs CUDA): copies to and from the device run
        asynchronously by DMA instead of through the driver's own pageable
        bounce buffer.
    """

    def __init__(self, pin: bool):
        self.pin = bool(pin)
        self.send = torch.empty(0, dtype=torch.uint8, pin_memory=self.pin)
        self.recv = torch.empty(0, dtype=torch.uint8, pin_memory=self.pin)
        # recorded after each asynchronous copy out of ``recv`` and waited on before
        # ``recv`` is written again (see ``to_device``); one event, re-recorded
        self._recv_read: torch.cuda.Event | None = None

    def to_host(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` copied into the send buffer; the copy, complete, as a view of it.

        The returned view is valid until the next call.
        """
        self.send = _holding(self.send, rows.numel(), self.pin)
        host = self.send[: rows.numel()].view(rows.shape)
        if rows.numel():
            host.copy_(rows, non_blocking=self.pin)
            if self.pin:
                # MPI reads ``host`` outside CUDA's stream order: wait for the copy, and
                # with it the kernels that made ``rows``, on this stream only
                torch.cuda.current_stream(rows.device).synchronize()
        return host

    def receive(self, shape: tuple[int, int]) -> torch.Tensor:
        """A ``shape`` view of the receive buffer, free to be written.

        Waits for the copy out of the previous view (``to_device``) first.
        The view is valid until the next call.
        """
        if self._recv_read is not None:
            self._recv_read.synchronize()
        self.recv = _holding(self.recv, shape[0] * shape[1], self.pin)
        return self.recv[: shape[0] * shape[1]].view(shape)

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A new tensor on ``device`` holding ``host`` (a view of the receive buffer).

        With pinned buffers the copy is asynchronous: it is still reading
        ``host`` when this returns. Rather than wait for it here (a second
        synchronisation per exchange), an event recorded after it is waited
        on by the next :meth:`receive`, before MPI overwrites the buffer; by
        then the copy has usually long finished, since the next exchange's
        own synchronisation (``to_host``) covered it.
        """
        out = torch.empty(host.shape, dtype=host.dtype, device=device)
        if host.numel():
            out.copy_(host, non_blocking=self.pin)
            if self.pin:
                if self._recv_read is None:
                    self._recv_read = torch.cuda.Event()
                self._recv_read.record(torch.cuda.current_stream(out.device))
        return out


class HaloExchange:
    """The exchange plan of one rank's block (LAMMPS's forward/reverse communication).

    Parameters
    ----------
    comm : Comm
    n_owned : int
        Owned nodes (the first rows of features).
    send_index : (m,) int array
        Owned nodes to send, grouped by receiving rank.
    send_counts, recv_counts : (P,) int arrays
        Rows sent to / received from each rank; received rows are the ghost
        nodes in order.
    device : torch.device
    handle : int, optional
        Key under which the exchange is registered for its torch custom ops
        (``ase_shard::halo_exchange``). A compiled model specialises on it, so
        a calculator keeps one handle across rebuilds; default: a new one.
    transport : {"host", "pinned", "pageable", "device"}, optional
        How rows reach MPI, in :attr:`transport`; default:
        :func:`choose_transport` of ``device``.

    Attributes
    ----------
    transport : str
        ``"host"``: CPU tensors, which MPI reads and writes in place (the
        received rows land in a reused buffer). ``"pinned"``: CUDA tensors,
        staged through reused page-locked host buffers: per exchange one
        asynchronous copy each way and one synchronisation of the current
        stream. ``"pageable"``: the same through ordinary host memory (other
        accelerators). ``"device"``: CUDA tensors handed to MPI as they are,
        where it is CUDA-aware (:func:`ase_shard.comm.cuda_aware_mpi`).
    staging : StagingBuffers
        The host buffers of ``"host"`` (receive only), ``"pinned"`` and
        ``"pageable"``. A rebuild makes a new exchange and so new buffers;
        pinned ones then come from torch's cache of page-locked blocks.
    received_bytes : int
        Bytes this rank received through the plan so far: per forward exchange
        a row of each ghost node, per reverse exchange one of each sent node.
    crossings : list of Crossing or None
        Where a list is given (:func:`ase_shard.plan.plan`'s calibration), each
        exchange made appends its direction and bytes per row: a step's traffic
        at any rank count is then these rows times the ghost and sent nodes.
    """

    def __init__(
        self,
        comm: Comm,
        n_owned: int,
        send_index: np.ndarray,
        send_counts: np.ndarray,
        recv_counts: np.ndarray,
        device: torch.device,
        handle: int | None = None,
        *,
        transport: str | None = None,
    ):
        transport = choose_transport(device) if transport is None else transport
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, not {transport!r}")
        self.transport = transport
        self.staging = StagingBuffers(pin=transport == "pinned")
        self.handle = next(_HANDLES) if handle is None else int(handle)
        _EXCHANGES[self.handle] = self
        self.comm = comm
        self.n_owned = int(n_owned)
        self.send_rows = torch.as_tensor(send_index, dtype=torch.int64)  # host copy
        self.send_index = self.send_rows.to(device)
        self.send_counts = np.asarray(send_counts, dtype=np.int64)
        self.recv_counts = np.asarray(recv_counts, dtype=np.int64)
        self.n_ghosts = int(self.recv_counts.sum())
        self.received_bytes = 0
        self.crossings: list[Crossing] | None = None
        self.token: torch.Tensor | None = None
        self.pad(n_owned, self.n_ghosts)

    def pad(self, owned_rows: int, ghost_rows: int) -> None:
        """Lay features out as ``owned_rows`` owned then ``ghost_rows`` ghost rows.

        The rows beyond the real owned and ghost nodes are padding
        (``ase_shard.padding``): never sent, received as zeros.
        """
        self.owned_rows, self.ghost_rows = int(owned_rows), int(ghost_rows)

    def new_evaluation(self, dtype: torch.dtype) -> torch.Tensor:
        """A fresh token for one forward/backward pass (differentiate w.r.t. it)."""
        self.token = torch.zeros((), dtype=dtype, device=self.send_index.device).requires_grad_()
        return self.token

    def __call__(self, owned: torch.Tensor) -> torch.Tensor:
        """Features of all nodes from the ``(n_owned, ...)`` owned ones."""
        if owned.shape[0] != self.owned_rows:
            raise ValueError(
                f"exchange expects {self.owned_rows} owned rows, got {owned.shape[0]}"
            )
        return halo_exchange(owned, self.token, self.handle)

    def vote(self) -> None:
        """Status vote; raises :class:`PeerFailure` if another rank failed, or
        :class:`ExchangeMismatch` if the ranks are not at the same exchange.

        A failed rank casts its one "failed" vote from the calculator
        (``comm.status(True, closing=True)``) instead of joining further exchanges.
        """
        check_status(*self.comm.status(False), "during the halo exchange")

    def forward_rows(self, owned: np.ndarray) -> np.ndarray:
        """The ghost nodes' rows, from their owners' ``owned`` rows (host, no autograd).

        Parameters
        ----------
        owned : (n_owned, ...) array
            This rank's owned nodes' rows, any dtype.

        Returns
        -------
        (n_ghosts, ...) array: every ghost node's row, as its owner holds it, in
        ghost-node order.
        """
        self._count(True, owned)
        return self._forward_rows(owned)

    def _forward_rows(self, owned: np.ndarray) -> np.ndarray:
        sent = np.take(owned, self.send_rows.numpy(), axis=0)
        return self.comm.alltoallv_rows(sent, self.send_counts, self.recv_counts)

    def reverse_columns(self, columns: np.ndarray) -> np.ndarray:
        """Owned nodes' values plus what the other ranks hold for them (host, no autograd).

        Parameters
        ----------
        columns : (k, n_owned + n_ghosts) float64 array
            One row per quantity, one column per node (owned, then ghosts);
            its owned columns are added to in place.

        Returns
        -------
        (k, n_owned) float64 array, a view of ``columns``: each owned node's
        column with every ghost copy's column on other ranks added, in a fixed
        order.
        """
        owned = columns[:, : self.n_owned]
        self._count(False, owned.T)
        if self.comm.size == 1:
            return owned  # no other rank holds a copy
        ghosts = columns[:, self.n_owned : self.n_owned + self.n_ghosts].T
        back = self.comm.alltoallv_rows(ghosts, self.recv_counts, self.send_counts)
        torch.from_numpy(owned).index_add_(1, self.send_rows, torch.from_numpy(back.T))
        return owned

    def sum_ghost_columns(self, columns: np.ndarray) -> None:
        """:meth:`reverse_columns` within an evaluation, after a status vote.

        For kernels that exchange between their passes
        (:class:`ase_shard.graph.GhostColumns`).
        """
        self.vote()
        self.reverse_columns(columns)

    def copy_owner_columns(self, columns: np.ndarray) -> None:
        """Ghost nodes' columns set to their owners' (host, no autograd), after a status vote.

        Parameters
        ----------
        columns : (k, n_owned + n_ghosts) float64 array
            As in :meth:`reverse_columns`; its ghost columns are overwritten.
        """
        self.vote()
        owned = columns[:, : self.n_owned].T
        self._count(True, owned)
        if self.comm.size == 1:
            return  # no ghosts
        received = self._forward_rows(owned)
        columns[:, self.n_owned : self.n_owned + self.n_ghosts] = received.T

    def _move(self, rows: torch.Tensor, send_counts, recv_counts) -> torch.Tensor:
        """The rows that the other ranks send for ``rows`` sent, grouped by rank, on its device.

        With the ``"host"`` transport the result is a view of the reused
        receive buffer, valid until the next exchange: callers copy it into
        their own output (``torch.cat``, ``index_add``), so what the custom
        ops return, and autograd keeps, never shares memory with a buffer.
        """
        send = _byte_rows(rows)
        shape = (int(recv_counts.sum()), send.shape[1])
        if self.transport == "device":
            recv = send.new_empty(shape)
            if rows.is_cuda:
                # MPI reads ``send`` and writes ``recv`` outside CUDA's stream order: the
                # kernels that made ``send`` and any that last used ``recv``'s memory must be
                # done; the current stream is the one they ran on
                torch.cuda.current_stream(rows.device).synchronize()
            self.comm.alltoallv_rows(send, send_counts, recv_counts, out=recv)
        elif self.transport == "host":
            recv = self.staging.receive(shape)
            self.comm.alltoallv_rows(send.numpy(), send_counts, recv_counts, out=recv.numpy())
        else:
            host = self.staging.to_host(send)
            received = self.staging.receive(shape)
            self.comm.alltoallv_rows(host.numpy(), send_counts, recv_counts, out=received.numpy())
            recv = self.staging.to_device(received, rows.device)
        return recv.view(rows.dtype).view(shape[0], *rows.shape[1:])

    def _count(self, forward: bool, rows: np.ndarray | torch.Tensor) -> None:
        """Add an exchange's received rows (``forward``, or reverse, of ``rows``' shape)
        to :attr:`received_bytes`, and to :attr:`crossings` where they are recorded."""
        row_bytes = _row_bytes(rows)
        self.received_bytes += row_bytes * (self.n_ghosts if forward else len(self.send_rows))
        if self.crossings is not None:
            self.crossings.append(Crossing(forward, row_bytes))

    def copy_to_ghosts(self, owned: torch.Tensor) -> torch.Tensor:
        self.vote()
        self._count(True, owned)
        ghosts = self._move(
            owned.index_select(0, self.send_index), self.send_counts, self.recv_counts
        )
        padding = owned.new_zeros((self.ghost_rows - ghosts.shape[0], *owned.shape[1:]))
        return torch.cat([owned, ghosts, padding])

    def sum_into_owners(self, grad: torch.Tensor) -> torch.Tensor:
        self.vote()
        self._count(False, grad)
        ghosts = grad[self.owned_rows : self.owned_rows + self.n_ghosts]
        back = self._move(ghosts, self.recv_counts, self.send_counts)
        return grad[: self.owned_rows].index_add(0, self.send_index, back)


@dataclass(frozen=True)
class Crossing:
    """One exchange of a step: ``forward`` (owners' rows to their ghosts: a row
    received per ghost node) or reverse (ghosts' rows to their owners: a row
    received per sent node), of ``row_bytes`` bytes a row."""

    forward: bool
    row_bytes: int


def _row_bytes(rows: np.ndarray | torch.Tensor) -> int:
    """Bytes of one row of an ``(n, ...)`` array or tensor."""
    itemsize = rows.itemsize if isinstance(rows, np.ndarray) else rows.element_size()
    return itemsize * math.prod(rows.shape[1:])


def _byte_rows(rows: torch.Tensor) -> torch.Tensor:
    """A contiguous ``(n, ...)`` tensor's rows as an ``(n, bytes per row)`` uint8 view.

    Bytes, so that every dtype (also those numpy lacks, e.g. bfloat16) takes
    the same buffers and the same MPI call.
    """
    flat = rows.detach().reshape(rows.shape[0], math.prod(rows.shape[1:]))
    return flat.view(torch.uint8)


def _holding(buffer: torch.Tensor, nbytes: int, pin: bool) -> torch.Tensor:
    """``buffer`` if it holds ``nbytes``, else a new one that does (sizes change at rebuilds)."""
    if buffer.numel() >= nbytes:
        return buffer
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


# Custom ops rather than an autograd.Function: torch.compile treats them as
# opaque nodes (no graph break, so a model's layer loop stays compiled).
_HANDLES = itertools.count()
# weak: an exchange lives as long as its calculator's block, not as long as the process
_EXCHANGES: weakref.WeakValueDictionary[int, HaloExchange] = weakref.WeakValueDictionary()


@torch.library.custom_op("ase_shard::halo_exchange", mutates_args=())
def halo_exchange(owned: torch.Tensor, token: torch.Tensor, handle: int) -> torch.Tensor:
    """Owned rows -> all rows (owned, ghosts from their owners, padding zeros)."""
    return _EXCHANGES[handle].copy_to_ghosts(owned.contiguous())


@halo_exchange.register_fake
def _(owned: torch.Tensor, token: torch.Tensor, handle: int) -> torch.Tensor:
    return owned.new_empty((owned.shape[0] + _EXCHANGES[handle].ghost_rows, *owned.shape[1:]))


@torch.library.custom_op("ase_shard::halo_reverse", mutates_args=())
def halo_reverse(grad: torch.Tensor, handle: int) -> torch.Tensor:
    """Gradient w.r.t. all rows -> w.r.t. owned rows (ghost parts summed into owners)."""
    return _EXCHANGES[handle].sum_into_owners(grad.contiguous())


@halo_reverse.register_fake
def _(grad: torch.Tensor, handle: int) -> torch.Tensor:
    return grad.new_empty((_EXCHANGES[handle].owned_rows, *grad.shape[1:]))


def _setup(ctx, inputs, output) -> None:
    ctx.handle = inputs[2]


def _backward(ctx, grad: torch.Tensor):
    return halo_reverse(grad, ctx.handle), None, None


halo_exchange.register_autograd(_backward, setup_context=_setup)
