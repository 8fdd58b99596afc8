"""OpInfo conformance: PyTorch's own samples for every torch name stepgraph mirrors.

For each entry of OPS (an OpInfo name and variant -> the stepgraph callable), every sample of
`op.sample_inputs("cpu", float32, requires_grad=True)` is traced into a graph (tensors become
graph inputs), run on the NumPy backend with the backward of sum(out * cotangent), and judged by
the tolerance policy (tests/reference.py): forward values and input gradients against torch in
float64 on the same sample, bound a small multiple of torch float32's own error. A sample
stepgraph refuses must raise a StepgraphError (UnsupportedOpError, ShapeError, ...) and its op
must be listed in docs/TESTING.md's refusal list; any other exception fails. The `cuda`
variant runs the same samples on the GPU backend.
"""
from __future__ import annotations

import pathlib
import sys
import types
import unittest

import numpy as np
import pytest
import torch

import stepgraph
from stepgraph.autodiff import append_backward
from stepgraph.backends import get_backend
from stepgraph.compile.executable import INFERENCE, Executable
from stepgraph.compile.plan import make_plan
from stepgraph.errors import StepgraphError
from stepgraph.functions import math as M
from stepgraph.functions import tensors as TS
from stepgraph.ir.graph import Value
from stepgraph.ir.trace import Tensor, Tracer
from stepgraph.nn import functional as F
from tests.ops.helpers import run_graph
from tests.reference import assert_close_to_reference

# torch's test internals import expecttest (a test-only package) for its TestCase base class;
# the samples need nothing from it.
sys.modules.setdefault("expecttest", types.SimpleNamespace(TestCase=unittest.TestCase))
_frozen = torch.backends.flags_frozen()
from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402

# Importing them freezes torch.backends' global flags for the whole process
# (disable_global_flags), which other tests in the same run set: unfreeze them as they were
# (the flag is a global of torch/backends/__init__.py, which its functions read).
torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = not _frozen

TESTING_DOC = pathlib.Path(__file__).parents[2] / "docs" / "TESTING.md"


def _method(name):
    return lambda x, *args, **kwargs: getattr(x, name)(*args, **kwargs)


# (OpInfo name, variant) -> stepgraph callable taking the sample's input, args and kwargs.
OPS = {
    ("add", ""): lambda x, y, alpha=1: x + y * alpha if alpha != 1 else x + y,
    ("sub", ""): lambda x, y, alpha=1: x - y * alpha if alpha != 1 else x - y,
    ("mul", ""): lambda x, y: x * y,
    ("div", "no_rounding_mode"): lambda x, y: x / y,
    ("true_divide", ""): lambda x, y: x / y,
    ("rsub", ""): lambda x, y, alpha=1: y - x * alpha if alpha != 1 else y - x,
    ("neg", ""): lambda x: -x,
    ("positive", ""): lambda x: +x,
    ("pow", ""): lambda x, y: x ** y,
    ("matmul", ""): lambda x, y: x @ y,
    ("mm", ""): lambda x, y: x @ y,
    ("bmm", ""): lambda x, y: x @ y,
    ("reshape", ""): _method("reshape"),
    ("view", ""): _method("view"),
    ("flatten", ""): _method("flatten"),
    ("permute", ""): _method("permute"),
    ("transpose", ""): _method("transpose"),
    ("T", ""): lambda x: x.T,
    ("contiguous", ""): _method("contiguous"),
    ("sum", ""): _method("sum"),
    ("mean", ""): _method("mean"),
    ("narrow", ""): _method("narrow"),
    ("split", ""): _method("split"),
    ("split", "list_args"): _method("split"),
    ("chunk", ""): _method("chunk"),
    ("softmax", ""): _method("softmax"),
    ("log_softmax", ""): _method("log_softmax"),
    ("sigmoid", ""): F.sigmoid,
    ("tanh", ""): F.tanh,
    ("nn.functional.relu", ""): F.relu,
    ("nn.functional.leaky_relu", ""): F.leaky_relu,
    ("nn.functional.gelu", ""): F.gelu,
    ("nn.functional.silu", ""): F.silu,
    ("nn.functional.linear", ""): F.linear,
    ("nn.functional.mse_loss", ""): F.mse_loss,
    ("nn.functional.conv2d", ""): F.conv2d,
    ("nn.functional.max_pool2d", ""): F.max_pool2d,
    ("nn.functional.avg_pool2d", ""): F.avg_pool2d,
    ("nn.functional.adaptive_avg_pool2d", ""): F.adaptive_avg_pool2d,
    ("nn.functional.batch_norm", ""): F.batch_norm,
    ("nn.functional.cross_entropy", ""): F.cross_entropy,
    ("nn.functional.nll_loss", ""): F.nll_loss,
    ("nn.functional.embedding", ""): F.embedding,
    ("nn.functional.layer_norm", ""): F.layer_norm,
    ("nn.functional.scaled_dot_product_attention", ""): F.scaled_dot_product_attention,
    **{(name, ""): getattr(M, name) for name in (
        "exp", "log", "log1p", "expm1", "sqrt", "rsqrt", "abs", "sign", "sin", "cos", "erf",
        "square", "floor", "ceil", "round", "trunc", "reciprocal", "maximum", "minimum",
        "clamp", "clamp_min", "clamp_max", "lt", "le", "gt", "ge", "eq", "ne", "logical_and",
        "logical_or", "logical_xor", "logical_not")},
    ("where", ""): lambda x, condition, other: M.where(condition, x, other),
    ("masked_fill", ""): _method("masked_fill"),
    # joining, splitting and viewing
    ("cat", ""): TS.cat,
    ("stack", ""): TS.stack,
    ("unbind", ""): TS.unbind,
    ("squeeze", ""): TS.squeeze,
    ("squeeze", "multiple"): TS.squeeze,
    ("unsqueeze", ""): TS.unsqueeze,
    ("unflatten", ""): TS.unflatten,
    ("movedim", ""): TS.movedim,
    ("view_as", ""): _method("view_as"),
    ("reshape_as", ""): _method("reshape_as"),
    ("expand", ""): _method("expand"),
    ("expand_as", ""): _method("expand_as"),
    ("repeat", ""): _method("repeat"),
    ("clone", ""): _method("clone"),
    ("tril", ""): TS.tril,
    ("triu", ""): TS.triu,
    # indexing
    ("gather", ""): TS.gather,
    ("index_select", ""): TS.index_select,
    ("__getitem__", ""): lambda x, index: x[index],
    # reductions along dims, sorting (integer outputs are compared exactly)
    ("cumsum", ""): TS.cumsum,
    ("logsumexp", ""): TS.logsumexp,
    ("var", ""): TS.var,
    ("var", "unbiased"): TS.var,
    ("std", ""): TS.std,
    ("std", "unbiased"): TS.std,
    ("amax", ""): TS.amax,
    ("amin", ""): TS.amin,
    ("argmax", ""): TS.argmax,
    ("argmin", ""): TS.argmin,
    ("max", "reduction_no_dim"): TS.max,
    ("max", "reduction_with_dim"): TS.max,
    ("max", "binary"): TS.max,
    ("min", "reduction_no_dim"): TS.min,
    ("min", "reduction_with_dim"): TS.min,
    ("min", "binary"): TS.min,
    ("topk", ""): TS.topk,
    ("sort", ""): TS.sort,
    # reflected operators, nn.functional
    ("__radd__", ""): lambda x, y: y + x,
    ("__rsub__", ""): lambda x, y: y - x,
    ("__rmul__", ""): lambda x, y: y * x,
    ("__rpow__", ""): lambda x, y: y ** x,
    **{(f"nn.functional.{name}", ""): getattr(F, name) for name in (
        "elu", "celu", "selu", "hardtanh", "relu6", "hardswish", "hardsigmoid", "logsigmoid",
        "mish", "softplus", "glu", "group_norm", "rms_norm", "conv1d", "conv_transpose2d",
        "adaptive_max_pool2d", "binary_cross_entropy", "binary_cross_entropy_with_logits",
        "smooth_l1_loss", "l1_loss", "huber_loss", "kl_div")},
    **{("nn.functional.interpolate", mode): F.interpolate for mode in (
        "nearest", "nearest-exact", "linear", "bilinear", "bicubic", "trilinear", "area")},
    # reductions, products, scatter, rounding division, reordering
    **{(name, ""): getattr(TS, name) for name in (
        "prod", "median", "scatter", "scatter_add", "outer", "mv", "dot", "addmm", "baddbmm",
        "floor_divide", "remainder", "flip", "roll", "repeat_interleave")},
    ("addmm", "decomposed"): TS.addmm,
    **{("norm", p): TS.norm for p in ("", "fro", "inf", "nuc")},
    ("einsum", ""): lambda tensors, equation: TS.einsum(equation, *tensors),
    ("div", "floor_rounding"): _method("div"),
    ("div", "trunc_rounding"): _method("div"),
    # new tensors (not new_empty: its values are whatever memory held) and casts
    **{(name, ""): _method(name) for name in (
        "new_zeros", "new_ones", "new_full", "to", "float", "double", "bool", "int", "long")},
    **{(f"nn.functional.{name}", ""): getattr(F, name) for name in (
        "normalize", "softmin", "cosine_similarity", "pairwise_distance", "one_hot",
        "pixel_shuffle", "pixel_unshuffle")},
    ("nn.functional.softmin", "with_dtype"): F.softmin,
    **{("nn.functional.pad", mode): F.pad for mode in (
        "constant", "reflect", "replicate", "replicate_negative", "circular")},
}
# Samples per op beyond which the CPU run keeps the first ones only (max_pool2d has 1440);
# the `slow` sweep runs them all.
FAST_SAMPLES = 40
DTYPES = {torch.float32: np.float32, torch.float64: np.float64}


def _opinfo(name: str, variant: str):
    return next(o for o in op_db if (o.name, o.variant_test_name) == (name, variant))


class _Feed:
    """The sample's tensors as graph inputs (float ones in the run's dtype; those that require
    grad get gradients), except integer 0-d arguments (not the sample's input), passed as
    constant NumPy scalars (narrow's start); torch dtypes as stepgraph's of the same name (what
    `import stepgraph as torch` gives a model file)."""

    def __init__(self, tracer: Tracer, dtype: torch.dtype):
        self.tracer, self.dtype = tracer, dtype
        self.arrays: dict[str, np.ndarray] = {}
        # the inputs' values (an in-place method rebinds its Tensor object to its result)
        self.grad_inputs: dict[str, Value] = {}

    def __call__(self, x, constants: bool = True):
        if isinstance(x, (list, tuple)):
            return type(x)(self(e) for e in x)
        if isinstance(x, torch.dtype):
            return getattr(stepgraph, str(x).removeprefix("torch."))
        if not isinstance(x, torch.Tensor):
            return x
        if constants and not x.is_floating_point() and x.ndim == 0:
            return x.numpy()                    # a constant (narrow's start), not an input
        name = f"t{len(self.arrays)}"
        a = x.detach().to(self.dtype if x.is_floating_point() else x.dtype).numpy()
        self.arrays[name] = np.array(a, copy=True)   # keeps 0-d (ascontiguousarray would not)
        t = self.tracer.input(a.shape, str(a.dtype), name)
        if x.requires_grad:
            self.grad_inputs[name] = t.value
        return t


def _outputs(y) -> list:
    return list(y) if isinstance(y, (tuple, list)) else [y]


def run_on(graph, arrays: dict, device: str) -> dict:
    """The graph's outputs on `device`'s backend (the NumPy one through tests/ops/helpers)."""
    if device == "cpu":
        return run_graph(graph, arrays)
    backend = get_backend(device)
    exe = Executable(make_plan(graph), backend, lambda v: None, backend.make_context(),
                     INFERENCE, None)
    exe.feed([arrays[v.name] for v in graph.inputs])
    exe.run_eager()
    return {k: backend.to_numpy(buf) for k, buf in exe.outputs.items()}


def stepgraph_run(fn, sample, dtype: torch.dtype, cotangents: list, device: str = "cpu"):
    """(outputs, input gradients in the sample's order) of `fn` on `sample` in `dtype`."""
    tracer = Tracer()
    feed = _Feed(tracer, dtype)
    args = [feed(sample.input, constants=False)] + [feed(a) for a in sample.args]
    kwargs = {k: feed(v) for k, v in sample.kwargs.items()}
    outs = _outputs(fn(*args, **kwargs))
    if not all(isinstance(o, Tensor) for o in outs):
        raise AssertionError(f"stepgraph returned {outs!r}, not tensors")
    graph_out = {f"out{i}": o.value for i, o in enumerate(outs)}
    # gradients only through float outputs (a comparison's bool output has none)
    names = list(feed.grad_inputs) if any(c is not None for c in cotangents) else []
    if names:
        terms = []
        for i, (o, c) in enumerate(zip(outs, cotangents)):
            if c is None:
                continue
            ct = tracer.input(c.shape, o.dtype, f"cot{i}")
            feed.arrays[f"cot{i}"] = c.astype(o.dtype)
            terms.append((o * ct).sum())
        loss = terms[0]
        for t in terms[1:]:
            loss = loss + t
        # an input the loss does not reach (prod of an empty tensor, new_zeros' self) has a
        # zero gradient, as torch's allow_unused gives here
        reached = _reaching(tracer.graph, loss.value)
        used = [n for n in names if feed.grad_inputs[n] in reached]
        grads = append_backward(tracer, loss.value, [feed.grad_inputs[n] for n in used])
        graph_out.update({f"grad:{n}": g for n, g in zip(used, grads)})
    tracer.graph.outputs = graph_out
    got = run_on(tracer.graph, feed.arrays, device)
    return ([got[f"out{i}"] for i in range(len(outs))],
            [got.get(f"grad:{n}", np.zeros_like(feed.arrays[n])) for n in names])


def _reaching(graph, loss) -> set:
    """The values `loss` depends on through differentiable nodes (float outputs: a mask or
    an index carries no gradient back)."""
    deps = {loss}
    for node in reversed(graph.nodes):
        if node.op != "stop_gradient" and any(
                v in deps and "float" in v.dtype for v in node.outputs):
            deps.update(node.inputs)
    return deps


def _torch_copy(x, dtype: torch.dtype):
    if isinstance(x, (list, tuple)):
        return type(x)(_torch_copy(e, dtype) for e in x)
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().to(dtype).requires_grad_(x.requires_grad)
    return x


def _grad_leaves(x) -> list:
    if isinstance(x, (list, tuple)):
        return [t for e in x for t in _grad_leaves(e)]
    return [x] if isinstance(x, torch.Tensor) and x.requires_grad else []


def torch_run(op, sample, dtype: torch.dtype, cotangents: list[np.ndarray] | None):
    """(outputs, input gradients) of the OpInfo's torch function on `sample` in `dtype`
    (no gradients without cotangents)."""
    inp = _torch_copy(sample.input, dtype)
    args = [_torch_copy(a, dtype) for a in sample.args]
    kwargs = {k: _torch_copy(v, dtype) for k, v in sample.kwargs.items()}
    outs = _outputs(op.op(inp, *args, **kwargs))
    leaves = _grad_leaves([inp, args, list(kwargs.values())])
    grads = []
    if leaves and cotangents is not None and any(c is not None for c in cotangents):
        pairs = [(o, torch.tensor(c, dtype=o.dtype)) for o, c in zip(outs, cotangents)
                 if c is not None and o.requires_grad]
        grads = torch.autograd.grad([o for o, _ in pairs], leaves, [c for _, c in pairs],
                                    allow_unused=True) if pairs else [None] * len(leaves)
        grads = [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads)]
    return ([o.detach().numpy() for o in outs], [g.numpy() for g in grads])


def _random(sample) -> bool:
    """Samples whose result is random (dropout masks): stepgraph draws its own (Philox, rng.py)
    and cannot match torch's; tests/ops/test_attention_ops.py checks them against the
    composed path instead."""
    return float(sample.kwargs.get("dropout_p", 0.0)) > 0.0


def _refusal_listed(name: str) -> bool:
    return f"`{name}`" in TESTING_DOC.read_text()


def check_op(key: tuple[str, str], limit: int | None, device: str = "cpu",
             dtype: torch.dtype = torch.float32, inplace: bool = False) -> list[str]:
    """Run every sample of OpInfo `key` (the first `limit`); fail on a mismatch or on an error
    that is not a StepgraphError; return the refused samples as "kind: reason" lines."""
    op, fn = _opinfo(*key), _inplace(key[0]) if inplace else OPS[key]
    refused = []
    # ops torch has no derivative for (floor_divide, the integer casts) run without gradients;
    # ops of integer inputs only (one_hot) get int64 samples
    sample_dtype = torch.float32 if torch.float32 in op.supported_dtypes("cpu") else torch.int64
    grad = op.supports_autograd and sample_dtype.is_floating_point
    samples = list(op.sample_inputs("cpu", sample_dtype, requires_grad=grad))[:limit]
    for i, sample in enumerate(samples):
        what = f"{key[0]} sample {i} ({sample.summary() if hasattr(sample, 'summary') else ''})"
        ref64_out, _ = torch_run(op, sample, torch.float64, None)
        gen = np.random.default_rng(i)
        # an in-place form cannot write a result broadcast past its input (torch refuses too)
        if _random(sample) or inplace and sample.broadcasts_input:
            continue
        cts = [gen.standard_normal(o.shape).astype(np.float32) if o.dtype.kind == "f" else None
               for o in ref64_out]
        ref64, ref32 = (torch_run(op, sample, d, cts) for d in (torch.float64, torch.float32))
        try:
            got = stepgraph_run(fn, sample, dtype, cts, device)
        except StepgraphError as err:
            assert _refusal_listed(key[0]), (f"{what}: refused ({type(err).__name__}: {err}) "
                                             "but not listed in docs/TESTING.md")
            refused.append(f"{type(err).__name__}: {err}")
            continue
        for kind, g, r64, r32 in (("out", got[0], ref64[0], ref32[0]),
                                  ("grad", got[1], ref64[1], ref32[1])):
            assert len(g) == len(r64), f"{what}: {len(g)} {kind}s, torch {len(r64)}"
            for j, (a, b, c) in enumerate(zip(g, r64, r32)):
                if b.dtype.kind == "f":
                    assert_close_to_reference(a, b, c, f"{what}: {kind} {j}",
                                              precision=DTYPES[dtype])
                else:       # indices, masks: no rounding, so exactly torch's
                    assert a.shape == b.shape, f"{what}: {kind} {j} shape {a.shape}, {b.shape}"
                    np.testing.assert_array_equal(a, b, err_msg=f"{what}: {kind} {j}")
    return refused


KEYS = pytest.mark.parametrize("key", list(OPS), ids=lambda k: ".".join(filter(None, k)))


# Known mismatches, each with its reason (docs/TESTING.md); strict: fixing one fails the run
# until its entry goes.
KNOWN = {
    ("nn.functional.nll_loss", torch.float32): "(N, C, d...) inputs take the composed path "
                            "(a picked-value product and a mean): 1.64e-7 from float64 against a "
                            "bound of 8.76e-8 on one sample; the fused op's accuracy is not there yet",
    ("nn.functional.rms_norm", torch.float32): "eps=None is the input dtype's epsilon, so the "
                            "float64 reference solves another problem: on a 1-element row the "
                            "gradient is r * eps / (x^2 + eps), 9.31e-10 with float32's eps "
                            "(stepgraph), ~0 with float64's (torch, both dtypes round to 0)",
    ("nn.functional.hardsigmoid", torch.float64): "torch's float64 backward multiplies by "
                            "the float32 constant 1.0f / 6.0f (0.1666666716, 5e-9 off 1/6): "
                            "stepgraph's exact g / 6 is 4.7e-9 from it on a bound of 1.8e-16",
    **{("nn.functional.normalize", d): "p=0.5 over a dim of length 1 is sign(x), of true "
                            "gradient 0: both sides give rounding noise of a cancelling "
                            "difference, stepgraph's 8x torch float32's (3.81e-6 vs 4.77e-7)"
       for d in (torch.float32, torch.float64)},
    ("pow", torch.float64): "the gradient of a 0-d exponent sums x^y * log(x) over terms that "
                            "cancel: 1.15x past the bound scaled down from torch float32's "
                            "error (float64 has no finer reference to show the true one)",
}


@KEYS
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_opinfo_samples(key, dtype, request):
    if (key[0], dtype) in KNOWN:
        request.node.add_marker(pytest.mark.xfail(reason=KNOWN[key[0], dtype], strict=True))
    refused = check_op(key, FAST_SAMPLES, dtype=dtype)
    print(f"{key[0]}: {len(refused)} refused", *sorted(set(refused)), sep="\n  ")


def _inplace(name: str):
    """Tensor.<name>_ on the sample's input, judged by what that tensor holds afterwards
    (the method rebinds it) against torch's out-of-place op."""
    def run(x, *args, **kwargs):
        getattr(x, f"{name}_")(*args, **kwargs)
        return x
    return run


# OPS entries whose OpInfo has an in-place variant that Tensor mirrors as a method (add_, ...)
INPLACE = [key for key in OPS if _opinfo(*key).inplace_variant is not None
           and f"{key[0]}_" in vars(Tensor)]


@pytest.mark.parametrize("key", INPLACE, ids=lambda k: ".".join(filter(None, k)) + "_")
def test_opinfo_inplace_samples(key):
    check_op(key, FAST_SAMPLES, inplace=True)


@pytest.mark.slow
@KEYS
def test_opinfo_every_sample(key):
    check_op(key, None)


# CUDA float32 results judged by the same bound, where the kernel is not strict FP32 on purpose.
KNOWN_CUDA = {
    "nn.functional.scaled_dot_product_attention":
        "the attention kernels' fp32 products are 3xTF32, not strict FP32: dv 9.6e-6 from "
        "float64 against a bound of 1.65e-6 on an H200 (2026-11-28); see docs/TESTING.md",
}


@pytest.mark.cuda
@KEYS
def test_opinfo_samples_cuda(key, request):
    if key[0] in KNOWN_CUDA:
        request.node.add_marker(pytest.mark.xfail(reason=KNOWN_CUDA[key[0]], strict=True))
    elif key[0] == "nn.functional.normalize":
        # the CPU's float32 mismatch (KNOWN) is rounding noise of a zero gradient: whether the
        # kernels' roundings land past the bound too has not been measured on a GPU
        request.node.add_marker(pytest.mark.xfail(reason=KNOWN[key[0], torch.float32],
                                                  strict=False))
    check_op(key, FAST_SAMPLES, device="cuda")
