"""`stepgraph train --model gpt --data text` and `stepgraph sample` on the CPU with a tiny GPT:
training on a text file, the default corpus, exact resume, reproducible sampling, the option
errors."""
from __future__ import annotations

import functools
import json
import random
import re

import numpy as np
import pytest

from stepgraph import models
from stepgraph import train as train_gpt_module
from stepgraph.checkpoint import CHECKPOINT_NAME, CheckpointError, load_checkpoint
from stepgraph.cli import main
from stepgraph.data import load_text
from stepgraph.data.text import DEFAULT_CORPUS, TokenBatches
from stepgraph.sample import next_token
from stepgraph.train import GPTTrainConfig
from stepgraph.train import train as train_gpt

TINY = ("--batch-size", "8", "--block-size", "16", "--n-layer", "1", "--n-head", "2",
        "--n-embd", "32", "--dropout", "0.1", "--device", "cpu", "--no-progress")
TINY_CONFIG = dict(batch_size=8, block_size=16, n_layer=1, n_head=2, n_embd=32, dropout=0.1,
                   eval_batches=4, device="cpu", progress=False)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    """About 13 KB of sentences from a small vocabulary."""
    rng = random.Random(0)
    words = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex "
             "jumbo mice").split()
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))).capitalize() + "."
             for _ in range(300)]
    path = tmp_path_factory.mktemp("text") / "sentences.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def trained(tmp_path_factory, text_file):
    """A 20-step run on the text file, evaluated every 10 steps."""
    out = tmp_path_factory.mktemp("gpt") / "run"
    code = main(["train", "--model", "gpt", "--data", "text", "--text-file", str(text_file),
                 "--steps", "20", "--eval-interval", "10", "--out", str(out), *TINY])
    assert code == 0
    return out


def test_train_on_a_text_file(trained, text_file):
    metrics = json.loads((trained / "metrics.json").read_text())
    assert [e["step"] for e in metrics["evals"]] == [10, 20]
    assert metrics["config"]["model"] == "gpt" and metrics["config"]["steps"] == 20
    assert metrics["device"] == "cpu" and metrics["corpus"] == str(text_file)
    first, last = metrics["evals"]
    assert last["val_loss"] < first["val_loss"] < np.log(metrics["vocab_size"]) + 0.1
    assert last["tokens_per_s"] > 0 and metrics["val_loss"] == last["val_loss"]
    assert (trained / "metrics.png").stat().st_size > 1000
    saved = load_checkpoint(trained / CHECKPOINT_NAME)
    assert saved.epoch == 20 and int(saved.state["optimizer.step"]) == 20
    assert saved.config["vocab"] == "".join(sorted(set(text_file.read_text())))
    for key in ("transformer.wte.weight", "lm_head.weight", "transformer.h.0.attn.c_attn.bias",
                "transformer.ln_f.weight"):
        assert key in saved.state, key
    np.testing.assert_array_equal(saved.state["lm_head.weight"],
                                  saved.state["transformer.wte.weight"])


def test_cli_prints_the_validation_loss(capsys, tmp_path, text_file):
    code, out, _ = run(capsys, "train", "--model", "gpt", "--text-file", str(text_file),
                       "--steps", "2", "--out", str(tmp_path / "run"), *TINY)
    assert code == 0 and "gpt (0.01M parameters) on" in out
    assert re.fullmatch(r"validation loss: \d\.\d{4}", out.strip().splitlines()[-1])


def test_sample_is_reproducible_by_seed(capsys, trained):
    argv = ("sample", "--out", str(trained), "--prompt", "The ", "--tokens", "40",
            "--device", "cpu")
    code, first, _ = run(capsys, *argv, "--seed", "3")
    assert code == 0 and first.startswith("The ") and len(first) == len("The ") + 40 + 1
    assert run(capsys, *argv, "--seed", "3")[1] == first
    assert run(capsys, *argv, "--seed", "4")[1] != first
    code, greedy, _ = run(capsys, *argv, "--temperature", "0", "--seed", "5")
    assert code == 0 and run(capsys, *argv, "--temperature", "0", "--seed", "6")[1] == greedy


def test_sample_errors(capsys, trained, tmp_path):
    code, out, err = run(capsys, "sample", "--out", str(trained), "--prompt", "Zebra%",
                         "--device", "cpu")
    assert code == 2 and "not in the vocabulary" in err and "%" in err and out == ""
    code, out, err = run(capsys, "sample", "--out", str(tmp_path), "--device", "cpu")
    assert code == 2 and err.startswith("error: no checkpoint at") and out == ""
    code, _, err = run(capsys, "sample", "--out", str(trained), "--tokens", "-1")
    assert code == 2 and "--tokens must be >= 0" in err


def test_next_token_sampling_rules():
    logits = np.array([0.0, 3.0, 1.0, 2.9])
    rng = np.random.default_rng(0)
    assert next_token(logits, 0.0, None, rng) == 1
    assert {next_token(logits, 1.0, 1, rng) for _ in range(20)} == {1}
    assert {next_token(logits, 1.0, 2, rng) for _ in range(50)} == {1, 3}
    draws = [next_token(logits, 1.0, None, np.random.default_rng(7)) for _ in range(3)]
    assert len(set(draws)) == 1


def test_default_corpus_is_pythons_help_text():
    corpus = load_text()
    assert corpus.name == DEFAULT_CORPUS and corpus.vocab_size > 60 and "\n" in corpus.vocab
    assert 300_000 < len(corpus.train) + len(corpus.val) < 2_000_000
    assert abs(len(corpus.val) / (len(corpus.train) + len(corpus.val)) - 0.1) < 1e-3
    assert "def" in corpus.decode(corpus.train[:200_000])
    again = load_text()
    assert again.vocab == corpus.vocab and np.array_equal(again.val, corpus.val)


def test_train_on_the_default_corpus(tmp_path):
    result = train_gpt(GPTTrainConfig(steps=2, eval_interval=2, out=str(tmp_path),
                                      **TINY_CONFIG), log=lambda _: None)
    assert result.dataset.name == DEFAULT_CORPUS and np.isfinite(result.val_loss)
    assert len(result.history) == 1


def test_batches_are_windows_shifted_by_one():
    tokens = np.arange(100, dtype=np.int32)
    batches = TokenBatches(tokens, 4, 8, seed=1)
    x, y = batches.batch(5)
    assert x.shape == y.shape == (4, 8) and x.dtype == np.int32
    np.testing.assert_array_equal(y, x + 1)
    np.testing.assert_array_equal(np.diff(x, axis=1), 1)
    again = list(batches.batches(4, 7))
    np.testing.assert_array_equal(again[1][0], x)
    assert not np.array_equal(TokenBatches(tokens, 4, 8, seed=1, stream=1).batch(5)[0], x)


class Interrupt(Exception):
    pass


def test_resume_is_exact(tmp_path, text_file, monkeypatch):
    config = functools.partial(GPTTrainConfig, text_file=str(text_file), steps=20,
                               eval_interval=10, **TINY_CONFIG)
    straight = train_gpt(config(out=str(tmp_path / "straight")), log=lambda _: None)

    real = train_gpt_module.train_interval

    def interrupted(session, first, last, bar):
        if first == 10:
            raise Interrupt
        return real(session, first, last, bar)

    monkeypatch.setattr(train_gpt_module, "train_interval", interrupted)
    with pytest.raises(Interrupt):
        train_gpt(config(out=str(tmp_path / "split")), log=lambda _: None)
    monkeypatch.setattr(train_gpt_module, "train_interval", real)
    with pytest.raises(CheckpointError, match="steps: checkpoint 20, now 30"):
        train_gpt(config(out=str(tmp_path / "split"), steps=30, resume=True), log=lambda _: None)
    resumed = train_gpt(config(out=str(tmp_path / "split"), resume=True), log=lambda _: None)

    expected, got = straight.step.state_dict(), resumed.step.state_dict()
    assert expected.keys() == got.keys() and "optimizer.exp_avg.transformer.wte.weight" in got
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
    assert [m.step for m in resumed.history] == [10, 20]
    assert resumed.val_loss == straight.val_loss


@pytest.mark.parametrize("argv, message", [
    (("--model", "gpt", "--epochs", "3"), "--epochs does not apply to --model gpt"),
    (("--model", "mlp", "--text-file", "x.txt"), "--text-file applies to --model gpt only"),
    (("--model", "mlp", "--data", "text"), "--model mlp does not train on --data text"),
    (("--model", "gpt", "--data", "digits"), "--model gpt does not train on --data digits"),
    (("--model", "gpt", "--text-file", "/no/such.txt"), "no text file at /no/such.txt"),
    (("--model", "gpt", "--n-embd", "30", "--n-head", "4"), "must be a multiple of --n-head"),
])
def test_option_errors(capsys, tmp_path, argv, message):
    code, _, err = run(capsys, "train", *argv, "--device", "cpu", "--out", str(tmp_path))
    assert code == 2 and message in err, err


def test_model_has_nanogpts_structure():
    model = models.gpt(11, block_size=8, n_layer=2, n_head=2, n_embd=16)
    keys = list(model.state_dict())
    assert keys[:3] == ["transformer.wte.weight", "transformer.wpe.weight",
                        "transformer.h.0.ln_1.weight"]
    assert keys[-3:] == ["transformer.ln_f.weight", "transformer.ln_f.bias", "lm_head.weight"]
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.get_num_params(non_embedding=False) == model.get_num_params() + 8 * 16
    groups = models.optimizer_groups(model, 0.1)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert all(len(p.shape) >= 2 for p in groups[0]["params"])
    assert sum(p is model.lm_head.weight for g in groups for p in g["params"]) == 1
    std = model.state_dict()["transformer.h.1.mlp.c_proj.weight"].std()
    assert 0.5 * 0.02 / np.sqrt(4) < std < 1.5 * 0.02 / np.sqrt(4)


def test_tf32_needs_a_gpu(capsys, tmp_path, text_file):
    code, _, err = run(capsys, "train", "--model", "gpt", "--text-file", str(text_file),
                       "--precision", "tf32", "--out", str(tmp_path), *TINY)
    assert code == 2 and "--precision tf32 needs a GPU" in err
