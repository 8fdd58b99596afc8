"""compile/matmul_add.py: add(matmul(a, b), x), in either order and through a reshape of the
product, becomes one matmul that adds x as cuBLASLt's C (attrs add_c). The NumPy reference
stores the product and adds c in its dtype, as the two nodes did, so the rewritten graphs
equal the graphs without the pass bit for bit (float32 and float64): lone sums, the backward
of a value read by two products, a two-branch MLP's steps and the token mixer's. Then the
near-misses left alone and the op's own checks."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from stepgraph import losses, nn, optim
from stepgraph.autodiff import append_backward
from stepgraph.compile.build import ModelLoss, build_train_graph
from stepgraph.compile.feed import signature_of
from stepgraph.compile.fuse import PASSES, fuse
from stepgraph.compile.matmul_add import fuse_matmul_add
from stepgraph.compile.plan import make_plan
from stepgraph.errors import ShapeError
from stepgraph.ir.graph import Value
from stepgraph.ir.ops import infer_outputs
from stepgraph.ir.trace import Tracer
from tests.ops.helpers import randn, run_graph, seeded

WITHOUT = tuple(p for p in PASSES if p is not fuse_matmul_add)
M, K, N = 6, 4, 5


def steps(graph) -> Counter:
    """The ops that run (views placed by the planner are not steps)."""
    plan = make_plan(graph)
    return Counter(n.op for i, n in enumerate(plan.steps) if plan.runs(i))


def sums(graph) -> int:
    """The adds that run: add nodes, binary adds, and adds inside pointwise programs."""
    count = 0
    for n in make_plan(graph).steps:
        program = n.attrs.get("program", ()) if n.op == "pointwise" else (n,)
        count += sum(i.op == "add" or (i.op == "binary" and dict(i.attrs)["kind"] == "add")
                     for i in program)
    return count


def fused_products(graph) -> list:
    return [n for n in graph.nodes if n.op == "matmul" and n.attrs.get("add_c")]


def assert_same_bits(want: dict, got: dict) -> None:
    assert want.keys() == got.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def sum_graph(first: bool = True, op: str = "add", dtype: str = "float32", trans=(False, False),
              view: tuple | None = None, x_shape: tuple | None = None, extra=None,
              **mm_attrs):
    """s = op(a) @ op(b) [viewed as `view`] + x (the product first or second), an output;
    `extra(tracer, product, seen)` may add a reader or an output."""
    t = Tracer()
    ta, tb = trans
    a = t.input((K, M) if ta else (M, K), dtype, "a")
    b = t.input((N, K) if tb else (K, N), dtype, "b")
    (p, *_) = t.emit("matmul", [a.value, b.value], trans_a=ta, trans_b=tb, **mm_attrs)
    seen = t.emit("reshape", [p], shape=view)[0] if view else p
    x = t.input(x_shape or seen.shape, dtype, "x")
    pair = [seen, x.value] if first else [x.value, seen]
    kind = {"kind": "add"} if op == "binary" else {}
    (s,) = t.emit(op, pair, **kind)
    t.graph.outputs = {"s": s}
    if extra:
        extra(t, p, seen)
    return t.graph


def arrays_for(graph, request) -> dict:
    rng = seeded(request.node.name)
    return {v.name: randn(rng, *v.shape, dtype=np.dtype(v.dtype)) for v in graph.inputs}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("op", ["add", "binary"])
@pytest.mark.parametrize("first", [True, False], ids=["product+x", "x+product"])
@pytest.mark.parametrize("trans", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["nn", "tn", "nt", "tt"])
def test_a_sum_of_a_product_is_one_matmul_with_the_same_bits(request, dtype, op, first, trans):
    graph = sum_graph(first, op, dtype, trans)
    rewritten = fuse_matmul_add(graph)
    assert Counter(n.op for n in rewritten.nodes) == {"matmul": 1}
    (mm,) = rewritten.nodes
    assert mm.attrs == {"trans_a": trans[0], "trans_b": trans[1], "add_c": True}
    assert mm.inputs[2].name == "x" and mm.outputs[0] is graph.outputs["s"]
    a = arrays_for(graph, request)
    assert_same_bits(run_graph(graph, a), run_graph(rewritten, a))


@pytest.mark.parametrize("first", [True, False], ids=["product+x", "x+product"])
def test_a_sum_of_a_reshaped_product_adds_x_viewed_as_the_product(request, first):
    graph = sum_graph(first, view=(2, 3, N))
    rewritten = fuse_matmul_add(graph)
    assert steps(graph) == {"matmul": 1, "add": 1}
    assert steps(rewritten) == {"matmul": 1}                 # the two reshapes are views
    (mm,) = fused_products(rewritten)
    assert mm.inputs[2].shape == (M, N) and mm.outputs[0].shape == (M, N)
    assert rewritten.nodes[-1].outputs[0] is graph.outputs["s"]
    a = arrays_for(graph, request)
    assert_same_bits(run_graph(graph, a), run_graph(rewritten, a))


def two_branch(x, w1, w2):
    """A value read by two products: its gradient is their input gradients' sum."""
    h = x.tanh()
    return (h @ w1).sin().sum() + (h @ w2).cos().sum()


def two_branch_graph(x_shape: tuple, dtype: str):
    t = Tracer()
    x = t.input(x_shape, dtype, "x")
    w1, w2 = t.input((x_shape[-1], 7), dtype, "w1"), t.input((x_shape[-1], 3), dtype, "w2")
    loss = two_branch(x, w1, w2)
    dx, dw1, dw2 = append_backward(t, loss.value, [x.value, w1.value, w2.value])
    t.graph.outputs = {"loss": loss.value, "dx": dx, "dw1": dw1, "dw2": dw2}
    return t.graph


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("x_shape", [(10, 6), (2, 5, 6)], ids=["2d", "3d"])
def test_the_backward_sum_of_two_input_gradients_rides_a_gemm(request, x_shape, dtype):
    graph = two_branch_graph(x_shape, dtype)
    before, after = fuse(graph, WITHOUT), fuse(graph)
    # the sum ran inside the tanh gradient's program: that one now only reads it
    assert sums(after) == sums(before) - 1
    assert steps(after)["matmul"] == steps(before)["matmul"]
    assert steps(after).total() == steps(before).total()
    (mm,) = fused_products(after)
    assert mm.inputs[1].name == "w1"           # the later product takes the add
    a = arrays_for(graph, request)
    assert_same_bits(run_graph(before, a), run_graph(after, a))


class TwoBranchMLP(nn.Module):
    """x -> Linear -> ReLU -> h, read by two Linears whose outputs are summed: h's gradient
    is the sum of their input gradients."""

    def __init__(self, features: int = 8, hidden: int = 16, out: int = 4):
        super().__init__()
        self.inner = nn.Linear(features, hidden)
        self.left, self.right = nn.Linear(hidden, out), nn.Linear(hidden, out)

    def forward(self, x):
        h = self.inner(x).relu()
        return self.left(h) + self.right(h)


def train_twice(model, opt, graph, arrays) -> tuple:
    """(losses, parameters and state) after two steps of `graph` on the NumPy backend."""
    bound = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    for v in graph.state:
        if v.name not in bound:
            bound[v.name] = np.array(opt.initial_state(v), dtype=v.dtype)
    done = [run_graph(graph, arrays, bound)["loss"] for _ in range(2)]
    return done, bound


def assert_steps_equal(model, opt, graphs, arrays) -> None:
    start = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    (loss_u, bound_u), (loss_f, bound_f) = (train_twice(model, opt, g, arrays) for g in graphs)
    np.testing.assert_array_equal(loss_f, loss_u)
    for k in (v.name for v in graphs[0].params):
        assert not np.array_equal(bound_u[k], start[k]), f"{k} was not updated"
        np.testing.assert_array_equal(bound_f[k], bound_u[k], err_msg=k)


@pytest.mark.parametrize("x_shape", [(12, 8), (3, 4, 8)], ids=["2d", "3d"])
def test_a_two_branch_mlp_step_equals_unfused(request, x_shape):
    model = TwoBranchMLP()
    opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rng = seeded(request.node.name)
    arrays = {"x": randn(rng, *x_shape), "y": randn(rng, *x_shape[:-1], 4)}
    signature = signature_of(("x", "y"), (arrays["x"], arrays["y"]))
    graph = build_train_graph(model, losses.mse, opt, signature, seed=0)
    before, after = fuse(graph, WITHOUT), fuse(graph)
    assert steps(after)["add"] == steps(before)["add"] - 1
    assert len(fused_products(after)) == 1
    assert_steps_equal(model, opt, (before, after), arrays)


def test_the_token_mixers_input_gradients_ride_their_gemms(request):
    """tests/compat/models/mixer.py: each block's input h feeds the qkv Linear and the
    convolution, and c feeds the gate Linear and the product: the two Linears' input gradients
    (through their (B, T, C) views) take the adds."""
    from tests.compat import loader

    model = loader.load("mixer", "stepgraph").TokenMixer()
    opt = optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    rng = seeded(request.node.name)
    arrays = {"idx": rng.integers(0, 32, (4, 12)), "t": rng.integers(0, 32, (4, 12))}
    signature = signature_of(("idx", "t"), (arrays["idx"], arrays["t"]))
    graph = build_train_graph(model, ModelLoss(), opt, signature, seed=0)
    before, after = fuse(graph, WITHOUT), fuse(graph)
    blocks = len(model.blocks)
    assert len(fused_products(after)) == 2 * blocks
    assert steps(after)["add"] == steps(before)["add"] - 2 * blocks
    assert_steps_equal(model, opt, (before, after), arrays)


def mutated_between(t, p, seen) -> None:
    """A node between the product and the sum that writes b in place (as an update would)."""
    b = t.graph.inputs[1]
    add = t.graph.nodes.pop()
    t.emit("scalar", [b], kind="mul", value=2.0)
    t.graph.nodes[-1].mutates = (0,)
    t.graph.nodes.append(add)


def mutated_after(t, p, seen) -> None:
    t.emit("scalar", [t.graph.inputs[1]], kind="mul", value=2.0)
    t.graph.nodes[-1].mutates = (0,)


NEAR_MISSES = {
    "product read twice": dict(extra=lambda t, p, seen: t.graph.outputs.update(
        r=t.emit("reduce_sum", [p], axes=(0,))[0])),
    "product is an output": dict(extra=lambda t, p, seen: t.graph.outputs.update(p=p)),
    "view read twice": dict(view=(2, 3, N), extra=lambda t, p, seen: t.graph.outputs.update(
        r=t.emit("reduce_sum", [seen], axes=(0,))[0])),
    "view is an output": dict(view=(2, 3, N),
                              extra=lambda t, p, seen: t.graph.outputs.update(v=seen)),
    "bf16": dict(dtype="bfloat16"),
    "float16": dict(dtype="float16"),
    "broadcasting add": dict(op="binary", x_shape=(N,)),
    "bias_grad": dict(trans=(True, False), bias_grad=True),
    "b written between": dict(extra=mutated_between),
}


@pytest.mark.parametrize("case", NEAR_MISSES)
def test_near_misses_keep_their_add(case):
    graph = sum_graph(**NEAR_MISSES[case])
    rewritten = fuse_matmul_add(graph)
    assert not fused_products(rewritten)
    assert [n.op for n in rewritten.nodes] == [n.op for n in graph.nodes]


def test_a_write_after_the_sum_does_not_stop_it():
    assert fused_products(fuse_matmul_add(sum_graph(extra=mutated_after)))


def test_a_fused_product_takes_no_second_add():
    graph = fuse_matmul_add(sum_graph())
    t = Tracer()
    t.graph = graph
    (s2,) = t.emit("add", [graph.outputs.pop("s"), graph.inputs[2]])
    graph.outputs["s2"] = s2
    assert len(fused_products(fuse_matmul_add(graph))) == 1
    assert [n.op for n in fuse_matmul_add(graph).nodes] == ["matmul", "add"]


def values(*specs):
    return [Value(shape, dtype) for shape, dtype in specs]


@pytest.mark.parametrize("ins,attrs,match", [
    ((((M, K), "float32"), ((K, N), "float32"), ((N, M), "float32")), {"add_c": True},
     r"add_c's c is float32\[5, 6\], the product float32\[6, 5\]"),
    ((((M, K), "float32"), ((K, N), "float32"), ((M, N), "float64")), {"add_c": True},
     "add_c's c is float64"),
    ((((M, K), "bfloat16"), ((K, N), "bfloat16"), ((M, N), "bfloat16")), {"add_c": True},
     "only float32 or float64 products take a c"),
    ((((K, M), "float32"), ((K, N), "float32"), ((M, N), "float32")),
     {"add_c": True, "trans_a": True, "bias_grad": True}, "add_c and bias_grad together"),
    ((((M, K), "float32"), ((K, N), "float32")), {"add_c": True}, "2 inputs with add_c=True"),
    ((((M, K), "float32"), ((K, N), "float32"), ((M, N), "float32")), {},
     "3 inputs with add_c=False"),
])
def test_the_shape_rule_says_what_mismatched(ins, attrs, match):
    with pytest.raises(ShapeError, match=match):
        infer_outputs("matmul", values(*ins), attrs)


def test_a_fused_product_has_no_vjp():
    t = Tracer()
    a, b, c = (t.input(s, "float32", n) for s, n in (((M, K), "a"), ((K, N), "b"),
                                                     ((M, N), "c")))
    s = t.op("matmul", [a, b, c], add_c=True)
    with pytest.raises(NotImplementedError, match="no VJP with add_c"):
        append_backward(t, s.sum().value, [a.value])


# ---- the CUDA side's bookkeeping, without a GPU ---------------------------------------------

def test_a_gemm_spec_adds_a_separate_c_with_the_default_epilogue_only():
    from stepgraph.backends.cuda.matmul.gemm import GemmSpec, Layout

    lay = Layout(rows=4, cols=4, ld=4)
    assert GemmSpec(lay, lay, lay, add_c=True).add_c
    with pytest.raises(ValueError, match="DEFAULT epilogue alone"):
        GemmSpec(lay, lay, lay, add_c=True, epilogue="RELU")
    with pytest.raises(ValueError, match="never with C = D"):
        GemmSpec(lay, lay, lay, add_c=True, accumulate=True)


def test_a_gemm_run_takes_a_c_pointer_exactly_with_add_c():
    from stepgraph.backends.cuda.matmul.gemm import GemmCache, GemmSpec, Layout

    lay = Layout(rows=4, cols=4, ld=4)
    cache = GemmCache.__new__(GemmCache)         # no handle: the check comes before any call
    with pytest.raises(ValueError, match="C is given exactly when the spec adds it"):
        cache.run(GemmSpec(lay, lay, lay, add_c=True), 0, 0x100, 0x200, 0x300)
    with pytest.raises(ValueError, match="C is given exactly when the spec adds it"):
        cache.run(GemmSpec(lay, lay, lay), 0, 0x100, 0x200, 0x300, c_ptr=0x400)


def test_the_gemm_spec_of_an_addend_is_laid_out_as_the_result():
    cuda_fakes = pytest.importorskip("tests.unit.test_nvrtc_compile")
    from stepgraph.backends.cuda.matmul import gemm

    Fake, n = cuda_fakes.Fake, 64                      # rows of 256 bytes
    a, b, out = Fake((M, K), ptr=0x1000), Fake((K, n), ptr=0x2000), Fake((M, n), ptr=0x3000)
    assert gemm.matmul_spec(a, b, out, addend=Fake((M, n), ptr=0x4000)).align[2] == 256
    spec = gemm.matmul_spec(a, b, out, addend=Fake((M, n), ptr=0x4010))
    assert spec.add_c and spec.align[2] == 16          # C's pointer is 16-byte aligned only
    assert not gemm.matmul_spec(a, b, out).add_c
    with pytest.raises(ShapeError, match="not laid out as the result"):
        gemm.matmul_spec(a, b, out, addend=Fake((n, M), ptr=0x4000))
    with pytest.raises(ShapeError, match="not laid out as the result"):
        gemm.matmul_spec(a, b, out, addend=Fake((M, n), "float64", ptr=0x4000))


@pytest.mark.parametrize("path,shape", [("small", (33, 17, 9)), ("small", (5, 300, 7)),
                                        ("tile", (128, 512, 256))])
def test_the_small_and_tiled_kernels_take_the_addend(monkeypatch, path, shape):
    """add_c on the paths without cuBLASLt: the addend reaches the kernel's `addend`
    parameter (the fourth), and every argument fits the kernel's parameters."""
    from types import SimpleNamespace

    cuda_fakes = pytest.importorskip("tests.unit.test_nvrtc_compile")
    if not cuda_fakes._nvrtc_usable():
        pytest.skip("libnvrtc is not loadable")
    from stepgraph.backends.cuda.matmul import linear, small_matmul
    from stepgraph.ir.graph import Node

    Fake, launched = cuda_fakes.Fake, []
    monkeypatch.setattr(small_matmul.compiler, "kernel", lambda filename, name: (
        lambda grid, block, args, stream: launched.append((filename, name, grid, block, args))))
    monkeypatch.setattr(linear, "PATH", path if path == "tile" else "auto")
    m, k, n = shape
    a, b = Fake((m, k), ptr=0x1000), Fake((k, n), ptr=0x2000)
    addend, out = Fake((m, n), ptr=0x3000), Fake((m, n), ptr=0x4000)
    node = Node("matmul", [], [], dict(add_c=True))
    linear.IMPLS["matmul"](node, [a, b, addend], [out], SimpleNamespace(stream=None,
                                                                         precision="fp32"))
    (launch,) = launched
    assert launch[0] == f"{path}_matmul.cu" and launch[4][3] is addend and launch[4][4] is out
    cuda_fakes._assert_launches_match(launched)
