"""``SystemFFT``: the slab-split FFT of the ranks' summed meshes against ``torch.fft``.

Plain pytest runs one rank; ``mpirun -n P python -m pytest --with-mpi`` runs P (2, 3
and 4 in ``make test``). Every rank spreads its own random mesh; the oracle is
``torch.fft.rfftn`` of their sum in one process (the meshes are gathered to every rank
for it), and ``irfftn`` of the whole spectrum for the inverse.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sharded import COMM, identical_on_all_ranks

from ase_shard.system_fft import SystemFFT

# a power of two, odd and prime axes, and axes shorter than the rank count (some ranks
# then hold no planes or no wave numbers)
SHAPES = [(16, 8, 12), (7, 5, 9), (2, 3, 4)]


def _meshes(shape: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's random mesh and the sum of every rank's."""
    rng = np.random.default_rng(1234)
    every = rng.normal(size=(COMM.size, *shape))
    return torch.from_numpy(every[COMM.rank].copy()), torch.from_numpy(every.sum(axis=0))


@pytest.mark.parametrize("shape", SHAPES)
def test_forward_is_the_summed_meshes_transform(shape: tuple[int, int, int]) -> None:
    mine, summed = _meshes(shape)
    spectrum, rows = SystemFFT(COMM).forward(mine)
    whole = torch.fft.rfftn(summed).transpose(0, 1)
    assert spectrum.shape == whole[rows].shape
    np.testing.assert_allclose(spectrum.numpy(), whole[rows].numpy(), rtol=0, atol=1e-12)
    # the ranks' slabs tile the wave numbers of the second axis, in rank order
    starts = COMM.allgather((rows.start, rows.stop))
    assert [start for start, _ in starts] == [0] + [stop for _, stop in starts[:-1]]
    assert starts[-1][1] == shape[1]


@pytest.mark.parametrize("shape", SHAPES)
def test_inverse_gives_every_rank_the_whole_mesh(shape: tuple[int, int, int]) -> None:
    mine, summed = _meshes(shape)
    fft = SystemFFT(COMM)
    spectrum, rows = fft.forward(mine)
    # a function of |k|^2, as a reciprocal-space kernel is: then the filtered spectrum
    # keeps the symmetry of a real mesh's, which irfftn assumes
    squares = [torch.fft.fftfreq(n, dtype=torch.float64) ** 2 for n in shape[:2]]
    squares.append(torch.fft.rfftfreq(shape[2], dtype=torch.float64) ** 2)
    kernel = torch.exp(-(squares[1][:, None, None] + squares[0][:, None] + squares[2]))
    filtered = spectrum * kernel[rows]
    mesh = fft.inverse(filtered, summed.shape)
    whole = torch.fft.rfftn(summed).transpose(0, 1) * kernel
    expected = torch.fft.irfftn(whole.transpose(0, 1), s=shape, norm="forward")
    np.testing.assert_allclose(mesh.numpy(), expected.numpy(), rtol=0, atol=1e-10)
    assert identical_on_all_ranks(mesh.numpy())
