"""precision="bf16": PyTorch's CUDA autocast(dtype=torch.bfloat16) as a pass over the forward;
precision="fp16" the same with dtype=torch.float16 (the same op lists; no weight copies: the
forward casts each weight, as torch's autocast does, and its VJP widens the gradient).

    trace -> autocast -> autodiff -> bind_weight_copies -> optimizer -> fuse -> plan

`autocast` runs on the freshly traced forward and loss, before autodiff, so every VJP sees the
dtypes torch's autograd would (a matmul's backward runs in bf16 because its forward did;
backward ops are never autocast, as in torch). It inserts `cast` nodes (ops/cast.py) in front
of the nodes whose autocast policy wants another input dtype, then re-infers every output's
dtype from its op's shape rule (outputs follow their inputs: a bf16 GEMM writes bf16, a ReLU of
bf16 is bf16). Values keep their identity; only their dtype changes.

Policies follow torch's CUDA op lists (aten/src/ATen/autocast_mode.h); each op below says which
list it is on. float64 values are never cast (autocast leaves doubles alone; the NumPy
reference's exact mode stays exact).

Where values are rounded to bf16 (the NumPy backend emulates it bit for bit, NumpyBackend):
exactly where a node writes a bf16 output, once, after computing everything in float32. So a
GEMM rounds its D once (float32 accumulation, bias and activation epilogue in float32), a cast
rounds, a ReLU/dropout/pool of bf16 rounds its output (a no-op for ReLU and max pooling, whose
outputs are inputs), and a fused kernel rounds only what it writes.

Master weights: parameters, their gradients as the optimizer reads them and the optimizer
state stay float32. The bf16 copy of a weight that a GEMM reads is not a per-step cast: after
autodiff, `bind_weight_copies` turns each cast of a parameter into a `state` value
(`autocast.bf16.<param>`) and the optimizer's one update launch writes it (attrs `copies` of
sgd_update / adam_update: after updating parameter i it stores bf16(p_i) into its copy; attrs
copy_dims transposes it, which takes the channels-last pass's per-step permute of a conv
weight into the update too). The first copy is made when the step binds its state (api.py),
and again whenever the parameters are loaded. A predict graph keeps its casts (no optimizer
writes copies there).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import UnsupportedPrecisionError
from ..ir.graph import BF16, FP16, HALF_DTYPES, PARAM, STATE, Graph, Node, Value
from ..ir.ops import infer_outputs
from .concat_casts import narrow_concats
from .plan import VIEW_OPS

PRECISION = "bf16"
FP16_PRECISION = "fp16"
# precision -> the dtype autocast lowers to
LOW_DTYPES = {PRECISION: BF16, FP16_PRECISION: FP16}

LOWER, FP32, PROMOTE, KEEP = "lower_precision_fp", "fp32", "promote", "keep"

# op -> policy. LOWER: float32 inputs cast to bf16 (bias included: torch casts every input).
# FP32: bf16 inputs cast to float32. PROMOTE: bf16 inputs cast to float32 when another input
# is float32 (torch's type promotion of two tensors; no autocast list). KEEP: no autocast list,
# runs in the dtype it is given (a bf16 input gives a bf16 output).
POLICIES = {
    # CUDA lower_precision_fp list: linear, mm/matmul, bmm, conv2d (tensor-core GEMMs).
    "linear": LOWER,
    "matmul": LOWER,
    "bmm": LOWER,
    "conv2d": LOWER,
    "conv3d": LOWER,
    # conv_transpose2d (torch's list has it) runs as conv2d's data gradient
    "conv2d_grad_input": LOWER,
    # scaled_dot_product_attention is on the list too (flash attention: bf16 q, k, v and
    # output, the softmax and its logsumexp in float32 inside the kernel).
    "sdpa": LOWER,
    # CUDA fp32 list: layer_norm (torch runs it, and returns, in float32); the losses nll_loss
    # and mse_loss. cross_entropy is composite in torch: log_softmax (fp32_set_opt_dtype) then
    # nll_loss (fp32), so float32 too.
    "layer_norm": FP32,
    "nll_loss": FP32,
    "cross_entropy": FP32,
    "mse": FP32,
    # CUDA fp32_set_opt_dtype list (run with dtype=float32): softmax, log_softmax, sum. A
    # stepgraph mean is sum / count, so it stays float32 too (torch's mean is on no list and
    # returns bf16 from a float32 accumulation; ours skips that last rounding).
    "softmax": FP32,
    "log_softmax": FP32,
    "reduce_sum": FP32,
    # Two tensors: torch's type promotion (bf16 + float32 -> float32; bf16 + bf16 -> bf16).
    "binary": PROMOTE,
    "add": PROMOTE,
    "concat": PROMOTE,              # torch.cat / stack are on the CUDA promote list
    # On no list: dtype-preserving in torch autocast. Activations (relu, leaky_relu, gelu,
    # sigmoid, tanh, silu), dropout, pooling, views and copies of shape; `scalar` with a Python
    # number keeps the tensor's dtype (torch does not promote a tensor by a Python scalar),
    # except pow and rdiv below.
    "act": KEEP,
    "dropout": KEEP,
    "maxpool2d": KEEP,
    "avgpool2d": KEEP,
    "maxpool3d": KEEP,
    "avgpool3d": KEEP,
    "reshape": KEEP,
    "permute": KEEP,
    "slice": KEEP,
    "expand": KEEP,
    "triangle": KEEP,               # tril / triu
    "scalar": KEEP,
    "cast": KEEP,
    # batch_norm is on no CUDA list: cuDNN's BatchNorm takes a bf16 x with float32 weight,
    # bias and running statistics and writes a bf16 y; its statistics are float32.
    "batch_norm_train": KEEP,
    # embedding is on no list: it returns its (float32 master) weight's dtype.
    "embedding": KEEP,
    "fill": KEEP,
    "arange": KEEP,
    "constant": KEEP,
    "stop_gradient": KEEP,
    # Elementwise math (ops/unary.py): sqrt, abs, sign, sin, cos, erf are on no list;
    # FP32_UNARY_KINDS below are on the fp32 list. Comparisons, where and masked_fill are on
    # no list: two tensors promote, a mask or a number keeps the tensor's dtype.
    "unary": KEEP,
    "compare": PROMOTE,
    "compare_scalar": KEEP,
    "logical": KEEP,
    "logical_not": KEEP,
    "where": PROMOTE,
    "masked_fill": KEEP,
}
# `scalar` kinds on the CUDA fp32 list: pow (x ** v, v ** x) and rdiv (v / x = v *
# reciprocal(x)); the binary pow; the unary kinds exp, log, log1p, expm1 and rsqrt.
FP32_SCALAR_KINDS = ("pow", "rpow", "rdiv")
FP32_KINDS = {"scalar": FP32_SCALAR_KINDS, "binary": ("pow",),
              "unary": ("exp", "log", "log1p", "expm1", "rsqrt")}
# An op missing above runs in float32 (its bf16 inputs cast up): safe until it is reviewed.
DEFAULT_POLICY = FP32

# State names of the weight copies the optimizer writes (weight_copy_name): the bf16 copies,
# and the float32 transposed copies of a channels-last step (compile/weight_permutes.py).
WEIGHT_COPY_PREFIX = "autocast.bf16"
PERMUTED_WEIGHT_PREFIX = "layout.float32"


@dataclass(frozen=True)
class WeightCopy:
    """A parameter's bf16 copy that the optimizer's update writes: the state `value` holds
    bf16(param.transpose(dims)) with value's shape (dims None: no transpose; a reshape needs
    none). What the forward read through a cast of the parameter, or of a permute or reshape
    of it (the channels-last pass's conv weights, compile/layout.py)."""

    param: Value
    value: Value
    dims: tuple[int, ...] | None = None


def policy_of(node: Node) -> str:
    if node.attrs.get("kind") in FP32_KINDS.get(node.op, ()):
        return FP32
    return POLICIES.get(node.op, DEFAULT_POLICY)


def _wanted(node: Node, inputs: list[Value], low: str) -> list[str]:
    """The dtype each input should have under the node's policy (`low`: bf16 or float16)."""
    policy = policy_of(node)
    dtypes = [v.dtype for v in inputs]
    if policy == LOWER:
        return [low if d == "float32" else d for d in dtypes]
    if policy == FP32 or (policy == PROMOTE and "float32" in dtypes):
        return ["float32" if d in HALF_DTYPES else d for d in dtypes]
    return dtypes


def autocast(graph: Graph, low: str = BF16) -> Graph:
    """Apply the autocast policies to a traced forward (+ loss) graph, in place: cast nodes
    are inserted where a node wants another input dtype (one cast per value and dtype, shared
    by every reader), and every node's outputs take the dtype its shape rule infers; then a
    promoted float32 concat that is only cast back to `low` runs in `low`
    (compile/concat_casts.py: the same bits). `low`: the dtype of the lower_precision_fp list
    (bfloat16, or float16 for precision="fp16")."""
    casts: dict[tuple[Value, str], Value] = {}
    nodes: list[Node] = []
    for node in graph.nodes:
        inputs = list(node.inputs)
        for i, (v, dtype) in enumerate(zip(inputs, _wanted(node, inputs, low))):
            if dtype == v.dtype:
                continue
            if (v, dtype) not in casts:
                (spec,) = infer_outputs("cast", [v], {"dtype": dtype})
                out = Value(*spec)
                nodes.append(Node("cast", [v], [out], {"dtype": dtype}, (), node.label))
                casts[v, dtype] = out
            inputs[i] = casts[v, dtype]
        node.inputs = inputs
        for v, (shape, dtype) in zip(node.outputs, infer_outputs(node.op, inputs, node.attrs)):
            assert tuple(shape) == v.shape, (node, shape)
            v.dtype = dtype
        nodes.append(node)
    graph.nodes = nodes
    return narrow_concats(graph, low)


def as_float32(graph: Graph, v: Value, label: str = "") -> Value:
    """v, or a cast of a bf16 or float16 v to float32 appended to the graph (a step's outputs
    reach the host as float32, as an autocast forward's are used in float32 code)."""
    if v.dtype not in HALF_DTYPES:
        return v
    out = Value(v.shape, "float32")
    graph.nodes.append(Node("cast", [v], [out], {"dtype": "float32"}, (), label))
    return out


def weight_copy_name(param_name: str, dims: tuple[int, ...] | None = None,
                     shape: tuple[int, ...] | None = None,
                     prefix: str = WEIGHT_COPY_PREFIX) -> str:
    """"autocast.bf16.<param>"; "autocast.bf16@<dims>.<param>" for a transposed copy,
    "autocast.bf16#<shape>.<param>" for a reshaped one (a 1x1 conv's weight in channels-last
    order), so that a name always names one shape: the steps of both layouts, built side by
    side (compile/layout_choice.py), bind their copies by name. A float32 copy's name starts
    with PERMUTED_WEIGHT_PREFIX instead."""
    tag = "" if dims is None else "@" + "".join(map(str, dims))
    if dims is None and shape is not None:
        tag = "#" + "x".join(map(str, shape))
    return f"{prefix}{tag}.{param_name}"


def parse_weight_copy(state_name: str) -> tuple[str, tuple[int, ...] | None] | None:
    """(parameter name, dims) of a weight copy's state name, bf16 or float32; None for other
    state. A reshaped copy's dims are None (copy_values reshapes to the buffer's shape)."""
    prefix = next((p for p in (WEIGHT_COPY_PREFIX, PERMUTED_WEIGHT_PREFIX)
                   if state_name.startswith(p)), None)
    if prefix is None:
        return None
    tag, dot, param = state_name[len(prefix):].partition(".")
    if not dot or (tag and tag[0] not in "@#"):
        return None
    return param, (tuple(int(d) for d in tag[1:]) if tag.startswith("@") else None)


def is_bf16_copy(state_name: str) -> bool:
    """Whether a weight copy's state name (parse_weight_copy) names a bf16 copy."""
    return state_name.startswith(WEIGHT_COPY_PREFIX)


def copy_values(param: np.ndarray, dims: tuple[int, ...] | None, shape) -> np.ndarray:
    """What a weight copy holds before rounding: param transposed by dims, in `shape`."""
    return (param if dims is None else param.transpose(dims)).reshape(shape)


def bind_weight_copies(graph: Graph) -> list[WeightCopy]:
    """After autodiff: each cast to bf16 of a parameter (or of a permute or reshape of one
    that nothing else reads) becomes a `state` value holding the bf16 copy, which its readers,
    forward and backward GEMMs, now read; the cast (and the permute) is dropped. Returns the
    copies, for the optimizer's update to write (Optimizer.emit weight_copies). The casts'
    VJPs (bf16 gradient -> float32, then the permute's) stay; compile/fuse.py
    fuse_gradient_casts later drops such a cast where only the update, the clipping norm and
    the guard read its result (they widen the bf16 gradient themselves)."""
    producers, users = graph.producers(), graph.consumers()
    copies: list[WeightCopy] = []
    drop: set[Node] = set()
    for n in graph.nodes:
        if n.op != "cast" or n.attrs["dtype"] != BF16:
            continue
        src, dims, shape, via = n.inputs[0], None, None, producers.get(n.inputs[0])
        if via is not None and via.op in ("permute", "reshape") and \
                via.inputs[0].role == PARAM and users[src] == [n]:
            src = via.inputs[0]
            if via.op == "permute":
                dims = tuple(via.attrs["dims"])
            else:
                shape = tuple(n.outputs[0].shape)
        if src.role != PARAM:
            continue
        copy = n.outputs[0]
        copy.role, copy.name = STATE, weight_copy_name(src.name, dims, shape)
        graph.state.append(copy)
        copies.append(WeightCopy(src, copy, dims))
        drop.update((n, via) if src is not n.inputs[0] else (n,))
    graph.nodes = [n for n in graph.nodes if n not in drop]
    return copies


def _without_kernels(graph: Graph, supported: frozenset[str], dtype: str) -> str:
    """"op (label), ..." of the ops of `graph` that read or write a `dtype` value and are not
    in `supported`; "" when there are none. Views (plan.VIEW_OPS) run no kernel."""
    missing: dict[str, str] = {}
    for n in graph.nodes:
        if n.op in VIEW_OPS or n.op in supported:
            continue
        if any(v.dtype == dtype for v in [*n.inputs, *n.outputs]):
            missing.setdefault(n.op, n.label)
    return ", ".join(f"{op} ({label})" if label else op for op, label in missing.items())


def check_bf16_support(graph: Graph, supported: frozenset[str] | None, device: str) -> None:
    """Raise UnsupportedPrecisionError naming every op of `graph` that reads or writes a bf16
    value and whose kernels on `device` do not take bf16 (`supported`: the ops that do; None:
    every op, the NumPy reference). Views (plan.VIEW_OPS) run no kernel."""
    if supported is None:
        return
    ops = _without_kernels(graph, supported, BF16)
    if ops:
        raise UnsupportedPrecisionError(
            f"precision='bf16' on {device}: no bf16 kernels yet for {ops}; the bf16 step runs "
            f"on device='cpu' (the NumPy emulation), or use precision='fp32' or 'tf32'")


def check_fp16_support(graph: Graph, supported: frozenset[str] | None, device: str) -> None:
    """check_bf16_support for float16 values, whatever made them (precision="fp16",
    autocast(dtype=torch.float16), model.half(), a .half() in the forward): raise
    UnsupportedPrecisionError naming every op that has no float16 kernel on `device`."""
    if supported is None:
        return
    ops = _without_kernels(graph, supported, FP16)
    if ops:
        raise UnsupportedPrecisionError(
            f"float16 on {device}: no float16 kernels yet for {ops}; use precision='bf16' "
            "(torch.autocast(dtype=torch.bfloat16), float32 master weights), or run the "
            "float16 step on device='cpu'")
