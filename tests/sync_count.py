"""Count, on any device, the operations that would make the host wait for a GPU.

A CUDA device runs kernels asynchronously: the host queues them and goes on.
It waits for everything queued so far (a *sync*) where it needs something the
device has not computed yet:

- an output whose size depends on the data: ``nonzero``, boolean-mask indexing
  and assignment, ``masked_select``, ``masked_scatter``, ``bincount``,
  ``unique``, ``repeat_interleave`` without ``output_size``;
- a value on the host: ``.item()``, ``int(t)``, ``bool(t)``, ``torch.equal``,
  ``.tolist()``, ``.numpy()``, ``.cpu()`` of a device tensor (not the range
  checks of ``one_hot`` with ``num_classes``, which run on a CPU only);
- a copy of host data to the device (``torch.tensor(x, device=...)``,
  ``torch.as_tensor``, ``.to(device)`` of a host tensor) once kernels are
  queued: torch synchronises the stream after such a copy. Before any kernel
  (at the start of a step) there is nothing to wait for;
- ase_shard's halo exchange (``ase_shard::halo_exchange`` and its reverse),
  whose messages pass through host memory.

A CPU run never waits, so :func:`count_syncs` counts these operations with
torch's dispatch and function modes, by those rules: a CPU test then tells
how often a GPU run would wait. Tensors made with an explicit ``device`` count
as device tensors; tensors made without one (``torch.as_tensor(array)``,
``torch.from_numpy``), and what ``.cpu()`` returns, as host tensors, whose
reads are free. Operations inside the halo exchange are not seen (the exchange
counts as one sync).

The helpers below count the syncs of a calculator's step that reuses its
layout (:func:`reuse_step`) and of every rank's block of a split built in one
process (:func:`split_reuse_step`), and check that only the block's own remain
(:func:`assert_block_syncs_only`, :func:`assert_split_equals_whole`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import numpy as np
import torch
from oracles import rel_err
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import ase_shard
from ase_shard.block import RESULT_COLUMNS, LocalBlock
from ase_shard.graph import model_dtype, receptive_field
from ase_shard.halo import rank_rows
from ase_shard.partition import choose_grid, frame_coordinates, spatial_owners

aten = torch.ops.aten

# operators whose output size the host must read from the device
_SIZE_FROM_DATA = {
    aten.nonzero,
    aten.masked_select,
    aten.masked_scatter,
    aten.masked_scatter_,
    aten.bincount,
    aten._unique,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
    aten.unique_dim_consecutive,
}
# operators that return a device value to the host
_VALUE_TO_HOST = {aten._local_scalar_dense, aten.equal, aten.is_nonzero}
# indexing that becomes ``nonzero`` with a boolean index
_INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
# reads of a whole tensor on the host
_READS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__}
_FACTORIES = {torch.tensor, torch.as_tensor, torch.asarray}
# operators that launch no kernel
_NO_KERNEL = {aten.lift_fresh, aten.empty, aten.empty_strided, aten.new_empty, aten.alias}
_TORCH = os.sep + "torch" + os.sep
# the folders that hold the package and these tests: paths are shown from there on
_ROOTS = (Path(ase_shard.__file__).resolve().parents[1], Path(__file__).resolve().parents[1])


@dataclass
class Sync:
    """One wait for the device: the operation and the code that asked for it."""

    what: str
    where: str  # "path/file.py:function", or "backward of <autograd node>"


@dataclass
class Syncs:
    """The syncs seen inside :func:`count_syncs`, in order."""

    events: list[Sync] = field(default_factory=list)
    pending: bool = False  # kernels queued since the last wait
    quiet: int = 0  # inside an operation whose syncs happen on a CPU only
    received_bytes: int = 0  # from other ranks, in the step :func:`reuse_step` counted
    _host: dict[int, torch.Tensor] = field(default_factory=dict)  # data pointer -> tensor

    def record(self, what: str) -> None:
        if not self.quiet:
            self.events.append(Sync(what, _caller()))
            self.pending = False

    def on_host(self, tensor: torch.Tensor) -> bool:
        return tensor.numel() == 0 or _address(tensor) in self._host

    def mark_host(self, tensor) -> None:
        if isinstance(tensor, torch.Tensor) and tensor.numel():
            self._host[_address(tensor)] = tensor  # kept alive: its address stays its own


def _address(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _short(path: str) -> str:
    """``path`` from the package or test folder on (``ase_shard/block.py``, ``sevenn/...``).

    Found from where ase_shard and these tests were imported, never from folder names:
    a checkout is often itself called ``ase_shard``.
    """
    resolved = Path(path).resolve()
    for root in _ROOTS:
        if resolved.is_relative_to(root):
            return resolved.relative_to(root).as_posix()
    parts = resolved.parts
    if "site-packages" in parts:
        return "/".join(parts[parts.index("site-packages") + 1 :])
    return path


def _caller() -> str:
    """Where the current operation was asked for, outside torch and this module."""
    node = torch._C._current_autograd_node()
    if node is not None:
        return f"backward of {node.name()}"
    frame = sys._getframe(1)
    while frame is not None and (
        _TORCH in frame.f_code.co_filename or frame.f_code.co_filename == __file__
    ):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{_short(frame.f_code.co_filename)}:{frame.f_code.co_name}"


def _device_given(args: tuple, kwargs: dict) -> bool:
    """Whether a ``Tensor.to`` call names a device."""
    return kwargs.get("device") is not None or any(
        isinstance(arg, (str, torch.device)) for arg in args[1:]
    )


def _num_classes(args: tuple, kwargs: dict) -> int:
    """The ``num_classes`` of a ``one_hot`` call (-1: found from the data)."""
    return int(kwargs.get("num_classes", args[1] if len(args) > 1 else -1))


def _sync_of(func, args: tuple, kwargs: dict) -> str | None:
    """What makes the operator call ``func(*args, **kwargs)`` wait for the device, if anything."""
    packet = func.overloadpacket
    if packet in _SIZE_FROM_DATA or packet in _VALUE_TO_HOST:
        return str(packet)
    if packet in _INDEXING and any(
        index is not None and index.dtype in (torch.bool, torch.uint8) for index in args[1]
    ):
        return f"{packet} with a boolean index"
    if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
        return f"{packet} without output_size"
    if func.namespace == "ase_shard":
        return f"{packet} (through host memory)"
    return None


class _Dispatch(TorchDispatchMode):
    """Operators, forward and backward: data-dependent sizes and values read on the host."""

    def __init__(self, syncs: Syncs):
        super().__init__()
        self.syncs = syncs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        syncs = self.syncs
        tensors = [arg for arg in args if isinstance(arg, torch.Tensor)]
        on_host = bool(tensors) and all(syncs.on_host(tensor) for tensor in tensors)
        what = None if on_host else _sync_of(func, args, kwargs)
        if what is not None:
            syncs.record(what)
        out = func(*args, **kwargs)
        launched = not (on_host or func.is_view or func.overloadpacket in _NO_KERNEL)
        if what is None and launched:
            syncs.pending = True
        return out


class _Functions(TorchFunctionMode):
    """Python-level reads and copies that do not reach the dispatcher as operators."""

    def __init__(self, syncs: Syncs):
        super().__init__()
        self.syncs = syncs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        syncs = self.syncs
        if func is torch.nn.functional.one_hot and _num_classes(args, kwargs) > 0:
            # given the class count, CUDA skips the range checks that read the
            # indices' minimum and maximum on a CPU
            syncs.quiet += 1
            try:
                return func(*args, **kwargs)
            finally:
                syncs.quiet -= 1
        if func in _READS and not syncs.on_host(args[0]):
            syncs.record(f"Tensor.{func.__name__}")
        elif func is torch.Tensor.cpu:
            if not syncs.on_host(args[0]):
                syncs.record("Tensor.cpu")
            out = func(*args, **kwargs)
            syncs.mark_host(out)
            return out
        elif func in _FACTORIES:
            data = args[0] if args else next(iter(kwargs.values()), None)
            from_host = not isinstance(data, torch.Tensor) or syncs.on_host(data)
            out = func(*args, **kwargs)
            if kwargs.get("device") is None:
                if from_host:
                    syncs.mark_host(out)
            elif from_host and syncs.pending:
                syncs.record(f"torch.{func.__name__} to the device")
            return out
        elif (
            func in (torch.Tensor.to, torch.Tensor.cuda)
            and syncs.pending
            and syncs.on_host(args[0])
            and (func is torch.Tensor.cuda or _device_given(args, kwargs))
        ):
            syncs.record(f"Tensor.{func.__name__} to the device")
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_syncs() -> Iterator[Syncs]:
    """Record in the yielded :class:`Syncs` every sync of the code run inside."""
    syncs = Syncs()
    from_numpy = torch.from_numpy

    def host_from_numpy(array):
        tensor = from_numpy(array)
        syncs.mark_host(tensor)
        return tensor

    # torch.from_numpy takes no tensor, so no mode sees it; its tensors share host memory
    with mock.patch.object(torch, "from_numpy", host_from_numpy), _Functions(syncs):
        with _Dispatch(syncs):
            yield syncs


# the block's syncs in a step that reuses its layout (on a CPU; on an accelerator
# the kept edges come as a copy of their counts per hop level instead)
KEPT_EDGES = ("Tensor.numpy", "ase_shard/block.py:kept_edges_on_host")
RESULTS = ("Tensor.cpu", "ase_shard/block.py:evaluate")


def assert_block_syncs_only(syncs: Syncs, block: LocalBlock) -> None:
    """The step synced for the kept edges (if it has edges) and the results only.

    Halo exchanges pass through host memory by design; they are left aside.
    """
    others = [
        (event.what, event.where)
        for event in syncs.events
        if not event.what.startswith("ase_shard.halo_")
    ]
    assert others == [KEPT_EDGES, RESULTS] if block.centre.numel() else [RESULTS], syncs.events


def reuse_step(atoms, move: float = 0.02, seed: int = 0) -> Syncs:
    """The syncs of one call of ``atoms.calc`` that reuses its layout.

    A first call builds the layout. Then every atom moves by at most ``move``
    Å along each axis (the same on every rank), twice: the first of these
    steps is not counted, the second is. (TorchScript, e3nn's code in MACE,
    optimises its graphs in their second run, once, comparing constants.)
    """
    atoms.get_forces()
    rebuilds = atoms.calc.rebuilds
    rng = np.random.default_rng(seed)
    for _ in range(2):
        atoms.positions = atoms.positions + rng.uniform(-move, move, atoms.positions.shape)
        received = atoms.calc.comm.received_bytes
        with count_syncs() as syncs:
            atoms.get_forces()
    syncs.received_bytes = atoms.calc.comm.received_bytes - received
    assert atoms.calc.rebuilds == rebuilds, "the counted step rebuilt the layout"
    return syncs


def rank_blocks(model, atoms, n_ranks: int, skin: float = 0.5, **options) -> list[LocalBlock]:
    """Every rank's full-halo block of a spatial ``n_ranks``-way split, built in this process.

    ``options`` go to :class:`LocalBlock`.
    """
    pbc, cell = atoms.pbc, atoms.cell.array
    width = receptive_field(model) + skin
    coords = frame_coordinates(atoms.positions, cell, pbc)
    owners = spatial_owners(coords, choose_grid(coords, pbc, n_ranks, width))
    blocks = []
    for rows in rank_rows(coords, pbc, owners, n_ranks, width):
        ids = rows.ids[: rows.n_nodes]
        blocks.append(
            LocalBlock(
                rows,
                atoms.numbers[ids],
                atoms.positions[ids],
                cell,
                model,
                skin=skin,
                device="cpu",
                **options,
            )
        )
    return blocks


def split_reuse_step(
    model, atoms, n_ranks: int, skin: float = 0.5, move: float = 0.02, seed: int = 0
) -> tuple[np.ndarray, list[tuple[LocalBlock, Syncs]]]:
    """Every rank's full-halo block of a spatial ``n_ranks``-way split, in this process.

    Each block is built at the positions of ``atoms`` and evaluated after every
    atom moved by at most ``move`` Å along each axis (a step that reuses it),
    twice to warm up and once counted (see :func:`reuse_step`).

    Returns
    -------
    results : (N, RESULT_COLUMNS) float64 array
        Per atom, its owner's energy column and every rank's force and virial
        columns summed: what the calculator's reverse exchange adds up.
    steps : list of (LocalBlock, Syncs)
        Each rank's block and the syncs of its counted step.
    """
    rng = np.random.default_rng(seed)
    moved = atoms.positions + rng.uniform(-move, move, atoms.positions.shape)
    results = np.zeros((len(atoms), RESULT_COLUMNS))
    steps = []
    for block in rank_blocks(model, atoms, n_ranks, skin):
        for _ in range(3):
            with count_syncs() as syncs:
                columns = block.evaluate(moved[block.ids], atoms.cell.array, model_dtype(model))
        np.add.at(results, block.ids, columns.T)
        steps.append((block, syncs))
    return results, steps


class Autograd(torch.nn.Module):
    """``model`` without ``energy_forces``: the block takes the autograd path, the one
    devices take (on a CPU the built-in potentials' compiled kernels sync nothing); a
    model that exchanges between its layers still does (``graph.exchange``)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        self.cutoff, self.num_layers = model.cutoff, model.num_layers
        self.atomic_types = model.atomic_types
        self.supports_layer_halo = getattr(model, "supports_layer_halo", False)

    def forward(self, graph):
        return self.model(graph)


class WithoutHops(Autograd):
    """``model`` given its graphs without ``hops``, as ``torch.compile``'s padded ones are
    (by the autograd path, as :class:`Autograd`)."""

    def forward(self, graph):
        return self.model(dataclasses.replace(graph, hops=None))


def assert_split_equals_whole(model, atoms, rtol: float) -> None:
    """Three ranks' full-halo blocks, built in this process, add up to one rank's block.

    With hop counts (each layer restricted) and without (the whole graph),
    energies, forces and virials agree to ``rtol``; every rank has ghosts and
    syncs for its kept edges and results only.
    """
    whole, _ = split_reuse_step(model, atoms, 1)
    split, steps = split_reuse_step(model, atoms, 3)
    bare, _ = split_reuse_step(WithoutHops(model), atoms, 3)
    for rows in (slice(0, 1), slice(1, 4), slice(4, None)):  # energies, forces, virials
        assert rel_err(split[:, rows], whole[:, rows]) <= rtol
        assert rel_err(bare[:, rows], whole[:, rows]) <= rtol
    for block, syncs in steps:
        assert block.n_nodes > block.n_owned
        assert_block_syncs_only(syncs, block)
