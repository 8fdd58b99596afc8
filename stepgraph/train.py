"""The training loop behind `stepgraph train`.

    dataset -> model for its shape -> compiled train step + predict -> epochs of
    (steps, evaluation, checkpoint, metrics) -> plot, final test accuracy

The step runs without host syncs; the loop reads the loss only every LOG_EVERY steps and at
the end of an epoch. A checkpoint after every epoch holds the step's full state and the epoch
number; the data order (and the augmentation of a batch) is a pure function of (seed, epoch),
so `resume` continues exactly.

Data-parallel (`stepgraph train --gpus N`, or N processes started by a launcher that sets
WORLD_SIZE): every rank trains on its shard of each global batch of --batch-size samples, the
gradients are averaged inside the step, and rank 0 alone evaluates and writes the metrics,
plot and checkpoint. A resume needs the world size that wrote the checkpoint.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import stepgraph as sg

from . import checkpoint as ckpt
from . import losses, models, nn, optim
from .api import PRECISIONS
from .data import (DATASETS, BatchLoader, Dataset, RandomCropFlip, load_dataset, to_device,
                   with_layout)
from .errors import BackendUnavailableError, LabelError, NonFiniteError, StepgraphError
from .nn import init as nn_init

MODELS = ("mlp", "cnn", "resnet")
DEVICES = ("auto", "cpu", "cuda")
BAD_BATCH_POLICIES = ("raise", "skip")   # what a guarded step does with a bad batch
DEFAULT_EPOCHS = {"digits": 20, "mnist": 5, "cifar10": 20}
DEFAULT_BATCH_SIZE = {"digits": 32, "mnist": 64, "cifar10": 512}
DEFAULT_LR = {"mlp": 1e-3, "cnn": 1e-3, "resnet": 0.4}   # AdamW; SGD for resnet
DEFAULT_DATA_DIR = "data/mnist"
DEFAULT_DATA_DIRS = {"mnist": DEFAULT_DATA_DIR, "cifar10": "data/cifar10"}
# The resnet recipe (docs/BENCHMARKS.md): SGD with Nesterov momentum and weight decay, a linear
# warmup over the first RESNET_WARMUP of all steps then a cosine decay to 0, smoothed labels.
RESNET_MOMENTUM = 0.9
RESNET_WEIGHT_DECAY = 5e-4
RESNET_WARMUP = 0.2
RESNET_LABEL_SMOOTHING = 0.2
CROP_PADDING = 4            # CIFAR-10 augmentation: random 32x32 crop of the image padded by 4
LOG_EVERY = 20              # read the loss (a host sync) every this many steps
EVAL_BATCH = 1000
TRAIN_EVAL_LIMIT = 10_000   # train accuracy is measured on at most this many training samples
# A resume must match the checkpoint on these; epochs may grow, the device may change.
RESUME_KEYS = ("model", "data", "batch_size", "lr", "seed")
METRICS_NAME = "metrics.json"
PLOT_NAME = "metrics.png"


class TrainConfigError(StepgraphError, ValueError):
    """A training option has an invalid value."""


class TrainingDivergedError(StepgraphError, ArithmeticError):
    """The loss or the model's state became NaN or infinite."""


@dataclass(frozen=True)
class TrainConfig:
    """Options of one training run (the `stepgraph train` flags)."""

    model: str = "mlp"
    data: str = "digits"
    data_dir: str | None = None
    epochs: int | None = None       # None: DEFAULT_EPOCHS[data]
    batch_size: int | None = None   # None: DEFAULT_BATCH_SIZE[data]
    lr: float | None = None         # None: DEFAULT_LR[model]
    device: str = "auto"
    seed: int = 0
    out: str | None = None          # None: runs/<data>-<model>
    resume: bool = False
    progress: bool = True           # tqdm bars on stderr
    on_bad_batch: str = "raise"     # a batch with bad labels or a NaN/Inf: fail, or skip it
    precision: str = "fp32"         # "tf32": TF32 GEMMs (cuda only); "bf16": autocast
    world_size: int | None = None   # data-parallel processes; None: the launcher's WORLD_SIZE

    def validate(self) -> None:
        """Raise TrainConfigError naming the first invalid option."""
        choices = {"model": MODELS, "data": DATASETS, "device": DEVICES,
                   "on-bad-batch": BAD_BATCH_POLICIES, "precision": PRECISIONS}
        for name, allowed in choices.items():
            value = getattr(self, name.replace("-", "_"))
            if value not in allowed:
                raise TrainConfigError(f"--{name} must be one of {', '.join(allowed)}, "
                                       f"got {value!r}")
        positive = {"epochs": self.total_epochs, "batch-size": self.batch}
        for name, value in positive.items():
            if value < 1:
                raise TrainConfigError(f"--{name} must be >= 1, got {value}")
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise TrainConfigError(f"--lr must be a positive number, got {self.learning_rate}")
        if self.seed < 0:
            raise TrainConfigError(f"--seed must be >= 0, got {self.seed}")
        if self.processes < 1:
            raise TrainConfigError(f"the world size must be >= 1, got {self.processes}")
        if self.batch % self.processes:
            raise TrainConfigError(f"--batch-size {self.batch} does not split evenly over "
                                   f"{self.processes} processes (it is the global batch)")

    @property
    def processes(self) -> int:
        """Processes of a data-parallel run (1: not data-parallel)."""
        if self.world_size is not None:
            return self.world_size
        from .distributed import launched_world_size

        return launched_world_size()

    @property
    def total_epochs(self) -> int:
        return DEFAULT_EPOCHS[self.data] if self.epochs is None else self.epochs

    @property
    def batch(self) -> int:
        return DEFAULT_BATCH_SIZE[self.data] if self.batch_size is None else self.batch_size

    @property
    def learning_rate(self) -> float:
        return DEFAULT_LR[self.model] if self.lr is None else self.lr

    @property
    def out_dir(self) -> Path:
        return Path(self.out) if self.out else Path("runs") / f"{self.data}-{self.model}"

    def record(self) -> dict:
        """The config as plain JSON values, with defaults resolved."""
        return {**dataclasses.asdict(self), "epochs": self.total_epochs,
                "batch_size": self.batch, "lr": self.learning_rate, "out": str(self.out_dir),
                "world_size": self.processes}


@dataclass
class EpochMetrics:
    epoch: int                  # 1-based
    loss: float                 # mean of the losses read during the epoch
    train_accuracy: float
    test_accuracy: float
    steps_per_s: float
    seconds: float
    skipped: int = 0            # batches whose update the guard skipped (--on-bad-batch skip)


@dataclass
class ModelSpec:
    """A model, the loss that fits its output, and the input layout it takes."""

    module: Any
    loss: Callable
    layout: str                 # "flat" (N, features) or "image" (N, C, H, W)


@dataclass
class TrainResult:
    test_accuracy: float
    history: list[EpochMetrics]
    out_dir: Path
    device: str
    step: Any = field(repr=False)
    model: Any = field(repr=False)
    rank: int = 0               # a data-parallel run's rank (only rank 0 evaluates: NaN else)


def resolve_device(device: str) -> str:
    """`auto` -> cuda when a GPU backend works here, else cpu; `cuda` must be available."""
    if device == "auto":
        return "cuda" if sg.cuda_available() else "cpu"
    if device == "cuda" and not sg.cuda_available():
        raise BackendUnavailableError(
            "--device cuda: no usable GPU (needs an NVIDIA GPU and `pip install -e \".[cuda]\"`)")
    return device


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


def build_model(name: str, dataset: Dataset) -> ModelSpec:
    """The model `name` sized for the dataset's images, with its loss and input layout."""
    mnist_like = dataset.image_shape == (1, 28, 28) and dataset.classes == 10
    if name == "mlp":
        module = models.mlp() if mnist_like else small_mlp(dataset.features, dataset.classes)
        return ModelSpec(module, losses.cross_entropy, "flat")
    if name == "cnn" and mnist_like:
        return ModelSpec(models.cnn(), losses.nll_loss, "image")    # ends in LogSoftmax
    if name == "cnn" and dataset.image_shape == (1, 8, 8):
        return ModelSpec(small_cnn(dataset.classes), losses.cross_entropy, "image")
    if name == "resnet":
        loss = functools.partial(losses.cross_entropy, label_smoothing=RESNET_LABEL_SMOOTHING)
        module = models.resnet(dataset.classes, in_channels=dataset.image_shape[0])
        return ModelSpec(module, loss, "image")
    raise TrainConfigError(f"no {name} model for images of shape {dataset.image_shape}")


def make_optimizer(config: TrainConfig, steps_per_epoch: int) -> optim.Optimizer:
    """AdamW for mlp and cnn; the resnet recipe's SGD, its LR schedule spanning the run."""
    if config.model != "resnet":
        return optim.AdamW(lr=config.learning_rate)
    total = config.total_epochs * steps_per_epoch
    warmup = max(1, round(total * RESNET_WARMUP))
    schedule = optim.WarmupCosine(warmup, total) if warmup < total else None
    return optim.SGD(lr=config.learning_rate, momentum=RESNET_MOMENTUM, nesterov=True,
                     weight_decay=RESNET_WEIGHT_DECAY, schedule=schedule)


def make_transform(config: TrainConfig, spec: ModelSpec) -> RandomCropFlip | None:
    """Random crop and flip of CIFAR-10 images, seeded by the run's seed; else None."""
    if config.data == "cifar10" and spec.layout == "image":
        return RandomCropFlip(CROP_PADDING, seed=config.seed)
    return None


def resume_keys(config: TrainConfig) -> tuple[str, ...]:
    """What a resume must keep: RESUME_KEYS, and the epochs where the LR schedule spans them."""
    return RESUME_KEYS + (("epochs",) if config.model == "resnet" else ())


def seed_init(seed: int) -> None:
    """Make parameter initialisation reproducible: modules draw from nn.init's generator."""
    nn_init.manual_seed(seed)


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
    located = type(err)(f"{where}: {err}")
    located.step = err.step
    return located


@dataclass
class Session:
    """Everything an epoch needs, built once per run."""

    config: TrainConfig
    device: str
    model: Any
    step: Any
    predict: Any
    loader: BatchLoader
    eval_sets: dict[str, tuple[Any, np.ndarray]]
    rank: int = 0               # of a data-parallel run; rank 0 evaluates and writes files


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
    """Load the data, build and compile the model: everything but the epochs. Data-parallel:
    this rank's shard of every batch, and an evaluation set on rank 0 only."""
    device = resolve_device(config.device)
    if config.precision == "tf32" and device != "cuda":
        raise TrainConfigError(f"--precision {config.precision} needs a GPU (device {device})")
    group = process_group(config, device)
    rank, world = (group.rank, group.world_size) if group is not None else (0, 1)
    dataset = load_dataset(config.data, config.data_dir or DEFAULT_DATA_DIRS.get(config.data))
    seed_init(config.seed)
    spec = build_model(config.model, dataset)
    x_train = with_layout(dataset.x_train, spec.layout)
    x_test = with_layout(dataset.x_test, spec.layout)
    log(f"stepgraph: {config.model} on {config.data} ({len(x_train)} train, {len(x_test)} test "
        f"samples), device {device}" + (f", {world} processes" if world > 1 else ""))
    batch = config.batch // world
    loader = BatchLoader(x_train, dataset.y_train, batch, seed=config.seed, device=device,
                         transform=make_transform(config, spec), rank=rank, world_size=world)
    example = (x_train[:batch], dataset.y_train[:batch])
    step = sg.compile_train_step(spec.module, loss=spec.loss,
                                 optimizer=make_optimizer(config, len(loader)),
                                 example_inputs=example, device=device,
                                 graph=(device == "cuda"), seed=config.seed,
                                 on_bad_batch=config.on_bad_batch, distributed=group is not None,
                                 precision=config.precision)
    predict, eval_sets = None, {}
    if rank == 0:
        predict = sg.compile_predict(spec.module, example_inputs=(x_test[:EVAL_BATCH],),
                                     device=device, precision=config.precision)
        n_eval = min(len(x_train), TRAIN_EVAL_LIMIT)
        eval_sets = {"train": (to_device(x_train[:n_eval], device), dataset.y_train[:n_eval]),
                     "test": (to_device(x_test, device), dataset.y_test)}
    return Session(config, device, spec.module, step, predict, loader, eval_sets, rank)


# ---- the run's files in out_dir: checkpoint, metrics.json, metrics.png --------------------
# The GPT loop (train_gpt.py) writes and reads its files through these too; a session here is
# either loop's (what is used: its config's out_dir and seed, and its step).

def read_resume_checkpoint(config, keys: tuple[str, ...]) -> ckpt.Checkpoint:
    """The checkpoint in config.out_dir, after checking that the configuration that wrote it
    had config.record()'s values for `keys`."""
    saved = ckpt.load_checkpoint(config.out_dir / ckpt.CHECKPOINT_NAME)
    ckpt.check_compatible(saved.config, config.record(), keys)
    return saved


def restore_step(session, saved: ckpt.Checkpoint, history_key: str) -> list[dict]:
    """Load the checkpoint into the step, after checking it was written by a step like this
    one (ckpt.check_signature says what differs); return the records under `history_key` in
    the run's metrics.json (none when it is gone)."""
    ckpt.check_signature(saved, ckpt.step_signature(session.step),
                         session.config.out_dir / ckpt.CHECKPOINT_NAME)
    session.step.load_state_dict(saved.state)
    metrics_path = session.config.out_dir / METRICS_NAME
    if not metrics_path.is_file():
        return []
    return json.loads(metrics_path.read_text()).get(history_key, [])


def save_run_checkpoint(session, done: int, record: dict, after: str) -> Path:
    """The step's checkpoint after `done` epochs or steps (`after` says which, in words),
    holding the run's `record`, written atomically; a state holding NaN or Inf is never
    written (TrainingDivergedError; the previous checkpoint stays)."""
    path = session.config.out_dir / ckpt.CHECKPOINT_NAME
    state = session.step.state_dict()
    bad = ckpt.non_finite_keys(state)
    if bad:
        raise TrainingDivergedError(
            f"after {after} the model's state holds NaN or Inf ({', '.join(bad[:6])}"
            f"{' ...' if len(bad) > 6 else ''}); not writing it over {path}")
    return ckpt.save_checkpoint(path, ckpt.Checkpoint(
        state, done, session.config.seed, record, ckpt.step_signature(session.step, state)))


def write_metrics_file(out_dir: Path, record: dict) -> Path:
    """metrics.json in out_dir, written atomically like the checkpoint: a resume reads it."""
    path = out_dir / METRICS_NAME
    ckpt.write_atomically(path, (json.dumps(record, indent=2) + "\n").encode())
    return path


@contextlib.contextmanager
def two_panel_plot(path: Path, title: str):
    """Two side-by-side axes to draw on; on leaving, the figure is gridded, titled and saved
    to `path` as a PNG (matplotlib's Agg canvas; no display needed)."""
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
    fig.savefig(path, dpi=100)


def restore(session: Session, saved: ckpt.Checkpoint) -> list[EpochMetrics]:
    """Load the checkpoint into the step (restore_step); return the metrics of its finished
    epochs."""
    records = restore_step(session, saved, "epochs")
    return [EpochMetrics(**r) for r in records[:saved.epoch]]


def write_metrics(session: Session, history: list[EpochMetrics]) -> Path:
    return write_metrics_file(session.config.out_dir, {
        "config": session.config.record(), "device": session.device,
        "epochs": [dataclasses.asdict(m) for m in history],
        "test_accuracy": history[-1].test_accuracy if history else None})


def write_plot(history: list[EpochMetrics], path: Path, title: str) -> Path:
    """Loss and accuracy per epoch as a PNG."""
    from matplotlib.ticker import MaxNLocator

    epochs = [m.epoch for m in history]
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


def train_epoch(session: Session, epoch: int) -> EpochMetrics:
    """One epoch of training followed by evaluation on the train and test sets."""
    from tqdm import tqdm

    total = session.config.total_epochs
    with tqdm(total=len(session.loader), desc=f"epoch {epoch + 1}/{total}", unit="step",
              disable=not session.config.progress or session.rank != 0,
              dynamic_ncols=True) as bar:
        skipped = session.step.skipped_steps
        loss, seconds = run_epoch(session.step, session.loader, epoch, bar)
        skipped = session.step.skipped_steps - skipped
        acc = {name: evaluate(session.predict, x, y) for name, (x, y) in session.eval_sets.items()}
        acc = acc or {"train": math.nan, "test": math.nan}      # not rank 0
        steps_per_s = len(session.loader) / seconds
        bar.set_postfix_str(f"loss={loss:.4f} train_acc={acc['train']:.4f} "
                            f"test_acc={acc['test']:.4f} steps/s={steps_per_s:.0f}"
                            + (f" skipped={skipped}" if skipped else ""))
    return EpochMetrics(epoch + 1, loss, acc["train"], acc["test"], steps_per_s, seconds,
                        skipped)


def save_epoch_checkpoint(session: Session, epoch: int) -> Path:
    """The checkpoint after `epoch` (0-based), written by save_run_checkpoint."""
    return save_run_checkpoint(session, epoch + 1, session.config.record(), f"epoch {epoch + 1}")


def train(config: TrainConfig, log: Callable[[str], None] = print) -> TrainResult:
    """Train, evaluate after every epoch, and write metrics, plot and checkpoint to config.out_dir.

    With `config.resume` the run continues from the checkpoint in out_dir up to config.epochs
    in total, producing the same parameters as an uninterrupted run.
    """
    config.validate()
    # Checked before compiling: a refused resume fails at once.
    saved = None
    if config.resume:
        saved = read_resume_checkpoint(config, resume_keys(config))
        check_world_size(saved, config)
    session = build_session(config, log if config.processes == 1 else _rank0(log))
    writes = session.rank == 0          # data-parallel: rank 0 writes the run's files
    out_dir = config.out_dir
    if writes:
        out_dir.mkdir(parents=True, exist_ok=True)
    start, history = 0, []
    if saved is not None:
        start, history = saved.epoch, restore(session, saved)
        if writes:
            log(f"resuming from {out_dir / ckpt.CHECKPOINT_NAME} after epoch {start}")
    for epoch in range(start, config.total_epochs):
        history.append(train_epoch(session, epoch))
        if writes:
            save_epoch_checkpoint(session, epoch)
            write_metrics(session, history)
    if not writes:
        accuracy = math.nan
    elif history and history[-1].epoch == config.total_epochs:
        accuracy = history[-1].test_accuracy
    else:   # nothing left to train, or metrics of earlier epochs lost: measure now
        accuracy = evaluate(session.predict, *session.eval_sets["test"])
    if history and writes:
        write_plot(history, out_dir / PLOT_NAME, f"{config.data} {config.model} ({session.device})")
    return TrainResult(accuracy, history, out_dir, session.device, session.step, session.model,
                       session.rank)


def _rank0(log: Callable[[str], None]) -> Callable[[str], None]:
    """`log` on rank 0 of a data-parallel run; silence on the others."""
    return lambda line: log(line) if sg.distributed.get_rank() == 0 else None


def check_world_size(saved: ckpt.Checkpoint, config: TrainConfig) -> None:
    """A checkpoint resumes only on as many processes as wrote it (the data order, the
    per-rank batch and the optimizer's steps per epoch depend on it)."""
    wrote = int(saved.config.get("world_size") or 1)
    if wrote != config.processes:
        raise ckpt.CheckpointError(
            f"cannot resume: the checkpoint in {config.out_dir} was written by a run on {wrote} "
            f"process(es) (--gpus {wrote}), this run has {config.processes}; resume with "
            f"--gpus {wrote}")
