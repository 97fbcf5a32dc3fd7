"""``SystemFFT``: the slab-split FFT of the ranks' summed meshes against ``torch.fft``.

Plain pytest runs one rank; ``mpirun -n P python -m pytest --with-mpi`` runs P (2, 3
and 4 in ``make test``). Every rank has its own random mesh, nonzero on every plane of
the first axis or on a random few of them (the planes its atoms would touch); the
oracle is ``torch.fft.rfftn`` of their sum in one process (every rank draws every
rank's mesh from one seed), and ``irfftn`` of the whole spectrum for the inverse, on
the rank's planes.
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
    shape: tuple[int, int, int], some: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's random mesh, its touched planes and the sum of every rank's mesh."""
    rng = np.random.default_rng(1234)
    every = rng.normal(size=(COMM.size, *shape))
    touched = rng.random((COMM.size, shape[0])) < (0.4 if some else 2.0)
    every *= touched[:, :, None, None]
    mine = torch.from_numpy(every[COMM.rank].copy())
    return mine, torch.from_numpy(touched[COMM.rank].copy()), torch.from_numpy(every.sum(0))


@pytest.mark.parametrize("some", [False, True], ids=["all planes", "some planes"])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_is_the_summed_meshes_transform(shape: tuple[int, int, int], some: bool) -> None:
    mine, touched, summed = _meshes(shape, some)
    spectrum, rows = SystemFFT(COMM).forward(mine, touched)
    whole = torch.fft.rfftn(summed).transpose(0, 1)
    assert spectrum.shape == whole[rows].shape
    np.testing.assert_allclose(spectrum.numpy(), whole[rows].numpy(), rtol=0, atol=1e-12)
    # the ranks' slabs tile the wave numbers of the second axis, in rank order
    starts = COMM.allgather((rows.start, rows.stop))
    assert [start for start, _ in starts] == [0] + [stop for _, stop in starts[:-1]]
    assert starts[-1][1] == shape[1]


@pytest.mark.parametrize("some", [False, True], ids=["all planes", "some planes"])
@pytest.mark.parametrize("shape", SHAPES)
def test_inverse_gives_each_rank_its_planes(shape: tuple[int, int, int], some: bool) -> None:
    mine, touched, summed = _meshes(shape, some)
    fft = SystemFFT(COMM)
    spectrum, rows = fft.forward(mine, touched)
    # a function of |k|^2, as a reciprocal-space kernel is: then the filtered spectrum
    # keeps the symmetry of a real mesh's, which irfftn assumes
    squares = [torch.fft.fftfreq(n, dtype=torch.float64) ** 2 for n in shape[:2]]
    squares.append(torch.fft.rfftfreq(shape[2], dtype=torch.float64) ** 2)
    kernel = torch.exp(-(squares[1][:, None, None] + squares[0][:, None] + squares[2]))
    mesh = fft.inverse(spectrum * kernel[rows], summed.shape)
    whole = torch.fft.rfftn(summed).transpose(0, 1) * kernel
    expected = torch.fft.irfftn(whole.transpose(0, 1), s=shape, norm="forward")
    expected[~touched] = 0.0
    np.testing.assert_allclose(mesh.numpy(), expected.numpy(), rtol=0, atol=1e-10)
    # a plane that several ranks touch holds the same bits on each (its owner's)
    every = COMM.allgather((mesh.numpy(), touched.numpy()))
    for plane in range(shape[0]):
        held = [values[plane] for values, mask in every if mask[plane]]
        assert all(np.array_equal(values, held[0]) for values in held)
