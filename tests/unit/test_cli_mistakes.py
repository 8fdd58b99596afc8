"""A user's mistakes end in one `error:` line naming the cause and the fix (exit status 2),
with no traceback and no NumPy RuntimeWarning; a CLI checkpoint loads for inference."""
from __future__ import annotations

import textwrap
import warnings

import numpy as np
import pytest

import stepgraph as sg
from stepgraph.cli import main

MODELS = '''
from stepgraph import nn


class NoParameters(nn.Module):
    def forward(self, x):
        return x.flatten(1)[:, :10]


class ReturnsTuple(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(64, 10)

    def forward(self, x):
        logits = self.linear(x.flatten(1))
        return logits, logits.sum()


class ReturnsDict(ReturnsTuple):
    def forward(self, x):
        return {"logits": self.linear(x.flatten(1))}


class Bigram(nn.Module):
    def __init__(self, vocab_size=65):
        super().__init__()
        self.table = nn.Embedding(vocab_size, vocab_size)

    def forward(self, idx):
        return self.table(idx)


class Overflows(ReturnsTuple):
    def forward(self, x):
        return self.linear(x.flatten(1)) * 1e30 * 1e30
'''


@pytest.fixture(scope="module")
def models_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("user") / "mistakes.py"
    path.write_text(textwrap.dedent(MODELS))
    return path


def run(capsys, *argv):
    """Exit code, stdout and stderr of `stepgraph ARGV`; a RuntimeWarning raises."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def error_line(code: int, err: str) -> str:
    """The one `error:` line a failed command printed, last on stderr."""
    assert code == 2, err
    assert "Traceback" not in err and "Warning" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], err
    return errors[0]


def train(capsys, tmp_path, *args):
    return run(capsys, "train", "--device", "cpu", "--no-progress", "--out",
               str(tmp_path / "run"), *args)


def test_a_model_with_nothing_to_train(capsys, tmp_path, models_file):
    line = error_line(*train(capsys, tmp_path, "--model", f"{models_file}:NoParameters",
                             "--epochs", "1")[::2])
    assert line == ("error: nothing to train: the model has no parameters; give it a layer "
                    "with weights (nn.Linear, nn.Conv2d, ...) that its output depends on")


@pytest.mark.parametrize("cls, returned", [("ReturnsTuple", "a tuple of 2 entries"),
                                           ("ReturnsDict", "a dict of 1 entry")])
def test_a_forward_returning_several_outputs(capsys, tmp_path, models_file, cls, returned):
    line = error_line(*train(capsys, tmp_path, "--model", f"{models_file}:{cls}",
                             "--epochs", "1")[::2])
    assert line == (f"error: --model {models_file}:{cls}: forward returned {returned}; on "
                    "--data digits it must return one tensor, the logits (N, classes) "
                    "(return the logits alone)")


def test_a_text_model_with_a_smaller_vocabulary(capsys, tmp_path, models_file):
    text = tmp_path / "corpus.txt"
    text.write_text("".join(chr(32 + i % 90) for i in range(4000)))    # 90 characters
    line = error_line(*train(capsys, tmp_path, "--model", f"{models_file}:Bigram",
                             "--data", "text", "--text-file", str(text), "--steps", "2",
                             "--block-size", "8", "--batch-size", "4")[::2])
    assert "step 1" not in line
    assert line == (f"error: --model {models_file}:Bigram: its logits have 65 classes but "
                    "--data text has 90 (tokens must be in [0, 65), the data's are in "
                    "[0, 90)): build the model with 90 outputs (the vocabulary size, e.g. "
                    "--model-args '{\"vocab_size\": 90}')")


def test_a_nan_loss_leaks_no_numpy_warning(capsys, tmp_path):
    # run() turns a RuntimeWarning into an exception: the CPU backend must not emit one
    line = error_line(*train(capsys, tmp_path, "--lr", "1e9", "--epochs", "1")[::2])
    assert line.startswith("error: epoch 1, batch ") and "non-finite loss" in line
    assert line.endswith("try a smaller --lr; --on-bad-batch skip goes on without such "
                         "batches)")


def test_a_run_whose_every_batch_was_skipped_fails(capsys, tmp_path, models_file):
    code, out, err = train(capsys, tmp_path, "--model", f"{models_file}:Overflows",
                           "--epochs", "2", "--on-bad-batch", "skip")
    line = error_line(code, err)
    assert line.startswith("error: epoch 1: all 45 steps were skipped (--on-bad-batch skip")
    assert "nothing was trained" in line and "test accuracy" not in out
    assert out.count("skipped: a non-finite loss") == 45        # each reported as it went
    assert not (tmp_path / "run" / "checkpoint.safetensors").exists()


@pytest.mark.parametrize("epochs, where", [
    ("1", "is at epoch 2, past --epochs 1"), ("2", "has finished its --epochs 2")])
def test_a_resume_with_nothing_left_to_train(capsys, tmp_path, epochs, where):
    assert train(capsys, tmp_path, "--epochs", "2")[0] == 0
    before = (tmp_path / "run" / "checkpoint.safetensors").read_bytes()
    line = error_line(*train(capsys, tmp_path, "--epochs", epochs, "--resume")[::2])
    assert line == (f"error: nothing to resume: the run in {tmp_path / 'run'} {where} "
                    "(--epochs is the run's total, not the number to add); pass --epochs 3 or "
                    "more to train further")
    assert (tmp_path / "run" / "checkpoint.safetensors").read_bytes() == before


def test_a_cli_checkpoint_loads_for_inference(capsys, tmp_path):
    from stepgraph import checkpoint
    from stepgraph.data import load_digits, with_layout
    from stepgraph.train import TrainConfig, small_mlp
    from stepgraph.train import train as train_run

    result = train_run(TrainConfig(epochs=1, device="cpu", out=str(tmp_path / "run"),
                                   progress=False), log=lambda line: None)
    path = tmp_path / "run" / "checkpoint.safetensors"
    model = small_mlp(64, 10)
    with pytest.raises(sg.StateDictError, match="unexpected keys"):    # the step's own state
        model.load_state_dict(checkpoint.load_checkpoint(path).state)
    model.load_state_dict(sg.checkpoint.model_state(path))             # strict
    trained = result.model.state_dict()
    assert set(model.state_dict()) == set(trained)
    for key, value in model.state_dict().items():
        np.testing.assert_array_equal(value, trained[key])
    x = with_layout(load_digits().x_test, "flat")
    predict = sg.compile_predict(model, example_inputs=(x,), device="cpu")
    trained_predict = sg.compile_predict(result.model, example_inputs=(x,), device="cpu")
    np.testing.assert_array_equal(sg.to_numpy(predict(x)), sg.to_numpy(trained_predict(x)))


def test_model_keys_without_a_signature():
    from stepgraph.checkpoint import _is_model_key

    assert _is_model_key("0.weight", None) and not _is_model_key("optimizer.step", None)
    # with the step's module paths, a model's own module named "optimizer" is the model's
    modules = {"(root)", "optimizer", "head"}
    assert _is_model_key("optimizer.weight", modules) and _is_model_key("pos", modules)
    assert not _is_model_key("optimizer.exp_avg.head.weight", modules)


def test_the_checked_loss_keeps_the_signature_of_earlier_checkpoints():
    # a model file's run written before the output check still resumes: its checkpoint's
    # step signature names the loss itself
    from stepgraph import checkpoint, losses, models
    from stepgraph.train import ModelFileLoss

    for loss, data in ((losses.cross_entropy, "digits"), (models.next_token_loss, "text")):
        checked = ModelFileLoss(loss, "net.py:Net", data, 10)
        assert checkpoint._callable_name(checked) == checkpoint._callable_name(loss)
