"""The 3-D FFT of a mesh summed over every rank, split in slabs (``LocalGraph.system_fft``).

A PME sum spreads each rank's owned charges on a mesh of the whole cell; the
transform is of the ranks' sum. Adding the meshes on every rank and
transforming the whole on each (what ``system_sum`` would do) repeats the
largest work of the step on every rank, and the ranks' transforms then share
one memory bus. :class:`SystemFFT` splits it as a slab-decomposed FFT does
(LAMMPS's PPPM, FFTW's MPI transforms), with one change: the ranks' meshes are
not added before the first transforms but after them. The transform is
linear, so each rank transforms the planes its own atoms touch along the
second and third axes; one transpose (a personalised all-to-all) gives each
rank one slab of the second axis's wave numbers from every rank's planes,
which it adds up and transforms along the first axis. The inverse goes back
the same way: each rank gets its own planes' slab of every rank's wave
numbers and transforms them back. A rank holds, sends and receives only its
planes, never the whole mesh; no exchange of planes comes before or after the
transpose, and a plane several ranks touch is transformed by each of them (a
few planes at the domains' borders). The first axis is the one along which
the ranks touch fewest planes in all: the direction in which the spatial
partition cut the ranks' domains.

Transforms are unnormalised both ways (``numpy``'s ``norm="backward"``
forward, ``norm="forward"`` inverse), as torch-pme's ``KSpaceFilter`` is
used by :class:`ase_shard.models.Coulomb`. Everything here is a constant for
autograd.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from ase_shard.comm import Comm
from ase_shard.exchange import check_status
from ase_shard.graph import MeshSlabs


class SystemFFT:
    """``graph.system_fft``: the ranks' meshes summed and transformed, slab by slab.

    Collective: every rank calls :meth:`plan`, :meth:`forward` and then
    :meth:`inverse` for meshes of the same shape. Each exchange of data is
    preceded by the calculator's status vote (as in
    :class:`ase_shard.system_sum.SystemSum`), so that a rank whose model raised
    stops the others instead of leaving them waiting.
    """

    def __init__(self, comm: Comm):
        self.comm = comm

    def plan(self, shape: Sequence[int], touched: Sequence[torch.Tensor]) -> MeshSlabs:
        """Which planes each rank holds and which wave numbers, from the planes it touches.

        Parameters
        ----------
        shape : (n_x, n_y, n_z)
            The mesh's shape along the cell's vectors.
        touched : three bool tensors, ``(n_x,)``, ``(n_y,)`` and ``(n_z,)``
            The planes along each axis where this rank's mesh may be nonzero,
            and where :meth:`inverse` is to give it the potential.
        """
        check_status(*self.comm.status(False), "during a mesh transform")
        size = self.comm.size
        flags = torch.cat([mask.detach().cpu() for mask in touched]).numpy()
        every = self.comm.allgather_rows(flags.astype(np.uint8).reshape(1, -1), [1] * size)
        every = np.split(every.astype(bool), np.cumsum(shape)[:-1], axis=1)
        # the axis along which the ranks hold the fewest numbers in all
        points = int(np.prod(shape))
        held = [mask.sum() * (points // count) for mask, count in zip(every, shape, strict=True)]
        axis = int(np.argmin(held))
        order = (axis, (axis + 1) % 3, (axis + 2) % 3)
        n0, n1, n2 = (int(shape[a]) for a in order)
        rows = _row_starts(n1, size)
        return MeshSlabs(
            order=order,
            shape=(n0, n1, n2),
            planes=np.flatnonzero(every[axis][self.comm.rank]),
            rows=slice(int(rows[self.comm.rank]), int(rows[self.comm.rank + 1])),
            touched=every[axis],
        )

    def forward(self, slabs: MeshSlabs, partial: torch.Tensor) -> torch.Tensor:
        """This rank's slab of the transform of every rank's ``partial`` summed.

        ``partial`` is this rank's mesh on its planes, ``(len(slabs.planes), n1,
        n2)`` with the axes in ``slabs.order``. The result is ``(len(slabs.rows),
        n2 // 2 + 1, n0)`` (wave numbers along ``n1``, ``n2`` and ``n0``): the
        elements ``[k1, k2, k0]`` of ``torch.fft.rfftn`` of the summed mesh (axes
        in order) at ``k1`` in ``slabs.rows``. The last transform runs along
        contiguous memory, and that layout is kept.
        """
        rank = self.comm.rank
        n0, n1, n2 = slabs.shape
        depth = n2 // 2 + 1
        half = _unless_empty(  # (planes, n1, depth)
            lambda mesh: torch.fft.rfftn(mesh, dim=(1, 2)),
            partial.detach().to("cpu", torch.float64),
            (len(slabs.planes), n1, depth),
        )
        rows = _row_starts(n1, self.comm.size)
        mine = int(rows[rank + 1] - rows[rank])
        held = slabs.touched.sum(axis=1)
        # to each other rank its wave numbers along n1 of this rank's planes
        outgoing = torch.empty((len(slabs.planes) * (n1 - mine), depth), dtype=torch.complex128)
        at = 0
        for s in self._others():
            part = half[:, rows[s] : rows[s + 1]]
            outgoing[at : at + part.shape[0] * part.shape[1]].view(part.shape).copy_(part)
            at += part.shape[0] * part.shape[1]
        received = self._transpose(outgoing, np.diff(rows) * len(slabs.planes), held * mine)
        # (planes, k1, k2): every rank's planes of this rank's wave numbers, added up
        planes = torch.empty((n0, mine, depth), dtype=torch.complex128)
        for _, plane, count in _runs(np.flatnonzero(~slabs.touched[rank])):
            planes[plane : plane + count] = 0.0
        for first, plane, count in _runs(slabs.planes):
            planes[plane : plane + count] = half[first : first + count, slabs.rows]
        for sender, block in received:
            block = block.view(int(held[sender]), mine, depth)
            for first, plane, count in _runs(np.flatnonzero(slabs.touched[sender])):
                planes[plane : plane + count] += block[first : first + count]
        # the transform along the planes' axis, kept (k1, k2, k0) in memory: MKL's
        # out-of-place transform writes its axis innermost, so the permuted result is
        # contiguous as it is (contiguous() copies only under an FFT library that does not)
        spectrum = _unless_empty(
            lambda planes: torch.fft.fft(planes, dim=0).permute(1, 2, 0).contiguous(),
            planes,
            (mine, depth, n0),
        )
        return spectrum.to(partial.device)

    def inverse(self, slabs: MeshSlabs, spectrum: torch.Tensor) -> torch.Tensor:
        """This rank's planes of the real mesh whose spectrum the ranks' slabs hold.

        The inverse of :meth:`forward`'s transform (unnormalised,
        ``torch.fft.irfftn(whole, norm="forward")``, axes in ``slabs.order``),
        ``(len(slabs.planes), n1, n2)``. ``spectrum`` is this rank's slab,
        laid out as :meth:`forward` returned it.
        """
        rank = self.comm.rank
        n0, n1, n2 = slabs.shape
        depth = n2 // 2 + 1
        columns = _unless_empty(
            lambda spectrum: torch.fft.ifft(spectrum, dim=2, norm="forward"),
            spectrum.detach().cpu(),
            spectrum.shape,
        )
        rows = _row_starts(n1, self.comm.size)
        mine = int(rows[rank + 1] - rows[rank])
        held = slabs.touched.sum(axis=1)
        # to each other rank its planes of this rank's wave numbers, (k1, k2, planes)
        outgoing = torch.empty(
            ((held.sum() - len(slabs.planes)) * mine, depth), dtype=torch.complex128
        )
        at = 0
        for s in self._others():
            block = outgoing[at : at + held[s] * mine].view(mine, depth, int(held[s]))
            for first, plane, count in _runs(np.flatnonzero(slabs.touched[s])):
                block[:, :, first : first + count] = columns[:, :, plane : plane + count]
            at += held[s] * mine
        received = self._transpose(outgoing, held * mine, np.diff(rows) * len(slabs.planes))
        # (k1, k2, planes): this rank's planes of every rank's wave numbers, the planes
        # innermost as they arrive (the last transforms take any layout)
        half = torch.empty((n1, depth, len(slabs.planes)), dtype=torch.complex128)
        for first, plane, count in _runs(slabs.planes):
            half[slabs.rows, :, first : first + count] = columns[:, :, plane : plane + count]
        for sender, block in received:
            shape = (int(rows[sender + 1] - rows[sender]), depth, len(slabs.planes))
            half[rows[sender] : rows[sender + 1]] = block.view(shape)
        planes = _unless_empty(
            lambda half: torch.fft.irfftn(half, s=(n1, n2), dim=(1, 2), norm="forward"),
            half.permute(2, 0, 1),
            (len(slabs.planes), n1, n2),
            torch.float64,
        )
        return planes.to(spectrum.device)

    def _others(self) -> list[int]:
        """The other ranks, in rank order."""
        return [s for s in range(self.comm.size) if s != self.comm.rank]

    def _transpose(
        self, outgoing: torch.Tensor, counts_sent: np.ndarray, counts_received: np.ndarray
    ) -> list[tuple[int, torch.Tensor]]:
        """One personalised all-to-all between this rank and the others: ``outgoing`` holds
        rows of wave numbers along the mesh's last axis for each other rank in rank order,
        ``counts_*`` (one per rank, this rank's own ignored) how many rows go to and come
        from each. Returns ``(sender, rows)`` for each other rank."""
        rank = self.comm.rank
        sent, expected = counts_sent.copy(), counts_received.copy()
        sent[rank] = expected[rank] = 0
        # the vote comes just before the data moves: a rank that raised anywhere before
        # it (a transform out of memory) stops the others here
        check_status(*self.comm.status(False), "during a mesh transform")
        received = self.comm.alltoallv_rows(outgoing.numpy(), sent, expected)
        parts = np.split(received, np.cumsum(expected)[:-1])
        return [(s, torch.from_numpy(parts[s])) for s in self._others()]


def _row_starts(count: int, ranks: int) -> np.ndarray:
    """Where each rank's block of ``count`` wave numbers starts (``ranks + 1`` bounds):
    contiguous blocks, the first ones one larger."""
    sizes = np.full(ranks, count // ranks, dtype=np.int64) + (np.arange(ranks) < count % ranks)
    return np.concatenate([[0], np.cumsum(sizes)])


def _runs(planes: np.ndarray) -> list[tuple[int, int, int]]:
    """``(first, plane, count)`` for each run of consecutive indices in ``planes``
    (ascending): ``planes[first : first + count]`` are ``plane, plane + 1, ...``. A
    rank's planes are one or two runs (its domain, maybe wrapped around the cell), so
    copies run by run move whole blocks of memory."""
    breaks = np.flatnonzero(np.diff(planes) != 1) + 1
    starts = np.concatenate([[0], breaks]).astype(np.int64)
    stops = np.concatenate([breaks, [len(planes)]]).astype(np.int64)
    return [
        (int(start), int(planes[start]), int(stop - start))
        for start, stop in zip(starts, stops, strict=True)
        if stop > start
    ]


def _unless_empty(
    transform: Callable[[torch.Tensor], torch.Tensor],
    values: torch.Tensor,
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.complex128,
) -> torch.Tensor:
    """``transform(values)``, or an empty tensor of ``shape`` where a rank holds no
    planes or no wave numbers (an axis shorter than the rank count): the FFT
    libraries refuse empty transforms."""
    if values.numel() == 0:
        return torch.empty(shape, dtype=dtype)
    return transform(values)
