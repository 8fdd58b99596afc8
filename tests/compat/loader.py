"""Loads a PyTorch model file twice: as written (real torch), and with only its torch import
lines pointed at stepgraph (`import torch` -> `import stepgraph as torch`, `torch.nn` ->
`stepgraph.nn`, ...). The rest of the file is not touched."""
from __future__ import annotations

import re
import sys
import types
from pathlib import Path

MODELS = Path(__file__).parent / "models"

# `import torch[.sub] [as name]` and `from torch[.sub] import ...`, at the start of a line
_IMPORT = re.compile(r"^(\s*)import torch((?:\.\w+)*)(\s+as\s+\w+)?\s*$")
_FROM = re.compile(r"^(\s*)from torch((?:\.\w+)*)\s+import\s")


def substitute_imports(source: str) -> str:
    """The source with every torch import line rewritten to import stepgraph instead."""
    lines = []
    for line in source.splitlines():
        if m := _IMPORT.match(line):
            indent, sub, alias = m.groups()
            # `import torch` and `import torch.nn` both bind the name torch
            line = f"{indent}import stepgraph{sub}{alias}" if alias else \
                f"{indent}import stepgraph as torch"
        elif m := _FROM.match(line):
            line = f"{m.group(1)}from stepgraph{line[m.start(2):]}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def load(name: str, framework: str) -> types.ModuleType:
    """tests/compat/models/<name>.py as a fresh module: framework "torch" runs it as written,
    "stepgraph" with the imports substituted. Registered in sys.modules under a private name
    (classes defined in it pickle and report a module)."""
    return load_file(MODELS / f"{name}.py", framework)


def load_file(path: Path, framework: str) -> types.ModuleType:
    """Any model file, as load() loads the suite's (scripts/compat-bench times a user's)."""
    path, name = Path(path), Path(path).stem
    source = path.read_text()
    if framework == "stepgraph":
        source = substitute_imports(source)
    elif framework != "torch":
        raise ValueError(f"framework must be 'torch' or 'stepgraph', got {framework!r}")
    module = types.ModuleType(f"_compat_{framework}_{name}")
    module.__file__ = str(path)
    sys.modules[module.__name__] = module
    exec(compile(source, str(path), "exec"), module.__dict__)
    return module
