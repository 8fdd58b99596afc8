"""PyTorch-style Module subclasses: forward written with tensor operators and nn.functional,
submodules in ModuleList, module paths in errors and node labels.

The same model definition is built once on torch.nn and once on stepgraph.nn; both start from
the same weights (load_state_dict) and train side by side with SGD on fresh batches.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as TF
from torch import nn as tnn

import stepgraph as sg
from stepgraph import losses, nn, optim
from stepgraph.errors import UnsupportedOpError
from stepgraph.ir.trace import Tracer
from stepgraph.nn import functional as F
from tests.ops.helpers import seeded

STEPS, BATCH, D_IN, D, CLASSES = 10, 8, 6, 8, 4


def residual_mlp(nn, F):
    """y = relu(linear2(relu(linear1(x))) + x) on the given framework."""

    class ResidualMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear1 = nn.Linear(D, D)
            self.linear2 = nn.Linear(D, D)

        def forward(self, x):
            return F.relu(self.linear2(F.relu(self.linear1(x))) + x)

    return ResidualMLP()


def block_net(nn, F):
    """A stem, two residual blocks in a ModuleList, centering, a scaled head."""

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.lin1, self.lin2, self.act = nn.Linear(d, d), nn.Linear(d, d), nn.ReLU()

        def forward(self, x):
            return self.act(self.lin2(self.act(self.lin1(x))) + x)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Linear(D_IN, D)
            self.blocks = nn.ModuleList([Block(D)])
            self.blocks.append(Block(D))
            self.head = nn.Linear(D, CLASSES)

        def forward(self, x):
            h = F.silu(self.stem(x))
            for block in self.blocks:
                h = block(h)
            h = h - h.mean(dim=1, keepdim=True)
            return self.head(h * 0.5) / 2.0

    return Net()


# name -> (model factory, input features, stepgraph loss, torch loss, target(gen, n))
MODELS = {
    "residual-mlp": (residual_mlp, D, losses.mse, TF.mse_loss,
                     lambda g, n: g.standard_normal((n, D)).astype(np.float32)),
    "modulelist-net": (block_net, D_IN, losses.cross_entropy, TF.cross_entropy,
                       lambda g, n: g.integers(0, CLASSES, n).astype(np.int64)),
}


@pytest.mark.parametrize("name", MODELS)
def test_subclass_trains_like_torch(name):
    factory, d_in, loss, torch_loss, target = MODELS[name]
    gen = seeded(name)
    torch.manual_seed(0)
    tmodel = factory(tnn, TF)
    model = factory(nn, F)
    model.load_state_dict({k: v.detach().numpy() for k, v in tmodel.state_dict().items()})
    topt = torch.optim.SGD(tmodel.parameters(), lr=0.1)
    batches = [(gen.standard_normal((BATCH, d_in)).astype(np.float32), target(gen, BATCH))
               for _ in range(STEPS)]
    step = sg.compile_train_step(model, loss, optim.SGD(lr=0.1), example_inputs=batches[0],
                                 device="cpu")
    got, want = [], []
    for x, y in batches:
        got.append(float(step(x, y)))
        topt.zero_grad()
        t_loss = torch_loss(tmodel(torch.tensor(x)), torch.tensor(y))
        t_loss.backward()
        topt.step()
        want.append(t_loss.item())
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert got[-1] < got[0]
    trained = model.state_dict()
    for k, v in tmodel.state_dict().items():
        np.testing.assert_allclose(trained[k], v.detach().numpy(), rtol=1e-4, atol=1e-6,
                                   err_msg=k)
    x = batches[0][0]
    with torch.no_grad():
        np.testing.assert_allclose(sg.compile_predict(model, (x,))(x),
                                   tmodel(torch.tensor(x)).numpy(), rtol=1e-5, atol=1e-6)


def test_modulelist_state_dict_keys_match_torch():
    assert list(block_net(nn, F).state_dict()) == list(block_net(tnn, TF).state_dict())
    items = nn.ModuleList([nn.Linear(2, 3)]).extend([nn.ReLU(), nn.Identity()])
    assert len(items) == 3 and isinstance(items[1], nn.ReLU) and isinstance(items[-1], nn.Identity)
    assert [type(m).__name__ for m in items] == ["Linear", "ReLU", "Identity"]
    assert list(items.state_dict()) == ["0.weight", "0.bias"]
    assert len(items[1:]) == 2


class Kthvalue(nn.Module):
    def forward(self, x):
        return x.kthvalue(2, 1).values


class MaskIndexing(nn.Module):
    def forward(self, x):
        return x[x > 0]           # a data-dependent shape


class Outer(nn.Module):
    def __init__(self, bad: nn.Module):
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(D, D), bad)])

    def forward(self, x):
        return self.layers[0](x)


@pytest.mark.parametrize("bad, op", [(Kthvalue(), "Tensor.kthvalue"),
                                     (MaskIndexing(), "mask")])
def test_unsupported_op_names_the_op_and_module_path(bad, op):
    model = Outer(bad)
    x = np.ones((BATCH, D), np.float32)
    with pytest.raises(UnsupportedOpError) as info:
        sg.compile_train_step(model, losses.mse, optim.SGD(lr=0.1), example_inputs=(x, x))
    assert op in str(info.value) and "model.layers.0.1" in str(info.value)


def test_nodes_carry_module_labels():
    tracer = Tracer()
    model = block_net(nn, F)
    model.name_parameters()
    model(tracer.input((BATCH, D_IN), "float32", "x_in"))
    labels = {(n.op, n.attrs.get("kind")): n.label for n in tracer.graph.nodes}
    assert labels[("act", "silu")] == "Net"
    assert labels[("binary", "add")] == "Block"          # the residual, in the block's forward
    assert labels[("act", "relu")] == "ReLU"
    assert [n.label for n in tracer.graph.nodes if n.op == "linear"] == [
        "Linear(6,8)", "Linear(8,8)", "Linear(8,8)", "Linear(8,8)", "Linear(8,8)", "Linear(8,4)"]
    assert tracer.module_path == [] and tracer.label == ""


def test_sequential_labels_unchanged():
    tracer = Tracer()
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Flatten())
    model.name_parameters()
    model(tracer.input((2, 4), "float32", "x"))
    assert [n.label for n in tracer.graph.nodes] == ["Linear(4,3)", "ReLU"]
