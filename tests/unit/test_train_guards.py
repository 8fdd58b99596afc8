"""`stepgraph train` and bad batches: a rejected batch is reported with its epoch and batch
index, skipped batches are counted, a checkpoint never holds NaN or Inf, and a resume from a
checkpoint of a different step explains what differs (numpy backend, tiny data)."""
from __future__ import annotations

import types

import numpy as np
import pytest

import stepgraph as sg
from stepgraph import checkpoint as ckpt
from stepgraph import losses, nn, optim
from stepgraph.data import BatchLoader
from stepgraph.errors import NonFiniteError
from stepgraph.train import (LOG_EVERY, TrainConfig, TrainingDivergedError, restore, run_epoch,
                             save_epoch_checkpoint)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
N, FEATURES, CLASSES, BATCH = 64, 5, 3, 8


class Bar:
    """What run_epoch needs of a tqdm bar."""

    def __init__(self):
        self.lines = []

    def write(self, line):
        self.lines.append(line)

    def set_postfix_str(self, *args, **kwargs):
        pass

    def update(self, n):
        pass


def data(bad_rows=()):
    gen = np.random.default_rng(0)
    x = gen.standard_normal((N, FEATURES)).astype(np.float32)
    for row in bad_rows:
        x[row, 0] = np.nan
    return x, gen.integers(0, CLASSES, N)


def make_step(policy, x, y):
    nn.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 8), nn.ReLU(), nn.Linear(8, CLASSES))
    return sg.compile_train_step(model, losses.cross_entropy, optim.AdamW(lr=0.01),
                                 (x[:BATCH], y[:BATCH]), on_bad_batch=policy)


def test_skipped_batches_are_reported_with_epoch_and_batch():
    x, y = data(bad_rows=[2 * BATCH + 1, 5 * BATCH])       # batches 3 and 6 (1-based)
    loader = BatchLoader(x, y, BATCH, shuffle=False)
    step, bar = make_step("skip", x, y), Bar()
    loss, _ = run_epoch(step, loader, 0, bar)
    assert np.isfinite(loss) and step.skipped_steps == 2
    assert len(bar.lines) == 2
    assert bar.lines[0].startswith("epoch 1, batch 3 of 8 (step 3) skipped: a non-finite loss")
    assert bar.lines[1].startswith("epoch 1, batch 6 of 8 (step 6) skipped")


def test_a_rejected_batch_fails_the_epoch_naming_it():
    assert LOG_EVERY > 8                                   # reported by the next call
    x, y = data(bad_rows=[3 * BATCH])                      # batch 4
    loader = BatchLoader(x, y, BATCH, shuffle=False)
    step = make_step("raise", x, y)
    with pytest.raises(NonFiniteError, match=r"^epoch 2, batch 4 of 8: step 4: ") as info:
        run_epoch(step, loader, 1, Bar())
    assert info.value.step == 4


def _session(tmp_path, step):
    config = TrainConfig(out=str(tmp_path), device="cpu")
    return types.SimpleNamespace(config=config, step=step)


def test_a_non_finite_state_is_never_checkpointed(tmp_path):
    x, y = data()
    session = _session(tmp_path, make_step("ignore", x, y))
    path = save_epoch_checkpoint(session, 0)
    good = path.read_bytes()
    session.step(np.full((BATCH, FEATURES), np.nan, np.float32), y[:BATCH])   # poisons it
    with pytest.raises(TrainingDivergedError, match="after epoch 2 .*NaN or Inf .*0.weight"):
        save_epoch_checkpoint(session, 1)
    assert path.read_bytes() == good


def test_resume_refuses_a_checkpoint_of_a_different_step(tmp_path):
    x, y = data()
    session = _session(tmp_path, make_step("raise", x, y))
    session.step(x[:BATCH], y[:BATCH])
    saved = ckpt.load_checkpoint(save_epoch_checkpoint(session, 0))
    assert saved.signature == ckpt.step_signature(session.step)
    restore(session, saved)                                 # the same step: fine
    nn.manual_seed(0)
    other = nn.Sequential(nn.Linear(FEATURES, 4), nn.ReLU(), nn.Linear(4, CLASSES))
    session.step = sg.compile_train_step(other, losses.cross_entropy, optim.AdamW(lr=0.01),
                                         (x[:BATCH], y[:BATCH]))
    with pytest.raises(ckpt.CheckpointError, match=r"different step: .*0.weight checkpoint "
                       r"\(8, 5\) float32, now \(4, 5\) float32"):
        restore(session, saved)
