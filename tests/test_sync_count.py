"""Host syncs per MD step that reuses the layout: the block's one, none in the models.

On a GPU every operation listed in ``tests/sync_count.py`` stalls the host
until the device has caught up. A step that reuses the neighbour list has one
inherent sync, the edges within the cutoff (with their counts per hop level in
the same copy), plus the copy of the results at its end; the halo exchange's
host round trips are the exchange's own. These tests count the syncs on the
CPU: the counter itself, the block's two ways to find the kept edges, and EMT
and a message-passing toy model through the calculator (in one process, and
under mpirun with its halo exchanged between ranks) and through every rank's
block of a three-way split built in one process (full halo: ghosts, hop counts
and edges left out). The ML adapters' tests are in
``tests/test_sharded_<family>.py``.

Only the calculator's test depends on the rank count; the others are
``rank_independent`` (one process; deselected under mpirun).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sharded import thermalised_cu
from sync_count import (
    Autograd,
    assert_block_syncs_only,
    assert_split_equals_whole,
    count_syncs,
    reuse_step,
)
from toy_models import ToyMessagePassing

from ase_shard import ShardedCalculator
from ase_shard.block import hop_counts, kept_edges_on_device, kept_edges_on_host
from ase_shard.models import EMT

HERE = "tests/test_sync_count.py"


@pytest.mark.rank_independent
def test_the_counter_sees_each_kind_of_sync() -> None:
    x = torch.arange(10.0, device="cpu")  # a device tensor: made with an explicit device
    mask = x > 4.5
    with count_syncs() as syncs:
        x.nonzero()
        x[mask]
        x.clone()[mask] = 0.0
        torch.masked_select(x, mask)
        torch.bincount(x.long())
        torch.unique(x)
        x.long().repeat_interleave(x.long())
        x.sum().item()
        int(x[0])
        bool(mask.any())
        torch.equal(x, x)
        torch.nn.functional.one_hot(x.long())  # the class count read from the data
        x.tolist()
        x.cpu()
    assert [event.what for event in syncs.events] == [
        "aten.nonzero",
        "aten.index with a boolean index",
        "aten.index_put_ with a boolean index",
        "aten.masked_select",
        "aten.bincount",
        "aten._unique2",
        "aten.repeat_interleave without output_size",
        "aten._local_scalar_dense",
        "aten._local_scalar_dense",
        "aten._local_scalar_dense",
        "aten.equal",
        "aten._local_scalar_dense",  # one_hot's check of the minimum, a CPU's only
        "aten._local_scalar_dense",
        "Tensor.tolist",
        "Tensor.cpu",
    ]
    assert {event.where for event in syncs.events} == {
        f"{HERE}:test_the_counter_sees_each_kind_of_sync"
    }


@pytest.mark.rank_independent
def test_the_counter_sees_backward_and_late_uploads() -> None:
    x = torch.arange(6.0, device="cpu").requires_grad_()
    here = f"{HERE}:test_the_counter_sees_backward_and_late_uploads"
    with count_syncs() as syncs:
        torch.as_tensor(np.ones(3), device="cpu")  # nothing queued yet: free
        (grad,) = torch.autograd.grad(x[x > 2.5].sum(), x)  # ends with a sync
        torch.as_tensor(np.ones(3), device="cpu")  # free again
        grad = grad * 2.0
        torch.as_tensor(np.ones(3), device="cpu")  # after a queued kernel
    assert [(event.what, event.where) for event in syncs.events] == [
        ("aten.index with a boolean index", here),
        ("aten.index_put with a boolean index", "backward of IndexBackward0"),
        ("torch.as_tensor to the device", here),
    ]
    assert grad.tolist() == [0.0, 0.0, 0.0, 2.0, 2.0, 2.0]


@pytest.mark.rank_independent
def test_the_counter_lets_pass_what_does_not_sync() -> None:
    x = torch.arange(10.0, device="cpu")
    with count_syncs() as syncs:
        mask = x > 4.5
        torch.nonzero_static(mask, size=5)
        x.index_select(0, torch.arange(3, device="cpu"))
        x[torch.tensor([1, 2])]
        x[2:5].cumsum(0)
        x.long().repeat_interleave(x.long(), output_size=45)
        torch.nn.functional.one_hot(x.long(), 10)  # CUDA does not check the range
        torch.full((), 3, device="cpu")
        host = (x * 2).cpu()  # the one sync
        host.tolist()
        host.numpy()
        host[3].item()
        torch.as_tensor(np.ones(3), device="cpu")  # the copy above waited: nothing queued
        torch.as_tensor(np.ones(3)).tolist()  # host tensors
        torch.from_numpy(np.ones(3)).numpy()
    assert [event.what for event in syncs.events] == ["Tensor.cpu"]


@pytest.mark.rank_independent
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kept_edges_on_a_device_equal_those_on_the_host(seed: int) -> None:
    """The accelerator's way (counts first, one copy) finds the same edges and counts."""
    rng = np.random.default_rng(seed)
    keep = torch.as_tensor(rng.random(500) < 0.4, device="cpu")
    ends = np.sort(rng.choice(np.arange(1, 500), 3, replace=False)).tolist() + [500]
    with count_syncs() as syncs:
        within, kept = kept_edges_on_device(keep, torch.as_tensor(np.subtract(ends, 1)))
    assert [event.what for event in syncs.events] == ["Tensor.tolist"]
    expected_within, expected_kept = kept_edges_on_host(keep, np.asarray(ends))
    assert torch.equal(within, expected_within) and kept == expected_kept
    assert kept == [int(keep[:end].sum()) for end in ends]


@pytest.mark.rank_independent
def test_hop_counts() -> None:
    """A chain 0 <- 1 <- 2 <- 3 plus an isolated node 4; node 0 is owned."""
    centre = torch.tensor([0, 1, 2, 1, 2, 3])
    neighbour = torch.tensor([1, 2, 3, 0, 1, 2])
    assert hop_counts(centre, neighbour, 1, 5, depth=2).tolist() == [0, 1, 2, 3, 3]
    assert hop_counts(centre, neighbour, 1, 5, depth=3).tolist() == [0, 1, 2, 3, 4]
    # messages flow into the centre only: edges out of node 0 bring nothing in
    assert hop_counts(centre[3:], neighbour[3:], 1, 5, depth=3).tolist() == [0, 4, 4, 4, 4]


def _models() -> dict:
    # EMT through autograd: the path a device takes (see sync_count.Autograd)
    return {
        "emt": lambda: Autograd(EMT()),
        "toy": lambda: ToyMessagePassing(cutoff=3.0, num_layers=3),
    }


@pytest.mark.parametrize("halo", ["layer", "full"])
@pytest.mark.parametrize("name", ["emt", "toy"])
def test_one_sync_per_reuse_step(name: str, halo: str) -> None:
    """In one process, and on every rank under mpirun, where the counted step receives
    data from the other ranks."""
    atoms = thermalised_cu(3, 300.0, seed=4)
    atoms.calc = calc = ShardedCalculator(_models()[name](), halo=halo)
    syncs = reuse_step(atoms)
    assert_block_syncs_only(syncs, calc._block)
    assert (syncs.received_bytes > 0) == (calc.comm.size > 1)


@pytest.mark.rank_independent
@pytest.mark.parametrize("name", ["emt", "toy"])
def test_split_full_halo_blocks_sum_to_one_block(name: str) -> None:
    """Three ranks' full-halo blocks in one process add up to one rank's, with each
    layer restricted by hop count (no sync) or whole (as compiled, without hops)."""
    atoms = thermalised_cu(3, 300.0, seed=4)
    model = _models()[name]()
    assert_split_equals_whole(model, atoms, 1e-12)
