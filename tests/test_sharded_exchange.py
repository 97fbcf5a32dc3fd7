"""The per-layer halo exchange: the operation itself and the calculator's use of it.

Runs at any rank count (plain pytest: one rank; ``make test``: 2, 3 and 4).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase import Atoms
from oracles import evaluate_periodic_graph, relative_errors
from sharded import COMM, assert_identical_on_all_ranks, random_gas, results
from toy_models import ToyMessagePassing

from ase_shard import ShardedCalculator
from ase_shard.comm import cuda_aware_mpi
from ase_shard.exchange import HaloExchange

RTOL = 1e-10

CUDA = torch.cuda.is_available()
# (transport, device): every way rows can reach MPI that this machine has; on the CPU,
# "pageable" runs the staging copies and "device" hands tensors to MPI through DLPack
TRANSPORTS = [
    ("host", "cpu"),
    ("pageable", "cpu"),
    ("device", "cpu"),
    pytest.param("pinned", "cuda", marks=pytest.mark.skipif(not CUDA, reason="needs CUDA")),
    pytest.param(
        "device",
        "cuda",
        marks=pytest.mark.skipif(
            not (CUDA and cuda_aware_mpi()), reason="needs CUDA and CUDA-aware MPI"
        ),
    ),
]


def random_plan(seed: int = 3):
    """A random exchange pattern known to every rank (same seed everywhere).

    Rank 1 owns nothing; every rank takes ghosts from every other rank's owned
    nodes, some of them more than once.

    Returns ``(owned_counts, ghost_sources)``: ``ghost_sources[r]`` lists rank
    ``r``'s ghost nodes as ``(owner, index among the owner's nodes)`` grouped by owner.
    """
    rng = np.random.default_rng(seed)
    size = COMM.size
    owned = [0 if rank == 1 else int(rng.integers(2, 7)) for rank in range(size)]
    sources = []
    for rank in range(size):
        ghosts = [
            (owner, int(index))
            for owner in range(size)
            if owner != rank and owned[owner]
            for index in rng.integers(0, owned[owner], int(rng.integers(1, 5)))
        ]
        sources.append(ghosts)
    return owned, sources


def exchange_for(
    rank: int, owned: list[int], sources: list, transport: str = "host", device: str = "cpu"
) -> HaloExchange:
    size = COMM.size
    send_index, send_counts = [], np.zeros(size, dtype=np.int64)
    for receiver in range(size):
        indices = [index for owner, index in sources[receiver] if owner == rank]
        send_index += indices
        send_counts[receiver] = len(indices)
    recv_counts = np.bincount([owner for owner, _ in sources[rank]], minlength=size)
    send_index = np.array(send_index, dtype=np.int64)
    return HaloExchange(
        COMM, owned[rank], send_index, send_counts, recv_counts, device, transport=transport
    )


def all_features(owned: list[int], shape: tuple, dtype, seed: int = 5) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.rand((n, *shape), generator=generator, dtype=torch.float64) * 100).to(dtype)
        for n in owned
    ]


def expected_features(features: list[torch.Tensor], sources: list) -> torch.Tensor:
    """This rank's owned features, then its ghosts' copied from their owners."""
    mine = features[COMM.rank]
    ghosts = [features[owner][index] for owner, index in sources[COMM.rank]]
    return torch.cat([mine, torch.stack(ghosts) if ghosts else mine[:0]])


@pytest.mark.parametrize(("transport", "device"), TRANSPORTS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.int64, torch.bfloat16])
def test_forward_copies_owner_features(dtype, transport: str, device: str) -> None:
    owned, sources = random_plan()
    exchange = exchange_for(COMM.rank, owned, sources, transport, device)
    features = all_features(owned, (2, 3), dtype)
    exchange.new_evaluation(torch.float64)
    with torch.no_grad():
        got = exchange(features[COMM.rank].to(device))
    assert got.device.type == device
    got = got.cpu()
    assert got.dtype == dtype and got.shape == (owned[COMM.rank] + len(sources[COMM.rank]), 2, 3)
    assert torch.equal(got, expected_features(features, sources))


@pytest.mark.parametrize(("transport", "device"), TRANSPORTS)
def test_adjoint(transport: str, device: str) -> None:
    """<y, A x> = <A^T y, x> summed over ranks, with A^T from autograd."""
    owned, sources = random_plan(seed=11)
    exchange = exchange_for(COMM.rank, owned, sources, transport, device)
    x = all_features(owned, (4,), torch.float64, seed=1)[COMM.rank].to(device).requires_grad_()
    n_nodes = owned[COMM.rank] + len(sources[COMM.rank])
    y = torch.rand(
        (n_nodes, 4), dtype=torch.float64, generator=torch.Generator().manual_seed(COMM.rank)
    ).to(device)
    token = exchange.new_evaluation(torch.float64)
    ax = exchange(x)
    (aty,) = torch.autograd.grad((ax * y).sum(), x)
    local = np.array([float((ax.detach() * y).sum()), float((aty * x.detach()).sum())])
    totals = np.sum(COMM.allgather(local), axis=0)
    assert totals[0] == pytest.approx(totals[1], rel=1e-13)
    assert token.grad is None


@pytest.mark.parametrize(("transport", "device"), TRANSPORTS)
def test_results_outlive_the_next_exchange(transport: str, device: str) -> None:
    """What exchanges return, forward and backward, stays as it was through the next ones.

    The exchanges reuse their buffers, so a result that shared memory with one
    would be overwritten by the next exchange while the model, or autograd,
    still holds it.
    """
    owned, sources = random_plan(seed=7)
    exchange = exchange_for(COMM.rank, owned, sources, transport, device)
    held, copies = [], []
    for seed in (1, 2):
        features = all_features(owned, (3,), torch.float64, seed=seed)
        x = features[COMM.rank].to(device).requires_grad_()
        exchange.new_evaluation(torch.float64)
        out = exchange(x)
        assert torch.equal(out.detach().cpu(), expected_features(features, sources))
        generator = torch.Generator().manual_seed(10 * seed + COMM.rank)
        weight = torch.rand(out.shape, dtype=out.dtype, generator=generator).to(device)
        (grad,) = torch.autograd.grad((out * weight).sum(), x)
        held += [out, grad]
        copies += [out.detach().clone(), grad.clone()]
    for value, copy in zip(held, copies, strict=True):
        assert torch.equal(value.detach(), copy)


@pytest.mark.parametrize("partition", ["spatial", "contiguous"])
@pytest.mark.parametrize(
    "pbc", [(True, True, True), (True, True, False), (False, False, False)], ids=str
)
def test_layer_halo_equals_full_halo(pbc, partition: str) -> None:
    """Both halos give the one-graph periodic evaluation; the layer halo with fewer nodes."""
    atoms = random_gas(pbc)
    model = ToyMessagePassing(num_layers=3)
    oracle = evaluate_periodic_graph(model, atoms)
    nodes = {}
    for halo in ("layer", "full"):
        calc = ShardedCalculator(model, partition=partition, halo=halo)
        atoms.calc = calc
        got = results(atoms)
        errors = relative_errors(got, {key: oracle[key] for key in got})
        assert all(err <= RTOL for err in errors.values()), (halo, errors)
        assert_identical_on_all_ranks(got)
        nodes[halo] = sum(nodes for _, _, nodes in calc.layout_counts)
    assert nodes["layer"] <= nodes["full"]


def test_one_layer_models_see_each_foreign_atom_once() -> None:
    """A one-layer model's ghost is an atom, whatever images of it its edges reach.

    In a 10 Å box a 6 Å halo reaches several images of some foreign atoms: a
    one-layer model folds them onto one ghost node (edges carry the shifts),
    a deeper one with the full halo keeps one node per image (their
    neighbourhoods differ at the halo's edge). Both equal the periodic graph.
    """
    atoms = random_gas((True, True, True))
    for layers in (1, 2):
        model = ToyMessagePassing(num_layers=layers)
        calc = ShardedCalculator(model, halo="full")
        atoms.calc = calc
        errors = relative_errors(results(atoms), evaluate_periodic_graph(model, atoms))
        assert all(err <= RTOL for err in errors.values()), (layers, errors)
        # the ghost rows start with the ghost nodes, then the images folded onto nodes
        ((ids, _),) = calc.decomposition["ghosts"].values()
        _, owned, nodes = calc.layout_counts[COMM.rank]
        ids = ids[: nodes - owned]
        repeats = COMM.allgather(len(ids) - len(np.unique(ids)))
        if layers == 1:
            assert repeats == [0] * COMM.size
        elif COMM.size > 1:
            assert sum(repeats) > 0  # the case above is not vacuous


class FailsOnLastRank(ToyMessagePassing):
    """Raises inside its second layer, on the last rank only, while ``armed``."""

    armed = True

    def forward(self, graph):
        if self.armed and COMM.rank == COMM.size - 1 and graph.exchange is not None:
            original = graph.exchange

            def exchange(features):
                graph.exchange = original
                raise KeyError("layer 2 failed here")

            graph.exchange = exchange
        return super().forward(graph)


def test_failure_between_layers_raises_everywhere() -> None:
    """One rank fails mid-forward: every rank raises, none waits in an exchange."""
    atoms = random_gas((True, True, True))
    model = FailsOnLastRank(num_layers=3)
    atoms.calc = ShardedCalculator(model, halo="layer")
    with pytest.raises(KeyError, match=f"rank {COMM.size - 1}"):
        atoms.get_potential_energy()
    model.armed = False
    oracle = evaluate_periodic_graph(model, atoms)
    errors = relative_errors({"forces": atoms.get_forces()}, {"forces": oracle["forces"]})
    assert errors["forces"] <= RTOL


def test_ranks_without_atoms() -> None:
    """Fewer atoms than ranks: empty ranks still join every exchange."""
    atoms = Atoms("CuAgAu", positions=[[0.0, 0.0, 0.0], [2.1, 0.2, 0.0], [0.3, 2.2, 0.4]])
    for system in (atoms, Atoms(atoms, cell=[4.0, 4.2, 4.4], pbc=True)):
        model = ToyMessagePassing(num_layers=3)
        oracle = evaluate_periodic_graph(model, system)
        system.calc = ShardedCalculator(model, halo="layer")
        got = results(system)
        errors = relative_errors(got, {k: oracle[k] for k in got if k in oracle})
        assert all(err <= RTOL for err in errors.values()), errors
