"""ShardedCalculator: an ASE calculator that spreads one system over MPI ranks.

``calculate`` follows the data path of the design: agree on the system,
decide whether to rebuild, partition and find ghosts (rank 0), scatter rows,
evaluate each rank's block, and gather/broadcast the results.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from ase import Atoms
from ase.calculators.calculator import Calculator, all_changes

from ase_shard.block import RESULT_COLUMNS, LocalBlock
from ase_shard.comm import CALCULATE, CLOSE, Comm, describe, rebuild
from ase_shard.exchange import HaloExchange, PeerFailure
from ase_shard.graph import (
    ShardModel,
    model_digest,
    model_dtype,
    receptive_field,
    supports_layer_halo,
)
from ase_shard.halo import rank_rows
from ase_shard.inputs import ModelInputs, pack, unpack
from ase_shard.padding import Capacities
from ase_shard.partition import (
    PARTITIONS,
    choose_grid,
    contiguous_owners,
    frame_coordinates,
    spatial_owners,
)
from ase_shard.system import differing_fields, fingerprint, validate
from ase_shard.timing import PhaseTimer

logger = logging.getLogger(__name__)

HALOS = ("layer", "full")


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
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device(f"cuda:{node_rank % torch.cuda.device_count()}")
    return torch.device("cpu")


class _Failed(Exception):
    """This rank's block could not be built (the error is already recorded)."""


class ShardedCalculator(Calculator):
    """Evaluate a torch potential on one system spread over MPI ranks.

    Parameters
    ----------
    model : torch.nn.Module
        A model following the protocol of :class:`ase_shard.graph.ShardModel`
        (``cutoff`` in Å, ``num_layers``, ``atomic_types``, per-atom energies
        in eV).
    skin : float
        Extra neighbour/halo distance in Å. The decomposition is reused until
        some atom moved more than ``skin / 2`` since it was built (a cell
        deformation counts through the distances it changes).
    device : str or torch.device, optional
        Where this rank evaluates; default ``cuda:<node-local rank % GPUs>``
        when CUDA is available, else CPU.
    dtype : torch.dtype, optional
        Precision of the model (it is cast); default: the model's own.
    comm : mpi4py communicator, optional
        Default ``MPI.COMM_WORLD`` when mpi4py is loaded, else one rank.
    partition : {"spatial", "contiguous"}
        ``spatial``: a count-balanced ``px*py*pz`` grid of boxes in frame
        coordinates. ``contiguous``: blocks of atom indices.
    grid : (int, int, int), optional
        Rank grid for ``spatial``; default: the one with the smallest halo.
    halo : {"layer", "full"}, optional
        ``full``: ghosts cover the whole receptive field (``cutoff *
        num_layers``) and each rank computes their features itself; works for
        any model. ``layer``: ghosts cover one cutoff and the model refreshes
        their features from their owners between layers (models with
        ``supports_layer_halo``). Default: ``layer`` where supported.
    compile : bool or str
        Run the model through ``torch.compile`` (``True``: the default
        backend; a string names the backend). Graphs are padded to capacities
        agreed by all ranks, so shapes change, and the model recompiles, only
        when a capacity grows. Parts dynamo cannot compile run eagerly.
    timeout : float or None
        Seconds a rank waits at the start of a calculation for the other ranks
        (under mpirun, SPMD) before it aborts the MPI job with a message:
        ranks whose ``Atoms`` diverged, so that only some of them calculate,
        end the job instead of hanging it. ``None`` waits forever.

    Results (eV, eV/Å, eV/Å³) equal the serial evaluation to round-off and are
    bitwise identical on every rank. ``stress``/``stresses`` exist only when the
    cell has rank 3.
    """

    implemented_properties = ["energy", "free_energy", "energies", "forces", "stress", "stresses"]
    nolabel = True

    def __init__(
        self,
        model: ShardModel,
        *,
        skin: float = 0.5,
        device: Any = None,
        dtype: torch.dtype | None = None,
        comm: Any = None,
        partition: str = "spatial",
        grid: Sequence[int] | None = None,
        halo: str | None = None,
        compile: bool | str = False,
        timeout: float | None = 600.0,
        **kwargs,
    ):
        if partition not in PARTITIONS:
            raise ValueError(f"partition must be one of {PARTITIONS}, not {partition!r}")
        if skin < 0:
            raise ValueError(f"skin must be >= 0 Å, not {skin}")
        if halo is None:
            halo = "layer" if supports_layer_halo(model) else "full"
        if halo not in HALOS:
            raise ValueError(f"halo must be one of {HALOS}, not {halo!r}")
        if halo == "layer" and not supports_layer_halo(model) and int(model.num_layers) > 1:
            raise ValueError(
                f"{type(model).__name__} does not exchange features between its layers "
                "(supports_layer_halo): use halo='full'"
            )
        Calculator.__init__(self, **kwargs)
        self.comm = Comm(comm)
        if grid is not None:
            grid = tuple(int(p) for p in grid)
            if len(grid) != 3 or int(np.prod(grid)) != self.comm.size:
                raise ValueError(f"grid {grid} does not multiply to {self.comm.size} ranks")
        self.device = place_rank(device, self.comm)
        self.dtype = dtype or model_dtype(model)
        if self.dtype not in (torch.float32, torch.float64):
            raise ValueError(
                f"dtype must be torch.float32 or torch.float64, not {self.dtype}: in half "
                "precision (float16/bfloat16) edge vectors keep 3 significant digits and "
                "forces are not usable for MD; pass dtype=torch.float32 to run such a model"
            )
        self.model = model.to(device=self.device, dtype=self.dtype)
        digests = self.comm.allgather(model_digest(self.model))
        differing = [rank for rank, digest in enumerate(digests) if digest != digests[0]]
        if differing:
            raise ValueError(
                f"the model's parameters on ranks {differing} differ from rank 0's: build "
                "it identically on every rank (same seed or the same checkpoint)"
            )
        # parameters stay JSON-encodable so Trajectory can write them
        self.parameters.update(
            skin=float(skin),
            partition=partition,
            grid=list(grid) if grid else None,
            halo=halo,
            compile=compile,
            model=type(model).__name__,
        )
        self.rebuilds = 0
        self.timer = PhaseTimer(self.device)
        self.timeout = timeout
        self._compiled = None
        self._capacity = Capacities()
        self._exchange_handle: int | None = None
        if compile:
            # a frame dynamo cannot compile runs eagerly instead of raising
            torch._dynamo.config.suppress_errors = True
            backend = compile if isinstance(compile, str) else "inductor"
            self._compiled = torch.compile(self.model, backend=backend, dynamic=False)
        # set by ase_shard.worker: rank 0 drives, the other ranks serve
        self._driven = False
        self._idle_root = False
        self._on_close: list = []
        self._block: LocalBlock | None = None
        self._root_state: dict | None = None  # rank 0: layout of the last build
        self.inputs = ModelInputs.of(model)
        self._inputs_digest: bytes | None = None  # of the inputs last calculated

    @property
    def skin(self) -> float:
        return self.parameters["skin"]

    @property
    def halo_reach(self) -> float:
        """Distance (Å) the ghosts must cover beyond the skin."""
        if self.parameters["halo"] == "layer":
            return float(self.model.cutoff)
        return receptive_field(self.model)

    @property
    def layout_counts(self) -> list[tuple[int, int, int]] | None:
        """Rank 0: ``(rows, owned, nodes)`` per rank of the current layout.

        Rows count every atom image; nodes are what the model evaluates
        (owned atoms plus ghost atoms), so ``nodes / owned`` is the padding.
        """
        if self._root_state is None:
            return None
        return [tuple(counts[:3]) for counts in self._root_state["counts"]]

    def request_rebuild(self) -> None:
        """Rebuild the decomposition at the next calculation (call on every rank)."""
        self._root_state = None
        self.reset()

    @property
    def decomposition(self) -> dict | None:
        """Rank 0: the current layout, for inspection and plots (``None`` elsewhere).

        ``owners`` is the owner rank of every atom; ``ghosts[r]`` holds rank
        ``r``'s ghost rows as ``(ids, image_shift)``: the ghost sits at
        ``positions[ids] + image_shift @ cell``.
        """
        state = self._root_state
        if state is None:
            return None
        owners = np.empty(len(state["atoms"]), dtype=np.int64)
        ghosts = []
        for rank, rows in enumerate(state["layout"]):
            owners[rows.ids[: rows.n_owned]] = rank
            ghosts.append((rows.ids[rows.n_owned :], rows.image_shift[rows.n_owned :]))
        return {"owners": owners, "ghosts": ghosts}

    def check_state(self, atoms: Atoms, tol: float = 1e-15) -> list[str]:
        """ASE's changes, plus ``"model inputs"`` when a declared input changed.

        ASE compares only positions, numbers, cell, pbc and the initial charges
        and magnetic moments; a model may also read custom arrays, velocities
        or ``atoms.info`` values.
        """
        changes = Calculator.check_state(self, atoms, tol)
        if self.inputs and self._inputs_digest != self.inputs.digest(atoms, self.parameters):
            changes.append("model inputs")
        return changes

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
        Calculator.calculate(self, atoms, properties, system_changes)
        atoms = self.atoms
        if self.inputs and atoms is not None:
            self._inputs_digest = self.inputs.digest(atoms, self.parameters)
        if self._driven:
            self.comm.bcast(CALCULATE)
        else:
            self.comm.rendezvous(
                self.timeout, "calculate too (do all ranks hold the same Atoms and call it?)"
            )
        try:
            self._calculate(atoms)
        except BaseException:
            # the next call starts from a fresh decomposition on every rank
            self._block = self._root_state = None
            self._inputs_digest = None
            raise

    def _calculate(self, atoms: Atoms | None) -> None:
        """One collective evaluation; ``atoms`` is ``None`` on serving ranks."""
        comm, timer = self.comm, self.timer
        with timer.phase("validate"):
            plan = self._agree_on_system(atoms)
        rebuild_now, cell = plan["rebuild"], np.array(plan["cell"])
        n_rows, n_owned, n_nodes, n_send = plan["counts"][comm.rank]
        root = self._root_state

        with timer.phase("scatter"):
            if rebuild_now:
                self.rebuilds += 1
                meta = comm.scatter_rows(
                    [
                        np.column_stack([r.ids, r.image_shift, atoms.numbers[r.ids], r.node])
                        for r in root["layout"]
                    ]
                    if comm.is_root
                    else None,
                    n_rows,
                    (6,),
                    np.int64,
                )
                send_index = comm.scatter_rows(
                    [r.send_index for r in root["layout"]] if comm.is_root else None,
                    n_send,
                    (),
                    np.int64,
                )
            # every row at a rebuild (for the neighbour list), then the nodes only;
            # per-atom model inputs travel in the same rows, after the positions
            part = "rows" if rebuild_now else "nodes"
            shapes = plan.get("input_shapes", {})
            width = 3 + sum(int(np.prod(shape, dtype=np.int64)) for shape in shapes.values())
            row_data = comm.scatter_rows(
                np.split(
                    np.concatenate(
                        [atoms.positions[root[part]], pack(root["inputs"], root[part])], axis=1
                    ),
                    root[part + "_splits"],
                )
                if comm.is_root
                else None,
                n_rows if rebuild_now else n_nodes,
                (width,),
                np.float64,
            )
            row_positions = row_data[:, :3]
            node_inputs = unpack(row_data[:n_nodes, 3:], shapes)

        error, rows = None, None
        if rebuild_now:
            try:
                self._block = self._build_block(
                    meta, send_index, n_owned, n_nodes, row_positions, cell, plan
                )
            except Exception as exc:
                error = describe(exc, comm.rank)
            if self._compiled is not None:
                # every rank pads to the same sizes, so they (re)compile together
                needed = self._block.needed() if error is None else Capacities()
                self._capacity = self._capacity.grown(Capacities.largest(comm.allgather(needed)))
                if error is None:
                    self._block.pad(self._capacity)
        try:
            if error is not None:
                raise _Failed
            rows = self._block.evaluate(
                row_positions[:n_nodes], cell, self.dtype, node_inputs, plan.get("system")
            )
            rows = rows.cpu().numpy()
            # the closing status vote (see ase_shard.exchange)
            if comm.any(False):
                raise PeerFailure("another rank failed")
        except PeerFailure as exc:
            error = describe(exc, comm.rank)
        except Exception as exc:
            error = error or describe(exc, comm.rank)
            comm.any(True)
        if rows is None:
            rows = np.zeros((n_nodes, RESULT_COLUMNS))

        with timer.phase("gather"):
            errors = comm.gather(error)
            gathered = comm.gather_rows(rows, [c[2] for c in plan["counts"]])
            status, buffer = None, None
            if comm.is_root:
                failed = [e for e in errors if e is not None]
                # report the ranks that failed, not those that stopped for them
                status = [e for e in failed if e[1] != PeerFailure.__qualname__] or failed or None
                if not failed:
                    buffer = self._assemble(atoms, gathered)
            status = comm.bcast(status)
            if status:
                raise rebuild(status)
            n_atoms = plan["n_atoms"]
            size = 1 + 4 * n_atoms + (6 + 6 * n_atoms if plan["stress"] else 0)
            buffer = comm.bcast_array(buffer if buffer is not None else np.empty(size))
        if atoms is not None:
            self._store(atoms, buffer)

    def _build_block(self, meta, send_index, n_owned, n_nodes, row_positions, cell, plan):
        exchange = None
        if self.parameters["halo"] == "layer":
            counts = np.asarray(plan["exchange_counts"])
            rank = self.comm.rank
            exchange = HaloExchange(
                self.comm,
                n_owned,
                send_index,
                counts[rank],
                counts[:, rank],
                self.device,
                self._exchange_handle,
            )
            self._exchange_handle = exchange.handle  # kept: compiled models specialise on it
        return LocalBlock(
            meta[:, 0],
            meta[:, 4],
            meta[:, 1:4],
            meta[:, 5],
            n_owned,
            n_nodes,
            self.model,
            self.skin,
            row_positions,
            cell,
            self.device,
            exchange,
            self.timer,
            self._compiled,
        )

    def _agree_on_system(self, atoms: Atoms) -> dict:
        """Validate, decide on a rebuild and plan it on rank 0; agree everywhere.

        One collective: every rank learns rank 0's plan (or error) and every
        rank's fingerprint, so all raise the same error or none does.
        """
        comm = self.comm
        plan, error = None, None
        if comm.is_root:
            try:
                plan = self._plan(atoms)
            except Exception as exc:
                error = describe(exc, 0)
        mine = None
        if comm.size > 1 and not self._driven:
            # the inputs' digest was taken in calculate()
            mine = (fingerprint(atoms), self._inputs_digest)
        views = comm.allgather((mine, error, plan))
        root_print, root_error, plan = views[0]
        if root_error is not None:
            raise rebuild([root_error])
        differing = {
            rank: differing_fields(root_print[0], view[0][0])
            + (["model inputs"] if view[0][1] != root_print[1] else [])
            for rank, view in enumerate(views)
            if view[0] != root_print
        }
        if differing:
            detail = "; ".join(f"rank {r}: {', '.join(f)}" for r, f in differing.items())
            raise ValueError(
                "ranks hold different Atoms than rank 0 (" + detail + "). Under mpirun every "
                "rank must build and move the same system: seed random numbers identically "
                "(e.g. Langevin(..., rng=np.random.default_rng(seed)))"
            )
        return plan

    def _plan(self, atoms: Atoms) -> dict:
        """Rank 0: validate, and partition + find ghosts when a rebuild is due."""
        validate(atoms, getattr(self.model, "atomic_types", None))
        cell = atoms.cell.array.copy()
        state = self._root_state
        reason = self._rebuild_reason(atoms, state)
        rebuild_now = reason is not None
        if rebuild_now:
            state = self._build_layout(atoms)
            self._root_state = state
            owned = [c[1] for c in state["counts"]]
            nodes = [c[2] for c in state["counts"]]
            logger.info(
                "rebuild %d (%s): owned atoms per rank %d-%d, evaluated atoms per rank %d-%d",
                self.rebuilds + 1,
                reason,
                min(owned),
                max(owned),
                min(nodes),
                max(nodes),
            )
        plan = {
            "rebuild": rebuild_now,
            "counts": state["counts"],
            "cell": cell.tolist(),
            "n_atoms": len(atoms),
            "stress": atoms.cell.rank == 3,
        }
        if rebuild_now:
            plan["exchange_counts"] = [r.send_counts.tolist() for r in state["layout"]]
        state["inputs"] = self.inputs.per_atom_arrays(atoms)
        bad = [name for name, value in state["inputs"].items() if not np.isfinite(value).all()]
        if bad:
            raise ValueError(f"per-atom model inputs {bad} are not finite")
        if self.inputs:
            plan["input_shapes"] = {k: list(v.shape[1:]) for k, v in state["inputs"].items()}
            plan["system"] = self.inputs.system_values(atoms, self.parameters)
        return plan

    def _rebuild_reason(self, atoms: Atoms, state: dict | None) -> str | None:
        """Why the decomposition must be rebuilt, or ``None`` to reuse it.

        Reuse is safe while every pair now within the receptive field ``W`` was
        within ``W + skin`` at the build. With the cell deformed by ``F`` (a
        barostat) and each atom displaced by ``u_i`` beyond that affine map, a
        pair vector changes by at most ``|F - I| |d0| + 2 max |u|``, which
        gives the test ``(W |F - I| + 2 max |u|) / (1 - |F - I|) <= skin``.
        Without a cell change this is the usual ``max |u| <= skin / 2``.
        """
        if state is None:
            return "first call"
        reference = state["atoms"]
        if (
            len(atoms) != len(reference)
            or (atoms.numbers != reference.numbers).any()
            or (atoms.pbc != reference.pbc).any()
        ):
            return "atoms or pbc changed"
        if len(atoms) == 0:
            return None
        cell, cell0 = atoms.cell.array, reference.cell.array
        affine = reference.positions
        strain = 0.0
        if (cell != cell0).any():
            if reference.cell.rank < 3:
                return "cell changed"
            deformation = np.linalg.solve(cell0, cell)  # cell = cell0 @ deformation
            affine = reference.positions @ deformation
            strain = np.linalg.norm(deformation - np.eye(3), ord=2)
            if strain >= 0.5:
                return "cell changed"
        displacement = np.sqrt(((atoms.positions - affine) ** 2).sum(axis=1).max())
        reach = self.halo_reach
        growth = (reach * strain + 2.0 * displacement) / (1.0 - strain)
        if growth > self.skin:
            return f"pair distances may have changed by {growth:.3f} Å > skin"
        return None

    def _build_layout(self, atoms: Atoms) -> dict:
        comm, timer = self.comm, self.timer
        with timer.phase("partition"):
            pbc = atoms.pbc.copy()
            coords = frame_coordinates(atoms.positions, atoms.cell.array, pbc)
            width = self.halo_reach + self.skin
            # a driving rank 0 that only runs ASE (notebook mode) owns nothing
            first = int(self._idle_root)
            n_compute = comm.size - first
            if self.parameters["partition"] == "spatial":
                grid = self.parameters["grid"] or choose_grid(coords, pbc, n_compute, width)
                owners = spatial_owners(coords, tuple(grid)) + first
            else:
                owners = contiguous_owners(len(atoms), n_compute) + first
        with timer.phase("halo"):
            layout = rank_rows(
                coords, pbc, owners, comm.size, width, self.parameters["halo"] == "layer"
            )
            rows = np.concatenate([r.ids for r in layout])
            nodes = np.concatenate([r.ids[: r.n_nodes] for r in layout])
        return {
            "atoms": atoms.copy(),
            "layout": layout,
            "rows": rows,
            "rows_splits": np.cumsum([len(r.ids) for r in layout])[:-1],
            "nodes": nodes,
            "nodes_splits": np.cumsum([r.n_nodes for r in layout])[:-1],
            "gather_index": torch.from_numpy(nodes),
            "counts": [(len(r.ids), r.n_owned, r.n_nodes, len(r.send_index)) for r in layout],
        }

    def _assemble(self, atoms: Atoms, gathered: np.ndarray) -> np.ndarray:
        """Rank 0: sum every rank's rows into owners; pack the results."""
        n = len(atoms)
        total = torch.zeros((n, RESULT_COLUMNS), dtype=torch.float64)
        total.index_add_(0, self._root_state["gather_index"], torch.from_numpy(gathered))
        total = total.numpy()
        energies = total[:, 0]
        parts = [[energies.sum()], energies, total[:, 1:4].ravel()]
        if atoms.cell.rank == 3:
            stresses = total[:, 4:] / atoms.get_volume()
            parts += [stresses.sum(axis=0), stresses.ravel()]
        return np.concatenate(parts)

    def _store(self, atoms: Atoms, buffer: np.ndarray) -> None:
        n = len(atoms)
        energy = float(buffer[0])
        self.results["energy"] = self.results["free_energy"] = energy
        self.results["energies"] = buffer[1 : 1 + n].copy()
        self.results["forces"] = buffer[1 + n : 1 + 4 * n].reshape(n, 3).copy()
        if atoms.cell.rank == 3:
            self.results["stress"] = buffer[1 + 4 * n : 7 + 4 * n].copy()
            self.results["stresses"] = buffer[7 + 4 * n :].reshape(n, 6).copy()

    def close(self) -> None:
        """Release the serving ranks (worker/notebook mode); safe to call twice.

        In SPMD mode there is nothing to release.
        """
        if self._driven and self.comm.is_root:
            self._driven = False
            self.comm.bcast(CLOSE)
            for release in self._on_close:
                release()
            self._on_close.clear()

    def __enter__(self) -> ShardedCalculator:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
