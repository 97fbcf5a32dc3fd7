"""``ase-shard`` on bad inputs: numeric options, unreadable files, a file without a
cell, restarts with another model; in-process and under ``mpirun -n 3``.

Each case is a row of docs/reliability.md ("Bad inputs: command line"). A refusal
is one line on stderr and exit status 2, before anything runs or is written; under
``mpirun`` the line appears once, with no traceback and no ``MPI_ABORT``. Restarted
runs are checked frame by frame against ASE's own calculators, with their parameters
spelled out here.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from ase.build import bulk
from ase.calculators.lj import LennardJones as AseLennardJones
from ase.calculators.morse import MorsePotential as AseMorse
from ase.cluster import Icosahedron
from ase.io import read, write
from ase.md.verlet import VelocityVerlet
from background import launch_in_background

from ase_shard import md
from ase_shard.calculator import ShardedCalculator
from ase_shard.cli import POSITIVE, POSITIVE_INT, CLIError, Number, build_parser, main
from ase_shard.comm import Comm
from ase_shard.presets import resolve_model

pytestmark = [
    pytest.mark.skipif(Comm().size > 1, reason="runs ase-shard serially and under its own mpirun"),
    pytest.mark.timeout(120),
]
QUIET = ["--no-progress"]
# the physics ase-shard md's morse and lj stand for, spelled out
MORSE = {"epsilon": 0.35, "r0": 2.55, "rho0": 4.0}
ARGON = {"sigma": 3.4, "epsilon": 0.0104, "rc": 8.5, "smooth": True}


def error_line(argv: list[str], capsys) -> str:
    """The error line of ``ase-shard argv``, which must exit with status 2 having printed
    nothing on stdout (no run started) and nothing else on stderr but argparse's usage."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    *usage, line = captured.err.splitlines()
    assert all(text.startswith(("usage: ", " ")) for text in usage), captured.err
    return line


# ----------------------------------------------------------------------------- numbers


@pytest.mark.parametrize(
    ("command", "option", "value", "bound"),
    [
        ("md", "--temperature", "-100", "a finite number >= 0"),
        ("md", "--temperature", "inf", "a finite number >= 0"),
        ("md", "--temperature", "nan", "a finite number >= 0"),
        ("md", "--timestep", "nan", "a finite number > 0"),
        ("md", "--timestep", "0", "a finite number > 0"),
        ("md", "--steps", "-5", "an integer >= 0"),
        ("md", "--steps", "2.5", "an integer >= 0"),
        ("md", "--size", "0", "an integer >= 1"),
        ("md", "--interval", "0", "an integer >= 1"),
        ("md", "--seed", "-1", "an integer >= 0"),
        ("md", "--friction", "-0.01", "a finite number >= 0"),
        ("md", "--taut", "0", "a finite number > 0"),
        ("md", "--taup", "inf", "a finite number > 0"),
        ("md", "--pressure", "nan", "a finite number"),
        ("md", "--compressibility", "0", "a finite number > 0"),
        ("md", "--skin", "-0.1", "a finite number >= 0"),
        ("bench", "--ml-cutoff", "0", "a finite number > 0"),
        ("bench", "--ml-channels", "0", "an integer >= 1"),
        ("bench", "--threads", "0", "an integer >= 1"),
        ("bench", "--reuse-steps", "-1", "an integer >= 0"),
        ("bench", "--ceiling-seconds", "nan", "a finite number > 0"),
    ],
)
def test_bad_number_is_refused_at_parse_time(
    command: str, option: str, value: str, bound: str, capsys
) -> None:
    """Exit status 2 and the usage, then one line naming the option and the value."""
    line = error_line([command, option, value], capsys)
    assert line == f"ase-shard {command}: error: argument {option}: must be {bound}, not {value!r}"


@pytest.mark.parametrize("option", ["--reuse-steps", "--rebuild-steps"])
def test_benchmark_needs_steps_of_each_kind(option: str, capsys) -> None:
    """0 parses (``--peer`` runs the sum of both), the benchmark refuses it by name."""
    line = error_line(["bench", "--size", "2", option, "0"], capsys)
    assert line == (
        f"ase-shard bench: error: {option} must be >= 1 (the benchmark times both kinds), not 0"
    )


def test_number_type_names_the_bound() -> None:
    with pytest.raises(
        argparse.ArgumentTypeError, match=r"^must be a finite number > 0, not 'nan'$"
    ):
        POSITIVE("nan")
    with pytest.raises(argparse.ArgumentTypeError, match=r"^must be an integer >= 1, not '1e3'$"):
        POSITIVE_INT("1e3")
    assert POSITIVE("1e-3") == 1e-3 and POSITIVE_INT(" 7 ") == 7


def test_edge_values_are_accepted() -> None:
    """0 K, a negative pressure, no friction, no skin and no steps are legitimate."""
    argv = ["md", "--temperature", "0", "--pressure", "-500", "--friction", "0", "--skin", "0"]
    args = build_parser().parse_args([*argv, "--steps", "0", "--seed", "0"])
    assert (args.temperature, args.pressure, args.friction, args.skin) == (0, -500, 0, 0)
    assert args.steps == 0 and isinstance(args.steps, int)


def test_every_numeric_option_is_checked() -> None:
    """No option of any subcommand parses with bare ``int`` or ``float``."""
    subcommands = next(
        a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    )
    checked = 0
    for name, parser in subcommands.choices.items():
        for action in parser._actions:
            assert action.type not in (int, float), f"{name} {action.option_strings}"
            checked += isinstance(action.type, Number)
    assert checked >= 20


# ----------------------------------------------------------------------------- files


@pytest.mark.parametrize(
    ("name", "content", "said"),
    [
        ("garbage.cif", "garbage\n", "AssertionError (no message)"),
        ("empty.xyz", "", "UnknownFileTypeError: Empty file: {path}"),
        (
            "bad.xyz",
            "2\n\nCu 0 0 0\nCu x 0 0\n",
            "ValueError: could not convert string to float: 'x'",
        ),
        ("missing.xyz", None, "FileNotFoundError: [Errno 2] No such file or directory: '{path}'"),
    ],
)
def test_unreadable_structure_file_is_one_line(
    name: str, content: str | None, said: str, tmp_path: Path, capsys
) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    reason = said.format(path=path)
    line = error_line(["md", str(path), "--steps", "1"], capsys)
    assert (
        line == f"ase-shard md: error: structure file {path}: ase.io.read cannot read it: {reason}"
    )
    line = error_line(["md", "--restart", str(path), "--steps", "1"], capsys)
    assert line == f"ase-shard md: error: --restart {path}: ase.io.read cannot read it: {reason}"


def test_xyz_without_lattice_warns_once(tmp_path: Path, capsys) -> None:
    """A crystal written as plain XYZ: one warning, and the run is a cluster (pbc all
    False). No warning with Lattice, for a built-in cluster, or for a cluster in a
    format that records the cell (.traj)."""
    plain, extended = tmp_path / "plain.xyz", tmp_path / "cell.xyz"
    crystal = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(2)
    write(plain, crystal, format="xyz")
    write(extended, crystal, format="extxyz")
    cluster = tmp_path / "cluster.traj"
    write(cluster, Icosahedron("Cu", noshells=2, latticeconstant=3.61))
    out = tmp_path / "out.traj"
    assert main(["md", str(plain), "--steps", "0", "--trajectory", str(out), *QUIET]) == 0
    (warning,) = capsys.readouterr().err.splitlines()
    assert warning == (
        f"ase-shard md: warning: {plain} has no Lattice: no cell and no periodic boundaries, "
        'so it runs as an isolated cluster (for a crystal, add Lattice="..." and pbc="T T T" '
        "to its comment line)"
    )
    assert not read(out).pbc.any()
    assert main(["md", str(extended), "--steps", "0", *QUIET]) == 0
    assert main(["md", "--system", "cu-cluster", "--size", "2", "--steps", "0", *QUIET]) == 0
    assert main(["md", str(cluster), "--steps", "0", *QUIET]) == 0
    assert capsys.readouterr().err == ""


# ----------------------------------------------------------------------------- restarts


def physics_record(model: str, parameters: str, temperature: float, compressibility: float):
    return {
        "md_model": model,
        "md_model_parameters": parameters,
        "md_temperature_K": temperature,
        "md_compressibility_per_bar": compressibility,
    }


MORSE_RECORD = physics_record("morse", "epsilon=0.35, r0=2.55, rho0=4.0", 300.0, 7e-7)


@pytest.mark.parametrize("suffix", [".traj", ".xyz"])
def test_restart_runs_the_recorded_model(suffix: str, tmp_path: Path, capsys) -> None:
    """morse, restarted without --model: every frame, the appended ones too, is ASE's
    MorsePotential's and records morse (before: the restart ran EMT)."""
    traj = tmp_path / f"md{suffix}"
    argv = ["md", "--size", "2", "--interval", "2", *QUIET]
    assert main([*argv, "--model", "morse", "--steps", "2", "--trajectory", str(traj)]) == 0
    assert main(["md", "--restart", str(traj), "--steps", "2", "--interval", "2", *QUIET]) == 0
    assert "32 atoms, morse (Morse)" in capsys.readouterr().out
    frames = read(traj, ":")
    assert [frame.info["md_step"] for frame in frames] == [0, 2, 4]
    for frame in frames:
        assert {key: frame.info[key] for key in MORSE_RECORD} == MORSE_RECORD
        energy, forces = frame.get_potential_energy(), frame.get_forces()
        frame.calc = AseMorse(**MORSE)
        assert energy == pytest.approx(frame.get_potential_energy(), rel=1e-10, abs=1e-9)
        np.testing.assert_allclose(forces, frame.get_forces(), atol=1e-7)  # .xyz: 8 digits


@pytest.mark.parametrize("suffix", [".traj", ".xyz"])
def test_restart_with_another_model_is_refused(suffix: str, tmp_path: Path, capsys) -> None:
    """The message names both models; nothing is appended."""
    traj = tmp_path / f"md{suffix}"
    argv = ["md", "--size", "2", "--model", "morse", "--steps", "2", "--trajectory", str(traj)]
    assert main([*argv, *QUIET]) == 0
    capsys.readouterr()
    written = traj.read_bytes()
    line = error_line(["md", "--restart", str(traj), "--model", "emt", "--steps", "2"], capsys)
    assert line == (
        f"ase-shard md: error: --restart {traj} was written with --model morse, not emt: "
        "a restart runs the model that wrote the trajectory; leave --model out, or start a "
        f"new run from its last frame (ase-shard md {traj} --model emt)"
    )
    assert traj.read_bytes() == written


def test_restart_without_a_record_needs_model(tmp_path: Path, capsys) -> None:
    """Frames of an older version (md_step, no md_model): refused without --model; with
    it, the run goes on and its frames record the model."""
    traj = tmp_path / "old.xyz"
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(2)
    atoms.info = {"md_step": 10, "md_time_fs": 20.0}
    write(traj, atoms, format="extxyz")
    line = error_line(["md", "--restart", str(traj), "--steps", "2"], capsys)
    assert line == (
        f"ase-shard md: error: --restart {traj}: its frames do not record which model wrote "
        "them (written before ase-shard md recorded it): give --model, the model that wrote "
        "them"
    )
    argv = ["md", "--restart", str(traj), "--model", "morse", "--steps", "2", "--interval", "2"]
    assert main([*argv, *QUIET]) == 0
    last = read(traj)
    assert last.info["md_step"] == 12 and last.info["md_model"] == "morse"


def test_restart_of_argon_keeps_lj_and_its_temperature(tmp_path: Path, capsys) -> None:
    """ar-liquid (lj, 180 K) under Langevin, restarted without --model or --temperature:
    LJ argon at 180 K (before: EMT, which refuses argon, and 300 K)."""
    traj = tmp_path / "ar.traj"
    argv = ["md", "--ensemble", "langevin", "--interval", "2", *QUIET]
    assert (
        main(
            [
                *argv,
                "--system",
                "ar-liquid",
                "--size",
                "2",
                "--steps",
                "2",
                "--trajectory",
                str(traj),
            ]
        )
        == 0
    )
    assert main([*argv, "--restart", str(traj), "--steps", "2"]) == 0
    assert "32 atoms, lj (LennardJones)" in capsys.readouterr().out
    want = physics_record("lj", "sigma=3.4, epsilon=0.0104, rc=8.5, smooth=True", 180.0, 2e-4)
    frames = read(traj, ":")
    assert len(frames) == 3
    for frame in frames:
        assert {key: frame.info[key] for key in want} == want
        energy = frame.get_potential_energy()
        frame.calc = AseLennardJones(**ARGON)
        assert energy == pytest.approx(frame.get_potential_energy(), rel=1e-10, abs=1e-9)


def recorded(**changes) -> md.Physics:
    """The record of a morse run at 300 K, with ``changes``."""
    fields = {
        "model": "morse",
        "parameters": "epsilon=0.35, r0=2.55, rho0=4.0",
        "modality": None,
        "temperature": 300.0,
        "compressibility": 7e-7,
    }
    return md.Physics(**{**fields, **changes})


def test_restart_model_refuses_what_differs(tmp_path: Path) -> None:
    """Parameters changed since, another modality, a model file gone."""
    with pytest.raises(
        CLIError,
        match=r"^--restart x\.xyz was written with --model morse \(epsilon=0\.3, r0=2\.55, "
        r"rho0=4\.0\), but this version's morse has \(epsilon=0\.35, r0=2\.55, rho0=4\.0\): "
        r"not the same potential$",
    ):
        md.restart_model(
            "x.xyz", recorded(parameters="epsilon=0.3, r0=2.55, rho0=4.0"), None, None
        )
    with pytest.raises(
        CLIError,
        match=r"^--restart x\.xyz was written with --model morse and --modality PBE, not R2SCAN$",
    ):
        md.restart_model("x.xyz", recorded(modality="PBE"), None, "R2SCAN")
    gone = tmp_path / "gone.model"
    with pytest.raises(
        CLIError,
        match=rf"^--restart x\.xyz was written with --model {gone}, which is not available "
        rf"here: unknown model '{gone}'",
    ):
        md.restart_model("x.xyz", recorded(model=str(gone), parameters=""), None, None)
    spec, modality = md.restart_model("x.xyz", recorded(modality="PBE"), None, None)
    assert (spec.kind, spec.source, modality) == ("builtin", "morse", "PBE")
    # a model file with other weights at the same path is another model (its digest)
    weights = tmp_path / "w.pth"
    weights.write_bytes(b"first weights")
    digest = md.model_parameters(resolve_model(str(weights)))
    written = recorded(model=str(weights), parameters=digest)
    assert written.parameters.startswith("sha256=")
    assert md.restart_model("x.xyz", written, None, None)[0].source == str(weights)
    weights.write_bytes(b"other weights")
    with pytest.raises(CLIError, match=r"but the file now has \(sha256=[0-9a-f]{16}\): other"):
        md.restart_model("x.xyz", written, None, None)


# ----------------------------------------------------------------------------- progress


def test_rate_counts_from_the_end_of_the_first_force_call(monkeypatch, capsys) -> None:
    """On a clock that the first force call moves by 100 s and each step by 1 s: the
    progress and the summary give 1 step/s (with the first call, 10 steps in 110 s would
    be 0.09), and the summary the 100 s apart."""
    clock = SimpleNamespace(now=1000.0)
    monkeypatch.setattr(md, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    calculate, step = ShardedCalculator.calculate, VelocityVerlet.step

    def first_call_takes_100_s(self, *args, **kwargs):
        calculate(self, *args, **kwargs)
        if clock.now == 1000.0:  # the first call
            clock.now += 100.0

    def step_takes_1_s(self, *args, **kwargs):
        step(self, *args, **kwargs)
        clock.now += 1.0

    monkeypatch.setattr(ShardedCalculator, "calculate", first_call_takes_100_s)
    monkeypatch.setattr(VelocityVerlet, "step", step_takes_1_s)
    assert main(["md", "--size", "2", "--steps", "10"]) == 0
    captured = capsys.readouterr()
    rates = re.findall(r"^ *(\d+)% +\d+/10 steps +([\d.]+) steps/s", captured.err, re.M)
    assert rates == [("0", "0.00")] + [(str(10 * n), "1.00") for n in range(1, 11)]
    assert "  wall time      110.00 s, of which 100.00 s the first force call" in captured.out
    assert "  steps/s        1.000 after the first force call" in captured.out


# ----------------------------------------------------------------------------- mpirun

RANKS = 3


def ase_shard_command() -> list[str]:
    script = Path(sys.executable).parent / "ase-shard"
    return [str(script)] if script.exists() else [sys.executable, "-m", "ase_shard.cli"]


def on_ranks(argv: list[str], folder: Path) -> subprocess.CompletedProcess:
    """``mpirun -n 3 ase-shard argv`` in ``folder``, under ``timeout``."""
    mpirun = Path(sys.executable).parent / "mpirun"
    if not mpirun.exists():
        pytest.skip(f"no {mpirun}")
    allow = {f"{p}_ALLOW_RUN_AS_ROOT{s}": "1" for p in ("OMPI", "PRTE") for s in ("", "_CONFIRM")}
    env = dict(os.environ, OMP_NUM_THREADS="1", **allow)
    command = [str(mpirun), "--oversubscribe", "-n", str(RANKS), *ase_shard_command(), *argv]
    return subprocess.run(
        ["timeout", "-k", "10", "200", *command],
        env=env,
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=230,
    )


def _garbage_cif(folder: Path) -> subprocess.CompletedProcess:
    (folder / "garbage.cif").write_text("garbage\n")
    return on_ranks(["md", "garbage.cif", "--steps", "2"], folder)


def _restart_other_model(folder: Path) -> subprocess.CompletedProcess:
    write_morse = [*ase_shard_command(), "md", "--size", "2", "--model", "morse", "--steps", "2"]
    subprocess.run(
        [*write_morse, "--trajectory", "out.xyz", *QUIET],
        cwd=folder,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        check=True,
        capture_output=True,
        timeout=100,
    )
    return on_ranks(["md", "--restart", "out.xyz", "--model", "emt", "--steps", "2"], folder)


def _restart_no_record(folder: Path) -> subprocess.CompletedProcess:
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(2)
    atoms.info = {"md_step": 10, "md_time_fs": 20.0}
    write(folder / "old.xyz", atoms, format="extxyz")
    return on_ranks(["md", "--restart", "old.xyz", "--steps", "2"], folder)


def _cluster(folder: Path) -> subprocess.CompletedProcess:
    write(folder / "plain.xyz", bulk("Cu", "fcc", a=3.61, cubic=True).repeat(2), format="xyz")
    return on_ranks(["md", "plain.xyz", "--steps", "2", *QUIET], folder)


# launch -> (argv or a launch function, exit status, the one line it must print)
MPIRUN_CASES = {
    "temperature": (
        ["md", "--temperature", "-100"],
        2,
        "ase-shard md: error: argument --temperature: must be a finite number >= 0, not '-100'",
    ),
    "timestep": (
        ["md", "--timestep", "nan"],
        2,
        "ase-shard md: error: argument --timestep: must be a finite number > 0, not 'nan'",
    ),
    "steps": (
        ["md", "--steps", "-5"],
        2,
        "ase-shard md: error: argument --steps: must be an integer >= 0, not '-5'",
    ),
    "garbage-cif": (
        _garbage_cif,
        2,
        "ase-shard md: error: structure file garbage.cif: ase.io.read cannot read it: "
        "AssertionError (no message)",
    ),
    "restart-other-model": (
        _restart_other_model,
        2,
        "ase-shard md: error: --restart out.xyz was written with --model morse, not emt: a "
        "restart runs the model that wrote the trajectory; leave --model out, or start a new "
        "run from its last frame (ase-shard md out.xyz --model emt)",
    ),
    "restart-no-record": (
        _restart_no_record,
        2,
        "ase-shard md: error: --restart old.xyz: its frames do not record which model wrote "
        "them (written before ase-shard md recorded it): give --model, the model that wrote "
        "them",
    ),
    "cluster-warning": (
        _cluster,
        0,
        "ase-shard md: warning: plain.xyz has no Lattice: no cell and no periodic boundaries, "
        'so it runs as an isolated cluster (for a crystal, add Lattice="..." and pbc="T T T" '
        "to its comment line)",
    ),
}


def _launch(case: str, folder: Path) -> subprocess.CompletedProcess:
    how = MPIRUN_CASES[case][0]
    return how(folder) if callable(how) else on_ranks(how, folder)


LAUNCHES = {case: (lambda folder, case=case: _launch(case, folder)) for case in MPIRUN_CASES}
USERS = {case: (f"test_under_mpirun_three_ranks[{case}]",) for case in MPIRUN_CASES}


@pytest.fixture(scope="module", autouse=True)
def launches(request, tmp_path_factory) -> Iterator[dict[str, Future]]:
    yield from launch_in_background(request, tmp_path_factory, LAUNCHES, lanes=2, users=USERS)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", MPIRUN_CASES)
def test_under_mpirun_three_ranks(case: str, launches: dict[str, Future]) -> None:
    """Every rank runs the command; the line appears once, with the exit status, and
    no traceback or MPI_ABORT."""
    done = launches[case].result()
    _, status, line = MPIRUN_CASES[case]
    output = done.stdout + done.stderr
    assert done.returncode == status, output
    assert output.count(line) == 1, output
    assert "Traceback" not in output and "MPI_ABORT" not in output
    if status == 0:
        assert done.stdout.count("ase-shard md summary") == 1
