"""compile/attention.py: a GPT's head split (slice, reshape, permute), or a ViT's (timm's
reshape to (B, T, 3, H, D), permute (2, 0, 3, 1, 4), unbind), sdpa, head merge and their
gradients (permutes, slice_grads and their sum) become sdpa_qkv / sdpa_qkv_grad on the
packed projection, with the same results bit for bit on the NumPy backend (the same
arithmetic on the same logical tensors; the dropped sums only added zeros). Patterns whose
intermediates are read elsewhere stay as they are."""
from __future__ import annotations

import numpy as np
import pytest

from stepgraph import models, optim
from stepgraph.api import compile_train_step
from stepgraph.compile.attention import pack_attention_heads
from stepgraph.compile.fuse import fuse
from stepgraph.nn import functional as F
from tests.ops.helpers import build_train_graph, randn, run_graph, seeded

B, T, HEADS, D = 2, 7, 3, 4
C = HEADS * D


def attention(extra_use: bool = False, dropout_p: float = 0.25):
    """nanoGPT's attention on a packed (B, T, 3C) projection x, times a weight w."""
    def body(t, ins):
        q, k, v = ins["x"].split(C, dim=2)
        q, k, v = (a.view(B, T, HEADS, D).transpose(1, 2) for a in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C) * ins["w"]
        return y + k.transpose(1, 2).reshape(B, T, C) if extra_use else y
    return body


def stacked_attention(extra_use: bool = False, dropout_p: float = 0.25):
    """timm's ViT attention on a packed (B, T, 3C) projection x, times a weight w."""
    def body(t, ins):
        qkv = ins["x"].reshape(B, T, 3, HEADS, D).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
        y = y.transpose(1, 2).reshape(B, T, C) * ins["w"]
        return y + qkv.sum(0).transpose(1, 2).reshape(B, T, C) if extra_use else y
    return body


def arrays(case: str) -> dict:
    gen = seeded(case)
    return {"x": randn(gen, B, T, 3 * C, dtype=np.float64), "w": randn(gen, C, dtype=np.float64),
            "target": randn(gen, B, T, C, dtype=np.float64)}


STEP = {"optimizer.step": np.array(4, np.int64)}


FORMS = pytest.mark.parametrize("form", ["sliced", "stacked"])


def body_of(form: str, **kw):
    return (attention if form == "sliced" else stacked_attention)(**kw)


@FORMS
@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_packed_attention_gives_the_same_bits(form, dropout_p):
    data = arrays(f"packed{form}{dropout_p}")
    plain = build_train_graph(body_of(form, dropout_p=dropout_p), data, ("x", "w"), fused=False)
    fused = build_train_graph(body_of(form, dropout_p=dropout_p), data, ("x", "w"), fused=True)
    ops = [n.op for n in fused.nodes]
    assert ops.count("sdpa_qkv") == 1 and ops.count("sdpa_qkv_grad") == 1
    assert not {"sdpa", "sdpa_grad", "slice", "slice_grad", "permute"} & set(ops)
    want, got = run_graph(plain, data, dict(STEP)), run_graph(fused, data, dict(STEP))
    for name in ("out", "loss", "grad:x", "grad:w"):
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@FORMS
def test_intermediates_read_elsewhere_keep_the_plain_ops(form):
    data = arrays(f"shared-{form}")
    plain = build_train_graph(body_of(form, extra_use=True), data, ("x", "w"), fused=False)
    fused = build_train_graph(body_of(form, extra_use=True), data, ("x", "w"), fused=True)
    ops = [n.op for n in fused.nodes]
    assert "sdpa_qkv" not in ops and "sdpa" in ops and "sdpa_grad" in ops
    want, got = run_graph(plain, data, dict(STEP)), run_graph(fused, data, dict(STEP))
    for name in ("out", "grad:x", "grad:w"):
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_forward_only_graphs_are_rewritten_too():
    from stepgraph.ir.trace import Tracer
    from tests.ops.helpers import trace_inputs

    data = arrays("inference")
    tracer = Tracer(training=False)
    ins = trace_inputs(tracer, data)
    tracer.graph.outputs = {"out": attention()(tracer, ins).value}
    packed = pack_attention_heads(tracer.graph)
    assert [n.op for n in packed.nodes] == ["sdpa_qkv", "binary"]
    np.testing.assert_array_equal(run_graph(packed, data)["out"],
                                  run_graph(tracer.graph, data)["out"])


def test_gpt_step_runs_packed_attention_in_every_layer():
    model = models.gpt(17, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.2)
    idx = np.zeros((3, 8), np.int64)
    step = compile_train_step(model, loss=models.next_token_loss,
                              optimizer=optim.AdamW(lr=1e-3), example_inputs=(idx, idx))
    graph = fuse(step.build_graph(step.signature))
    ops = [n.op for n in graph.nodes]
    assert ops.count("sdpa_qkv") == 2 and ops.count("sdpa_qkv_grad") == 2
    assert not {"sdpa", "sdpa_grad", "permute", "slice", "slice_grad"} & set(ops)


def test_vit_file_runs_packed_attention_in_every_block():
    """The compatibility suite's ViT (hand-written, timm's split): its attentions become
    sdpa (the rewrite) and then sdpa_qkv on its qkv projection."""
    import stepgraph as sg
    from stepgraph import losses
    from tests.compat.loader import load

    model = load("vit", "stepgraph").VisionTransformer(img_size=8, patch_size=4, embed_dim=32,
                                                       depth=2, num_heads=2)
    gen = seeded("vit-packed")
    x = gen.standard_normal((4, 3, 8, 8)).astype(np.float32)
    y = gen.integers(0, 10, 4).astype(np.int64)
    step = sg.compile_train_step(model, losses.cross_entropy, optim.SGD(lr=0.1),
                                 example_inputs=(x, y), device="cpu")
    ops = [n.op for n in step.plan(step.signature).graph.nodes]
    assert ops.count("sdpa_qkv") == 2 and ops.count("sdpa_qkv_grad") == 2
    assert not {"sdpa", "sdpa_grad"} & set(ops)
