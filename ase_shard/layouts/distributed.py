"""Distributed atoms: each rank holds only the atoms it owns (ASAP3-style).

At a rebuild every rank computes the owners of its own atoms by a rule all
ranks share (cuts at summed histograms, :func:`ase_shard.partition.balanced_cuts`),
the atoms migrate to their owners with all their arrays (the halo's
``exchange``), each rank sends the images of its atoms that lie in another
rank's widened domain, and the requests of the folded ghost nodes go back to
their owners (``borders``). At every step a rank's owned rows are its own
atoms and the ghost nodes' rows come from their owners (``forward``); results
stay with the atoms that own them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ase_shard.distributed import GLOBAL_ID, DistributedAtoms
from ase_shard.halo import fold_rows, images_near_domains
from ase_shard.layouts.base import Decomposition, Layout, Request
from ase_shard.partition import (
    OverRanks,
    balanced_cuts,
    contiguous_owners,
    frame_box,
    frame_coordinates,
    grid_for_extent,
)
from ase_shard.system import checksum, validate_numbers, validate_positions


class DistributedLayout(Layout):
    """Each rank holds its own atoms (:class:`~ase_shard.distributed.DistributedAtoms`)."""

    def build(self, atoms: DistributedAtoms, request: Request) -> Decomposition:
        comm, settings = self.comm, self.settings
        with self.timer.phase("partition"):
            self.halo.exchange(atoms, self._owners(atoms, request))
            counts = comm.allgather(len(atoms))
            if sum(counts) != request.n_atoms:
                raise ValueError(
                    f"the ranks hold {sum(counts)} atoms between them, not the "
                    f"{request.n_atoms} that were distributed: atoms were added or deleted on "
                    "some rank (not supported on DistributedAtoms)"
                )
        with self.timer.phase("halo"):
            coords = frame_coordinates(atoms.positions, request.cell, request.pbc)
            boxes = np.array(comm.allgather(frame_box(coords.s)))
            dest, place, image_shift = images_near_domains(
                coords, request.pbc, boxes[:, 0], boxes[:, 1], comm.rank, settings.halo_width
            )
            # each image's atom, shift, place among its owner's atoms and element,
            # to the rank that needs it
            ids = atoms.arrays[GLOBAL_ID]
            described = np.column_stack([ids[place], image_shift, place, atoms.numbers[place]])
            send_counts = np.bincount(dest, minlength=comm.size).astype(np.int64)
            recv_counts = comm.alltoall_counts(send_counts)
            ghosts = comm.alltoallv_rows(described.astype(np.int64), send_counts, recv_counts)
            n_owned = len(atoms)
            rows = fold_rows(
                comm.rank,
                comm.size,
                np.concatenate([ids, ghosts[:, 0]]),
                np.concatenate([coords.wrap_shift, ghosts[:, 1:4]]),
                n_owned,
                np.concatenate(
                    [np.full(n_owned, comm.rank), np.repeat(np.arange(comm.size), recv_counts)]
                ),
                np.concatenate([np.arange(n_owned), ghosts[:, 4]]),
                settings.fold,
            )
            self.halo.borders(rows)
        # the ghost nodes' elements, by global id, from the rows that brought them
        by_id = np.argsort(ghosts[:, 0], kind="stable")
        ghost_ids = rows.ids[n_owned : rows.n_nodes]
        found = by_id[np.searchsorted(ghosts[by_id, 0], ghost_ids)]
        self.state = Decomposition(
            n_atoms=request.n_atoms,
            cell=request.cell,
            rows=rows,
            numbers=np.concatenate([atoms.numbers, ghosts[found, 5]]),
        )
        return self.state

    def _owners(self, atoms: DistributedAtoms, request: Request) -> np.ndarray:
        """New owner of each local atom: the same rule on every rank.

        ``spatial``: boxes cut at summed histograms (one allgather of the
        ranks' boxes; per cut axis, one allreduce of the histograms and one
        allgather of the atoms in the cuts' bins), balanced by count, or by
        work (``balance="work"``: the cuts are kept while they balance).
        ``contiguous``: blocks of global ids.
        """
        comm, settings = self.comm, self.settings
        if settings.partition == "contiguous":
            return contiguous_owners(request.n_atoms, comm.size)[atoms.arrays[GLOBAL_ID]]
        coords = frame_coordinates(atoms.positions, request.cell, request.pbc)
        boxes = np.array(comm.allgather(frame_box(coords.s)))
        lo, hi = boxes[:, 0].min(axis=0), boxes[:, 1].max(axis=0)
        span = np.where(np.isfinite(hi - lo), hi - lo, 0.0)
        grid = tuple(
            settings.grid
            or grid_for_extent(
                np.where(request.pbc, coords.spacing, span),
                request.pbc,
                comm.size,
                settings.halo_width,
            )
        )
        ids = atoms.arrays[GLOBAL_ID]
        over_ranks = OverRanks(
            sum=comm.allreduce_counts,
            concatenate=lambda rows: np.concatenate(comm.allgather(rows)),
        )
        if self.work_cuts is None:
            return balanced_cuts(coords.s, ids, lo, hi, grid, over_ranks).owners
        return self.work_cuts.owners(coords.s, ids, lo, hi, grid, over_ranks)

    def stale(self, atoms: DistributedAtoms) -> str | None:
        if len(atoms) != self.state.rows.n_owned:
            return "local atoms changed"
        return None

    def node_rows(self, atoms: DistributedAtoms, request: Request) -> np.ndarray:
        # the owned rows only: the ghosts' come once every rank agreed to reuse the plan
        return self.rows_of(atoms, slice(None))

    def with_ghosts(self, rows: np.ndarray) -> np.ndarray:
        with self.timer.phase("scatter"):
            return self.halo.forward(rows)

    def validate(self, atoms: DistributedAtoms, request: Request) -> None:
        validate_positions(atoms.positions, atoms.arrays[GLOBAL_ID])
        validate_numbers(atoms.numbers, self.settings.atomic_types)

    def share(self, atoms: DistributedAtoms, request: Request, inputs_digest: Any) -> Any:
        return request.n_atoms, checksum(request.cell), tuple(request.pbc.tolist())

    def settle(
        self, shares: list, request: Request, reason: str | None, copies: list
    ) -> str | None:
        if any(share != shares[0] for share in shares):
            raise ValueError(
                "the ranks' DistributedAtoms differ in their number of atoms, cell or pbc "
                f"(rank by rank: {shares}); change them on every rank"
            )
        return reason

    def record_work(self, edges: np.ndarray) -> None:
        # the owned atoms are the local atoms, in order, until the next rebuild
        self.work_cuts.record(edges)

    def collect(self, partial: np.ndarray, owned: np.ndarray) -> tuple[Any, Any]:
        # each rank keeps its own atoms' results, in its own order
        totals = self.comm.allgather_rows(partial, np.ones(self.comm.size, dtype=np.int64))
        return totals, owned
