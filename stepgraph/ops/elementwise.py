"""Elementwise family: broadcasting binary ops, tensor-scalar ops and expand; add of two
same-shape tensors and fill (autodiff's gradient sum and seed).

Broadcasting follows NumPy/PyTorch. Gradients of broadcast operands are reduced back to the
operand's own shape by `sum_to` (reduce_sum over the broadcast axes, then reshape).
"""
from __future__ import annotations

import math

import numpy as np

from ..ir.ops import _need, defop, impl, vjp

BINARY_KINDS = ("add", "sub", "mul", "div", "pow", "maximum", "minimum")
SCALAR_KINDS = ("add", "sub", "rsub", "mul", "div", "rdiv", "pow", "rpow", "maximum", "minimum")


def _broadcast(op: str, a: tuple, b: tuple) -> tuple[int, ...]:
    try:
        return tuple(np.broadcast_shapes(a, b))
    except ValueError:
        _need(False, op, f"shapes {a} and {b} do not broadcast")


# ---- shape rules ---------------------------------------------------------------------------

@defop("binary")
def _binary(ins, attrs):
    """y = a kind b, kind in BINARY_KINDS (pow a**b; maximum and minimum propagate NaN, as
    np.maximum), NumPy broadcasting; out shape =
    np.broadcast_shapes(a.shape, b.shape), dtype = a.dtype (a.dtype == b.dtype required)."""
    a, b = ins
    _need(attrs["kind"] in BINARY_KINDS, "binary", f"unknown kind {attrs['kind']!r}")
    _need(a.dtype == b.dtype, "binary", f"dtypes differ: {a.dtype} vs {b.dtype}")
    return [(_broadcast("binary", a.shape, b.shape), a.dtype)]


@defop("scalar")
def _scalar(ins, attrs):
    """y = x kind value (Python float): add x+v, sub x-v, rsub v-x, mul x*v, div x/v,
    rdiv v/x, pow x**v, rpow v**x, maximum max(x, v), minimum min(x, v) (NaN propagates)."""
    _need(attrs["kind"] in SCALAR_KINDS, "scalar", f"unknown kind {attrs['kind']!r}")
    return [(ins[0].shape, ins[0].dtype)]


@defop("expand")
def _expand(ins, attrs):
    """y = np.broadcast_to(x, attrs shape), materialised."""
    x, shape = ins[0], tuple(attrs["shape"])
    _need(_broadcast("expand", x.shape, shape) == shape, "expand",
          f"cannot expand {x.shape} to {shape}")
    return [(shape, x.dtype)]


# ---- VJPs ----------------------------------------------------------------------------------

def sum_to(emit, g, shape: tuple[int, ...]):
    """Reduce the gradient `g` of a broadcast result back to an operand of `shape`: sum over
    the leading axes `shape` lacks and the axes where `shape` has 1, then reshape."""
    shape = tuple(shape)
    if tuple(g.shape) == shape:
        return g
    lead = len(g.shape) - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, d in enumerate(shape) if d == 1 and g.shape[lead + i] != 1)
    if axes:
        g = emit("reduce_sum", [g], axes=axes)[0]
    if tuple(g.shape) != shape:
        g = emit("reshape", [g], shape=shape)[0]
    return g


def _neg(emit, g):
    return emit("scalar", [g], kind="mul", value=-1.0)[0]


@vjp("binary")
def _binary_vjp(emit, node, dy, wants) -> list:
    (g,), (a, b), kind = dy, node.inputs, node.attrs["kind"]
    da = db = None
    if kind in ("add", "sub"):
        da = sum_to(emit, g, a.shape) if wants(0) else None
        if wants(1):
            db = sum_to(emit, g, b.shape)
            db = _neg(emit, db) if kind == "sub" else db
    elif kind == "mul":
        if wants(0):
            da = sum_to(emit, emit("binary", [g, b], kind="mul")[0], a.shape)
        if wants(1):
            db = sum_to(emit, emit("binary", [g, a], kind="mul")[0], b.shape)
    elif kind == "pow":
        return _pow_vjp(emit, node, g, wants)
    elif kind in ("maximum", "minimum"):
        return _extremum_vjp(emit, node, g, wants)
    else:  # div: da = g / b; db = -g a / b^2 = -(g y) / b
        if wants(0):
            da = sum_to(emit, emit("binary", [g, b], kind="div")[0], a.shape)
        if wants(1):
            gy = emit("binary", [g, node.outputs[0]], kind="mul")[0]
            db = _neg(emit, sum_to(emit, emit("binary", [gy, b], kind="div")[0], b.shape))
    return [da, db]


def _pow_vjp(emit, node, g, wants) -> list:
    """PyTorch's pow derivatives: da = g b a^(b-1), zero where b == 0; db = g y log(a), zero
    where a == 0 and b >= 0 (so 0**b with b >= 0 is flat in b)."""
    (a, b), y = node.inputs, node.outputs[0]
    da = db = None
    if wants(0):
        slope = emit("binary", [a, emit("scalar", [b], kind="sub", value=1.0)[0]],
                     kind="pow")[0]
        da = emit("binary", [emit("binary", [g, b], kind="mul")[0], slope], kind="mul")[0]
        da = emit("masked_fill", [da, emit("compare_scalar", [b], kind="eq", value=0.0)[0]],
                  value=0.0)[0]
        da = sum_to(emit, da, a.shape)
    if wants(1):
        gy = emit("binary", [g, y], kind="mul")[0]
        db = emit("binary", [gy, emit("unary", [a], kind="log")[0]], kind="mul")[0]
        flat = emit("logical", [emit("compare_scalar", [a], kind="eq", value=0.0)[0],
                                emit("compare_scalar", [b], kind="ge", value=0.0)[0]],
                    kind="and")[0]
        db = sum_to(emit, emit("masked_fill", [db, flat], value=0.0)[0], b.shape)
    return [da, db]


def _extremum_vjp(emit, node, g, wants) -> list:
    """maximum / minimum: the gradient goes to the chosen operand, half to each on ties
    (PyTorch's rule)."""
    (a, b), kind = node.inputs, node.attrs["kind"]
    tie = emit("compare", [a, b], kind="eq")[0]
    half = emit("scalar", [g], kind="mul", value=0.5)[0]
    shared = emit("where", [tie, half, g])[0]
    # maximum: a loses where a < b; minimum: where a > b
    lose_a, lose_b = ("lt", "gt") if kind == "maximum" else ("gt", "lt")
    grads = []
    for i, (v, lose) in enumerate(((a, lose_a), (b, lose_b))):
        if not wants(i):
            grads.append(None)
            continue
        lost = emit("compare", [a, b], kind=lose)[0]
        grads.append(sum_to(emit, emit("masked_fill", [shared, lost], value=0.0)[0], v.shape))
    return grads


@vjp("scalar")
def _scalar_vjp(emit, node, dy, wants) -> list:
    (g,), x = dy, node.inputs[0]
    kind, v = node.attrs["kind"], float(node.attrs["value"])
    if kind in ("add", "sub"):
        return [g]
    if kind == "rsub":
        return [_neg(emit, g)]
    if kind in ("mul", "div"):
        return [emit("scalar", [g], kind=kind, value=v)[0]]
    if kind == "rdiv":  # d(v / x) = -v / x^2 = -y / x
        gy = emit("binary", [g, node.outputs[0]], kind="mul")[0]
        return [_neg(emit, emit("binary", [gy, x], kind="div")[0])]
    if kind == "rpow":  # d(v**x) = y log(v); 0**x is taken as flat (PyTorch masks x >= 0)
        log_v = math.log(v) if v > 0 else 0.0 if v == 0 else math.nan
        return [emit("scalar", [emit("binary", [g, node.outputs[0]], kind="mul")[0]],
                     kind="mul", value=log_v)[0]]
    if kind in ("maximum", "minimum"):   # clamp: no gradient where x was replaced by v
        lost = emit("compare_scalar", [x], kind="lt" if kind == "maximum" else "gt", value=v)[0]
        return [emit("masked_fill", [g, lost], value=0.0)[0]]
    if v == 0.0:        # x**0 is constant (PyTorch gives zeros, even at x = 0)
        return [emit("scalar", [g], kind="mul", value=0.0)[0]]
    slope = emit("scalar", [x], kind="pow", value=v - 1.0)[0]
    slope = emit("scalar", [slope], kind="mul", value=v)[0]
    return [emit("binary", [g, slope], kind="mul")[0]]


@vjp("expand")
def _expand_vjp(emit, node, dy, wants) -> list:
    return [sum_to(emit, dy[0], node.inputs[0].shape)]


# ---- numpy reference -----------------------------------------------------------------------

_BINARY_UFUNCS = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
                  "pow": np.power, "maximum": np.maximum, "minimum": np.minimum}


@impl("binary")
def _binary_impl(node, ins, outs, ctx):
    _BINARY_UFUNCS[node.attrs["kind"]](ins[0], ins[1], out=outs[0])


# kind -> (ufunc, whether the scalar is the first operand)
_SCALAR_UFUNCS = {"add": (np.add, False), "sub": (np.subtract, False),
                  "rsub": (np.subtract, True), "mul": (np.multiply, False),
                  "div": (np.divide, False), "rdiv": (np.divide, True), "pow": (np.power, False),
                  "rpow": (np.power, True), "maximum": (np.maximum, False),
                  "minimum": (np.minimum, False)}


@impl("scalar")
def _scalar_impl(node, ins, outs, ctx):
    x, v = ins[0], ins[0].dtype.type(node.attrs["value"])
    ufunc, scalar_first = _SCALAR_UFUNCS[node.attrs["kind"]]
    if scalar_first:
        ufunc(v, x, out=outs[0])
    else:
        ufunc(x, v, out=outs[0])


@impl("expand")
def _expand_impl(node, ins, outs, ctx):
    outs[0][...] = np.broadcast_to(ins[0], outs[0].shape)


# ---- add and fill: autodiff's gradient sum and seed ----------------------------------------

@defop("add")
def _add(ins, attrs):
    """c = a + b, same shapes (no broadcasting)."""
    a, b = ins
    _need(a.shape == b.shape and a.dtype == b.dtype, "add", f"{a!r} + {b!r}")
    return [(a.shape, a.dtype)]


@vjp("add")
def _add_vjp(emit, node, dy, wants) -> list:
    return [dy[0] if wants(0) else None, dy[0] if wants(1) else None]


@impl("add")
def _add_impl(node, ins, outs, ctx):
    np.add(ins[0], ins[1], out=outs[0])


@defop("fill")
def _fill(ins, attrs):
    """y = attrs["value"] everywhere; shape attrs["shape"], dtype attrs["dtype"]. No inputs."""
    return [(tuple(attrs["shape"]), attrs["dtype"])]


@impl("fill")
def _fill_impl(node, ins, outs, ctx):
    outs[0][...] = node.attrs["value"]
