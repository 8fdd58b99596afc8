"""Peers' measured rows kept between `stepgraph bench` runs, so that a second run times only
stepgraph and reuses each peer's row.

A peer's row depends on the peer, its libraries' versions, the GPU, the workload (its
definition, not only its name), the precision and the options that change what is timed
(repeats, run length, batches, seed; torch.compile's modes for the torch compile row,
tinygrad's BEAM width for tinygrad's): that is the key (`PeerKey`). stepgraph's own rows are
never cached (they are what a run measures), nor are rows that did not measure (missing,
failed, n/a: a failure may be gone next time).

One JSON file, CACHE_FILE under the stepgraph cache directory (stepgraph/cache.py:
$STEPGRAPH_CACHE_DIR, else $XDG_CACHE_HOME/stepgraph or ~/.cache/stepgraph), maps a SHA-256
of each key to the key itself, the row and the date it was measured; a read checks that the
stored key is the one asked for. It is written to a temporary file and renamed over the old
one. An unreadable file counts as empty (and is replaced at the next write);
STEPGRAPH_DISK_CACHE=0 turns the cache off, as it does the kernel choices'.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass, fields
from importlib import metadata
from pathlib import Path
from typing import Any

from stepgraph import cache as disk_cache

CACHE_FILE = Path("bench") / "peer-results.json"
FORMAT = 1
# The distributions whose versions a peer's row depends on, by PeerInfo.library.
PEER_DISTRIBUTIONS = {"torch": ("torch", "triton"), "jax": ("jax", "jaxlib", "optax"),
                      "tinygrad": ("tinygrad",)}
# Options every row depends on (BenchConfig fields), and those of one peer module only.
COMMON_OPTIONS = ("repeats", "target_seconds", "warmup_steps", "warmup_seconds",
                  "max_steps_per_repeat", "batches", "seed", "device", "tiny")
PEER_OPTIONS = {"torch_compile": ("compile_modes",), "tinygrad_jit": ("tinygrad_beam",)}


@dataclass(frozen=True)
class PeerKey:
    """What a peer's measured row depends on."""

    peer: str
    versions: dict[str, str | None]     # distribution -> version (None: not installed)
    device: str                         # the GPU's name
    workload: str
    workload_digest: str                # of the workload's whole definition
    precision: str
    options: dict[str, Any]

    def text(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    def digest(self) -> str:
        return hashlib.sha256(self.text().encode()).hexdigest()


def distribution_versions(library: str) -> dict[str, str | None]:
    """The installed versions of the distributions a peer of `library` depends on."""
    versions: dict[str, str | None] = {}
    for name in PEER_DISTRIBUTIONS.get(library, (library,)):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def peer_key(peer, config, device: str, workload, precision: str) -> PeerKey:
    """The key of `peer`'s row on `workload` at `precision` under `config` (a BenchConfig)."""
    names = COMMON_OPTIONS + PEER_OPTIONS.get(peer.module, ())
    options = {name: _plain(getattr(config, name)) for name in names}
    definition = json.dumps(_plain(asdict(workload)), sort_keys=True, default=repr)
    return PeerKey(peer.name, distribution_versions(peer.library), device, workload.name,
                   hashlib.sha256(definition.encode()).hexdigest()[:16], precision, options)


def _plain(value):
    """Tuples as lists, as JSON keeps them (a key read back compares equal)."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


@dataclass
class CachedRow:
    """A row read from the cache: the stored PeerResult fields and when they were measured."""

    row: dict[str, Any]
    measured: str       # the date of the run that measured it (BenchReport.date)


class PeerResultCache:
    """The cache file's entries, read once; `put` writes the file at once."""

    def __init__(self, path: Path | None = None, enabled: bool | None = None):
        """The cache file at `path` (default: CACHE_FILE in the stepgraph cache directory);
        enabled None: unless STEPGRAPH_DISK_CACHE=0."""
        self.path = path or disk_cache.cache_dir() / CACHE_FILE
        self.enabled = disk_cache.enabled() if enabled is None else enabled
        self._entries = self._read() if self.enabled else {}

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):   # none yet, or damaged: measured again, then replaced
            return {}
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            return {}
        entries = data.get("entries")
        return entries if isinstance(entries, dict) else {}

    def get(self, key: PeerKey) -> CachedRow | None:
        """The row stored under `key`, or None (none, or one stored under another key)."""
        entry = self._entries.get(key.digest())
        if not isinstance(entry, dict) or entry.get("key") != json.loads(key.text()):
            return None
        row, measured = entry.get("row"), entry.get("measured")
        if not isinstance(row, dict) or not isinstance(measured, str):
            return None
        return CachedRow(row, measured)

    def put(self, key: PeerKey, row: dict[str, Any], measured: str) -> bool:
        """Store `row` (a PeerResult's fields) under `key` and write the file; False when the
        cache is off or cannot be written (a benchmark never fails over its cache)."""
        if not self.enabled:
            return False
        self._entries[key.digest()] = {"key": json.loads(key.text()), "row": row,
                                       "measured": measured}
        try:
            self._write()
        except OSError:
            return False
        return True

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"format": FORMAT, "entries": self._entries}, indent=1,
                          sort_keys=True, ensure_ascii=False)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp",
                                   dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text + "\n")
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def row_fields(result) -> dict[str, Any]:
    """A PeerResult's fields as stored: all but the cache's own mark."""
    return {k: v for k, v in asdict(result).items() if k != "cached"}


def restore_row(result_type, cached: CachedRow):
    """A PeerResult (`result_type`) from a cached row, marked with the date it was measured;
    fields the stored row lacks keep their defaults, unknown ones are dropped."""
    known = {f.name for f in fields(result_type)}
    row = {k: v for k, v in cached.row.items() if k in known and k != "cached"}
    return result_type(**row, cached=cached.measured)
