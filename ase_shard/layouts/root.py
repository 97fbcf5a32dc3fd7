"""Worker mode: rank 0 alone holds the ``Atoms`` and runs ASE; the other ranks serve.

At a rebuild rank 0 validates the system, partitions it and lays out every
rank's rows and exchange plan (:func:`ase_shard.halo.rank_rows`), then sends
each rank its rows; at every step it sends each rank its node rows (one
``Scatterv``) and receives the owned results (one ``Gatherv``). With an idle
root (a notebook process that drives spawned workers) rank 0 owns nothing.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from ase import Atoms

from ase_shard.comm import Comm, Failure
from ase_shard.exchange import Halo
from ase_shard.halo import RankRows, rank_rows
from ase_shard.inputs import ModelInputs
from ase_shard.layouts.base import (
    Decomposition,
    DecompositionView,
    Ghosts,
    Layout,
    Request,
    gathered_rows,
    in_order,
)
from ase_shard.settings import Settings
from ase_shard.system import validate
from ase_shard.timing import PhaseTimer


class RootLayout(Layout):
    """Rank 0 holds the system and plans for every rank.

    Parameters
    ----------
    comm, halo, settings, inputs, timer
        As for every :class:`~ase_shard.layouts.base.Layout`.
    idle_root : bool
        Rank 0 owns no atoms (it only drives).
    """

    def __init__(
        self,
        comm: Comm,
        halo: Halo,
        settings: Settings,
        inputs: ModelInputs,
        timer: PhaseTimer,
        idle_root: bool = False,
    ):
        super().__init__(comm, halo, settings, inputs, timer)
        self.idle_root = idle_root
        # rank 0 only: every atom's owner and row in rank-ordered results, every
        # rank's rows, and the atoms of every rank's nodes, rank by rank
        self.owners: np.ndarray | None = None
        self.gathered_row: np.ndarray | None = None
        self.layouts: list[RankRows] | None = None
        self.root_nodes: np.ndarray | None = None
        self.node_counts: np.ndarray | None = None  # nodes per rank (every rank)

    def build(self, atoms: Atoms | None, request: Request) -> Decomposition:
        comm = self.comm

        def lay_out() -> tuple[list, list]:
            validate(atoms, self.settings.atomic_types)
            coords, self.owners = self.partition(atoms, request, first=int(self.idle_root))
            with self.timer.phase("halo"):
                self.layouts = rank_rows(
                    coords,
                    request.pbc,
                    self.owners,
                    comm.size,
                    self.settings.halo_width,
                    self.settings.fold,
                )
            sends = [r.send_counts.tolist() for r in self.layouts]
            return sends, [(len(r.ids), r.n_owned, r.n_nodes) for r in self.layouts]

        sends, sizes = comm.decide(lay_out)  # rank 0's partition and halo phases
        with self.timer.phase("scatter"):
            sends, sizes = np.array(sends, dtype=np.int64), np.array(sizes, dtype=np.int64)
            meta, send_index = None, None
            if comm.is_root:
                meta = np.concatenate(
                    [
                        np.column_stack([r.ids, r.image_shift, atoms.numbers[r.ids], r.node])
                        for r in self.layouts
                    ]
                )
                send_index = np.concatenate([r.send_index for r in self.layouts])
                self.gathered_row = gathered_rows(self.owners)
                self.root_nodes = np.concatenate([r.ids[: r.n_nodes] for r in self.layouts])
            meta = comm.scatter_rows(meta, sizes[:, 0], (6,), np.int64)
            send_index = comm.scatter_rows(send_index, sends.sum(axis=1), (), np.int64)
        n_nodes = int(sizes[comm.rank, 2])
        rows = RankRows(
            ids=meta[:, 0].copy(),
            image_shift=meta[:, 1:4].copy(),
            n_owned=int(sizes[comm.rank, 1]),
            node=meta[:, 5].copy(),
            n_nodes=n_nodes,
            recv_counts=sends[:, comm.rank].copy(),
            requests=np.zeros(0, dtype=np.int64),
            send_index=send_index,
            send_counts=sends[comm.rank].copy(),
        )
        self.halo.borders(rows)  # the send side came from rank 0: nothing to ask
        self.node_counts = sizes[:, 2]
        self.state = Decomposition(
            n_atoms=request.n_atoms,
            cell=request.cell,
            rows=rows,
            numbers=meta[:n_nodes, 4].copy(),
        )
        return self.state

    def node_rows(self, atoms: Atoms | None, request: Request) -> np.ndarray:
        send = self.rows_of(atoms, self.root_nodes) if self.comm.is_root else None
        return self.comm.scatter_rows(send, self.node_counts, (request.row_width,), np.float64)

    def failure(self, request: Request) -> Failure | None:
        # the request, and its failure, are rank 0's
        return request.failure if self.comm.is_root else None

    def validate(self, atoms: Atoms | None, request: Request) -> None:
        """Nothing before the build: rank 0 validates the whole system as it plans."""

    def collect(self, partial: np.ndarray, owned: np.ndarray) -> tuple[Any, Any]:
        return self._collected(self.comm.gather_rows, partial, owned, self.gathered_row)

    def record_work(self, edges: np.ndarray) -> None:
        # rank 0 partitions every atom: every atom's weight there, in atom order
        every = self.comm.gather_rows(edges, self.state.counts[:, 1])
        if self.comm.is_root:
            self.work_cuts.record(in_order(every, self.gathered_row))

    def decomposition(self) -> DecompositionView | None:
        if self.state is None or self.owners is None:
            return None
        ghosts = {rank: Ghosts.of(rows) for rank, rows in enumerate(self.layouts)}
        return DecompositionView(self.owners, ghosts)
