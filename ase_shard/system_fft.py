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
its atoms touch. A rank holds, sends and receives only those planes (those of
its atoms' interpolation stencils), never the whole mesh, and the slabs are
cut along the axis where the ranks' planes overlap least: along the direction
in which the spatial partition cut the ranks' domains, most planes stay on
their rank.

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
    :meth:`inverse` for meshes of the same shape. Each call that moves data
    starts with the calculator's status vote (as
    :class:`ase_shard.system_sum.SystemSum` does), so that a rank whose model
    raised stops the others instead of leaving them waiting.
    """

    def __init__(self, comm: Comm):
        self.comm = comm

    def plan(self, shape: Sequence[int], touched: Sequence[torch.Tensor]) -> MeshSlabs:
        """Where the slabs are cut, from the planes every rank touches.

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
        axis = _slab_axis(every, shape, size)
        order = (axis, (axis + 1) % 3, (axis + 2) % 3)
        n0, n1, n2 = (int(shape[a]) for a in order)
        rows = _blocks(n1, size)
        start = int(rows[: self.comm.rank].sum())
        return MeshSlabs(
            order=order,
            shape=(n0, n1, n2),
            planes=np.flatnonzero(every[axis][self.comm.rank]),
            rows=slice(start, start + int(rows[self.comm.rank])),
            touched=every[axis],
        )

    def forward(self, slabs: MeshSlabs, partial: torch.Tensor) -> torch.Tensor:
        """This rank's slab of the transform of every rank's ``partial`` summed.

        ``partial`` is this rank's mesh on its planes, ``(len(slabs.planes), n1,
        n2)`` with the axes in ``slabs.order``. The result is ``(len(slabs.rows),
        n2 // 2 + 1, n0)`` (wave numbers along ``n1``, ``n2`` and ``n0``): the
        elements ``[k1, k2, k0]`` of ``torch.fft.rfftn`` of the summed mesh (axes
        in order) at ``k1`` in ``slabs.rows``. The transform's last pass runs
        along contiguous memory, and that layout is kept.
        """
        check_status(*self.comm.status(False), "during a mesh transform")
        rank, size = self.comm.rank, self.comm.size
        every = slabs.touched
        n0, n1, n2 = slabs.shape
        planes = _blocks(n0, size)
        starts = np.concatenate([[0], np.cumsum(planes)])
        mine = slice(starts[rank], starts[rank + 1])
        # each rank's planes in this rank's block, added in rank order
        received = self.comm.alltoallv_rows(
            partial.detach().to("cpu", torch.float64).numpy(),
            _per_block(every[rank], starts),
            every[:, mine].sum(axis=1),
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
        columns = self._planes_to_columns(half.numpy(), planes, _blocks(n1, size))
        spectrum = _unless_empty(
            lambda columns: torch.fft.fft(columns, dim=2), columns, columns.shape
        )
        return spectrum.to(partial.device)

    def inverse(self, slabs: MeshSlabs, spectrum: torch.Tensor) -> torch.Tensor:
        """This rank's planes of the real mesh whose spectrum the ranks' slabs hold.

        The inverse of :meth:`forward`'s transform (unnormalised,
        ``torch.fft.irfftn(whole, norm="forward")``, axes in ``slabs.order``),
        ``(len(slabs.planes), n1, n2)``. ``spectrum`` is this rank's slab,
        laid out as :meth:`forward` returned it.
        """
        check_status(*self.comm.status(False), "during a mesh transform")
        rank, size = self.comm.rank, self.comm.size
        every = slabs.touched
        n0, n1, n2 = slabs.shape
        planes = _blocks(n0, size)
        starts = np.concatenate([[0], np.cumsum(planes)])
        columns = _unless_empty(
            lambda spectrum: torch.fft.ifft(spectrum, dim=2, norm="forward"),
            spectrum.detach().cpu(),
            spectrum.shape,
        )
        half = self._columns_to_planes(columns.numpy(), _blocks(n1, size), planes)
        slab = _unless_empty(
            lambda half: torch.fft.irfftn(half, s=(n1, n2), dim=(1, 2), norm="forward"),
            torch.from_numpy(half),
            (half.shape[0], n1, n2),
            torch.float64,
        ).numpy()
        # each rank's planes of this rank's block go back to it
        mine = slice(starts[rank], starts[rank + 1])
        outgoing = np.concatenate([slab[every[receiver, mine]] for receiver in range(size)])
        received = self.comm.alltoallv_rows(
            outgoing, every[:, mine].sum(axis=1), _per_block(every[rank], starts)
        )
        return torch.from_numpy(received).to(spectrum.device)

    def _planes_to_columns(
        self, half: np.ndarray, planes: np.ndarray, rows: np.ndarray
    ) -> torch.Tensor:
        """The forward transpose: ``(planes[rank], n1, k)``, every wave number along
        ``n1`` of this rank's planes, to ``(rows[rank], k, n0)``, every plane of this
        rank's wave numbers (the planes last, contiguous, for the last transform)."""
        rank = self.comm.rank
        depth = half.shape[2]
        # what goes to rank s: its wave numbers of every plane held here
        outgoing = np.ascontiguousarray(half.transpose(1, 0, 2)).reshape(-1)
        incoming = planes * rows[rank] * depth
        received = self.comm.alltoallv_rows(outgoing, rows * planes[rank] * depth, incoming)
        columns = np.empty((rows[rank], depth, int(planes.sum())), dtype=half.dtype)
        parts = np.split(received, np.cumsum(incoming)[:-1])
        bounds = np.concatenate([[0], np.cumsum(planes)])
        for sender, part in enumerate(parts):
            shaped = part.reshape(rows[rank], planes[sender], depth)
            columns[:, :, bounds[sender] : bounds[sender + 1]] = shaped.transpose(0, 2, 1)
        return torch.from_numpy(columns)

    def _columns_to_planes(
        self, columns: np.ndarray, rows: np.ndarray, planes: np.ndarray
    ) -> np.ndarray:
        """The inverse transpose: ``(rows[rank], k, n0)`` to ``(planes[rank], n1, k)``."""
        rank = self.comm.rank
        depth = columns.shape[1]
        # what goes to rank s: its planes of this rank's wave numbers, planes first
        bounds = np.concatenate([[0], np.cumsum(planes)])
        outgoing = np.concatenate(
            [
                columns[:, :, bounds[s] : bounds[s + 1]].transpose(2, 0, 1).reshape(-1)
                for s in range(len(planes))
            ]
        )
        incoming = rows * planes[rank] * depth
        received = self.comm.alltoallv_rows(outgoing, planes * rows[rank] * depth, incoming)
        parts = np.split(received, np.cumsum(incoming)[:-1])
        shaped = [
            part.reshape(planes[rank], count, depth)
            for part, count in zip(parts, rows, strict=True)
        ]
        return np.concatenate(shaped, axis=1)


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
