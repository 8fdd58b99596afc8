"""`step.profile()` and `stepgraph profile --script FILE`: the parts that run without a GPU
(loading the user's step from a script, the errors); the table itself needs CUDA."""
from __future__ import annotations

import textwrap

import pytest

from stepgraph import cli
from stepgraph.profile import load_script_step

SCRIPT = textwrap.dedent("""
    import numpy as np
    import stepgraph as sg
    from stepgraph import losses, nn, optim

    def make_step():
        model = nn.Sequential(nn.Linear(4, 3))
        x, y = np.ones((2, 4), np.float32), np.array([0, 2])
        step = sg.compile_train_step(model, losses.cross_entropy, optim.SGD(lr=0.1), (x, y))
        return step, (x, y)

    if __name__ == "__main__":
        raise SystemExit("the training loop must not run when profiling")
""")


def test_script_gives_its_step_and_inputs(tmp_path):
    path = tmp_path / "train_me.py"
    path.write_text(SCRIPT)
    step, inputs = load_script_step(str(path))
    assert len(inputs) == 2 and step.device == "cpu"
    assert float(step(*inputs)) > 0


@pytest.mark.parametrize("body, words", [("x = 1\n", "must define make_step()"),
                                         ("def make_step():\n    return 3\n", "(step, inputs)")])
def test_script_errors_say_what_is_expected(tmp_path, body, words):
    path = tmp_path / "bad.py"
    path.write_text(body)
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        load_script_step(str(path))


def test_profile_command_accepts_a_script(tmp_path, capsys):
    path = tmp_path / "train_me.py"
    path.write_text(SCRIPT)
    code = cli.main(["profile", "--script", str(path)])
    out = capsys.readouterr().out
    from stepgraph.backends import cuda_available
    if cuda_available():      # a CPU step: profile() says it needs device='cuda'
        assert code == 2 and "device='cuda'" in out
    else:
        assert code == 2 and "needs a CUDA GPU" in out
