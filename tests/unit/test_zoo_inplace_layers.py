"""Layers' `inplace=` as torchvision passes it (Conv2dNormActivation's activation_layer(
inplace=True), nn.Dropout(p, inplace=True)): accepted, the same values and gradients as
torch's (float64-judged), the same repr."""
from __future__ import annotations

import numpy as np
import pytest
import torch as real

import stepgraph as torch
from stepgraph import nn
from tests.ops.helpers import forward_and_grads, torch_forward_and_grads

LAYERS = [("ReLU", ()), ("LeakyReLU", (0.2,)), ("Hardswish", ()), ("Hardsigmoid", ()),
          ("ReLU6", ()), ("SiLU", ()), ("ELU", (0.75,)), ("SELU", ()), ("CELU", (1.5,)),
          ("Hardtanh", (-0.5, 0.5)), ("Mish", ())]


@pytest.mark.parametrize("name,args", LAYERS, ids=[n for n, _ in LAYERS])
def test_inplace_activation_equals_torch(name, args):
    rng = np.random.default_rng(len(name))
    arrays = {"x": rng.standard_normal((4, 6)) * 3, "target": rng.standard_normal((4, 6))}
    ours = getattr(nn, name)(*args, inplace=True)
    theirs = getattr(real.nn, name)(*args, inplace=True)
    y, grads = forward_and_grads(lambda tracer, t: ours(t["x"]) * 1.0, arrays, ("x",), False)
    # torch's in-place layer would overwrite the leaf: feed it a copy
    ty, tgrads = torch_forward_and_grads(lambda x: theirs(x * 1.0), arrays, ("x",))
    # torch's hard* backward multiplies by 1/6 as a float32 constant even in float64
    rtol = 1e-7 if name.startswith("Hard") else 1e-12
    np.testing.assert_allclose(y, ty, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(grads["x"], tgrads["x"], rtol=rtol, atol=1e-15)


def test_inplace_dropout_accepted_with_the_same_result():
    assert repr(nn.Dropout(0.3, inplace=True)) == repr(real.nn.Dropout(0.3, inplace=True))
    assert repr(nn.Dropout2d(0.3)) == repr(real.nn.Dropout2d(0.3))
    assert repr(nn.LeakyReLU(0.1, inplace=True)) == repr(real.nn.LeakyReLU(0.1, inplace=True))
    x = np.random.default_rng(0).standard_normal((8, 4, 3, 3)).astype(np.float32)

    def outputs(inplace):
        net = nn.Sequential(nn.Dropout(0.5, inplace=inplace), nn.Dropout2d(0.5, inplace=inplace))
        tracer = torch.ir.trace.Tracer(seed=3)
        y = net(tracer.input(x.shape, "float32", "x"))
        return [n.attrs for n in tracer.graph.nodes if n.op == "dropout"], y
    assert outputs(True)[0] == outputs(False)[0]
    net = nn.Sequential(nn.Dropout(0.5, inplace=True)).eval()
    np.testing.assert_array_equal(torch.compile_predict(net, (x,))(x), x)
