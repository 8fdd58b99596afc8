"""Logits stored classes-first (compile/logits_layout.py): where a row of classes is not a
multiple of 16 bytes, the LM head's GEMM writes logits.T, cross_entropy_train reads it and
writes dlogits.T, and the two gradient GEMMs read that with their transpose flag flipped. The
step computes what it computed before, to the order of BLAS's sums, and the pass leaves the
heads it cannot take (aligned rows, a bias, rows that would stay unaligned, logits read
elsewhere) as they were."""
from __future__ import annotations

import numpy as np
import pytest

from stepgraph import losses, models, nn, optim
from stepgraph.compile.build import build_train_graph
from stepgraph.compile.feed import signature_of
from stepgraph.compile.fuse import PASSES, fuse
from stepgraph.compile.logits_layout import transpose_unaligned_logits
from stepgraph.ops.loss import IGNORE_INDEX
from tests.ops.helpers import op_forward, run_graph, seeded

LAYERS, HEADS, EMBD, BLOCK, BATCH = 2, 2, 32, 16, 4
WITHOUT = tuple(p for p in PASSES if p is not transpose_unaligned_logits)


def gpt_case(vocab: int, batch: int = BATCH, precision: str = "fp32"):
    """(model, optimizer, feed, graph builder) of a small GPT over `vocab` tokens."""
    cfg = models.GPTConfig(vocab_size=vocab, block_size=BLOCK, n_layer=LAYERS, n_head=HEADS,
                           n_embd=EMBD, dropout=0.0, bias=True)
    model = models.GPT(cfg)
    opt = model.configure_optimizers(weight_decay=0.1, learning_rate=1e-2)
    gen = seeded(f"logits-layout-{vocab}-{batch}")
    arrays = {k: gen.integers(0, vocab, (batch, BLOCK)) for k in ("x", "y")}
    signature = signature_of(("x", "y"), (arrays["x"], arrays["y"]))
    build = lambda: build_train_graph(model, models.next_token_loss, opt, signature,  # noqa
                                      seed=5, precision=precision)
    return model, opt, arrays, build


def loss_node(graph):
    (ce,) = [n for n in graph.nodes if n.op == "cross_entropy_train"]
    return ce


@pytest.mark.parametrize("precision, dtype", [("fp32", "float32"), ("bf16", "bfloat16")])
def test_unaligned_vocabulary_runs_the_head_classes_first(precision, dtype):
    """65 classes (130 or 260-byte rows) over 64 rows: the head is matmul(w, x, trans_b) ->
    (65, 64), the loss reads it classes-first, and both gradient GEMMs read dlogits.T: dx with
    trans_a (dlogits = (dlogits.T).T), dw without (dlogits.T @ x; at float32 it also adds the
    tied embedding's gradient as its C)."""
    *_, build = gpt_case(65, precision=precision)
    graph = fuse(build())
    ce, producers, users = loss_node(graph), graph.producers(), graph.consumers()
    rows = BATCH * BLOCK
    assert ce.attrs["classes_first"] and ce.inputs[0].shape == (65, rows)
    assert ce.inputs[0].dtype == dtype and ce.outputs[1].shape == (65, rows)
    head = producers[ce.inputs[0]]
    assert head.op == "matmul" and head.attrs == {"trans_b": True}
    assert head.inputs[0].shape == (65, EMBD) and head.inputs[1].shape == (rows, EMBD)
    grads = {n.outputs[0].shape: n for n in users[ce.outputs[1]]}
    assert sorted(grads) == [(rows, EMBD), (65, EMBD)]
    dw, dx = grads[(65, EMBD)], grads[(rows, EMBD)]
    assert dw.op == dx.op == "matmul"
    flags = lambda n: (n.attrs.get("trans_a", False), n.attrs.get("trans_b", False))  # noqa
    assert flags(dw) == (False, False) and flags(dx) == (True, False)
    assert not any(n.op == "linear" and n.outputs[0].shape == (rows, 65) for n in graph.nodes)


def test_the_step_trains_as_with_row_major_logits_on_numpy():
    """Two steps with the classes-first head against the same graph without the pass: the
    losses agree to float32 rounding (BLAS's sums in another order) and so do the parameters,
    to a thousandth of the learning rate (Adam's steps divide by the gradients' size, so a
    rounding in a tiny gradient moves its step by more than the gradient's ulp)."""
    model, opt, arrays, build = gpt_case(65)
    params = {k: v.numpy() for k, v in model.state_dict().items()}
    results = []
    for passes in (WITHOUT, PASSES):
        graph = fuse(build(), passes)
        bound = {k: v.copy() for k, v in params.items()}
        for v in graph.state:
            bound[v.name] = np.array(opt.initial_state(v), dtype=v.dtype)
        losses_ = [run_graph(graph, arrays, bound)["loss"] for _ in range(2)]
        results.append((losses_, bound))
    (rows, bound_r), (cols, bound_c) = results
    np.testing.assert_allclose(cols, rows, rtol=1e-6)
    for k, v in bound_r.items():
        np.testing.assert_allclose(bound_c[k], v, rtol=0, atol=1e-5, err_msg=k)


def test_an_aligned_vocabulary_stays_row_major():
    """64 classes make 256-byte float32 rows: the GEMMs are aligned as they are."""
    *_, build = gpt_case(64)
    graph = fuse(build())
    assert not loss_node(graph).attrs.get("classes_first")
    assert graph.producers()[loss_node(graph).inputs[0]].op == "linear"


class BiasedHead(nn.Module):
    def __init__(self, vocab: int, bias: bool):
        super().__init__()
        self.emb = nn.Embedding(vocab, 16)
        self.head = nn.Linear(16, vocab, bias=bias)

    def forward(self, idx):
        return self.head(self.emb(idx))


def head_loss_node(bias: bool, rows: int, loss=losses.cross_entropy):
    model = BiasedHead(65, bias)
    opt = optim.SGD(model.parameters(), lr=0.1)
    x = seeded(f"head-{rows}").integers(0, 65, (rows,))
    signature = signature_of(("x", "y"), (x, x))
    return loss_node(fuse(build_train_graph(model, loss, opt, signature, seed=1)))


@pytest.mark.parametrize("bias", [True, False])
def test_a_head_with_a_bias_stays_row_major(bias):
    """The bias gradient is a column sum of dlogits (fuse_matmul_bias_grad puts it on the
    weight-gradient GEMM, whose sums follow the operand's layout): such a head is left as it
    was; without a bias the same model is transposed."""
    assert bool(head_loss_node(bias, 64).attrs.get("classes_first")) == (not bias)


def test_rows_the_transposed_layout_would_leave_unaligned_stay_row_major():
    """45 float32 rows (180 bytes) would lead the transposed logits unaligned too."""
    assert not head_loss_node(False, 45).attrs.get("classes_first")


@pytest.mark.parametrize("eps, ignore", [(0.0, IGNORE_INDEX), (0.2, 3)])
def test_numpy_loss_classes_first_is_the_row_major_one_transposed(eps, ignore):
    """The numpy reference of the classes-first op: the row-major op's loss and dlogits, bit
    for bit, on the transposed logits."""
    gen = seeded(f"ce-cols-{eps}")
    x = (3 * gen.standard_normal((50, 65))).astype(np.float32)
    y = gen.integers(0, 65, 50)
    y[::7] = ignore
    attrs = dict(label_smoothing=eps, ignore_index=ignore)
    loss, dx = op_forward("cross_entropy_train", {"x": x, "y": y}, **attrs)
    loss_t, dx_t = op_forward("cross_entropy_train", {"x": np.ascontiguousarray(x.T), "y": y},
                              classes_first=True, **attrs)
    np.testing.assert_array_equal(loss_t, loss)
    np.testing.assert_array_equal(dx_t, dx.T)


def test_logits_read_elsewhere_stay_row_major():
    """A loss that also reads the logits (their mean, here) keeps them (N, C) for that reader
    and for the gradient it adds to dlogits."""
    loss = lambda out, y: losses.cross_entropy(out, y) + 1e-3 * out.mean()  # noqa: E731
    assert not head_loss_node(False, 64, loss).attrs.get("classes_first")
