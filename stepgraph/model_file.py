"""A user's model file for `stepgraph train --model path/to/file.py:ClassName`.

The file is imported as a module of its own, with its directory first on sys.path, as Python
does for a script (`python file.py`), so that it can import helper modules beside it (`from
layers import Block`); the class is constructed with the `--model-args` JSON object as keyword
arguments (none by default). Every way this can fail is a ModelFileError naming the file and
what is wrong.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path

from .errors import StepgraphError


class ModelFileError(StepgraphError, ValueError):
    """A --model FILE.py:CLASS that cannot be loaded or constructed."""


def is_model_file(name: str) -> bool:
    """Whether a --model value names a model file (FILE.py:CLASS) rather than a built-in."""
    path, sep, _ = name.rpartition(":")
    return bool(sep) and path.endswith(".py")


def split_model_file(name: str) -> tuple[Path, str]:
    """FILE.py:CLASS -> (the file, the class name)."""
    path, _, class_name = name.rpartition(":")
    if not class_name.isidentifier():
        raise ModelFileError(f"--model {name}: {class_name!r} is not a class name "
                             "(expected FILE.py:CLASS)")
    return Path(path), class_name


def load_model_class(name: str) -> type:
    """The nn.Module subclass that `name` (FILE.py:CLASS) names."""
    from .nn import Module

    path, class_name = split_model_file(name)
    if not path.is_file():
        raise ModelFileError(f"--model {name}: no model file at {path}")
    # A module name of its own per file, so two files with one name do not collide.
    tag = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(f"stepgraph_model_{tag}", path)
    module = importlib.util.module_from_spec(spec)
    add_to_path(path.resolve().parent)
    try:
        spec.loader.exec_module(module)
    except Exception as err:    # the file's own code failed: say where, keep the cause chained
        raise ModelFileError(f"--model {name}: importing {path} failed: "
                             f"{type(err).__name__}: {err}") from err
    cls = getattr(module, class_name, None)
    if cls is None:
        defined = sorted(k for k, v in vars(module).items()
                         if isinstance(v, type) and issubclass(v, Module) and v is not Module
                         and v.__module__ == module.__name__)
        raise ModelFileError(f"--model {name}: {path} has no class {class_name} (nn.Module "
                             f"classes it defines: {', '.join(defined) or 'none'})")
    if not (isinstance(cls, type) and issubclass(cls, Module)):
        raise ModelFileError(f"--model {name}: {class_name} is not an nn.Module subclass "
                             f"(it is {type(cls).__name__} {cls!r:.60}); write it as "
                             f"`class {class_name}(nn.Module)` with `from stepgraph import nn`")
    return cls


def add_to_path(folder: Path) -> None:
    """`folder` first on sys.path, as Python puts a script's folder there, and kept there: a
    model's forward may import its helpers late, when the step is compiled."""
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))


def parse_model_args(text: str | None) -> dict:
    """--model-args: a JSON object of keyword arguments (None: no arguments)."""
    if text is None:
        return {}
    try:
        args = json.loads(text)
    except json.JSONDecodeError as err:
        raise ModelFileError(f"--model-args is not valid JSON ({err}): {text!r}") from err
    if not isinstance(args, dict):
        raise ModelFileError(f"--model-args must be a JSON object of keyword arguments, got "
                             f"{text!r}")
    return args


def build_model_from_file(name: str, model_args: dict):
    """An instance of FILE.py:CLASS constructed with model_args as keyword arguments."""
    cls = load_model_class(name)
    try:
        return cls(**model_args)
    except Exception as err:    # the class's own constructor failed
        given = f"--model-args {json.dumps(model_args)}" if model_args else "no arguments"
        raise ModelFileError(f"--model {name}: constructing {cls.__name__} with {given} "
                             f"failed: {type(err).__name__}: {err}") from err
