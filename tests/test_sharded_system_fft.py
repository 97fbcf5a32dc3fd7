"""``SystemFFT``: the slab-split FFT of the ranks' summed meshes against ``torch.fft``.

Plain pytest runs one rank; ``mpirun -n P python -m pytest --with-mpi`` runs P (2, 3
and 4 in ``make test``). Every rank has its own random mesh, nonzero on every plane of
the first axis or on a random few of them (the planes its atoms would touch), and
gives the transform only those planes; the oracle is ``torch.fft.rfftn`` of their
sum in one process (every rank draws every rank's mesh from one seed), and
``irfftn`` of the whole spectrum for the inverse, on the rank's planes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sharded import COMM

from ase_shard.system_fft import SystemFFT

# a power of two, odd and prime axes, and axes shorter than the rank count (some ranks
# then hold no planes or no wave numbers)
SHAPES = [(16, 8, 12), (7, 5, 9), (2, 3, 4)]


def _meshes(
    shape: tuple[int, int, int], some: str
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """This rank's random mesh, its touched planes per axis and the sum of every rank's.

    ``some``: every plane touched (``"all"``), a random few along each axis
    (``"random"``), or each rank one block of the third axis's planes (``"domains"``,
    as a partition cut along that axis leaves them: the slabs are then cut there).
    """
    rng = np.random.default_rng(1234)
    every = rng.normal(size=(COMM.size, *shape))
    touched = [rng.random((COMM.size, n)) < (0.6 if some == "random" else 2.0) for n in shape]
    if some == "domains":
        block = np.arange(shape[2]) * COMM.size // shape[2]
        touched[2] = block[None, :] == np.arange(COMM.size)[:, None]
    every *= touched[0][:, :, None, None] * touched[1][:, None, :, None]
    every *= touched[2][:, None, None, :]
    mine = torch.from_numpy(every[COMM.rank].copy())
    masks = [torch.from_numpy(mask[COMM.rank].copy()) for mask in touched]
    return mine, masks, torch.from_numpy(every.sum(0))


def _kernel(shape: tuple[int, ...]) -> torch.Tensor:
    """A function of |k|^2 on the (n1, n2 // 2 + 1, n0) spectrum slab layout of an (n0,
    n1, n2) mesh, as a reciprocal-space kernel is: the filtered spectrum then keeps the
    symmetry of a real mesh's, which irfftn assumes."""
    squares = [torch.fft.fftfreq(n, dtype=torch.float64) ** 2 for n in shape[:2]]
    squares.append(torch.fft.rfftfreq(shape[2], dtype=torch.float64) ** 2)
    return torch.exp(-(squares[1][:, None, None] + squares[2][:, None] + squares[0]))


def _whole(summed: torch.Tensor, order: tuple[int, int, int]) -> torch.Tensor:
    """The oracle's spectrum of the summed mesh, axes in ``order``, laid out as the
    slabs are: (k1, k2, k0)."""
    return torch.fft.rfftn(summed.permute(order)).permute(1, 2, 0)


TOUCHED = ["all", "random", "domains"]


@pytest.mark.parametrize("some", TOUCHED)
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_is_the_summed_meshes_transform(shape: tuple[int, int, int], some: str) -> None:
    mine, touched, summed = _meshes(shape, some)
    fft = SystemFFT(COMM)
    slabs = fft.plan(shape, touched)
    order = slabs.order
    # only this rank's planes are given; every collective before any assertion, so
    # that a rank that fails one leaves no other waiting
    spectrum = fft.forward(slabs, mine.permute(order)[slabs.planes].contiguous())
    starts = COMM.allgather((slabs.rows.start, slabs.rows.stop))
    if some == "domains" and COMM.size > 1:
        assert order == (2, 0, 1)  # the slabs follow the ranks' domains
    assert slabs.shape == tuple(shape[axis] for axis in order)
    np.testing.assert_array_equal(slabs.planes, np.flatnonzero(touched[order[0]].numpy()))
    whole = _whole(summed, order)
    assert spectrum.shape == whole[slabs.rows].shape
    np.testing.assert_allclose(spectrum.numpy(), whole[slabs.rows].numpy(), rtol=0, atol=1e-12)
    # the ranks' slabs tile the wave numbers of the second axis, in rank order
    assert [start for start, _ in starts] == [0] + [stop for _, stop in starts[:-1]]
    assert starts[-1][1] == shape[order[1]]


@pytest.mark.parametrize("some", TOUCHED)
@pytest.mark.parametrize("shape", SHAPES)
def test_inverse_gives_each_rank_its_planes(shape: tuple[int, int, int], some: str) -> None:
    mine, touched, summed = _meshes(shape, some)
    fft = SystemFFT(COMM)
    slabs = fft.plan(shape, touched)
    order, rows = slabs.order, slabs.rows
    spectrum = fft.forward(slabs, mine.permute(order)[slabs.planes].contiguous())
    kernel = _kernel(slabs.shape)
    planes = fft.inverse(slabs, spectrum * kernel[rows])
    every = COMM.allgather((planes.numpy(), slabs.planes))
    filtered = (_whole(summed, order) * kernel).permute(2, 0, 1)
    expected = torch.fft.irfftn(filtered, s=slabs.shape, norm="forward")[slabs.planes]
    assert planes.shape == (len(slabs.planes), *slabs.shape[1:])
    np.testing.assert_allclose(planes.numpy(), expected.numpy(), rtol=0, atol=1e-10)
    # a plane that several ranks touch holds the same bits on each (its owner's)
    for plane in range(slabs.shape[0]):
        held = [values[list(at).index(plane)] for values, at in every if plane in at]
        assert all(np.array_equal(values, held[0]) for values in held)
