"""TorchInductor's on-disk caches kept in one folder (`--compile-cache DIR` of scripts/compat-bench
and `stepgraph bench`), so that one command compiles and a later one, on a fresh machine given
the folder back, times.

torch.compile(mode="max-autotune") spends minutes a model in Inductor: it benchmarks Triton
templates for every GEMM shape. What a later process can reuse lives in files:
  - the AOTAutograd cache and, beneath it, the FX graph cache: the compiled forward and backward
    (the generated code, with the Triton kernels bundled into the entry): a hit skips Inductor
    and its autotuning altogether;
  - the local autotune cache: the GEMM choices' benchmark timings (one JSON file,
    DIR/cache/<system hash>, read by codecache.PersistentCache at each max-autotune
    selection) and the pointwise / reduction kernels' best configs: a graph that misses still
    skips the benchmarking of shapes seen before;
  - Triton's kernel cache (TRITON_CACHE_DIR): compiled kernels by source hash.
Inductor finds the folder through TORCHINDUCTOR_CACHE_DIR, read when it first needs it; the
switches are config values that their environment variables set when the config module is
first imported. Both are set here, the environment first, before anything compiles: the
environment also reaches the compile workers and autotuning subprocesses Inductor starts.
Only options torch 2.11 (the GPU machine's) and 2.13 both have are set; an attribute a
version lacks is skipped and named in the returned record.

The cache JSON file is rewritten whole (read, benchmark, write) by every autotuning process, so
processes that autotune at once must not share a folder: `jobs` gives each its own copy and
`merge` folds them back (files by name, the JSON by key).

The folder grows to hundreds of MB (every benchmarked candidate's compiled kernel), too much to
bring back from one command and into the next. What a later compile needs to skip the
benchmarking, which is most of max-autotune's time on the conv files, is a few MB:
`pack_choices` keeps only the choices' timings and the kernels' best configs, written as each
selection finishes, so even a compile stopped by its command's time limit leaves its progress;
`unpack_choices` merges them into a folder on the next machine, whose compile then benchmarks
only the selections not yet made (`scripts/compile-choices pack|unpack`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

# (module, attribute, value): the caches max-autotune consults, on; none of them remote.
CONFIG = (
    ("torch._inductor.config", "force_disable_caches", False),
    ("torch._inductor.config", "fx_graph_cache", True),
    ("torch._inductor.config", "autotune_local_cache", True),
    ("torch._functorch.config", "enable_autograd_cache", True),
)
# Counters (torch._dynamo.utils.counters) that say whether a compile reused the folder: cache
# hits and misses, and the GEMM autotuning benchmarks run (a PersistentCache miss).
HITS = (("inductor", "fxgraph_cache_hit"), ("aot_autograd", "autograd_cache_hit"))
MISSES = (("inductor", "fxgraph_cache_miss"), ("aot_autograd", "autograd_cache_miss"),
          ("inductor", "select_algorithm_autotune"))
SKIPPED_IN_MERGE = ("locks",)    # lock files of the process that wrote the folder


def environment(directory: str | os.PathLike) -> dict[str, str]:
    """The environment variables that point Inductor and Triton at `directory` and force the
    FX graph and AOTAutograd caches on."""
    root = os.path.abspath(directory)
    return {"TORCHINDUCTOR_CACHE_DIR": root,
            "TRITON_CACHE_DIR": os.path.join(root, "triton"),
            "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
            "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}


def use(directory: str | os.PathLike) -> dict:
    """Point this process's Inductor and Triton caches at `directory` (created) and turn the
    caches on. Call it before anything is compiled. Returns what was set, for a report:
    {"dir", "env", "config": {name: value}, "missing": [names this torch lacks],
    "inductor_loaded_before": whether Inductor's config was imported before the call}."""
    loaded_before = "torch._inductor.config" in sys.modules
    env = environment(directory)
    Path(env["TORCHINDUCTOR_CACHE_DIR"]).mkdir(parents=True, exist_ok=True)
    os.environ.update(env)
    import importlib
    applied, missing = {}, []
    for module_name, name, value in CONFIG:
        key = f"{module_name}.{name}"
        try:
            module = importlib.import_module(module_name)
        except ImportError:     # no torch: the environment alone, for whatever compiles later
            missing.append(key)
            continue
        if hasattr(module, name):
            setattr(module, name, value)
            applied[key] = getattr(module, name)
        else:
            missing.append(key)
    return {"dir": env["TORCHINDUCTOR_CACHE_DIR"], "env": env, "config": applied,
            "missing": missing, "inductor_loaded_before": loaded_before}


def counts() -> dict[str, int]:
    """The cache counters now ("group.name": count)."""
    from torch._dynamo.utils import counters
    return {f"{group}.{name}": int(counters[group][name]) for group, name in HITS + MISSES}


def state(before: dict[str, int], after: dict[str, int]) -> dict:
    """What a compile between two `counts` did with the caches: the counters' increments and
    "warm" (hits, no miss and no autotuning), "cold" (no hit), "partial" (both) or "none"
    (neither: nothing compiled, or the caches were off)."""
    delta = {key: after[key] - before.get(key, 0) for key in after}
    hits = sum(delta[f"{g}.{n}"] for g, n in HITS)
    misses = sum(delta[f"{g}.{n}"] for g, n in MISSES)
    verdict = ("partial" if misses else "warm") if hits else ("cold" if misses else "none")
    return {"cache": verdict, **delta}


def size(directory: str | os.PathLike) -> tuple[int, int]:
    """(files, bytes) under `directory`."""
    files = [p for p in Path(directory).rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def job_folder(directory: str | os.PathLike, name: str) -> Path:
    """A private copy of `directory` for one of several processes compiling at once (merge
    folds it back): DIR/.jobs/<name>, seeded with what DIR already holds."""
    root = Path(directory)
    folder = root / ".jobs" / name
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    if root.is_dir():
        for entry in root.iterdir():
            if entry.name in (".jobs",) + SKIPPED_IN_MERGE:
                continue
            if entry.is_dir():
                shutil.copytree(entry, folder / entry.name, symlinks=True)
            elif entry.is_file():
                shutil.copy2(entry, folder / entry.name)
    return folder


def merge(source: str | os.PathLike, destination: str | os.PathLike) -> int:
    """Fold the cache folder `source` into `destination`: files `destination` lacks are copied
    (the caches name their files by content hash, so one name is one content); the autotune
    JSON files (cache/<system hash>) are merged key by key, `destination`'s timings kept where
    both have one. Returns the number of files written."""
    source, destination = Path(source), Path(destination)
    written = 0
    for path in sorted(source.rglob("*")):
        relative = path.relative_to(source)
        if not path.is_file() or path.is_symlink() or relative.parts[0] in SKIPPED_IN_MERGE:
            continue
        target = destination / relative
        if relative.parts[0] == "cache" and len(relative.parts) == 2 and target.is_file():
            merged = _merged_json(target, path)
            if merged is not None:
                tmp = target.with_name(target.name + ".merge-tmp")
                tmp.write_text(json.dumps(merged, indent=4))
                tmp.replace(target)
                written += 1
            continue
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
        written += 1
    return written


def _merged_json(target: Path, addition: Path) -> dict | None:
    """{"system", "cache"} of `target` with `addition`'s entries it lacks; None when the files
    are not that format or add nothing."""
    try:
        have, add = json.loads(target.read_text()), json.loads(addition.read_text())
    except (OSError, ValueError):
        return None
    if not (isinstance(have, dict) and isinstance(add, dict)
            and isinstance(have.get("cache"), dict) and isinstance(add.get("cache"), dict)):
        return None
    before = json.dumps(have, sort_keys=True)
    _fill(have["cache"], add["cache"])
    return have if json.dumps(have, sort_keys=True) != before else None


def _fill(have: dict, add: dict) -> None:
    for key, value in add.items():
        if key not in have:
            have[key] = value
        elif isinstance(have[key], dict) and isinstance(value, dict):
            _fill(have[key], value)


def choice_files(directory: str | os.PathLike) -> list[Path]:
    """The files of `directory` that hold autotuning results: the choices' timings
    (cache/<system hash>, read before a selection compiles or benchmarks any candidate) and the
    pointwise and reduction kernels' best configs (<key>.best_config beside their sources)."""
    root = Path(directory)
    return sorted(path for path in root.rglob("*")
                  if path.is_file() and not path.is_symlink()
                  and path.relative_to(root).parts[0] not in (".jobs",) + SKIPPED_IN_MERGE
                  and (path.parent == root / "cache" or path.name.endswith(".best_config")))


def pack_choices(directory: str | os.PathLike, tarball: str | os.PathLike) -> tuple[int, int]:
    """Write `directory`'s choice_files into the gzipped tar `tarball`, paths relative to the
    folder. Returns (files, bytes of the tarball)."""
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"no compile cache folder {str(root)!r}")
    files = choice_files(root)
    with tarfile.open(tarball, "w:gz") as tar:
        for path in files:
            tar.add(path, arcname=str(path.relative_to(root)))
    return len(files), Path(tarball).stat().st_size


def unpack_choices(tarball: str | os.PathLike, directory: str | os.PathLike) -> int:
    """Merge a `pack_choices` tarball into the cache folder `directory` (created): timings by key,
    the folder's own kept where both have one; best configs it lacks copied. Returns the files
    written."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        with tarfile.open(tarball) as tar:
            tar.extractall(scratch, filter="data")
        return merge(scratch, directory)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="compile-choices",
        description="Carry max-autotune's autotuning results between machines: pack a "
                    "--compile-cache folder's choice timings and best configs into a small "
                    "tarball, or merge such a tarball into a folder.")
    verbs = parser.add_subparsers(dest="verb", required=True)
    pack = verbs.add_parser("pack", help="FOLDER TARBALL")
    pack.add_argument("folder")
    pack.add_argument("tarball")
    unpack = verbs.add_parser("unpack", help="TARBALL FOLDER")
    unpack.add_argument("tarball")
    unpack.add_argument("folder")
    args = parser.parse_args(argv)
    try:
        if args.verb == "pack":
            files, size_bytes = pack_choices(args.folder, args.tarball)
            print(f"packed {files} files of {args.folder} into {args.tarball} "
                  f"({size_bytes / 1024:.1f} KiB)")
        else:
            written = unpack_choices(args.tarball, args.folder)
            print(f"merged {args.tarball} into {args.folder}: {written} files written")
    except (OSError, tarfile.TarError) as error:
        print(f"compile-choices {args.verb}: {error}", file=sys.stderr)
        return 1
    return 0
