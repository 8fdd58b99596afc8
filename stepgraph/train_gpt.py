"""The training loop behind `stepgraph train --model gpt --data text`: a character-level GPT.

    text -> vocabulary and splits -> GPT (stepgraph.models.gpt) -> compiled train step
    (AdamW with weight decay on matrices, gradient clipping, warmup + cosine LR) and predictor
    -> `steps` iterations, the validation loss every `eval_interval` -> checkpoint, metrics

The recipe is nanoGPT's shakespeare-char: 6 layers, 6 heads, 384 wide, context 256, batch 64,
dropout 0.2, lr 1e-3 with 100 warmup steps and a cosine decay to lr/10 at the last step, betas
(0.9, 0.99), weight decay 0.1, gradient norm clipped at 1.0.

Iterations, not epochs: batch `s` is a pure function of (seed, s) (data/text.py) and dropout's
random stream one of (seed, step counter), so a checkpoint (written at every evaluation,
holding the step's full state and the vocabulary) continues exactly on `--resume`. The loop
reads the loss only every LOG_EVERY steps. Losses are estimated in eval mode (no dropout) on
fixed batches of each split.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import stepgraph as sg

from . import checkpoint as ckpt
from .api import PRECISIONS
from . import models, optim
from .data.augment import array_module
from .data.text import TextDataset, TokenBatches, load_text
from .errors import LabelError, NonFiniteError
from .train import (BAD_BATCH_POLICIES, DEVICES, PLOT_NAME, TrainConfigError,
                    TrainingDivergedError, read_resume_checkpoint, resolve_device, restore_step,
                    save_run_checkpoint, seed_init, two_panel_plot, write_metrics_file)

TEXT_MODELS = ("gpt",)
TEXT_DATASETS = ("text",)
LOG_EVERY = 20              # read the loss (a host sync) every this many steps
WARMUP_STEPS = 100          # or a tenth of the run, when that is less
MIN_LR_FRACTION = 0.1       # the cosine decay ends at lr * this
BETAS = (0.9, 0.99)
WEIGHT_DECAY = 0.1          # on matrices and embeddings only (models.optimizer_groups)
GRAD_CLIP = 1.0
EVAL_STREAM = 1             # evaluation batches: drawn apart from the training batches
# A resume must match the checkpoint on these (the LR schedule spans `steps`).
RESUME_KEYS = ("model", "data", "text_file", "batch_size", "lr", "seed", "steps", "block_size",
               "n_layer", "n_head", "n_embd", "dropout")


@dataclass(frozen=True)
class GPTTrainConfig:
    """Options of one GPT training run (the `stepgraph train --model gpt` flags)."""

    text_file: str | None = None    # None: the default corpus (data/text.py)
    steps: int = 2000
    eval_interval: int = 250
    eval_batches: int = 20          # batches per split a loss estimate averages
    batch_size: int = 64
    lr: float = 1e-3
    block_size: int = 256
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.2
    device: str = "auto"
    precision: str = "fp32"         # "tf32": TF32 GEMMs (cuda only); "bf16": autocast
    seed: int = 0
    out: str | None = None          # None: runs/text-gpt
    resume: bool = False
    progress: bool = True
    on_bad_batch: str = "raise"

    model = "gpt"
    data = "text"

    def validate(self) -> None:
        """Raise TrainConfigError naming the first invalid option."""
        choices = {"device": DEVICES, "precision": PRECISIONS,
                   "on-bad-batch": BAD_BATCH_POLICIES}
        for name, allowed in choices.items():
            value = getattr(self, name.replace("-", "_"))
            if value not in allowed:
                raise TrainConfigError(f"--{name} must be one of {', '.join(allowed)}, "
                                       f"got {value!r}")
        positive = {"steps": self.steps, "eval-interval": self.eval_interval,
                    "eval-batches": self.eval_batches, "batch-size": self.batch_size,
                    "block-size": self.block_size, "n-layer": self.n_layer,
                    "n-head": self.n_head, "n-embd": self.n_embd}
        for name, value in positive.items():
            if value < 1:
                raise TrainConfigError(f"--{name} must be >= 1, got {value}")
        if self.n_embd % self.n_head:
            raise TrainConfigError(f"--n-embd ({self.n_embd}) must be a multiple of --n-head "
                                   f"({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise TrainConfigError(f"--dropout must be in [0, 1), got {self.dropout}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise TrainConfigError(f"--lr must be a positive number, got {self.lr}")
        if self.seed < 0:
            raise TrainConfigError(f"--seed must be >= 0, got {self.seed}")

    @property
    def out_dir(self) -> Path:
        return Path(self.out) if self.out else Path("runs") / f"{self.data}-{self.model}"

    def record(self) -> dict:
        """The config as plain JSON values."""
        return {"model": self.model, "data": self.data, **dataclasses.asdict(self),
                "out": str(self.out_dir)}

    def model_config(self, vocab_size: int) -> models.GPTConfig:
        return models.GPTConfig(vocab_size, self.block_size, self.n_layer, self.n_head,
                                self.n_embd, self.dropout)


@dataclass
class EvalMetrics:
    """The losses at one evaluation and the training speed since the previous one."""

    step: int                   # steps done
    loss: float                 # mean of the training losses read since the last evaluation
    train_loss: float           # eval-mode estimates on fixed batches of each split
    val_loss: float
    tokens_per_s: float
    seconds: float              # training time since the last evaluation (evaluation excluded)
    lr: float                   # the learning rate of the last step
    skipped: int = 0            # steps whose update the guard skipped (--on-bad-batch skip)


@dataclass
class GPTTrainResult:
    val_loss: float
    history: list[EvalMetrics]
    out_dir: Path
    device: str
    dataset: TextDataset = field(repr=False)
    step: Any = field(repr=False)
    model: Any = field(repr=False)


@dataclass
class GPTSession:
    """Everything the loop needs, built once per run."""

    config: GPTTrainConfig
    device: str
    dataset: TextDataset
    model: models.GPT
    step: Any
    predict: Any
    batches: TokenBatches
    eval_sets: dict[str, list[tuple[Any, Any]]]


def make_optimizer(config: GPTTrainConfig, model: models.GPT) -> optim.AdamW:
    """AdamW with decay on matrices only, clipping, warmup then cosine to lr/10."""
    warmup = min(WARMUP_STEPS, config.steps // 10)
    min_lr = config.lr * MIN_LR_FRACTION
    schedule = (optim.WarmupCosine(warmup, config.steps, min_lr) if warmup >= 1
                else optim.Cosine(config.steps, min_lr))
    return model.configure_optimizers(WEIGHT_DECAY, config.lr, BETAS, schedule=schedule,
                                      max_grad_norm=GRAD_CLIP)


def build_session(config: GPTTrainConfig, log: Callable[[str], None]) -> GPTSession:
    """Read the text, build and compile the model: everything but the steps."""
    device = resolve_device(config.device)
    if config.precision == "tf32" and device != "cuda":
        raise TrainConfigError(f"--precision {config.precision} needs a GPU (device {device})")
    dataset = load_text(config.text_file)
    seed_init(config.seed)
    model = models.GPT(config.model_config(dataset.vocab_size))
    log(f"stepgraph: gpt ({model.get_num_params() / 1e6:.2f}M parameters) on {dataset.name} "
        f"({len(dataset.train)} train, {len(dataset.val)} validation characters, "
        f"vocabulary {dataset.vocab_size}), device {device}, {config.precision}")
    shape = (config.batch_size, config.block_size)
    example = (np.zeros(shape, np.int32), np.zeros(shape, np.int32))
    step = sg.compile_train_step(model, loss=models.next_token_loss,
                                 optimizer=make_optimizer(config, model), example_inputs=example,
                                 device=device, graph=(device == "cuda"), seed=config.seed,
                                 precision=config.precision, on_bad_batch=config.on_bad_batch)
    predict = sg.compile_predict(model, example_inputs=example[:1], device=device,
                                 precision=config.precision)
    stream = getattr(step.backend, "stream", None) if device == "cuda" else None
    batches = TokenBatches(dataset.train, config.batch_size, config.block_size, "train",
                           config.seed, device, cuda_stream=stream)
    eval_sets = {}
    for split in ("train", "val"):
        source = TokenBatches(dataset.split(split), config.batch_size, config.block_size, split,
                              config.seed, device, stream=EVAL_STREAM, cuda_stream=stream)
        eval_sets[split] = list(source.batches(0, config.eval_batches))
    return GPTSession(config, device, dataset, model, step, predict, batches, eval_sets)


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


def run_steps(session: GPTSession, first: int, last: int, bar) -> tuple[float, float]:
    """Train steps first..last-1; return (mean of the losses read, seconds). Reads the loss
    every LOG_EVERY steps and at the last one."""
    step, losses_read = session.step, []
    tokens = session.config.batch_size * session.config.block_size
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
        located = type(err)(f"step {err.step}: {err}" if err.step is not None else str(err))
        located.step = err.step
        raise located from err
    mean = float(np.mean(losses_read)) if losses_read else math.nan
    return mean, time.perf_counter() - start


def eval_points(config: GPTTrainConfig, start: int) -> list[int]:
    """The step counts after which the run evaluates and checkpoints, past `start`."""
    points = list(range(config.eval_interval, config.steps, config.eval_interval))
    return [p for p in points + [config.steps] if p > start]


def checkpoint_config(session: GPTSession) -> dict:
    """The run's record plus what `stepgraph sample` needs: the vocabulary."""
    return {**session.config.record(), "vocab": session.dataset.vocab,
            "vocab_size": session.dataset.vocab_size}


def save_checkpoint(session: GPTSession, steps_done: int) -> Path:
    """The checkpoint after `steps_done` steps (in the Checkpoint's `epoch` field), written by
    save_run_checkpoint."""
    return save_run_checkpoint(session, steps_done, checkpoint_config(session),
                               f"step {steps_done}")


def restore(session: GPTSession, saved: ckpt.Checkpoint) -> list[EvalMetrics]:
    """Load the checkpoint into the step after checking it fits (its vocabulary, then
    restore_step); return the metrics of the evaluations it had done."""
    if saved.config.get("vocab") != session.dataset.vocab:
        path = session.config.out_dir / ckpt.CHECKPOINT_NAME
        raise ckpt.CheckpointError(f"cannot resume from {path}: it was trained on text with "
                                   "another vocabulary")
    records = restore_step(session, saved, "evals")
    return [EvalMetrics(**r) for r in records if r["step"] <= saved.epoch]


def write_metrics(session: GPTSession, history: list[EvalMetrics]) -> Path:
    return write_metrics_file(session.config.out_dir, {
        "config": session.config.record(), "device": session.device,
        "corpus": session.dataset.name, "vocab_size": session.dataset.vocab_size,
        "parameters": session.model.get_num_params(non_embedding=False),
        "evals": [dataclasses.asdict(m) for m in history],
        "val_loss": history[-1].val_loss if history else None})


def write_plot(history: list[EvalMetrics], path: Path, title: str) -> Path:
    """Losses and throughput per evaluation as a PNG."""
    steps = [m.step for m in history]
    with two_panel_plot(path, title) as (ax_loss, ax_speed):
        ax_loss.plot(steps, [m.loss for m in history], marker="o", label="training batches")
        ax_loss.plot(steps, [m.train_loss for m in history], marker="o",
                     label="train (eval mode)")
        ax_loss.plot(steps, [m.val_loss for m in history], marker="o", label="validation")
        ax_loss.set(xlabel="step", ylabel="cross-entropy (nats per character)", title="loss")
        ax_loss.legend()
        ax_speed.plot(steps, [m.tokens_per_s for m in history], marker="o")
        ax_speed.set(xlabel="step", ylabel="tokens/s", title="training throughput")
    return path


def train_interval(session: GPTSession, first: int, last: int, bar) -> EvalMetrics:
    """Steps first..last-1, then the loss estimates."""
    step = session.step
    skipped = step.skipped_steps
    loss, seconds = run_steps(session, first, last, bar)
    skipped = step.skipped_steps - skipped
    estimates = {split: estimate_loss(session.predict, batches)
                 for split, batches in session.eval_sets.items()}
    tokens = (last - first) * session.config.batch_size * session.config.block_size
    lr = optim.schedules.schedule_lr(step.optimizer.schedule_vector(), last)
    bar.write(f"step {last}: loss {loss:.4f}, train {estimates['train']:.4f}, val "
              f"{estimates['val']:.4f}, {tokens / seconds:,.0f} tokens/s"
              + (f", {skipped} skipped" if skipped else ""))
    return EvalMetrics(last, loss, estimates["train"], estimates["val"], tokens / seconds,
                       seconds, lr, skipped)


def train_gpt(config: GPTTrainConfig, log: Callable[[str], None] = print) -> GPTTrainResult:
    """Train, estimating the losses every eval_interval steps, and write metrics, plot and
    checkpoint to config.out_dir. With `config.resume` the run continues from the checkpoint
    there, producing the same parameters as an uninterrupted run."""
    from tqdm import tqdm

    config.validate()
    # Checked before compiling: a refused resume fails at once.
    saved = read_resume_checkpoint(config, RESUME_KEYS) if config.resume else None
    session = build_session(config, log)
    config.out_dir.mkdir(parents=True, exist_ok=True)
    start, history = 0, []
    if saved is not None:
        start, history = saved.epoch, restore(session, saved)
        log(f"resuming from {config.out_dir / ckpt.CHECKPOINT_NAME} after step {start}")
    with tqdm(total=config.steps, initial=start, desc="gpt", unit="step",
              disable=not config.progress, dynamic_ncols=True) as bar:
        for point in eval_points(config, start):
            history.append(train_interval(session, start, point, bar))
            save_checkpoint(session, point)
            write_metrics(session, history)
            start = point
    if history and history[-1].step == config.steps:
        val_loss = history[-1].val_loss
    else:   # nothing left to train, or metrics of earlier evaluations lost: measure now
        val_loss = estimate_loss(session.predict, session.eval_sets["val"])
    if history:
        write_plot(history, config.out_dir / PLOT_NAME,
                   f"gpt on {Path(session.dataset.name).name} ({session.device})")
    return GPTTrainResult(val_loss, history, config.out_dir, session.device, session.dataset,
                          session.step, session.model)
