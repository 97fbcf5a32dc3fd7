"""Per-layer halo exchange of node features, differentiable.

Forward copies every owned node's features into its ghost copies on other
ranks; backward sums the gradients of those ghost copies back into the owner.
Both directions are one ``Alltoallv`` of rows through host memory.

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

import numpy as np
import torch

from ase_shard.comm import Comm


class PeerFailure(RuntimeError):
    """Another rank failed during a collective evaluation (its error is reported)."""


class HaloExchange:
    """The feature exchange of one rank's block.

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
    """

    def __init__(
        self,
        comm: Comm,
        n_owned: int,
        send_index: np.ndarray,
        send_counts: np.ndarray,
        recv_counts: np.ndarray,
        device: torch.device,
    ):
        self.comm = comm
        self.n_owned = int(n_owned)
        self.send_index = torch.as_tensor(send_index, dtype=torch.int64, device=device)
        self.send_counts = np.asarray(send_counts, dtype=np.int64)
        self.recv_counts = np.asarray(recv_counts, dtype=np.int64)
        self.token: torch.Tensor | None = None

    def new_evaluation(self, dtype: torch.dtype) -> torch.Tensor:
        """A fresh token for one forward/backward pass (differentiate w.r.t. it)."""
        self.token = torch.zeros((), dtype=dtype, device=self.send_index.device).requires_grad_()
        return self.token

    def __call__(self, owned: torch.Tensor) -> torch.Tensor:
        """Features of all nodes from the ``(n_owned, ...)`` owned ones."""
        if owned.shape[0] != self.n_owned:
            raise ValueError(f"exchange expects {self.n_owned} owned rows, got {owned.shape[0]}")
        return _Exchange.apply(owned, self.token, self)

    def vote(self, failed: bool = False) -> None:
        """Status vote; raises :class:`PeerFailure` if another rank failed."""
        if self.comm.any(failed) and not failed:
            raise PeerFailure("another rank failed during the halo exchange")

    def _move(self, rows: torch.Tensor, send_counts, recv_counts) -> torch.Tensor:
        moved = self.comm.alltoallv_rows(rows.detach().cpu().numpy(), send_counts, recv_counts)
        return torch.from_numpy(moved).to(rows.device)

    def copy_to_ghosts(self, owned: torch.Tensor) -> torch.Tensor:
        self.vote()
        ghosts = self._move(
            owned.index_select(0, self.send_index), self.send_counts, self.recv_counts
        )
        return torch.cat([owned, ghosts])

    def sum_into_owners(self, grad: torch.Tensor) -> torch.Tensor:
        self.vote()
        back = self._move(grad[self.n_owned :], self.recv_counts, self.send_counts)
        return grad[: self.n_owned].index_add(0, self.send_index, back)


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, owned: torch.Tensor, token: torch.Tensor, halo: HaloExchange):
        ctx.halo = halo
        return halo.copy_to_ghosts(owned)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.halo.sum_into_owners(grad.contiguous()), None, None
