"""Guards on the numpy backend (compile/guard.py): a batch with labels out of range or a NaN or
Inf loss or gradient never changes the model. "raise": the update is not applied, the next
call (or loss read) raises LabelError / NonFiniteError naming the step; "skip": skipped and
counted, and the run equals the run without that batch; "ignore": today's behaviour."""
from __future__ import annotations

import numpy as np
import pytest

import stepgraph as sg
from stepgraph import losses, nn, optim
from stepgraph.compile.guard import bad_step_error
from stepgraph.errors import BackendUnavailableError, LabelError, NonFiniteError, ShapeError
from stepgraph.ir.graph import Node
from stepgraph.ops import guard as ops_guard

BATCH, FEATURES, CLASSES = 8, 6, 4
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def make_step(on_bad_batch="raise", opt=None, dropout=0.3, loss=losses.cross_entropy):
    nn.manual_seed(0)
    layers = [nn.Linear(FEATURES, 16), nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, CLASSES)]
    if loss is losses.nll_loss:
        layers.append(nn.LogSoftmax(dim=1))
    opt = opt or optim.AdamW(lr=0.01)
    return sg.compile_train_step(nn.Sequential(*layers), loss, opt, example_inputs=batch(0),
                                 on_bad_batch=on_bad_batch)


def batch(i: int, size: int = BATCH):
    gen = np.random.default_rng(i)
    return gen.standard_normal((size, FEATURES)).astype(np.float32), gen.integers(0, CLASSES, size)


def poisoned(i: int, kind: str):
    """Batch i made bad: a NaN or an Inf in the input, or labels out of range."""
    x, y = batch(i)
    x, y = x.copy(), y.copy()
    if kind == "nan":
        x[2, 3] = np.nan
    elif kind == "inf":
        x[5, 0] = np.inf
    elif kind == "label-high":
        y[1] = CLASSES
    elif kind == "label-negative":
        y[6] = -1
    return x, y


def snapshot(step) -> dict[str, np.ndarray]:
    return {k: v.copy() for k, v in step.state_dict().items()}


def assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k


def inf_gradient_step(on_bad_batch, precision="fp32"):
    """mse on Linear(2, 1): one sample's input of 1e20 gives a finite loss (~2.5e37) and an
    infinite weight gradient (5e18 * 1e20 overflows float32, and bf16 alike)."""
    model = nn.Sequential(nn.Linear(2, 1))
    model.load_state_dict({"0.weight": np.array([[0.1, 0.2]], np.float32),
                           "0.bias": np.zeros(1, np.float32)})
    x = np.array([[1.0, 2.0], [0.5, -1.0], [2.0, 0.0], [-1.0, 1.0]], np.float32)
    t = np.zeros((4, 1), np.float32)
    step = sg.compile_train_step(model, losses.mse, optim.SGD(lr=0.01, momentum=0.9), (x, t),
                                 on_bad_batch=on_bad_batch, precision=precision)
    bad = x.copy()
    bad[0, 0] = 1e20
    return step, (x, t), (bad, t)


# ---- raise ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["nan", "inf"])
def test_raise_keeps_state_and_the_next_call_raises(kind):
    step = make_step("raise")
    step(*batch(1))
    before = snapshot(step)
    loss = step(*poisoned(2, kind))            # returns: the guard works without a sync
    assert_same(before, snapshot(step))        # params, optimizer state, step counter
    assert int(before["optimizer.step"]) == 1
    with pytest.raises(NonFiniteError, match="step 2: .*non-finite") as info:
        step(*batch(3))                        # the documented point: the next call
    assert info.value.step == 2 and loss.step == 2
    assert_same(before, snapshot(step))        # the raising call did not run either
    # reported once: training goes on exactly as if the bad batch had never been fed
    ref = make_step("raise")
    ref(*batch(1))
    for i in (3, 4):
        assert float(ref(*batch(i))) == float(step(*batch(i)))
    assert_same(snapshot(ref), snapshot(step))


def test_raise_on_reading_the_bad_loss():
    step = make_step("raise")
    loss = step(*poisoned(1, "nan"))
    with pytest.raises(NonFiniteError, match="step 1"):
        float(loss)
    assert int(step.state_dict()["optimizer.step"]) == 0
    assert np.isfinite(float(step(*batch(2))))   # reported: no longer pending


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_inf_gradient_with_a_finite_loss_is_caught(precision):
    """bf16: the guard reads the weight's bf16 gradient itself (fuse_gradient_casts)."""
    step, good, bad = inf_gradient_step("raise", precision)
    step(*good)
    before = snapshot(step)
    loss = step(*bad)
    assert np.isfinite(loss._slot(loss._loss)[0])    # the loss itself is finite
    with pytest.raises(NonFiniteError, match="non-finite gradients") as info:
        step(*good)
    assert "non-finite loss" not in str(info.value)
    assert_same(before, snapshot(step))


def test_raise_holds_every_later_step_until_reported():
    """Where the host cannot see the device without a sync (the CUDA mailbox not yet
    written), later calls run but change nothing; the next loss read reports them."""
    step = make_step("raise")
    step(*batch(1))
    before = snapshot(step)
    step._guard.mirror = None                  # the host sees the device only by syncing
    step(*poisoned(2, "inf"))
    handles = [step(*batch(i)) for i in (3, 4, 5)]
    assert_same(before, snapshot(step))
    assert [h.step for h in handles] == [3, 4, 5] and all(h.skipped for h in handles)
    assert handles[0].problem == "an earlier bad step was not yet reported"
    with pytest.raises(NonFiniteError, match=r"step 2: .* nor those of the 3 step\(s\)"):
        float(handles[-1])
    assert step.skipped_steps == 4
    assert np.isfinite(float(step(*batch(6))))
    assert int(step.state_dict()["optimizer.step"]) == 2


def test_device_label_check_raises_label_error():
    """Labels the host cannot see (on the GPU) are checked by the guard: here the host
    pre-check is switched off to stand for that."""
    step = make_step("raise", loss=losses.nll_loss)
    step._check_values = lambda arrays: None
    step(*batch(1))
    before = snapshot(step)
    step(*poisoned(2, "label-negative"))
    assert_same(before, snapshot(step))
    with pytest.raises(LabelError, match=rf"step 2: .*labels outside \[0, {CLASSES}\)") as info:
        step(*batch(3))
    assert info.value.step == 2


def test_host_labels_raise_before_the_call_runs():
    step = make_step("raise")
    before = snapshot(step)
    with pytest.raises(LabelError, match="'y'") as info:
        step(*poisoned(1, "label-high"))
    assert info.value.step is None
    assert_same(before, snapshot(step))


# ---- skip ----------------------------------------------------------------------------------

OPTIMIZERS = {"adamw": lambda: optim.AdamW(lr=0.01),
              "sgd": lambda: optim.SGD(lr=0.05, momentum=0.9, nesterov=True),
              "adam-clipped": lambda: optim.Adam(lr=0.01, max_grad_norm=0.5)}


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_skip_equals_the_run_without_the_bad_batches(opt):
    """Dropout masks and Adam's bias corrections follow the step counter, which a skipped
    batch does not move: the two runs agree bit for bit."""
    make_opt = OPTIMIZERS[opt]
    bad = {3: "nan", 5: "label-high", 6: "inf", 9: "label-negative"}
    skipping, clean = make_step("skip", make_opt()), make_step("skip", make_opt())
    got, want = [], []
    for i in range(1, 12):
        if i in bad:
            loss = skipping(*poisoned(i, bad[i]))
            assert loss.skipped and loss.problem
            continue
        got.append(float(skipping(*batch(i))))
        want.append(float(clean(*batch(i))))
    assert got == want
    assert skipping.skipped_steps == len(bad) and clean.skipped_steps == 0
    assert_same(snapshot(skipping), snapshot(clean))


def test_batch_norm_running_statistics_are_put_back():
    """BatchNorm updates its running statistics in the forward pass, before the guard knows:
    guard_save copies them first and guard_restore puts them back on a skipped step."""
    def bn_step():
        nn.manual_seed(0)
        model = nn.Sequential(nn.Linear(FEATURES, 8), nn.BatchNorm1d(8), nn.ReLU(),
                              nn.Dropout(0.2), nn.Linear(8, CLASSES))
        return sg.compile_train_step(model, losses.cross_entropy,
                                     optim.SGD(lr=0.1, momentum=0.9), batch(0),
                                     on_bad_batch="skip")

    skipping, clean = bn_step(), bn_step()
    ops = [n.op for n in skipping.executable(skipping.signature).plan.graph.nodes]
    assert ops[0] == "guard_save" and ops.index("guard_restore") > ops.index("guard_advance")
    for i in range(1, 9):
        if i in (3, 6):
            before = snapshot(skipping)
            assert skipping(*poisoned(i, "nan")).skipped
            assert_same(before, snapshot(skipping))      # running_mean/var, num_batches too
            continue
        assert float(skipping(*batch(i))) == float(clean(*batch(i)))
    state = snapshot(skipping)
    assert int(state["1.num_batches_tracked"]) == 6
    assert_same(state, snapshot(clean))


def test_skip_counts_an_inf_gradient_and_reads_the_loss():
    step, good, bad = inf_gradient_step("skip")
    step(*good)
    before = snapshot(step)
    loss = step(*bad)
    assert np.isfinite(float(loss)) and loss.skipped     # reading never raises under "skip"
    assert loss.problem.startswith("non-finite gradients (NaN or Inf")
    assert_same(before, snapshot(step))
    assert step.skipped_steps == 1
    assert not step(*good).skipped


# ---- ignore --------------------------------------------------------------------------------

def test_ignore_is_todays_behaviour():
    step = make_step("ignore", dropout=0.0)
    loss = step(*poisoned(1, "nan"))
    assert np.isnan(float(loss)) and not loss.skipped and loss.problem is None
    assert np.isnan(step.state_dict()["0.weight"]).any()
    assert step.skipped_steps == 0
    graph = step.executable(step.signature).plan.graph
    assert not any(n.op.startswith("guard") for n in graph.nodes)
    assert any(n.op == "advance_step" for n in graph.nodes)   # the fused bookkeeping


def test_guarded_graph_shape():
    step = make_step("raise")
    ops = [n.op for n in step.executable(step.signature).plan.graph.nodes]
    check, advance, update = (ops.index(o) for o in ("guard_check", "guard_advance",
                                                     "adam_update"))
    assert check < advance < update and ops.count("guard_check") == 1
    assert "advance_step" not in ops and "step_increment" not in ops
    check = next(n for n in step.executable(step.signature).plan.graph.nodes
                 if n.op == "guard_check")
    assert check.attrs == {"classes": CLASSES, "ignore_index": -100}   # PyTorch's default
    assert not any(k.startswith("guard.") for k in step.state_dict())


def test_policy_is_checked_and_part_of_the_compile_cache_key():
    with pytest.raises(ValueError, match="on_bad_batch"):
        make_step("warn")
    nn.manual_seed(0)
    model, opt = nn.Sequential(nn.Linear(FEATURES, CLASSES)), optim.SGD(lr=0.1)
    a = sg.compile_train_step(model, losses.cross_entropy, opt, batch(0))
    b = sg.compile_train_step(model, losses.cross_entropy, opt, batch(0), on_bad_batch="skip")
    assert a is not b and a.on_bad_batch == "raise" and b.on_bad_batch == "skip"


# ---- the ops themselves --------------------------------------------------------------------

def _run_check(loss, labels, grads, classes=CLASSES, ignore_index=None):
    flags = np.zeros(2, np.int32)
    ins = [flags, np.asarray(loss, np.float32)] + ([labels] if labels is not None else []) + grads
    node = Node("guard_check", [], [], {"classes": classes if labels is not None else None,
                                        "ignore_index": ignore_index})
    ops_guard._guard_check_impl(node, ins, [], None)
    return int(flags[0])


def test_guard_check_bits():
    g = [np.ones((3, 2), np.float32), np.zeros(4, np.float32)]
    y = np.array([0, 3, 1])
    assert _run_check(1.0, y, g) == 0
    assert _run_check(np.nan, y, g) == ops_guard.GUARD_LOSS
    assert _run_check(1.0, np.array([0, 4]), g) == ops_guard.GUARD_LABELS
    assert _run_check(1.0, np.array([-1, 0], np.int32), g) == ops_guard.GUARD_LABELS
    bad = [g[0], np.array([0, -np.inf, 0, 0], np.float32)]
    assert _run_check(np.inf, None, bad) == ops_guard.GUARD_LOSS | ops_guard.GUARD_GRADS
    assert _run_check(1.0, np.zeros(0, np.int64), g) == 0
    assert _run_check(1.0, np.array([0, -100, 3]), g, ignore_index=-100) == 0   # skipped rows
    assert _run_check(1.0, np.array([0, -100, 4]), g, ignore_index=-100) == ops_guard.GUARD_LABELS
    assert _run_check(1.0, np.array([-100]), g) == ops_guard.GUARD_LABELS


def test_error_types_and_messages():
    err = bad_step_error(7, ops_guard.GUARD_LABELS | ops_guard.GUARD_LOSS, classes=10)
    assert isinstance(err, LabelError) and err.step == 7
    assert "labels outside [0, 10)" in str(err) and "non-finite loss" in str(err)
    err = bad_step_error(3, ops_guard.GUARD_GRADS, held=2)
    assert isinstance(err, NonFiniteError) and isinstance(err, ArithmeticError)
    assert "2 step(s) after it" in str(err)


# ---- the loss handle -----------------------------------------------------------------------

def test_loss_handle_is_a_value():
    step = make_step("raise")
    loss = step(*batch(1))
    value = float(loss)
    assert loss.item() == value and f"{loss:.3f}" == f"{value:.3f}"
    arr = np.asarray(loss)
    assert arr.shape == () and arr.dtype == np.float32 and float(arr) == value
    assert np.asarray(loss, dtype=np.float64).dtype == np.float64
    host = sg.to_numpy(loss)
    assert isinstance(host, np.ndarray) and host.shape == () and float(host) == value
    assert loss.numpy().dtype == np.float32
    assert "step=1" in repr(loss) and not loss.skipped and loss.problem is None


def test_repr_does_not_consume_a_pending_error():
    step = make_step("raise")
    loss = step(*poisoned(1, "nan"))
    assert "nan" in repr(loss)
    with pytest.raises(NonFiniteError):
        loss.item()


def test_empty_batch_message_does_not_contradict_itself():
    step = make_step("raise")
    x, y = batch(1)
    with pytest.raises(ShapeError) as info:
        step(x[:0], y[:0])
    message = str(info.value)
    assert "empty batch" in message and "does not match" not in message


def test_profile_needs_cuda():
    step = make_step("raise")
    with pytest.raises(BackendUnavailableError, match="device='cuda'"):
        step.profile(*batch(1))


# ---- optimizer state that would overflow, parameters that are not finite --------------------

def huge_batch_step(on_bad_batch):
    """Adam on Linear(2, 1) with mse against targets of 1e19: the loss (~1e38) and the
    gradients (~2e19) are finite, but the gradients' squares overflow float32, so Adam's
    exp_avg_sq would hold Inf and those weights would never move again."""
    model = nn.Sequential(nn.Linear(2, 1))
    model.load_state_dict({"0.weight": np.array([[0.1, 0.2]], np.float32),
                           "0.bias": np.zeros(1, np.float32)})
    x = np.array([[1.0, 2.0], [0.5, -1.0]], np.float32)
    t = np.zeros((2, 1), np.float32)
    step = sg.compile_train_step(model, losses.mse, optim.Adam(lr=0.01), (x, t),
                                 on_bad_batch=on_bad_batch)
    return step, (x, t), (x, np.full_like(t, 1e19))


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_gradients_whose_square_overflows_are_a_bad_step(policy):
    step, good, bad = huge_batch_step(policy)
    step(*good)
    before = snapshot(step)
    loss = step(*bad)
    if policy == "skip":
        assert np.isfinite(float(loss))      # only the squares overflow
    if policy == "raise":
        with pytest.raises(NonFiniteError, match="square.*overflows"):
            step(*good)
    else:
        assert step.skipped_steps == 1
    assert_same(snapshot(step), before)
    step(*good)                  # training goes on: the weights still move
    after = snapshot(step)
    assert all(np.isfinite(v).all() for v in after.values())
    assert not np.array_equal(after["0.weight"], before["0.weight"])


def test_guard_check_flags_a_finite_gradient_whose_square_overflows():
    g = [np.array([1.0, 1e19], np.float32)]
    assert _run_check(1.0, None, g) == 0
    g = [np.array([1.0, -2e19], np.float32)]
    assert _run_check(1.0, None, g) == ops_guard.GUARD_GRADS
    assert _run_check(1.0, None, [g[0].astype(np.float64)]) == 0   # float64 holds 4e38


def test_non_finite_parameters_are_blamed_not_the_batch():
    step = make_step("raise", dropout=0.0)
    sd = snapshot(step)
    sd["0.weight"] = sd["0.weight"].copy()
    sd["0.weight"][0, 0] = np.nan
    step.load_state_dict(sd)
    step(*batch(1))
    with pytest.raises(NonFiniteError, match=r"parameters hold NaN or Inf \(0\.weight;"):
        step(*batch(2))
