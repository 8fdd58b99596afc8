"""Pointwise fusion (compile/pointwise.py): which nodes group, that a fused graph computes
exactly what the unfused one did on the numpy backend (forward and backward), and that the
CUDA source generated for a program compiles for sm_90 (no GPU needed)."""
from __future__ import annotations

import numpy as np
import pytest

from stepgraph.compile.fuse import fuse
from stepgraph.compile.pointwise import fuse_pointwise
from stepgraph.ir.trace import Tracer
from tests.ops.helpers import build_train_graph, run_graph, seeded, trace_inputs


def _residual(t: Tracer, ins):
    """relu(x * scale + shift + skip): BatchNorm's eval form and a residual add + ReLU."""
    y = t.op("binary", [ins["x"], ins["scale"]], kind="mul")
    y = t.op("binary", [y, ins["shift"]], kind="add")
    y = t.op("binary", [y, ins["skip"]], kind="add")
    return t.op("act", [y], kind="relu", slope=0.01)


def _arrays(test: str) -> dict[str, np.ndarray]:
    rng = seeded(test)
    return {"x": rng.standard_normal((4, 3, 5, 5)), "scale": rng.standard_normal((1, 3, 1, 1)),
            "shift": rng.standard_normal((1, 3, 1, 1)), "skip": rng.standard_normal((4, 3, 5, 5)),
            "target": rng.standard_normal((4, 3, 5, 5))}


def _ops(graph) -> list[str]:
    return [n.op for n in graph.nodes]


def test_forward_chain_becomes_one_node():
    arrays = _arrays("chain")
    t = Tracer()
    out = _residual(t, trace_inputs(t, arrays))
    t.graph.outputs = {"out": out.value}
    fused = fuse_pointwise(t.graph)
    assert _ops(fused) == ["pointwise"]
    node = fused.nodes[0]
    assert [v.name for v in node.inputs] == ["x", "scale", "shift", "skip"]
    assert len(node.outputs) == 1 and node.outputs[0] is out.value
    want = run_graph(t.graph, arrays)["out"]
    got = run_graph(fused, arrays)["out"]
    np.testing.assert_array_equal(got, want)      # the same reference code runs each step


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_train_graph_fused_equals_unfused(dtype):
    arrays = {k: v.astype(dtype) for k, v in _arrays(f"train-{dtype}").items()}
    wrt = ("x", "scale", "shift", "skip")
    plain = build_train_graph(_residual, arrays, wrt, fused=False)
    fused = build_train_graph(_residual, arrays, wrt, fused=True)
    assert "pointwise" in _ops(fused)
    assert len(fused.nodes) < len(plain.nodes)
    want, got = run_graph(plain, arrays), run_graph(fused, arrays)
    assert want.keys() == got.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_values_read_outside_become_outputs():
    """The pre-activation is also a step output: it stays in memory as a second output."""
    arrays = _arrays("outputs")
    t = Tracer()
    ins = trace_inputs(t, arrays)
    z = t.op("binary", [ins["x"], ins["skip"]], kind="add")
    y = t.op("act", [z], kind="relu", slope=0.01)
    t.graph.outputs = {"z": z.value, "y": y.value}
    fused = fuse_pointwise(t.graph)
    (node,) = fused.nodes
    assert set(node.outputs) == {z.value, y.value}
    got, want = run_graph(fused, arrays), run_graph(t.graph, arrays)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


def test_a_group_never_outruns_an_outside_reader():
    """a = x + skip is read by a reduce_sum between a and the next elementwise node that
    reads both: fusing that node with a would compute a after its reader."""
    arrays = _arrays("reader")
    t = Tracer()
    ins = trace_inputs(t, arrays)
    a = t.op("binary", [ins["x"], ins["skip"]], kind="add")
    s = t.op("reduce_sum", [a], axes=(0, 2, 3))
    s4 = t.op("reshape", [s], shape=(1, 3, 1, 1))
    b = t.op("binary", [a, s4], kind="mul")
    t.graph.outputs = {"b": b.value}
    fused = fuse_pointwise(t.graph)
    assert _ops(fused) == _ops(t.graph)
    np.testing.assert_array_equal(run_graph(fused, arrays)["b"], run_graph(t.graph, arrays)["b"])


def test_groups_need_one_output_shape_and_two_nodes():
    arrays = _arrays("shapes")
    t = Tracer()
    ins = trace_inputs(t, arrays)
    small = t.op("binary", [ins["scale"], ins["shift"]], kind="mul")      # (1, 3, 1, 1)
    big = t.op("binary", [ins["x"], small], kind="add")                 # (4, 3, 5, 5)
    t.graph.outputs = {"big": big.value}
    assert _ops(fuse_pointwise(t.graph)) == ["binary", "binary"]


def test_the_fuse_pipeline_runs_the_pass():
    arrays = _arrays("pipeline")
    t = Tracer()
    out = _residual(t, trace_inputs(t, arrays))
    t.graph.outputs = {"out": out.value}
    assert _ops(fuse(t.graph)) == ["pointwise"]


def test_generated_cuda_source_compiles_for_sm90():
    pytest.importorskip("cupy")
    from cupy.cuda import nvrtc

    try:
        nvrtc.getVersion()
    except Exception:
        pytest.skip("libnvrtc is not loadable")
    from stepgraph.backends.cuda import pointwise
    from stepgraph.backends.cuda.runtime import compiler

    arrays = {k: v.astype(np.float32) for k, v in _arrays("nvrtc").items()}
    graph = build_train_graph(_residual, arrays, ("x", "scale", "shift", "skip"), fused=True)
    nodes = [n for n in graph.nodes if n.op == "pointwise"]
    assert nodes
    for n in nodes:
        source = pointwise.kernel_source(n.attrs["program"], n.attrs["results"],
                                         tuple(n.attrs["shape"]),
                                         tuple(tuple(v.shape) for v in n.inputs))
        assert compiler.compile_source_to_cubin(source, "pointwise.cu", "sm_90")


def test_mixed_bf16_float32_programs_compile_for_sm90(monkeypatch):
    """The programs of a bf16 gpt step, which mix bf16 and float32 registers through casts
    (tests/unit/test_bf16.py test_casts_join_the_pointwise_programs_around_them), compile."""
    pytest.importorskip("cupy")
    from cupy.cuda import nvrtc

    try:
        nvrtc.getVersion()
    except Exception:
        pytest.skip("libnvrtc is not loadable")
    from stepgraph.backends.cuda import pointwise
    from stepgraph.backends.cuda.runtime import compiler
    from stepgraph.compile.fuse import PASSES
    from stepgraph.ir.graph import BF16
    from tests.unit.test_bf16 import gpt_bf16_run

    graph = gpt_bf16_run(monkeypatch, PASSES)[2]
    mixed = [n for n in graph.nodes if n.op == "pointwise"
             and {v.dtype for v in n.inputs + n.outputs} >= {BF16, "float32"}]
    assert mixed
    for n in mixed:
        source = pointwise.kernel_source(n.attrs["program"], n.attrs["results"],
                                         tuple(n.attrs["shape"]),
                                         tuple(tuple(v.shape) for v in n.inputs),
                                         tuple(v.dtype for v in n.inputs))
        assert compiler.compile_source_to_cubin(source, "pointwise.cu", "sm_90")


# ---- bfloat16 programs -------------------------------------------------------------------

def _bf16_resnet_runs(monkeypatch, passes, steps: int = 3):
    """Losses, parameters and bf16 weight copies of `steps` bf16 channels-last resnet steps on
    numpy with the fusion passes `passes`, and the plan's graph."""
    import stepgraph as sg
    import stepgraph.api
    from stepgraph import losses, models, optim
    from stepgraph.compile import fuse as fuse_module

    monkeypatch.setattr(stepgraph.api, "fuse", lambda g: fuse_module.fuse(g, passes=passes))
    gen = seeded("bf16-resnet-fusion")
    x = gen.standard_normal((4, 3, 16, 16)).astype(np.float32)
    y = gen.integers(0, 10, 4).astype(np.int64)
    model = models.resnet(widths=(8, 16, 32))
    model.load_state_dict({k: v for k, v in _initial_resnet_state().items()})
    step = sg.compile_train_step(model, losses.cross_entropy, optim.SGD(lr=0.1, momentum=0.9),
                                 (x, y), precision="bf16", memory_format="channels_last")
    run = [np.float32(step(x, y)).tobytes() for _ in range(steps)]
    state = {k: step.backend.to_numpy(b) for k, b in step.state.items()}
    params = {k: np.array(v.numpy(), copy=True) for k, v in model.named_parameters()}
    graph = step.plan(step.signature).graph
    return run, state, params, graph


_RESNET_STATE: dict = {}


def _initial_resnet_state() -> dict:
    """One initialisation shared by the fused and unfused runs."""
    if not _RESNET_STATE:
        from stepgraph import models

        _RESNET_STATE.update(models.resnet(widths=(8, 16, 32)).state_dict())
    return _RESNET_STATE


def test_bf16_resnet_step_fused_equals_unfused_bit_for_bit(monkeypatch):
    """precision="bf16": the residual add + ReLU (forward) fuses into the BatchNorm before it
    (fuse_batch_norm_residual, which rounds the normalised value and the sum to bf16 as the
    unfused nodes store them, and applies a downsampling shortcut's BatchNorm likewise), the
    gradient sum + ReLU gradient (backward) into bf16
    `pointwise` nodes, whose programs round each instruction to bf16 likewise, and the stem's
    gradient sum into its BatchNorm gradient (fuse_batch_norm_grad_sum, rounding the sum to
    bf16 too): three numpy steps with and without the three passes give the same loss bits,
    parameters and bf16 weight copies."""
    from stepgraph.compile.fuse import PASSES, fuse_batch_norm_grad_sum, \
        fuse_batch_norm_residual
    from stepgraph.compile.pointwise import fuse_pointwise
    from stepgraph.compile.pointwise_views import read_pointwise_views
    from stepgraph.ir.graph import BF16

    without = tuple(p for p in PASSES if p not in (fuse_pointwise, fuse_batch_norm_residual,
                                                    fuse_batch_norm_grad_sum,
                                                    read_pointwise_views))
    want = _bf16_resnet_runs(monkeypatch, without)
    got = _bf16_resnet_runs(monkeypatch, PASSES)
    # (the float32 input's cast to bf16 reads it through the channels-last permute's view)
    programs = [n for n in got[3].nodes if n.op == "pointwise" and not n.attrs.get("views")]
    assert programs and all(v.dtype == BF16 for n in programs for v in n.inputs + n.outputs)
    assert {tuple(i.op for i in n.attrs["program"]) for n in programs} >= {("add", "act_grad")}
    assert [n for n in got[3].nodes if n.attrs.get("residual")]
    assert [n for n in got[3].nodes if n.attrs.get("dy_sum")]
    assert [n for n in got[3].nodes if n.attrs.get("residual_norm")]     # the downsamples'
    assert [n for n in got[3].nodes if n.op == "batch_norm_stats"]
    assert not [n for n in want[3].nodes if n.op == "pointwise"]
    assert got[0] == want[0]
    for k in want[1]:
        np.testing.assert_array_equal(got[1][k], want[1][k], err_msg=k)
    for k in want[2]:
        np.testing.assert_array_equal(got[2][k], want[2][k], err_msg=k)


def test_bf16_program_rounds_every_instruction():
    """A bf16 a + b + c program rounds a + b before adding c, as two unfused bf16 adds do (one
    rounding at the end would differ): 1 + 2^-8 rounds to 1 (ties to even), + 2^-8 again: 1;
    in float32 throughout, 1 + 2^-7, a bf16 value."""
    from stepgraph.backends.numpy import bf16
    from stepgraph.ir.graph import BF16

    t = Tracer()
    a, b, c = (t.input((4,), BF16, name) for name in "abc")
    out = t.op("add", [t.op("add", [a, b]), c])
    t.graph.outputs = {"out": out.value}
    fused = fuse_pointwise(t.graph)
    assert _ops(fused) == ["pointwise"]
    arrays = {"a": np.ones(4, np.float32), "b": np.full(4, 2.0**-8, np.float32),
              "c": np.full(4, 2.0**-8, np.float32)}
    bits = {k: bf16.to_bits(v) for k, v in arrays.items()}
    want = run_graph(t.graph, bits)["out"]
    got = run_graph(fused, bits)["out"]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(bf16.from_bits(got), np.ones(4, np.float32))


def test_cuda_accepts_the_fused_bf16_resnet_step(monkeypatch):
    """Every op of the fused bf16 resnet step (channels-last) has bf16 kernels on CUDA
    (importable without a GPU): the elementwise families and the pointwise programs declare
    them, so check_bf16_support lets it through."""
    pytest.importorskip("cupy")
    from stepgraph.backends.cuda.backend import declared_bf16_ops
    from stepgraph.compile.autocast import check_bf16_support
    from stepgraph.compile.fuse import PASSES
    from stepgraph.compile.pointwise import fuse_pointwise

    declared = declared_bf16_ops()
    assert {"act", "act_grad", "add", "binary", "scalar", "expand", "pointwise"} <= declared
    for passes in (PASSES, tuple(p for p in PASSES if p is not fuse_pointwise)):
        graph = _bf16_resnet_runs(monkeypatch, passes, steps=0)[3]
        check_bf16_support(graph, declared, "cuda")


def _bf16_chain(t: Tracer):
    """relu(x * scale + shift + skip), then sigmoid, * 0.5 and its relu gradient, all bf16."""
    from stepgraph.ir.graph import BF16

    ins = {name: t.input(shape, BF16, name) for name, shape in
           (("x", (4, 3, 5, 5)), ("scale", (1, 3, 1, 1)), ("shift", (1, 3, 1, 1)),
            ("skip", (4, 3, 5, 5)))}
    y = _residual(t, ins)
    s = t.op("scalar", [t.op("act", [y], kind="sigmoid", slope=0.01)], kind="mul", value=0.5)
    return ins, t.op("act_grad", [s, y], kind="relu", slope=0.01)


def test_bf16_chain_fuses_and_rounds_like_the_unfused_nodes():
    from stepgraph.backends.numpy import bf16

    t = Tracer()
    ins, out = _bf16_chain(t)
    t.graph.outputs = {"out": out.value}
    fused = fuse_pointwise(t.graph)
    assert _ops(fused) == ["pointwise"]
    rng = seeded("bf16-chain")
    bits = {k: bf16.to_bits(rng.standard_normal(v.shape).astype(np.float32))
            for k, v in ins.items()}
    np.testing.assert_array_equal(run_graph(fused, bits)["out"], run_graph(t.graph, bits)["out"])


def test_generated_bf16_cuda_source_compiles_for_sm90():
    """A bf16 program loads its inputs as bits, rounds every instruction (bf16_round) and
    stores bits; the source compiles with NVRTC (no GPU needed)."""
    pytest.importorskip("cupy")
    from cupy.cuda import nvrtc

    try:
        nvrtc.getVersion()
    except Exception:
        pytest.skip("libnvrtc is not loadable")
    from stepgraph.backends.cuda import pointwise
    from stepgraph.backends.cuda.runtime import compiler

    t = Tracer()
    _, out = _bf16_chain(t)
    t.graph.outputs = {"out": out.value}
    (node,) = fuse_pointwise(t.graph).nodes
    source, name = pointwise.generated_kernels(node)[0]
    assert source.count("bf16_round(") == len(node.attrs["program"])
    assert "const unsigned short* __restrict__ in0" in source and "bf16_from_float(r" in source
    assert compiler.compile_source_to_cubin(source, "pointwise.cu", "sm_90")


def test_bf16_dropout_program_equals_the_unfused_nodes():
    """bf16 dropout fuses too: the program's mask is the op's, x * mask * scale is rounded
    once (the dropout node's store), then the residual add rounds again."""
    from stepgraph.backends.numpy import bf16
    from stepgraph.ir.graph import BF16

    t = Tracer()
    x, skip = t.input((6, 7), BF16, "x"), t.input((6, 7), BF16, "skip")
    step = t.input((), "int64", "step")
    y, mask = t.emit("dropout", [x.value, step.value], p=0.3, seed=5, site=2)
    (out,) = t.emit("binary", [y, skip.value], kind="add")
    t.graph.outputs = {"out": out, "mask": mask}
    fused = fuse_pointwise(t.graph)
    assert _ops(fused) == ["pointwise"]
    rng = seeded("bf16-dropout")
    arrays = {"x": bf16.to_bits(rng.standard_normal((6, 7)).astype(np.float32)),
              "skip": bf16.to_bits(rng.standard_normal((6, 7)).astype(np.float32)),
              "step": np.array(3, np.int64)}
    want, got = run_graph(t.graph, arrays), run_graph(fused, arrays)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert 0 < want["mask"].sum() < want["mask"].size
