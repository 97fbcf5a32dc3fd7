"""GPU readiness: the one command to run first on a machine with GPUs.

    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
    mpirun -n 1 .venv/bin/python scripts/gpu_check.py --json gpu-check-1.json
    mpirun -n 2 .venv/bin/python scripts/gpu_check.py --json gpu-check-2.json \\
        --compare gpu-check-1.json
    make gpu-check                      # both, each bounded by timeout

Three models (EMT, Lennard-Jones and a small random-weight SevenNet) on three Cu
systems (a periodic crystal, a slab with vacuum, a triclinic cell). Rank 0 prints
one table and writes the JSON; the exit status is 1 when a check failed.

- exact vs CPU float64: the calculator on this rank's device equals
  ``ShardedCalculator(device="cpu")`` to a relative 1e-10 (energy, forces, stress);
- one CUDA context per rank: ``torch.cuda.current_device()``, the calculator's
  device and the GPUs ``nvidia-smi`` lists for this rank's pid (exactly one);
- syncs and memcpy per step: synchronising CUDA operations
  (``torch.cuda.set_sync_debug_mode("warn")``) and the profiler's copies and
  synchronisations, in a reuse step and a rebuild step;
- halo layer == full for SevenNet, and bitwise identical results on every rank;
- compile: no graph breaks and few graphs under ``torch.compile``, equal to eager;
- time per step: the median of a few reuse steps; ``--compare`` prints another
  run's times (another rank count) next to this run's.

Without CUDA, or with ``--dry-run``, the checks that mean something on a CPU run
there (the exactness check compares the GPU's neighbour search, the torch cell
list, with vesin on the CPU and tests the plumbing; compile uses the quick
``aot_eager`` backend) and the CUDA-only rows say "not run (no CUDA)". Rows
that say ``warn`` (graph breaks, say) do not fail the run.
"""

import ase_shard  # first: sets up MPI before ASE fixes ase.parallel.world

# isort: split

import argparse
import hashlib
import itertools
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch._dynamo.utils
from ase import Atoms
from ase.build import bulk, fcc111

from ase_shard import ShardedCalculator
from ase_shard.comm import Comm
from ase_shard.models import EMT, LennardJones
from ase_shard.random_models import random_sevennet

warnings.filterwarnings("ignore", message="No tensor product accelerator")


class Once(logging.Filter):
    """Lets each message through once: every calculator of this script would repeat
    the placement warning (ranks outnumbering GPUs)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        new = message not in self.seen
        self.seen.add(message)
        return new


SCHEMA = "ase-shard-gpu-check/1"
RTOL = 1e-10  # float64: device against CPU, layer against full halo, compiled against eager
MAX_GRAPHS = 2  # graphs dynamo may compile for one model (a capacity may grow once)
TIMED_STEPS = 5
NOT_RUN = "not run (no CUDA)"
UUID = re.compile("-".join(f"[0-9a-f]{{{n}}}" for n in (8, 4, 4, 4, 12)))

# the checks, in the order of the table
EXACT = "exact vs CPU float64"
PLACEMENT = "one CUDA context per rank"
SYNCS = "syncs per step"
MEMCPY = "memcpy per step"
HALO = "halo layer == full"
IDENTICAL = "identical on all ranks"
COMPILE = "compile"
TIME = "time per step"

# profiler events counted per step, by name prefix: device-side copies (kernels of
# the copy engines), the CUDA runtime calls that start copies, and host waits
PROFILED = {
    "HtoD": ("Memcpy HtoD",),
    "DtoH": ("Memcpy DtoH",),
    "cudaMemcpy": ("cudaMemcpy",),
    "cudaSync": ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"),
}


@dataclass
class Row:
    """One line of the table.

    Attributes
    ----------
    check : str
        The check's name (:data:`EXACT`, ...).
    subject : str
        What was checked: a model, a model and system, a rank.
    result : str
    verdict : str
        ``ok``, ``FAIL``, ``warn`` (could not tell), ``info`` (a measurement)
        or ``-`` (not run).
    values : dict
        The numbers behind ``result``, for the JSON.
    """

    check: str
    subject: str
    result: str
    verdict: str
    values: dict = field(default_factory=dict)


@dataclass
class Setup:
    """What every check needs.

    Attributes
    ----------
    comm : Comm
    cuda : bool
        Whether the checks run on CUDA (``False``: the CPU dry run).
    device : str or None
        ``device`` for the calculators under test: ``None`` lets the calculator
        place the rank (CUDA), ``"cpu"`` in the dry run.
    backend : str
        The ``torch.compile`` backend of the compiled calculators.
    neighbor_list : str
        Their neighbour search: ``auto`` on CUDA (the torch cell list there),
        ``torch`` in the dry run (the same search, on the CPU); the CPU
        reference uses vesin.
    models : dict of str to torch.nn.Module
    systems : dict of str to Atoms
    timing_system : Atoms
    results : dict
        Device results by ``(model, system, halo)``, filled by :func:`check_exact`
        and :func:`check_halo`.
    """

    comm: Comm
    cuda: bool
    device: str | None
    backend: str
    neighbor_list: str
    models: dict
    systems: dict
    timing_system: Atoms
    results: dict = field(default_factory=dict)


# -- systems, models and evaluation ------------------------------------------------------------


def cu_systems() -> dict[str, Atoms]:
    """Small rattled Cu systems: periodic crystal, slab (pbc T, T, F), triclinic cell."""
    crystal = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(2)  # 32 atoms
    slab = fcc111("Cu", size=(2, 2, 3), vacuum=6.0, a=3.61)  # 12 atoms
    triclinic = bulk("Cu", "fcc", a=3.61).repeat(3)  # 27 atoms, primitive cell
    systems = {"crystal": crystal, "slab": slab, "triclinic": triclinic}
    for seed, atoms in enumerate(systems.values()):
        atoms.rattle(0.05, seed=seed)
    return systems


def timing_system(size: int) -> Atoms:
    """A rattled periodic Cu crystal of ``4 size**3`` atoms."""
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(size)
    atoms.rattle(0.05, seed=10)
    return atoms


def build_models() -> dict[str, torch.nn.Module]:
    """EMT, Lennard-Jones and a random-weight SevenNet (2 layers, lmax 2), all float64."""
    return {
        "EMT": EMT(),
        "LJ": LennardJones(sigma=2.33, epsilon=0.409, rc=5.0),
        "SevenNet": random_sevennet([29], cutoff=4.0, channels=8, num_layers=2),
    }


def attach(calc: ShardedCalculator, atoms: Atoms) -> Atoms:
    """A copy of ``atoms`` with ``calc`` attached."""
    atoms = atoms.copy()
    atoms.calc = calc
    return atoms


def evaluate(atoms: Atoms) -> dict[str, np.ndarray]:
    """Energy (eV), forces (eV/Å) and stress (eV/Å³) from the attached calculator."""
    return {
        "energy": np.asarray(atoms.get_potential_energy()),
        "forces": atoms.get_forces(),
        "stress": atoms.get_stress(),
    }


def relative_errors(got: dict, ref: dict) -> dict[str, float]:
    """Largest absolute difference over the largest reference magnitude, per key."""
    errors = {}
    for key, reference in ref.items():
        scale = np.abs(reference).max()
        difference = np.abs(np.asarray(got[key]) - reference).max()
        errors[key] = float(difference / scale if scale > 0 else difference)
    return errors


def within(errors: dict[str, float]) -> tuple[str, str]:
    """The errors as text, and ``ok`` or ``FAIL`` against :data:`RTOL`."""
    text = ", ".join(f"{key} {value:.1e}" for key, value in errors.items())
    return text, "ok" if max(errors.values()) <= RTOL else "FAIL"


def digest(values: dict[str, np.ndarray]) -> str:
    """blake2b of the energy and forces, bit for bit."""
    hashed = hashlib.blake2b()
    for key in ("energy", "forces"):
        hashed.update(np.ascontiguousarray(values[key], dtype=np.float64).tobytes())
    return hashed.hexdigest()


def calculator(setup: Setup, model: torch.nn.Module, **kwargs) -> ShardedCalculator:
    """The calculator under test, in float64 on this rank's device."""
    return ShardedCalculator(
        model,
        device=setup.device,
        dtype=torch.float64,
        neighbor_list=setup.neighbor_list,
        **kwargs,
    )


def nudge(atoms: Atoms, step: int) -> None:
    """Move every atom by 1e-4 Å, back and forth: a new calculation that reuses the layout."""
    atoms.positions[:, 0] += 1e-4 * (-1) ** step


def not_run(check: str, subjects: list[str]) -> list[Row]:
    """Rows of a CUDA-only check in the dry run."""
    return [Row(check, subject, NOT_RUN, "-") for subject in subjects]


# -- 1. exactness ------------------------------------------------------------------------------


def check_exact(setup: Setup) -> list[Row]:
    """Device against CPU (vesin's neighbour list), both float64, every model and system."""
    rows = []
    for model_name, model in setup.models.items():
        for system_name, system in setup.systems.items():
            got = evaluate(attach(calculator(setup, model), system))
            cpu = ShardedCalculator(
                model, device="cpu", dtype=torch.float64, neighbor_list="vesin"
            )
            ref = evaluate(attach(cpu, system))
            halo = "layer" if model_name == "SevenNet" else "default"
            setup.results[model_name, system_name, halo] = got
            errors = relative_errors(got, ref)
            text, verdict = within(errors)
            rows.append(Row(EXACT, f"{model_name} / {system_name}", text, verdict, errors))
    return rows


# -- 2. placement ------------------------------------------------------------------------------


def smi_gpus(text: str, pid: int) -> list[str]:
    """GPU UUIDs that ``nvidia-smi --query-compute-apps=pid,gpu_uuid`` lists for ``pid``."""
    gpus = []
    for line in text.splitlines():
        fields = [part.strip() for part in line.split(",")]
        if len(fields) == 2 and fields[0] == str(pid):
            gpus.append(fields[1])
    return gpus


def query_smi() -> str | None:
    """``nvidia-smi``'s compute apps as ``pid, gpu_uuid`` lines; ``None`` without it."""
    if shutil.which("nvidia-smi") is None:
        return None
    command = ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    return done.stdout if done.returncode == 0 else None


def rank_placement(device: torch.device) -> dict:
    """This rank's view of its GPU: current device, the calculator's, nvidia-smi's."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    smi = query_smi()
    return {
        "host": socket.gethostname(),
        "current_device": torch.cuda.current_device(),
        "calc_device": str(device),
        "uuid": gpu_id(uuid),
        "visible_gpus": torch.cuda.device_count(),
        "smi_gpus": None if smi is None else smi_gpus(smi, os.getpid()),
    }


def gpu_id(uuid: object) -> str | None:
    """The UUID in torch's or ``nvidia-smi``'s spelling of a GPU (``GPU-...``), lower case.

    ``None`` when there is none to compare.
    """
    found = UUID.search(str(uuid).lower())
    return found.group() if found else None


def placement_verdict(rank: int, views: list[dict]) -> tuple[str, str]:
    """Whether rank ``rank`` runs on its calculator's GPU alone; the problem, if any.

    ``views`` holds every rank's :func:`rank_placement`.
    """
    view = views[rank]
    if view["current_device"] != torch.device(view["calc_device"]).index:
        return "FAIL", "current device is not the calculator's"
    on_node = [v for v in views if v["host"] == view["host"]]
    sharing = [
        r
        for r, v in enumerate(views)
        if r != rank and v["host"] == view["host"] and view["uuid"] and v["uuid"] == view["uuid"]
    ]
    if sharing and view["visible_gpus"] >= len(on_node):
        return "FAIL", f"shares its GPU with rank(s) {sharing} though GPUs are free"
    gpus = view["smi_gpus"]
    if gpus is None:
        return "warn", "nvidia-smi not found"
    if not gpus:
        return "warn", "pid not listed by nvidia-smi (container PID namespace?)"
    if len(gpus) > 1:
        return "FAIL", f"contexts on {len(gpus)} GPUs"
    if view["uuid"] and gpu_id(gpus[0]) != view["uuid"]:
        return "FAIL", "nvidia-smi lists it on another GPU than the calculator's"
    return "ok", ""


def check_placement(setup: Setup) -> list[Row]:
    """One row per rank: current device, calculator device, the GPUs holding its context."""
    if not setup.cuda:
        return not_run(PLACEMENT, [f"rank {rank}" for rank in range(setup.comm.size)])
    probe = calculator(setup, setup.models["EMT"])
    evaluate(attach(probe, setup.systems["crystal"]))  # a context, if none exists yet
    views = setup.comm.allgather(rank_placement(probe.device))
    rows = []
    for rank, view in enumerate(views):
        verdict, problem = placement_verdict(rank, views)
        smi = "?" if view["smi_gpus"] is None else ", ".join(view["smi_gpus"]) or "none"
        text = (
            f"current_device {view['current_device']}, calc {view['calc_device']}, "
            f"nvidia-smi: {smi}" + (f"; {problem}" if problem else "")
        )
        rows.append(Row(PLACEMENT, f"rank {rank} ({view['host']})", text, verdict, view))
    return rows


# -- 3. syncs and copies per step ---------------------------------------------------------------


def count_syncs(step: Callable[[], None]) -> int:
    """Synchronising CUDA operations in ``step()`` (warnings of the sync debug mode)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(warning.message) for warning in caught)


def profiled_counts(counts: dict[str, int]) -> dict[str, int]:
    """:data:`PROFILED` totals from the profiler's ``{event name: count}``."""
    return {
        label: sum(n for name, n in counts.items() if name.startswith(prefixes))
        for label, prefixes in PROFILED.items()
    }


def count_copies(step: Callable[[], None]) -> dict[str, int]:
    """Copies and host waits in ``step()``, from the torch profiler."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
    return profiled_counts({event.key: event.count for event in prof.key_averages()})


def step_functions(atoms: Atoms) -> dict[str, Callable[[], None]]:
    """A reuse step and a rebuild step of ``atoms``'s calculator."""
    calls = itertools.count()

    def reuse() -> None:
        nudge(atoms, next(calls))
        atoms.get_forces()

    def rebuild() -> None:
        atoms.calc.request_rebuild()
        atoms.get_forces()

    return {"reuse": reuse, "rebuild": rebuild}


def check_steps(setup: Setup) -> list[Row]:
    """Syncs (sync debug mode) and copies (profiler) in a reuse and a rebuild step.

    The table shows rank 0's counts (with several ranks, every rank's are in the JSON).
    """
    if not setup.cuda:
        return not_run(SYNCS, list(setup.models)) + not_run(MEMCPY, list(setup.models))
    prefix = "rank 0: " if setup.comm.size > 1 else ""
    syncs, copies = [], []
    for name, model in setup.models.items():
        atoms = attach(calculator(setup, model), setup.systems["crystal"])
        steps = step_functions(atoms)
        steps["reuse"]()  # the first calculation, then one reuse step: nothing new allocated
        steps["reuse"]()
        built = atoms.calc.rebuilds
        synced = {kind: count_syncs(step) for kind, step in steps.items()}
        copied = {kind: count_copies(step) for kind, step in steps.items()}
        rebuilt = atoms.calc.rebuilds - built
        views = setup.comm.allgather((synced, copied))
        synced, copied = views[0]
        text = f"{prefix}reuse {synced['reuse']}, rebuild {synced['rebuild']}"
        values = {**synced, "rebuilds": rebuilt, "per_rank": [view[0] for view in views]}
        syncs.append(Row(SYNCS, name, text, "info" if rebuilt == 2 else "FAIL", values))
        text = prefix + "; ".join(
            f"{kind} " + " ".join(f"{label} {n}" for label, n in counts.items())
            for kind, counts in copied.items()
        )
        values = {**copied, "per_rank": [view[1] for view in views]}
        copies.append(Row(MEMCPY, name, text, "info", values))
    return syncs + copies


# -- 4. halo and identity across ranks ----------------------------------------------------------


def check_halo(setup: Setup) -> list[Row]:
    """SevenNet with the one-cutoff halo and exchanges equals the full receptive field."""
    rows = []
    for system_name, system in setup.systems.items():
        full = evaluate(attach(calculator(setup, setup.models["SevenNet"], halo="full"), system))
        setup.results["SevenNet", system_name, "full"] = full
        errors = relative_errors(setup.results["SevenNet", system_name, "layer"], full)
        text, verdict = within(errors)
        rows.append(Row(HALO, f"SevenNet / {system_name}", text, verdict, errors))
    return rows


def check_identical(setup: Setup) -> list[Row]:
    """Per model: every rank's results hash to the same digests."""
    rows = []
    for model_name in setup.models:
        mine = {
            "/".join(key[1:]): digest(values)
            for key, values in setup.results.items()
            if key[0] == model_name
        }
        views = setup.comm.allgather(mine)
        differing = sorted({k for view in views for k in view if view[k] != views[0][k]})
        text = f"{len(mine)} results, {setup.comm.size} rank(s): " + (
            "bitwise equal" if not differing else f"differ: {', '.join(differing)}"
        )
        rows.append(
            Row(
                IDENTICAL,
                model_name,
                text,
                "FAIL" if differing else "ok",
                {"results": len(mine), "differing": differing},
            )
        )
    return rows


# -- 5. compile ---------------------------------------------------------------------------------


def compile_verdict(errors: dict[str, float], views: list[tuple[int, int]]) -> str:
    """``FAIL``: not equal to eager, or ranks compiled differently; ``warn``: slow.

    ``views`` holds every rank's ``(graph breaks, unique graphs)``. Graph breaks
    and many graphs cost time, not correctness: what dynamo cannot compile runs
    eagerly.
    """
    if max(errors.values()) > RTOL or len(set(views)) > 1:
        return "FAIL"
    breaks, graphs = views[0]
    return "ok" if breaks == 0 and 1 <= graphs <= MAX_GRAPHS else "warn"


def check_compile(setup: Setup) -> list[Row]:
    """A first call, a reuse and a rebuild step compiled: graph breaks, graphs, vs eager.

    Graphs compiled after the first call are recompilations.
    """
    counters = torch._dynamo.utils.counters
    rows = []
    for name, model in setup.models.items():
        torch._dynamo.reset()
        counters.clear()
        atoms = attach(calculator(setup, model, compile=setup.backend), setup.systems["crystal"])
        halo = "layer" if name == "SevenNet" else "default"
        with warnings.catch_warnings():
            # calc.compile_fallbacks counts what this would repeat
            warnings.filterwarnings("ignore", "torch.compile could not compile")
            errors = relative_errors(evaluate(atoms), setup.results[name, "crystal", halo])
            first = int(counters["stats"]["unique_graphs"])
            for step in step_functions(atoms).values():
                step()
        breaks = dict(counters["graph_break"])
        graphs = int(counters["stats"]["unique_graphs"])
        views = setup.comm.allgather((sum(breaks.values()), graphs))
        text = (
            f"graph breaks {sum(breaks.values())}, unique graphs {graphs} "
            f"({first} at the first call), eager fall-backs {atoms.calc.compile_fallbacks}, "
            f"vs eager {max(errors.values()):.1e}"
        )
        values = {
            "graph_breaks": breaks,
            "compile_fallbacks": atoms.calc.compile_fallbacks,
            "unique_graphs": graphs,
            "first_call_graphs": first,
            "errors": errors,
            "backend": str(setup.backend),
            "per_rank": views,
        }
        rows.append(
            Row(COMPILE, f"{name} ({setup.backend})", text, compile_verdict(errors, views), values)
        )
    torch._dynamo.reset()
    return rows


# -- 6. time per step ---------------------------------------------------------------------------


def median_step(atoms: Atoms, steps: int) -> float:
    """Median seconds of ``steps`` reuse steps (after the first call and one more)."""
    atoms.get_forces()
    nudge(atoms, 1)
    atoms.get_forces()
    seconds = []
    for step in range(steps):
        nudge(atoms, step)
        start = time.perf_counter()
        atoms.get_forces()  # ends with the result on the host: no sync needed
        seconds.append(time.perf_counter() - start)
    return float(np.median(seconds))


def check_time(setup: Setup) -> list[Row]:
    """Median time of a reuse step per model, on :attr:`Setup.timing_system`."""
    rows = []
    n_atoms = len(setup.timing_system)
    for name, model in setup.models.items():
        atoms = attach(calculator(setup, model), setup.timing_system)
        seconds = max(setup.comm.allgather(median_step(atoms, TIMED_STEPS)))
        text = f"{1e3 * seconds:.2f} ms ({n_atoms} atoms, {setup.comm.size} rank(s))"
        rows.append(
            Row(
                TIME,
                name,
                text,
                "info",
                {"seconds": seconds, "atoms": n_atoms, "ranks": setup.comm.size},
            )
        )
    return rows


def compared(rows: list[Row], path: Path) -> list[Row]:
    """Rows putting another run's times (another rank count) next to this run's."""
    other = json.loads(path.read_text())
    theirs = {r["subject"]: r["values"] for r in other["rows"] if r["check"] == TIME}
    out = []
    for row in rows:
        if row.check != TIME or row.subject not in theirs:
            continue
        them = theirs[row.subject]
        if them["ranks"] == row.values["ranks"] or them["atoms"] != row.values["atoms"]:
            continue
        speedup = them["seconds"] / row.values["seconds"]
        text = (
            f"{1e3 * them['seconds']:.2f} ms on {them['ranks']} rank(s) ({path.name}); "
            f"speed-up {speedup:.2f}x"
        )
        out.append(
            Row(
                TIME,
                f"{row.subject} vs {them['ranks']} rank(s)",
                text,
                "info",
                {**them, "speedup": speedup},
            )
        )
    return out


# -- the table and the report -------------------------------------------------------------------

CHECK_STEPS = (
    (EXACT, check_exact),
    (PLACEMENT, check_placement),
    (SYNCS, check_steps),  # and MEMCPY
    (HALO, check_halo),
    (IDENTICAL, check_identical),
    (COMPILE, check_compile),
    (TIME, check_time),
)


def run_checks(setup: Setup) -> tuple[list[Row], dict[str, float]]:
    """Every check, in the order of the table, and the seconds each took.

    An exception fails its check; the calculator raises its errors on every
    rank, so all ranks go on to the next check together.
    """
    rows, seconds = [], {}
    for label, check in CHECK_STEPS:
        start = time.perf_counter()
        try:
            rows += check(setup)
        except Exception as exc:  # reported as the check's failure
            rows.append(Row(label, "-", f"{type(exc).__name__}: {exc}", "FAIL"))
        seconds[label] = time.perf_counter() - start
    return rows, seconds


def table(rows: list[Row]) -> str:
    """The rows as one Markdown table."""
    header = ("check", "subject", "result", "verdict")
    cells = [header] + [(r.check, r.subject, r.result, r.verdict) for r in rows]
    widths = [max(len(line[k]) for line in cells) for k in range(len(header))]

    def line(values) -> str:
        return "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), rule, *map(line, cells[1:])])


def verdict_line(summary: dict) -> str:
    """``FAILED: ...``, ``passed with warnings: ...`` or ``passed``."""
    if summary["failed"]:
        return "FAILED: " + ", ".join(summary["failed"])
    if summary["warnings"]:
        return "passed with warnings: " + ", ".join(summary["warnings"])
    return "passed"


def versions() -> dict[str, str | None]:
    return {
        "ase_shard": ase_shard.__version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
    }


def report(setup: Setup, rows: list[Row], devices: list[str], seconds: dict) -> dict:
    """The JSON written by rank 0."""
    return {
        "schema": SCHEMA,
        "ranks": setup.comm.size,
        "cuda": setup.cuda,
        "dry_run": not setup.cuda,
        "devices": devices,
        "versions": versions(),
        "systems": {name: len(atoms) for name, atoms in setup.systems.items()},
        "timing_atoms": len(setup.timing_system),
        "rows": [asdict(row) for row in rows],
        "check_seconds": seconds,
        "failed": [f"{row.check} / {row.subject}" for row in rows if row.verdict == "FAIL"],
        "warnings": [f"{row.check} / {row.subject}" for row in rows if row.verdict == "warn"],
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--json",
        type=Path,
        default=Path("gpu-check.json"),
        help="where rank 0 writes the report (default: gpu-check.json)",
    )
    parser.add_argument(
        "--compare",
        type=Path,
        help="another run's JSON (another rank count): its times are printed too",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="run on the CPU even where CUDA is available"
    )
    parser.add_argument(
        "--compile-backend",
        help="torch.compile backend (default: inductor on CUDA, aot_eager on the CPU)",
    )
    parser.add_argument(
        "--size", type=int, help="time steps on 4*size**3 atoms (default 8 on CUDA, 2 on CPU)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.getLogger("ase_shard.calculator").addFilter(Once())
    cuda = torch.cuda.is_available() and not args.dry_run
    setup = Setup(
        comm=Comm(),
        cuda=cuda,
        device=None if cuda else "cpu",
        backend=args.compile_backend or ("inductor" if cuda else "aot_eager"),
        neighbor_list="auto" if cuda else "torch",
        models=build_models(),
        systems=cu_systems(),
        timing_system=timing_system(args.size or (8 if cuda else 2)),
    )
    devices = setup.comm.allgather(str(calculator(setup, setup.models["EMT"]).device))
    rows, seconds = run_checks(setup)
    # rank 0 alone prints and reports the rows, so it alone reads the other run's report
    if args.compare is not None and setup.comm.is_root and args.compare.exists():
        rows += compared(rows, args.compare)
    failed = setup.comm.any(any(row.verdict == "FAIL" for row in rows))
    if setup.comm.is_root:
        summary = report(setup, rows, devices, seconds)
        mode = "CUDA" if cuda else "dry run on the CPU: " + NOT_RUN
        print(
            f"gpu-check: {setup.comm.size} rank(s) on {', '.join(devices)}; torch "
            f"{torch.__version__}, CUDA {torch.version.cuda}; {mode}"
        )
        print(table(rows))
        args.json.write_text(json.dumps(summary, indent=1, default=str))
        print(verdict_line(summary) + f"; report in {args.json}")
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
