"""The 3-D FFT of a mesh summed over every rank, split in slabs (``LocalGraph.system_fft``).

A PME sum spreads each rank's owned charges on a mesh of the whole cell; the
transform is of the ranks' sum. Adding the meshes on every rank and
transforming the whole on each (what ``system_sum`` would do) repeats the
largest work of the step on every rank, and the ranks' transforms then share
one memory bus. :class:`SystemFFT` splits it as a slab-decomposed FFT does
(LAMMPS's PPPM, FFTW's MPI transforms): each rank adds up one slab of planes
along the first axis, transforms it along the other two, and after a
transpose (one personalised all-to-all) along the first; it then holds the
spectrum of one slab of the second axis's wave numbers. The inverse goes back
the same way and ends with every rank holding the real mesh on the planes
its atoms touch. A rank sends and receives only those planes (those of its
atoms' interpolation stencils), and the slabs are cut along the axis where
the ranks' planes overlap least: along the direction in which the spatial
partition cut the ranks' domains, most planes stay on their rank.

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


class SystemFFT:
    """``graph.system_fft``: the ranks' meshes summed and transformed, slab by slab.

    Collective: every rank calls :meth:`forward` and then :meth:`inverse` with
    meshes of the same shape. Each call starts with the calculator's status
    vote (as :class:`ase_shard.system_sum.SystemSum` does), so that a rank
    whose model raised stops the others instead of leaving them waiting.
    """

    def __init__(self, comm: Comm):
        self.comm = comm
        # the last forward's axis order, and the planes each rank touches along its first
        self._order: tuple[int, int, int] = (0, 1, 2)
        self._touched: np.ndarray | None = None  # (ranks, planes)

    def forward(
        self, partial: torch.Tensor, touched: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, slice, tuple[int, int, int]]:
        """This rank's slab of the transform of every rank's ``partial`` summed.

        The slabs are cut along the axis where the ranks' planes overlap least
        (the ranks' domains' direction): the mesh is transformed with its axes
        in ``order``, that axis first.

        Parameters
        ----------
        partial : (n0, n1, n2) real tensor
            This rank's mesh, zero outside the planes ``touched``.
        touched : three bool tensors, (n0,), (n1,) and (n2,)
            The planes along each axis where this rank's mesh may be nonzero,
            and where :meth:`inverse` is to give it the potential.

        Returns
        -------
        spectrum : (len(rows), n[order[0]], n[order[2]] // 2 + 1) complex tensor
            ``torch.fft.rfftn(partial.permute(order))`` of the summed mesh at
            the wave numbers ``rows`` of its second axis, that axis first
            (the layout the transpose leaves, kept).
        rows : slice
            This rank's wave numbers along the second axis (indices).
        order : (int, int, int)
            The mesh's axes in the order transformed: a cyclic shift.
        """
        check_status(*self.comm.status(False), "during a mesh transform")
        rank, size = self.comm.rank, self.comm.size
        flags = torch.cat([mask.detach().cpu() for mask in touched]).numpy()
        every = self.comm.allgather_rows(flags.astype(np.uint8).reshape(1, -1), [1] * size)
        every = np.split(every.astype(bool), np.cumsum(partial.shape)[:-1], axis=1)
        axis = _slab_axis(every, partial.shape, size)
        self._order = order = (axis, (axis + 1) % 3, (axis + 2) % 3)
        self._touched = every = every[axis]
        mesh = partial.detach().to("cpu", torch.float64).permute(order).numpy()
        n0, n1, n2 = mesh.shape
        planes = _blocks(n0, size)
        starts = np.concatenate([[0], np.cumsum(planes)])
        mine = slice(starts[rank], starts[rank + 1])
        # each rank's touched planes in this rank's block, added in rank order
        received = self.comm.alltoallv_rows(
            mesh[every[rank]], _per_block(every[rank], starts), every[:, mine].sum(axis=1)
        )
        slab = np.zeros((planes[rank], n1, n2))
        first = 0
        for sender in range(size):
            at = np.flatnonzero(every[sender, mine])
            slab[at] += received[first : first + len(at)]
            first += len(at)
        half = _unless_empty(  # (mine, n1, n2 // 2 + 1)
            lambda slab: torch.fft.rfftn(slab, dim=(1, 2)),
            torch.from_numpy(slab),
            (planes[rank], n1, n2 // 2 + 1),
        )
        columns = self._transpose(half, planes, _blocks(n1, size))
        spectrum = _unless_empty(  # (rows, n0, n2 // 2 + 1)
            lambda columns: torch.fft.fft(columns, dim=1), columns, columns.shape
        )
        return spectrum.to(partial.device), self._rows(n1), order

    def inverse(self, spectrum: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The real mesh of ``shape`` from every rank's slab of its spectrum.

        The inverse of :meth:`forward`'s transform (unnormalised):
        ``torch.fft.irfftn(whole_spectrum, norm="forward")`` with the axes
        back in their order, on the planes this rank said it touched at
        :meth:`forward` along the slabs' axis, zero elsewhere. ``spectrum`` is
        this rank's slab, as :meth:`forward` returned it.
        """
        check_status(*self.comm.status(False), "during a mesh transform")
        order, every = self._order, self._touched
        n0, n1, n2 = (shape[axis] for axis in order)
        rank, size = self.comm.rank, self.comm.size
        planes, rows = _blocks(n0, size), _blocks(n1, size)
        starts = np.concatenate([[0], np.cumsum(planes)])
        columns = _unless_empty(
            lambda spectrum: torch.fft.ifft(spectrum, dim=1, norm="forward"),
            spectrum.detach().cpu(),
            spectrum.shape,
        )
        half = self._transpose(columns, rows, planes)  # (mine, n1, n2 // 2 + 1)
        slab = _unless_empty(
            lambda half: torch.fft.irfftn(half, s=(n1, n2), dim=(1, 2), norm="forward"),
            half,
            (half.shape[0], n1, n2),
            torch.float64,
        ).numpy()
        # each rank's touched planes of this rank's block go back to it
        mine = slice(starts[rank], starts[rank + 1])
        outgoing = np.concatenate([slab[every[receiver, mine]] for receiver in range(size)])
        received = self.comm.alltoallv_rows(
            outgoing, every[:, mine].sum(axis=1), _per_block(every[rank], starts)
        )
        mesh = np.zeros((n0, n1, n2))
        mesh[every[rank]] = received
        # axes back in the caller's order (a view)
        return torch.from_numpy(mesh).permute(np.argsort(order).tolist()).to(spectrum.device)

    def _transpose(
        self, block: torch.Tensor, held: np.ndarray, wanted: np.ndarray
    ) -> torch.Tensor:
        """From ``held[rank]`` rows of every column to every row of ``wanted[rank]`` columns.

        ``block`` is ``(held[rank], C, k)`` with ``C = sum(wanted)``; the result is
        ``(wanted[rank], R, k)``, ``R = sum(held)``, rows in rank order.
        """
        rank = self.comm.rank
        depth = block.shape[2]
        # what goes to rank s: the columns of its block, every held row (flattened)
        outgoing = block.permute(1, 0, 2).contiguous().numpy().reshape(-1)
        sent = wanted * held[rank] * depth
        received = self.comm.alltoallv_rows(outgoing, sent, held * wanted[rank] * depth)
        parts = np.split(received, np.cumsum(held * wanted[rank] * depth)[:-1])
        shaped = [
            part.reshape(wanted[rank], count, depth)
            for part, count in zip(parts, held, strict=True)
        ]
        return torch.from_numpy(np.concatenate(shaped, axis=1))

    def _rows(self, ny: int) -> slice:
        """This rank's wave numbers along the second axis."""
        blocks = _blocks(ny, self.comm.size)
        start = int(blocks[: self.comm.rank].sum())
        return slice(start, start + int(blocks[self.comm.rank]))


def _slab_axis(touched: list[np.ndarray], shape: Sequence[int], ranks: int) -> int:
    """The axis along which cutting the mesh into the ranks' slabs sends the fewest
    numbers: each rank's touched planes that fall in other ranks' slabs (the first of
    equals). ``touched[a]`` is ``(ranks, shape[a])``: which planes each rank touches."""
    points = int(np.prod(shape))
    sent = []
    for every, count in zip(touched, shape, strict=True):
        starts = np.concatenate([[0], np.cumsum(_blocks(count, ranks))])
        own = np.stack([_per_block(mask, starts)[rank] for rank, mask in enumerate(every)])
        sent.append((every.sum() - own.sum()) * (points // count))
    return int(np.argmin(sent))


def _per_block(mask: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """How many of ``mask``'s planes fall in each rank's block (``starts``: the blocks'
    bounds)."""
    before = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])
    return before[starts[1:]] - before[starts[:-1]]


def _blocks(count: int, ranks: int) -> np.ndarray:
    """``count`` planes in ``ranks`` contiguous blocks, the first ones one larger."""
    return np.full(ranks, count // ranks, dtype=np.int64) + (np.arange(ranks) < count % ranks)


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
