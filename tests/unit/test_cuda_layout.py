"""The CUDA backend's module structure, read from the source: none of its imports needs the
package root's __init__ to have run, the version is a leaf module, and the GPU tests (which
nothing imports without a GPU) import names that exist. (That the imports form no circle is
tests/unit/test_imports.py's.)"""
from __future__ import annotations

import ast
from pathlib import Path

import stepgraph
from stepgraph import version

PACKAGE_ROOT = Path(stepgraph.__file__).parent
CUDA_ROOT = PACKAGE_ROOT / "backends" / "cuda"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    """Whether dotted `name` is a module or package of stepgraph's source tree."""
    path = PACKAGE_ROOT.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _type_checking_only(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def runtime_imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every `from X import names` and `import X` that runs (at import or
    in a function; not under `if TYPE_CHECKING:`), relative modules resolved."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path.parent)
    found = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if _type_checking_only(child):
                continue
            if isinstance(child, ast.ImportFrom):
                base = package.split(".")
                if child.level:
                    base = base[:len(base) - child.level + 1]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module
                found.append((target, [alias.name for alias in child.names]))
            elif isinstance(child, ast.Import):
                found.extend((alias.name, []) for alias in child.names)
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def test_the_cuda_backend_imports_no_name_of_the_package_root():
    """`from stepgraph import X` needs stepgraph/__init__ to have run unless X is a module;
    the backend is imported while that __init__ runs (api -> backends -> cuda)."""
    for path in sorted(CUDA_ROOT.rglob("*.py")):
        for target, names in runtime_imports(path):
            if target == "stepgraph":
                assert all(is_module(f"stepgraph.{n}") for n in names), (path, names)


def test_the_version_is_a_leaf_module_the_package_reexports():
    tree = ast.parse(Path(version.__file__).read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert stepgraph.__version__ == version.__version__
    autotune = CUDA_ROOT / "runtime" / "autotune.py"
    assert ("stepgraph.version", ["__version__"]) in runtime_imports(autotune)


def test_the_gpu_tests_import_names_that_exist():
    """tests/cuda skips its modules without a GPU, so nothing imports them here: every
    `from stepgraph... import name` they make is checked to resolve instead."""
    import importlib

    import pytest

    pytest.importorskip("cupy")
    checked = 0
    for path in sorted((Path(__file__).parents[1] / "cuda").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("stepgraph"):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name) or is_module(
                        f"{node.module}.{alias.name}"), (path.name, node.module, alias.name)
                    checked += 1
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "importorskip":
                name = getattr(node.args[0], "value", "") if node.args else ""
                if name.startswith("stepgraph"):
                    importlib.import_module(name)
    assert checked > 50
