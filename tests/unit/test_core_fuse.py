"""Fusion passes (compile/fuse.py): each rewrite fires where it should, not where it must not,
and fused and unfused graphs of whole train steps compute the same numbers."""
from __future__ import annotations

import numpy as np
import pytest

from stepgraph import losses, models, nn, optim
from stepgraph.autodiff import append_backward
from stepgraph.compile.build import build_train_graph
from stepgraph.compile.feed import signature_of
from stepgraph.compile.fuse import (eliminate_dead_code, fuse, fuse_activation_bias_grad,
                                    fuse_conv_bias_grad, fuse_cross_entropy,
                                    fuse_linear_activation, fuse_matmul_bias_grad,
                                    fuse_conv_relu, fuse_log_softmax_nll, fuse_pool_relu,
                                    fuse_step_bookkeeping)
from stepgraph.compile.layout import to_channels_last
from stepgraph.ops.activation import ACTIVATIONS, GRAD_FROM_OUTPUT
from stepgraph.errors import ShapeError
from stepgraph.ir.trace import Tracer
from tests.ops.helpers import assert_close, run_graph, seeded
from tests.unit.compat_training import torch_state, train_steps


def ops(graph) -> list[str]:
    return [n.op for n in graph.nodes]


def linear_act_graph(kind: str, bias: bool = True, backward: bool = True):
    """x -> linear -> act -> mse(target), with its backward w.r.t. w (and b)."""
    t = Tracer()
    x, target = t.input((5, 4), "float32", "x"), t.input((5, 3), "float32", "target")
    w, b = t.input((3, 4), "float32", "w"), t.input((3,), "float32", "b")
    z = t.op("linear", [x, w] + ([b] if bias else []), act=None)
    y = t.op("act", [z], kind=kind, slope=0.2)
    loss = t.op("mse", [y, target])
    t.graph.outputs = {"loss": loss.value}
    if backward:
        wrt = [w.value] + ([b.value] if bias else [])
        grads = append_backward(t, loss.value, wrt)
        t.graph.outputs.update({f"d{i}": g for i, g in enumerate(grads)})
    return t.graph


# ---- linear + activation -------------------------------------------------------------------

@pytest.mark.parametrize("kind", ACTIVATIONS)
def test_linear_absorbs_its_activation(kind):
    graph = fuse_linear_activation(linear_act_graph(kind))
    (lin,) = [n for n in graph.nodes if n.op == "linear"]
    assert "act" not in ops(graph)
    assert lin.attrs["act"] == kind and lin.attrs["slope"] == 0.2
    # act_grad needs the pre-activation z unless the derivative comes from the output y
    assert lin.attrs["save_preact"] == (kind not in GRAD_FROM_OUTPUT)
    assert len(lin.outputs) == (2 if lin.attrs["save_preact"] else 1)


@pytest.mark.parametrize("kind", ["relu", "gelu"])
def test_forward_only_linear_activation_saves_nothing(kind):
    graph = fuse_linear_activation(linear_act_graph(kind, backward=False))
    (lin,) = [n for n in graph.nodes if n.op == "linear"]
    assert lin.attrs["act"] == kind and not lin.attrs["save_preact"]


def test_linear_read_by_two_activations_is_not_fused():
    t = Tracer()
    x, w = t.input((5, 4), "float32", "x"), t.input((3, 4), "float32", "w")
    z = t.op("linear", [x, w], act=None)
    a, b = t.op("act", [z], kind="relu", slope=0.0), t.op("act", [z], kind="tanh", slope=0.0)
    t.graph.outputs = {"a": a.value, "b": b.value}
    assert ops(fuse(t.graph)) == ["linear", "act", "act"]


def test_preactivation_that_is_a_step_output_is_kept():
    t = Tracer()
    x, w = t.input((5, 4), "float32", "x"), t.input((3, 4), "float32", "w")
    z = t.op("linear", [x, w], act=None)
    y = t.op("act", [z], kind="relu", slope=0.0)
    t.graph.outputs = {"z": z.value, "y": y.value}
    fused = fuse(t.graph)
    (lin,) = fused.nodes
    assert lin.attrs["save_preact"] and lin.outputs == [y.value, z.value]
    gen = seeded("preact")
    arrays = {"x": gen.standard_normal((5, 4), np.float32),
              "w": gen.standard_normal((3, 4), np.float32)}
    out = run_graph(fused, arrays)
    assert_close(out["z"], arrays["x"] @ arrays["w"].T)
    assert_close(out["y"], np.maximum(out["z"], 0))


# ---- backward fusions ----------------------------------------------------------------------

@pytest.mark.parametrize("bias", [True, False])
def test_activation_grad_and_bias_grad_fuse(bias):
    graph = fuse(linear_act_graph("gelu", bias=bias))
    assert ("act_bias_grad" in ops(graph)) == bias
    assert ("act_grad" in ops(graph)) != bias
    if bias:   # the bias gradient comes from the fused node, not a separate reduction
        assert "reduce_sum" not in ops(graph)


def cross_entropy_graph(seed_value: float = 1.0):
    """cross_entropy on inputs with its backward seeded by `seed_value` (1 is what autodiff
    emits; anything else must block the fused kernel, which assumes dloss = 1)."""
    t = Tracer()
    x, y = t.input((6, 5), "float32", "x"), t.input((6,), "int64", "y")
    loss, lse = t.emit("cross_entropy", [x.value, y.value])
    seed = t.emit("fill", [], value=seed_value, shape=(), dtype="float32")[0]
    (dx,) = t.emit("cross_entropy_grad", [seed, x.value, lse, y.value])
    t.graph.outputs = {"loss": loss, "dx": dx}
    return t.graph


def test_cross_entropy_forward_and_backward_fuse():
    assert ops(fuse(cross_entropy_graph())) == ["cross_entropy_train"]


def test_cross_entropy_with_a_non_unit_seed_is_not_fused():
    graph = fuse(cross_entropy_graph(2.0))
    assert "cross_entropy_train" not in ops(graph)
    gen = seeded("ce2")
    arrays = {"x": gen.standard_normal((6, 5), np.float32), "y": gen.integers(0, 5, 6)}
    assert_close(run_graph(graph, arrays)["dx"],
                 2 * run_graph(fuse(cross_entropy_graph(1.0)), arrays)["dx"])


def log_softmax_nll_graph(expose_log_probs: bool):
    t = Tracer()
    x, y = t.input((6, 5), "float32", "x"), t.input((6,), "int64", "y")
    logp = t.op("log_softmax", [x])
    loss = losses.nll_loss(logp, y)
    (dx,) = append_backward(t, loss.value, [x.value])
    t.graph.outputs = {"loss": loss.value, "dx": dx}
    if expose_log_probs:
        t.graph.outputs["logp"] = logp.value
    return t.graph


@pytest.mark.parametrize("expose", [False, True], ids=["fused", "log-probs-read"])
def test_log_softmax_nll_becomes_cross_entropy_unless_log_probs_are_read(expose):
    graph = fuse(log_softmax_nll_graph(expose))
    if expose:
        assert "cross_entropy_train" not in ops(graph) and "log_softmax" in ops(graph)
    else:
        assert ops(graph) == ["cross_entropy_train"]
    gen = seeded(f"lsnll{expose}")
    arrays = {"x": 3 * gen.standard_normal((6, 5), np.float32), "y": gen.integers(0, 5, 6)}
    got, want = run_graph(graph, arrays), run_graph(log_softmax_nll_graph(expose), arrays)
    for k in want:
        assert_close(got[k], want[k], what=k)


# ---- dead code and purity ------------------------------------------------------------------

def test_dead_code_is_removed_but_state_updates_stay():
    t = Tracer()
    x = t.input((3,), "float32", "x")
    step = t.state((), "int64", "optimizer.step")
    t.op("act", [x], kind="tanh", slope=0.0)                  # nobody reads it
    live = t.op("act", [x], kind="relu", slope=0.0)
    t.emit("step_increment", [step])                          # no outputs, but mutates
    t.graph.outputs = {"y": live.value}
    assert ops(eliminate_dead_code(t.graph)) == ["act", "step_increment"]
    assert eliminate_dead_code(t.graph).nodes[0].attrs["kind"] == "relu"


PASSES = [fuse_linear_activation, fuse_pool_relu, fuse_conv_relu, fuse_activation_bias_grad,
          fuse_conv_bias_grad,
          fuse_matmul_bias_grad, fuse_cross_entropy, fuse_log_softmax_nll, fuse_step_bookkeeping, eliminate_dead_code,
          fuse]


@pytest.mark.parametrize("fusion", PASSES, ids=lambda p: p.__name__)
def test_passes_leave_their_input_graph_unchanged(fusion):
    """A pass returns a new graph: the one it was given still computes what it did."""
    for graph in (linear_act_graph("gelu"), log_softmax_nll_graph(False), cross_entropy_graph(),
                  conv_graph(True), conv_graph(True, relu=True)):
        before = str(graph)
        nodes = [(n.op, list(n.inputs), list(n.outputs), dict(n.attrs)) for n in graph.nodes]
        fusion(graph)
        assert str(graph) == before
        assert nodes == [(n.op, n.inputs, n.outputs, n.attrs) for n in graph.nodes]


def pool_relu_graph(relu_read_twice: bool = False):
    """x -> maxpool2d -> relu -> mse(target), with the backward w.r.t. x (a stand-in param)."""
    t = Tracer()
    x = t.input((2, 3, 6, 6), "float32", "x")
    target = t.input((2, 3, 3, 3), "float32", "target")
    y = t.op_all("maxpool2d", [x], kernel=(2, 2), stride=(2, 2))[0]
    r = t.op("act", [y], kind="relu", slope=0.01)
    loss = t.op("mse", [r, target])
    t.graph.outputs = {"loss": loss.value}
    if relu_read_twice:
        t.graph.outputs["pooled"] = y.value
    (dx,) = append_backward(t, loss.value, [x.value])
    t.graph.outputs["dx"] = dx
    return t.graph


def test_pool_relu_fuse_forward_and_backward():
    fused = fuse_pool_relu(pool_relu_graph())
    assert "act" not in ops(fused) and "act_grad" not in ops(fused)
    pool = next(n for n in fused.nodes if n.op == "maxpool2d")
    grad = next(n for n in fused.nodes if n.op == "maxpool2d_grad")
    assert pool.attrs["relu"] and grad.attrs["relu"] and grad.inputs[2] is pool.outputs[0]
    gen = seeded("pool_relu")
    arrays = {"x": gen.standard_normal((2, 3, 6, 6)).astype(np.float32),
              "target": gen.standard_normal((2, 3, 3, 3)).astype(np.float32)}
    want, got = run_graph(pool_relu_graph(), arrays, {}), run_graph(fused, arrays, {})
    for k in ("loss", "dx"):
        assert_close(got[k], want[k], what=k)


def conv_graph(bias: bool, layout: str = "NCHW", relu: bool = False, keep_z: bool = False):
    """x -> conv2d [-> relu] -> mse(target), with the backward w.r.t. w (and b); with layout
    "NHWC" the forward is first rewritten channels-last (compile/layout.py), as a step's would
    be; keep_z: the convolution's output is a graph output too."""
    t = Tracer()
    x, target = t.input((2, 3, 7, 6), "float32", "x"), t.input((2, 4, 5, 4), "float32", "target")
    w, b = t.input((4, 3, 3, 3), "float32", "w"), t.input((4,), "float32", "b")
    z = y = t.op("conv2d", [x, w] + ([b] if bias else []), stride=(1, 1), padding=(0, 0))
    if relu:
        y = t.op("act", [z], kind="relu", slope=0.01)
    loss = t.op("mse", [y, target])
    t.graph.outputs = {"loss": loss.value, **({"z": z.value} if keep_z else {})}
    if layout == "NHWC":
        t.graph = to_channels_last(t.graph)[0]
    grads = append_backward(t, loss.value, [w.value] + ([b.value] if bias else []))
    t.graph.outputs.update({f"d{i}": g for i, g in enumerate(grads)})
    return t.graph


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("bias", [True, False])
def test_conv_relu_fuses_into_the_convolution(bias, layout):
    graph = conv_graph(bias, layout, relu=True)
    fused = eliminate_dead_code(fuse_conv_relu(graph))
    (conv,) = [n for n in fused.nodes if n.op == "conv2d"]
    assert "act" not in ops(fused) and conv.attrs["act"] == "relu"
    assert "act_grad" in ops(fused)                  # the backward's mask reads the conv's y
    gen = seeded(f"conv_relu {bias} {layout}")
    arrays = {"x": gen.standard_normal((2, 3, 7, 6)).astype(np.float32),
              "target": gen.standard_normal((2, 4, 5, 4)).astype(np.float32),
              "w": gen.standard_normal((4, 3, 3, 3)).astype(np.float32),
              "b": gen.standard_normal(4).astype(np.float32)}
    want, got = run_graph(graph, arrays, {}), run_graph(fused, arrays, {})
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_conv_relu_stays_apart_where_the_convolution_is_read_elsewhere():
    fused = fuse_conv_relu(conv_graph(True, relu=True, keep_z=True))
    assert "act" in ops(fused)
    assert all(n.attrs.get("act", "none") == "none" for n in fused.nodes if n.op == "conv2d")


def test_conv_relu_stays_apart_where_elementwise_code_reads_the_relu():
    """conv -> relu -> scale: the ReLU joins the scale's program instead."""
    t = Tracer()
    x, w = t.input((1, 2, 5, 5), "float32", "x"), t.input((3, 2, 3, 3), "float32", "w")
    y = t.op("act", [t.op("conv2d", [x, w], stride=(1, 1), padding=(0, 0))], kind="relu",
             slope=0.01)
    t.graph.outputs = {"y": t.op("scalar", [y], kind="mul", value=2.0).value}
    assert "act" in ops(fuse_conv_relu(t.graph))


def test_a_conv_with_another_fused_activation_is_refused():
    t = Tracer()
    x, w = t.input((1, 2, 4, 4), "float32", "x"), t.input((3, 2, 3, 3), "float32", "w")
    with pytest.raises(ShapeError, match="fused activation must be 'relu'"):
        t.op("conv2d", [x, w], stride=(1, 1), padding=(0, 0), act="gelu")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_squeezenet_trains_bit_for_bit_with_its_relus_fused(monkeypatch, precision):
    """tests/compat/models/squeezenet.py (every convolution followed by an in-place ReLU):
    each ReLU runs in its convolution, and three steps on NumPy reach the same losses and
    parameters, bit for bit, as with the pass off."""
    import stepgraph
    import stepgraph.compile.fuse as fuse_module

    kw = dict(version="1_1", num_classes=10, dropout=0.0)
    state = torch_state("squeezenet", "SqueezeNet", kw)
    rng = np.random.default_rng(0)
    batches = [(rng.standard_normal((2, 3, 32, 32)).astype(np.float32),
                rng.integers(0, 10, 2)) for _ in range(3)]

    def train(passes):
        monkeypatch.setattr(fuse_module.fuse, "__defaults__", (passes,))
        plan, losses, params = train_steps("squeezenet", "SqueezeNet", kw, state, batches,
                                           stepgraph.nn.functional.cross_entropy,
                                           precision=precision)
        fused = sum(n.op == "conv2d" and n.attrs.get("act") == "relu" for n in plan.steps)
        return fused, losses, params

    without = tuple(p for p in fuse_module.PASSES if p is not fuse_conv_relu)
    (fused, losses, params), (none, want_losses, want) = train(fuse_module.PASSES), train(without)
    assert fused == 26 and none == 0
    assert losses == want_losses
    for k in want:
        np.testing.assert_array_equal(params[k], want[k], err_msg=k)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("bias", [True, False])
def test_conv_bias_grad_joins_the_weight_grad(bias, layout):
    fused = fuse_conv_bias_grad(conv_graph(bias, layout))
    (grad,) = [n for n in fused.nodes if n.op == "conv2d_grad_weight"]
    assert "reduce_sum" not in ops(fused)
    assert bool(grad.attrs.get("bias")) == bias and len(grad.outputs) == 1 + bias
    assert grad.attrs.get("layout", "NCHW") == layout
    gen = seeded("conv_bias")
    arrays = {"x": gen.standard_normal((2, 3, 7, 6)).astype(np.float32),
              "target": gen.standard_normal((2, 4, 5, 4)).astype(np.float32),
              "w": gen.standard_normal((4, 3, 3, 3)).astype(np.float32),
              "b": gen.standard_normal(4).astype(np.float32)}
    want, got = run_graph(conv_graph(bias, layout), arrays, {}), run_graph(fused, arrays, {})
    for k in want:
        assert_close(got[k], want[k], what=k)


def linear_graph(bias: bool, sum_axis: int = 0):
    """x -> linear -> mse(target), with the backward w.r.t. w (and b): matmul(dz, x, trans_a)
    and reduce_sum(dz, axes=(0,)) read the same dz; sum_axis 1 adds a near miss, a row sum
    of dz (another reader, another axis) that no rewrite may take."""
    t = Tracer()
    x, target = t.input((9, 4), "float32", "x"), t.input((9, 3), "float32", "target")
    w, b = t.input((3, 4), "float32", "w"), t.input((3,), "float32", "b")
    z = t.op("linear", [x, w] + ([b] if bias else []), act=None)
    loss = t.op("mse", [z, target])
    t.graph.outputs = {"loss": loss.value}
    grads = append_backward(t, loss.value, [w.value] + ([b.value] if bias else []))
    t.graph.outputs.update({f"d{i}": g for i, g in enumerate(grads)})
    if sum_axis == 1:
        (dw,) = [n for n in t.graph.nodes if n.op == "matmul" and n.attrs.get("trans_a")]
        t.graph.outputs["rows"] = t.emit("reduce_sum", [dw.inputs[0]], axes=(1,))[0]
    return t.graph


@pytest.mark.parametrize("bias", [True, False])
def test_linear_bias_grad_joins_the_weight_grad(bias):
    """dw = dz^T @ x and db = dz.sum(0) become one matmul node with two outputs; the numbers
    are the unfused graph's, bit for bit (the numpy sum is the reduce_sum's)."""
    fused = fuse_matmul_bias_grad(linear_graph(bias))
    (grad,) = [n for n in fused.nodes if n.op == "matmul" and n.attrs.get("trans_a")]
    assert ("reduce_sum" in ops(fused)) is False
    assert bool(grad.attrs.get("bias_grad")) == bias and len(grad.outputs) == 1 + bias
    gen = seeded("linear_bias")
    arrays = {"x": gen.standard_normal((9, 4)).astype(np.float32),
              "target": gen.standard_normal((9, 3)).astype(np.float32),
              "w": gen.standard_normal((3, 4)).astype(np.float32),
              "b": gen.standard_normal(3).astype(np.float32)}
    want, got = run_graph(linear_graph(bias), arrays, {}), run_graph(fused, arrays, {})
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_a_row_sum_of_the_same_gradient_is_not_a_bias_grad():
    """Beside the bias gradient, a sum of dz over its other axis stays a reduce_sum."""
    fused = fuse_matmul_bias_grad(linear_graph(True, sum_axis=1))
    (left,) = [n for n in fused.nodes if n.op == "reduce_sum"]
    assert left.attrs["axes"] == (1,)
    assert [n.attrs.get("bias_grad") for n in fused.nodes if n.op == "matmul"
            and n.attrs.get("trans_a")] == [True]


def test_a_sum_before_the_weight_grad_is_left_alone():
    """A reduce_sum scheduled before the weight-gradient matmul keeps its place: joining it to
    the later matmul would write db after a reader could have read it."""
    graph = linear_graph(True)
    nodes = list(graph.nodes)
    (dw,) = [n for n in nodes if n.op == "matmul" and n.attrs.get("trans_a")]
    (db,) = [n for n in nodes if n.op == "reduce_sum"]
    nodes.remove(db)
    nodes.insert(nodes.index(dw), db)
    graph.nodes = nodes
    fused = fuse_matmul_bias_grad(graph)
    assert "reduce_sum" in ops(fused)
    assert not any(n.attrs.get("bias_grad") for n in fused.nodes if n.op == "matmul")


def test_step_bookkeeping_becomes_one_op():
    model = models.mlp(in_features=6, hidden=8, dropout=0.0)
    x, y = np.zeros((4, 6), np.float32), np.zeros(4, np.int64)
    graph = build_train_graph(model, losses.cross_entropy, optim.SGD(lr=0.1),
                              signature_of(("x", "y"), (x, y)), seed=0)
    fused = fuse_step_bookkeeping(graph)
    for op in ("step_increment", "lr_schedule", "record_loss"):
        assert op in ops(graph) and op not in ops(fused)
    assert ops(fused).count("advance_step") == 1
    assert ops(fused).index("advance_step") < ops(fused).index("sgd_update")


def test_pool_output_read_elsewhere_is_not_fused():
    assert "act" in ops(fuse_pool_relu(pool_relu_graph(relu_read_twice=True)))


# ---- fused and unfused train steps agree ---------------------------------------------------

def mixed_model():
    return nn.Sequential(nn.Linear(12, 16), nn.LeakyReLU(0.2), nn.Linear(16, 16), nn.GELU(),
                         nn.Linear(16, 16, bias=False), nn.Tanh(), nn.Linear(16, 8),
                         nn.GELU("tanh"), nn.Linear(8, 4), nn.Sigmoid(), nn.Linear(4, 5),
                         nn.LogSoftmax(dim=1))


STEP_MODELS = {   # model factory, loss, input shape
    "mlp": (lambda: models.mlp(hidden=32, dropout=0.2), losses.cross_entropy, (784,)),
    "cnn": (lambda: models.cnn(dropout=0.3), losses.nll_loss, (1, 28, 28)),
    "mixed": (mixed_model, losses.nll_loss, (12,)),
}


def run_one_step(graph, params: dict, optimizer, arrays) -> tuple[float, dict]:
    bound = {k: v.copy() for k, v in params.items()}
    for v in graph.state:
        bound[v.name] = np.array(optimizer.initial_state(v), dtype=v.dtype)
    loss = run_graph(graph, arrays, bound)["loss"]
    return float(loss), {k: bound[k] for k in params}


@pytest.mark.parametrize("name", STEP_MODELS)
def test_fused_and_unfused_train_steps_compute_the_same(name):
    make_model, loss_fn, shape = STEP_MODELS[name]
    model, opt = make_model(), optim.Adam(lr=1e-2)
    gen = seeded(name)
    arrays = {"x": gen.standard_normal((8, *shape)).astype(np.float32),
              "y": gen.integers(0, 5, 8)}
    signature = signature_of(("x", "y"), (arrays["x"], arrays["y"]))
    unfused = build_train_graph(model, loss_fn, opt, signature, seed=3)
    fused = fuse(build_train_graph(model, loss_fn, opt, signature, seed=3))
    assert len(fused.nodes) < len(unfused.nodes)
    params = {k: v.numpy() for k, v in model.state_dict().items()}
    loss_u, params_u = run_one_step(unfused, params, opt, arrays)
    loss_f, params_f = run_one_step(fused, params, opt, arrays)
    assert_close(loss_f, loss_u, what="loss")
    for k in params:
        assert not np.array_equal(params_u[k], params[k]), f"{k} was not updated"
        assert_close(params_f[k], params_u[k], what=k)
