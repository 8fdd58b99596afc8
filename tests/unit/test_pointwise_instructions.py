"""The elementwise ops of ops/unary.py and ops/compare.py, the new binary, scalar and cast
kinds as instructions of the generated pointwise kernels (backends/cuda/pointwise.py): one
program holding every instruction, in float32 and in bf16, and lone nodes run as their
one-instruction programs, compile for sm_90 with NVRTC (no GPU needed); the sources hold the
expressions each instruction is documented to become."""
from __future__ import annotations

import pytest

from stepgraph.compile.pointwise import fuse_pointwise
from stepgraph.ir.graph import BF16, Node, Value
from stepgraph.ir.ops import infer_outputs
from stepgraph.ir.trace import Tracer
from stepgraph.ops.compare import COMPARE_KINDS, LOGICAL_KINDS
from stepgraph.ops.unary import UNARY_KINDS

SHAPE = (4, 8)


def _every_instruction(t: Tracer, x, y):
    """Every new instruction on x and y (same shape, one float dtype); returns the results."""
    results = [t.op("unary", [x], kind=kind) for kind in UNARY_KINDS]
    results += [t.op("binary", [x, y], kind=kind) for kind in ("pow", "maximum", "minimum")]
    results += [t.op("scalar", [x], kind=kind, value=0.7)
                for kind in ("rpow", "maximum", "minimum")]
    masks = [t.op("compare", [x, y], kind=kind) for kind in COMPARE_KINDS]
    masks += [t.op("compare_scalar", [x], kind=kind, value=-0.25) for kind in COMPARE_KINDS]
    masks += [t.op("logical", [masks[0], masks[-1]], kind=kind) for kind in LOGICAL_KINDS]
    masks.append(t.op("logical_not", [masks[-1]]))
    results.append(t.op("where", [masks[-1], x, y]))
    results.append(t.op("masked_fill", [x, masks[-2]], value=float("-inf")))
    results.append(t.op("cast", [masks[-3]], dtype=x.dtype))
    results.append(t.op("cast", [x], dtype="bool"))
    return results + masks


def _fused_node(dtype: str) -> Node:
    t = Tracer()
    x, y = (t.input(SHAPE, dtype, name) for name in ("x", "y"))
    z = t.op("binary", [x, y], kind="mul")       # every instruction joins z's group
    results = _every_instruction(t, z, y)
    t.graph.outputs = {f"out{i}": r.value for i, r in enumerate(results)}
    (node,) = fuse_pointwise(t.graph).nodes
    return node


def _compile(source: str):
    pytest.importorskip("cupy")
    from cupy.cuda import nvrtc

    try:
        nvrtc.getVersion()
    except Exception:
        pytest.skip("libnvrtc is not loadable")
    from stepgraph.backends.cuda.runtime import compiler

    assert compiler.compile_source_to_cubin(source, "pointwise.cu", "sm_90")


@pytest.mark.parametrize("dtype", ["float32", BF16])
def test_one_program_of_every_new_instruction_compiles(dtype):
    from stepgraph.backends.cuda import pointwise

    node = _fused_node(dtype)
    ops = {(i.op, i.attr.get("kind")) for i in node.attrs["program"]}
    assert {("unary", k) for k in UNARY_KINDS} <= ops
    assert {("compare", k) for k in COMPARE_KINDS} <= ops
    assert {"bool"} < {v.dtype for v in node.outputs}
    (source, _), *_ = pointwise.generated_kernels(node)
    for expression in ("expm1f(", "erff(", "__fsqrt_rn(", "fmax_nan(", "sign_nan(", " <= ",
                       " && ", " ? ", "(bool)("):
        assert expression in source
    assert "bool* __restrict__ out" in source
    if dtype == BF16:
        assert "bf16_round(" in source
    _compile(source)


def _lone(op: str, dtypes: tuple[str, ...], **attrs) -> Node:
    ins = [Value(SHAPE if i else (8,), d) for i, d in enumerate(dtypes)]   # first broadcasts
    outs = [Value(s, d) for s, d in infer_outputs(op, ins, attrs)]
    return Node(op, ins, outs, attrs)


LONE = {
    "cast-float-int64": ("cast", ("float32",), dict(dtype="int64")),
    "cast-int32-bf16": ("cast", ("int32",), dict(dtype=BF16)),
    "cast-bool-float": ("cast", ("bool",), dict(dtype="float32")),
    "where-broadcast-cond": ("where", ("bool", "float32", "float32"), {}),
    "compare-bf16": ("compare", (BF16, BF16), dict(kind="ge")),
    "masked_fill-bf16": ("masked_fill", (BF16, "bool"), dict(value=3.5)),
    "unary-bf16": ("unary", (BF16,), dict(kind="erf")),          # four elements a thread too
}


@pytest.mark.parametrize("case", LONE)
def test_lone_nodes_run_their_one_instruction_program(case):
    from stepgraph.backends.cuda import pointwise

    op, dtypes, attrs = LONE[case]
    node = _lone(op, dtypes, **attrs)
    program = pointwise.as_program(node)
    assert [i.op for i in program.attrs["program"]] == [op]
    assert program.outputs == node.outputs and program.inputs == node.inputs
    (source, name), *_ = pointwise.generated_kernels(program)
    assert name == pointwise.KERNEL_NAME
    _compile(source)


@pytest.mark.parametrize("dtype", ["float32", BF16])
def test_masks_inside_a_float_program_keep_the_vector_kernel(dtype):
    """Bool registers between float inputs and outputs (x.masked_fill(x > 0.5, 0) * y): the
    source has the four-elements-a-thread kernel, and it compiles."""
    from stepgraph.backends.cuda import pointwise

    t = Tracer()
    x, y = (t.input(SHAPE, dtype, name) for name in ("x", "y"))
    y = x.masked_fill(x > 0.5, 0.0) * y
    t.graph.outputs = {"y": y.value}
    (node,) = fuse_pointwise(t.graph).nodes
    kernels = pointwise.generated_kernels(node)
    assert [name for _, name in kernels] == [pointwise.KERNEL_NAME, pointwise.VEC_KERNEL_NAME]
    assert "const bool r" in kernels[0][0]
    _compile(kernels[0][0])


@pytest.mark.parametrize("op, dtypes, attrs, generated", [
    ("binary", ("float32", "float32"), dict(kind="pow"), True),
    ("binary", ("float32", "float32"), dict(kind="add"), False),
    ("scalar", ("float32",), dict(kind="maximum", value=0.0), True),
    ("scalar", ("float32",), dict(kind="mul", value=2.0), False),
    ("cast", ("float32",), dict(dtype="int64"), True),
    ("cast", ("float32",), dict(dtype=BF16), False),
])
def test_kinds_without_a_kernel_of_their_own_compile_ahead(op, dtypes, attrs, generated):
    """binary, scalar and cast kinds that run as generated programs are in their families'
    GENERATED_KERNELS (what backend.prepare compiles before the first step); the others run
    their own .cu kernels and name no generated one."""
    from stepgraph.backends.cuda import broadcast, cast, pointwise

    node = _lone(op, dtypes, **attrs)
    table = {**broadcast.GENERATED_KERNELS, **cast.GENERATED_KERNELS}
    want = pointwise.generated_kernels(pointwise.as_program(node)) if generated else []
    assert table[op](node) == want and bool(want) == generated


@pytest.mark.parametrize("dtype", ["float32", BF16])
@pytest.mark.parametrize("shapes, vector", [
    # (x, channel vector, per-pixel value): channels-last maps, last extent a multiple of 4
    (((2, 3, 5, 8), (1, 1, 1, 8), (2, 3, 5, 1)), True),
    (((2, 3, 5, 8), (2, 1, 1, 8), ()), True),           # SE-style scales, a 0-d value
    (((2, 3, 5, 6), (1, 1, 1, 6), (2, 3, 5, 1)), False),  # 6 channels: lanes would straddle
    (((2, 3, 5, 8), (1, 3, 1, 8), (2, 3, 5, 1)), True),
    (((2, 3, 4, 8), (1, 1, 4, 1), (2, 3, 4, 8)), True),   # per column: one element for four
])
def test_broadcast_inputs_keep_the_vector_kernel_where_lanes_share_them(dtype, shapes, vector):
    """x * scale + shift with broadcast operands: the four-elements-a-thread kernel exists
    where each operand's four lanes are four consecutive elements of it or one element, and
    its source compiles."""
    from stepgraph.backends.cuda import pointwise

    t = Tracer()
    x, scale, shift = (t.input(s, dtype, name) for s, name in zip(shapes, "xyz"))
    t.graph.outputs = {"y": (x * scale + shift).value}
    (node,) = fuse_pointwise(t.graph).nodes
    kernels = pointwise.generated_kernels(node)
    want = [pointwise.KERNEL_NAME] + ([pointwise.VEC_KERNEL_NAME] if vector else [])
    assert [name for _, name in kernels] == want
    _compile(kernels[0][0])


@pytest.mark.parametrize("dtype", ["float32", BF16])
def test_mask_inputs_and_outputs_keep_the_vector_kernel(dtype):
    """A saved bool mask read by a backward program (dy.masked_fill(mask, 0)) and a mask the
    forward writes for it (x > 6 beside relu6-like arithmetic): four masks a thread in one
    4-byte access; the sources compile."""
    from stepgraph.backends.cuda import pointwise

    t = Tracer()
    x, dy = t.input(SHAPE, dtype, "x"), t.input(SHAPE, dtype, "dy")
    mask = t.input(SHAPE, "bool", "mask")
    t.graph.outputs = {"dx": (dy.masked_fill(mask, 0.0) * x).value}
    (backward,) = fuse_pointwise(t.graph).nodes
    t = Tracer()
    x = t.input(SHAPE, dtype, "x")
    y = x * 2.0
    t.graph.outputs = {"y": y.value, "mask": (y > 6.0).value}
    (forward,) = fuse_pointwise(t.graph).nodes
    for node, mask_at in ((backward, "const bool* __restrict__ in"),
                          (forward, "bool* __restrict__ out")):
        assert mask_at in pointwise.kernel_source(*pointwise._program(node))
        kernels = pointwise.generated_kernels(node)
        assert [name for _, name in kernels] == [pointwise.KERNEL_NAME,
                                                 pointwise.VEC_KERNEL_NAME]
        source = kernels[0][0]
        assert "load4_bytes" in source or "store4_bytes" in source
        _compile(source)


def test_dropout_programs_have_the_vector_kernel():
    """gpt's residual dropout under autocast (a bf16 dropout, its mask kept for the backward,
    the widening cast and the float32 add, which fuse_pointwise makes one program):
    the four-elements-a-thread kernel exists, one dropout group a thread (the group's Philox
    words drawn once, the step counter read once, not per element), and it compiles."""
    from stepgraph.backends.cuda import pointwise

    t = Tracer()
    x, resid = t.input((16, 384), BF16, "x"), t.input((16, 384), "float32", "resid")
    step = t.input((), "int64", "step")
    y, mask = t.emit("dropout", [x.value, step.value], p=0.2, seed=5, site=2)
    (wide,) = t.emit("cast", [y], dtype="float32")
    (out,) = t.emit("binary", [resid.value, wide], kind="add")
    t.graph.outputs = {"out": out, "mask": mask}
    (node,) = fuse_pointwise(t.graph).nodes
    kernels = pointwise.generated_kernels(node)
    assert [name for _, name in kernels] == [pointwise.KERNEL_NAME, pointwise.VEC_KERNEL_NAME]
    vec = kernels[0][0].split(pointwise.VEC_KERNEL_NAME)[1]
    assert vec.count("dropout_words(") == 1 and "const int g = q;" in vec
    assert "store4_bytes(out" in vec
    _compile(kernels[0][0])
