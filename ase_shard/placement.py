"""Where a rank evaluates: its device and cores, and the model's copy and precision."""

from __future__ import annotations

import copy
import logging
import os
import warnings
from typing import Any

import torch

from ase_shard.comm import Comm, node_local_rank
from ase_shard.graph import model_dtype

logger = logging.getLogger(__name__)


def place_rank(device: Any, comm: Comm) -> torch.device:
    """This rank's device, and its share of the node's cores.

    ``device`` if given, else ``cuda:<node-local rank % GPUs>`` when CUDA is
    available, else CPU. Without ``OMP_NUM_THREADS``, torch would start one
    thread per core in every rank; ranks sharing a node split the cores instead.
    """
    node_rank, node_size = comm.node_placement()
    if node_size > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // node_size))
    if device is not None:
        placed = checked_device(device)
    elif torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        # the launcher's node-local rank counts every process of the job on this
        # node, so calculators on sub-communicators do not pile onto the same GPUs
        launcher_rank, launcher_size = node_local_rank()
        if launcher_rank is not None:
            node_rank, node_size = launcher_rank, launcher_size
        if node_size > gpus:
            logger.warning(
                "%d ranks on this node share %d GPU(s); give each rank its own GPU, "
                "or use MPS, for full speed",
                node_size,
                gpus,
            )
        placed = torch.device(f"cuda:{node_rank % gpus}")
    else:
        placed = torch.device("cpu")
    if placed.type == "cuda":
        # kernels, allocations and synchronisations without a device index go here,
        # not to GPU 0
        torch.cuda.set_device(placed)
    return placed


def placed(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` on ``device`` in ``dtype``: a copy if that moves or casts it.

    A model that cannot be copied (TorchScript functions inside) is moved in
    place, with a warning.

    ``Module.to`` works in place, which would change the caller's model (and
    make a CPU reference evaluated after it run on the GPU).
    """
    def in_place(tensor: torch.Tensor) -> bool:
        cast = tensor.is_floating_point() and tensor.dtype != dtype
        return tensor.device == device and not cast

    if all(map(in_place, [*model.parameters(), *model.buffers()])):
        return model
    try:
        model = copy.deepcopy(model)
    except Exception as exc:  # TorchScript functions inside (SevenNet) cannot be copied
        warnings.warn(
            f"{type(model).__name__} cannot be copied ({exc}), so it is moved to {device} "
            f"and cast to {dtype} in place: the caller's model changes too",
            RuntimeWarning,
            stacklevel=3,
        )
    return model.to(device=device, dtype=dtype)


def checked_device(device: Any) -> torch.device:
    """``torch.device(device)``, or ``ValueError`` naming the devices this process has."""
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    available = ["cpu", *(f"cuda:{k}" for k in range(cuda))]
    if torch.backends.mps.is_available():
        available.append("mps")
    try:
        placed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"device {device!r} is not a torch device; available here: {', '.join(available)}"
        ) from None
    index = 0 if placed.index is None else placed.index
    usable = {
        "cpu": True,
        "cuda": index < cuda,
        "mps": "mps" in available,
    }.get(placed.type, True)  # other backends (xpu, ...) report their own errors
    if not usable:
        raise ValueError(
            f"device {device!r} is not available here; available: {', '.join(available)}"
        )
    return placed


# the precisions a model can run in, by the names the command line uses
DTYPES = {"float32": torch.float32, "float64": torch.float64}


def checked_dtype(dtype: Any, model: torch.nn.Module) -> torch.dtype:
    """The precision to evaluate ``model`` in: ``dtype``, else the model's own.

    ``dtype`` is ``"float32"``, ``"float64"``, ``torch.float32``,
    ``torch.float64`` or ``None``; anything else raises ``ValueError`` naming
    it. Half precision is refused, also when it is the model's own.
    """
    resolved = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if dtype is None:
        resolved = model_dtype(model)
    if isinstance(resolved, torch.dtype) and resolved in DTYPES.values():
        return resolved
    if isinstance(resolved, torch.dtype) and resolved.is_floating_point:
        whose = "the model's dtype" if dtype is None else "dtype"
        raise ValueError(
            f"{whose} is {resolved}: in half precision (float16/bfloat16) edge vectors keep "
            "3 significant digits and forces are not usable for MD; pass dtype=torch.float32 "
            "(or 'float32') to run such a model"
        )
    raise ValueError(
        "dtype must be 'float32' or 'float64' (or torch.float32, torch.float64, None for the "
        f"model's own), not {dtype!r}"
    )
