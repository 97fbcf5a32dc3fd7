"""Halo exchange between ranks: node features forward, ghost contributions back.

Forward copies every owned node's features into its ghost copies on other
ranks; backward sums the gradients of those ghost copies back into the owner.
Both directions are one ``Alltoallv`` of rows through host memory. The same
plan sums the ghost nodes' results (forces, virials) into their owners
(:meth:`HaloExchange.sum_into_owned_columns`).

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
import weakref

import numpy as np
import torch

from ase_shard.comm import Comm


class PeerFailure(RuntimeError):
    """Another rank failed during a collective evaluation (its error is reported)."""


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
    ):
        self.handle = next(_HANDLES) if handle is None else int(handle)
        _EXCHANGES[self.handle] = self
        self.comm = comm
        self.n_owned = int(n_owned)
        self.send_rows = torch.as_tensor(send_index, dtype=torch.int64)  # host copy
        self.send_index = self.send_rows.to(device)
        self.send_counts = np.asarray(send_counts, dtype=np.int64)
        self.recv_counts = np.asarray(recv_counts, dtype=np.int64)
        self.n_ghosts = int(self.recv_counts.sum())
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
        """Status vote; raises :class:`PeerFailure` if another rank failed.

        A failed rank casts its one "failed" vote from the calculator
        (``comm.any(True)``) instead of joining further exchanges.
        """
        if self.comm.any(False):
            raise PeerFailure("another rank failed during the halo exchange")

    def sum_into_owned_columns(self, columns: np.ndarray) -> np.ndarray:
        """Owned nodes' values plus what the other ranks hold for them (host, no autograd).

        Parameters
        ----------
        columns : (k, n_owned + n_ghosts) float64 array
            One row per quantity, one column per node (owned, then ghosts).

        Returns
        -------
        (k, n_owned) float64 array: each owned node's column with every ghost
        copy's column on other ranks added, in a fixed order.
        """
        if self.comm.size == 1:
            return columns[:, : self.n_owned]  # no other rank holds a copy
        ghosts = columns[:, self.n_owned : self.n_owned + self.n_ghosts].T
        back = self.comm.alltoallv_rows(ghosts, self.recv_counts, self.send_counts)
        owned = torch.from_numpy(np.array(columns[:, : self.n_owned]))
        owned.index_add_(1, self.send_rows, torch.from_numpy(back.T))
        return owned.numpy()

    def _move(self, rows: torch.Tensor, send_counts, recv_counts) -> torch.Tensor:
        moved = self.comm.alltoallv_rows(rows.detach().cpu().numpy(), send_counts, recv_counts)
        return torch.from_numpy(moved).to(rows.device)

    def copy_to_ghosts(self, owned: torch.Tensor) -> torch.Tensor:
        self.vote()
        ghosts = self._move(
            owned.index_select(0, self.send_index), self.send_counts, self.recv_counts
        )
        padding = owned.new_zeros((self.ghost_rows - ghosts.shape[0], *owned.shape[1:]))
        return torch.cat([owned, ghosts, padding])

    def sum_into_owners(self, grad: torch.Tensor) -> torch.Tensor:
        self.vote()
        ghosts = grad[self.owned_rows : self.owned_rows + self.n_ghosts]
        back = self._move(ghosts, self.recv_counts, self.send_counts)
        return grad[: self.owned_rows].index_add(0, self.send_index, back)


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
