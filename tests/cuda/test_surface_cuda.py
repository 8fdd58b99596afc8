"""The composed torch names of tests/ops/test_surface_ops.py on the GPU, where the compat
files (tests/compat/test_compat_models_cuda.py runs mixer.py: einsum, normalize, constant
pad, prod, outer, scatter_add, in-place adds) do not reach them: median (topk), reflect and
replicate padding, flip (index_select), roll, pixel_shuffle, scatter of a tensor and of a
value (gather_grad, compare, where), repeat_interleave, cosine_similarity and float
remainder, trained three steps by cuda eager and cuda graph replay against the numpy backend
(losses and parameter changes); and one_hot's int64 comparison in a compiled predict."""
from __future__ import annotations

import numpy as np
import pytest

import stepgraph as sg
from stepgraph import nn, optim
from stepgraph.nn import functional as F

pytestmark = pytest.mark.cuda
cp = pytest.importorskip("cupy")
if not sg.cuda_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

BATCH, CLASSES = 6, 5


class Surface(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        # distinct weights per place: the median's rows hold no exact ties
        self.mix = nn.Parameter(np.random.default_rng(11).uniform(0.5, 1.5, (6, 6)))
        self.head = nn.Linear(35, CLASSES)
        self.shift = nn.Parameter(np.zeros(CLASSES, np.float32))
        perm = np.stack([np.random.default_rng(i).permutation(6) for i in range(BATCH * 6)])
        self.register_buffer("perm", perm.reshape(BATCH, 6, 6).astype(np.int64))

    def forward(self, x):
        b = x.shape[0]
        h = self.fc(x)                                                    # (b, 16)
        img = F.pixel_shuffle(h.view(b, 4, 2, 2), 2)                      # (b, 1, 4, 4)
        img = F.pad(img, (1, 1, 1, 1), mode="reflect") + \
            F.pad(img, (2, 0, 0, 2), mode="replicate")                    # (b, 1, 6, 6)
        rows = (img.flip(-1) + img.roll(1, 2)).view(b, 6, 6)
        med = (rows * self.mix).median(dim=-1).values                     # (b, 6)
        mixed = rows.scatter(2, self.perm, rows * 2.0).scatter(2, self.perm[..., :2], 0.5)
        cos = F.cosine_similarity(h[:, :8], h[:, 8:], dim=1)              # (b,)
        out = sg.cat([med.repeat_interleave(2, dim=1), mixed.sum(-1), cos[:, None],
                      h % 1.5], 1)                                         # (b, 35)
        out = self.head(out)
        out += self.shift
        return out


def _data(steps: int):
    return [(np.random.default_rng(i).standard_normal((BATCH, 8)).astype(np.float32),
             np.random.default_rng(100 + i).integers(0, CLASSES, BATCH).astype(np.int64))
            for i in range(steps)]


def _train(device: str, graph: bool):
    nn.manual_seed(0)
    model = Surface()
    data = _data(3)
    step = sg.compile_train_step(model, loss=F.cross_entropy, optimizer=optim.SGD(lr=0.01),
                                 example_inputs=data[0], device=device, graph=graph)
    params = [k for k, _ in model.named_parameters()]
    before = {k: model.state_dict()[k].copy() for k in params}
    losses = [float(step(x, y)) for x, y in data]
    return losses, {k: model.state_dict()[k] - before[k] for k in params}


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_composed_torch_names_cuda_match_numpy(graph):
    want_losses, want = _train("cpu", False)
    got_losses, got = _train("cuda", graph)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-4)
    for k in want:
        assert np.abs(want[k]).max() > 0, k
        err = np.linalg.norm(got[k] - want[k]) / np.linalg.norm(want[k])
        assert err < 1e-3, (k, err)


class OneHot(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(CLASSES, 3)

    def forward(self, labels):
        return self.fc(F.one_hot(labels, CLASSES).float())


def test_one_hot_predict_cuda_matches_numpy():
    nn.manual_seed(0)
    model = OneHot()
    batches = [np.random.default_rng(20 + i).integers(0, CLASSES, (4, 9)).astype(np.int64)
               for i in range(5)]
    cpu = sg.compile_predict(model, example_inputs=batches[:1], device="cpu")
    gpu = sg.compile_predict(model, example_inputs=batches[:1], device="cuda", graph=True)
    for labels in batches:
        want = np.asarray(cpu(labels)).copy()
        np.testing.assert_allclose(sg.to_numpy(gpu(labels)), want, rtol=1e-6, atol=1e-6)
