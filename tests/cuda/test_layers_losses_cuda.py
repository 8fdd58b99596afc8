"""The composed layers and losses on the GPU: the layer zoo (tests/models/test_layer_zoo.py)
and a weighted, ignore_index cross-entropy plus BCE-with-logits model, trained three steps by
cuda eager and cuda graph replay against the numpy backend (losses and parameter changes).
Their resampling matrices are built on the device from arange, float64 arithmetic and
comparisons, which this also exercises on the generated pointwise kernels."""
from __future__ import annotations

import numpy as np
import pytest

import stepgraph as sg
from stepgraph import nn, optim
from stepgraph.nn import functional as F
from tests.models.test_layer_zoo import make_zoo, zoo_data, zoo_loss

pytestmark = pytest.mark.cuda
cp = pytest.importorskip("cupy")
if not sg.cuda_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)


class WeightedHeads(nn.Module):
    """Logits and a multi-label score; the class weights are a buffer of the model."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(12, 7)
        self.register_buffer("class_weight", np.array([0.5, 1, 2, 1.5, 1], np.float32))

    def forward(self, x):
        return self.body(x)


def weighted_loss(model):
    def loss(out, y):
        ce = F.cross_entropy(out.narrow(1, 0, 5), y,
                             model.class_weight, ignore_index=3, label_smoothing=0.05)
        bce = F.binary_cross_entropy_with_logits(out.narrow(1, 5, 2), out.narrow(1, 5, 2)
                                                 .sigmoid() * 0.5, reduction="sum")
        return ce + bce
    return loss


def _train(make, loss_of, data, device, graph):
    model = make()
    nn.manual_seed(0)
    step = sg.compile_train_step(model, loss=loss_of(model), optimizer=optim.SGD(lr=0.05),
                                 example_inputs=data[0], device=device, graph=graph)
    params = [k for k, _ in model.named_parameters()]
    before = {k: model.state_dict()[k].copy() for k in params}
    losses = [float(step(x, y)) for x, y in data]
    return losses, {k: model.state_dict()[k] - before[k] for k in params}


def _same_init(make):
    def made():
        nn.manual_seed(0)
        return make()
    return made


CASES = {
    "zoo": (_same_init(lambda: make_zoo(nn)), lambda m: zoo_loss, zoo_data(3)),
    "weighted": (_same_init(WeightedHeads), weighted_loss,
                 [(np.random.default_rng(i).standard_normal((9, 12)).astype(np.float32),
                   np.random.default_rng(i).integers(0, 5, 9).astype(np.int64))
                  for i in range(3)]),
}


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("case", list(CASES))
def test_composed_layers_and_losses_cuda_match_numpy(case, graph):
    make, loss_of, data = CASES[case]
    want_losses, want = _train(make, loss_of, data, "cpu", False)
    got_losses, got = _train(make, loss_of, data, "cuda", graph)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-4)
    for k in want:
        assert np.abs(want[k]).max() > 0, k
        err = np.linalg.norm(got[k] - want[k]) / np.linalg.norm(want[k])
        assert err < 1e-3, (k, err)
