"""A small harness for op-level tests: build a graph from arrays, plan it, run it on numpy.

Every value a test feeds (data, weights, labels, cotangents, the dropout step counter) is a
graph input, so a one-op graph runs through the real pipeline: `make_plan` places its
intermediates in an arena and `Executable` runs the numpy kernels, as a compiled step would.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.nn.functional as TF

from stepgraph import losses
from stepgraph.autodiff import append_backward
from stepgraph.ir.ops import VJPS
from stepgraph.backends.numpy import NumpyBackend
from stepgraph.compile.executable import INFERENCE, Executable
from stepgraph.compile.fuse import fuse
from stepgraph.compile.plan import make_plan
from stepgraph.ir.graph import Graph
from stepgraph.ir.trace import Tensor, Tracer

Arrays = dict[str, np.ndarray]
# A graph body: given the tracer and the input tensors by name, trace ops; return the output.
Body = Callable[[Tracer, dict[str, Tensor]], Tensor]


def seeded(test_id: str) -> np.random.Generator:
    """A generator seeded from a test's name: fresh inputs per test, the same on every run."""
    return np.random.default_rng([ord(c) for c in test_id])


def randn(rng: np.random.Generator, *shape, dtype=np.float32) -> np.ndarray:
    """Standard normal values (never all zeros, never exactly zero in practice)."""
    return rng.standard_normal(shape).astype(dtype)


def trace_inputs(tracer: Tracer, arrays: Arrays) -> dict[str, Tensor]:
    return {name: tracer.input(a.shape, str(a.dtype), name) for name, a in arrays.items()}


def run_graph(graph: Graph, arrays: Arrays, bound: dict[str, np.ndarray] | None = None) -> Arrays:
    """Plan `graph`, feed `arrays` to its inputs (by name), run it once on the numpy backend
    and return copies of its outputs. Params and state are bound to the arrays in `bound`,
    which the step updates in place."""
    bound = bound or {}
    plan = make_plan(graph)
    exe = Executable(plan, NumpyBackend(), lambda v: bound[v.name], None, INFERENCE, None)
    exe.feed([arrays[v.name] for v in graph.inputs])
    exe.run_eager()
    return {k: np.array(buf, copy=True) for k, buf in exe.outputs.items()}


def op_forward(op: str, arrays: Arrays, **attrs) -> list[np.ndarray]:
    """Every output of one `op` node applied to `arrays` (in order)."""
    tracer = Tracer()
    ins = trace_inputs(tracer, arrays)
    outs = tracer.emit(op, [t.value for t in ins.values()], **attrs)
    tracer.graph.outputs = {f"out{i}": v for i, v in enumerate(outs)}
    result = run_graph(tracer.graph, arrays)
    return [result[f"out{i}"] for i in range(len(outs))]


def op_vjp(op: str, arrays: Arrays, cotangent: np.ndarray | dict[int, np.ndarray],
           wrt: tuple[str, ...], **attrs) -> Arrays:
    """J^T v of one `op` node through its registered VJP rule, v = `cotangent` on the node's
    first output (or {output index: cotangent} for several outputs, the others None): the
    gradient nodes the rule emits, run after the forward node."""
    cotangents = cotangent if isinstance(cotangent, dict) else {0: cotangent}
    tracer = Tracer()
    ins = trace_inputs(tracer, arrays)
    tracer.emit(op, [t.value for t in ins.values()], **attrs)
    node = tracer.graph.nodes[-1]
    dys = [None] * len(node.outputs)
    for i, v in cotangents.items():
        dys[i] = tracer.input(v.shape, str(v.dtype), f"cotangent{i}").value
    wanted = {ins[name].value for name in wrt}
    grads = VJPS[op](tracer.emit, node, dys, lambda i: node.inputs[i] in wanted)
    outputs = {}
    for name, g in zip(ins, grads):
        if name in wrt:
            assert g is not None, f"{op}: the VJP rule gave no gradient for {name}"
            outputs[name] = g
    tracer.graph.outputs = outputs
    return run_graph(tracer.graph, {**arrays,
                                    **{f"cotangent{i}": v for i, v in cotangents.items()}})


def build_train_graph(body: Body, arrays: Arrays, wrt: tuple[str, ...], fused: bool) -> Graph:
    """Trace `body`; its output y is the step output "out". The loss is y itself when y is a
    scalar, else mse(y, target) with the input "target". Append the backward with respect to
    the inputs named in `wrt` (outputs "grad:<name>") and optionally run the fusion passes."""
    tracer = Tracer()
    ins = trace_inputs(tracer, arrays)
    out = body(tracer, ins)
    loss = out if out.shape == () else losses.mse(out, ins["target"])
    grads = append_backward(tracer, loss.value, [ins[name].value for name in wrt])
    tracer.graph.outputs = {"out": out.value, "loss": loss.value,
                            **{f"grad:{n}": g for n, g in zip(wrt, grads)}}
    return fuse(tracer.graph) if fused else tracer.graph


def forward_and_grads(body: Body, arrays: Arrays, wrt: tuple[str, ...],
                      fused: bool) -> tuple[np.ndarray, Arrays]:
    """The output of `body` and the loss gradients (see build_train_graph) on numpy."""
    result = run_graph(build_train_graph(body, arrays, wrt, fused), arrays)
    return result["out"], {n: result[f"grad:{n}"] for n in wrt}


def torch_forward_and_grads(fn: Callable, arrays: Arrays,
                            wrt: tuple[str, ...]) -> tuple[np.ndarray, Arrays]:
    """The torch oracle of forward_and_grads: fn(**tensors) -> y; the loss is y when scalar,
    else mse(y, target); y and the gradients of wrt, as numpy arrays."""
    ts = {k: torch.tensor(v, requires_grad=k in wrt) for k, v in arrays.items()}
    y = fn(**{k: t for k, t in ts.items() if k != "target"})
    loss = y if y.ndim == 0 else TF.mse_loss(y, ts["target"])
    grads = torch.autograd.grad(loss, [ts[k] for k in wrt])
    return y.detach().numpy(), {k: g.numpy() for k, g in zip(wrt, grads)}


def case_arrays(case: str, on_torch: Callable, make: Callable, dtype) -> Arrays:
    """A (fn, make) case's inputs: make(gen, dtype), gen seeded from the case and dtype, and a
    `target` of the output's shape (on_torch(**tensors)) when the output is not a scalar."""
    gen = seeded(case + str(np.dtype(dtype)))
    arrays = make(gen, dtype)
    probe = on_torch(**{k: torch.tensor(v) for k, v in arrays.items()})
    if probe.ndim:
        arrays["target"] = randn(gen, *probe.shape, dtype=dtype)
    return arrays


def assert_matches_torch(what: str, body: Body, on_torch: Callable, arrays: Arrays,
                         wrt: tuple[str, ...], fused: bool, dtype, rtol: float,
                         grad_rtol: float | None = None) -> None:
    """body's output and gradients on numpy (forward_and_grads) agree with the torch oracle's
    (torch_forward_and_grads), all of `dtype`: the output to rtol, the gradients to grad_rtol
    (rtol unless given)."""
    out, grads = forward_and_grads(body, arrays, wrt, fused)
    want, want_grads = torch_forward_and_grads(on_torch, arrays, wrt)
    assert out.dtype == dtype
    assert_close(out, want, rtol, f"{what} forward")
    grad_rtol = rtol if grad_rtol is None else grad_rtol
    for name in wrt:
        assert grads[name].dtype == dtype
        assert_close(grads[name], want_grads[name], grad_rtol, f"{what} grad of {name}")


def assert_close(got: np.ndarray, want: np.ndarray, rtol: float = 1e-5, what: str = "") -> None:
    """Elementwise relative agreement, with an absolute floor of rtol * max|want|: float32 sums
    taken in a different order differ by rounding relative to the summed terms' size, so an
    element that cancels to near zero cannot agree to rtol of itself."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} vs {want.shape}"
    scale = float(np.max(np.abs(want))) if want.size else 0.0
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale, err_msg=what)


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """Norm-wise relative error of a whole tensor."""
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) /
                 max(np.linalg.norm(np.asarray(want, np.float64)), 1e-30))


def check_with_torch(ours, theirs, arrays: dict, wrt, rtol: float) -> None:
    """ours(**tensors) and theirs(**torch tensors) agree, forward and the gradients of the
    inputs named in `wrt`; a non-scalar result is reduced by a random weighting ("proj") so
    that every element's gradient is checked. Traced and run as a graph (numpy backend)."""
    ref = theirs(**{k: torch.tensor(v) for k, v in arrays.items()})
    proj = np.random.default_rng(1).standard_normal(ref.shape).astype(ref.numpy().dtype)
    arrays = {**arrays, "proj": proj}

    def body(tracer, ins):
        y = ours(**{k: v for k, v in ins.items() if k != "proj"})
        return y if y.shape == () else (y * ins["proj"]).sum()

    got, grads = forward_and_grads(body, arrays, wrt, fused=False)
    ts = {k: torch.tensor(v, requires_grad=k in wrt) for k, v in arrays.items()}
    y = theirs(**{k: v for k, v in ts.items() if k != "proj"})
    y = y if y.ndim == 0 else (y * ts["proj"]).sum()
    t_grads = torch.autograd.grad(y, [ts[k] for k in wrt])
    assert_close(got, y.detach().numpy(), rtol, "forward")
    for name, g in zip(wrt, t_grads):
        assert grads[name].dtype == arrays[name].dtype
        assert_close(grads[name], g.numpy(), rtol, f"grad of {name}")
