"""sdpa's attention masks, grouped-query heads and head dims of real models (80, 96) on the
NumPy backend, against torch's scaled_dot_product_attention: forward and gradients judged by
tests/reference.py's policy (stepgraph float32 against torch float64, bound by torch
float32's own error). Masks bool and additive, broadcast over batch, heads or queries, rows
blocked wholly (torch's sdpa gives 0 there, and no gradient); grouped heads (enable_gqa:
k, v of fewer heads, dk and dv summed over each group) through the op and through
F.scaled_dot_product_attention, whose masked path the attention rewrite turns into one
masked sdpa on both backends (CUDA included: the plan is built without a GPU), and
repeat_interleave'd k and v written by hand into grouped sdpa."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import stepgraph as sg
from stepgraph.autodiff import append_backward
from stepgraph.compile.attention_rewrite import masks_supported, rewrite_attention
from stepgraph.compile.build import rewrite_forward_attention
from stepgraph.errors import ShapeError
from stepgraph.ir.trace import Tracer
from stepgraph.nn import functional as F
from tests.ops.helpers import op_forward, op_vjp, randn, run_graph, seeded, trace_inputs
from tests.reference import assert_close_to_reference

# name -> (q lead, kv lead, L, S, E, mask shape or None, mask kind, causal)
CASES = {
    "bool-keys": ((2, 3), (2, 3), 5, 7, 8, (2, 1, 1, 7), "bool", False),
    "additive-LS": ((2, 2), (2, 2), 6, 6, 16, (6, 6), "additive", False),
    "additive-heads": ((2, 3), (2, 3), 4, 9, 8, (1, 3, 4, 9), "additive", False),
    "bool-queries": ((2, 2), (2, 2), 5, 6, 8, (2, 1, 5, 1), "bool", False),
    "blocked-rows": ((2, 2), (2, 2), 5, 6, 8, (2, 2, 5, 6), "blocked", False),
    "gqa": ((2, 4), (2, 2), 5, 7, 8, None, None, False),
    "gqa-causal": ((1, 6), (1, 2), 6, 6, 8, None, None, True),
    "mqa-mask": ((2, 4), (2, 1), 5, 7, 8, (2, 1, 5, 7), "bool", False),
    "gqa-3d": ((4,), (2,), 3, 5, 8, None, None, False),
    "head-80": ((2, 2), (2, 2), 9, 9, 80, None, None, True),
    "head-96-mask": ((1, 2), (1, 2), 9, 9, 96, (9, 9), "additive", False),
    "head-72-gqa": ((2, 4), (2, 2), 4, 6, 72, (2, 1, 1, 6), "bool", False),
}


def make_mask(gen, shape, kind):
    """(the bool mask torch takes, True: attend) or an additive float mask, of `shape`."""
    if kind == "additive":
        values = gen.normal(size=shape)
        return np.where(gen.random(shape) < 0.3, -np.inf, values)
    keep = gen.random(shape) > 0.35
    keep[..., 0, :] |= keep.shape[-1] == 1          # never a wholly blocked row by chance
    keep[..., 0] |= kind != "blocked"
    if kind == "blocked":
        keep[0, 1, 2] = False                      # one row blocked wholly
        keep[1, 0, 0] = False
        keep[1, 0, 4, 1:] = True
    return keep


def case_arrays(name: str, dtype=np.float64) -> dict:
    lead, kv_lead, length, s, e, mshape, kind, _ = CASES[name]
    gen = seeded(f"masks-{name}")
    arrays = {"q": randn(gen, *lead, length, e, dtype=dtype),
              "k": randn(gen, *kv_lead, s, e, dtype=dtype),
              "v": randn(gen, *kv_lead, s, e, dtype=dtype)}
    if mshape is not None:
        arrays["mask"] = make_mask(gen, mshape, kind)
    arrays["dout"] = randn(gen, *lead, length, e, dtype=dtype)
    return arrays


def additive(mask: np.ndarray, dtype) -> np.ndarray:
    return (np.where(mask, 0.0, -np.inf) if mask.dtype == bool else mask).astype(dtype)


def torch_run(arrays: dict, causal: bool, scale: float, dtype) -> list[np.ndarray]:
    """torch's out and dq, dk, dv in `dtype` (enable_gqa where k has fewer heads)."""
    q, k, v = (torch.tensor(arrays[n], dtype=dtype, requires_grad=True) for n in "qkv")
    mask = arrays.get("mask")
    if mask is not None:
        mask = torch.tensor(mask) if mask.dtype == bool else torch.tensor(mask, dtype=dtype)
    gqa = q.shape[:-2] != k.shape[:-2]
    out = TF.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                          scale=scale, enable_gqa=gqa)
    grads = torch.autograd.grad(out, [q, k, v], torch.tensor(arrays["dout"], dtype=dtype))
    return [out.detach().numpy()] + [g.numpy() for g in grads]


def references(name: str, arrays: dict):
    causal, e = CASES[name][7], CASES[name][4]
    scale = 1.0 / math.sqrt(e)
    return scale, causal, torch_run(arrays, causal, scale, torch.float64), \
        torch_run(arrays, causal, scale, torch.float32)


def assert_judged(got: list, ref64: list, ref32: list, what: str) -> None:
    for label, g, w64, w32 in zip(("out", "dq", "dk", "dv"), got, ref64, ref32):
        assert g.dtype == np.float32, (what, label)
        assert_close_to_reference(g, w64, w32, f"{what} {label}")


@pytest.mark.parametrize("name", CASES)
def test_sdpa_op_matches_torch(name):
    """The op itself (its NumPy reference and VJP) in float32 on the case's masks and
    heads."""
    arrays = case_arrays(name)
    scale, causal, ref64, ref32 = references(name, arrays)
    f32 = {n: arrays[n].astype(np.float32) for n in "qkv"}
    attrs = dict(scale=scale, causal=causal, dropout_p=0.0)
    if "mask" in arrays:
        f32["mask"] = additive(arrays["mask"], np.float32)
        attrs["mask"] = True
    out, lse = op_forward("sdpa", f32, **attrs)
    grads = op_vjp("sdpa", f32, arrays["dout"].astype(np.float32), ("q", "k", "v"), **attrs)
    assert_judged([out, grads["q"], grads["k"], grads["v"]], ref64, ref32, name)
    assert grads["k"].shape == arrays["k"].shape
    if name == "blocked-rows":                # the wholly blocked rows: 0 out, lse -inf
        assert (out[0, 1, 2] == 0).all() and lse[0, 1, 2] == -np.inf
        assert (grads["q"][0, 1, 2] == 0).all()


def functional_graph(name: str, arrays: dict, masked: bool):
    """F.scaled_dot_product_attention traced in float32 (bool masks as bool inputs), loss
    sum(out * dout), the rewrite run as for a device whose sdpa takes masks or not; (graph,
    forward ops after the rewrite)."""
    scale, causal = 1.0 / math.sqrt(CASES[name][4]), CASES[name][7]
    feed = {n: a if a.dtype == bool else a.astype(np.float32) for n, a in arrays.items()}
    tracer = Tracer()
    ins = trace_inputs(tracer, feed)
    gqa = arrays["q"].shape[:-2] != arrays["k"].shape[:-2]
    out = F.scaled_dot_product_attention(ins["q"], ins["k"], ins["v"],
                                         attn_mask=ins.get("mask"), is_causal=causal,
                                         scale=scale, enable_gqa=gqa)
    tracer.graph = rewrite_attention(tracer.graph, masked=masked, kept=(out.value,))
    ops = [n.op for n in tracer.graph.nodes]
    loss = (out * ins["dout"]).sum()
    grads = append_backward(tracer, loss.value, [ins[n].value for n in "qkv"])
    tracer.graph.outputs = {"out": out.value, **{f"d{n}": g for n, g in zip("qkv", grads)}}
    return tracer.graph, ops, feed


@pytest.mark.parametrize("name", CASES)
def test_functional_sdpa_is_one_sdpa_and_matches_torch(name):
    arrays = case_arrays(name)
    _, _, ref64, ref32 = references(name, arrays)
    graph, ops, feed = functional_graph(name, arrays, masked=True)
    assert ops.count("sdpa") == 1 and "softmax" not in ops and "bmm" not in ops, ops
    sdpa = next(n for n in graph.nodes if n.op == "sdpa")
    assert sdpa.inputs[1].shape == arrays["k"].shape        # grouped heads: no repeat
    assert bool(sdpa.attrs.get("mask")) == ("mask" in arrays)
    got = run_graph(graph, feed)
    assert_judged([got[n] for n in ("out", "dq", "dk", "dv")], ref64, ref32, name)


def test_functional_sdpa_broadcasts_batch_dims_as_torch():
    """q of fewer batch dims than k and v (the OpInfo samples torch broadcasts): q expanded,
    and k, v of one head shared by every query head without a copy."""
    gen = seeded("broadcast")
    arrays = {"q": randn(gen, 4, 3, 8, dtype=np.float64),
              "k": randn(gen, 2, 4, 6, 8, dtype=np.float64),
              "v": randn(gen, 2, 1, 6, 8, dtype=np.float64)}
    arrays["k"] = arrays["k"][:, :1].copy()
    arrays["dout"] = randn(gen, 2, 4, 3, 8, dtype=np.float64)
    ref = {}
    for dtype in (torch.float64, torch.float32):
        q, k, v = (torch.tensor(arrays[n], dtype=dtype, requires_grad=True) for n in "qkv")
        out = TF.scaled_dot_product_attention(q, k, v)
        grads = torch.autograd.grad(out, [q, k, v], torch.tensor(arrays["dout"], dtype=dtype))
        ref[dtype] = [out.detach().numpy()] + [g.numpy() for g in grads]
    feed = {n: a.astype(np.float32) for n, a in arrays.items()}
    tracer = Tracer()
    ins = trace_inputs(tracer, feed)
    out = F.scaled_dot_product_attention(ins["q"], ins["k"], ins["v"])
    sdpa = next(n for n in tracer.graph.nodes if n.op == "sdpa")
    assert sdpa.inputs[1].shape == (2, 1, 6, 8) and sdpa.inputs[0].shape == (2, 4, 3, 8)
    grads = append_backward(tracer, (out * ins["dout"]).sum().value,
                            [ins[n].value for n in "qkv"])
    tracer.graph.outputs = {"out": out.value, **{f"d{n}": g for n, g in zip("qkv", grads)}}
    got = run_graph(tracer.graph, feed)
    assert_judged([got[n] for n in ("out", "dq", "dk", "dv")], ref[torch.float64],
                  ref[torch.float32], "broadcast")


def test_sdpa_refuses_heads_that_do_not_group():
    tracer = Tracer()
    t = trace_inputs(tracer, {"q": np.zeros((2, 6, 3, 8), np.float32),
                              "k": np.zeros((2, 4, 5, 8), np.float32),
                              "v": np.zeros((2, 4, 5, 8), np.float32)})
    with pytest.raises(ShapeError, match="multiple"):
        tracer.emit("sdpa", [t[n].value for n in "qkv"], scale=1.0, causal=False)
    with pytest.raises(ShapeError, match="enable_gqa"):
        F.scaled_dot_product_attention(t["q"], t["k"], t["v"], enable_gqa=True)


# ---- the rewrite: masked sdpa on CUDA too; repeat_interleave'd k, v as grouped heads --------

class PaddedAttention(sg.nn.Module):
    """Attention written by hand with a key-padding mask given at run time, and k, v of two
    heads repeated for four query heads (Tensor.repeat_interleave)."""

    def forward(self, q, k, v, keep):
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        att = (q @ k.transpose(-2, -1)) * 0.25
        att = att.masked_fill(~keep, float("-inf"))
        return F.softmax(att, dim=-1) @ v


def test_the_rewrite_gives_cuda_masked_grouped_sdpa():
    """On a CUDA step's forward (built here without a GPU) the runtime mask becomes sdpa's
    mask input and the repeated k and v its grouped heads: no softmax, no repeat left."""
    assert masks_supported("cuda") and masks_supported("cpu")
    gen = seeded("padded")
    feed = {"q": randn(gen, 2, 4, 5, 16), "k": randn(gen, 2, 2, 5, 16),
            "v": randn(gen, 2, 2, 5, 16), "keep": gen.random((2, 1, 1, 5)) > 0.3}
    feed["keep"][..., 0] = True
    model = PaddedAttention()
    for device in ("cuda", "cpu"):
        tracer = Tracer()
        ins = trace_inputs(tracer, feed)
        out = model(*(ins[n] for n in ("q", "k", "v", "keep")))
        tracer.graph.outputs = {"y": out.value}
        graph = rewrite_forward_attention(tracer.graph, model, device)
        ops = [n.op for n in graph.nodes]
        assert ops.count("sdpa") == 1 and "softmax" not in ops and "expand" not in ops, ops
        sdpa = next(n for n in graph.nodes if n.op == "sdpa")
        assert sdpa.attrs["mask"] and sdpa.inputs[1] is ins["k"].value, device
        assert sdpa.inputs[2] is ins["v"].value
    got = run_graph(graph, feed)["y"]
    t = {n: torch.tensor(a, dtype=torch.float64) for n, a in feed.items() if n != "keep"}
    want = TF.scaled_dot_product_attention(t["q"], t["k"], t["v"],
                                           attn_mask=torch.tensor(feed["keep"]), scale=0.25,
                                           enable_gqa=True)
    t32 = {n: a.float() for n, a in t.items()}
    want32 = TF.scaled_dot_product_attention(t32["q"], t32["k"], t32["v"],
                                             attn_mask=torch.tensor(feed["keep"]), scale=0.25,
                                             enable_gqa=True)
    assert_close_to_reference(got, want.numpy(), want32.numpy(), "padded attention")


def test_one_repeated_operand_keeps_its_repeat():
    """k repeated but v not: no grouped heads (the repeat stays, sdpa reads the copy)."""
    tracer = Tracer()
    ins = trace_inputs(tracer, {"q": np.zeros((2, 4, 5, 8), np.float32),
                                "k": np.zeros((2, 2, 5, 8), np.float32),
                                "v": np.zeros((2, 4, 5, 8), np.float32)})
    k = ins["k"].repeat_interleave(2, dim=1)
    y = F.softmax(ins["q"] @ k.transpose(-2, -1), dim=-1) @ ins["v"]
    tracer.graph.outputs = {"y": y.value}
    graph = rewrite_attention(tracer.graph)
    sdpa = next(n for n in graph.nodes if n.op == "sdpa")
    assert sdpa.inputs[1].shape == (2, 4, 5, 8) and "expand" in [n.op for n in graph.nodes]
