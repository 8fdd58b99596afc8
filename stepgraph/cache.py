"""The on-disk cache of kernel choices, so that a new process does not time again what an
earlier one on the same GPU already chose (the cuBLASLt algorithm of each GEMM, the path and
variant of each conv and linear op: backends/cuda/matmul/gemm.py, runtime/autotune.py), nor
build again the cuDNN plans cuDNN compiles at their build (namespace "cudnn_compiled", the
serialized plan in the entry: backends/cuda/conv/cudnn_compiled.py), nor time again the two
layouts of a step (namespace "layout": compile/layout_choice.py).

Where: $STEPGRAPH_CACHE_DIR, else $XDG_CACHE_HOME/stepgraph, else ~/.cache/stepgraph; the
choices live under choices/<namespace>/. STEPGRAPH_DISK_CACHE=0 turns it off. `stepgraph cache
info` shows it, `stepgraph cache clear` empties it. (Compiled kernels are cached by CuPy,
in $CUPY_CACHE_DIR or ~/.cupy/kernel_cache.)

An entry is one small JSON file named by a hash of (device identity, namespace, problem): the
identity names the GPU model, driver, CUDA, cuBLASLt and library versions and a digest of the
kernel sources, so a choice made elsewhere is never used. Files are written to a temporary
name and renamed (readers see a whole old entry or a whole new one; concurrent processes race
harmlessly), and every entry is validated when read: its own checksum, identity, problem and
the caller's check that the value still names a candidate. Anything else is ignored, and the
caller's fresh choice overwrites it.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

CACHE_ENV = "STEPGRAPH_CACHE_DIR"
SWITCH_ENV = "STEPGRAPH_DISK_CACHE"     # "0": neither read nor write the cache
CHOICES = "choices"
FORMAT = 1


def cache_dir() -> Path:
    """The user's stepgraph cache directory (not created here)."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "stepgraph"


def enabled() -> bool:
    return os.environ.get(SWITCH_ENV, "1") != "0"


def _checksum(record: dict) -> str:
    body = {k: v for k, v in record.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


class ChoiceCache:
    """Choices of one kind (`namespace`, e.g. "gemm") for one device identity, by problem
    (a string that names the problem exactly, e.g. the repr of a frozen dataclass)."""

    def __init__(self, namespace: str, identity: dict, root: Path | None = None):
        self.namespace, self.identity = namespace, dict(identity)
        self.directory = (root or cache_dir()) / CHOICES / namespace
        self._identity_text = json.dumps(self.identity, sort_keys=True)
        self.hits = self.misses = self.rejected = 0

    def path(self, problem: str) -> Path:
        key = f"{self._identity_text}\0{self.namespace}\0{problem}".encode()
        return self.directory / f"{hashlib.sha256(key).hexdigest()[:32]}.json"

    def get(self, problem: str, valid: Callable[[Any], bool] = lambda value: True) -> Any:
        """The stored value for `problem`, or None when there is none or it does not pass
        every check (a damaged or foreign entry is counted in `rejected` and ignored)."""
        path = self.path(problem)
        try:
            record = json.loads(path.read_text())
        except FileNotFoundError:
            self.misses += 1
            return None
        except (OSError, ValueError):
            self.rejected += 1
            return None
        try:
            ok = (isinstance(record, dict) and record.get("format") == FORMAT
                  and record.get("sha256") == _checksum(record)
                  and record.get("namespace") == self.namespace
                  and record.get("identity") == self.identity
                  and record.get("problem") == problem and valid(record.get("value")))
        except Exception:  # a validator meeting a value of the wrong shape: not trusted
            ok = False
        if not ok:
            self.rejected += 1
            return None
        self.hits += 1
        return record["value"]

    def put(self, problem: str, value: Any) -> bool:
        """Store `value` (JSON) for `problem`, replacing any entry; False when the cache
        cannot be written (a read-only or full disk never stops training)."""
        record = {"format": FORMAT, "namespace": self.namespace, "identity": self.identity,
                  "problem": problem, "value": value}
        record["sha256"] = _checksum(record)
        path = self.path(problem)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(record, f, sort_keys=True)
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError:
            return False
        return True


def entries(root: Path | None = None) -> list[Path]:
    """Every entry file (and leftover temporary file) of the choice cache."""
    directory = (root or cache_dir()) / CHOICES
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.rglob("*") if p.is_file())


def clear(root: Path | None = None) -> int:
    """Delete every cached choice; returns how many files were removed."""
    removed = 0
    for path in entries(root):
        try:
            path.unlink()
            removed += 1
        except FileNotFoundError:    # another process got there first
            pass
    return removed


def info(root: Path | None = None) -> dict:
    """The cache's directory, and its entries and bytes per namespace."""
    root = root or cache_dir()
    namespaces: dict[str, dict[str, int]] = {}
    for path in entries(root):
        ns = namespaces.setdefault(path.parent.name, {"entries": 0, "bytes": 0})
        ns["entries"] += 1
        ns["bytes"] += path.stat().st_size
    return {"directory": str(root), "enabled": enabled(), "namespaces": namespaces}


def main(argv: list[str] | None = None) -> int:
    """`stepgraph cache info|clear`."""
    parser = argparse.ArgumentParser(
        prog="stepgraph cache", description="The on-disk cache of kernel choices (GEMM "
        "algorithms, conv and linear paths) and of cuDNN's runtime-compiled plans. Set "
        f"{CACHE_ENV} to move it, {SWITCH_ENV}=0 to turn it off.")
    parser.add_argument("action", choices=("info", "clear"))
    args = parser.parse_args(argv)
    if args.action == "clear":
        print(f"removed {clear()} cached kernel choices from {cache_dir()}")
        return 0
    summary = info()
    print(f"stepgraph cache: {summary['directory']}"
          + ("" if summary["enabled"] else f" (off: {SWITCH_ENV}=0)"))
    if not summary["namespaces"]:
        print("  no kernel choices cached")
    for name, ns in sorted(summary["namespaces"].items()):
        print(f"  {name:<10} {ns['entries']:6d} entries {ns['bytes'] / 1024:10.1f} KiB")
    print("compiled kernels are cached by CuPy: "
          f"{os.environ.get('CUPY_CACHE_DIR', '~/.cupy/kernel_cache')}")
    return 0
