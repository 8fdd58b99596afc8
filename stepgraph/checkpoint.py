"""Training checkpoints in safetensors format.

One file holds the compiled step's `state_dict()` (parameters under their PyTorch names, the
optimizer state `optimizer.*` including its step counter) and the loop's own state under `train.*`:
the number of finished epochs and the data-order seed. The shuffle order of an epoch is a pure
function of (seed, epoch) (`data.epoch_order`), so those two numbers are the whole data-order RNG
state, and a resumed run continues bit for bit. The run's configuration is kept as JSON metadata
so a resume with a different model or data is refused instead of silently mixing runs.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import StepgraphError

CHECKPOINT_NAME = "checkpoint.safetensors"
TRAIN_PREFIX = "train."
EPOCH_KEY = "train.epoch"
DATA_SEED_KEY = "train.data_seed"
CONFIG_METADATA_KEY = "stepgraph.config"


class CheckpointError(StepgraphError):
    """A checkpoint is missing, unreadable, or belongs to a different run configuration."""


@dataclass
class Checkpoint:
    """What a run needs to continue: step state, finished epochs, data seed and config."""

    state: dict[str, np.ndarray]
    epoch: int
    data_seed: int
    config: dict = field(default_factory=dict)


def save_checkpoint(path: str | Path, checkpoint: Checkpoint) -> Path:
    """Write `checkpoint` to `path` atomically (a crash mid-write leaves the old file)."""
    from safetensors.numpy import save_file

    path = Path(path)
    clashes = [k for k in checkpoint.state if k.startswith(TRAIN_PREFIX)]
    if clashes:
        raise CheckpointError(f"state_dict keys clash with the loop's own keys: {clashes}")
    # np.asarray keeps 0-d arrays 0-d (np.ascontiguousarray would make them 1-d).
    tensors = {k: np.asarray(v, order="C") for k, v in checkpoint.state.items()}
    tensors[EPOCH_KEY] = np.array(checkpoint.epoch, dtype=np.int64)
    tensors[DATA_SEED_KEY] = np.array(checkpoint.data_seed, dtype=np.int64)
    metadata = {CONFIG_METADATA_KEY: json.dumps(checkpoint.config, sort_keys=True)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)
    return path


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read a checkpoint written by save_checkpoint."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        with safe_open(str(path), framework="np") as f:
            metadata = f.metadata() or {}
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"cannot read checkpoint {path}: {err}") from err
    missing = [k for k in (EPOCH_KEY, DATA_SEED_KEY) if k not in tensors]
    if missing:
        raise CheckpointError(f"{path} is not a training checkpoint: missing {missing}")
    state = {k: v for k, v in tensors.items() if not k.startswith(TRAIN_PREFIX)}
    config = json.loads(metadata.get(CONFIG_METADATA_KEY, "{}"))
    return Checkpoint(state, int(tensors[EPOCH_KEY]), int(tensors[DATA_SEED_KEY]), config)


def check_compatible(saved: dict, current: dict, keys: tuple[str, ...]) -> None:
    """Raise CheckpointError naming every key in `keys` whose value differs between configs."""
    diffs = [f"{k}: checkpoint {saved.get(k)!r}, now {current.get(k)!r}"
             for k in keys if saved.get(k) != current.get(k)]
    if diffs:
        raise CheckpointError("cannot resume a different run: " + "; ".join(diffs))
