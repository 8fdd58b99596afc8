"""fuse_batch_norm_relu, fuse_batch_norm_residual and fuse_batch_norm_grad_sum
(compile/fuse.py): BatchNorm then ReLU (or then the residual add and ReLU) becomes one forward
node (and, for the ReLU alone, one backward node), and a gradient sum joins the BatchNorm
gradient that reads it, where each value's only reader is the next, nowhere else; fused graphs
compute what unfused ones do."""
from __future__ import annotations

import numpy as np
import pytest

from stepgraph.autodiff import append_backward
from stepgraph.compile.fuse import PASSES, fuse, fuse_batch_norm_grad_sum, \
    fuse_batch_norm_relu, fuse_batch_norm_residual
from stepgraph.ir.trace import Tracer
from tests.ops.helpers import assert_close, run_graph, seeded

SHAPE = (4, 3, 5, 2)


def ops(graph) -> list[str]:
    return [n.op for n in graph.nodes]


def bn_relu_graph(affine: bool = True, read_bn_output: bool = False,
                  read_relu_grad: bool = False, track: bool = True):
    """x -> batch_norm_train -> relu -> mse(target), with the backward w.r.t. x (and the
    affine weight and bias). read_bn_output: the pre-ReLU output is a step output too;
    read_relu_grad: the ReLU's input gradient is a step output too."""
    t = Tracer()
    x, target = t.input(SHAPE, "float32", "x"), t.input(SHAPE, "float32", "target")
    w, b = t.input((3,), "float32", "w"), t.input((3,), "float32", "b")
    running = [t.state((3,), "float32", "rm"), t.state((3,), "float32", "rv"),
               t.state((), "int64", "count")] if track else []
    ins = [x.value] + ([w.value, b.value] if affine else []) + running
    y = t.emit("batch_norm_train", ins, eps=1e-5, momentum=0.1, affine=affine, track=track,
               act="none")[0]
    r = t.op("act", [y], kind="relu", slope=0.01)
    loss = t.op("mse", [r, target])
    t.graph.outputs = {"loss": loss.value}
    if read_bn_output:
        t.graph.outputs["y"] = y
    wrt = [x.value] + ([w.value, b.value] if affine else [])
    grads = append_backward(t, loss.value, wrt)
    t.graph.outputs.update({f"d{i}": g for i, g in enumerate(grads)})
    if read_relu_grad:
        (relu_grad,) = [n for n in t.graph.nodes if n.op == "act_grad"]
        t.graph.outputs["dy"] = relu_grad.outputs[0]
    return t.graph


def arrays_and_state():
    gen = seeded("bn_relu")
    arrays = {"x": gen.standard_normal(SHAPE).astype(np.float32),
              "target": gen.standard_normal(SHAPE).astype(np.float32),
              "w": (1 + gen.standard_normal(3) / 2).astype(np.float32),
              "b": gen.standard_normal(3).astype(np.float32)}
    state = {"rm": gen.standard_normal(3).astype(np.float32),
             "rv": (1 + gen.standard_normal(3) ** 2).astype(np.float32),
             "count": np.array(2, np.int64)}
    return arrays, state


def assert_same_results(fused, unfused):
    arrays, state = arrays_and_state()
    state_u = {k: v.copy() for k, v in state.items()}
    got, want = run_graph(fused, arrays, state), run_graph(unfused, arrays, state_u)
    for k in want:
        assert_close(got[k], want[k], what=k)
    for k in state:   # the running statistics update the same way
        assert_close(state[k], state_u[k], what=k)


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "noaffine"])
def test_batch_norm_relu_fuse_forward_and_backward(affine):
    unfused = bn_relu_graph(affine)
    fused = fuse_batch_norm_relu(unfused)
    assert "act" not in ops(fused) and "act_grad" not in ops(fused)
    (bn,) = [n for n in fused.nodes if n.op == "batch_norm_train"]
    (grad,) = [n for n in fused.nodes if n.op == "batch_norm_grad"]
    assert bn.attrs["act"] == "relu" and grad.attrs["act"] == "relu"
    assert bn.outputs[0] not in grad.inputs          # the mask comes from x, not from y
    if affine:
        assert grad.inputs[-1] is bn.inputs[2]       # the bias, to recompute the mask
    assert bn.mutates == ((3, 4, 5) if affine else (1, 2, 3))
    assert_same_results(fused, unfused)


def test_bn_output_read_elsewhere_is_not_fused():
    graph = fuse_batch_norm_relu(bn_relu_graph(read_bn_output=True))
    assert "act" in ops(graph) and "act_grad" in ops(graph)
    assert all(n.attrs.get("act", "none") == "none" for n in graph.nodes
               if n.op.startswith("batch_norm"))


def test_relu_gradient_read_elsewhere_fuses_only_the_forward():
    unfused = bn_relu_graph(read_relu_grad=True)
    fused = fuse_batch_norm_relu(unfused)
    assert "act" not in ops(fused) and "act_grad" in ops(fused)
    (grad,) = [n for n in fused.nodes if n.op == "batch_norm_grad"]
    assert grad.attrs["act"] == "none"
    assert_same_results(fused, unfused)


def test_whole_pipeline_fuses_and_agrees_without_running_statistics():
    unfused = bn_relu_graph(track=False)
    fused = fuse(unfused)
    assert [n.attrs["act"] for n in fused.nodes if n.op.startswith("batch_norm")] == \
        ["relu", "relu"]
    assert_same_results(fused, unfused)


def test_pass_is_in_the_pipeline_and_leaves_its_input_unchanged():
    assert fuse_batch_norm_relu in PASSES
    graph = bn_relu_graph()
    before = str(graph)
    nodes = [(n.op, list(n.inputs), list(n.outputs), dict(n.attrs)) for n in graph.nodes]
    fuse_batch_norm_relu(graph)
    assert str(graph) == before
    assert nodes == [(n.op, n.inputs, n.outputs, n.attrs) for n in graph.nodes]


# ---- fuse_batch_norm_residual --------------------------------------------------------------

def bn_residual_graph(late_shortcut: bool = False, read_sum: bool = False,
                      bn_shortcut: bool = False, shortcut_affine: bool = True,
                      read_shortcut: bool = False):
    """relu(batch_norm_train(x) + s) -> mse(target), backward w.r.t. x, w, b and the shortcut's
    input z. s = z * 2 (late_shortcut: computed after the BatchNorm, as a downsampling
    shortcut is; bn_shortcut: s = batch_norm_train(z * 2), affine or not, with running
    statistics, made after the BatchNorm as a downsample's is); read_sum: the pre-ReLU sum is
    a step output too; read_shortcut: s is a step output too."""
    t = Tracer()
    x, z, target = (t.input(SHAPE, "float32", n) for n in ("x", "z", "target"))
    w, b = t.input((3,), "float32", "w"), t.input((3,), "float32", "b")
    running = [t.state((3,), "float32", "rm"), t.state((3,), "float32", "rv"),
               t.state((), "int64", "count")]
    s = None if late_shortcut or bn_shortcut else t.op("scalar", [z], kind="mul", value=2.0)
    y = t.emit("batch_norm_train", [x.value, w.value, b.value] + running, eps=1e-5,
               momentum=0.1, affine=True, track=True, act="none")[0]
    if late_shortcut or bn_shortcut:
        s = t.op("scalar", [z], kind="mul", value=2.0).value
    if bn_shortcut:
        ws, bs = t.input((3,), "float32", "ws"), t.input((3,), "float32", "bs")
        ins = [s] + ([ws.value, bs.value] if shortcut_affine else []) + [
            t.state((3,), "float32", "rm_s"), t.state((3,), "float32", "rv_s"),
            t.state((), "int64", "count_s")]
        s = t.emit("batch_norm_train", ins, eps=2e-5, momentum=0.2, affine=shortcut_affine,
                   track=True, act="none")[0]
    if read_shortcut:
        t.graph.outputs["s"] = s
    total = t.op("binary", [y, s], kind="add")
    out = t.op("act", [total], kind="relu", slope=0.01)
    loss = t.op("mse", [out, target])
    t.graph.outputs = {"loss": loss.value, **t.graph.outputs}
    if read_sum:
        t.graph.outputs["sum"] = total.value
    wrt = [x.value, z.value, w.value, b.value] + (
        [ws.value, bs.value] if bn_shortcut and shortcut_affine else [])
    grads = append_backward(t, loss.value, wrt)
    t.graph.outputs.update({f"d{i}": g for i, g in enumerate(grads)})
    return t.graph


def residual_arrays_and_state():
    arrays, state = arrays_and_state()
    gen = seeded("bn_residual")
    arrays["z"] = gen.standard_normal(SHAPE).astype(np.float32)
    arrays["ws"] = (1 + gen.standard_normal(3) / 2).astype(np.float32)
    arrays["bs"] = gen.standard_normal(3).astype(np.float32)
    state.update(rm_s=gen.standard_normal(3).astype(np.float32),
                 rv_s=(1 + gen.standard_normal(3) ** 2).astype(np.float32),
                 count_s=np.array(5, np.int64))
    return arrays, state


@pytest.mark.parametrize("late_shortcut", [False, True], ids=["early", "late"])
def test_batch_norm_residual_relu_fuse_into_one_forward_node(late_shortcut):
    unfused = bn_residual_graph(late_shortcut)
    fused = fuse_batch_norm_residual(unfused)
    (bn,) = [n for n in fused.nodes if n.op == "batch_norm_train"]
    assert bn.attrs["residual"] and bn.attrs["act"] == "relu"
    assert not any(n.op == "binary" and n.attrs["kind"] == "add" for n in fused.nodes)
    assert [n.op for n in fused.nodes].count("act") == 0
    shortcut = next(n for n in fused.nodes if n.op == "scalar")
    assert fused.nodes.index(shortcut) < fused.nodes.index(bn)   # r is made before it runs
    assert bn.inputs[-1] is shortcut.outputs[0]
    arrays, state = residual_arrays_and_state()
    state_u = {k: v.copy() for k, v in state.items()}
    got, want = run_graph(fused, arrays, state), run_graph(unfused, arrays, state_u)
    for k in want:
        assert_close(got[k], want[k], what=k)
    for k in state:
        assert_close(state[k], state_u[k], what=k)


def test_batch_norm_residual_sum_read_elsewhere_is_not_fused():
    fused = fuse_batch_norm_residual(bn_residual_graph(read_sum=True))
    assert not any(n.attrs.get("residual") for n in fused.nodes)
    assert fuse_batch_norm_residual in PASSES


# ---- fuse_batch_norm_grad_sum --------------------------------------------------------------

def bn_two_readers_graph(read_grad_sum: bool = False):
    """relu(batch_norm_train(x)) read twice (r * 2 + r * 3 -> mse(target)): the backward sums
    the two paths' gradients of r, and that sum feeds the BatchNorm's gradient. read_grad_sum:
    the sum is a step output too."""
    t = Tracer()
    x, target = t.input(SHAPE, "float32", "x"), t.input(SHAPE, "float32", "target")
    w, b = t.input((3,), "float32", "w"), t.input((3,), "float32", "b")
    running = [t.state((3,), "float32", "rm"), t.state((3,), "float32", "rv"),
               t.state((), "int64", "count")]
    y = t.emit("batch_norm_train", [x.value, w.value, b.value] + running, eps=1e-5,
               momentum=0.1, affine=True, track=True, act="none")[0]
    r = t.op("act", [y], kind="relu", slope=0.01)
    both = t.op("binary", [t.op("scalar", [r], kind="mul", value=2.0).value,
                           t.op("scalar", [r], kind="mul", value=3.0).value], kind="add")
    loss = t.op("mse", [both, target])
    t.graph.outputs = {"loss": loss.value}
    grads = append_backward(t, loss.value, [x.value, w.value, b.value])
    t.graph.outputs.update({f"d{i}": g for i, g in enumerate(grads)})
    if read_grad_sum:
        (grad,) = [n for n in fuse_batch_norm_relu(t.graph).nodes if n.op == "batch_norm_grad"]
        t.graph.outputs["dr"] = grad.inputs[0]
    return t.graph


def test_gradient_sum_fuses_into_the_batch_norm_gradient():
    unfused = fuse_batch_norm_relu(bn_two_readers_graph())
    (grad,) = [n for n in unfused.nodes if n.op == "batch_norm_grad"]
    summed = next(n for n in unfused.nodes if grad.inputs[0] in n.outputs)
    assert summed.op in ("add", "binary")
    fused = fuse_batch_norm_grad_sum(unfused)
    (grad,) = [n for n in fused.nodes if n.op == "batch_norm_grad"]
    assert grad.attrs["dy_sum"] and grad.attrs["act"] == "relu"
    assert grad.inputs[0] is summed.inputs[0] and grad.inputs[-1] is summed.inputs[1]
    assert summed not in fused.nodes and len(fused.nodes) == len(unfused.nodes) - 1
    arrays, state = arrays_and_state()
    state_u = {k: v.copy() for k, v in state.items()}
    got, want = run_graph(fused, arrays, state), run_graph(unfused, arrays, state_u)
    for k in want:       # the same float32 sum, then the same float64 reductions
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert fuse_batch_norm_grad_sum in PASSES


def test_gradient_sum_read_elsewhere_is_not_fused():
    graph = fuse_batch_norm_relu(bn_two_readers_graph(read_grad_sum=True))
    fused = fuse_batch_norm_grad_sum(graph)
    assert not any(n.attrs.get("dy_sum") for n in fused.nodes)
    assert len(fused.nodes) == len(graph.nodes)


@pytest.mark.parametrize("affine", [True, False])
def test_shortcut_batch_norm_is_applied_by_the_residual_node(affine):
    """A downsampling shortcut's BatchNorm whose output only the residual add reads keeps its
    statistics alone (batch_norm_stats); the fused node normalises the shortcut's raw value
    as it reads it. Outputs, gradients and both running statistics: the unfused graph's bits
    (the reference normalises the shortcut with its float64 statistics, as the unfused node's
    reference does)."""
    unfused = bn_residual_graph(bn_shortcut=True, shortcut_affine=affine)
    fused = fuse_batch_norm_residual(unfused)
    (stats,) = [n for n in fused.nodes if n.op == "batch_norm_stats"]
    (bn,) = [n for n in fused.nodes if n.op == "batch_norm_train"]
    assert bn.attrs["residual_norm"] and bn.attrs["residual_affine"] == affine
    assert bn.inputs[-(4 if affine else 2):][:2] == stats.outputs
    assert fused.nodes.index(stats) < fused.nodes.index(bn)
    assert stats.mutates == (1, 2, 3) and stats.attrs["eps"] == bn.attrs["residual_eps"]
    arrays, state = residual_arrays_and_state()
    state_u = {k: v.copy() for k, v in state.items()}
    got, want = run_graph(fused, arrays, state), run_graph(unfused, arrays, state_u)
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    for k in state:
        np.testing.assert_array_equal(state[k], state_u[k], err_msg=k)


def test_shortcut_batch_norm_read_elsewhere_is_not_folded():
    fused = fuse_batch_norm_residual(bn_residual_graph(bn_shortcut=True, read_shortcut=True))
    assert not any(n.op == "batch_norm_stats" for n in fused.nodes)
    (bn,) = [n for n in fused.nodes if n.attrs.get("residual")]
    assert not bn.attrs.get("residual_norm")
