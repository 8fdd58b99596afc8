"""precision="bf16" on the CPU against PyTorch's CPU autocast(dtype=torch.bfloat16), float32
master weights on both sides: the `mlp` and `cnn` workloads of BENCHMARKS.md (batch 32), the
same initial weights (the twin's), the same fresh batches, the same optimizer.

CPU and CUDA autocast differ on this path in two places, and the twins do what CUDA does:
- CUDA autocast runs log_softmax in float32 (its fp32_set_opt_dtype list), CPU autocast in
  bf16. stepgraph follows CUDA's lists (compile/autocast.py), so the twin computes its final
  LogSoftmax in float32 itself.
- cuDNN's bf16 convolutions and cuBLAS's bf16 GEMMs accumulate in float32 and round once. PyTorch's CPU bf16
  convolution backward on processors without AVX512-BF16 (oneDNN's AVX2 path, CI's machines)
  does not: its weight gradient sits 0.7% (norm-wise) from the float32 sum of the same bf16
  operands rounded once, three times the half-ulp this test allows. The twins' convolutions
  and linears therefore run on bf16-rounded operands in float32 and round their output to
  bf16 (`Bf16Conv2d`, `Bf16Linear`), which is the CUDA semantics, forward and backward (autograd rounds each
  gradient at the casts).
The rest (linear and conv2d in bf16, ReLU, max pooling and dropout on bf16, the losses in float32,
the backward in the forward's dtypes, gradients reaching the optimizer as float32) is the same
on both lists.

Tolerances. bf16 keeps 8 significant bits: one rounding moves a value by up to 2^-9 (0.2%)
relative. Both sides round at the same points (the first test pins that: on identical weights
the first step agrees to float32 rounding), but each GEMM accumulates its float32 sums in its
own order, so now and then a value near a bf16 rounding boundary rounds to the other
neighbour: one ulp, 2^-8 of that element. Such flips are noise the emulation cannot remove;
what it must get right is where rounding happens. So every check is also made against the
float32 twin (torch without autocast), whose distance from torch's bf16 run is the size of
bf16's effects, and stepgraph must be much closer than that:
- first step (SGD with lr 1, so the update is minus the gradient): loss within 1e-6, each
  parameter's gradient within 2^-9 norm-wise (half a bf16 ulp) and within a tenth of the
  float32 twin's gradient distance from torch's bf16 gradient (measured: at most 5e-5, and
  under 1/80 of the float32 twin's distance, 0.2 - 14%);
- 20 steps: every loss within 1e-3 relative (a quarter of the 2^-8 relative step of a bf16
  value; measured up to 3.5e-4 with AdamW, whose normalised updates turn a flipped gradient
  element into a full lr-sized step) and the first one within 1e-6 (measured 1e-7); the
  parameters' total change (final - initial, all tensors together) no farther from torch's
  than the float32 twin's. Over 20 steps a flip grows like any perturbation of a training run;
  where the bf16 effects are small against that growth (the cnn with SGD: the float32 twin sits
  only 6% of the change away), stepgraph lands at a similar distance (measured 0.87 of the
  float32 twin's; AdamW 0.08, the mlp 0.0002 - 0.3), so this bound is the float32 twin's
  distance itself, not a fraction of it.
The twins' GEMMs and convolutions accumulate in float32 (Bf16Linear, Bf16Conv2d) in their own
order, NumPy's reference in another: the flips, measured with torch 2.13.0+cpu, are a few in
10^4 elements of a layer's output, none on most seeds.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn as tnn

import stepgraph as sg
from stepgraph import optim
from tests.models.test_trajectories import WORKLOADS, Batches
from tests.ops.helpers import relative_error

STEPS, BATCH = 20, 32
FIRST_LOSS_RTOL, LOSS_RTOL = 1e-6, 1e-3
GRAD_RTOL = 2.0 ** -9
GRAD_VS_FP32, UPDATE_VS_FP32 = 0.1, 1.0


class LogSoftmax32(tnn.Module):
    """CUDA autocast's log_softmax: float32 in, float32 out (CPU autocast's would be bf16)."""

    def forward(self, x):
        return torch.log_softmax(x.float(), dim=1)


class Bf16Linear(tnn.Linear):
    """Linear as cuBLAS runs it under CUDA autocast (see Bf16Conv2d)."""

    @classmethod
    def like(cls, linear: tnn.Linear) -> "Bf16Linear":
        twin = cls(linear.in_features, linear.out_features, linear.bias is not None)
        twin.load_state_dict(linear.state_dict())
        return twin

    def forward(self, x):
        w = self.weight.bfloat16().float()
        b = None if self.bias is None else self.bias.bfloat16().float()
        with torch.autocast("cpu", enabled=False):
            return tnn.functional.linear(x.bfloat16().float(), w, b).bfloat16()


class Bf16Conv2d(tnn.Conv2d):
    """Conv2d as cuDNN runs it under CUDA autocast: operands rounded to bf16, float32
    accumulation, output rounded to bf16; the gradients of x and weight come back rounded to
    bf16 at the casts, as autocast's bf16 convolution backward gives them."""

    @classmethod
    def like(cls, conv: tnn.Conv2d) -> "Bf16Conv2d":
        twin = cls(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride,
                   conv.padding, conv.dilation, conv.groups, conv.bias is not None)
        twin.load_state_dict(conv.state_dict())
        return twin

    def forward(self, x):
        w = self.weight.bfloat16().float()
        b = None if self.bias is None else self.bias.bfloat16().float()
        with torch.autocast("cpu", enabled=False):       # float32 inside autocast's region
            return self._conv_forward(x.bfloat16().float(), w, b).bfloat16()


def twins(name: str, seed: int):
    """(stepgraph model, torch bf16 twin, torch float32 twin), with the bf16 twin's weights."""
    w = WORKLOADS[name]
    torch.manual_seed(seed)
    t16 = w.torch_model(0.0, 0, [0])
    t32 = w.torch_model(0.0, 0, [0])
    t32.load_state_dict(t16.state_dict())
    if name == "cnn":
        t16[-1] = LogSoftmax32()
    for i, m in enumerate(t16):
        if isinstance(m, (tnn.Conv2d, tnn.Linear)):
            t16[i] = (Bf16Conv2d if isinstance(m, tnn.Conv2d) else Bf16Linear).like(m)
    model = w.sg_model(0.0)
    model.load_state_dict({k: v.detach().numpy() for k, v in t16.state_dict().items()})
    return model, t16, t32


def torch_step(w, tmodel, topt, x, y, autocast: bool) -> float:
    topt.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = tmodel(torch.tensor(x))
    loss = w.torch_loss(out.float(), torch.tensor(y))
    loss.backward()
    topt.step()
    return loss.item()


def state_arrays(model) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in model.state_dict().items()}


def changes(model_state: dict, initial: dict) -> np.ndarray:
    return np.concatenate([(model_state[k] - initial[k]).ravel() for k in sorted(initial)])


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_first_step_matches_torch_autocast(name, request):
    w = WORKLOADS[name]
    model, t16, t32 = twins(name, 1)
    x, y = Batches(request.node.name, w.x_shape).draw(BATCH)
    step = sg.compile_train_step(model, w.loss, optim.SGD(lr=1.0), (x, y), precision="bf16")
    before = state_arrays(model)
    loss = float(step(x, y))
    want = torch_step(w, t16, torch.optim.SGD(t16.parameters(), lr=1.0), x, y, True)
    torch_step(w, t32, torch.optim.SGD(t32.parameters(), lr=1.0), x, y, False)
    assert abs(loss - want) <= FIRST_LOSS_RTOL * abs(want), (loss, want)
    after, p16, p32 = state_arrays(model), t16.state_dict(), t32.state_dict()
    for k in before:
        got, g16, g32 = (before[k] - after[k], before[k] - p16[k].numpy(),
                         before[k] - p32[k].numpy())
        err, fp32_err = relative_error(got, g16), relative_error(g32, g16)
        assert err <= GRAD_RTOL and err <= GRAD_VS_FP32 * fp32_err, (k, err, fp32_err)


@pytest.mark.parametrize("opt", ["adamw", "sgd-momentum"])
@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_20_steps_follow_torch_autocast(name, opt, request):
    w = WORKLOADS[name]
    model, t16, t32 = twins(name, 0)
    if opt == "adamw":
        sg_opt = optim.AdamW(lr=1e-3, weight_decay=0.01)
        make = lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01)   # noqa: E731
    else:
        sg_opt = optim.SGD(lr=0.01, momentum=0.5)
        make = lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.5)          # noqa: E731
    o16, o32 = make(t16.parameters()), make(t32.parameters())
    batches = Batches(request.node.name, w.x_shape)
    initial = state_arrays(model)
    step = sg.compile_train_step(model, w.loss, sg_opt, batches.draw(BATCH), precision="bf16")
    got, want = [], []
    for _ in range(STEPS):
        x, y = batches.draw(BATCH)
        got.append(float(step(x, y)))
        want.append(torch_step(w, t16, o16, x, y, True))
        torch_step(w, t32, o32, x, y, False)
    errors = [abs(a - b) / abs(b) for a, b in zip(got, want)]
    p16 = {k: v.numpy() for k, v in t16.state_dict().items()}
    p32 = {k: v.numpy() for k, v in t32.state_dict().items()}
    torch_change = changes(p16, initial)
    err = relative_error(changes(state_arrays(model), initial), torch_change)
    fp32_err = relative_error(changes(p32, initial), torch_change)
    assert errors[0] <= FIRST_LOSS_RTOL and max(errors) <= LOSS_RTOL, \
        f"losses\nstepgraph {got}\ntorch     {want}"
    assert err <= UPDATE_VS_FP32 * fp32_err, (err, fp32_err)
