"""`stepgraph train --model FILE.py:CLASS` (a user's model file on the built-in data sets) and
the model and data registries of the one training loop (CPU, tiny models)."""
from __future__ import annotations

import json
import random
import re
import textwrap

import numpy as np
import pytest

from stepgraph import checkpoint as ckpt
from stepgraph.cli import main
from stepgraph.data import load_dataset
from stepgraph.model_file import ModelFileError, is_model_file, load_model_class
from stepgraph.train import (DATA, MODEL_FILE, MODELS, RUN_KINDS, GPTTrainConfig, TrainConfig,
                             build_model, model_entry)

MODEL_FILE_TEXT = '''
from stepgraph import nn


class Tiny(nn.Module):
    """Digits (N, 1, 8, 8) -> 10 logits."""

    def __init__(self, hidden=16):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, 10)

    def forward(self, x):
        return self.head(self.body(x))


class Bigram(nn.Module):
    """Tokens (B, T) -> next-token logits (B, T, V)."""

    def __init__(self, vocab_size):
        super().__init__()
        self.table = nn.Embedding(vocab_size, vocab_size)

    def forward(self, idx):
        return self.table(idx)


class Plain:
    pass


def helper():
    return 1
'''


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("user") / "my_models.py"
    path.write_text(textwrap.dedent(MODEL_FILE_TEXT))
    return path


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_a_model_file_trains_on_digits_and_resumes(capsys, tmp_path, model_file):
    out = tmp_path / "run"
    argv = ("train", "--model", f"{model_file}:Tiny", "--model-args", '{"hidden": 24}',
            "--lr", "0.01", "--device", "cpu", "--no-progress", "--out", str(out))
    code, stdout, err = run(capsys, *argv, "--epochs", "2")
    assert code == 0, err
    assert "stepgraph: Tiny on digits (" in stdout
    accuracy = float(re.fullmatch(r"test accuracy: ([01]\.\d{4})",
                                  stdout.strip().splitlines()[-1]).group(1))
    assert accuracy > 0.6                  # it learns: chance is 0.1
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["config"]["model"] == f"{model_file}:Tiny"
    assert metrics["config"]["model_args"] == {"hidden": 24}
    assert [e["epoch"] for e in metrics["epochs"]] == [1, 2]
    saved = ckpt.load_checkpoint(out / ckpt.CHECKPOINT_NAME)
    assert saved.state["body.1.weight"].shape == (24, 64) and saved.epoch == 2
    assert "optimizer.exp_avg.head.weight" in saved.state

    code, _, err = run(capsys, *argv, "--epochs", "3", "--resume")
    assert code == 0, err
    assert ckpt.load_checkpoint(out / ckpt.CHECKPOINT_NAME).epoch == 3
    code, _, err = run(capsys, "train", "--model", f"{model_file}:Tiny", "--model-args",
                       '{"hidden": 8}', "--lr", "0.01", "--device", "cpu", "--out", str(out),
                       "--epochs", "4",
                       "--resume")
    assert code == 2 and "model_args: checkpoint {'hidden': 24}, now {'hidden': 8}" in err


def test_default_out_is_named_after_the_class(monkeypatch, tmp_path, model_file):
    monkeypatch.chdir(tmp_path)
    assert TrainConfig(model=f"{model_file}:Tiny").out_dir.as_posix() == "runs/digits-Tiny"


def test_a_model_file_trains_on_text(capsys, tmp_path, model_file):
    rng = random.Random(0)
    words = "ab ba abba baab aab".split()
    text_file = tmp_path / "text.txt"
    text_file.write_text(" ".join(rng.choice(words) for _ in range(2000)) + "\n")
    vocab = len(set(text_file.read_text()))
    out = tmp_path / "run"
    code, stdout, err = run(capsys, "train", "--model", f"{model_file}:Bigram", "--model-args",
                            json.dumps({"vocab_size": vocab}), "--data", "text",
                            "--text-file", str(text_file), "--steps", "40",
                            "--eval-interval", "20", "--batch-size", "8", "--block-size", "16",
                            "--lr", "0.05", "--device", "cpu", "--no-progress", "--out", str(out))
    assert code == 0, err
    assert "stepgraph: Bigram (0.00M parameters) on" in stdout
    assert re.fullmatch(r"validation loss: \d\.\d{4}", stdout.strip().splitlines()[-1])
    evals = json.loads((out / "metrics.json").read_text())["evals"]
    assert [e["step"] for e in evals] == [20, 40]
    assert evals[1]["val_loss"] < evals[0]["val_loss"] < np.log(vocab) + 0.1


@pytest.mark.parametrize("target, args, message", [
    ("{dir}/missing.py:Tiny", None, "no model file at {dir}/missing.py"),
    ("{file}:Nope", None, "has no class Nope (nn.Module classes it defines: Bigram, Tiny)"),
    ("{file}:Plain", None, "Plain is not an nn.Module subclass"),
    ("{file}:helper", None, "helper is not an nn.Module subclass"),
    ("{file}:Tiny", '{"width": 3}', "constructing Tiny with --model-args {{\"width\": 3}} failed: "
                                    "TypeError"),
    ("{file}:Tiny", "[1, 2]", "--model-args must be a JSON object"),
    ("{file}:Tiny", "{hidden: 3}", "--model-args is not valid JSON"),
    ("{broken}:Tiny", None, "importing {broken} failed: ZeroDivisionError"),
])
def test_model_file_errors_are_error_lines(capsys, tmp_path, model_file, target, args,
                                           message):
    broken = tmp_path / "broken.py"
    broken.write_text("x = 1 / 0\n")
    names = {"dir": tmp_path, "file": model_file, "broken": broken}
    argv = ["train", "--model", target.format(**names), "--device", "cpu", "--out",
            str(tmp_path / "run")]
    if args is not None:
        argv += ["--model-args", args]
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.startswith("error: ") and message.format(**names) in err, err


def test_model_args_need_a_model_file(capsys, tmp_path):
    code, _, err = run(capsys, "train", "--model-args", "{}", "--out", str(tmp_path))
    assert code == 2 and "--model-args applies to a model file" in err
    code, _, err = run(capsys, "train", "--model", "vgg")
    assert code == 2 and "invalid choice: 'vgg'" in err and "FILE.py:CLASS" in err


def test_load_model_class(model_file):
    assert load_model_class(f"{model_file}:Tiny").__name__ == "Tiny"
    assert is_model_file("a/b.py:C") and not is_model_file("mlp")
    assert not is_model_file("b.txt:C")
    with pytest.raises(ModelFileError, match="is not a class name"):
        load_model_class(f"{model_file}:not-a-name")


# ---- the registries ------------------------------------------------------------------------

def test_every_model_trains_on_registered_data():
    for name, entry in MODELS.items():
        assert entry.data and set(entry.data) <= set(DATA), name
        assert model_entry(name) is entry
    assert model_entry("x.py:Net") is MODEL_FILE and set(MODEL_FILE.data) == set(DATA)
    assert {entry.kind for entry in DATA.values()} == set(RUN_KINDS)


def test_models_are_built_for_their_data():
    digits = load_dataset("digits")
    for name in ("mlp", "cnn", "resnet"):
        spec = build_model(name, digits)
        assert spec.layout == ("flat" if name == "mlp" else "image")
    from stepgraph.data import load_text

    config = GPTTrainConfig(n_layer=1, n_head=2, n_embd=16, block_size=8)
    spec = build_model("gpt", load_text(), config)
    assert spec.layout == "tokens" and spec.module.config.n_layer == 1


def test_defaults_come_from_the_entries():
    gpt = TrainConfig(model="gpt")
    assert (gpt.data_set, gpt.kind, gpt.batch, gpt.learning_rate) == ("text", "text", 64, 1e-3)
    mnist = TrainConfig(model="cnn", data="mnist")
    assert (mnist.batch, mnist.total_epochs, mnist.kind) == (64, 5, "image")
    assert TrainConfig(model="x.py:Net", data="cifar10").batch == 512


def test_records_and_resume_settings():
    image, text = TrainConfig().record(), GPTTrainConfig().record()
    assert {"epochs", "data_dir", "world_size"} <= image.keys()
    assert not {"steps", "n_layer", "model_args"} & image.keys()
    assert {"steps", "text_file", "block_size", "n_layer", "dropout"} <= text.keys()
    assert not {"epochs", "data_dir"} & text.keys()
    mlp = TrainConfig().run_settings()
    assert "precision" in mlp and "batch_size" in mlp and "seed" in mlp
    assert "epochs" not in mlp and "device" not in mlp and "out" not in mlp
    assert "epochs" in TrainConfig(model="resnet").run_settings()
    assert "steps" in GPTTrainConfig().run_settings()
    assert "eval_interval" not in GPTTrainConfig().run_settings()
    assert "model_args" in TrainConfig(model="x.py:Net").run_settings()


HELPER_TEXT = '''
from stepgraph import nn


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return self.linear(x).relu()
'''

IMPORTING_MODEL_TEXT = '''
from stepgraph import nn
from trust_helper_layers import Block      # a module beside this file


class WithHelper(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), Block(16))
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(self.body(x))
'''


def test_a_model_file_imports_a_module_beside_it(capsys, tmp_path, monkeypatch):
    import sys

    monkeypatch.setattr(sys, "path", list(sys.path))     # the folder added is undone after
    monkeypatch.delitem(sys.modules, "trust_helper_layers", raising=False)
    folder = tmp_path / "user"
    folder.mkdir()
    (folder / "trust_helper_layers.py").write_text(HELPER_TEXT)
    (folder / "net.py").write_text(IMPORTING_MODEL_TEXT)
    code = main(["train", "--model", f"{folder / 'net.py'}:WithHelper", "--epochs", "1",
                 "--device", "cpu", "--out", str(tmp_path / "run"), "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.strip().splitlines()[-1].startswith("test accuracy: ")
    assert sys.path[0] == str(folder.resolve())
    sys.modules.pop("trust_helper_layers", None)
