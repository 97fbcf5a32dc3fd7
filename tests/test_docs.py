"""The user-facing docs say what the code does: the calculator's signature and table,
and the measurements they cite.

docs/index.md shows ``ShardedCalculator``'s signature in a code block and one
table row per parameter; both are checked against ``inspect.signature``, so
a new parameter or a changed default fails here until the docs follow. The run
files in docs/bench are the evidence the docs cite: every cited one exists, and
every one is cited.
"""

from __future__ import annotations

import ast
import fnmatch
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


# ----------------------------------------------------------------------- docs/bench

BENCH = ROOT / "docs" / "bench"
# a path under docs/bench as the docs cite it (`docs/bench/x.json`, or `bench/x.json`
# from docs/): names, globs (*) and brace patterns ({1..8}, {a,b}); not ase_shard/bench/
CITATION = re.compile(r"(?<![\w/])(?:docs/)?bench/((?:[\w.*\-]|\{[^{}\s]*\})+)")


def _expand(pattern: str) -> list[str]:
    """A shell brace pattern's words: ``run{1..3}`` and ``{a,b}``, nested, in order."""
    group = re.search(r"\{([^{}]*)\}", pattern)
    if group is None:
        return [pattern]
    body = group.group(1)
    numbers = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    words = (
        [str(n) for n in range(int(numbers[1]), int(numbers[2]) + 1)]
        if numbers
        else body.split(",")
    )
    head, tail = pattern[: group.start()], pattern[group.end() :]
    return [path for word in words for path in _expand(head + word + tail)]


def _cited() -> dict[str, set[str]]:
    """Every docs/bench path the docs and README cite, expanded, with the files citing it."""
    cited: dict[str, set[str]] = {}
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for match in CITATION.finditer(doc.read_text()):
            for path in _expand(match.group(1).rstrip(".")):
                cited.setdefault(path, set()).add(doc.name)
    return cited


def test_brace_patterns_expand_as_the_shell_does() -> None:
    assert _expand("a-run{1..3}.json") == ["a-run1.json", "a-run2.json", "a-run3.json"]
    assert _expand("p{1,2}-{x,y}.{json,png}")[:3] == ["p1-x.json", "p1-x.png", "p1-y.json"]
    assert len(_expand("p{1,2}-{x,y}.{json,png}")) == 8
    text = "`docs/bench/a{1,2}.json`, [plot](bench/b.png). ase_shard/bench/harness.py"
    assert [m.group(1) for m in CITATION.finditer(text)] == ["a{1,2}.json", "b.png"]


def test_every_cited_bench_file_exists() -> None:
    files = sorted(p.name for p in BENCH.iterdir())
    missing = {
        path: sorted(docs) for path, docs in _cited().items() if not fnmatch.filter(files, path)
    }
    assert not missing, f"cited but not in docs/bench: {missing}"


def test_every_bench_file_is_cited() -> None:
    patterns = list(_cited())
    uncited = [
        p.name
        for p in sorted(BENCH.iterdir())
        if not any(fnmatch.fnmatch(p.name, c) for c in patterns)
    ]
    assert not uncited, f"in docs/bench but cited by no doc: {uncited}"
