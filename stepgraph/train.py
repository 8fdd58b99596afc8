"""The one training loop behind `stepgraph train`, for every model and data set.

    data set (DATA) -> model for it (MODELS, or a user's FILE.py:CLASS) -> compiled train step
    + predict -> periods of (steps, evaluation, checkpoint, metrics) -> plot, final score

Two registries choose what runs: a data entry says how to load the data set and which kind of
run it makes (image data: epochs, evaluated by accuracy; text: --steps iterations, evaluated
by the validation loss every --eval-interval steps); a model entry says which data sets it
trains on, how to build it for one, and its optimizer recipe. The loop itself is the same for
all: after every period the step's full state goes into a checkpoint and the metrics so far
into metrics.json.

The step runs without host syncs; the loop reads the loss only every LOG_EVERY steps and at
the end of a period. The data order (and the augmentation of a batch) is a pure function of
(seed, epoch) or (seed, step), dropout's random stream one of (seed, step counter), so
`resume` continues exactly.

A run's files are never lost by accident: an --out that holds a run is refused unless the run
resumes it (--resume) or replaces it (--overwrite); a resume with settings that change the run
is refused, each difference named, unless --force; a metrics.json that cannot be read is kept
aside under a new name and the run resumes from its checkpoint.

Data-parallel (image data; `stepgraph train --gpus N`, or N processes started by a launcher
that sets WORLD_SIZE): every rank trains on its shard of each global batch of --batch-size
samples, the gradients are averaged inside the step, and rank 0 alone evaluates and writes the
metrics, plot and checkpoint. A resume needs the world size that wrote the checkpoint.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import stepgraph as sg

from . import checkpoint as ckpt
from . import backends, losses, models, nn, optim
from .api import PRECISIONS
from .data import BatchLoader, RandomCropFlip, load_dataset, to_device, with_layout
from .data.augment import array_module
from .data.text import TokenBatches, load_text
from .errors import BackendUnavailableError, LabelError, NonFiniteError, StepgraphError
from .model_file import (ModelFileError, build_model_from_file, is_model_file,
                         split_model_file)
from .nn import init as nn_init

DEVICES = backends.DEVICES             # --device: auto, cpu, cuda
BAD_BATCH_POLICIES = ("raise", "skip")   # what a guarded step does with a bad batch
DEFAULT_LR = 1e-3                        # AdamW, for models without a recipe of their own
# The resnet recipe (docs/BENCHMARKS.md): SGD with Nesterov momentum and weight decay, a linear
# warmup over the first RESNET_WARMUP of all steps then a cosine decay to 0, smoothed labels.
RESNET_MOMENTUM = 0.9
RESNET_WEIGHT_DECAY = 5e-4
RESNET_WARMUP = 0.2
RESNET_LABEL_SMOOTHING = 0.2
# The gpt recipe, nanoGPT's shakespeare-char: AdamW with betas (0.9, 0.99), weight decay on
# matrices and embeddings only, gradient norm clipped at 1.0, a warmup over 100 steps (or a
# tenth of the run, when that is less) then a cosine decay to lr/10 at the last step.
GPT_WARMUP_STEPS = 100
GPT_MIN_LR_FRACTION = 0.1
GPT_BETAS = (0.9, 0.99)
GPT_WEIGHT_DECAY = 0.1
GPT_GRAD_CLIP = 1.0
CROP_PADDING = 4            # CIFAR-10 augmentation: random 32x32 crop of the image padded by 4
LOG_EVERY = 20              # read the loss (a host sync) every this many steps
EVAL_BATCH = 1000
TRAIN_EVAL_LIMIT = 10_000   # train accuracy is measured on at most this many training samples
EVAL_STREAM = 1             # text evaluation batches: drawn apart from the training batches
METRICS_NAME = "metrics.json"
PLOT_NAME = "metrics.png"
# Settings a resume may change: where and how the run is shown and kept, the device, and how
# often it is evaluated. Every other recorded setting changes the run (the world size has a
# check of its own; the run's length is free unless the LR schedule spans it).
FREE_ON_RESUME = ("device", "out", "resume", "progress", "data_dir", "world_size",
                  "eval_interval", "eval_batches", "on_bad_batch")


class TrainConfigError(StepgraphError, ValueError):
    """A training option has an invalid value."""


class TrainingDivergedError(StepgraphError, ArithmeticError):
    """The loss or the model's state became NaN or infinite."""


class NothingTrainedError(StepgraphError, RuntimeError):
    """A run that would train nothing: a resume already at or past its length, or a period
    whose every batch the guard skipped (--on-bad-batch skip)."""


class RunFileError(StepgraphError, OSError):
    """A run's file in --out cannot be written or read; says which and what was kept."""


# ---- the registries ------------------------------------------------------------------------

@dataclass
class ModelSpec:
    """A model, the loss that fits its output, and the input layout it takes."""

    module: Any
    loss: Callable
    layout: str                 # "flat" (N, features), "image" (N, C, H, W) or "tokens" (B, T)


@dataclass(frozen=True)
class DataEntry:
    """A built-in data set: the kind of run it makes, its loader and its defaults."""

    kind: str                       # "image" or "text" (RUN_KINDS)
    load: Callable[[TrainConfig], Any]
    batch_size: int                 # default --batch-size
    epochs: int | None = None       # default --epochs (image data)
    data_dir: str | None = None     # default --data-dir (data read from files)


@dataclass(frozen=True)
class ModelEntry:
    """A built-in model: the data sets it trains on, how it is built for one (with the loss
    and the input layout that fit it), and its optimizer recipe."""

    data: tuple[str, ...]
    build: Callable[[TrainConfig, Any], ModelSpec]      # (config, data set)
    # (config, module, steps per epoch) -> the optimizer
    optimizer: Callable[[TrainConfig, Any, int], optim.Optimizer]
    lr: float = DEFAULT_LR          # default --lr
    options: tuple[str, ...] = ()   # its own TrainConfig fields (recorded, checked on resume)
    schedule_spans_run: bool = False    # the LR schedule spans the run: its length is fixed


def _load_images(config: TrainConfig):
    return load_dataset(config.data_set, config.data_dir or DATA[config.data_set].data_dir)


def _load_text(config: TrainConfig):
    return load_text(config.text_file)


DATA: dict[str, DataEntry] = {
    "digits": DataEntry("image", _load_images, batch_size=32, epochs=20),
    "mnist": DataEntry("image", _load_images, batch_size=64, epochs=5, data_dir="data/mnist"),
    "cifar10": DataEntry("image", _load_images, batch_size=512, epochs=20,
                         data_dir="data/cifar10"),
    "text": DataEntry("text", _load_text, batch_size=64),
}
IMAGE_DATA = tuple(name for name, entry in DATA.items() if entry.kind == "image")


def small_mlp(features: int, classes: int):
    """An MLP for small flat inputs (digits: 64 features)."""
    return nn.Sequential(nn.Linear(features, 256), nn.ReLU(), nn.Dropout(0.1),
                         nn.Linear(256, classes))


def small_cnn(classes: int):
    """A CNN for 8x8 images: two 3x3 conv + pool stages leave a 32x2x2 map."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 2 * 2, 64), nn.ReLU(), nn.Linear(64, classes))


def _mnist_like(dataset) -> bool:
    return dataset.image_shape == (1, 28, 28) and dataset.classes == 10


def _build_mlp(config, dataset) -> ModelSpec:
    module = models.mlp() if _mnist_like(dataset) else small_mlp(dataset.features,
                                                                   dataset.classes)
    return ModelSpec(module, losses.cross_entropy, "flat")


def _build_cnn(config, dataset) -> ModelSpec:
    if _mnist_like(dataset):
        return ModelSpec(models.cnn(), losses.nll_loss, "image")    # ends in LogSoftmax
    if dataset.image_shape == (1, 8, 8):
        return ModelSpec(small_cnn(dataset.classes), losses.cross_entropy, "image")
    raise TrainConfigError(f"no cnn model for images of shape {dataset.image_shape}")


def _build_resnet(config, dataset) -> ModelSpec:
    loss = functools.partial(losses.cross_entropy, label_smoothing=RESNET_LABEL_SMOOTHING)
    module = models.resnet(dataset.classes, in_channels=dataset.image_shape[0])
    return ModelSpec(module, loss, "image")


def _build_gpt(config, dataset) -> ModelSpec:
    module = models.GPT(models.GPTConfig(dataset.vocab_size, config.block_size, config.n_layer,
                                         config.n_head, config.n_embd, config.dropout))
    return ModelSpec(module, models.next_token_loss, "tokens")


def _adamw(config, module, steps_per_epoch: int) -> optim.AdamW:
    return optim.AdamW(lr=config.learning_rate)


def _resnet_sgd(config, module, steps_per_epoch: int) -> optim.SGD:
    total = config.total_epochs * steps_per_epoch
    warmup = max(1, round(total * RESNET_WARMUP))
    schedule = optim.WarmupCosine(warmup, total) if warmup < total else None
    return optim.SGD(lr=config.learning_rate, momentum=RESNET_MOMENTUM, nesterov=True,
                     weight_decay=RESNET_WEIGHT_DECAY, schedule=schedule)


def _gpt_adamw(config, module, steps_per_epoch: int) -> optim.AdamW:
    warmup = min(GPT_WARMUP_STEPS, config.steps // 10)
    min_lr = config.learning_rate * GPT_MIN_LR_FRACTION
    schedule = (optim.WarmupCosine(warmup, config.steps, min_lr) if warmup >= 1
                else optim.Cosine(config.steps, min_lr))
    return module.configure_optimizers(GPT_WEIGHT_DECAY, config.learning_rate, GPT_BETAS,
                                       schedule=schedule, max_grad_norm=GPT_GRAD_CLIP)


MODELS: dict[str, ModelEntry] = {
    "mlp": ModelEntry(IMAGE_DATA, _build_mlp, _adamw),
    "cnn": ModelEntry(IMAGE_DATA, _build_cnn, _adamw),
    "resnet": ModelEntry(IMAGE_DATA, _build_resnet, _resnet_sgd, lr=0.4,
                         schedule_spans_run=True),
    "gpt": ModelEntry(("text",), _build_gpt, _gpt_adamw,
                      options=("n_layer", "n_head", "n_embd", "dropout"),
                      schedule_spans_run=True),
}


def _build_from_file(config, dataset) -> ModelSpec:
    """A user's model: images (N, C, H, W) to logits, trained with cross-entropy; or tokens
    (B, T) to next-token logits (B, T, V)."""
    module = build_model_from_file(config.model, config.model_args or {})
    if DATA[config.data_set].kind == "text":
        loss = ModelFileLoss(models.next_token_loss, config.model, "text", dataset.vocab_size)
        return ModelSpec(module, loss, "tokens")
    loss = ModelFileLoss(losses.cross_entropy, config.model, config.data_set, dataset.classes)
    return ModelSpec(module, loss, "image")


@dataclass(frozen=True)
class ModelFileLoss:
    """A model file's loss, checking at trace time what its forward returned: one tensor of
    logits, (N, classes) on image data or (B, T, V) on text, with at least as many classes
    as the data has. A mismatch is a ModelFileError saying what was returned and what to
    return, instead of an error from inside the loss or a non-finite loss at the first step
    (a token past the logits' vocabulary reads no logit)."""

    loss: Callable
    model: str                  # --model FILE.py:CLASS
    data: str                   # the data set's name ("text" for text)
    classes: int                # labels (image) or tokens (text) lie in [0, classes)

    @property
    def __wrapped__(self) -> Callable:
        """The loss it checks for: a checkpoint's step signature names that one, as it did
        before the check (checkpoint._callable_name), so earlier runs still resume."""
        return self.loss

    def __call__(self, out, target):
        text = self.data == "text"
        wanted = "next-token logits (B, T, V)" if text else "logits (N, classes)"
        if not isinstance(out, sg.Tensor):
            what = f"a {type(out).__name__}"
            if isinstance(out, (tuple, list, dict)):
                what += f" of {len(out)} entr{'y' if len(out) == 1 else 'ies'}"
            raise ModelFileError(f"--model {self.model}: forward returned {what}; on --data "
                                 f"{self.data} it must return one tensor, the {wanted} (return "
                                 "the logits alone)")
        if out.ndim != (3 if text else 2):
            raise ModelFileError(f"--model {self.model}: forward returned a tensor of shape "
                                 f"{tuple(out.shape)}; on --data {self.data} it must return "
                                 f"the {wanted}")
        if out.shape[-1] < self.classes:
            unit = "tokens" if text else "labels"
            raise ModelFileError(
                f"--model {self.model}: its logits have {out.shape[-1]} classes but "
                f"--data {self.data} has {self.classes} ({unit} must be in "
                f"[0, {out.shape[-1]}), the data's are in [0, {self.classes})): build the "
                f"model with {self.classes} outputs"
                + (f" (the vocabulary size, e.g. --model-args '{{\"vocab_size\": "
                   f"{self.classes}}}')" if text else ""))
        return self.loss(out, target)


# A model file trains on every data set, with AdamW at a constant LR.
MODEL_FILE = ModelEntry(tuple(DATA), _build_from_file, _adamw, options=("model_args",))


def model_entry(model: str) -> ModelEntry:
    """The registry entry of --model: a built-in's, or MODEL_FILE for FILE.py:CLASS."""
    if is_model_file(model):
        return MODEL_FILE
    if model not in MODELS:
        raise TrainConfigError(f"--model must be one of {', '.join(MODELS)} or FILE.py:CLASS, "
                               f"got {model!r}")
    return MODELS[model]


# ---- the run's options ---------------------------------------------------------------------

# The options each kind of data adds to the run's record.
KIND_OPTIONS = {"image": ("data_dir", "epochs", "world_size"),
                "text": ("text_file", "steps", "eval_interval", "eval_batches", "block_size")}
COMMON_OPTIONS = ("model", "data", "batch_size", "lr", "device", "seed", "out", "resume",
                  "progress", "on_bad_batch", "precision")


@dataclass(frozen=True)
class TrainConfig:
    """Options of one training run (the `stepgraph train` flags). None means the default of
    the model's or the data set's registry entry."""

    model: str = "mlp"              # a MODELS name, or FILE.py:CLASS
    data: str | None = None         # None: the model's first data set
    data_dir: str | None = None     # None: DATA[data].data_dir
    epochs: int | None = None       # image data; None: DATA[data].epochs
    batch_size: int | None = None   # None: DATA[data].batch_size
    lr: float | None = None         # None: the model entry's lr
    device: str = "auto"
    seed: int = 0
    out: str | None = None          # None: runs/<data>-<model>
    resume: bool = False
    overwrite: bool = False         # replace a run already in out
    force: bool = False             # resume even where the settings differ from the checkpoint's
    progress: bool = True           # tqdm bars on stderr
    on_bad_batch: str = "raise"     # a batch with bad labels or a NaN/Inf: fail, or skip it
    precision: str = "fp32"         # "tf32": TF32 GEMMs (cuda only); "bf16": autocast
    world_size: int | None = None   # data-parallel processes; None: the launcher's WORLD_SIZE
    # text data
    text_file: str | None = None    # None: the default corpus (data/text.py)
    steps: int = 2000
    eval_interval: int = 250
    eval_batches: int = 20          # batches per split a loss estimate averages
    block_size: int = 256
    # gpt
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.2
    # a model file
    model_args: dict | None = None  # keyword arguments of its class

    def validate(self) -> None:
        """Raise TrainConfigError naming the first invalid option."""
        entry = model_entry(self.model)
        choices = {"data": tuple(DATA), "device": DEVICES, "on-bad-batch": BAD_BATCH_POLICIES,
                   "precision": PRECISIONS}
        for name, allowed in choices.items():
            value = self.data_set if name == "data" else getattr(self, name.replace("-", "_"))
            if value not in allowed:
                raise TrainConfigError(f"--{name} must be one of {', '.join(allowed)}, "
                                       f"got {value!r}")
        if self.data_set not in entry.data:
            raise TrainConfigError(f"--model {self.model} does not train on --data "
                                   f"{self.data_set}: it trains on {', '.join(entry.data)}"
                                   + ("; use --model gpt or a model file (FILE.py:CLASS) with "
                                      "--data text" if self.kind == "text" else ""))
        self._validate_kind()
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise TrainConfigError(f"--lr must be a positive number, got {self.learning_rate}")
        if self.seed < 0:
            raise TrainConfigError(f"--seed must be >= 0, got {self.seed}")
        if self.resume and self.overwrite:
            raise TrainConfigError("--resume continues the run in --out and --overwrite "
                                   "replaces it: pass one of them")
        if self.force and not self.resume:
            raise TrainConfigError("--force applies to --resume only")
        if self.model_args is not None and entry is not MODEL_FILE:
            raise TrainConfigError("--model-args applies to a model file (--model "
                                   "FILE.py:CLASS) only")

    def _validate_kind(self) -> None:
        """The checks of the options of this kind of data (and of gpt)."""
        if self.kind == "image":
            positive = {"epochs": self.total_epochs, "batch-size": self.batch}
        else:
            subject = "--model gpt" if self.model == "gpt" else "--data text"
            for flag, value in (("--epochs", self.epochs), ("--data-dir", self.data_dir)):
                if value is not None:
                    raise TrainConfigError(f"{flag} does not apply to {subject} (it trains for "
                                           "--steps on --text-file)")
            positive = {"steps": self.steps, "eval-interval": self.eval_interval,
                        "eval-batches": self.eval_batches, "batch-size": self.batch,
                        "block-size": self.block_size}
            if self.model == "gpt":
                positive.update({"n-layer": self.n_layer, "n-head": self.n_head,
                                 "n-embd": self.n_embd})
        for name, value in positive.items():
            if value < 1:
                raise TrainConfigError(f"--{name} must be >= 1, got {value}")
        if self.model == "gpt" and self.n_embd % self.n_head:
            raise TrainConfigError(f"--n-embd ({self.n_embd}) must be a multiple of --n-head "
                                   f"({self.n_head})")
        if self.model == "gpt" and not 0.0 <= self.dropout < 1.0:
            raise TrainConfigError(f"--dropout must be in [0, 1), got {self.dropout}")
        if self.processes < 1:
            raise TrainConfigError(f"the world size must be >= 1, got {self.processes}")
        if self.kind == "text" and self.processes > 1:
            raise TrainConfigError("data-parallel training (--gpus) applies to image data only "
                                   "(mlp, cnn, resnet and model files)")
        if self.batch % self.processes:
            raise TrainConfigError(f"--batch-size {self.batch} does not split evenly over "
                                   f"{self.processes} processes (it is the global batch)")

    @property
    def data_set(self) -> str:
        """--data, or the model's first data set."""
        return self.data if self.data is not None else model_entry(self.model).data[0]

    @property
    def kind(self) -> str:
        """The kind of run: "image" (epochs, accuracy) or "text" (steps, validation loss)."""
        return DATA[self.data_set].kind

    @property
    def model_name(self) -> str:
        """The model's short name: a built-in's, or a model file's class name."""
        return split_model_file(self.model)[1] if is_model_file(self.model) else self.model

    @property
    def processes(self) -> int:
        """Processes of a data-parallel run (1: not data-parallel)."""
        if self.world_size is not None:
            return self.world_size
        from .distributed import launched_world_size

        return launched_world_size()

    @property
    def total_epochs(self) -> int:
        return DATA[self.data_set].epochs if self.epochs is None else self.epochs

    @property
    def batch(self) -> int:
        return DATA[self.data_set].batch_size if self.batch_size is None else self.batch_size

    @property
    def learning_rate(self) -> float:
        return model_entry(self.model).lr if self.lr is None else self.lr

    @property
    def out_dir(self) -> Path:
        return (Path(self.out) if self.out
                else Path("runs") / f"{self.data_set}-{self.model_name}")

    def record(self) -> dict:
        """The run's settings as plain JSON values, with defaults resolved: the common ones,
        its kind of data's, its model's."""
        resolved = {"data": self.data_set, "epochs": self.total_epochs,
                    "batch_size": self.batch, "lr": self.learning_rate,
                    "out": str(self.out_dir), "world_size": self.processes}
        names = COMMON_OPTIONS + KIND_OPTIONS[self.kind] + model_entry(self.model).options
        return {name: resolved.get(name, getattr(self, name)) for name in names}

    def run_settings(self) -> tuple[str, ...]:
        """The recorded settings a resume must keep (all but FREE_ON_RESUME, and the run's
        length unless the LR schedule spans it)."""
        length = "epochs" if self.kind == "image" else "steps"
        free = FREE_ON_RESUME + (() if model_entry(self.model).schedule_spans_run
                                 else (length,))
        return tuple(k for k in self.record() if k not in free)


@dataclass(frozen=True)
class GPTTrainConfig(TrainConfig):
    """A TrainConfig whose defaults are gpt on text."""

    model: str = "gpt"
    data: str | None = "text"


def build_model(name: str, dataset, config: TrainConfig | None = None) -> ModelSpec:
    """The model `name` built for the data set (gpt: at config's sizes), with its loss and
    input layout."""
    return model_entry(name).build(config or TrainConfig(model=name), dataset)


def make_optimizer(config: TrainConfig, steps_per_epoch: int, module=None) -> optim.Optimizer:
    """The optimizer of the model's recipe for `module` (gpt needs it: decay on matrices)."""
    return model_entry(config.model).optimizer(config, module, steps_per_epoch)


def make_transform(config: TrainConfig, spec: ModelSpec) -> RandomCropFlip | None:
    """Random crop and flip of CIFAR-10 images, seeded by the run's seed; else None."""
    if config.data_set == "cifar10" and spec.layout == "image":
        return RandomCropFlip(CROP_PADDING, seed=config.seed)
    return None


# ---- metrics of a period -------------------------------------------------------------------

@dataclass
class EpochMetrics:
    """An epoch of image data."""

    epoch: int                  # 1-based
    loss: float                 # mean of the losses read during the epoch
    train_accuracy: float
    test_accuracy: float
    steps_per_s: float
    seconds: float
    skipped: int = 0            # batches whose update the guard skipped (--on-bad-batch skip)


@dataclass
class EvalMetrics:
    """The losses at one evaluation of a text run and the training speed since the previous."""

    step: int                   # steps done
    loss: float                 # mean of the training losses read since the last evaluation
    train_loss: float           # eval-mode estimates on fixed batches of each split
    val_loss: float
    tokens_per_s: float
    seconds: float              # training time since the last evaluation (evaluation excluded)
    lr: float                   # the learning rate of the last step
    skipped: int = 0            # steps whose update the guard skipped (--on-bad-batch skip)


@dataclass
class TrainResult:
    """A finished run: its final score (test accuracy for image data, validation loss for
    text), its metrics per period, and the trained step and model."""

    history: list
    out_dir: Path
    device: str
    step: Any = field(repr=False)
    model: Any = field(repr=False)
    rank: int = 0               # a data-parallel run's rank (only rank 0 evaluates: NaN else)
    dataset: Any = field(default=None, repr=False)
    test_accuracy: float | None = None
    val_loss: float | None = None


@dataclass
class Session:
    """Everything a period needs, built once per run."""

    config: TrainConfig
    device: str
    dataset: Any
    model: Any
    step: Any
    predict: Any
    batches: Any                # BatchLoader (image) or TokenBatches (text)
    eval_sets: dict             # image: split -> (x, y); text: split -> list of batches
    rank: int = 0               # of a data-parallel run; rank 0 evaluates and writes files


def resolve_device(device: str) -> str:
    """`auto` -> cuda when a GPU backend works here, else cpu; `cuda` must be available."""
    if device == "auto":
        return backends.resolve_device(device)
    if device == "cuda" and not sg.cuda_available():
        raise BackendUnavailableError(
            "--device cuda: no usable GPU (needs an NVIDIA GPU and `pip install -e \".[cuda]\"`)")
    return device


def seed_init(seed: int) -> None:
    """Make parameter initialisation reproducible: modules draw from nn.init's generator."""
    nn_init.manual_seed(seed)


# ---- image data: epochs, accuracy ----------------------------------------------------------

def evaluate(predict, x, y: np.ndarray, batch_size: int = EVAL_BATCH) -> float:
    """Accuracy of argmax(predict(x)) against labels y, predicting in batches."""
    correct = 0
    for i in range(0, len(y), batch_size):
        logits = sg.to_numpy(predict(x[i:i + batch_size]))
        correct += int((logits.argmax(axis=1) == y[i:i + batch_size]).sum())
    return correct / len(y)


def run_epoch(step, loader: BatchLoader, epoch: int, bar,
              report: Callable[[str], None] | None = None) -> tuple[float, float]:
    """Train one epoch; return (mean of the losses read, seconds). Reads the loss rarely. A
    batch the step's guard rejects fails the epoch with its epoch and batch index named
    (on_bad_batch "raise"), or is reported through `report` (default bar.write) and skipped
    ("skip")."""
    report = report or bar.write
    losses_read, recent = [], []
    n = len(loader)
    start = time.perf_counter()
    first, skipped = None, step.skipped_steps if step.on_bad_batch == "skip" else 0
    try:
        for i, (x, y) in enumerate(loader.epoch(epoch)):
            loss = step(x, y)
            first = loss.step - i if first is None else first   # step number of batch 0
            recent.append((i, loss))
            if (i + 1) % LOG_EVERY == 0 or i + 1 == n:
                value = float(loss)   # syncs; raises the error of a rejected batch ("raise")
                if step.on_bad_batch == "skip":
                    skipped = _report_skipped(step, skipped, recent, epoch, n, report)
                recent = []
                if not math.isfinite(value) and not loss.skipped:
                    raise TrainingDivergedError(f"loss is {value} at epoch {epoch + 1}, "
                                                f"batch {i + 1} of {n} (step {loss.step})")
                if math.isfinite(value):
                    losses_read.append(value)
                elapsed = time.perf_counter() - start
                bar.set_postfix_str(f"loss={value:.4f} steps/s={(i + 1) / elapsed:.0f}",
                                    refresh=False)
            bar.update(1)
    except (LabelError, NonFiniteError) as err:
        raise _located(err, epoch, first, n) from err
    mean = float(np.mean(losses_read)) if losses_read else math.nan
    return mean, time.perf_counter() - start


def _report_skipped(step, skipped: int, recent: list, epoch: int, n: int,
                    report: Callable[[str], None]) -> int:
    """Report the batches among `recent` (batch index, loss) whose update was skipped, when the
    step's skip count moved (one read); return the new count."""
    now = step.skipped_steps
    if now != skipped:
        for i, loss in recent:
            if loss.skipped:
                report(f"epoch {epoch + 1}, batch {i + 1} of {n} (step {loss.step}) skipped: "
                       f"{loss.problem}")
    return now


def _located(err, epoch: int, first: int | None, n: int):
    """`err` (a guard's LabelError / NonFiniteError) with its epoch and batch in front."""
    batch = None if first is None or err.step is None else err.step - first
    where = f"epoch {epoch + 1}" + (f", batch {batch + 1} of {n}" if batch is not None
                                    and 0 <= batch < n else "")
    located = type(err)(f"{where}: {_with_advice(err)}")
    located.step = err.step
    return located


def _with_advice(err) -> str:
    """A guard's error message, with what to try when it is a NaN or Inf."""
    if not isinstance(err, NonFiniteError):
        return str(err)
    return (f"{err} (a learning rate too large for the model, or values that overflow float32:"
            " try a smaller --lr; --on-bad-batch skip goes on without such batches)")


def train_epoch(session: Session, epoch: int) -> EpochMetrics:
    """One epoch of training followed by evaluation on the train and test sets."""
    from tqdm import tqdm

    total = session.config.total_epochs
    with tqdm(total=len(session.batches), desc=f"epoch {epoch + 1}/{total}", unit="step",
              disable=not session.config.progress or session.rank != 0,
              dynamic_ncols=True) as bar:
        skipped = session.step.skipped_steps
        loss, seconds = run_epoch(session.step, session.batches, epoch, bar)
        skipped = session.step.skipped_steps - skipped
        acc = {name: evaluate(session.predict, x, y) for name, (x, y) in session.eval_sets.items()}
        acc = acc or {"train": math.nan, "test": math.nan}      # not rank 0
        steps_per_s = len(session.batches) / seconds
        bar.set_postfix_str(f"loss={loss:.4f} train_acc={acc['train']:.4f} "
                            f"test_acc={acc['test']:.4f} steps/s={steps_per_s:.0f}"
                            + (f" skipped={skipped}" if skipped else ""))
    return EpochMetrics(epoch + 1, loss, acc["train"], acc["test"], steps_per_s, seconds,
                        skipped)


# ---- text data: steps, validation loss -----------------------------------------------------

def mean_cross_entropy(logits, targets) -> float:
    """Mean cross-entropy of logits (..., V) at integer targets (...), in float64, computed
    where the arrays live (NumPy or CuPy)."""
    xp = array_module(logits)
    z = logits.astype(xp.float64)
    top = z.max(axis=-1, keepdims=True)
    lse = xp.log(xp.exp(z - top).sum(axis=-1)) + top[..., 0]
    picked = xp.take_along_axis(z, targets[..., None].astype(xp.int64), axis=-1)[..., 0]
    return float((lse - picked).mean())


def estimate_loss(predict, batches: list[tuple[Any, Any]]) -> float:
    """The mean eval-mode loss over `batches`."""
    losses_ = []
    for x, y in batches:
        logits = predict(x)
        with _stream_of(predict):    # in order after the predictor's work
            losses_.append(mean_cross_entropy(logits, y))
    return float(np.mean(losses_))


def _stream_of(compiled):
    """The CUDA stream a compiled step or predictor runs on, as a context; else a no-op."""
    stream = getattr(compiled.backend, "stream", None)
    return stream if stream is not None else contextlib.nullcontext()


def run_steps(session: Session, first: int, last: int, bar) -> tuple[float, float]:
    """Train steps first..last-1; return (mean of the losses read, seconds). Reads the loss
    every LOG_EVERY steps and at the last one."""
    step, losses_read = session.step, []
    tokens = session.config.batch * session.config.block_size
    start = time.perf_counter()
    try:
        for s, (x, y) in enumerate(session.batches.batches(first, last), start=first):
            loss = step(x, y)
            if (s + 1) % LOG_EVERY == 0 or s + 1 == last:
                value = float(loss)   # syncs; raises the error of a rejected batch ("raise")
                if not math.isfinite(value) and not loss.skipped:
                    raise TrainingDivergedError(f"loss is {value} at step {s + 1}")
                if math.isfinite(value):
                    losses_read.append(value)
                rate = (s + 1 - first) * tokens / (time.perf_counter() - start)
                bar.set_postfix_str(f"loss={value:.4f} tok/s={rate:,.0f}", refresh=False)
            bar.update(1)
    except (LabelError, NonFiniteError) as err:
        located = type(err)(_with_advice(err))     # the guard's message names the step
        located.step = err.step
        raise located from err
    mean = float(np.mean(losses_read)) if losses_read else math.nan
    return mean, time.perf_counter() - start


def train_interval(session: Session, first: int, last: int, bar) -> EvalMetrics:
    """Steps first..last-1, then the loss estimates."""
    step = session.step
    skipped = step.skipped_steps
    loss, seconds = run_steps(session, first, last, bar)
    skipped = step.skipped_steps - skipped
    estimates = {split: estimate_loss(session.predict, batches)
                 for split, batches in session.eval_sets.items()}
    tokens = (last - first) * session.config.batch * session.config.block_size
    lr = optim.schedules.schedule_lr(step.optimizer.schedule_vector(), last)
    bar.write(f"step {last}: loss {loss:.4f}, train {estimates['train']:.4f}, val "
              f"{estimates['val']:.4f}, {tokens / seconds:,.0f} tokens/s"
              + (f", {skipped} skipped" if skipped else ""))
    return EvalMetrics(last, loss, estimates["train"], estimates["val"], tokens / seconds,
                       seconds, lr, skipped)


def eval_points(config: TrainConfig, start: int) -> list[int]:
    """The step counts after which a text run evaluates and checkpoints, past `start`."""
    points = list(range(config.eval_interval, config.steps, config.eval_interval))
    return [p for p in points + [config.steps] if p > start]


def count_parameters(module) -> int:
    """Parameters of the model, a tied one counted once."""
    return sum(int(np.prod(p.shape)) for p in module.parameters())


# ---- the two kinds of run ------------------------------------------------------------------

def compile_step(config: TrainConfig, spec: ModelSpec, example, device: str, group,
                 steps_per_epoch: int):
    """The compiled train step of the run's model, loss and optimizer recipe."""
    return sg.compile_train_step(spec.module, loss=spec.loss,
                                 optimizer=make_optimizer(config, steps_per_epoch, spec.module),
                                 example_inputs=example, device=device,
                                 graph=(device == "cuda"), seed=config.seed,
                                 on_bad_batch=config.on_bad_batch, distributed=group is not None,
                                 precision=config.precision)


class ImageRun:
    """Image data: the run is --epochs epochs, each followed by the train and test accuracy;
    its score is the last test accuracy."""

    unit = "epoch"
    score = "test_accuracy"
    history_key = "epochs"
    record_type = EpochMetrics

    @staticmethod
    def build(config: TrainConfig, device: str, dataset, spec: ModelSpec, group,
              log: Callable[[str], None]) -> Session:
        rank, world = (group.rank, group.world_size) if group is not None else (0, 1)
        x_train = with_layout(dataset.x_train, spec.layout)
        x_test = with_layout(dataset.x_test, spec.layout)
        log(f"stepgraph: {config.model_name} on {config.data_set} ({len(x_train)} train, "
            f"{len(x_test)} test samples), device {device}"
            + (f", {world} processes" if world > 1 else ""))
        batch = config.batch // world
        loader = BatchLoader(x_train, dataset.y_train, batch, seed=config.seed, device=device,
                             transform=make_transform(config, spec), rank=rank,
                             world_size=world)
        example = (x_train[:batch], dataset.y_train[:batch])
        step = compile_step(config, spec, example, device, group, len(loader))
        predict, eval_sets = None, {}
        if rank == 0:
            predict = sg.compile_predict(spec.module, example_inputs=(x_test[:EVAL_BATCH],),
                                         device=device, precision=config.precision)
            n_eval = min(len(x_train), TRAIN_EVAL_LIMIT)
            eval_sets = {"train": (to_device(x_train[:n_eval], device),
                                   dataset.y_train[:n_eval]),
                         "test": (to_device(x_test, device), dataset.y_test)}
        return Session(config, device, dataset, spec.module, step, predict, loader, eval_sets,
                       rank)

    @staticmethod
    def points(config: TrainConfig, start: int) -> list[int]:
        return list(range(start + 1, config.total_epochs + 1))

    @staticmethod
    def progress(session: Session, start: int):
        return contextlib.nullcontext()     # a bar per epoch (train_epoch)

    @staticmethod
    def train_period(session: Session, first: int, last: int, bar) -> EpochMetrics:
        return train_epoch(session, first)

    @staticmethod
    def steps(session: Session, first: int, last: int) -> int:
        """Steps the period first..last (epochs) ran."""
        return (last - first) * len(session.batches)

    @staticmethod
    def save(session: Session, done: int) -> Path:
        return save_epoch_checkpoint(session, done - 1)

    @staticmethod
    def check_restore(session, saved: ckpt.Checkpoint) -> None:
        pass

    @staticmethod
    def metrics(session: Session, history: list[EpochMetrics]) -> dict:
        return {"config": session.config.record(), "device": session.device,
                "epochs": [dataclasses.asdict(m) for m in history],
                "test_accuracy": history[-1].test_accuracy if history else None}

    @staticmethod
    def final(session: Session, history: list[EpochMetrics]) -> float:
        if history and history[-1].epoch == session.config.total_epochs:
            return history[-1].test_accuracy
        # the metrics of earlier epochs were lost (unreadable metrics.json): measure now
        return evaluate(session.predict, *session.eval_sets["test"])

    @staticmethod
    def plot(session: Session, history: list[EpochMetrics], path: Path) -> Path:
        """Loss and accuracy per epoch."""
        from matplotlib.ticker import MaxNLocator

        config = session.config
        epochs = [m.epoch for m in history]
        title = f"{config.data_set} {config.model_name} ({session.device})"
        with two_panel_plot(path, title) as (ax_loss, ax_acc):
            ax_loss.plot(epochs, [m.loss for m in history], marker="o")
            ax_loss.set(xlabel="epoch", ylabel="train loss", title="loss")
            ax_acc.plot(epochs, [m.train_accuracy for m in history], marker="o", label="train")
            ax_acc.plot(epochs, [m.test_accuracy for m in history], marker="o", label="test")
            ax_acc.set(xlabel="epoch", ylabel="accuracy", title="accuracy")
            ax_acc.legend()
            for ax in (ax_loss, ax_acc):
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        return path


class TextRun:
    """Text data: the run is --steps iterations, with the eval-mode loss on both splits
    every --eval-interval steps; its score is the last validation loss."""

    unit = "step"
    score = "val_loss"
    history_key = "evals"
    record_type = EvalMetrics

    @staticmethod
    def build(config: TrainConfig, device: str, dataset, spec: ModelSpec, group,
              log: Callable[[str], None]) -> Session:
        model = spec.module
        params = (model.get_num_params() if isinstance(model, models.GPT)
                  else count_parameters(model))
        log(f"stepgraph: {config.model_name} ({params / 1e6:.2f}M parameters) on "
            f"{dataset.name} ({len(dataset.train)} train, {len(dataset.val)} validation "
            f"characters, vocabulary {dataset.vocab_size}), device {device}, "
            f"{config.precision}")
        shape = (config.batch, config.block_size)
        example = (np.zeros(shape, np.int32), np.zeros(shape, np.int32))
        step = compile_step(config, spec, example, device, group, config.steps)
        predict = sg.compile_predict(model, example_inputs=example[:1], device=device,
                                     precision=config.precision)
        stream = getattr(step.backend, "stream", None) if device == "cuda" else None
        batches = TokenBatches(dataset.train, config.batch, config.block_size, "train",
                               config.seed, device, cuda_stream=stream)
        eval_sets = {}
        for split in ("train", "val"):
            source = TokenBatches(dataset.split(split), config.batch, config.block_size,
                                  split, config.seed, device, stream=EVAL_STREAM,
                                  cuda_stream=stream)
            eval_sets[split] = list(source.batches(0, config.eval_batches))
        return Session(config, device, dataset, model, step, predict, batches, eval_sets)

    @staticmethod
    def points(config: TrainConfig, start: int) -> list[int]:
        return eval_points(config, start)

    @staticmethod
    def progress(session: Session, start: int):
        from tqdm import tqdm

        return tqdm(total=session.config.steps, initial=start, desc=session.config.model_name,
                    unit="step", disable=not session.config.progress, dynamic_ncols=True)

    @staticmethod
    def train_period(session: Session, first: int, last: int, bar) -> EvalMetrics:
        return train_interval(session, first, last, bar)

    @staticmethod
    def steps(session: Session, first: int, last: int) -> int:
        """Steps the period first..last (steps) ran."""
        return last - first

    @staticmethod
    def save(session: Session, done: int) -> Path:
        """The checkpoint after `done` steps (in the Checkpoint's `epoch` field), its record
        holding what `stepgraph sample` needs too: the vocabulary."""
        record = {**session.config.record(), "vocab": session.dataset.vocab,
                  "vocab_size": session.dataset.vocab_size}
        return save_run_checkpoint(session, done, record, f"step {done}")

    @staticmethod
    def check_restore(session: Session, saved: ckpt.Checkpoint) -> None:
        if saved.config.get("vocab") != session.dataset.vocab:
            path = session.config.out_dir / ckpt.CHECKPOINT_NAME
            raise ckpt.CheckpointError(f"cannot resume from {path}: it was trained on text "
                                       "with another vocabulary")

    @staticmethod
    def metrics(session: Session, history: list[EvalMetrics]) -> dict:
        return {"config": session.config.record(), "device": session.device,
                "corpus": session.dataset.name, "vocab_size": session.dataset.vocab_size,
                "parameters": count_parameters(session.model),
                "evals": [dataclasses.asdict(m) for m in history],
                "val_loss": history[-1].val_loss if history else None}

    @staticmethod
    def final(session: Session, history: list[EvalMetrics]) -> float:
        if history and history[-1].step == session.config.steps:
            return history[-1].val_loss
        # the metrics of earlier evaluations were lost (unreadable metrics.json): measure now
        return estimate_loss(session.predict, session.eval_sets["val"])

    @staticmethod
    def plot(session: Session, history: list[EvalMetrics], path: Path) -> Path:
        """Losses and throughput per evaluation."""
        steps = [m.step for m in history]
        title = (f"{session.config.model_name} on {Path(session.dataset.name).name} "
                 f"({session.device})")
        with two_panel_plot(path, title) as (ax_loss, ax_speed):
            ax_loss.plot(steps, [m.loss for m in history], marker="o", label="training batches")
            ax_loss.plot(steps, [m.train_loss for m in history], marker="o",
                         label="train (eval mode)")
            ax_loss.plot(steps, [m.val_loss for m in history], marker="o", label="validation")
            ax_loss.set(xlabel="step", ylabel="cross-entropy (nats per character)",
                        title="loss")
            ax_loss.legend()
            ax_speed.plot(steps, [m.tokens_per_s for m in history], marker="o")
            ax_speed.set(xlabel="step", ylabel="tokens/s", title="training throughput")
        return path


RUN_KINDS = {"image": ImageRun, "text": TextRun}


def process_group(config: TrainConfig, device: str):
    """The data-parallel group of the run (None for one process). On CUDA the rank's GPU is
    made current first, so the loader's arrays land on it."""
    if config.processes == 1:
        return None
    if device == "cuda":
        from .backends import get_backend

        get_backend("cuda")
    group = sg.distributed.init()
    if group.world_size != config.processes:
        raise TrainConfigError(f"the run has {group.world_size} processes, the configuration "
                               f"{config.processes}")
    return group


def build_session(config: TrainConfig, log: Callable[[str], None]) -> Session:
    """Load the data, build and compile the model: everything but the periods. Data-parallel:
    this rank's shard of every batch, and an evaluation set on rank 0 only."""
    device = resolve_device(config.device)
    if config.precision == "tf32" and device != "cuda":
        raise TrainConfigError(f"--precision {config.precision} needs a GPU (device {device})")
    group = process_group(config, device)
    dataset = DATA[config.data_set].load(config)
    seed_init(config.seed)
    spec = model_entry(config.model).build(config, dataset)
    return RUN_KINDS[config.kind].build(config, device, dataset, spec, group, log)


# ---- the run's files in out_dir: checkpoint, metrics.json, metrics.png --------------------

RUN_FILES = (ckpt.CHECKPOINT_NAME, METRICS_NAME)    # an --out holding one of these holds a run


def warn(line: str) -> None:
    """A warning on stderr: the run goes on."""
    print(f"warning: {line}", file=sys.stderr, flush=True)


def check_out_dir(config: TrainConfig) -> None:
    """Refuse an --out that holds a run, unless this run resumes it (--resume) or replaces it
    (--overwrite): running a command twice must not silently replace the first run."""
    out = config.out_dir
    if out.exists() and not out.is_dir():
        raise RunFileError(f"--out {out} is a file, not a directory; nothing was written")
    if config.resume or config.overwrite:
        return
    found = [name for name in RUN_FILES if (out / name).exists()]
    if found:
        raise TrainConfigError(f"--out {out} already holds a run ({', '.join(found)}); pass "
                               "--resume to continue it, or --overwrite to replace it")


def make_out_dir(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunFileError(f"cannot create --out {out}: {err.strerror or err}; nothing was "
                           "written") from err


def read_resume_checkpoint(config: TrainConfig) -> ckpt.Checkpoint:
    """The checkpoint in config.out_dir, after checking that the run that wrote it had this
    run's settings (config.run_settings; --force skips the check)."""
    try:
        saved = ckpt.load_checkpoint(config.out_dir / ckpt.CHECKPOINT_NAME)
    except ckpt.CheckpointError as err:
        raise ckpt.CheckpointError(f"{err}; nothing in {config.out_dir} was changed (--overwrite "
                                   "instead of --resume starts a new run there)") from err
    if not config.force:
        ckpt.check_compatible(saved.config, config.record(), config.run_settings(),
                              advice="; resume with the checkpoint's settings, or pass --force "
                              "to resume with these")
    diffs = ckpt.setting_differences(saved.config, config.record(), config.run_settings())
    if diffs:
        warn("--force: resuming with settings that differ from the checkpoint's: "
             + "; ".join(diffs))
    return saved


def restore(session, saved: ckpt.Checkpoint) -> list:
    """Load the checkpoint into the step, after checking it was written by a step like this
    one (ckpt.check_signature says what differs); return the metrics of the periods it had
    finished, read from the run's metrics.json (none when it is gone or unreadable)."""
    config = session.config
    kind = RUN_KINDS[config.kind]
    kind.check_restore(session, saved)
    ckpt.check_signature(saved, ckpt.step_signature(session.step),
                         config.out_dir / ckpt.CHECKPOINT_NAME)
    session.step.load_state_dict(saved.state)
    if getattr(session, "rank", 0) != 0:    # data-parallel: rank 0 keeps the metrics
        return []
    history = read_history(config.out_dir / METRICS_NAME, kind)
    return [m for m in history if getattr(m, kind.unit) <= saved.epoch]


def read_history(path: Path, kind) -> list:
    """The metrics per period in the run's metrics.json; an unreadable file is kept aside
    under a new name, with a warning, and the history starts empty."""
    if not path.is_file():
        return []
    try:
        records = json.loads(path.read_bytes())[kind.history_key]
        return [kind.record_type(**record) for record in records]
    except (ValueError, KeyError, TypeError) as err:    # JSON, UTF-8, missing or odd fields
        kept = set_aside(path)
        warn(f"{path} cannot be read ({type(err).__name__}: {err}); kept it as {kept.name} "
             f"and resuming from the checkpoint, without the metrics of the {kind.unit}s "
             "before it")
        return []


def set_aside(path: Path) -> Path:
    """Rename `path` to a name not taken yet (PATH.unreadable, PATH.unreadable-1, ...)."""
    n = 0
    while True:
        kept = path.with_name(f"{path.name}.unreadable" + (f"-{n}" if n else ""))
        if not kept.exists():
            path.rename(kept)
            return kept
        n += 1


def save_run_checkpoint(session, done: int, record: dict, after: str) -> Path:
    """The step's checkpoint after `done` epochs or steps (`after` says which, in words),
    holding the run's `record`, written atomically; a state holding NaN or Inf is never
    written (TrainingDivergedError), nor is a failed write (RunFileError): the previous
    checkpoint stays."""
    path = session.config.out_dir / ckpt.CHECKPOINT_NAME
    state = session.step.state_dict()
    bad = ckpt.non_finite_keys(state)
    if bad:
        raise TrainingDivergedError(
            f"after {after} the model's state holds NaN or Inf ({', '.join(bad[:6])}"
            f"{' ...' if len(bad) > 6 else ''}); not writing it over {path}")
    kept = "the previous checkpoint there is kept" if path.exists() else "none was written"
    with _write_failures(path, f"the checkpoint after {after}", kept):
        return ckpt.save_checkpoint(path, ckpt.Checkpoint(
            state, done, session.config.seed, record, ckpt.step_signature(session.step, state)))


def save_epoch_checkpoint(session, epoch: int) -> Path:
    """The checkpoint after `epoch` (0-based) of image data, written by save_run_checkpoint."""
    return save_run_checkpoint(session, epoch + 1, session.config.record(), f"epoch {epoch + 1}")


@contextlib.contextmanager
def _write_failures(path: Path, what: str, kept: str):
    """An OSError (disk full, errno 27 file too large, ...) while writing `path` becomes a
    RunFileError naming the file and what was kept (write_atomically removed its temporary
    file)."""
    try:
        yield
    except OSError as err:
        if isinstance(err, RunFileError):
            raise
        raise RunFileError(f"cannot write {what} to {path}: {err.strerror or err}; "
                           f"{kept}") from err


def write_metrics_file(out_dir: Path, record: dict) -> Path:
    """metrics.json in out_dir, written atomically like the checkpoint: a resume reads it."""
    path = out_dir / METRICS_NAME
    kept = "the previous one is kept" if path.exists() else "none was written"
    with _write_failures(path, "the metrics", kept + "; the checkpoint is written"):
        ckpt.write_atomically(path, (json.dumps(record, indent=2) + "\n").encode())
    return path


def write_metrics(session: Session, history: list) -> Path:
    return write_metrics_file(session.config.out_dir,
                              RUN_KINDS[session.config.kind].metrics(session, history))


@contextlib.contextmanager
def two_panel_plot(path: Path, title: str):
    """Two side-by-side axes to draw on; on leaving, the figure is gridded, titled and saved
    to `path` as a PNG, atomically (matplotlib's Agg canvas; no display needed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    yield axes
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    kept = "the previous plot is kept" if path.exists() else "none was written"
    with _write_failures(path, "the plot", kept + "; the checkpoint and metrics are written"):
        ckpt.write_atomically(path, png.getvalue())


# ---- the loop ------------------------------------------------------------------------------

def train(config: TrainConfig, log: Callable[[str], None] = print) -> TrainResult:
    """Train, evaluating after every period (an epoch, or --eval-interval steps), and write
    checkpoint and metrics after each and a plot at the end to config.out_dir.

    With `config.resume` the run continues from the checkpoint in out_dir up to its length
    (epochs or steps) in total, producing the same parameters as an uninterrupted run.
    """
    config.validate()
    check_out_dir(config)
    # Checked before compiling: a refused resume fails at once.
    saved = None
    if config.resume:
        saved = read_resume_checkpoint(config)
        check_world_size(saved, config)
        check_left_to_train(saved, config)
    session = build_session(config, log if config.processes == 1 else _rank0(log))
    kind = RUN_KINDS[config.kind]
    writes = session.rank == 0          # data-parallel: rank 0 writes the run's files
    out_dir = config.out_dir
    if writes:
        make_out_dir(out_dir)
    start, history = 0, []
    if saved is not None:
        start, history = saved.epoch, restore(session, saved)
        if writes:
            log(f"resuming from {out_dir / ckpt.CHECKPOINT_NAME} after {kind.unit} {start}")
    with kind.progress(session, start) as bar:
        for point in kind.points(config, start):
            history.append(kind.train_period(session, start, point, bar))
            check_trained(history[-1], kind.steps(session, start, point), kind.unit, point)
            if writes:
                kind.save(session, point)
                write_metrics(session, history)
            start = point
    score = kind.final(session, history) if writes else math.nan
    if history and writes:
        kind.plot(session, history, out_dir / PLOT_NAME)
    return TrainResult(history, out_dir, session.device, session.step, session.model,
                       session.rank, session.dataset, **{kind.score: score})


def _rank0(log: Callable[[str], None]) -> Callable[[str], None]:
    """`log` on rank 0 of a data-parallel run; silence on the others."""
    return lambda line: log(line) if sg.distributed.get_rank() == 0 else None


def check_left_to_train(saved: ckpt.Checkpoint, config: TrainConfig) -> None:
    """A resume must have something to train: --epochs (--steps) is the run's total length,
    so a checkpoint already at or past it is refused, saying so, before anything is
    compiled (exit status 2, as any refused resume: a script that resumes to train further
    must not read the old score as the result of new training)."""
    unit, flag = (("epoch", "--epochs") if config.kind == "image" else ("step", "--steps"))
    total = config.total_epochs if config.kind == "image" else config.steps
    if saved.epoch >= total:
        where = ("has finished its" if saved.epoch == total
                 else f"is at {unit} {saved.epoch}, past")
        raise NothingTrainedError(
            f"nothing to resume: the run in {config.out_dir} {where} {flag} {total} ({flag} "
            f"is the run's total, not the number to add); pass {flag} {saved.epoch + 1} or "
            "more to train further")


def check_trained(metrics, steps: int, unit: str, point: int) -> None:
    """A period whose every step the guard skipped (--on-bad-batch skip) trained nothing:
    stop there, before writing its checkpoint, rather than report a score of the untrained
    model. Each skipped batch was reported, with its cause, as it was skipped."""
    if steps > 0 and metrics.skipped >= steps:
        raise NothingTrainedError(
            f"{unit} {point}: all {steps} steps were skipped (--on-bad-batch skip: each gave "
            "bad labels or a NaN/Inf loss or gradient, as reported above), so nothing was "
            "trained; fix the model or the data (a smaller --lr if the loss overflows), or "
            "run with --on-bad-batch raise to stop at the first bad batch")


def check_world_size(saved: ckpt.Checkpoint, config: TrainConfig) -> None:
    """A checkpoint resumes only on as many processes as wrote it (the data order, the
    per-rank batch and the optimizer's steps per epoch depend on it)."""
    wrote = int(saved.config.get("world_size") or 1)
    if wrote != config.processes:
        raise ckpt.CheckpointError(
            f"cannot resume: the checkpoint in {config.out_dir} was written by a run on {wrote} "
            f"process(es) (--gpus {wrote}), this run has {config.processes}; resume with "
            f"--gpus {wrote}")
