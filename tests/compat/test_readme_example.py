"""The README's PyTorch model file (section "PyTorch model files, unchanged") runs as written:
its first python block is the model file, with only stepgraph imports, and trains."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

import stepgraph as sg
from stepgraph import optim

README = Path(__file__).parents[2] / "README.md"


def readme_model_file() -> str:
    section = README.read_text().split("## PyTorch model files, unchanged", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_model_file_trains():
    source = readme_model_file()
    assert "import stepgraph as torch" in source and "\nimport torch" not in source
    namespace: dict = {}
    exec(compile(source, str(README), "exec"), namespace)
    model = namespace["TinyGPT"]()
    idx = np.random.default_rng(0).integers(0, 64, (8, 17))
    x, y = idx[:, :-1], idx[:, 1:]
    step = sg.compile_train_step(model, loss=None, optimizer=optim.AdamW(lr=1e-2),
                                 example_inputs=(x, y))
    losses = [float(step(x, y)) for _ in range(10)]
    # one batch, ten AdamW steps: the model fits it
    assert losses[-1] < losses[0] - 0.5, losses
