"""Compare family: comparisons giving bool masks, logic on masks, and selection by a mask.

`compare` (tensor-tensor, NumPy broadcasting) and `compare_scalar` (tensor-Python number)
give IR dtype `bool`; `logical` and `logical_not` combine masks; `where(cond, a, b)` and
`masked_fill(x, mask, value)` select. Every op is an instruction of the generated pointwise
kernels (ops/pointwise.py PROGRAM_OPS).

Masks carry no gradient (comparisons have no VJP: autodiff never hands one a cotangent, since
no op's VJP gives a bool value one). Selection passes the gradient to the chosen operand and
zero to the other, as PyTorch's where and masked_fill do; a scalar side gets none.

A scalar compares at the tensor's precision (float32(value) against a float32 tensor), as
PyTorch's tensor-scalar comparisons do.
"""
from __future__ import annotations

import numpy as np

from ..ir.ops import _need, defop, impl, vjp
from .elementwise import _broadcast, sum_to

COMPARE_KINDS = ("lt", "le", "gt", "ge", "eq", "ne")
LOGICAL_KINDS = ("and", "or", "xor")
BOOL = "bool"


# ---- shape rules ---------------------------------------------------------------------------

@defop("compare")
def _compare(ins, attrs):
    """y = a kind b (bool), kind in COMPARE_KINDS (lt a<b, le a<=b, gt, ge, eq, ne), NumPy
    broadcasting; a.dtype == b.dtype required."""
    a, b = ins
    _need(attrs["kind"] in COMPARE_KINDS, "compare", f"unknown kind {attrs['kind']!r}")
    _need(a.dtype == b.dtype, "compare", f"dtypes differ: {a.dtype} vs {b.dtype}")
    return [(_broadcast("compare", a.shape, b.shape), BOOL)]


@defop("compare_scalar")
def _compare_scalar(ins, attrs):
    """y = x kind value (bool, x's shape), kind in COMPARE_KINDS, value a Python number
    converted to x's dtype."""
    _need(attrs["kind"] in COMPARE_KINDS, "compare_scalar", f"unknown kind {attrs['kind']!r}")
    return [(ins[0].shape, BOOL)]


@defop("logical")
def _logical(ins, attrs):
    """y = a kind b, kind in LOGICAL_KINDS, a and b bool, NumPy broadcasting."""
    a, b = ins
    _need(attrs["kind"] in LOGICAL_KINDS, "logical", f"unknown kind {attrs['kind']!r}")
    _need(a.dtype == b.dtype == BOOL, "logical", f"bool operands only, got {a.dtype} and "
          f"{b.dtype}")
    return [(_broadcast("logical", a.shape, b.shape), BOOL)]


@defop("logical_not")
def _logical_not(ins, attrs):
    """y = not x, x bool."""
    _need(ins[0].dtype == BOOL, "logical_not", f"a bool operand only, got {ins[0].dtype}")
    return [(ins[0].shape, BOOL)]


@defop("where")
def _where(ins, attrs):
    """y = a where cond else b; cond bool, a.dtype == b.dtype; the three broadcast together
    (NumPy); y has a's dtype."""
    cond, a, b = ins
    _need(cond.dtype == BOOL, "where", f"condition must be bool, got {cond.dtype}")
    _need(a.dtype == b.dtype, "where", f"dtypes differ: {a.dtype} vs {b.dtype}")
    shape = _broadcast("where", _broadcast("where", cond.shape, a.shape), b.shape)
    return [(shape, a.dtype)]


@defop("masked_fill")
def _masked_fill(ins, attrs):
    """y = value (a Python float, inf included) where mask else x; mask bool, broadcast with
    x (NumPy); y has x's dtype."""
    x, mask = ins
    _need(mask.dtype == BOOL, "masked_fill", f"mask must be bool, got {mask.dtype}")
    return [(_broadcast("masked_fill", x.shape, mask.shape), x.dtype)]


# ---- VJPs ----------------------------------------------------------------------------------

def zero_where(emit, g, mask):
    """g with zeros where mask holds (the gradient of the branch not taken)."""
    return emit("masked_fill", [g, mask], value=0.0)[0]


@vjp("where")
def _where_vjp(emit, node, dy, wants) -> list:
    (g,), (cond, a, b) = dy, node.inputs
    da = db = None
    if wants(1):
        da = sum_to(emit, zero_where(emit, g, emit("logical_not", [cond])[0]), a.shape)
    if wants(2):
        db = sum_to(emit, zero_where(emit, g, cond), b.shape)
    return [None, da, db]


@vjp("masked_fill")
def _masked_fill_vjp(emit, node, dy, wants) -> list:
    (g,), (x, mask) = dy, node.inputs
    return [sum_to(emit, zero_where(emit, g, mask), x.shape), None]


# ---- numpy reference -----------------------------------------------------------------------

_COMPARE_UFUNCS = {"lt": np.less, "le": np.less_equal, "gt": np.greater,
                   "ge": np.greater_equal, "eq": np.equal, "ne": np.not_equal}
_LOGICAL_UFUNCS = {"and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor}


@impl("compare")
def _compare_impl(node, ins, outs, ctx):
    _COMPARE_UFUNCS[node.attrs["kind"]](ins[0], ins[1], out=outs[0])


@impl("compare_scalar")
def _compare_scalar_impl(node, ins, outs, ctx):
    x = ins[0]
    _COMPARE_UFUNCS[node.attrs["kind"]](x, x.dtype.type(node.attrs["value"]), out=outs[0])


@impl("logical")
def _logical_impl(node, ins, outs, ctx):
    _LOGICAL_UFUNCS[node.attrs["kind"]](ins[0], ins[1], out=outs[0])


@impl("logical_not")
def _logical_not_impl(node, ins, outs, ctx):
    np.logical_not(ins[0], out=outs[0])


@impl("where")
def _where_impl(node, ins, outs, ctx):
    outs[0][...] = np.where(ins[0], ins[1], ins[2])


@impl("masked_fill")
def _masked_fill_impl(node, ins, outs, ctx):
    x = ins[0]
    outs[0][...] = np.where(ins[1], x.dtype.type(node.attrs["value"]), x)
