"""Loop capture (stepgraph/loop): a PyTorch training loop, written once, run on torch (float32 and
float64) and on stepgraph with `import stepgraph as torch`, judged by the tolerance policy; and
the captured loop against compile_train_step, bit for bit."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import stepgraph as sg
from stepgraph.loop.passes import RecaptureWarning, ValueNotReadyError
from tests.reference import assert_close_to_reference

D_IN, HIDDEN, CLASSES = 12, 16, 5


def net(fw, dropout=0.0):
    layers = [fw.nn.Linear(D_IN, HIDDEN), fw.nn.ReLU()]
    layers += [fw.nn.Dropout(dropout)] if dropout else []
    return fw.nn.Sequential(*layers, fw.nn.Linear(HIDDEN, CLASSES))


def batches(n, batch=8, seed=0):
    gen = np.random.default_rng(seed)
    return [(gen.standard_normal((batch, D_IN)).astype(np.float32),
             gen.integers(0, CLASSES, batch).astype(np.int64)) for _ in range(n)]


def twins(make=None):
    """torch float32 / float64 models and a stepgraph model of make(fw) (default: net), all
    with the same weights."""
    make = make or net
    torch.manual_seed(0)
    t32 = make(torch)
    t64 = make(torch).double()
    t64.load_state_dict({k: v.double() for k, v in t32.state_dict().items()})
    ours = make(sg)
    ours.load_state_dict({k: v.numpy() for k, v in t32.state_dict().items()})
    return t32, t64, ours


def classic_loop(fw, model, opt, data, dtype=np.float32, accumulate=1, clip=None,
                 after_backward=None):
    """The loop as PyTorch's examples write it; returns each step's (last) loss, read after
    the step."""
    F = fw.nn.functional
    losses = []
    for i in range(0, len(data), accumulate):
        opt.zero_grad()
        for x, y in data[i:i + accumulate]:
            out = model(fw.from_numpy(x.astype(dtype)))
            loss = F.cross_entropy(out, fw.from_numpy(y)) / accumulate
            loss.backward()
        if clip is not None:
            clip(fw, model)
        if after_backward is not None:
            after_backward(fw, opt, i)
        opt.step()
        losses.append(loss.item() * accumulate)
    return losses


def changes(model, before):
    return {k: np.asarray(v, np.float64) - before[k] for k, v in _state(model).items()}


def _state(model):
    return {k: (v.detach().numpy() if hasattr(v, "detach") and not isinstance(v, np.ndarray)
                else np.asarray(v)).astype(np.float64) for k, v in model.state_dict().items()}


def judge_changes(start, t32, t64, ours, what="change"):
    """Every parameter's change from `start`: stepgraph's within the policy's bound of torch
    float64's, torch float32's error the yardstick; the float64 run must have trained it."""
    c32, c64, csg = changes(t32, start), changes(t64, start), changes(ours, start)
    for k in c64:
        assert np.abs(c64[k]).max() > 1e-4, f"{k} did not train: the test could not fail"
        assert_close_to_reference(csg[k], c64[k], c32[k], f"{what} of {k}")


def judge(make_opt, data, **loop):
    """Run the loop on the three twins; stepgraph's losses and parameter changes within the
    policy's bound of torch float64, torch float32's error the yardstick."""
    t32, t64, ours = twins()
    start = _state(t32)
    l32 = classic_loop(torch, t32, make_opt(torch, t32), data, **loop)
    l64 = classic_loop(torch, t64, make_opt(torch, t64), data, dtype=np.float64, **loop)
    lsg = classic_loop(sg, ours, make_opt(sg, ours), data, **loop)
    assert_close_to_reference(lsg, l64, l32, "losses")
    judge_changes(start, t32, t64, ours)
    return lsg


SGD = lambda fw, m: fw.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)       # noqa: E731
ADAMW = lambda fw, m: fw.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)  # noqa: E731


@pytest.mark.parametrize("make_opt", [SGD, ADAMW], ids=["sgd", "adamw"])
def test_classic_loop_trains_as_torch(make_opt):
    judge(make_opt, batches(6))


def test_gradient_accumulation_as_torch():
    """Three backward() per step(), the loss divided by three: torch's accumulated gradient."""
    judge(SGD, batches(6), accumulate=3)


def test_accumulation_equals_the_larger_batch():
    """k micro-batches of the mean loss / k give the update of the k-times batch."""
    data = batches(4)
    big = [(np.concatenate([x for x, _ in data]), np.concatenate([y for _, y in data]))]
    _, _, a = twins()
    _, _, b = twins()
    start = _state(a)
    classic_loop(sg, a, SGD(sg, a), data, accumulate=4)
    classic_loop(sg, b, SGD(sg, b), big)
    for k, v in changes(a, start).items():
        np.testing.assert_allclose(v, changes(b, start)[k], rtol=1e-5, atol=1e-7)


def test_clip_grad_norm_and_value_as_torch():
    def norm(fw, model):
        fw.nn.utils.clip_grad_norm_(model.parameters(), 0.05)

    def value(fw, model):
        fw.nn.utils.clip_grad_value_(model.parameters(), 0.01)
    judge(SGD, batches(4), clip=norm)
    judge(SGD, batches(4), clip=value)


def test_clip_grad_norm_returns_the_norm_after_the_step():
    t32, _, ours = twins()
    norms = {}
    for fw, model in ((torch, t32), (sg, ours)):
        opt = SGD(fw, model)
        x, y = batches(1)[0]
        loss = fw.nn.functional.cross_entropy(model(fw.from_numpy(x)), fw.from_numpy(y))
        loss.backward()
        norm = fw.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        if fw is sg:
            with pytest.raises(ValueNotReadyError):
                norm.item()
        opt.step()
        norms[fw] = float(norm)
    np.testing.assert_allclose(norms[sg], norms[torch], rtol=1e-5)


def test_captured_loop_equals_compile_train_step_bit_for_bit():
    """Dropout included: the captured step is compile_train_step's step (same seed, same
    sites), so losses and parameters agree to the bit."""
    data = batches(5)
    sg.manual_seed(0)
    a = net(sg, dropout=0.3)
    sg.manual_seed(0)
    b = net(sg, dropout=0.3)
    step = sg.compile_train_step(a, loss=sg.nn.functional.cross_entropy,
                                 optimizer=sg.optim.AdamW(lr=1e-2), example_inputs=data[0],
                                 on_bad_batch="ignore")
    ref = [float(step(x, y)) for x, y in data]
    got = classic_loop(sg, b, sg.optim.AdamW(b.parameters(), lr=1e-2), data)
    assert got == ref
    sa, sb = a.state_dict(), b.state_dict()
    assert all(np.array_equal(sa[k], sb[k]) for k in sa)


def counting_forward(model) -> list:
    """A list that grows by one at each call of model's forward (its class swapped for a
    subclass that counts)."""
    calls = []
    forward = type(model).forward

    class Counting(type(model)):
        def forward(self, *args):
            calls.append(1)
            return forward(self, *args)
    model.__class__ = Counting
    return calls


def test_replayed_iterations_run_no_model_python():
    """After the first iteration the model's forward is not called again: the pass replays."""
    _, _, ours = twins()
    calls = counting_forward(ours)
    classic_loop(sg, ours, SGD(sg, ours), batches(4))
    assert len(calls) == 2            # the recording, and the step's trace of its program


def test_a_changed_op_recaptures_with_a_warning():
    """A different script-level op in one iteration: a RecaptureWarning naming it, and the
    step that runs is that iteration's (checked against torch)."""
    def loop(fw, model, opt, data, dtype=np.float32):
        F = fw.nn.functional
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            loss = F.cross_entropy(model(fw.from_numpy(x.astype(dtype))), fw.from_numpy(y))
            if i == 2:
                loss = loss * 3.0
            loss.backward()
            opt.step()
    t32, t64, ours = twins()
    start = _state(t32)
    data = batches(4)
    loop(torch, t32, SGD(torch, t32), data)
    loop(torch, t64, SGD(torch, t64), data, np.float64)
    with pytest.warns(RecaptureWarning, match="scalar"):
        loop(sg, ours, SGD(sg, ours), data)
    judge_changes(start, t32, t64, ours)


def test_last_partial_batch_shares_the_optimizer_state():
    """A smaller last batch is a new program, trained by the same step (momentum goes on)."""
    data = batches(3) + batches(1, batch=3, seed=9)
    judge(SGD, data)


def test_losses_kept_in_a_list_keep_their_values():
    """Tensors held across steps are copied out before the next step overwrites them."""
    _, _, ours = twins()
    opt = SGD(sg, ours)
    kept, read = [], []
    for x, y in batches(4):
        opt.zero_grad()
        loss = sg.nn.functional.cross_entropy(ours(sg.from_numpy(x)), sg.from_numpy(y))
        loss.backward()
        opt.step()
        kept.append(loss)
        read.append(loss.item())
    assert [t.item() for t in kept] == read
    assert len(set(read)) == 4


def test_values_after_the_step_compute_eagerly():
    """Accuracy from the output after the step, as scripts compute it."""
    _, _, ours = twins()
    opt = SGD(sg, ours)
    x, y = batches(1)[0]
    out = ours(sg.from_numpy(x))
    loss = sg.nn.functional.cross_entropy(out, sg.from_numpy(y))
    loss.backward()
    opt.step()
    correct = (out.argmax(1) == sg.from_numpy(y)).sum().item()
    expected = int((np.asarray(out.numpy()).argmax(1) == y).sum())
    assert correct == expected
    assert f"{loss.item():.4f}" == f"{float(loss):.4f}"
    assert "tensor(" in repr(loss)


def test_reading_a_value_before_step_gives_the_steps_value():
    """loss.item() between backward() and step() is the loss the step computes (one more
    forward, loop/early.py; tests/unit/test_loop_early_read.py); a gradient read there still
    waits for the step and says so."""
    x, y = batches(1)[0]
    read = []
    for early in (True, False):
        _, _, ours = twins()
        opt = SGD(sg, ours)
        loss = sg.nn.functional.cross_entropy(ours(sg.from_numpy(x)), sg.from_numpy(y))
        loss.backward()
        if early:
            read.append(loss.item())
            with pytest.raises(ValueNotReadyError, match="after that"):
                ours[0].weight.grad.numpy()
        opt.step()
        read.append(loss.item())
    assert read[0] == read[1] == read[2]


def test_script_level_parameter_terms_get_gradients():
    """An L2 term over the parameters written in the script trains as torch's."""
    def l2(fw, model, opt, data, dtype=np.float32):
        F = fw.nn.functional
        for x, y in data:
            opt.zero_grad()
            loss = F.cross_entropy(model(fw.from_numpy(x.astype(dtype))), fw.from_numpy(y))
            loss = loss + 0.01 * sum((p ** 2).sum() for p in model.parameters())
            loss.backward()
            opt.step()
    t32, t64, ours = twins()
    start = _state(t32)
    data = batches(3)
    l2(torch, t32, SGD(torch, t32), data)
    l2(torch, t64, SGD(torch, t64), data, np.float64)
    l2(sg, ours, SGD(sg, ours), data)
    judge_changes(start, t32, t64, ours)


def test_eval_under_no_grad_uses_the_predictor():
    t32, _, ours = twins()
    opt = SGD(sg, ours)                     # noqa: F841 - a loop optimizer makes a session
    ours.eval()
    t32.eval()
    x, _ = batches(1)[0]
    with sg.no_grad():
        got = ours(sg.from_numpy(x))
    assert got.is_eager
    with torch.no_grad():
        want = t32(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)


def test_zero_grad_drops_an_unstepped_backward_with_a_warning():
    _, _, ours = twins()
    opt = SGD(sg, ours)
    before = _state(ours)
    x, y = batches(1)[0]
    sg.nn.functional.cross_entropy(ours(sg.from_numpy(x)), sg.from_numpy(y)).backward()
    with pytest.warns(RecaptureWarning, match="dropped 1"):
        opt.zero_grad()
    opt.step()
    assert all(np.array_equal(v, before[k]) for k, v in _state(ours).items())


def test_frozen_parameters_are_not_updated():
    _, _, ours = twins()
    opt = SGD(sg, ours)
    ours[0].weight.requires_grad_(False)
    before = _state(ours)
    classic_loop(sg, ours, opt, batches(2))
    after = _state(ours)
    assert np.array_equal(after["0.weight"], before["0.weight"])
    assert not np.array_equal(after["2.weight"], before["2.weight"])


def test_grad_scaler_skips_a_non_finite_step_and_backs_off():
    _, _, ours = twins()
    opt = SGD(sg, ours)
    scaler = sg.amp.GradScaler(init_scale=1024.0)
    data = batches(3)
    data[1] = (np.full_like(data[1][0], np.inf), data[1][1])
    states = []
    for x, y in data:
        opt.zero_grad()
        loss = sg.nn.functional.cross_entropy(ours(sg.from_numpy(x)), sg.from_numpy(y))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        states.append(_state(ours))
    assert all(np.array_equal(states[1][k], states[0][k]) for k in states[0])   # skipped
    assert not np.array_equal(states[2]["0.weight"], states[1]["0.weight"])
    assert scaler.get_scale() == 512.0


def test_autocast_bfloat16_compiles_a_bf16_step():
    _, _, ours = twins()
    opt = SGD(sg, ours)
    for x, y in batches(2):
        opt.zero_grad()
        with sg.autocast("cpu", dtype=sg.bfloat16):
            loss = sg.nn.functional.cross_entropy(ours(sg.from_numpy(x)), sg.from_numpy(y))
        loss.backward()
        opt.step()
    from stepgraph.loop.hooks import SESSION
    assert SESSION.last_step.precision == "bf16"
    with pytest.raises(sg.UnsupportedOpError, match="bfloat16"):
        sg.autocast("cuda", dtype=sg.int64)


def test_backward_without_a_loop_optimizer_names_the_alternative():
    x = sg.ones(3)
    with pytest.raises(sg.UnsupportedOpError, match="compile_train_step"):
        x.sum().backward()


def test_torch_compile_returns_the_module():
    _, _, ours = twins()
    assert sg.compile(ours, mode="max-autotune") is ours
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sg.compile(mode="reduce-overhead")(len) is len


def test_a_loop_alternating_between_bodies_compiles_each_once():
    """Every third iteration scales its loss: after one recording of each body the loop
    switches between the two programs, with no further re-capture or compile."""
    _, _, ours = twins()
    opt = SGD(sg, ours)
    F = sg.nn.functional
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, (x, y) in enumerate(batches(9)):
            opt.zero_grad()
            loss = F.cross_entropy(ours(sg.from_numpy(x)), sg.from_numpy(y))
            if i % 3 == 2:
                loss = loss * 3.0
            loss.backward()
            opt.step()
    recaptures = [w for w in caught if issubclass(w.category, RecaptureWarning)]
    assert len(recaptures) == 1
    from stepgraph.loop.hooks import SESSION
    assert len(SESSION.last_step.executables) == 2
    assert sum(len(v) for v in SESSION.programs.values()) == 2


def test_p_grad_between_backward_and_step_is_torchs_gradient():
    """p.grad asked for after backward() is kept by the step and read after it; None after
    zero_grad(), as torch's with set_to_none."""
    t32, t64, ours = twins()
    grads = {}
    for fw, model, dtype in ((torch, t32, np.float32), (torch, t64, np.float64),
                             (sg, ours, np.float32)):
        opt = SGD(fw, model)
        for x, y in batches(2):
            opt.zero_grad()
            out = model(fw.from_numpy(x.astype(dtype)))
            fw.nn.functional.cross_entropy(out, fw.from_numpy(y)).backward()
            held = {n: p.grad for n, p in model.named_parameters()}
            opt.step()
        grads[fw, dtype] = {n: np.asarray(g.numpy(), np.float64) for n, g in held.items()}
        opt.zero_grad()
        assert all(p.grad is None for p in model.parameters())
    for n in grads[sg, np.float32]:
        assert_close_to_reference(grads[sg, np.float32][n], grads[torch, np.float64][n],
                                  grads[torch, np.float32][n], f"grad of {n}")


def test_eval_of_a_forward_returning_a_tuple_is_compiled():
    """nanoGPT's estimate_loss: model(X, Y) -> (logits, loss) under no_grad in eval mode."""
    class WithLoss(sg.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net(sg)

        def forward(self, x, y=None):
            logits = self.net(x)
            loss = None if y is None else sg.nn.functional.cross_entropy(logits, y)
            return logits, loss
    model = WithLoss()
    opt = SGD(sg, model)                    # noqa: F841 - a loop optimizer makes a session
    model.eval()
    x, y = batches(1)[0]
    with sg.no_grad():
        logits, loss = model(sg.from_numpy(x), sg.from_numpy(y))
        only, none = model(sg.from_numpy(x))
    from stepgraph.loop.hooks import SESSION
    assert len(SESSION.predictors) == 2           # one per argument count
    ref = torch.nn.functional.cross_entropy(torch.from_numpy(logits.numpy()), torch.from_numpy(y))
    assert none is None and logits.shape == (8, CLASSES)
    np.testing.assert_allclose(loss.item(), ref.item(), rtol=1e-6)
    np.testing.assert_array_equal(only.numpy(), logits.numpy())


def test_resuming_from_a_torch_checkpoint_trains_as_torch(tmp_path):
    """A checkpoint torch.save'd by torch mid-training (model and AdamW state) loads with
    stepgraph's torch.load into a captured loop, which then goes on as torch does (torch
    float32 and float64 resumed from the same checkpoint are the yardstick)."""
    t32, t64, ours = twins()
    data = batches(6)
    opt32 = ADAMW(torch, t32)
    classic_loop(torch, t32, opt32, data[:3])
    torch.save({"model": t32.state_dict(), "optimizer": opt32.state_dict()}, tmp_path / "c.pt")
    saved = torch.load(tmp_path / "c.pt", weights_only=True)
    t64.load_state_dict(saved["model"])
    opt64 = ADAMW(torch, t64)
    opt64.load_state_dict(saved["optimizer"])            # torch casts the moments to float64
    start = _state(t32)
    checkpoint = sg.load(tmp_path / "c.pt")
    ours.load_state_dict(checkpoint["model"])
    opt = ADAMW(sg, ours)
    opt.load_state_dict(checkpoint["optimizer"])
    l32 = classic_loop(torch, t32, opt32, data[3:])
    l64 = classic_loop(torch, t64, opt64, data[3:], dtype=np.float64)
    lsg = classic_loop(sg, ours, opt, data[3:])
    assert_close_to_reference(lsg, l64, l32, "losses after resuming")
    judge_changes(start, t32, t64, ours, "change after resuming")


def test_clipping_applies_to_the_steps_that_ask_for_it():
    """clip_grad_norm_ in the first step only: the later steps are not clipped (torch's)."""
    def clip_first(fw, opt, i):
        if i == 0:
            fw.nn.utils.clip_grad_norm_(opt.param_groups[0]["params"], 0.01)
    judge(SGD, batches(3), after_backward=clip_first)


# ---- what the replay's fast paths must still catch ----

def pair_net(fw):
    """A model of two inputs: forward(u, v) = a(u) + b(v)."""
    class Pair(fw.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = fw.nn.Linear(D_IN, CLASSES)
            self.b = fw.nn.Linear(D_IN, CLASSES)

        def forward(self, u, v):
            return self.a(u) + self.b(v)
    return Pair()


def pair_twins():
    torch.manual_seed(0)
    t32 = pair_net(torch)
    t64 = pair_net(torch).double()
    t64.load_state_dict({k: v.double() for k, v in t32.state_dict().items()})
    ours = pair_net(sg)
    ours.load_state_dict({k: v.numpy() for k, v in t32.state_dict().items()})
    return t32, t64, ours


def test_one_tensor_for_two_arguments_then_two_tensors_recaptures():
    """Recorded as model(x, x) (one feed for both arguments), then model(x, z): the replay
    must not fill that one feed twice; it re-records, and trains as torch."""
    def loop(fw, model, opt, data, dtype=np.float32):
        F = fw.nn.functional
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            u = fw.from_numpy(x.astype(dtype))
            v = u if i < 2 else fw.from_numpy(x[::-1].astype(dtype).copy())
            F.cross_entropy(model(u, v), fw.from_numpy(y)).backward()
            opt.step()
    t32, t64, ours = pair_twins()
    start = _state(t32)
    data = batches(4)
    loop(torch, t32, SGD(torch, t32), data)
    loop(torch, t64, SGD(torch, t64), data, np.float64)
    with pytest.warns(RecaptureWarning, match="another tensor"):
        loop(sg, ours, SGD(sg, ours), data)
    judge_changes(start, t32, t64, ours)


def test_one_tensor_twice_in_a_script_op_then_two_tensors_recaptures():
    """A script-level op recorded with one eager tensor in two places (one feed), later with
    two tensors: re-recorded, the step computes with both (checked against torch)."""
    def loop(fw, model, opt, data, dtype=np.float32):
        F = fw.nn.functional
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            out = model(fw.from_numpy(x.astype(dtype)))
            m = fw.from_numpy(np.full(out.shape, 0.5, dtype))
            n = m if i < 2 else fw.from_numpy(np.full(out.shape, -2.0, dtype))
            loss = F.cross_entropy(out, fw.from_numpy(y)) + (fw.cat([out, m, n]) ** 2).mean()
            loss.backward()
            opt.step()
    t32, t64, ours = twins()
    start = _state(t32)
    data = batches(4)
    loop(torch, t32, SGD(torch, t32), data)
    loop(torch, t64, SGD(torch, t64), data, np.float64)
    with pytest.warns(RecaptureWarning, match="another tensor"):
        loop(sg, ours, SGD(sg, ours), data)
    judge_changes(start, t32, t64, ours)


def test_clipped_norms_kept_over_steps_are_each_steps_own():
    """The norms clip_grad_norm_ returned, read after later steps: each its step's (torch's)."""
    t32, _, ours = twins()
    got = {}
    for fw, model in ((torch, t32), (sg, ours)):
        opt, norms = SGD(fw, model), []
        for x, y in batches(3):
            opt.zero_grad()
            fw.nn.functional.cross_entropy(model(fw.from_numpy(x)), fw.from_numpy(y)).backward()
            norms.append(fw.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
            opt.step()
        got[fw] = [float(n) for n in norms]
    assert len(set(got[sg])) == 3
    np.testing.assert_allclose(got[sg], got[torch], rtol=1e-5)


def test_clipping_part_of_the_parameters_follows_requires_grad():
    """clip_grad_norm_ over one layer is refused while the other trains too, and accepted
    once the other is frozen (what the waiting passes train is asked again)."""
    _, _, ours = twins()
    opt = SGD(sg, ours)
    x, y = batches(1)[0]

    def iteration():
        opt.zero_grad()
        sg.nn.functional.cross_entropy(ours(sg.from_numpy(x)), sg.from_numpy(y)).backward()
        sg.nn.utils.clip_grad_norm_(ours[0].parameters(), 0.05)
        opt.step()
    with pytest.raises(sg.UnsupportedOpError, match="a part of"):
        iteration()
    with pytest.warns(RecaptureWarning, match="dropped 1"):
        opt.zero_grad()
    ours[2].requires_grad_(False)
    before = _state(ours)
    iteration()
    after = _state(ours)
    assert np.array_equal(after["2.weight"], before["2.weight"])
    assert not np.array_equal(after["0.weight"], before["0.weight"])


def test_a_submodules_mode_set_directly_records_its_own_pass():
    """model[1].training = False (no .eval() call) between iterations: the next pass is
    recorded in that mode (BatchNorm's running statistics), as torch computes it."""
    def bn_net(fw):
        return fw.nn.Sequential(fw.nn.Linear(D_IN, HIDDEN), fw.nn.BatchNorm1d(HIDDEN),
                                fw.nn.ReLU(), fw.nn.Linear(HIDDEN, CLASSES))

    def loop(fw, model, opt, data, dtype=np.float32):
        F = fw.nn.functional
        for i, (x, y) in enumerate(data):
            if i == 2:
                model[1].training = False
            opt.zero_grad()
            F.cross_entropy(model(fw.from_numpy(x.astype(dtype))), fw.from_numpy(y)).backward()
            opt.step()
    torch.manual_seed(0)
    t32 = bn_net(torch)
    t64 = bn_net(torch).double()
    t64.load_state_dict({k: v.double() for k, v in t32.state_dict().items()})
    ours = bn_net(sg)
    ours.load_state_dict({k: v.numpy() for k, v in t32.state_dict().items()})
    start = _state(t32)
    data = batches(4)
    loop(torch, t32, SGD(torch, t32), data)
    loop(torch, t64, SGD(torch, t64), data, np.float64)
    loop(sg, ours, SGD(sg, ours), data)
    judge_changes(start, t32, t64, ours)
