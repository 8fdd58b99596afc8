"""The README's Python examples run as written, on any machine: every ```python block of
README.md, in order, in one namespace (device="auto" picks the CPU without a GPU). The PyTorch
model file of section "PyTorch model files, unchanged" also trains."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

import stepgraph as sg
from stepgraph import optim

README = Path(__file__).parents[2] / "README.md"


def python_blocks() -> list[tuple[int, str]]:
    """(first line number, source) of every ```python block of the README, in order."""
    text = README.read_text()
    return [(text[:m.start(1)].count("\n") + 1, m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)]


def readme_model_file() -> str:
    section = README.read_text().split("## PyTorch model files, unchanged", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_every_python_block_runs_in_order():
    blocks = python_blocks()
    assert len(blocks) >= 5, "the README's python blocks were not found"
    namespace: dict = {"__name__": "readme"}
    try:
        for line, source in blocks:
            # padded with newlines so a traceback names the README's own line numbers
            exec(compile("\n" * (line - 1) + source, str(README), "exec"), namespace)
    finally:
        sg.distributed.destroy()        # the data-parallel example's group (of one here)
    # what the blocks left behind is what they say: trained steps and a loss each
    for name in ("loss", "logits", "step", "model"):
        assert name in namespace, name
    assert np.isfinite(float(namespace["loss"]))
    assert sg.to_numpy(namespace["logits"]).shape == (128, 10)


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
