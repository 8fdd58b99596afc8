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
    from stepgraph.backends.cuda import compiler, pointwise

    arrays = {k: v.astype(np.float32) for k, v in _arrays("nvrtc").items()}
    graph = build_train_graph(_residual, arrays, ("x", "scale", "shift", "skip"), fused=True)
    nodes = [n for n in graph.nodes if n.op == "pointwise"]
    assert nodes
    for n in nodes:
        source = pointwise.kernel_source(n.attrs["program"], n.attrs["results"],
                                         tuple(n.attrs["shape"]),
                                         tuple(tuple(v.shape) for v in n.inputs))
        assert compiler.compile_source_to_cubin(source, "pointwise.cu", "sm_90")
