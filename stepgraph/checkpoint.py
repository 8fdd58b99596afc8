"""Training checkpoints in safetensors format.

One file holds the compiled step's `state_dict()` (parameters under their PyTorch names, the
optimizer state `optimizer.*` including its step counter) and the loop's own state under `train.*`:
the number of finished epochs and the data-order seed. The shuffle order of an epoch is a pure
function of (seed, epoch) (`data.epoch_order`), so those two numbers are the whole data-order RNG
state, and a resumed run continues bit for bit. The run's configuration is kept as JSON metadata
so a resume with a different model or data is refused instead of silently mixing runs.

Beside it the metadata records the library version, the step's signature (its modules, the
shapes and dtypes of its state and its optimizer and loss: `step_signature`), so a refused
resume can say what differs, and a SHA-256 of the rest of the metadata and every tensor, so a
corrupt file or an edited header is refused rather than loaded (checkpoints written before the
header was covered carry a SHA-256 of the tensors alone, and still load). A checkpoint is
written to a temporary file in the same directory, flushed to disk and renamed over the old
one: a crash or a full disk mid-write leaves the last good checkpoint and no temporary file.
Non-finite values are never written.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import StepgraphError
from .version import __version__

CHECKPOINT_NAME = "checkpoint.safetensors"
TRAIN_PREFIX = "train."
EPOCH_KEY = "train.epoch"
DATA_SEED_KEY = "train.data_seed"
CONFIG_METADATA_KEY = "stepgraph.config"
VERSION_METADATA_KEY = "stepgraph.version"
SIGNATURE_METADATA_KEY = "stepgraph.signature"
CHECKSUM_METADATA_KEY = "stepgraph.checksum"    # SHA-256 of the other metadata and the tensors
DIGEST_METADATA_KEY = "stepgraph.sha256"        # older checkpoints: of the tensors alone
MAX_LISTED = 6          # differences or keys named in one error message


class CheckpointError(StepgraphError):
    """A checkpoint is missing, unreadable, corrupt, or belongs to a different run or step."""


@dataclass
class Checkpoint:
    """What a run needs to continue: step state, finished epochs, data seed and config; the
    step's signature (step_signature) and the library version that wrote it."""

    state: dict[str, np.ndarray]
    epoch: int
    data_seed: int
    config: dict = field(default_factory=dict)
    signature: dict | None = None
    version: str | None = None




def tensors_digest(tensors: dict[str, np.ndarray]) -> str:
    """SHA-256 over every tensor's key, dtype, shape and bytes, in key order."""
    digest = hashlib.sha256()
    for key in sorted(tensors):
        value = np.ascontiguousarray(tensors[key])
        digest.update(f"{key}\0{value.dtype.str}\0{value.shape}\0".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()


def checkpoint_digest(tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> str:
    """SHA-256 over the metadata's keys and values, in key order, and tensors_digest."""
    digest = hashlib.sha256()
    for key in sorted(metadata):
        digest.update(f"{key}\0{metadata[key]}\0".encode())
    digest.update(tensors_digest(tensors).encode())
    return digest.hexdigest()


def non_finite_keys(state: dict[str, np.ndarray]) -> list[str]:
    """Keys of the floating-point arrays in `state` holding a NaN or an Inf."""
    return [k for k, v in state.items()
            if np.issubdtype(np.asarray(v).dtype, np.floating) and not np.isfinite(v).all()]


def _listed(keys: list[str]) -> str:
    more = f" and {len(keys) - MAX_LISTED} more" if len(keys) > MAX_LISTED else ""
    return ", ".join(keys[:MAX_LISTED]) + more


def save_checkpoint(path: str | Path, checkpoint: Checkpoint,
                    allow_non_finite: bool = False) -> Path:
    """Write `checkpoint` to `path` atomically (a crash mid-write leaves the old file). A
    state holding NaN or Inf is refused (CheckpointError) unless allow_non_finite."""
    from safetensors.numpy import save

    path = Path(path)
    clashes = [k for k in checkpoint.state if k.startswith(TRAIN_PREFIX)]
    if clashes:
        raise CheckpointError(f"state_dict keys clash with the loop's own keys: {clashes}")
    bad = [] if allow_non_finite else non_finite_keys(checkpoint.state)
    if bad:
        raise CheckpointError(f"not writing {path}: NaN or Inf in {_listed(bad)}")
    # np.asarray keeps 0-d arrays 0-d (np.ascontiguousarray would make them 1-d).
    tensors = {k: np.asarray(v, order="C") for k, v in checkpoint.state.items()}
    tensors[EPOCH_KEY] = np.array(checkpoint.epoch, dtype=np.int64)
    tensors[DATA_SEED_KEY] = np.array(checkpoint.data_seed, dtype=np.int64)
    metadata = {CONFIG_METADATA_KEY: json.dumps(checkpoint.config, sort_keys=True),
                VERSION_METADATA_KEY: checkpoint.version or __version__}
    if checkpoint.signature is not None:
        metadata[SIGNATURE_METADATA_KEY] = json.dumps(checkpoint.signature, sort_keys=True)
    metadata[CHECKSUM_METADATA_KEY] = checkpoint_digest(tensors, metadata)
    write_atomically(path, save(tensors, metadata=metadata))
    return path


def write_atomically(path: Path, data: bytes) -> None:
    """Replace `path` by `data` all at once: a temporary file in the same directory (same
    file system, so the rename is atomic), flushed to disk before the rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # A fresh name, created with the usual permissions (mkstemp's would be 0600).
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_directory(path.parent)


def _fsync_directory(directory: Path) -> None:
    """Make the rename itself durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read a checkpoint written by save_checkpoint; CheckpointError naming the file and what
    is wrong with it when it is missing, truncated, corrupt or not a training checkpoint."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    if path.stat().st_size == 0:
        raise CheckpointError(f"checkpoint {path} is empty (0 bytes)")
    try:
        with safe_open(str(path), framework="np") as f:
            metadata = f.metadata() or {}
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"cannot read checkpoint {path} (truncated or not a safetensors "
                              f"file): {err}") from err
    missing = [k for k in (EPOCH_KEY, DATA_SEED_KEY) if k not in tensors]
    if missing:
        raise CheckpointError(f"{path} is not a training checkpoint: missing {missing}")
    _check_digest(path, tensors, metadata)
    try:
        config = json.loads(metadata.get(CONFIG_METADATA_KEY, "{}"))
        signature = json.loads(metadata[SIGNATURE_METADATA_KEY]) \
            if SIGNATURE_METADATA_KEY in metadata else None
    except json.JSONDecodeError as err:
        raise CheckpointError(f"checkpoint {path} is corrupt: unreadable metadata ({err})") \
            from err
    state = {k: v for k, v in tensors.items() if not k.startswith(TRAIN_PREFIX)}
    return Checkpoint(state, int(tensors[EPOCH_KEY]), int(tensors[DATA_SEED_KEY]), config,
                      signature, metadata.get(VERSION_METADATA_KEY))


# The step's own state beside the model's: optimizer state (moments, step counter, LR
# schedule) and a loss module's buffers (compile_train_step keys them "loss.*").
TRAINING_STATE_PREFIXES = ("optimizer.", "loss.")


def model_state(path: str | Path) -> dict[str, np.ndarray]:
    """The model's state_dict held in a training checkpoint (`stepgraph train`'s
    checkpoint.safetensors): its parameters and buffers under their PyTorch keys, without
    the optimizer's state and the loop's, so that it loads for inference with a strict
    `model.load_state_dict(stepgraph.checkpoint.model_state(path))`. The file is checked as
    for a resume (CheckpointError naming it and the fault)."""
    saved = load_checkpoint(path)
    modules = None
    if saved.signature is not None:     # the model's module paths: "(root): GPT", "lm_head: ..."
        modules = {entry.split(": ", 1)[0] for entry in saved.signature.get("modules", [])}
    return {k: v for k, v in saved.state.items() if _is_model_key(k, modules)}


def _is_model_key(key: str, modules: set[str] | None) -> bool:
    """Whether a checkpoint's state key is the model's: the key of a parameter or buffer of
    one of its modules (by the step's signature, when the checkpoint has one), else any key
    outside TRAINING_STATE_PREFIXES."""
    owner = key.rpartition(".")[0] or "(root)"
    if modules is not None and owner in modules:
        return True
    return modules is None and not key.startswith(TRAINING_STATE_PREFIXES)


def _check_digest(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """CheckpointError unless the file's SHA-256 matches its header and tensors (or, written
    before the header was covered, its tensors)."""
    if CHECKSUM_METADATA_KEY in metadata:
        header = {k: v for k, v in metadata.items() if k != CHECKSUM_METADATA_KEY}
        if metadata[CHECKSUM_METADATA_KEY] != checkpoint_digest(tensors, header):
            raise CheckpointError(f"checkpoint {path} is corrupt: its header (version, run "
                                  "settings) or tensors do not match the SHA-256 written with "
                                  "them; was it edited?")
    elif DIGEST_METADATA_KEY in metadata:
        if metadata[DIGEST_METADATA_KEY] != tensors_digest(tensors):
            raise CheckpointError(f"checkpoint {path} is corrupt: its tensors do not match the "
                                  "SHA-256 written with them")
    else:
        raise CheckpointError(f"checkpoint {path} carries no SHA-256 ({CHECKSUM_METADATA_KEY}), "
                              "so its contents cannot be trusted")


def setting_differences(saved: dict, current: dict, keys: tuple[str, ...]) -> list[str]:
    """"key: checkpoint <saved value>, now <current value>" for every key in `keys` whose
    value differs between the configs."""
    return [f"{k}: checkpoint {saved.get(k)!r}, now {current.get(k)!r}"
            for k in keys if saved.get(k) != current.get(k)]


def check_compatible(saved: dict, current: dict, keys: tuple[str, ...], advice: str = "") -> None:
    """Raise CheckpointError naming every key in `keys` whose value differs between configs
    (saved vs current), followed by `advice`."""
    diffs = setting_differences(saved, current, keys)
    if diffs:
        raise CheckpointError("cannot resume a different run: " + "; ".join(diffs) + advice)


# ---- step signatures -----------------------------------------------------------------------

def _callable_name(fn) -> str:
    wrapped = getattr(fn, "__wrapped__", None)     # a checking wrapper names what it wraps
    if wrapped is not None:
        return _callable_name(wrapped)
    if isinstance(fn, functools.partial):
        args = [repr(a) for a in fn.args] + [f"{k}={v!r}" for k, v in sorted(fn.keywords.items())]
        return f"{_callable_name(fn.func)}({', '.join(args)})"
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def step_signature(step, state: dict[str, np.ndarray] | None = None) -> dict:
    """What a checkpoint of `step` must match to be loaded into it: the module tree (paths
    and types), the shape and dtype of every state_dict entry, the optimizer (type,
    hyperparameters, clipping, schedule; not the LR, which may change freely) and the loss."""
    state = step.state_dict() if state is None else state
    opt = step.optimizer
    optimizer = {"type": type(opt).__name__, "max_grad_norm": opt.max_grad_norm,
                 "schedule": repr(opt.schedule), **opt.hyperparameters()}
    return {"modules": [f"{name or '(root)'}: {type(m).__name__}"
                        for name, m in step.model.named_modules()],
            "state": {k: [list(np.shape(v)), str(np.asarray(v).dtype)]
                      for k, v in sorted(state.items())},
            "optimizer": optimizer,
            "loss": _callable_name(step.loss_fn)}


def signature_digest(signature: dict) -> str:
    """A short stable id of a signature."""
    text = json.dumps(signature, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def signature_differences(saved: dict, current: dict) -> list[str]:
    """What differs between two step signatures, in words (empty when they match)."""
    diffs = []
    old, new = saved.get("modules", []), current.get("modules", [])
    if old != new:
        at = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
        diffs.append(f"modules: checkpoint has {len(old)}, this model {len(new)}; first "
                     f"difference at #{at}: checkpoint "
                     f"{old[at] if at < len(old) else 'nothing'!r}, now "
                     f"{new[at] if at < len(new) else 'nothing'!r}")
    old, new = saved.get("state", {}), current.get("state", {})
    missing, extra = sorted(set(new) - set(old)), sorted(set(old) - set(new))
    if missing:
        diffs.append(f"state the checkpoint lacks: {_listed(missing)}")
    if extra:
        diffs.append(f"state this step does not have: {_listed(extra)}")
    changed = [f"{k} checkpoint {tuple(old[k][0])} {old[k][1]}, now {tuple(new[k][0])} "
               f"{new[k][1]}" for k in sorted(set(old) & set(new)) if old[k] != new[k]]
    if changed:
        diffs.append("shapes or dtypes: " + _listed(changed))
    for part in ("optimizer", "loss"):
        if saved.get(part) != current.get(part):
            diffs.append(f"{part}: checkpoint {saved.get(part)!r}, now {current.get(part)!r}")
    return diffs


def check_signature(saved: Checkpoint, current: dict, path: str | Path) -> None:
    """Raise CheckpointError explaining what differs when `saved` was written by a step
    unlike the one with signature `current` (a checkpoint without a signature passes)."""
    if saved.signature is None:
        return
    # Through JSON, as the saved signature was: tuples compare equal to the lists they became.
    current = json.loads(json.dumps(current, sort_keys=True))
    diffs = signature_differences(saved.signature, current)
    if diffs:
        version = __version__
        written = f" (written by stepgraph {saved.version}, this is {version})" \
            if saved.version and saved.version != version else ""
        raise CheckpointError(f"cannot resume from {path}: it holds the state of a different "
                              f"step{written}: " + "; ".join(diffs))
