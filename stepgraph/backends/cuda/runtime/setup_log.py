"""The setup log: with STEPGRAPH_AUTOTUNE_LOG=FILE, what a step's setup did and how long it
took, one JSON line each (docs/PROFILING.md): the autotuner's timed problems (autotune.py),
the cuDNN plans built for them (conv_cudnn.py) and every NVRTC module compiled or looked up
in CuPy's disk cache (compiler.py, with the time.perf_counter() seconds it was queued, started
and ended, so a cold start's waits can be laid out on one time line).

Its own module so that compiler.py, which autotune.py imports, can write there too.
"""
from __future__ import annotations

import json
import os
import threading

_lock = threading.Lock()


def enabled() -> bool:
    return bool(os.environ.get("STEPGRAPH_AUTOTUNE_LOG"))


def write(line: dict) -> None:
    """Append `line` to STEPGRAPH_AUTOTUNE_LOG's file as one JSON line (nothing when unset)."""
    path = os.environ.get("STEPGRAPH_AUTOTUNE_LOG")
    if path:
        with _lock, open(path, "a") as f:
            f.write(json.dumps(line) + "\n")
