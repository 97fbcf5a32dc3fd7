"""The user-facing docs say what the code does: the calculator's signature and table.

docs/index.md shows ``ShardedCalculator``'s signature in a code block and one
table row per parameter; both are checked against ``inspect.signature``, so
a new parameter or a changed default fails here until the docs follow.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

from ase_shard import ShardedCalculator

ROOT = Path(__file__).resolve().parents[1]
INDEX = (ROOT / "docs" / "index.md").read_text()


def _documented_signature() -> dict[str, str | None]:
    """Parameter names and default source texts of the signature block in docs/index.md."""
    block = re.search(r"```python\n(ShardedCalculator\(.*?\))\n```", INDEX, re.DOTALL)
    assert block, "no ShardedCalculator(...) code block in docs/index.md"
    call = ast.parse(f"def f{block.group(1).removeprefix('ShardedCalculator')}: pass").body[0]
    arguments = call.args
    defaults = dict(
        zip(
            [a.arg for a in arguments.kwonlyargs],
            [ast.unparse(d) if d is not None else None for d in arguments.kw_defaults],
            strict=True,
        )
    )
    return {**{a.arg: None for a in arguments.args}, **defaults}


def test_signature_block_matches_the_code() -> None:
    code = {
        name: None if p.default is inspect.Parameter.empty else repr(p.default)
        for name, p in inspect.signature(ShardedCalculator.__init__).parameters.items()
        if name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD
    }
    documented = _documented_signature()
    assert documented.keys() == code.keys()
    for name, default in code.items():
        if default is not None:
            assert ast.literal_eval(documented[name]) == ast.literal_eval(default), name


def test_every_parameter_has_a_table_row() -> None:
    for name in _documented_signature():
        assert re.search(rf"^\| `{name}` \|", INDEX, re.MULTILINE), name


def test_help_on_init_shows_the_parameters() -> None:
    text = ShardedCalculator.__init__.__doc__
    assert "min_distance" in text and "neighbor_list" in text


def test_readme_says_what_root_sets() -> None:
    readme = (ROOT / "README.md").read_text()
    for name in ("OMPI_ALLOW_RUN_AS_ROOT=1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"):
        assert name in readme
