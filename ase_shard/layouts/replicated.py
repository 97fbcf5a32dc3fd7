"""SPMD: every rank holds the same ``Atoms`` and works on its own share of it.

No rank plans, reads or checks for another. At a rebuild each rank computes
the owners of all atoms by the same rule, finds its own ghosts and tells their
owners what it needs (:meth:`ase_shard.exchange.Halo.borders`); at every step
it reads its node rows from its own copy. Results: ghosts' sums go back to
their owners, then one allgather of the owned results leaves every rank with
the same results.

Each rank's copy must be the system every other rank holds: at every call
each rank sends the fingerprint of its whole copy in the step's vote
(:meth:`ReplicatedLayout.share`), and copies that differ are re-synchronised
from rank 0 when the difference is round-off, else every rank raises
(:meth:`ReplicatedLayout.settle`) before any result exists.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from ase import Atoms

from ase_shard.comm import Failure, reraise
from ase_shard.halo import local_rows
from ase_shard.layouts.base import (
    Decomposition,
    DecompositionView,
    Ghosts,
    Layout,
    Request,
    gathered_rows,
    in_order,
)
from ase_shard.system import (
    PER_ATOM_FIELDS,
    differing_fields,
    fingerprint,
    slice_bounds,
    validate_numbers,
    validate_positions,
)

# Å: ranks' copies of the positions and cell closer than this to rank 0's are
# re-synchronised from rank 0 (round-off); farther ones are an error
SYNC_TOLERANCE = 1e-10


def diverged(detail: str) -> ValueError:
    """The error every rank raises when the ranks' copies differ by more than round-off."""
    return ValueError(
        "ranks hold different Atoms than rank 0 (" + detail + "). Under mpirun every "
        "rank must build and move the same system: seed random numbers identically "
        "(e.g. Langevin(..., rng=np.random.default_rng(seed)))"
    )


class ReplicatedLayout(Layout):
    """Every rank holds the whole system (SPMD, or one rank)."""

    owners: np.ndarray | None = None  # the owner of every atom, at the build
    gathered_row: np.ndarray | None = None  # each atom's row in rank-ordered results

    def build(self, atoms: Atoms, request: Request) -> Decomposition:
        comm = self.comm

        def own_rows():
            coords, owners = self.partition(atoms, request)
            with self.timer.phase("halo"):
                rows = local_rows(
                    coords,
                    request.pbc,
                    owners,
                    comm.rank,
                    comm.size,
                    self.settings.halo_width,
                    self.settings.fold,
                )
            return owners, rows

        owners, rows = comm.agree(own_rows)
        with self.timer.phase("halo"):
            self.halo.borders(rows)
        self.owners, self.gathered_row = owners, gathered_rows(owners)
        self.state = Decomposition(
            n_atoms=request.n_atoms,
            cell=request.cell,
            rows=rows,
            numbers=atoms.numbers[rows.ids[: rows.n_nodes]],
        )
        return self.state

    def node_rows(self, atoms: Atoms, request: Request) -> np.ndarray:
        return self.rows_of(atoms, self.state.node_ids)

    def validate(self, atoms: Atoms, request: Request) -> None:
        # each rank checks one slice of every atom; the copies are compared whole
        span = slice_bounds(len(atoms), self.comm.size, self.comm.rank)
        validate_positions(atoms.positions[span], np.arange(span.start, span.stop))

    def share(self, atoms: Atoms, request: Request, inputs_digest: Any) -> Any:
        if self.comm.size == 1:
            return None
        return fingerprint(atoms), inputs_digest

    def settle(
        self, shares: list, request: Request, reason: str | None, copies: list[Atoms]
    ) -> str | None:
        """Every rank's fingerprint against rank 0's; then, at a rebuild, the elements.

        ``copies`` are this call's ``Atoms`` (the caller's and the calculator's),
        which a re-synchronisation updates.
        """
        if self.comm.size > 1 and self._compare(shares, request, copies):
            # the rows fetched and the reuse vote were of the unsynchronised copies
            reason = reason or "positions re-synchronised from rank 0"
        if reason is not None:
            # the copies agree: every rank finds the same elements, and the same error
            try:
                validate_numbers(copies[-1].numbers, self.settings.atomic_types)
            except ValueError as exc:
                raise reraise([Failure.of(exc, 0)]) from None
        return reason

    def _compare(self, shares: list, request: Request, copies: list[Atoms]) -> bool:
        """Whether the copies differed (and were re-synchronised; see :meth:`_resync`)."""
        reference = shares[0]
        differing = {
            rank: differing_fields(reference[0], share[0])
            + (["model inputs"] if share[1] != reference[1] else [])
            for rank, share in enumerate(shares)
            if share != reference
        }
        if differing:
            self._resync(differing, request, copies)
        return bool(differing)

    def _resync(
        self, differing: dict[int, list[str]], request: Request, copies: list[Atoms]
    ) -> None:
        """The ranks' copies differ (``differing``: fields by rank): re-synchronise, or raise.

        Copies that differ only in positions and cell, by at most
        :data:`SYNC_TOLERANCE` Å from rank 0's (round-off, e.g. an optimiser's
        random start on each rank), take rank 0's values, as GPAW does; any
        other difference raises the same ``ValueError`` on every rank, naming
        each differing rank's fields, how many atoms differ and the first of
        them, and by how much positions and cell differ (Å).
        """
        fields = set().union(*differing.values())
        if "number of atoms" in fields:  # nothing to compare atom by atom
            raise diverged("; ".join(f"rank {r}: {', '.join(f)}" for r, f in differing.items()))
        atoms = copies[-1]
        # rare, so pickled: rank 0's whole copy
        numbers, positions, cell = self.comm.bcast(
            (atoms.numbers, atoms.positions, atoms.cell.array) if self.comm.is_root else None
        )
        # bitwise, as the fingerprints compare (NaN differs from NaN)
        rows = np.flatnonzero(
            (atoms.numbers != numbers) | (atoms.positions != positions).any(axis=1)
        )
        # NaN-propagating maxima: a non-finite copy is never close
        moved = np.abs(atoms.positions - positions).max(initial=0.0)
        deviation = np.max([moved, np.abs(atoms.cell.array - cell).max()])
        views = self.comm.allgather((len(rows), int(rows[0]) if len(rows) else None, deviation))
        worst = float(np.max([view[2] for view in views]))
        if fields <= {"positions", "cell"} and worst <= SYNC_TOLERANCE:
            for copy in copies:
                copy.positions[:] = positions
                copy.cell.array[:] = cell
            request.cell = cell.copy()
            return
        details = []
        for rank, names in differing.items():
            count, first, _ = views[rank]
            # "numbers, positions of 2 atom(s) from atom 7, cell"
            last = max((i for i, n in enumerate(names) if n in PER_ATOM_FIELDS), default=None)
            if last is not None and count:
                names = [*names]
                names[last] += f" of {count} atom(s) from atom {first}"
            details.append(f"rank {rank}: {', '.join(names)}")
        if fields & {"positions", "cell"}:
            details.append(f"by up to {worst:.3g} Å")
        raise diverged("; ".join(details))

    def collect(self, partial: np.ndarray, owned: np.ndarray) -> tuple[Any, Any]:
        return self._collected(self.comm.allgather_rows, partial, owned, self.gathered_row)

    def record_work(self, edges: np.ndarray) -> None:
        # every rank partitions every atom: every atom's weight, in atom order
        every = self.comm.allgather_rows(edges, self.state.counts[:, 1])
        self.work_cuts.record(in_order(every, self.gathered_row))

    def decomposition(self) -> DecompositionView | None:
        if self.state is None or self.owners is None:
            return None
        return DecompositionView(self.owners, {self.comm.rank: Ghosts.of(self.state.rows)})
