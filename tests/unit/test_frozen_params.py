"""Frozen parameters (requires_grad=False) and models that compute their own loss
(compile_train_step(loss=None)), against torch on the same models and batches.

Judged as DESIGN.md says: the parameter changes of a float32 run against a float64 torch run,
bounded by a small multiple of the error torch float32 makes on the same problem."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import stepgraph as sg
from stepgraph import LossSelectionError, losses, nn, optim
from stepgraph.nn import functional as F
from tests.ops.helpers import relative_error, seeded

STEPS = 5
# float32 rounding floor (2^-23) for a change torch float32 happens to get exact
EPS32 = 2.0 ** -23

OPTIMIZERS = {
    "sgd-momentum": (lambda: optim.SGD(lr=0.1, momentum=0.9),
                     lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
    "adamw": (lambda: optim.AdamW(lr=0.01, weight_decay=0.1),
              lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1)),
}
FROZEN = ("0.weight", "0.bias", "2.bias")


def sg_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5))


def torch_mlp(dtype) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 5)).to(dtype)


def batches(name: str):
    gen = seeded(name)
    return [(gen.standard_normal((12, 6)).astype(np.float32), gen.integers(0, 5, 12))
            for _ in range(STEPS)]


def torch_run(initial: dict, frozen, make_opt, data, dtype) -> dict[str, np.ndarray]:
    """Parameters after torch trains the MLP from `initial` with `frozen` not trained."""
    model = torch_mlp(dtype)
    model.load_state_dict({k: torch.tensor(v) for k, v in initial.items()})
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    opt = make_opt([p for p in model.parameters() if p.requires_grad])
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.tensor(x, dtype=dtype)),
                                          torch.tensor(y)).backward()
        opt.step()
    return {k: v.detach().double().numpy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_frozen_parameters_stay_bit_identical_and_the_rest_trains_as_torch(opt):
    make_sg, make_torch = OPTIMIZERS[opt]
    nn.init.manual_seed(1)
    model = sg_mlp()
    for name in FROZEN:
        model.get_parameter(name).requires_grad_(False)
    initial = {k: v.numpy() for k, v in model.state_dict().items()}
    data = batches(opt)
    step = sg.compile_train_step(model, losses.cross_entropy, make_sg(),
                                 example_inputs=data[0])
    for x, y in data:
        step(x, y)
    after = {k: v.numpy() for k, v in model.state_dict().items()}
    for name in FROZEN:
        assert after[name].tobytes() == initial[name].tobytes(), name
        assert not any(name in key for key in step.state), f"optimizer state for {name}"
    assert any("2.weight" in key for key in step.state)      # the trained one has its slots
    want = torch_run(initial, FROZEN, make_torch, data, torch.float64)
    t32 = torch_run(initial, FROZEN, make_torch, data, torch.float32)
    for name in ("2.weight",):
        change, want_change = after[name] - initial[name], want[name] - initial[name]
        torch_err = relative_error(t32[name] - initial[name], want_change)
        err = relative_error(change, want_change)
        assert np.abs(want_change).max() > 1e-3, "the trained parameter must move"
        assert err <= 4 * max(torch_err, EPS32), f"{name}: {err:.2e} vs torch {torch_err:.2e}"


def test_requires_grad_change_is_seen_by_the_next_compile():
    nn.init.manual_seed(2)
    model = sg_mlp()
    opt = optim.SGD(lr=0.1)
    data = batches("recompile")
    step = sg.compile_train_step(model, losses.cross_entropy, opt, example_inputs=data[0])
    model[0].requires_grad_(False)
    # the compiled step keeps training what it was built with ...
    before = model.state_dict()
    step(*data[0])
    assert not np.array_equal(model.state_dict()["0.weight"], before["0.weight"])
    # ... and compiling again builds a step that freezes layer 0
    frozen_step = sg.compile_train_step(model, losses.cross_entropy, opt, example_inputs=data[0])
    assert frozen_step is not step
    before = model.state_dict()
    frozen_step(*data[1])
    after = model.state_dict()
    assert np.array_equal(after["0.weight"], before["0.weight"])
    assert not np.array_equal(after["2.weight"], before["2.weight"])


def test_frozen_parameter_with_a_new_batch_shape_stays_frozen():
    nn.init.manual_seed(3)
    model = sg_mlp()
    model[2].weight.requires_grad = False
    step = sg.compile_train_step(model, losses.cross_entropy, optim.SGD(lr=0.1),
                                 example_inputs=batches("ragged")[0])
    before = model.state_dict()["2.weight"]
    gen = seeded("ragged-last")
    step(gen.standard_normal((5, 6)).astype(np.float32), gen.integers(0, 5, 5))  # a new plan
    assert np.array_equal(model.state_dict()["2.weight"], before)


class OwnLoss(nn.Module):
    """nanoGPT's calling convention: forward(x, targets=None) -> (logits, loss or None)."""

    def __init__(self):
        super().__init__()
        self.net = sg_mlp()

    def forward(self, x, targets=None):
        logits = self.net(x)
        loss = None if targets is None else F.cross_entropy(logits, targets)
        return logits, loss


class DictLoss(OwnLoss):
    def forward(self, x, targets):
        logits, loss = super().forward(x, targets)
        return {"logits": logits, "nll": loss}


def test_model_returning_logits_and_loss_trains_like_loss_cross_entropy():
    data = batches("own-loss")
    nn.init.manual_seed(4)
    own = OwnLoss()
    plain = sg_mlp()
    plain.load_state_dict({k.removeprefix("net."): v for k, v in own.state_dict().items()})
    opt_own, opt_plain = optim.AdamW(lr=0.01), optim.AdamW(lr=0.01)
    step_own = sg.compile_train_step(own, optimizer=opt_own, example_inputs=data[0])
    step_plain = sg.compile_train_step(plain, losses.cross_entropy, opt_plain,
                                       example_inputs=data[0])
    for x, y in data:
        assert float(step_own(x, y)) == float(step_plain(x, y))
    for k, v in plain.state_dict().items():
        assert np.array_equal(own.state_dict()["net." + k], v), k
    # predict mode (targets None) returns the logits
    predict = sg.compile_predict(own, example_inputs=(data[0][0],))
    assert np.array_equal(predict(data[0][0]), sg.compile_predict(plain, (data[0][0],))(
        data[0][0]))


def test_loss_is_picked_by_key_index_or_taken_as_the_output():
    data = batches("pick")
    nn.init.manual_seed(5)
    model = DictLoss()
    step = sg.compile_train_step(model, optimizer=optim.SGD(lr=0.1), example_inputs=data[0],
                                 loss_key="nll")
    tmodel = torch_mlp(torch.float64)
    tmodel.load_state_dict({k.removeprefix("net."): torch.tensor(v.numpy())
                            for k, v in model.state_dict().items()})
    x, y = data[0]
    want = torch.nn.functional.cross_entropy(tmodel(torch.tensor(x, dtype=torch.float64)),
                                             torch.tensor(y))
    assert float(step(x, y)) == pytest.approx(want.item(), rel=1e-6)
    with pytest.raises(LossSelectionError, match="'loss'.*keys \\['logits', 'nll'\\]"):
        sg.compile_train_step(DictLoss(), optimizer=optim.SGD(lr=0.1), example_inputs=data[0])
    with pytest.raises(LossSelectionError, match="entry 0 is not a scalar.*shape \\(12, 5\\)"):
        sg.compile_train_step(OwnLoss(), optimizer=optim.SGD(lr=0.1), example_inputs=data[0],
                              loss_index=0)


class LogitsOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = sg_mlp()

    def forward(self, x, targets):
        return self.net(x)


def test_no_scalar_loss_in_the_output_is_a_clear_error():
    data = batches("no-loss")
    with pytest.raises(LossSelectionError, match="output is not a scalar loss.*shape"):
        sg.compile_train_step(LogitsOnly(), optimizer=optim.SGD(lr=0.1),
                              example_inputs=data[0])


def test_a_model_with_every_parameter_frozen_is_refused():
    model = sg_mlp().requires_grad_(False)
    with pytest.raises(ValueError, match="all 4 parameters of the model have requires_grad=False"):
        sg.compile_train_step(model, losses.cross_entropy, optim.SGD(lr=0.1),
                              example_inputs=batches("all-frozen")[0])
