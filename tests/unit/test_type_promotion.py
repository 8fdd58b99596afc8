"""torch's type promotion in binary ops (ir/promotion.py): for a table of operands (1-d and 0-d
tensors of float32, float64, bfloat16, float16, int64, int32, bool; Python int, float and
bool), the result dtype of + - * /, comparisons, where, maximum / minimum and the in-place
forms is torch's, and so are the values (judged against torch float64 on the promoted
operands by the tolerance policy; integers and masks exactly). Cases torch refuses (bool
subtraction) are left out; for in-place forms torch's "can't be cast" refusal is expected."""
from __future__ import annotations

import itertools
import operator

import numpy as np
import pytest
import torch

import stepgraph as sg
from stepgraph.errors import TypePromotionError
from stepgraph.ir.promotion import can_cast, promote_types, result_type
from tests.reference import assert_close_to_reference

DTYPES = ["float32", "float64", "bfloat16", "float16", "int64", "int32", "bool"]
NUMBERS = [2, 2.5, True, -3]


def values(dtype: str, zero_d: bool):
    if dtype == "bool":
        return True if zero_d else [True, True, False, True]
    if dtype.startswith("int"):
        return 3 if zero_d else [1, -2, 3, 0]
    return 2.5 if zero_d else [1.5, -2.0, 3.0, 0.0]


TENSORS = [(d, z) for z in (False, True) for d in DTYPES]
OPERANDS = TENSORS + [("number", n) for n in NUMBERS]


def make(fw, operand):
    """The operand in framework fw: a tensor (dtype, 0-d?) or a Python number as it is."""
    kind, arg = operand
    if kind == "number":
        return arg
    return fw.tensor(values(kind, arg), dtype=getattr(fw, kind))


def name(operand) -> str:
    kind, arg = operand
    return repr(arg) if kind == "number" else f"{kind}{'[]' if arg else '[4]'}"


def host(t) -> np.ndarray:
    """Values as float64 (bool stays bool)."""
    if isinstance(t, torch.Tensor):
        return t.numpy() if t.dtype == torch.bool else t.double().numpy()
    return t.numpy() if str(t.dtype) == "bool" else np.asarray(t.float().numpy(), np.float64)


def judge(got, want, reference64, what: str) -> None:
    """`got` (stepgraph) has torch's dtype `want.dtype` and its values: exactly for integer
    and bool results, floats within the policy's bound of the float64 reference."""
    assert str(got.dtype) == str(want.dtype).removeprefix("torch."), \
        f"{what}: dtype {got.dtype}, torch {want.dtype}"
    if not want.dtype.is_floating_point:
        np.testing.assert_array_equal(host(got), host(want), err_msg=what)
        return
    assert_close_to_reference(host(got), host(reference64), host(want), what)


def in64(fw_op, a, b, dtype):
    """torch float64 on the operands as the op sees them (cast to the result type first)."""
    def cast(x):
        return x.to(dtype).double() if isinstance(x, torch.Tensor) else x
    return fw_op(cast(a), cast(b))


BINARY = {"add": operator.add, "sub": operator.sub, "mul": operator.mul,
          "div": operator.truediv, "maximum": lambda a, b: a.maximum(b),
          "minimum": lambda a, b: a.minimum(b)}
COMPARE = {"lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge,
           "eq": operator.eq, "ne": operator.ne}


def test_result_type_and_promote_types_are_torchs():
    for a, b in itertools.product(OPERANDS, OPERANDS):
        if a[0] == b[0] == "number":
            continue
        want = torch.result_type(make(torch, a), make(torch, b))
        assert result_type(make(sg, a), make(sg, b)) == str(want).removeprefix("torch."), \
            (name(a), name(b))
    for a, b in itertools.product(DTYPES, DTYPES):
        t_a, t_b = getattr(torch, a), getattr(torch, b)
        assert promote_types(a, b) == str(torch.promote_types(t_a, t_b)).removeprefix("torch.")
        assert can_cast(a, b) == torch.can_cast(t_a, t_b), (a, b)


@pytest.mark.parametrize("op", BINARY)
def test_binary_ops_promote_as_torch(op):
    f, checked = BINARY[op], 0
    for a, b in itertools.product(TENSORS, OPERANDS):
        if op in ("maximum", "minimum") and b[0] == "number":
            continue                       # torch.maximum takes tensors only
        for x, y in ((a, b), (b, a)) if b[0] == "number" else ((a, b),):
            try:
                want = f(make(torch, x), make(torch, y))
            except RuntimeError:
                continue                   # torch refuses (bool - bool)
            got = f(make(sg, x), make(sg, y))
            judge(got, want, in64(f, make(torch, x), make(torch, y), want.dtype),
                  f"{name(x)} {op} {name(y)}")
            checked += 1
    assert checked > 150


@pytest.mark.parametrize("op", COMPARE)
def test_comparisons_compare_in_the_promoted_type(op):
    f = COMPARE[op]
    for a, b in itertools.product(TENSORS, OPERANDS):
        want = f(make(torch, a), make(torch, b))
        judge(f(make(sg, a), make(sg, b)), want, want, f"{name(a)} {op} {name(b)}")
    # an int tensor against a fraction: compared in float32, not at the int's precision
    ints = sg.tensor([0, 1, 2])
    np.testing.assert_array_equal(host(ints < 0.5), [True, False, False])


def test_where_promotes_both_branches():
    cond_t, cond_s = torch.tensor([True, False, True, False]), \
        sg.tensor([True, False, True, False])
    for a, b in itertools.product(OPERANDS, OPERANDS):
        want = torch.where(cond_t, make(torch, a), make(torch, b))
        got = sg.where(cond_s, make(sg, a), make(sg, b))
        judge(got, want, want, f"where(cond, {name(a)}, {name(b)})")
        if a[0] != "number":
            judge(make(sg, a).where(cond_s, make(sg, b)), want, want,
                  f"{name(a)}.where(cond, {name(b)})")


@pytest.mark.parametrize("op", ["add_", "sub_", "mul_", "div_"])
def test_inplace_forms_keep_the_left_dtype_or_refuse_as_torch(op):
    refused = 0
    for a, b in itertools.product([(d, False) for d in DTYPES], OPERANDS):
        mine, theirs = make(sg, a), make(torch, a)
        try:
            getattr(theirs, op)(make(torch, b))
        except RuntimeError as err:
            if "can't be cast" not in str(err):
                continue                   # another refusal (bool subtraction)
            with pytest.raises(TypePromotionError, match=str(err)):
                getattr(mine, op)(make(sg, b))
            refused += 1
            continue
        assert getattr(mine, op)(make(sg, b)) is mine
        reference = in64(BINARY[op[:-1]], make(torch, a), make(torch, b),
                         torch.result_type(make(torch, a), make(torch, b)))
        judge(mine, theirs, reference, f"{name(a)}.{op}({name(b)})")
    assert refused > 0


def test_the_operators_in_place_and_on_traced_tensors():
    """x += y with a float32 x and a bfloat16 y stays float32; in a compiled forward the
    mixed float32 / bfloat16 / float16 arithmetic is torch's too (casts before each op)."""
    x = sg.tensor([1.0, 2.0, 3.0])
    x += sg.tensor([0.5, 0.25, 0.125], dtype=sg.bfloat16)
    np.testing.assert_array_equal(host(x), [1.5, 2.25, 3.125])
    assert x.dtype == sg.float32

    def forward(fw, v):
        h = v.to(fw.bfloat16)
        y = (v + h) * v.half() - (h > v).to(fw.int32)
        return fw.where(v > 0, y, h.half()) / 3

    class Mixed(sg.nn.Module):
        def forward(self, v):
            return forward(sg, v)

    v = np.random.default_rng(0).standard_normal((4, 5)).astype(np.float32)
    predict = sg.compile_predict(Mixed(), example_inputs=(v,), device="cpu")
    want = forward(torch, torch.from_numpy(v))
    got = np.asarray(predict(v))
    assert got.dtype == np.float32 and want.dtype == torch.float32
    assert_close_to_reference(got, forward(torch, torch.from_numpy(v).double()).numpy(),
                              want.numpy(), "mixed-dtype forward")
