"""``ase-shard bench`` (also ``--framework``) and ``scripts/bench_scaling.py``: the
reports are consistent.

Small systems, one rank in-process and two under their own ``mpirun``. Nothing here
asserts on how fast anything is: only that the fields fit together, that every subject
computed the same energies and forces as the bare model, that the bare model itself
equals ASE's EMT, and that steps meant to rebuild rebuilt.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import torch
from ase.build import bulk
from ase.calculators.emt import EMT as AseEMT
from background import launch_in_background
from oracles import ase_results, relative_errors
from sync_count import Autograd

from ase_shard.bench.bare import BareModel
from ase_shard.bench.framework import FRAMEWORK_PHASES
from ase_shard.bench.report import format_summary
from ase_shard.cli import main
from ase_shard.comm import Comm
from ase_shard.models import EMT
from ase_shard.timing import PHASES

pytestmark = [
    pytest.mark.skipif(Comm().size > 1, reason="runs ase-shard bench serially and under mpirun"),
    pytest.mark.timeout(240),
]

ROOT = Path(__file__).parents[1]
RTOL = 1e-10
MPIRUN = Path(sys.executable).parent / "mpirun"
MPI_ENV = dict(
    os.environ,
    OMPI_ALLOW_RUN_AS_ROOT="1",
    OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
    OMP_NUM_THREADS="1",
    HF_HUB_OFFLINE="1",
)
# small and quick: the timings mean nothing, the structure of the report does
QUICK = ["--reuse-steps", "2", "--rebuild-steps", "2", "--ceiling-seconds", "0.02"]
# 256 atoms, two steps of each kind
FRAMEWORK = ["bench", "--framework", "--size", "4", "--reuse-steps", "2", "--rebuild-steps", "2"]
# seconds per step by which a CPU time may exceed its wall time (the two clocks are read
# one after the other)
CLOCK_SLACK = 2e-3


@pytest.mark.parametrize("path", ["kernel", "autograd"])
def test_bare_model_equals_ase_emt(path: str) -> None:
    """The bare model (one periodic graph, reused neighbour list) is exact, through
    EMT's compiled kernel and through autograd."""
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(3)
    atoms.rattle(0.05, seed=1)
    model = EMT() if path == "kernel" else Autograd(EMT())
    bare = BareModel(model, skin=0.5, dtype=torch.float64, device=torch.device("cpu"))
    bare.build(atoms)
    atoms.positions += np.random.default_rng(2).uniform(-0.05, 0.05, atoms.positions.shape)
    out = bare.evaluate(atoms)  # on the list built before the move, within the skin
    got = {
        "energy": out["energy"],
        "energies": out["energies"],
        "forces": out["forces"],
        "stress": out["virial"] / atoms.get_volume(),
    }
    errors = relative_errors(got, ase_results(AseEMT(), atoms))
    assert max(errors.values()) < RTOL, errors
    assert set(bare.timer.totals) == set(PHASES)
    timed = ("neighbors", "forward") + (("backward",) if path == "autograd" else ())
    assert all(bare.timer.totals[phase] > 0 for phase in timed)


def check_cpu(wall: dict, cpu: dict, threads: list[int]) -> None:
    """CPU seconds per phase and rank (MPI excluded): as many as the wall-clock ones, none
    negative, none above the wall time times the rank's threads."""
    assert list(cpu) == list(wall) == list(PHASES)
    for phase in PHASES:
        assert len(cpu[phase]) == len(wall[phase])
        for rank, (c, w) in enumerate(zip(cpu[phase], wall[phase], strict=True)):
            assert -1e-9 <= c <= w * threads[rank] + CLOCK_SLACK, (phase, rank, c, w)
    assert sum(sum(values) for values in cpu.values()) > 0


def check_report(report: dict, ranks: int, n_atoms: int, subjects: set[str]) -> None:
    """Fields present and consistent with each other and with the settings."""
    assert report["schema"] == "ase-shard-bench/1"
    assert report["ranks"] == ranks and report["system"]["n_atoms"] == n_atoms
    assert len(report["threads_per_rank"]) == ranks
    results, settings = report["results"], report["settings"]
    assert set(results) == subjects
    steps = {"reuse": settings["reuse_steps"], "rebuild": settings["rebuild_steps"]}
    for name, result in results.items():
        kinds = ("reuse",) if name == "ase" else ("reuse", "rebuild")
        for kind in kinds:
            entry = result[kind]
            assert len(entry["samples_s"]) == len(entry["energies"]) == steps[kind]
            assert entry["step_s"] == pytest.approx(np.median(entry["samples_s"]))
            if name != "ase":
                # reuse steps keep the decomposition, rebuild steps rebuild every call
                assert entry["rebuilds"] == (steps[kind] if kind == "rebuild" else 0), name
                breakdown = entry["breakdown"]
                assert list(breakdown) == list(PHASES)
                n_ranks = ranks if name == "sharded" else 1
                assert all(len(values) == n_ranks for values in breakdown.values())
                assert all(min(values) >= 0 for values in breakdown.values())
                # the built-in potentials' kernels do all their work in "forward"
                assert min(breakdown["forward"]) > 0
                check_cpu(breakdown, entry["breakdown_cpu"], report["threads_per_rank"])
        # every subject saw the same positions, step by step
        if name != "bare":
            assert report["agreement"][name]["energy"] < RTOL
            assert report["agreement"][name]["forces"] < RTOL
        for memory in result.get("memory", []):
            assert memory["peak_rss_mb"] > 0
    for name in ("sharded", "sharded_1"):
        if name in results:
            layout = np.array(results[name]["layout"])
            n_ranks = ranks if name == "sharded" else 1
            assert layout.shape == (n_ranks, 3)
            rows, owned, nodes = layout.T
            assert owned.sum() == n_atoms
            assert (nodes >= owned).all() and (rows >= nodes).all()
    ratios = report["ratios"]

    def paired(a: str, b: str, kind: str) -> float:
        """Median of per-step ratios: the subjects took turns step by step."""
        return np.median(np.divide(results[a][kind]["samples_s"], results[b][kind]["samples_s"]))

    one = "sharded" if ranks == 1 else "sharded_1"
    for kind in ("reuse", "rebuild"):
        assert ratios[kind]["speedup_vs_bare"] == pytest.approx(paired("bare", "sharded", kind))
        assert ratios[kind]["speedup"] == pytest.approx(paired(one, "sharded", kind))
        assert ratios[kind]["sharded_1_over_bare"] == pytest.approx(paired(one, "bare", kind))
        assert ratios[kind]["efficiency"] == pytest.approx(ratios[kind]["speedup"] / ranks)
    ceiling = report["ceiling"]
    assert ceiling["iterations"] % ranks == 0
    assert len(ceiling["serial_samples_s"]) == steps["reuse"] + steps["rebuild"]
    ratio = np.divide(ceiling["serial_samples_s"], ceiling["split_samples_s"])
    assert ratios["ceiling"] == pytest.approx(np.median(ratio))
    assert ("memory_ratio" in ratios) == (ranks > 1)


def test_one_rank(tmp_path, capsys) -> None:
    """In-process, with ASE's EMT as the extra reference; JSON, PNG and summary."""
    json_path, png = tmp_path / "bench.json", tmp_path / "bench.png"
    args = ["bench", "--size", "3", "--ase-reference", "--json", str(json_path)]
    assert main([*args, "--plot", str(png), *QUICK]) == 0
    report = json.loads(json_path.read_text())
    check_report(report, 1, 108, {"bare", "sharded", "ase"})
    assert report["labels"]["model"] == "emt" and report["model"]["class"] == "EMT"
    assert "ase_over_sharded" in report["ratios"]
    assert png.stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "speed-up, 1 -> 1 rank" in out and "machine ceiling on 1 rank" in out
    assert "breakdown, wall ms per step" in out and "(CPU, MPI excluded)" in out
    assert "DIFFERS" not in out and "WARNING" not in out
    # a subject that computed something else is flagged, not just timed
    report["agreement"]["sharded"]["forces"] = 1e-3
    assert "sharded, 1 rank" in format_summary(report).split("DIFFERS")[0].splitlines()[-1]
    assert "WARNING: results differ from the bare model" in format_summary(report)


def test_rejects_bad_arguments(capsys) -> None:
    assert main(["bench", "--size", "2", "--reuse-steps", "0"]) == 2
    assert main(["bench", "--size", "2", "--model", "sevennet", "--ase-reference"]) == 2
    assert "--ase-reference" in capsys.readouterr().err
    assert main(["bench", "--size", "2", "--framework", "--ase-reference"]) == 2
    assert main(["bench", "--size", "2", "--framework", "--rebuild-steps", "0"]) == 2
    assert main(["bench", "--size", "2", "--model", "no-edge"]) == 2
    assert "--framework only" in capsys.readouterr().err


@pytest.mark.parametrize(("model", "package"), [("sevennet", "sevenn"), ("nequip", "nequip")])
def test_ml_model(tmp_path, model: str, package: str) -> None:
    """A random-weight ML model: the sharded calculator equals the bare model."""
    pytest.importorskip(package)
    json_path = tmp_path / "bench.json"
    args = ["bench", "--size", "2", "--model", model, "--ml-channels", "4"]
    args += ["--ml-layers", "2", "--ml-cutoff", "4.0", "--json", str(json_path), "--no-plot"]
    assert main([*args, *QUICK]) == 0
    report = json.loads(json_path.read_text())
    check_report(report, 1, 32, {"bare", "sharded"})
    assert report["model"]["num_layers"] == 2 and report["dtype"] == "float64"


def run_mpi(
    command: list[str], ranks: int, folder: Path, timeout: int = 180
) -> subprocess.CompletedProcess:
    """``command`` under ``mpirun -n ranks``; output through files in ``folder``."""
    if not MPIRUN.exists():
        pytest.skip(f"no {MPIRUN}")
    full = [str(MPIRUN), "--oversubscribe", "-n", str(ranks), *command]
    return run_logged(full, folder, timeout)


def run_logged(command: list[str], folder: Path, timeout: int) -> subprocess.CompletedProcess:
    """``command`` run to its end, its output written to files in ``folder`` and read back
    after it exits; a non-zero exit fails the test.

    These runs take place in the background (:func:`launches`) while other tests run
    ``bench`` in this process, whose CPU times per phase count every thread of the
    process: the thread that waits here reads no pipe while they are measured.
    """
    with open(folder / "stdout", "w") as out, open(folder / "stderr", "w") as err:
        returncode = subprocess.run(
            command, env=MPI_ENV, stdout=out, stderr=err, timeout=timeout
        ).returncode
    done = subprocess.CompletedProcess(
        command, returncode, (folder / "stdout").read_text(), (folder / "stderr").read_text()
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done


def launch_two_ranks(folder: Path) -> tuple[subprocess.CompletedProcess, Path]:
    json_path = folder / "bench.json"
    command = [sys.executable, "-m", "ase_shard.cli", "bench", "--size", "3"]
    command += ["--json", str(json_path), "--plot", str(folder / "bench.png"), *QUICK]
    return run_mpi(command, 2, folder), json_path


def test_two_ranks(launched) -> None:
    """SPMD under mpirun -n 2: one report, with the one-rank reference of the same run."""
    done, json_path = launched
    assert done.stdout.count("ase-shard bench: cu-bulk") == 1  # the summary, rank 0 only
    report = json.loads(json_path.read_text())
    check_report(report, 2, 108, {"bare", "sharded", "sharded_1"})
    # the imbalance per phase: the busiest rank's CPU over the mean, from the report
    for kind in ("reuse", "rebuild"):
        cpu = report["results"]["sharded"][kind]["breakdown_cpu"]
        line = next(
            line
            for line in done.stdout.splitlines()
            if line.startswith(f"    sharded, 2 ranks, {kind}: ") and "all phases" in line
        )
        printed = line.split(": ", 1)[1].split(" (")[0].split()
        for phase, value in zip(PHASES, printed, strict=True):
            spent = np.asarray(cpu[phase])
            if spent.mean() == 0:
                assert value == "-"
            else:
                assert 1.0 <= float(value) == pytest.approx(spent.max() / spent.mean(), abs=6e-3)


def check_framework(report: dict, ranks: int, model: str) -> None:
    """A ``bench --framework`` report of :data:`FRAMEWORK`: fields consistent, every
    requested rebuild rebuilt and no other step did, CPU within wall time."""
    assert report["schema"] == "ase-shard-bench-framework/1"
    assert report["ranks"] == ranks and report["system"]["n_atoms"] == 256
    assert report["labels"]["model"] == model
    threads = report["threads_per_rank"]
    assert len(threads) == ranks
    settings = report["settings"]
    assert settings["temperature"] == 300 and settings["timestep"] == 1
    steps = {"reuse": settings["reuse_steps"], "rebuild": settings["rebuild_steps"]}
    assert steps == {"reuse": 2, "rebuild": 2}
    schedule = report["schedule"]
    assert schedule[0] == "rebuild" and {k: schedule.count(k) for k in steps} == steps
    # the first call's build, then one per rebuild step
    assert report["rebuilds"] == 1 + steps["rebuild"]
    for kind, result in report["results"].items():
        assert result["steps"] == steps[kind]
        assert result["rebuilds"] == (steps[kind] if kind == "rebuild" else 0)
        baseline = np.array(result["baseline_samples_s"])
        framework = np.array(result["framework_samples_s"])
        sharded = np.array(result["sharded_step_samples_s"])
        for samples in (baseline, framework, sharded):
            assert samples.shape == (steps[kind], ranks) and (samples > 0).all()
        # the time inside calculate is part of the sharded step
        assert (framework <= sharded).all()
        assert result["baseline_s"] == pytest.approx(np.median(baseline[:, 0]))
        assert result["baseline_max_s"] == pytest.approx(np.median(baseline.max(axis=1)))
        assert result["framework_s"] == pytest.approx(np.median(framework.max(axis=1)))
        assert result["sharded_step_s"] == pytest.approx(np.median(sharded.max(axis=1)))
        for key, reference in (
            ("framework_over_baseline", baseline.max(axis=1)),
            ("framework_over_baseline_rank0", baseline[:, 0]),
        ):
            ratio = result[key]
            assert np.isfinite(ratio) and ratio > 0
            assert ratio == pytest.approx(np.median(framework.max(axis=1) / reference))
        wall, cpu = result["breakdown"], result["breakdown_cpu"]
        check_cpu(wall, cpu, threads)
        # the phases run inside calculate
        calculate = result["calculate_s"]
        assert calculate == pytest.approx(framework.mean(axis=0).tolist())
        for rank in range(ranks):
            assert sum(wall[phase][rank] for phase in PHASES) <= calculate[rank] + 1e-6
        # partitioning happens on rebuilds only
        assert (max(wall["partition"]) > 0) == (kind == "rebuild")
        framework_cpu = [sum(cpu[p][rank] for p in FRAMEWORK_PHASES) for rank in range(ranks)]
        assert result["framework_cpu_s"] == pytest.approx(framework_cpu)
        assert min(framework_cpu) > 0
        balance = result["framework_cpu_max_over_min"]
        assert balance == pytest.approx(max(framework_cpu) / min(framework_cpu)) and balance >= 1
    memory = report["memory"]
    assert len(memory) == ranks
    assert all(m["peak_rss_mb"] > 0 and m["start_rss_mb"] > 0 for m in memory)
    layout = np.array(report["layout"])
    assert layout.shape == (ranks, 3) and layout[:, 1].sum() == 256
    if model == "no-edge":
        # no pairs: the sharded atoms fly free, as with the zero calculator
        assert report["model"]["cutoff"] == 0.3 and report["max_force"] == 0
    else:
        assert report["max_force"] > 0


@pytest.mark.parametrize("model", ["no-edge", "emt"])
def test_framework_one_rank(tmp_path, capsys, model: str) -> None:
    """``bench --framework`` in-process: the no-edge model (its default) and EMT."""
    json_path = tmp_path / "framework.json"
    args = [*FRAMEWORK, "--json", str(json_path)]
    assert main(args if model == "no-edge" else [*args, "--model", model]) == 0
    check_framework(json.loads(json_path.read_text()), 1, model)
    out = capsys.readouterr().out
    assert "calculate / ZeroCalculator step" in out and "(CPU, MPI excluded" in out
    assert "WARNING" not in out


def launch_framework_two_ranks(folder: Path) -> tuple[subprocess.CompletedProcess, Path]:
    json_path = folder / "framework.json"
    command = [sys.executable, "-m", "ase_shard.cli", *FRAMEWORK, "--json", str(json_path)]
    return run_mpi(command, 2, folder), json_path


def test_framework_two_ranks(launched) -> None:
    """``bench --framework`` under mpirun -n 2: one report with both ranks' CPU."""
    done, json_path = launched
    assert done.stdout.count("ase-shard bench --framework: cu-bulk") == 1
    check_framework(json.loads(json_path.read_text()), 2, "no-edge")


def launch_scaling_helper(folder: Path) -> tuple[subprocess.CompletedProcess, Path]:
    if not MPIRUN.exists():
        pytest.skip(f"no {MPIRUN}")
    img = folder / "scaling.png"
    command = [sys.executable, str(ROOT / "scripts" / "bench_scaling.py"), "--sizes", "2"]
    command += ["--ranks", "1", "2", "--out-dir", str(folder), "--img", str(img), "--"]
    command += ["--no-plot", *QUICK]
    return run_logged(command, folder, timeout=200), folder


def test_scaling_helper(launched) -> None:
    """scripts/bench_scaling.py: runs 1 and 2 ranks, draws the curves, prints the table."""
    done, folder = launched
    table = [line for line in done.stdout.splitlines() if line.startswith("| 32 |")]
    assert [line.split("|")[2].strip() for line in table] == ["1", "2"]
    assert (folder / "scaling.png").stat().st_size > 10_000
    assert sorted(p.name for p in folder.glob("*.json")) == [
        "emt-cu-bulk-2-p1.json",
        "emt-cu-bulk-2-p2.json",
    ]


# the tests that launch their own mpirun, by name: their launches run one after the
# other in the background from the module's first test on, while the in-process tests
# run on the other core (tests/background.py); each test checks its own launch
LAUNCHES = {
    "test_two_ranks": launch_two_ranks,
    "test_framework_two_ranks": launch_framework_two_ranks,
    "test_scaling_helper": launch_scaling_helper,
}


@pytest.fixture(scope="module", autouse=True)
def launches(request, tmp_path_factory) -> Iterator[dict[str, Future]]:
    yield from launch_in_background(request, tmp_path_factory, LAUNCHES, lanes=1)


def test_sync_skew_script_reports_every_segment() -> None:
    """scripts/sync_skew.py: one line per rank with each segment's work and wait."""
    command = [sys.executable, str(ROOT / "scripts" / "sync_skew.py")]
    command += ["--work-ms", "2", "1", "--steps", "3"]
    done = subprocess.run(command, capture_output=True, text=True, env=MPI_ENV, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("rank ")]
    assert [line.split(":")[0] for line in lines] == ["rank 0"]
    works, waits = (re.findall(rf"{word} [\d.]+", lines[0]) for word in ("work", "wait"))
    assert len(works) == len(waits) == 2
