"""The stepgraph package's imports form no circle.

The import graph is read from the source (ast), not by importing: an edge A -> B for every
`import B` / `from B import name` (B.name where that is a module) that A holds, at module
level (also under `if TYPE_CHECKING:`: an annotation naming a module that imports this one
ties the two into a circle as much as a run-time import) or, for the second graph, deferred
into functions as well. Neither graph may have a cycle.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "stepgraph"

def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its __init__.py)."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _import_nodes(body: list, deferred: bool):
    """The import statements of `body` (under any `if`, TYPE_CHECKING included; functions'
    bodies too if deferred)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
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


def test_type_checking_imports_are_edges():
    """An import under `if TYPE_CHECKING:` is read as an edge (no module of the package has
    one now, so a snippet stands in)."""
    tree = ast.parse("from typing import TYPE_CHECKING\n"
                     "if TYPE_CHECKING:\n"
                     "    from ..nn.module import Buffer, Parameter\n")
    nodes = list(_import_nodes(tree.body, deferred=False))
    assert len(nodes) == 2
    assert _targets("stepgraph.ir.trace", False, nodes[1], _modules()) == \
        {"stepgraph.nn.module"}


def test_module_level_imports_form_no_cycle():
    cycle = find_cycle(import_graph(deferred=False))
    assert cycle is None, f"module-level import cycle: {' -> '.join(cycle)}"


def test_deferred_imports_form_no_cycle_either():
    cycle = find_cycle(import_graph(deferred=True))
    assert cycle is None, f"import cycle (deferred imports included): {' -> '.join(cycle)}"

