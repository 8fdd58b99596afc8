"""The composed torch names of tests/ops/test_surface_ops.py on the GPU, where the compat
files (tests/compat/test_compat_models_cuda.py runs mixer.py: einsum, normalize, constant
pad, prod, outer, scatter_add, in-place adds) do not reach them: median (topk), reflect and
replicate padding, flip (index_select), roll, pixel_shuffle, scatter of a tensor and of a
value (gather_grad, compare, where), repeat_interleave, cosine_similarity and float
remainder, trained three steps by cuda eager and cuda graph replay (and, on the CPU, the
numpy backend), judged against the model's torch twin in float64 by the policy (losses and
parameter changes); and one_hot's int64 comparison in a compiled predict."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import stepgraph as sg
from stepgraph import nn, optim
from stepgraph.nn import functional as F
from tests.reference import assert_close_to_reference, assert_state_changes_close


BATCH, CLASSES = 6, 5


def make_surface(torch_ns):
    """The model over `torch_ns` (stepgraph or torch): (BATCH, 8) -> (BATCH, CLASSES)."""
    nn, F = torch_ns.nn, torch_ns.nn.functional

    class Surface(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 16)
            # distinct weights per place: the median's rows hold no exact ties
            mix = np.random.default_rng(11).uniform(0.5, 1.5, (6, 6)).astype(np.float32)
            self.mix = nn.Parameter(torch_ns.tensor(mix))
            self.head = nn.Linear(35, CLASSES)
            self.shift = nn.Parameter(torch_ns.tensor(np.zeros(CLASSES, np.float32)))
            perm = np.stack([np.random.default_rng(i).permutation(6) for i in range(BATCH * 6)])
            self.register_buffer("perm", torch_ns.tensor(perm.reshape(BATCH, 6, 6)))

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
            out = torch_ns.cat([med.repeat_interleave(2, dim=1), mixed.sum(-1), cos[:, None],
                                h % 1.5], 1)                                   # (b, 35)
            out = self.head(out)
            out += self.shift
            return out

    return Surface()


def _data(steps: int):
    return [(np.random.default_rng(i).standard_normal((BATCH, 8)).astype(np.float32),
             np.random.default_rng(100 + i).integers(0, CLASSES, BATCH).astype(np.int64))
            for i in range(steps)]


def _twins():
    """(stepgraph model, torch model holding the same values)."""
    twin = make_surface(torch)
    model = make_surface(sg)
    model.load_state_dict({k: v.numpy() for k, v in twin.state_dict().items()})
    return model, twin


def torch_run(twin, data, dtype):
    """Three SGD steps of a copy of the torch twin at `dtype`: (losses, float64 state)."""
    twin = copy.deepcopy(twin).to(dtype)
    opt = torch.optim.SGD(twin.parameters(), lr=0.01)
    out = []
    for x, y in data:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(twin(torch.from_numpy(x).to(dtype)),
                                                 torch.from_numpy(y))
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out, {k: (v.double() if v.is_floating_point() else v).numpy()
                 for k, v in twin.state_dict().items()}


def test_surface_twin_steps_on_the_numpy_backend_as_torch():
    """The same judgement on the CPU, where it runs in CI: the twin is the model."""
    check_steps("cpu", False)


@pytest.mark.cuda
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_composed_torch_names_cuda_match_a_float64_run(graph):
    check_steps("cuda", graph)


def check_steps(device: str, graph: bool):
    """Three SGD steps on `device`, judged by the tolerance policy (docs/TESTING.md): losses
    and every parameter's change against the torch twin in float64, bound 4x the twin's own
    float32 error."""
    model, twin = _twins()
    data = _data(3)
    step = sg.compile_train_step(model, loss=F.cross_entropy, optimizer=optim.SGD(lr=0.01),
                                 example_inputs=data[0], device=device, graph=graph)
    before = {k: np.array(v, copy=True) for k, v in model.state_dict().items()}
    losses = [float(step(x, y)) for x, y in data]
    losses64, after64 = torch_run(twin, data, torch.float64)
    losses32, after32 = torch_run(twin, data, torch.float32)
    assert_close_to_reference(losses, losses64, losses32, f"{device} losses")
    after = {k: np.asarray(sg.to_numpy(v)) for k, v in model.state_dict().items()}
    assert_state_changes_close(before, after, after64, after32, f"{device} ",
                               trained=[k for k, _ in model.named_parameters()])


class OneHot(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(CLASSES, 3)

    def forward(self, labels):
        return self.fc(F.one_hot(labels, CLASSES).float())


@pytest.mark.cuda
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
