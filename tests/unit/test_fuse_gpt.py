"""The GPT's fused train graph (compile/fuse.py, compile/pointwise.py): a Linear on (B, T, C)
inputs traces as reshape -> linear -> reshape, and the passes still see through the views: the
MLP's GELU rides its linear (one node, bias and activation in it) and the GELU's gradient and
the bias gradient are one act_bias_grad, the other Linears' bias gradients ride their
weight-gradient matmuls; the residual branches' dropouts ride the LayerNorms after them and
the embeddings' dropout and add are one pointwise node (mask drawn as the dropout op draws
it). On the numpy backend the fused step computes the same bits as unfused."""
from __future__ import annotations

import numpy as np
import pytest

from stepgraph import models
from stepgraph.compile.build import build_train_graph
from stepgraph.compile.feed import signature_of
from stepgraph.compile.fuse import (PASSES, fuse, fuse_activation_bias_grad,
                                    fuse_linear_activation)
from stepgraph.compile.logits_layout import transpose_unaligned_logits
from stepgraph.compile.pointwise import fuse_pointwise
from stepgraph.ir.trace import Tracer
from tests.ops.helpers import run_graph, seeded

LAYERS, HEADS, EMBD, VOCAB, BLOCK, BATCH = 2, 2, 32, 17, 16, 3


def gpt_graphs(dropout: float = 0.2, bias: bool = True, passes=PASSES):
    """(model, optimizer, feed, unfused train graph, fused train graph) of a small GPT."""
    cfg = models.GPTConfig(vocab_size=VOCAB, block_size=BLOCK, n_layer=LAYERS, n_head=HEADS,
                           n_embd=EMBD, dropout=dropout, bias=bias)
    model = models.GPT(cfg)
    opt = model.configure_optimizers(weight_decay=0.1, learning_rate=1e-2)
    gen = seeded(f"gpt-{dropout}-{bias}")
    arrays = {"x": gen.integers(0, VOCAB, (BATCH, BLOCK)), "y": gen.integers(0, VOCAB,
                                                                         (BATCH, BLOCK))}
    signature = signature_of(("x", "y"), (arrays["x"], arrays["y"]))
    build = lambda: build_train_graph(model, models.next_token_loss, opt, signature,  # noqa
                                      seed=5)
    return model, opt, arrays, build(), fuse(build(), passes)


def ops(graph) -> list[str]:
    return [n.op for n in graph.nodes]


def test_gpt_mlp_gelu_rides_the_linear_forward_and_backward():
    *_, unfused, fused = gpt_graphs()
    assert ops(unfused).count("act") == LAYERS and ops(unfused).count("act_grad") == LAYERS
    assert "act" not in ops(fused) and "act_grad" not in ops(fused)
    gelu = [n for n in fused.nodes if n.op == "linear" and n.attrs.get("act")]
    assert len(gelu) == LAYERS
    for lin in gelu:
        assert lin.attrs["act"] == "gelu_tanh" and lin.attrs["save_preact"]
        assert len(lin.inputs) == 3 and lin.inputs[0].shape == (BATCH * BLOCK, EMBD)
        assert [v.shape for v in lin.outputs] == [(BATCH * BLOCK, 4 * EMBD)] * 2
    grads = [n for n in fused.nodes if n.op == "act_bias_grad"]
    assert len(grads) == LAYERS
    producers = fused.producers()
    for grad, lin in zip(grads, reversed(gelu)):
        assert grad.attrs["kind"] == "gelu_tanh"
        assert [v.shape for v in grad.inputs] == [(BATCH * BLOCK, 4 * EMBD)] * 2
        assert grad.inputs[1] is lin.outputs[1]                # the saved pre-activation
        assert producers[grad.inputs[0]].op == "matmul"        # dy straight from the GEMM
        assert grad.outputs[1].shape == (4 * EMBD,)            # c_fc's bias gradient
    # no other bias-gradient sum of the c_fc layers is left
    sums = [n for n in fused.nodes if n.op == "reduce_sum"]
    assert all(n.outputs[0].shape != (4 * EMBD,) for n in sums)


@pytest.mark.parametrize("bias", [True, False])
def test_gpt_bias_gradients_ride_the_weight_gradient_matmuls(bias):
    """The Linears without an activation (c_attn, the attention's c_proj, the MLP's c_proj:
    three a layer) get their bias gradients from their weight-gradient matmul
    (fuse_matmul_bias_grad); the MLP's c_fc keeps its in act_bias_grad. No column sum of a
    (tokens, features) gradient is left (the position embedding's sum over the batch stays);
    without biases no matmul writes one."""
    *_, unfused, fused = gpt_graphs(bias=bias)
    column_sums = lambda graph: [n for n in graph.nodes  # noqa: E731
                                 if n.op == "reduce_sum" and len(n.inputs[0].shape) == 2]
    assert len(column_sums(unfused)) == (4 * LAYERS if bias else 0)
    assert not column_sums(fused)
    joined = [n for n in fused.nodes if n.op == "matmul" and n.attrs.get("bias_grad")]
    assert len(joined) == (3 * LAYERS if bias else 0)
    for n in joined:
        dz, x = n.inputs
        assert n.attrs["trans_a"] and n.outputs[1].shape == (dz.shape[1],)
        assert n.outputs[0].shape == (dz.shape[1], x.shape[1])


def test_gpt_dropouts_ride_the_layer_norms_and_the_embeddings_add():
    """Each residual branch's dropout is drawn by the add_layer_norm after it (norm_rewrite);
    its gradient is a dropout_grad on the norm gradient's db. The embeddings' dropout, which
    no norm follows, and the add before it are one pointwise node, and so are its gradient
    and the sum of the first block's two residual gradients."""
    *_, unfused, fused = gpt_graphs()
    for graph in (unfused, fused):
        folded = [n for n in graph.nodes if n.op == "add_layer_norm"]
        assert len(folded) == 2 * LAYERS
        assert all(n.attrs["dropout"] == 0.2 for n in folded)
        assert len({n.attrs["site"] for n in folded}) == 2 * LAYERS
        branch_grads = [n for n in graph.nodes if n.op == "dropout_grad"]
        producers = graph.producers()
        masks = [producers[n.inputs[1]].op for n in branch_grads]
        assert masks.count("add_layer_norm") == 2 * LAYERS       # the norms' keep masks
    assert ops(unfused).count("dropout") == 1
    assert "dropout" not in ops(fused)
    programs = [[i.op for i in n.attrs["program"]] for n in fused.nodes if n.op == "pointwise"]
    forward = [p for p in programs if "dropout_mask" in p]
    assert len(forward) == 1 and "binary" in forward[0]
    assert programs.count(["add", "dropout_grad"]) == 1


@pytest.mark.parametrize("dropout,bias", [(0.2, True), (0.0, True), (0.2, False)])
def test_gpt_fused_step_equals_unfused_on_numpy(dropout, bias):
    # Without the classes-first logits: BLAS adds the LM head's transposed products in
    # another order (tests/unit/test_logits_layout.py compares them).
    same_sums = tuple(p for p in PASSES if p is not transpose_unaligned_logits)
    model, opt, arrays, unfused, fused = gpt_graphs(dropout, bias, same_sums)
    assert len(fused.nodes) < len(unfused.nodes)
    params = {k: v.numpy() for k, v in model.state_dict().items()}
    results = []
    for graph in (unfused, fused):
        bound = {k: v.copy() for k, v in params.items()}
        for v in graph.state:
            bound[v.name] = np.array(opt.initial_state(v), dtype=v.dtype)
        for _ in range(2):           # the second step draws new dropout masks
            loss = run_graph(graph, arrays, bound)["loss"]
        results.append((loss, bound))
    (loss_u, bound_u), (loss_f, bound_f) = results
    np.testing.assert_array_equal(loss_f, loss_u)
    for k in (v.name for v in unfused.params):   # lm_head.weight is transformer.wte.weight
        assert not np.array_equal(bound_u[k], params[k]), f"{k} was not updated"
        np.testing.assert_array_equal(bound_f[k], bound_u[k], err_msg=k)


def mlp3d_graph(kind: str, backward: bool = True):
    """x (2, 3, 4) -> Linear(4, 6) as nn traces it (reshape, linear, reshape) -> act -> sum."""
    t = Tracer()
    x, w, b = (t.input(s, "float32", n) for s, n in (((2, 3, 4), "x"), ((6, 4), "w"),
                                                     ((6,), "b")))
    z = t.op("linear", [x.reshape(6, 4), w, b], act=None).reshape(2, 3, 6)
    y = t.op("act", [z], kind=kind, slope=0.1)
    loss = t.op("reduce_sum", [t.op("binary", [y, y], kind="mul")], axes=(0, 1, 2))
    t.graph.outputs = {"loss": loss.value, "y": y.value}
    if backward:
        from stepgraph.autodiff import append_backward

        grads = append_backward(t, loss.value, [w.value, b.value])
        t.graph.outputs.update({"dw": grads[0], "db": grads[1]})
    return t.graph


@pytest.mark.parametrize("kind", ["relu", "gelu", "gelu_tanh", "sigmoid"])
@pytest.mark.parametrize("backward", [True, False])
def test_linear_activation_through_a_view(kind, backward):
    graph = mlp3d_graph(kind, backward)
    fused = fuse_activation_bias_grad(fuse_linear_activation(graph))
    (lin,) = [n for n in fused.nodes if n.op == "linear"]
    assert lin.attrs["act"] == kind and "act" not in ops(fused)
    if backward:
        assert "act_grad" not in ops(fused) and ops(fused).count("act_bias_grad") == 1
    gen = seeded(f"view-{kind}-{backward}")
    arrays = {"x": gen.standard_normal((2, 3, 4)).astype(np.float32),
              "w": gen.standard_normal((6, 4)).astype(np.float32),
              "b": gen.standard_normal(6).astype(np.float32)}
    want, got = run_graph(graph, arrays), run_graph(fuse(graph), arrays)
    assert want.keys() == got.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_view_read_elsewhere_keeps_the_preactivation():
    """z viewed as (2, 3, 6) is also a step output: the linear saves it, the view stays."""
    graph = mlp3d_graph("relu", backward=False)
    (view,) = [n for n in graph.nodes if n.op == "reshape" and n.outputs[0].shape == (2, 3, 6)]
    graph.outputs["z"] = view.outputs[0]
    fused = fuse_linear_activation(graph)
    (lin,) = [n for n in fused.nodes if n.op == "linear"]
    assert lin.attrs["save_preact"] and view.outputs[0] in fused.outputs.values()


def test_dropout_grad_alone_or_per_channel_stays():
    t = Tracer(seed=1, training=True)
    x = t.input((2, 3, 4, 4), "float32", "x")
    step = t.rng_step()
    d, _ = t.op_all("dropout", [x, step], p=0.5, seed=1, site=0, per_channel=True)
    y = t.op("binary", [d, x], kind="add")
    t.graph.outputs = {"y": y.value}
    assert ops(fuse_pointwise(t.graph)) == ["dropout", "binary"]
