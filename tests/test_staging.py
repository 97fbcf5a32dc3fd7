"""How halo rows reach MPI: reused staging buffers, ``alltoallv_rows(out=)``, CUDA-aware MPI.

The buffers' tests are ``rank_independent`` (one process); the exchanges' run in
one process and under mpirun, where they assert that rows came from the other
ranks. The pinned buffers need CUDA; everything else runs on the CPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sharded import COMM

from ase_shard.comm import CUDA_AWARE_MPI_VARIABLE, cuda_aware_mpi
from ase_shard.exchange import HaloExchange, StagingBuffers, choose_transport

CUDA = torch.cuda.is_available()


def byte_rows(n: int, width: int, seed: int, device: str = "cpu") -> torch.Tensor:
    """``(n, width)`` random bytes, as the exchange hands rows to the buffers."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, width), dtype=torch.uint8, generator=generator).to(device)


@pytest.mark.rank_independent
def test_send_buffer_is_reused_and_grows() -> None:
    staging = StagingBuffers(pin=False)
    first = byte_rows(4, 24, seed=1)
    assert torch.equal(staging.to_host(first), first)
    buffer = staging.send.data_ptr()
    smaller = byte_rows(2, 16, seed=2)
    assert torch.equal(staging.to_host(smaller), smaller)
    assert staging.send.data_ptr() == buffer
    larger = byte_rows(9, 24, seed=3)
    assert torch.equal(staging.to_host(larger), larger)
    assert staging.send.numel() >= larger.numel()
    grown = staging.send.data_ptr()
    staging.to_host(first)
    assert staging.send.data_ptr() == grown  # never shrinks back


@pytest.mark.rank_independent
def test_receive_buffer_is_reused_and_grows() -> None:
    staging = StagingBuffers(pin=False)
    view = staging.receive((5, 8))
    assert view.shape == (5, 8) and view.dtype == torch.uint8 and view.is_contiguous()
    buffer = staging.recv.data_ptr()
    assert view.data_ptr() == buffer
    assert staging.receive((3, 8)).data_ptr() == buffer
    assert staging.receive((10, 8)).shape == (10, 8)
    assert staging.recv.numel() >= 80
    grown = staging.recv.data_ptr()
    assert staging.receive((5, 8)).data_ptr() == grown


def overlaps(tensor: torch.Tensor, buffer: torch.Tensor) -> bool:
    """Whether ``tensor``'s bytes lie (partly) in ``buffer``'s."""
    start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes
    return start < buffer.data_ptr() + buffer.nbytes and buffer.data_ptr() < end


@pytest.mark.rank_independent
def test_device_copies_do_not_share_the_receive_buffer() -> None:
    """A result the caller holds is not changed by the next exchange's receive."""
    staging = StagingBuffers(pin=False)
    results = []
    for seed in (1, 2):
        rows = byte_rows(6, 8, seed)
        view = staging.receive(tuple(rows.shape))
        view.copy_(rows)  # what MPI would write
        results.append((staging.to_device(view, torch.device("cpu")), rows))
    for held, rows in results:
        assert torch.equal(held, rows)
        assert not overlaps(held, staging.recv)


@pytest.mark.rank_independent
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_pinned_buffers_on_cuda() -> None:
    """Page-locked, reused, and not overwritten while a copy out of them may still run."""
    staging = StagingBuffers(pin=True)
    rows = byte_rows(64, 256, seed=1, device="cuda")
    host = staging.to_host(rows)
    assert staging.send.is_pinned()
    assert torch.equal(host, rows.cpu())  # complete on return: MPI reads it next
    buffer = staging.send.data_ptr()
    staging.to_host(rows[:10])
    assert staging.send.data_ptr() == buffer
    expected = byte_rows(64, 256, seed=2)
    view = staging.receive(tuple(expected.shape))
    assert staging.recv.is_pinned()
    view.copy_(expected)  # what MPI would write
    on_device = staging.to_device(view, rows.device)
    assert on_device.is_cuda
    again = staging.receive(tuple(expected.shape))  # the next exchange, at once
    assert again.data_ptr() == view.data_ptr()
    again.fill_(0)
    assert torch.equal(on_device.cpu(), expected)


def sent_rows(rank: int) -> np.ndarray:
    """What ``rank`` sends: two rows of three to every rank, in rank order, marked by ``rank``."""
    return np.arange(COMM.size * 2 * 3, dtype=np.float64).reshape(-1, 3) + 100 * rank


def test_alltoallv_rows_into_out() -> None:
    """A new array and ``out`` (numpy or torch, then returned) both receive, from every
    rank, the two rows it sent here; under mpirun they come from the other ranks."""
    rows, counts = sent_rows(COMM.rank), np.full(COMM.size, 2)
    here = slice(2 * COMM.rank, 2 * COMM.rank + 2)
    expected = np.concatenate([sent_rows(rank)[here] for rank in range(COMM.size)])
    received = COMM.received_bytes
    np.testing.assert_array_equal(COMM.alltoallv_rows(rows, counts, counts), expected)
    out = np.empty_like(expected)
    assert COMM.alltoallv_rows(rows, counts, counts, out=out) is out
    np.testing.assert_array_equal(out, expected)
    tensor_out = torch.empty(expected.shape, dtype=torch.float64)
    got = COMM.alltoallv_rows(torch.from_numpy(rows), counts, counts, out=tensor_out)
    assert got is tensor_out
    np.testing.assert_array_equal(tensor_out.numpy(), expected)
    from_others = 3 * 2 * 3 * 8 * (COMM.size - 1)  # three calls, two rows of three float64
    assert COMM.received_bytes - received == from_others


@pytest.mark.parametrize(
    "out",
    [
        np.empty((1, 3)),  # too few rows
        np.empty((2, 4)),  # rows of another shape
        np.empty((2, 3), dtype=np.float32),
        np.empty((3, 2)).T,  # not C-contiguous
    ],
    ids=["rows", "row-shape", "dtype", "layout"],
)
def test_alltoallv_rows_rejects_a_wrong_out(out: np.ndarray) -> None:
    """Checked before any MPI call, so every rank raises and none waits."""
    rows = np.zeros((2, 3))
    counts = np.zeros(COMM.size, dtype=np.int64)
    counts[COMM.rank] = 2
    with pytest.raises(ValueError, match="alltoallv_rows: out must be a C-contiguous"):
        COMM.alltoallv_rows(rows, counts, counts, out=out)


def test_cuda_aware_mpi_setting(monkeypatch) -> None:
    monkeypatch.setenv(CUDA_AWARE_MPI_VARIABLE, "1")
    assert cuda_aware_mpi()
    assert choose_transport(torch.device("cuda")) == "device"
    monkeypatch.setenv(CUDA_AWARE_MPI_VARIABLE, "0")
    assert not cuda_aware_mpi()
    assert choose_transport(torch.device("cuda")) == "pinned"
    monkeypatch.setenv(CUDA_AWARE_MPI_VARIABLE, "yes")
    with pytest.raises(ValueError, match="must be 0 or 1"):
        cuda_aware_mpi()
    monkeypatch.delenv(CUDA_AWARE_MPI_VARIABLE)
    assert isinstance(cuda_aware_mpi(), bool)  # what the MPI library says


def test_transport_by_device() -> None:
    assert choose_transport(torch.device("cpu")) == "host"
    assert choose_transport(torch.device("xpu")) == "pageable"
    assert choose_transport(torch.device("cuda")) == ("device" if cuda_aware_mpi() else "pinned")
    nothing, counts = np.zeros(0, dtype=np.int64), np.zeros(COMM.size, dtype=np.int64)
    exchange = HaloExchange(COMM, 0, nothing, counts, counts, "cpu")
    assert exchange.transport == "host" and not exchange.staging.pin
    with pytest.raises(ValueError, match="transport must be one of"):
        HaloExchange(COMM, 0, nothing, counts, counts, "cpu", transport="gpu")


@pytest.mark.parametrize("transport", ["host", "pageable"])
def test_exchanges_reuse_one_buffer(transport: str) -> None:
    """Every rank sends its first two nodes to every other rank: one receive buffer throughout."""
    others = [rank for rank in range(COMM.size) if rank != COMM.rank]
    counts = np.array([0 if rank == COMM.rank else 2 for rank in range(COMM.size)])
    send_index = np.tile([0, 1], len(others))
    exchange = HaloExchange(COMM, 3, send_index, counts, counts, "cpu", transport=transport)
    buffers = set()
    received = COMM.received_bytes
    for seed in range(3):
        features = torch.rand((3, 5), generator=torch.Generator().manual_seed(seed))
        exchange.new_evaluation(torch.float32)
        with torch.no_grad():
            out = exchange(features + COMM.rank)
        everyone = COMM.allgather(features.numpy() + np.float32(COMM.rank))
        expected = np.concatenate([everyone[COMM.rank]] + [everyone[r][:2] for r in others])
        np.testing.assert_array_equal(out.numpy(), expected)
        assert not overlaps(out, exchange.staging.recv)
        buffers.add(exchange.staging.recv.data_ptr())
    assert len(buffers) == 1
    assert COMM.received_bytes - received == 3 * len(others) * 2 * 5 * 4  # rows of 5 float32
