"""The package's import graph: every arrow points down, and MPI is called from one place.

Read from the source (every ``import`` statement, also those inside functions), not
from what one run happens to import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ase_shard

pytestmark = pytest.mark.rank_independent

PACKAGE = Path(ase_shard.__file__).parent

# the one circle, documented in docs/design-notes.md: DistributedAtoms.__ase_optimizable__
# imports dynamics (and ASE's optimisers, scipy) only when a driver asks for it
LAZY_CIRCLE = {("ase_shard.distributed", "ase_shard.dynamics")}

# modules that may import mpi4py: comm (every collective) and worker (starting and
# spawning processes, before a Comm exists)
MPI_MODULES = {"ase_shard.comm", "ase_shard.worker"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, bool]]:
    """``(imported name, at top level?)`` for every import statement of ``path``."""
    tree = ast.parse(path.read_text())
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [(name, id(node) in top_level) for name in names]
    return found


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]], dict[str, set[str]]]:
    """(package edges, the top-level subset, every imported name) per module."""
    paths = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    edges = {name: set() for name in paths}
    top = {name: set() for name in paths}
    imported = {name: set() for name in paths}
    for name, path in paths.items():
        for target, at_top in _imports(path):
            imported[name].add(target)
            if target in paths and target != name:
                edges[name].add(target)
                if at_top:
                    top[name].add(target)
    return edges, top, imported


def circles(edges: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in edges[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(component)

    for node in edges:
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_but_the_documented_lazy_one() -> None:
    edges, top, _ = import_graph()
    allowed = [set(pair) for pair in LAZY_CIRCLE]
    assert [circle for circle in circles(edges) if circle not in allowed] == []
    # the allowed one stays lazy: at import time the graph has no circle at all
    assert circles(top) == []


def test_the_circle_check_finds_a_circle() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(edges) == [{"a", "b", "c"}]


def test_mpi_is_imported_by_comm_and_worker_only() -> None:
    _, _, imported = import_graph()
    users = {
        name
        for name, targets in imported.items()
        if any(target == "mpi4py" or target.startswith("mpi4py.") for target in targets)
    }
    assert users == MPI_MODULES
