"""compile_train_step / compile_predict with device="auto": cuda when usable, else cpu, as
`stepgraph train --device auto`."""
from __future__ import annotations

import numpy as np
import pytest

import stepgraph as sg
from stepgraph import backends, losses, nn, optim


def test_resolve_device():
    assert backends.resolve_device("auto") == ("cuda" if sg.cuda_available() else "cpu")
    assert backends.resolve_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="device must be one of"):
        backends.resolve_device("gpu")


def test_auto_compiles_on_the_available_device():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 4)).astype(np.float32)
    y = rng.integers(0, 3, 8)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = optim.SGD(lr=0.1)
    step = sg.compile_train_step(model, loss=losses.cross_entropy, optimizer=optimizer,
                                 example_inputs=(x, y), device="auto")
    expected = "cuda" if sg.cuda_available() else "cpu"
    assert step.device == expected and step.use_graph == (expected == "cuda")
    # "auto" and the device it picks are one step (one optimizer state), not two
    assert sg.compile_train_step(model, loss=losses.cross_entropy, optimizer=optimizer,
                                 example_inputs=(x, y), device=expected) is step
    first = float(step(x, y))
    for _ in range(20):
        last = float(step(x, y))
    assert last < first
    predict = sg.compile_predict(model, example_inputs=(x,), device="auto")
    assert predict.device == expected
    assert sg.to_numpy(predict(x)).shape == (8, 3)
