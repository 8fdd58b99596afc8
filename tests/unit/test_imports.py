"""The stepgraph package's imports form no circle.

The import graph is read from the source (ast), not by importing: an edge A -> B for every
`import B` / `from B import name` (B.name where that is a module) that A runs. Imports under
`if TYPE_CHECKING:` never run and are left out. Module-level imports may form no cycle at
all. Imports deferred into functions may close a cycle only where KNOWN_DEFERRED lists it,
with the reason; every entry must still close one, so the list can only shrink. None may
close a cycle among the core packages (CORE).
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "stepgraph"
CORE = ("stepgraph.ir", "stepgraph.ops", "stepgraph.autodiff", "stepgraph.backends.numpy",
        "stepgraph.nn")

# (importer, imported) of each deferred import that closes a cycle, and why it is there.
KNOWN_DEFERRED = {
    ("stepgraph.api", "stepgraph.profile"):
        "TrainStep.profile runs profile.py, which reads the API's precisions",
}


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its __init__.py)."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
    return name == "TYPE_CHECKING"


def _import_nodes(body: list, deferred: bool):
    """The import statements that run when `body` runs (functions' bodies too if deferred)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node):
                yield from _import_nodes(node.body, deferred)
            yield from _import_nodes(node.orelse, deferred)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if deferred:
                yield from _import_nodes(node.body, deferred)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody,
                          *(h.body for h in node.handlers)):
                yield from _import_nodes(block, deferred)
        elif isinstance(node, (ast.ClassDef, ast.With, ast.For, ast.While)):
            yield from _import_nodes(node.body, deferred)


def _targets(module: str, is_package: bool, node, modules) -> set[str]:
    """The package modules an import statement of `module` imports."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in modules}
    source = node.module or ""
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - node.level + 1]
        source = ".".join(base + ([node.module] if node.module else []))
    found = {f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source
             for a in node.names}
    return {t for t in found if t in modules}


def import_graph(deferred: bool) -> dict[str, set[str]]:
    """module -> the package modules it imports (at module level, or also in functions)."""
    return {name: set(imported) for name, imported in _parsed_graph(deferred).items()}


@functools.cache
def _parsed_graph(deferred: bool) -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[name] = set()
        for node in _import_nodes(tree.body, deferred):
            graph[name] |= _targets(name, path.name == "__init__.py", node, modules)
        graph[name].discard(name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle [a, b, ..., a] of the graph, or None."""
    state: dict[str, int] = {}                     # 1: on the current path, 2: done
    for root in sorted(graph):
        if root in state:
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = {start}, [start]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt == goal:
                return True
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return False


def test_find_cycle_finds_one_and_only_where_there_is_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"b", "c"}, "c": set()}) == ["b", "b"]


def test_graph_reads_relative_submodule_and_deferred_imports():
    module_level, deferred = import_graph(False), import_graph(True)
    assert "stepgraph.ir.ops" in module_level["stepgraph.ir.trace"]        # from .ops import
    assert "stepgraph.ops.linear" in module_level["stepgraph.ops"]         # from . import linear
    assert "stepgraph.backends.cuda.backend" not in module_level["stepgraph.backends"]
    assert "stepgraph.backends.cuda.backend" in deferred["stepgraph.backends"]


def test_module_level_imports_form_no_cycle():
    assert find_cycle(import_graph(deferred=False)) is None, \
        f"module-level import cycle: {' -> '.join(find_cycle(import_graph(False)))}"


def test_deferred_imports_close_only_the_known_cycles():
    graph = import_graph(deferred=True)
    for importer, imported in KNOWN_DEFERRED:
        graph[importer].discard(imported)
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle (deferred imports included): {' -> '.join(cycle)}"


def test_known_cycles_still_exist_and_spare_the_core():
    graph = import_graph(deferred=True)
    for (importer, imported), why in KNOWN_DEFERRED.items():
        assert not importer.startswith(CORE), f"{importer} is core: fix its cycle ({why})"
        assert imported in graph[importer], \
            f"{importer} no longer imports {imported}: remove it from KNOWN_DEFERRED"
        assert _reaches(graph, imported, importer), \
            f"{importer} -> {imported} closes no cycle now: remove it from KNOWN_DEFERRED"
