"""precision="bf16" on cuda against PyTorch's CUDA autocast(dtype=torch.bfloat16) over 50
AdamW steps: the `mlp` and `cnn` workloads of BENCHMARKS.md (batch 32), the same initial
weights, the same fresh batches; float32 master weights on both sides. On the GPU the two run
the same semantics (CUDA autocast's op lists, cuBLAS and cuDNN accumulating in float32 and
rounding once), so no twin modules are needed, unlike the CPU test
(tests/models/test_bf16_trajectory.py).

Tolerances, as the CPU test argues them: both sides round at the same points, but each GEMM
and convolution sums in its own order, so now and then a value near a bf16 rounding boundary
lands on the other neighbour (2^-8 of it), and over 50 AdamW steps such flips grow like any
perturbation of a training run. A PyTorch float32 run from the same weights on the same
batches measures how far bf16's effects take torch's bf16 run. So
- at every step the loss is within 2^-8 relative of torch's bf16 loss (one bf16 ulp at the
  bottom of a binade: the loss is a float32 mean over bf16 logits, each carrying up to that
  much rounding), or no farther from it than the float32 run's loss is. Per step the float32
  run is not always the farther one: on the H100 flip-grown differences up to 1.15x the
  float32 run's distance were seen at single steps (mlp step 39: 0.0054 against 0.0047,
  2.6e-3 relative; cnn step 6: 0.0049 against 0.0039);
- over the 50 steps, the mean distance to torch's bf16 losses is below the float32 run's:
  on the whole the run follows bf16 arithmetic, not float32;
- the parameters' total change (final - initial, all tensors together) is no farther from
  torch's bf16 run's than the float32 run's change is."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

cp = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")

from stepgraph.backends import cuda_available  # noqa: E402

if not cuda_available() or not torch.cuda.is_available():
    pytest.skip("needs a GPU visible to CuPy and to PyTorch", allow_module_level=True)

import stepgraph as sg  # noqa: E402
from stepgraph import optim  # noqa: E402
from tests.models.test_trajectories import WORKLOADS, Batches  # noqa: E402
from tests.ops.helpers import relative_error  # noqa: E402

STEPS, BATCH = 50, 32
LOSS_RTOL = 2.0 ** -8


def torch_step(w, tmodel, topt, x, y, autocast: bool) -> float:
    topt.zero_grad()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = tmodel(torch.tensor(x, device="cuda"))
    loss = w.torch_loss(out.float(), torch.tensor(y, device="cuda"))
    loss.backward()
    topt.step()
    return loss.item()


def changes(state: dict, initial: dict) -> np.ndarray:
    return np.concatenate([(np.asarray(state[k]) - initial[k]).ravel() for k in sorted(initial)])


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_50_bf16_steps_follow_torch_cuda_autocast(name, request):
    w = WORKLOADS[name]
    torch.manual_seed(0)
    t16, t32 = w.torch_model(0.0, 0, [0]), w.torch_model(0.0, 0, [0])
    t32.load_state_dict(t16.state_dict())
    model = w.sg_model(0.0)
    model.load_state_dict({k: v.detach().numpy() for k, v in t16.state_dict().items()})
    t16, t32 = t16.cuda(), t32.cuda()
    o16, o32 = (torch.optim.AdamW(t.parameters(), lr=1e-3, weight_decay=0.01) for t in (t16, t32))
    batches = Batches(request.node.name, w.x_shape)
    initial = {k: np.array(v) for k, v in model.state_dict().items()}
    step = sg.compile_train_step(model, w.loss, optim.AdamW(lr=1e-3, weight_decay=0.01),
                                 batches.draw(BATCH), device="cuda", precision="bf16")
    losses = []                                     # (ours, torch bf16, torch float32)
    for _ in range(STEPS):
        x, y = batches.draw(BATCH)
        got = float(step(cp.asarray(x), cp.asarray(y)))
        losses.append((got, *(torch_step(w, t, o, x, y, autocast) for t, o, autocast in
                              ((t16, o16, True), (t32, o32, False)))))
    got, want, fp32 = np.array(losses).T
    ours, float32s = np.abs(got - want), np.abs(fp32 - want)
    print(f"{name}: |ours - torch bf16| mean {ours.mean():.2e} max {ours.max():.2e}; "
          f"|torch fp32 - torch bf16| mean {float32s.mean():.2e} max {float32s.max():.2e}")
    assert np.isfinite(got).all()
    far = np.flatnonzero(ours > np.maximum(LOSS_RTOL * np.abs(want), float32s))
    assert far.size == 0, [(i, got[i], want[i], fp32[i]) for i in far]
    assert ours.mean() < float32s.mean(), (ours.mean(), float32s.mean())
    p16 = {k: v.cpu().numpy() for k, v in t16.state_dict().items()}
    p32 = {k: v.cpu().numpy() for k, v in t32.state_dict().items()}
    torch_change = changes(p16, initial)
    err = relative_error(changes(model.state_dict(), initial), torch_change)
    assert err <= relative_error(changes(p32, initial), torch_change), err
