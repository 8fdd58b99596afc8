"""state_dict and load_state_dict: PyTorch keys and shapes, strict and atomic loading, torch
weights loading directly, and TrainStep checkpoints that resume a run bit for bit."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn as tnn

import stepgraph as sg
from stepgraph import losses, models, nn, optim
from stepgraph.errors import StateDictError
from tests.ops.helpers import assert_close, seeded


def torch_twin(name: str) -> tnn.Module:
    if name == "mlp":
        return tnn.Sequential(tnn.Linear(784, 512), tnn.ReLU(), tnn.Dropout(0.1),
                              tnn.Linear(512, 512), tnn.ReLU(), tnn.Dropout(0.1),
                              tnn.Linear(512, 10))
    return tnn.Sequential(tnn.Conv2d(1, 10, 5), tnn.MaxPool2d(2), tnn.ReLU(),
                          tnn.Conv2d(10, 20, 5), tnn.Dropout2d(0.5), tnn.MaxPool2d(2), tnn.ReLU(),
                          tnn.Flatten(), tnn.Linear(320, 50), tnn.ReLU(), tnn.Dropout(0.5),
                          tnn.Linear(50, 10), tnn.LogSoftmax(dim=1))


MODELS = {"mlp": (models.mlp, (784,)), "cnn": (models.cnn, (1, 28, 28))}


def torch_numpy_state(tmodel) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy() for k, v in tmodel.state_dict().items()}


@pytest.mark.parametrize("name", MODELS)
def test_keys_shapes_and_init_bounds_match_torch(name):
    sd, want = MODELS[name][0]().state_dict(), torch_numpy_state(torch_twin(name))
    assert list(sd) == list(want)
    for k in want:
        assert sd[k].shape == want[k].shape and sd[k].dtype == sg.float32, k
        # torch's default init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weights and biases
        weight = want[k.replace("bias", "weight")]
        bound = 1 / np.sqrt(np.prod(weight.shape[1:]))
        assert bound / 2 < np.abs(sd[k]).max() <= bound, k


@pytest.mark.parametrize("name", MODELS)
def test_torch_weights_load_and_predict_like_torch(name):
    make, shape = MODELS[name]
    torch.manual_seed(0)
    tmodel, model = torch_twin(name).eval(), make()
    model.load_state_dict(torch_numpy_state(tmodel))
    x = seeded(name).standard_normal((5, *shape)).astype(np.float32)
    predict = sg.compile_predict(model, (x,))
    with torch.no_grad():
        assert_close(predict(x), tmodel(torch.tensor(x)).numpy())
    # loading again after compiling writes into the buffers the compiled predictor reads
    torch.manual_seed(1)
    other = torch_twin(name).eval()
    model.load_state_dict(torch_numpy_state(other))
    with torch.no_grad():
        assert_close(predict(x), other(torch.tensor(x)).numpy())


def test_round_trip_and_copies():
    a, b = models.mlp(hidden=8), models.mlp(hidden=8)
    sd = a.state_dict()
    b.load_state_dict(sd)
    for k, v in b.state_dict().items():
        np.testing.assert_array_equal(v, sd[k])
    sd["0.weight"][...] = 0            # a state_dict is a copy, not a view of the model
    assert a.state_dict()["0.weight"].any()


def mutations():
    def missing(sd):
        del sd["3.bias"]

    def extra(sd):
        sd["7.weight"] = np.zeros((2, 2), np.float32)

    def shape(sd):
        sd["6.weight"] = sd["6.weight"].T

    def late_shape(sd):   # the last key is wrong: nothing before it may be written either
        sd["6.bias"] = np.zeros(11, np.float32)

    return {"missing": (missing, "3.bias"), "extra": (extra, "7.weight"),
            "shape": (shape, "6.weight"), "late-shape": (late_shape, "6.bias")}


@pytest.mark.parametrize("case", mutations())
def test_load_rejects_mismatches_and_writes_nothing(case):
    mutate, key = mutations()[case]
    model = models.mlp(hidden=8)
    before = model.state_dict()
    sd = {k: np.full_like(v, 0.5) for k, v in before.items()}
    mutate(sd)
    with pytest.raises(StateDictError, match=key.replace(".", r"\.")):
        model.load_state_dict(sd)
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)


# ---- TrainStep checkpoints -----------------------------------------------------------------

def batches(n: int, size: int = 16):
    gen = seeded("train-batches")
    return [(gen.standard_normal((size, 784)).astype(np.float32), gen.integers(0, 10, size))
            for _ in range(n)]


def fresh_step(opt, seed: int):
    nn.manual_seed(seed)      # a different initialisation each time: the load must overwrite it
    model = models.mlp(hidden=32, dropout=0.2)
    return sg.compile_train_step(model, losses.cross_entropy, opt, batches(1)[0], seed=5)


@pytest.mark.parametrize("make_opt", [
    lambda: optim.AdamW(lr=1e-2, schedule=optim.WarmupCosine(2, 8)),
    lambda: optim.SGD(lr=0.05, momentum=0.9, nesterov=True, schedule=optim.StepDecay(2, 0.5)),
], ids=["adamw-warmup-cosine", "sgd-nesterov-step-decay"])
def test_train_step_checkpoint_resumes_bitwise(make_opt):
    data = batches(7)
    step = fresh_step(make_opt(), seed=0)
    for x, y in data[:3]:
        step(x, y)
    checkpoint = {k: v.copy() for k, v in step.state_dict().items()}
    assert int(checkpoint["optimizer.step"]) == 3
    assert not any(k.startswith("history.") for k in checkpoint)
    want = [float(step(x, y)) for x, y in data[3:]]

    resumed = fresh_step(make_opt(), seed=1)
    resumed.load_state_dict(checkpoint)
    got = [resumed(x, y) for x, y in data[3:]]
    assert [h.step for h in got] == [4, 5, 6, 7]
    assert [float(h) for h in got] == want       # dropout masks, moments, schedule: all bitwise
    final, resumed_final = step.state_dict(), resumed.state_dict()
    for k in final:
        np.testing.assert_array_equal(resumed_final[k], final[k], err_msg=k)


def test_train_step_load_restores_the_learning_rate():
    step = fresh_step(optim.SGD(lr=0.05), seed=0)
    checkpoint = step.state_dict()
    other = fresh_step(optim.SGD(lr=0.9), seed=1)
    other.load_state_dict(checkpoint)
    assert other.optimizer.lr == pytest.approx(0.05)


@pytest.mark.parametrize("case", ["missing-state", "state-shape", "param-shape", "extra-key"])
def test_train_step_load_rejects_mismatches_and_writes_nothing(case):
    step = fresh_step(optim.Adam(lr=1e-2), seed=0)
    step(*batches(1)[0])
    before = {k: v.copy() for k, v in step.state_dict().items()}
    bad = {k: v + 1 for k, v in before.items()}
    if case == "missing-state":
        del bad["optimizer.exp_avg.0.weight"]
    elif case == "state-shape":
        bad["optimizer.exp_avg_sq.3.bias"] = np.zeros(3, np.float32)
    elif case == "param-shape":
        bad["6.bias"] = np.zeros(3, np.float32)
    else:
        bad["optimizer.momentum_buffer.0.weight"] = bad["0.weight"]
    with pytest.raises(StateDictError):
        step.load_state_dict(bad)
    for k, v in step.state_dict().items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)


def test_predictor_reads_the_parameters_the_train_step_updates():
    step = fresh_step(optim.SGD(lr=0.5), seed=0)
    x = batches(1)[0][0]
    predict = sg.compile_predict(step.model, (x,))
    before = predict(x)
    step(*batches(2)[1])
    after = predict(x)
    assert not np.allclose(after, before)
    reference = models.mlp(hidden=32, dropout=0.2)
    reference.load_state_dict(step.model.state_dict())
    np.testing.assert_array_equal(sg.compile_predict(reference, (x,))(x), after)
