"""precision="bf16" on the CPU: the rounding helper against torch's bfloat16 bit for bit, the
emulation's rounding points (a bf16 value is rounded once, by the node that writes it, after
float32 arithmetic), the dtype of every value of traced mlp, cnn and gpt steps (PyTorch CUDA
autocast's op lists, compile/autocast.py), the bf16 weight copies the optimizer's update
writes, and the typed error of a backend without bf16 kernels. The trajectories against
PyTorch's autocast are in tests/models/test_bf16_trajectory.py."""
from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

import stepgraph as sg
from stepgraph import api, losses, models, optim
from stepgraph.backends.numpy import NumpyBackend, bf16
from stepgraph.compile.autocast import (FP32, LOWER, POLICIES, autocast, check_bf16_support,
                                        parse_weight_copy, weight_copy_name)
from stepgraph.compile.build import build_predict_graph, build_train_graph
from stepgraph.compile.executable import INFERENCE, Executable
from stepgraph.compile.feed import signature_of
from stepgraph.compile.fuse import fuse
from stepgraph.compile.plan import make_plan
from stepgraph.errors import UnsupportedOpError, UnsupportedPrecisionError
from stepgraph.ir.graph import BF16, PARAM, STATE, Value
from stepgraph.ir.trace import Tracer
from tests.ops.helpers import randn, seeded

F32 = "float32"


def torch_bits(x: np.ndarray) -> np.ndarray:
    """torch's float32 -> bfloat16 conversion, as uint16 bits."""
    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(torch.bfloat16) \
        .view(torch.int16).numpy().view(np.uint16)


# ---- the rounding helper ------------------------------------------------------------------

def test_rounding_matches_torch_bit_for_bit():
    """Every bf16 value's float32 neighbourhood: all 2^16 upper halves with lower halves at
    0 (exact), just below / at / just above the tie 0x8000 (ties go to the even neighbour),
    0x7FFF, 0xFFFF and random ones: overflow to inf, subnormals, signed zeros included. NaN
    inputs give a NaN (0x7FC0; torch's vectorised conversion picks another NaN pattern)."""
    upper = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    lowers = [0, 0x7FFF, 0x8000, 0x8001, 0xFFFF] + \
        list(seeded("bf16-lowers").integers(1, 0xFFFF, 3))
    bits = np.concatenate([upper | np.uint32(lo) for lo in lowers])
    x = bits.view(np.float32)
    got, want = bf16.to_bits(x), torch_bits(x)
    nan = np.isnan(x)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    assert (got[nan] == 0x7FC0).all() and np.isnan(bf16.from_bits(want[nan])).all()
    # bf16 -> float32 is exact: torch's widening of every bf16 pattern.
    every = np.arange(1 << 16, dtype=np.uint16)
    widened = torch.from_numpy(every.view(np.int16)).view(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(bf16.from_bits(every).view(np.uint32),
                                  widened.view(np.uint32))


def test_round_bf16_keeps_shape_and_rank():
    assert bf16.round_bf16(np.float32(1 + 2**-9)).shape == ()
    assert bf16.round_bf16(np.ones((2, 0, 3))).shape == (2, 0, 3)
    t = np.arange(12, dtype=np.float32).reshape(3, 4).T        # non-contiguous
    np.testing.assert_array_equal(bf16.round_bf16(t), t)


def test_cast_op_matches_torch_forward_and_gradient():
    """cast (ops/cast.py) as torch's .to(torch.bfloat16) and its backward (grad.float())."""
    gen = seeded("cast-torch")
    x, g = randn(gen, 5, 7), randn(gen, 5, 7)
    t = torch.tensor(x, requires_grad=True)
    y = t.to(torch.bfloat16)
    y.backward(torch.tensor(g).to(torch.bfloat16))
    tracer = Tracer()
    xv = tracer.input(x.shape, F32, "x").value
    gv = tracer.input(g.shape, F32, "g").value
    (yv,) = tracer.emit("cast", [xv], dtype=BF16)
    (g16,) = tracer.emit("cast", [gv], dtype=BF16)
    from stepgraph.ir.ops import VJPS
    (dx,) = VJPS["cast"](tracer.emit, tracer.graph.nodes[0], [g16], lambda i: True)
    got = run(tracer.graph, {"x": x, "g": g}, {"y": yv, "dx": dx})
    np.testing.assert_array_equal(got["y"], y.float().detach().numpy())
    np.testing.assert_array_equal(got["dx"], t.grad.numpy())
    assert dx.dtype == F32


# ---- storage and rounding points ----------------------------------------------------------

def run(graph, arrays: dict, outputs: dict[str, Value]) -> dict[str, np.ndarray]:
    """Plan `graph` with `outputs`, run it once on the numpy backend; bf16 outputs are
    returned as their float32 values."""
    graph.outputs = dict(outputs)
    backend = NumpyBackend()
    step = np.array(3, np.int64)                       # the dropout step counter, if any
    exe = Executable(make_plan(graph), backend, lambda v: step, None, INFERENCE, None)
    exe.feed([arrays[v.name] for v in graph.inputs])
    exe.run_eager()
    return {k: backend.to_numpy(b) for k, b in exe.outputs.items()}


def test_bf16_values_take_two_bytes_and_are_held_as_bits():
    v = Value((3, 5), BF16)
    assert v.nbytes == 30
    tracer = Tracer()
    x = tracer.input((64, 64), F32, "x").value
    (y,) = tracer.emit("cast", [x], dtype=BF16)
    tracer.graph.outputs = {"y": y}
    plan = make_plan(tracer.graph)
    assert plan.slots[y].nbytes == 64 * 64 * 2
    exe = Executable(plan, NumpyBackend(), None, None, INFERENCE, None)
    assert exe.buffers[y].dtype == np.uint16 and exe.buffers[y].nbytes == 64 * 64 * 2


def autocast_forward(body, arrays: dict, fused: bool = False):
    """Trace body(tracer, tensors) on inputs named like `arrays`, autocast it, optionally
    fuse; returns (graph, output value)."""
    tracer = Tracer(seed=5)
    ins = {k: tracer.input(a.shape, str(a.dtype), k) for k, a in arrays.items()}
    out = body(tracer, ins)
    graph = autocast(tracer.graph)
    if fused:
        graph.outputs = {"out": out.value}
        graph = fuse(graph)
    return graph, out.value


def test_linear_rounds_its_inputs_and_once_its_output():
    """A bf16 GEMM: operands rounded to bf16 (the casts), products accumulated in float32, the
    bias added in float32, one rounding of the result (cuBLASLt's D)."""
    gen = seeded("linear-rounding")
    a = {"x": randn(gen, 6, 40), "w": randn(gen, 8, 40), "b": randn(gen, 8)}
    graph, y = autocast_forward(lambda t, i: sg.nn.functional.linear(i["x"], i["w"], i["b"]), a)
    assert y.dtype == BF16 and [n.op for n in graph.nodes] == ["cast"] * 3 + ["linear"]
    r = {k: bf16.round_bf16(v) for k, v in a.items()}
    want = bf16.round_bf16(r["x"] @ r["w"].T + r["b"])
    np.testing.assert_array_equal(run(graph, a, {"y": y})["y"], want)
    assert not np.array_equal(want, bf16.round_bf16(a["x"] @ a["w"].T + a["b"]))


@pytest.mark.parametrize("fused", [False, True])
def test_gelu_after_a_gemm_rounds_where_its_kernel_writes(fused):
    """Unfused: the GEMM writes round(z), the GELU kernel round(gelu(round(z))). Fused into
    the GEMM's epilogue (fuse_linear_activation): round(gelu(z)) from the float32 z, and the
    saved pre-activation round(z): one rounding per value a kernel writes."""
    gen = seeded("gelu-rounding")
    a = {"x": randn(gen, 16, 24), "w": randn(gen, 32, 24)}

    def body(t, i):
        return sg.nn.functional.gelu(sg.nn.functional.linear(i["x"], i["w"]))

    graph, y = autocast_forward(body, a, fused)
    assert [n.op for n in graph.nodes if n.op != "cast"] == (["linear"] if fused else
                                                             ["linear", "act"])
    from stepgraph.ops.activation import act_forward
    z = bf16.round_bf16(a["x"]) @ bf16.round_bf16(a["w"]).T
    want = bf16.round_bf16(act_forward(z if fused else bf16.round_bf16(z), "gelu"))
    np.testing.assert_array_equal(run(graph, a, {"y": y})["y"], want)


def test_dtype_preserving_ops_round_their_output_and_fp32_ops_do_not():
    """dropout of bf16 writes round(x * mask / (1 - p)); ReLU and max pooling write bf16 values
    exactly; log_softmax and sums run in float32 on the widened bf16 values (CUDA autocast's
    fp32 lists) and are not rounded; bf16 + float32 promotes to float32, bf16 + bf16 stays
    bf16 (rounded sum); x ** 2 is on the fp32 list, x * 2 keeps bf16."""
    gen = seeded("preserving")
    a = {"x": randn(gen, 4, 2, 6, 6) * 3, "w": randn(gen, 3, 2, 3, 3), "f": randn(gen, 4, 48)}

    def body(t, i):
        F = sg.nn.functional
        h = F.conv2d(i["x"], i["w"])                                   # bf16 (4, 3, 4, 4)
        outs["pool"] = p = F.max_pool2d(F.relu(h), 2)                   # bf16 (4, 3, 2, 2)
        outs["drop"] = d = F.dropout(h.reshape(4, 48), 0.3)             # bf16
        outs["lsm"] = d.log_softmax(-1)                                 # float32
        outs["sum"] = d.sum(1)                                          # float32
        outs["mixed"] = d + i["f"]                                      # float32
        outs["same"] = d + d                                            # bf16
        outs["pow"], outs["mul"] = d ** 2, d * 3.0                      # float32, bf16
        outs["h"] = h
        return p

    outs = {}
    graph, _ = autocast_forward(body, a)
    got = run(graph, a, {k: v.value for k, v in outs.items()})
    dtypes = {k: v.value.dtype for k, v in outs.items()}
    assert dtypes == dict(pool=BF16, drop=BF16, lsm=F32, sum=F32, mixed=F32, same=BF16,
                          pow=F32, mul=BF16, h=BF16)
    h = got["h"]
    assert np.array_equal(bf16.round_bf16(h), h)
    mask = got["drop"] != 0
    d = bf16.round_bf16(np.where(mask, h.reshape(4, 48) * np.float32(1 / 0.7), 0))
    np.testing.assert_array_equal(got["drop"], d)
    np.testing.assert_array_equal(
        got["pool"], np.maximum(h, 0).reshape(4, 3, 2, 2, 2, 2).max(axis=(3, 5)))
    np.testing.assert_allclose(got["lsm"], torch.log_softmax(torch.tensor(d), -1).numpy(),
                               rtol=1e-6, atol=1e-6)
    assert not np.array_equal(bf16.round_bf16(got["lsm"]), got["lsm"])    # not rounded
    np.testing.assert_allclose(got["sum"], d.sum(1), rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(got["mixed"], d + a["f"], rtol=1e-7)
    np.testing.assert_array_equal(got["same"], bf16.round_bf16(d + d))
    np.testing.assert_array_equal(got["pow"], d * d)
    np.testing.assert_array_equal(got["mul"], bf16.round_bf16(d * np.float32(3)))


# ---- the dtype of every value of traced steps ---------------------------------------------

def build(model, loss, x, y, precision="bf16", opt=None):
    return build_train_graph(model, loss, opt or optim.AdamW(lr=1e-3),
                             signature_of(("x", "y"), (x, y)), 0, precision=precision)


def forward_nodes(graph):
    return [n for n in graph.nodes if n.label == "loss seed" or not n.label.endswith("bwd")][
        :next(i for i, n in enumerate(graph.nodes) if n.label == "loss seed")]


def summary(nodes) -> list[tuple]:
    return [(n.op, tuple(v.dtype for v in n.inputs), tuple(v.dtype for v in n.outputs))
            for n in nodes]


B, I, U = BF16, "int64", "uint8"


def test_mlp_forward_dtypes():
    """models.mlp under autocast, op by op: the input cast to bf16 once for the first GEMM,
    the weights read from their bf16 copies, ReLU and dropout in bf16, the logits cast to
    float32 for the loss."""
    x, y = np.zeros((8, 784), np.float32), np.zeros(8, np.int64)
    g = build(models.mlp(dropout=0.1), losses.cross_entropy, x, y)
    assert summary(forward_nodes(g)) == [
        ("cast", (F32,), (B,)),
        ("linear", (B, B, B), (B,)), ("act", (B,), (B,)), ("dropout", (B, I), (B, U)),
        ("linear", (B, B, B), (B,)), ("act", (B,), (B,)), ("dropout", (B, I), (B, U)),
        ("linear", (B, B, B), (B,)),
        ("cast", (B,), (F32,)), ("cross_entropy", (F32, I), (F32, F32))]


def test_cnn_forward_dtypes():
    x, y = np.zeros((4, 1, 28, 28), np.float32), np.zeros(4, np.int64)
    g = build(models.cnn(dropout=0.5), losses.nll_loss, x, y)
    assert summary(forward_nodes(g)) == [
        ("cast", (F32,), (B,)),
        ("conv2d", (B, B, B), (B,)), ("maxpool2d", (B,), (B, "int32")), ("act", (B,), (B,)),
        ("conv2d", (B, B, B), (B,)), ("dropout", (B, I), (B, U)),
        ("maxpool2d", (B,), (B, "int32")), ("act", (B,), (B,)), ("reshape", (B,), (B,)),
        ("linear", (B, B, B), (B,)), ("act", (B,), (B,)), ("dropout", (B, I), (B, U)),
        ("linear", (B, B, B), (B,)),
        # the model's log_softmax and the nll_loss loss: one cross_entropy
        # (compile/cross_entropy_rewrite.py)
        ("cast", (B,), (F32,)), ("cross_entropy", (F32, I), (F32, F32))]


def gpt_graph():
    m = models.gpt(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=16, dropout=0.1)
    x = np.zeros((2, 8), np.int64)
    return build(m, models.next_token_loss, x, x)


def test_gpt_forward_dtypes():
    """Embeddings (on no list) return their float32 tables' dtype; layer_norm and the loss
    run in float32 (fp32 list); the GEMMs and attention (lower_precision_fp) in bf16, the
    attention's logsumexp float32; the residual stream is float32 (bf16 branch + float32
    stream promotes)."""
    g = gpt_graph()
    nodes = forward_nodes(g)
    by_op: dict[str, set] = {}
    for op, ins, outs in summary(nodes):
        by_op.setdefault(op, set()).add((ins, outs))
    assert by_op["embedding"] == {((F32, I), (F32,))}
    assert by_op["layer_norm"] == {((F32, F32, F32), (F32, F32, F32))}
    assert by_op["linear"] == {((B, B, B), (B,)), ((B, B), (B,))}      # lm_head: no bias
    attention = by_op.get("sdpa") or by_op["bmm"]
    assert all(set(ins[:3]) == {B} for ins, _ in attention)
    assert by_op["binary"] == {((F32, F32), (F32,))}                  # residual adds
    assert by_op["act"] == {((B,), (B,))}                             # GELU
    assert by_op["cross_entropy"] == {((F32, I), (F32, F32))}


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt"])
def test_every_value_of_a_train_step_has_its_autocast_dtype(name):
    """The whole step, forward, backward and update, before and after fusion: GEMM-like ops
    read and write bf16; fp32-list ops float32; no op mixes bf16 and float32 operands where
    torch would promote; every cast converts float32 <-> bf16; no parameter is cast inside
    the step (its copy is state); parameters and the optimizer's slots are float32, the
    copies bf16 and written by the update; the gradients the update reads are float32, or
    after fusion the bf16 gradients of copies (fuse_gradient_casts)."""
    if name == "gpt":
        graph = gpt_graph()
    else:
        x = np.zeros((4, 784) if name == "mlp" else (4, 1, 28, 28), np.float32)
        graph = build(getattr(models, name)(), losses.cross_entropy if name == "mlp"
                      else losses.nll_loss, x, np.zeros(4, np.int64))
    for fused, g in enumerate((graph, fuse(graph))):
        for n in g.nodes:
            floats = [v.dtype for v in [*n.inputs, *n.outputs] if v.dtype in (F32, B)]
            if n.op in ("linear", "matmul", "bmm", "conv2d", "conv2d_grad_input",
                        "conv2d_grad_weight"):
                assert set(floats) == {B}, n
            elif n.op == "cross_entropy_train" and fused:
                # fuse_loss_casts: bf16 logits in, bf16 dlogits out, a float32 loss
                assert n.outputs[0].dtype == F32 and \
                    n.inputs[0].dtype == n.outputs[1].dtype, n
            elif n.op in ("layer_norm", "layer_norm_grad") and fused:
                # fuse_layer_norm_casts: y (forward) or dy (backward) may be bf16;
                # fuse_norm_grad_casts: dx too, or its dx_half copy beside a float32 dx (and
                # the uint8 keep mask of a dropout's gradient it applies to the copy);
                # fuse_norm_grad_bias_sums: the copy's column sum, a Linear's bias gradient
                loose = [n.outputs[0]] if n.op == "layer_norm" else [n.inputs[0], n.outputs[0]]
                if n.attrs.get("dx_half"):
                    loose.append(n.outputs[-2 if n.attrs.get("dx_sum") else -1])
                if n.attrs.get("dx_sum"):
                    loose.append(n.outputs[-1])
                if n.attrs.get("dx_half_dropout"):
                    loose.append(n.inputs[-1])
                assert {v.dtype for v in [*n.inputs, *n.outputs] if v not in loose} == {F32}, n
            elif n.op in ("layer_norm", "layer_norm_grad", "softmax", "softmax_grad",
                          "log_softmax", "log_softmax_grad", "cross_entropy",
                          "cross_entropy_grad", "cross_entropy_train", "nll_loss"):
                assert set(floats) == {F32}, n
            elif n.op in ("binary", "add", "act", "act_grad", "act_bias_grad", "dropout",
                          "dropout_grad", "maxpool2d", "maxpool2d_grad"):
                assert len(set(floats)) == 1, n
            elif n.op == "cast":
                assert {n.inputs[0].dtype, n.attrs["dtype"]} == {F32, B}, n
                assert n.inputs[0].role != PARAM, n
        update = next(n for n in g.nodes if n.op == "adam_update")
        k, p = update.attrs["n_scalars"], update.attrs["n_params"]
        params, grads = update.inputs[k:k + p], update.inputs[k + p:k + 2 * p]
        slots = update.inputs[k + 2 * p:k + 4 * p]
        copies = update.inputs[k + 4 * p:]
        assert {v.dtype for v in params + slots} == {F32}
        copied = {params[i] for i in update.attrs["copies"]}
        assert all(g.dtype == F32 or (fused and p in copied) for p, g in zip(params, grads))
        assert copies and {v.dtype for v in copies} == {B}
        assert all(v.role == STATE and v.name == weight_copy_name(params[i].name)
                   for v, i in zip(copies, update.attrs["copies"]))
        assert set(update.mutates) >= {update.inputs.index(c) for c in copies}


def test_fp32_steps_are_unchanged():
    """precision fp32 (the default) builds exactly the graph it built before bf16 existed:
    no casts, no bf16 value, no weight copies."""
    x, y = np.zeros((4, 784), np.float32), np.zeros(4, np.int64)
    model = models.mlp()
    default = build_train_graph(model, losses.cross_entropy, optim.AdamW(lr=1e-3),
                                signature_of(("x", "y"), (x, y)), 0)
    fp32 = build(model, losses.cross_entropy, x, y, precision="fp32")
    assert summary(default.nodes) == summary(fp32.nodes)
    assert not [n for n in fp32.nodes if n.op == "cast"]
    assert all(v.dtype != B for n in fp32.nodes for v in [*n.inputs, *n.outputs])
    assert "copies" not in next(n for n in fp32.nodes if n.op == "adam_update").attrs


def test_every_forward_op_has_a_reviewed_policy():
    """The ops a traced forward can hold are each on a policy list (compile/autocast.py says
    which torch list and why); GEMM-like ops lower, the fp32 list's ops float32."""
    assert {POLICIES[op] for op in ("linear", "matmul", "bmm", "conv2d", "sdpa")} == {LOWER}
    assert {POLICIES[op] for op in ("softmax", "log_softmax", "layer_norm", "cross_entropy",
                                    "nll_loss", "mse", "reduce_sum")} == {FP32}


# ---- master weights: the bf16 copies the update writes ------------------------------------

def mlp_step(opt, on_bad_batch="raise"):
    gen = seeded("copies")
    model = models.mlp(in_features=20, hidden=16, classes=5, dropout=0.0)
    x, y = randn(gen, 8, 20), gen.integers(0, 5, 8)
    step = sg.compile_train_step(model, losses.cross_entropy, opt, (x, y), precision="bf16",
                                 on_bad_batch=on_bad_batch)
    return model, step, x, y


def copies_of(step) -> dict[str, np.ndarray]:
    return {parse_weight_copy(k)[0]: step.backend.to_numpy(v)
            for k, v in step.state.items() if parse_weight_copy(k) is not None}


@pytest.mark.parametrize("opt", [lambda: optim.AdamW(lr=1e-2),
                                 lambda: optim.SGD(lr=0.1, momentum=0.9)])
def test_update_writes_the_bf16_copy_of_every_weight(opt):
    model, step, x, y = mlp_step(opt())
    copies = copies_of(step)
    assert set(copies) == {k for k, _ in model.named_parameters()}
    for k, p in model.named_parameters():                   # made when the step was built
        np.testing.assert_array_equal(copies[k], bf16.round_bf16(p.numpy()))
    before = model.state_dict()
    for _ in range(3):
        step(x, y)
    copies = copies_of(step)
    for k, p in model.named_parameters():
        assert not np.array_equal(p.numpy(), before[k])
        np.testing.assert_array_equal(copies[k], bf16.round_bf16(p.numpy()))
    assert not any(parse_weight_copy(k) for k in step.state_dict())


def test_channels_last_copies_hold_the_permuted_weights():
    """With memory_format="channels_last" (compile/layout.py) a conv weight enters the forward
    as a permute (or, for one input channel, a reshape) of its parameter: the update writes
    the bf16 copy in that layout (attrs copy_dims), so no step permutes or casts a weight,
    and the run is the contiguous run's."""
    gen = seeded("channels-last")
    x, y = randn(gen, 8, 1, 28, 28), gen.integers(0, 10, 8)
    runs = {}
    for fmt in ("contiguous", "channels_last"):
        model = models.cnn(dropout=0.0)
        model.load_state_dict(runs.setdefault("init", model.state_dict()))
        step = sg.compile_train_step(model, losses.nll_loss, optim.AdamW(lr=1e-3), (x, y),
                                     precision="bf16", memory_format=fmt)
        runs[fmt] = [float(step(x, y)) for _ in range(3)]
        graph = next(iter(step.executables.values())).plan.graph
        assert not [n for n in graph.nodes if n.op in ("cast", "permute", "reshape")
                    and n.inputs[0].role == PARAM]
        params = dict(model.named_parameters())
        for k, buf in step.state.items():
            if parse_weight_copy(k) is not None:
                name, dims = parse_weight_copy(k)
                p = params[name].numpy()
                want = (p if dims is None else p.transpose(dims)).reshape(buf.shape)
                np.testing.assert_array_equal(step.backend.to_numpy(buf), bf16.round_bf16(want))
        if fmt == "channels_last":
            update = next(n for n in graph.nodes if n.op == "adam_update")
            assert (0, 2, 3, 1) in update.attrs["copy_dims"]
    np.testing.assert_allclose(runs["channels_last"], runs["contiguous"], rtol=1e-6)


def test_a_skipped_step_leaves_the_copies_alone():
    model, step, x, y = mlp_step(optim.AdamW(lr=1e-2), on_bad_batch="skip")
    step(x, y)
    copies, params = copies_of(step), model.state_dict()
    bad = x.copy()
    bad[0, 0] = np.nan
    step(bad, y)
    assert step.skipped_steps == 1
    for k, v in copies_of(step).items():
        np.testing.assert_array_equal(v, copies[k])
        np.testing.assert_array_equal(model.state_dict()[k], params[k])


def test_loading_parameters_refreshes_the_copies():
    """model.load_state_dict (or step.load_state_dict) writes the float32 parameters; the
    next step's forward reads the new weights' bf16 copies, as a fresh step would."""
    model, step, x, y = mlp_step(optim.SGD(lr=0.1))
    step(x, y)
    other = models.mlp(in_features=20, hidden=16, classes=5, dropout=0.0)
    model.load_state_dict(other.state_dict())
    loss = float(step(x, y))
    fresh = sg.compile_train_step(other, losses.cross_entropy, optim.SGD(lr=0.1), (x, y),
                                  precision="bf16")
    assert loss == float(fresh(x, y))
    saved = step.state_dict()
    step(x, y)
    step.load_state_dict(saved)
    for k, p in model.named_parameters():
        np.testing.assert_array_equal(copies_of(step)[k], bf16.round_bf16(p.numpy()))


def bf16_run(monkeypatch, passes, model, loss, opt, batch, steps: int = 3, **step_args):
    """Losses (their bits), parameters and plan graph of `steps` bf16 steps of `model` on
    numpy with the fusion passes `passes`."""
    import stepgraph.api
    from stepgraph.compile import fuse as fuse_module

    monkeypatch.setattr(stepgraph.api, "fuse", lambda g: fuse_module.fuse(g, passes=passes))
    step = sg.compile_train_step(model, loss, opt, batch, precision="bf16", **step_args)
    losses_ = [np.float32(step(*batch)).tobytes() for _ in range(steps)]
    return losses_, model.state_dict(), next(iter(step.executables.values())).plan.graph


def assert_same_run(got, want):
    assert got[0] == want[0]
    for key in want[1]:
        np.testing.assert_array_equal(got[1][key], want[1][key], err_msg=key)


def cnn_bf16_run(monkeypatch, opt, passes, max_grad_norm=None, steps: int = 3,
                 memory_format: str = "auto"):
    """bf16_run of guarded cnn steps."""
    gen = seeded("gradient-casts")
    batch = randn(gen, 8, 1, 28, 28), gen.integers(0, 10, 8)
    model = models.cnn(dropout=0.0)
    model.load_state_dict(_initial_cnn_state())
    opt.max_grad_norm = max_grad_norm
    return bf16_run(monkeypatch, passes, model, losses.nll_loss, opt, batch, steps,
                    on_bad_batch="raise", memory_format=memory_format)


@functools.cache
def _initial_cnn_state() -> dict:
    """One initialisation shared by the fused and unfused runs."""
    return models.cnn(dropout=0.0).state_dict()


@pytest.mark.parametrize("clip", [None, 1.0])
@pytest.mark.parametrize("opt", [lambda: optim.AdamW(lr=1e-2),
                                 lambda: optim.SGD(lr=0.1, momentum=0.9)])
def test_casts_around_the_loss_and_the_gradients_are_dropped(monkeypatch, opt, clip):
    """fuse_gradient_casts: the gradient of each weight's bf16 copy reaches the update, the
    clipping norm and the guard's check as it is, no cast to float32 between (each widens it
    as it loads it, exactly). fuse_loss_casts: the loss reads the bf16 logits and writes bf16
    dlogits. Three steps give the bits of the graph with the casts."""
    from stepgraph.compile.fuse import PASSES, fuse_gradient_casts, fuse_loss_casts

    want = cnn_bf16_run(monkeypatch, opt(), tuple(
        p for p in PASSES if p not in (fuse_gradient_casts, fuse_loss_casts)), clip)
    got = cnn_bf16_run(monkeypatch, opt(), PASSES, clip)
    for graph, n_casts in ((want[2], 8), (got[2], 0)):
        update = next(n for n in graph.nodes if n.op.endswith("_update"))
        k, n = update.attrs["n_scalars"], update.attrs["n_params"]
        grads = update.inputs[k + n:k + 2 * n]
        assert sum(g.dtype == BF16 for g in grads) == 8 - n_casts
        assert len([c for c in graph.nodes if c.op == "cast" and c.outputs[0] in grads]) \
            == n_casts
        readers = ["guard_check"] + (["global_norm"] if clip else [])
        for reader in readers:
            assert set(grads) <= set(next(n for n in graph.nodes if n.op == reader).inputs)
    loss = next(n for n in got[2].nodes if n.op == "cross_entropy_train")
    assert [v.dtype for v in loss.inputs[:1] + loss.outputs] == [B, F32, B]
    assert [n.op for n in got[2].nodes].count("cast") == 1          # the input's
    assert [n.op for n in want[2].nodes].count("cast") == 11
    assert_same_run(got, want)


def test_gradient_casts_move_past_the_permutes_of_channels_last_weights(monkeypatch):
    """Under channels-last a conv weight's bf16 copy is KRSC, so its gradient reaches the
    float32 update through cast -> permute (or reshape) back to OIHW: fuse_gradient_casts
    moves each such copy before the cast, which then goes, and the update reads the bf16
    gradient. The steps give the bits of the graph with the casts."""
    from stepgraph.compile.fuse import PASSES, fuse_gradient_casts

    # the permutes stay for the update to read through (compile/update_permutes.py drops them)
    monkeypatch.setattr(api, "read_gradients_through_permutes", lambda graph: graph)
    runs = [cnn_bf16_run(monkeypatch, optim.SGD(lr=0.1, momentum=0.9), passes,
                         memory_format="channels_last")
            for passes in (tuple(p for p in PASSES if p is not fuse_gradient_casts), PASSES)]
    want, got = runs
    for graph, casts in ((want[2], 8), (got[2], 0)):
        update = next(n for n in graph.nodes if n.op == "sgd_update")
        k, n = update.attrs["n_scalars"], update.attrs["n_params"]
        grads = update.inputs[k + n:k + 2 * n]
        producers = graph.producers()
        weights = [g for g in grads if len(g.shape) == 4]
        assert len(weights) == 2
        # the conv weights' gradients come out of a permute (or a view) in both graphs
        assert {producers[g].op for g in weights} <= {"permute", "reshape"}
        assert [g.dtype for g in weights] == [BF16 if not casts else F32] * 2
        widened = [c for c in graph.nodes if c.op == "cast" and c.attrs["dtype"] == F32
                   and c.inputs[0].dtype == BF16]
        assert len(widened) == casts
    assert_same_run(got, want)


def gpt_bf16_run(monkeypatch, passes):
    """bf16_run of AdamW steps (with clipping) of a two-layer gpt."""
    gen = seeded("gpt-bf16-casts")
    batch = tuple(gen.integers(0, 11, (2, 8)).astype(np.int64) for _ in range(2))
    model = models.gpt(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16,
                       dropout=0.1)
    model.load_state_dict(_initial_gpt_state())
    return bf16_run(monkeypatch, passes, model, models.next_token_loss,
                    optim.AdamW(lr=1e-2, max_grad_norm=1.0), batch)


@functools.cache
def _initial_gpt_state() -> dict:
    return models.gpt(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16,
                      dropout=0.1).state_dict()


def _casts(graph) -> list:
    return [n for n in graph.nodes if n.op == "cast"]


def test_layer_norm_reads_and_writes_bf16_around_the_gemms(monkeypatch):
    """fuse_layer_norm_casts on a bf16 gpt step: every LayerNorm (the residual sums' are
    add_layer_norm: compile/norm_rewrite.py) writes its y in bf16 for the GEMM after it and
    every LayerNorm gradient reads that GEMM's bf16 dx (through the views between), no cast
    left there; three steps give the bits of the graph with the casts."""
    from stepgraph.compile.fuse import PASSES, fuse_layer_norm_casts

    want = gpt_bf16_run(monkeypatch, tuple(p for p in PASSES if p is not fuse_layer_norm_casts))
    got = gpt_bf16_run(monkeypatch, PASSES)
    norms = [n for n in got[2].nodes if n.op in ("layer_norm", "add_layer_norm")]
    grads = [n for n in got[2].nodes if n.op in ("layer_norm_grad", "add_layer_norm_grad")]
    assert len(norms) == len(grads) == 5
    assert all(n.outputs[0].dtype == B for n in norms)
    assert all(n.inputs[0].dtype == B and n.outputs[0].dtype == F32 for n in grads)
    assert not any("layer_norm" in n.op for c in _casts(got[2])
                   for n in [got[2].producers().get(c.inputs[0])] if n is not None)
    assert_same_run(got, want)


def test_casts_join_the_pointwise_programs_around_them(monkeypatch):
    """Without the add_layer_norm rewrite (which reads the bf16 dropouts' outputs itself and
    takes the residual gradient's sum into its backward: tests/unit/test_norm_rewrite_bf16.py)
    the casts of a bf16 gpt step sit between its bf16 dropouts and the float32 residual
    stream: fuse_pointwise takes them into mixed programs (a bf16 dropout, its widening and
    the float32 residual add; a float32 gradient sum, its rounding and the bf16 dropout
    gradient), so no cast launch is left; the bits are those of the unfused nodes."""
    from stepgraph.compile.fuse import PASSES
    from stepgraph.compile.norm_rewrite import ADD_LAYER_NORM_SWITCH
    from stepgraph.compile.pointwise import fuse_pointwise

    monkeypatch.setenv(ADD_LAYER_NORM_SWITCH, "0")
    want = gpt_bf16_run(monkeypatch, tuple(p for p in PASSES if p is not fuse_pointwise))
    got = gpt_bf16_run(monkeypatch, PASSES)
    assert len(_casts(want[2])) >= 8 and not _casts(got[2])
    mixed = [n for n in got[2].nodes if n.op == "pointwise" and
             {v.dtype for v in n.inputs + n.outputs} >= {B, F32}]
    assert {tuple(i.op for i in n.attrs["program"]) for n in mixed} >= {
        ("dropout_mask", "dropout_grad", "cast", "binary"), ("add", "cast", "dropout_grad")}
    assert_same_run(got, want)


# ---- predictors, errors -------------------------------------------------------------------

def test_predictor_returns_float32_close_to_fp32():
    gen = seeded("predict")
    model = models.mlp(in_features=20, hidden=64, classes=5)
    x = randn(gen, 8, 20)
    p16 = sg.compile_predict(model, (x,), precision="bf16")
    out = p16(x)
    graph = build_predict_graph(model, signature_of(("x",), (x,)), precision="bf16")
    assert graph.outputs["output"].dtype == F32 and out.dtype == np.float32
    want = sg.compile_predict(model, (x,))(x)
    assert np.abs(out - want).max() <= 2**-6 * np.abs(want).max()     # a few bf16 ulps
    assert not np.array_equal(out, want)


def test_tf32_still_needs_cuda_and_bf16_runs_on_the_cpu():
    model = models.mlp(in_features=4, hidden=8, classes=3)
    x, y = np.zeros((2, 4), np.float32), np.zeros(2, np.int64)
    with pytest.raises(ValueError, match="tf32"):
        sg.compile_train_step(model, losses.cross_entropy, optim.SGD(lr=0.1), (x, y),
                              precision="tf32")
    with pytest.raises(ValueError, match="precision"):
        sg.compile_train_step(model, losses.cross_entropy, optim.SGD(lr=0.1), (x, y),
                              precision="fp8")
    step = sg.compile_train_step(model, losses.cross_entropy, optim.SGD(lr=0.1), (x, y),
                                 precision="bf16")
    assert math.isfinite(float(step(x, y)))


def test_a_backend_without_bf16_kernels_refuses_with_a_typed_error(monkeypatch):
    """A backend declaring which ops take bf16 (`bf16_ops`, the CUDA backend: the families'
    BF16_OPS) refuses a bf16 step holding any other op on bf16 values, naming them, before
    anything is allocated or run."""
    monkeypatch.setattr(NumpyBackend, "bf16_ops", frozenset({"cast"}), raising=False)
    model = models.mlp(in_features=4, hidden=8, classes=3)
    x, y = np.zeros((2, 4), np.float32), np.zeros(2, np.int64)
    with pytest.raises(UnsupportedPrecisionError, match=r"linear.*adam_update") as err:
        sg.compile_train_step(model, losses.cross_entropy, optim.AdamW(lr=0.1), (x, y),
                              precision="bf16")
    assert isinstance(err.value, (UnsupportedOpError, NotImplementedError))
    assert "cast" not in str(err.value).split("kernels yet for")[1].split(";")[0].split(", ")
    step = sg.compile_train_step(model, losses.cross_entropy, optim.AdamW(lr=0.1), (x, y))
    assert math.isfinite(float(step(x, y)))                  # fp32 steps are not checked


@pytest.mark.parametrize("name", ["mlp", "big"])
def test_cuda_accepts_the_bf16_dense_steps(name):
    """The CUDA families declare bf16 kernels for every op of the fused bf16 mlp and big
    steps (importable without a GPU): check_bf16_support lets them through; an op no family
    declares is still refused."""
    pytest.importorskip("cupy")
    from stepgraph.backends.cuda.backend import declared_bf16_ops

    declared = declared_bf16_ops()
    assert {"cast", "linear", "matmul", "reduce_sum", "dropout", "dropout_grad",
            "act_bias_grad", "adam_update", "sgd_update"} <= declared
    model = models.mlp(in_features=16, hidden=8) if name == "mlp" else models.big(width=16,
                                                                                 depth=2)
    x, y = np.zeros((4, 16), np.float32), np.zeros(4, np.int64)
    graph = fuse(build(model, losses.cross_entropy, x, y))
    assert any(n.op == "act_bias_grad" and n.inputs[0].dtype == BF16 for n in graph.nodes)
    check_bf16_support(graph, declared, "cuda")
    with pytest.raises(UnsupportedPrecisionError, match="linear"):
        check_bf16_support(graph, declared - {"linear"}, "cuda")
    check_bf16_support(graph, None, "cpu")
