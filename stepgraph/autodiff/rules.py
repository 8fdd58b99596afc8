"""One VJP rule per op. A rule emits ordinary nodes and returns one gradient per input (None
where the input needs none). `wants(i)` says whether input i needs a gradient, so no node is
emitted for gradients nobody reads (e.g. the data input of the first layer)."""
from __future__ import annotations

from typing import Callable

from ..ir.graph import Node, Value
from ..ir.ops import GRAD_FROM_OUTPUT, IGNORE_INDEX, channel_sum_axes, conv_geometry, layout_of

Emit = Callable[..., list[Value]]   # emit(op, inputs, **attrs) -> outputs
VJPS: dict[str, Callable] = {}


def vjp(op: str):
    def register(rule):
        VJPS[op] = rule
        return rule
    return register


@vjp("linear")
def _linear(emit: Emit, node: Node, dy: list, wants) -> list:
    (g,), (x, w) = dy, node.inputs[:2]
    dx = emit("matmul", [g, w])[0] if wants(0) else None
    dw = emit("matmul", [g, x], trans_a=True)[0] if wants(1) else None
    grads = [dx, dw]
    if len(node.inputs) == 3:
        grads.append(emit("reduce_sum", [g], axes=(0,))[0] if wants(2) else None)
    return grads


def product_vjp(op: str):
    """The VJP rule of a product op `op` (matmul, bmm): c = op(a) @ op(b), op = transpose
    where attrs trans_a / trans_b. d op(a) = g @ op(b).T and d op(b) = op(a).T @ g, transposed
    back where the operand entered transposed; the flags absorb every transpose."""
    def rule(emit: Emit, node: Node, dy: list, wants) -> list:
        (g,), (a, b) = dy, node.inputs
        ta, tb = bool(node.attrs.get("trans_a")), bool(node.attrs.get("trans_b"))
        da = db = None
        if wants(0):
            da = (emit(op, [b, g], trans_a=tb, trans_b=True) if ta
                  else emit(op, [g, b], trans_b=not tb))[0]
        if wants(1):
            db = (emit(op, [g, a], trans_a=True, trans_b=ta) if tb
                  else emit(op, [a, g], trans_a=not ta))[0]
        return [da, db]
    return rule


vjp("matmul")(product_vjp("matmul"))


@vjp("act")
def _act(emit: Emit, node: Node, dy: list, wants) -> list:
    kind = node.attrs["kind"]
    saved = node.outputs[0] if kind in GRAD_FROM_OUTPUT else node.inputs[0]
    return [emit("act_grad", [dy[0], saved], kind=kind, slope=node.attrs["slope"])[0]]


def layout_attrs(node: Node) -> dict:
    """{"layout": "NHWC"} for a channels-last image op (its gradients run channels-last too),
    else {} (NCHW nodes stay as they were before layouts existed)."""
    layout = layout_of(node.op, node.attrs)
    return {} if layout == "NCHW" else {"layout": layout}


@vjp("conv2d")
def _conv2d(emit: Emit, node: Node, dy: list, wants) -> list:
    (g,), (x, w) = dy, node.inputs[:2]
    stride, padding, dilation, groups = conv_geometry(node.attrs)
    geometry = dict(stride=stride, padding=padding, dilation=dilation, groups=groups,
                    **layout_attrs(node))
    dx = emit("conv2d_grad_input", [g, w], input_shape=x.shape, **geometry)[0] if wants(0) else None
    dw = emit("conv2d_grad_weight", [g, x], weight_shape=w.shape, **geometry)[0] if wants(1) else None
    grads = [dx, dw]
    if len(node.inputs) == 3:
        axes = channel_sum_axes(layout_of(node.op, node.attrs))
        grads.append(emit("reduce_sum", [g], axes=axes)[0] if wants(2) else None)
    return grads


@vjp("maxpool2d")
def _maxpool2d(emit: Emit, node: Node, dy: list, wants) -> list:
    return [emit("maxpool2d_grad", [dy[0], node.outputs[1]], input_shape=node.inputs[0].shape,
                 kernel=node.attrs["kernel"], stride=node.attrs["stride"],
                 padding=tuple(node.attrs.get("padding", (0, 0))), **layout_attrs(node))[0]]


@vjp("reshape")
def _reshape(emit: Emit, node: Node, dy: list, wants) -> list:
    return [emit("reshape", [dy[0]], shape=node.inputs[0].shape)[0]]


@vjp("dropout")
def _dropout(emit: Emit, node: Node, dy: list, wants) -> list:
    dx = emit("dropout_grad", [dy[0], node.outputs[1]], p=node.attrs["p"],
              per_channel=node.attrs["per_channel"])[0]
    return [dx, None]


@vjp("log_softmax")
def _log_softmax(emit: Emit, node: Node, dy: list, wants) -> list:
    return [emit("log_softmax_grad", [dy[0], node.outputs[0]])[0]]


@vjp("cross_entropy")
def _cross_entropy(emit: Emit, node: Node, dy: list, wants) -> list:
    logits, labels = node.inputs
    return [emit("cross_entropy_grad", [dy[0], logits, node.outputs[1], labels],
                 label_smoothing=float(node.attrs.get("label_smoothing", 0.0)),
                 ignore_index=int(node.attrs.get("ignore_index", IGNORE_INDEX)))[0], None]


@vjp("nll_loss")
def _nll_loss(emit: Emit, node: Node, dy: list, wants) -> list:
    logp, labels = node.inputs
    return [emit("nll_loss_grad", [dy[0], labels], classes=logp.shape[1])[0], None]


@vjp("mse")
def _mse(emit: Emit, node: Node, dy: list, wants) -> list:
    pred, target = node.inputs
    dpred = emit("mse_grad", [dy[0], pred, target])[0] if wants(0) else None
    dtarget = None
    if wants(1):  # d/dtarget = -d/dpred
        dtarget = emit("mse_grad", [dy[0], target, pred])[0]
    return [dpred, dtarget]


@vjp("add")
def _add(emit: Emit, node: Node, dy: list, wants) -> list:
    return [dy[0] if wants(0) else None, dy[0] if wants(1) else None]
