"""``ase-shard`` answers ``--help`` and usage errors without importing torch.

Whether torch is imported is deterministic, unlike a timing: these tests check
``sys.modules`` in a fresh interpreter.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ase_shard import cli
from ase_shard.comm import Comm

pytestmark = [
    pytest.mark.skipif(Comm().size > 1, reason="starts its own interpreters"),
    pytest.mark.timeout(120),
]
PACKAGE = Path(cli.__file__).parent
HEAVY = ("torch", "ase_shard.calculator", "ase_shard.bench", "ase_shard.md", "ase_shard.models")


def heavy_modules(code: str) -> list[str]:
    """The modules of ``HEAVY`` that a fresh interpreter has imported after ``code``."""
    probe = f"{code}\nimport sys\nprint('HEAVY', *(m for m in {HEAVY!r} if m in sys.modules))"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    return done.stdout.splitlines()[-1].split()[1:]


def test_cli_module_alone_imports_no_torch() -> None:
    """cli.py itself: the package's __init__ is bypassed with an empty package."""
    bypass = (
        "import sys, types\n"
        "package = types.ModuleType('ase_shard')\n"
        f"package.__path__ = [{str(PACKAGE)!r}]\n"
        "package.__version__ = '0'\n"
        "sys.modules['ase_shard'] = package\n"
        "import ase_shard.cli as cli\n"
        "parser = cli.build_parser()\n"
        "for argv in (['md', '--help'], ['bench', '--help'], ['md', '--ensemble', 'x']):\n"
        "    try:\n"
        "        parser.parse_args(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "assert cli.main(['md', '--model', 'nonsense']) == 2\n"
    )
    assert heavy_modules(bypass) == []


def test_parser_imports_no_torch() -> None:
    """The installed entry point's imports: ase_shard, then ase_shard.cli."""
    assert heavy_modules("import ase_shard.cli, sys\nase_shard.cli.build_parser()") == []


def test_choices_match_the_modules_that_define_them() -> None:
    """cli.py spells out choices that torch-heavy modules define."""
    from ase_shard import balance, md, partition, random_models, settings

    assert cli.HALOS == settings.HALOS
    assert cli.PARTITIONS == partition.PARTITIONS
    assert cli.BALANCES == balance.BALANCES
    assert cli.BENCH_MODELS == tuple(random_models.ML_MODELS)
    assert cli.BUILTIN_MODELS == tuple(md.MODELS)


@pytest.mark.parametrize(
    ("argv", "code", "stream", "text"),
    [
        (["--help"], 0, "stdout", "usage: ase-shard"),
        (["md", "--help"], 0, "stdout", "--restart TRAJ"),
        (["bench", "--help"], 0, "stdout", "--framework"),
        (["md", "--ensemble", "npt"], 2, "stderr", "invalid choice: 'npt'"),
        (["md", "--model", "nonsense"], 2, "stderr", "unknown model 'nonsense'"),
        (["md", "--size", "0"], 2, "stderr", "argument --size: must be an integer >= 1, not '0'"),
    ],
)
def test_entry_point_answers(argv: list[str], code: int, stream: str, text: str) -> None:
    """The ``ase-shard`` script: exit code and message (subprocess)."""
    script = Path(sys.executable).parent / "ase-shard"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "ase_shard.cli"]
    done = subprocess.run([*command, *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == code, done.stderr
    assert text in getattr(done, stream)
    if code == 2:
        assert "Traceback" not in done.stderr
