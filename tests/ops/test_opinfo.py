"""OpInfo conformance: PyTorch's own samples for every torch name stepgraph mirrors.

For each entry of OPS (an OpInfo name and variant -> the stepgraph callable), every sample of
`op.sample_inputs("cpu", float32, requires_grad=True)` (drawn from a seed of the op's name, so
every run sees the same values) is traced into a graph (tensors become graph inputs), run on
the NumPy backend with the backward of sum(out * cotangent), and judged by the tolerance policy
(tests/reference.py): forward values and input gradients against torch in float64 on the same
sample, bound a small multiple of torch float32's own error.

Each sample is judged on its own: it is compared, or refused, or a known mismatch, or left
out, and the test lists every sample that was not compared with its reason. A refusal must be
a StepgraphError that a rule of REFUSALS names for that very sample (its kind, the error type
and a fragment of the message); a sample a rule names must be refused. A known mismatch
(KNOWN, per sample) must fail its comparison. A test that compared no sample fails; ops whose
every sample is refused are REFUSED_OPS, tested for that. The `cuda` variant runs the same
samples on the GPU backend.
"""
from __future__ import annotations

import dataclasses
import pathlib
import re
import sys
import types
import unittest
import zlib
from typing import Callable

import numpy as np
import pytest
import torch

import stepgraph
from stepgraph.autodiff import append_backward
from stepgraph.backends import get_backend
from stepgraph.compile.executable import INFERENCE, Executable
from stepgraph.compile.plan import make_plan
from stepgraph.errors import ShapeError, StepgraphError, UnsupportedOpError
from stepgraph.functions import math as M
from stepgraph.functions import tensors as TS
from stepgraph.ir.graph import Value
from stepgraph.ir.trace import Tensor, Tracer
from stepgraph.nn import functional as F
from tests.ops.helpers import run_graph
from tests.reference import FACTOR, assert_close_to_reference

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
    # OpInfo's op is lambda weight, idx: F.embedding(idx, weight): the sample's input is the
    # weight
    ("nn.functional.embedding", ""): lambda weight, idx, **kwargs: F.embedding(idx, weight,
                                                                               **kwargs),
    ("nn.functional.layer_norm", ""): F.layer_norm,
    ("nn.functional.scaled_dot_product_attention", ""): F.scaled_dot_product_attention,
    **{(f"nn.functional.{name}", ""): getattr(F, name) for name in (
        "softsign", "tanhshrink", "threshold", "prelu", "instance_norm", "margin_ranking_loss",
        "hinge_embedding_loss", "soft_margin_loss", "multilabel_soft_margin_loss",
        "cosine_embedding_loss", "triplet_margin_loss", "poisson_nll_loss", "gaussian_nll_loss",
        "max_pool1d", "avg_pool1d", "adaptive_avg_pool1d", "conv_transpose1d", "bilinear")},
    **{(name, ""): getattr(M, name) for name in (
        "exp", "log", "log1p", "expm1", "sqrt", "rsqrt", "abs", "sign", "sin", "cos", "erf",
        "square", "floor", "ceil", "round", "trunc", "reciprocal", "maximum", "minimum",
        "clamp", "clamp_min", "clamp_max", "lt", "le", "gt", "ge", "eq", "ne", "logical_and",
        "logical_or", "logical_xor", "logical_not", "isnan", "isinf", "isposinf", "isneginf",
        "isfinite", "isclose", "all", "any", "lerp", "addcmul", "addcdiv", "hypot", "logaddexp",
        "xlogy", "frac", "fmod", "float_power", "nan_to_num", "heaviside", "sinc")},
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
    **{("nn.functional.interpolate", mode): F.interpolate for mode in ("nearest", "bilinear")},
    # reductions, products, scatter, rounding division, reordering
    **{(name, ""): getattr(TS, name) for name in (
        "prod", "median", "scatter", "scatter_add", "outer", "mv", "dot", "addmm", "baddbmm",
        "floor_divide", "remainder", "flip", "roll", "repeat_interleave")},
    ("addmm", "decomposed"): TS.addmm,
    **{("norm", p): TS.norm for p in ("", "fro", "inf")},
    ("einsum", ""): lambda tensors, equation: TS.einsum(equation, *tensors),
    # composed reductions, shapes and joins (functions/tensors.py)
    **{(name, ""): getattr(TS, name) for name in (
        "count_nonzero", "aminmax", "dist", "diff", "renorm", "tile", "broadcast_to",
        "broadcast_tensors", "flipud", "fliplr", "rot90", "vstack", "hstack", "dstack",
        "column_stack", "atleast_1d", "atleast_2d", "atleast_3d", "select", "take_along_dim",
        "tensor_split", "diagonal", "diag", "cartesian_prod", "block_diag", "kron", "var_mean",
        "std_mean")},
    ("var_mean", "unbiased"): TS.var_mean,
    ("std_mean", "unbiased"): TS.std_mean,
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
# Names stepgraph mirrors whose every OpInfo sample it refuses (REFUSALS says why):
# test_opinfo_refused_samples checks that each is refused as listed.
REFUSED_OPS = {
    **{("nn.functional.interpolate", mode): F.interpolate for mode in (
        "nearest-exact", "linear", "bicubic", "trilinear", "area")},
    ("norm", "nuc"): TS.norm,
}
# Samples per op beyond which the CPU run keeps the first ones only (max_pool2d has 1440);
# the `slow` sweep runs them all.
FAST_SAMPLES = 40
DTYPES = {torch.float32: np.float32, torch.float64: np.float64}


def _opinfo(name: str, variant: str):
    return next(o for o in op_db if (o.name, o.variant_test_name) == (name, variant))


def _samples(op, key: tuple[str, str], limit: int | None) -> list:
    """The op's first `limit` samples (all for None), their random values drawn from a seed of
    the op's name: the fast, slow and cuda runs and both dtypes see the same samples, so a
    rule or a known mismatch names the same one in each. Ops torch has no derivative for
    (floor_divide, the integer casts) get samples without gradients; ops of integer inputs
    only (one_hot) int64 samples."""
    sample_dtype = torch.float32 if torch.float32 in op.supported_dtypes("cpu") else torch.int64
    grad = op.supports_autograd and sample_dtype.is_floating_point
    torch.manual_seed(zlib.crc32(".".join(key).encode()))
    return list(op.sample_inputs("cpu", sample_dtype, requires_grad=grad))[:limit]


class _Feed:
    """The sample's tensors as graph inputs (float ones in the run's dtype; those that require
    grad get gradients), except integer 0-d arguments (not the sample's input): eager
    stepgraph tensors, as `torch.tensor(2)` in a model file gives (narrow's start, a 0-d
    index), constants of the trace where they meet it; torch dtypes as stepgraph's of the
    same name (what `import stepgraph as torch` gives a model file)."""

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
        if isinstance(x, torch.device):
            return stepgraph.device(str(x))
        if not isinstance(x, torch.Tensor):
            return x
        if constants and not x.is_floating_point() and x.ndim == 0:
            return stepgraph.tensor(x.cpu().numpy())
        name = f"t{len(self.arrays)}"
        # .cpu(): torch's samples of `to` name device 'cuda' on a machine with a GPU
        a = x.detach().cpu().to(self.dtype if x.is_floating_point() else x.dtype).numpy()
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


def _rms_norm_problem(kwargs: dict, dtype: torch.dtype) -> dict:
    """rms_norm's eps=None is the input dtype's epsilon: the float64 reference of a float32
    run normalises with float32's, the problem stepgraph's float32 run solves (float64's
    would make another: on a 1-element row the gradient r * eps / (x^2 + eps) differs)."""
    return {**kwargs, "eps": torch.finfo(dtype).eps} if kwargs.get("eps") is None else kwargs


# OpInfo name -> the sample's kwargs as the problem a run in `dtype` solves, for the torch
# runs that judge it (reference and torch float32 alike)
PROBLEM = {"nn.functional.rms_norm": _rms_norm_problem}


def torch_run(op, sample, dtype: torch.dtype, cotangents: list[np.ndarray] | None,
              problem: torch.dtype | None = None):
    """(outputs, input gradients) of the OpInfo's torch function on `sample` in `dtype`
    (no gradients without cotangents), solving the problem of a run in `problem` (PROBLEM;
    the sample's own when None). Results come back as host arrays: on a machine with a GPU,
    torch's samples of `to` and new_* name device 'cuda' too."""
    inp = _torch_copy(sample.input, dtype)
    args = [_torch_copy(a, dtype) for a in sample.args]
    kwargs = {k: _torch_copy(v, dtype) for k, v in sample.kwargs.items()}
    if problem is not None and op.name in PROBLEM:
        kwargs = PROBLEM[op.name](kwargs, problem)
    outs = _outputs(op.op(inp, *args, **kwargs))
    leaves = _grad_leaves([inp, args, list(kwargs.values())])
    grads = []
    if leaves and cotangents is not None and any(c is not None for c in cotangents):
        pairs = [(o, torch.tensor(c, dtype=o.dtype, device=o.device))
                 for o, c in zip(outs, cotangents)
                 if c is not None and o.requires_grad]
        grads = torch.autograd.grad([o for o, _ in pairs], leaves, [c for _, c in pairs],
                                    allow_unused=True) if pairs else [None] * len(leaves)
        grads = [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads)]
    return ([o.detach().cpu().numpy() for o in outs], [g.cpu().numpy() for g in grads])


# ---- what a sample may do other than match torch: each rule names its samples ----------------

@dataclasses.dataclass(frozen=True)
class Run:
    """The circumstances of one sample's run, what the rules look at besides the sample."""
    index: int
    dtype: torch.dtype
    device: str


Applies = Callable[[object, Run], bool]     # (SampleInput, Run) -> does the rule name it


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Samples stepgraph refuses: those `applies` names must raise `error` with `message` in
    its text, and no other sample may be refused. `kind` is the sample kind as
    docs/TESTING.md's refusal table words it (test_refusals_are_documented)."""
    kind: str
    applies: Applies
    error: type
    message: str


@dataclasses.dataclass(frozen=True)
class Known:
    """Samples that run but miss torch's float64 reference by more than the bound, for
    `reason` (docs/TESTING.md, known mismatches): those `applies` names must fail their
    comparison (a strict expected failure, per sample); every other sample is compared.
    With `looser` set, the samples are of an arithmetic coarser than float32 on purpose
    (3xTF32): they are compared against the bound times `looser` instead, and must meet it."""
    kind: str
    applies: Applies
    reason: str
    looser: float | None = None


def _shape(x) -> tuple:
    return tuple(x.shape) if isinstance(x, torch.Tensor) else ()


def _arg(s, i: int, default=None):
    return s.args[i] if len(s.args) > i else default


def _batch_dims(a: tuple, b: tuple) -> tuple[tuple, tuple]:
    """matmul's batch dims of each operand (a vector and a matrix have none)."""
    return a[:-2] if len(a) > 2 else (), b[:-2] if len(b) > 2 else ()


def _broadcast_batch(s, run) -> bool:
    a, b = _batch_dims(_shape(s.input), _shape(s.args[0]))
    return bool(b) and a != b


def _same_padding_asymmetric(s, run) -> bool:
    if s.kwargs.get("padding") != "same":
        return False
    kernel = _shape(s.args[0])[2:]
    dilation = s.kwargs.get("dilation", 1)
    dilation = (dilation,) * len(kernel) if isinstance(dilation, int) else tuple(dilation)
    return any(d * (k - 1) % 2 for k, d in zip(kernel, dilation))


def _unbatched(rank: int) -> Applies:
    return lambda s, run: s.input.ndim == rank


def _kw(name: str, test: Callable = bool, position: int | None = None) -> Applies:
    """The sample's argument `name` (a keyword, or the positional one after the input at
    `position`) passes `test`."""
    def applies(s, run):
        if name in s.kwargs:
            return test(s.kwargs[name])
        return position is not None and len(s.args) > position and test(s.args[position])
    return applies


def _any(*rules: Applies) -> Applies:
    return lambda s, run: any(r(s, run) for r in rules)


def _in_f64(rule: Applies) -> Applies:
    """A dtype= of float32 that only the float64 run differs from."""
    return lambda s, run: run.dtype == torch.float64 and rule(s, run)


_CHANNELS_LAST = _kw("memory_format", lambda f: f == torch.channels_last)


def _float64_on_cuda(s, run) -> bool:
    """A float64 result on the cuda backend, whose elementwise kernels compute float32: a
    dtype argument of float64 (a tensor argument, `x.to(other)`'s, is cast to the run's
    dtype on both sides, as every sample tensor is)."""
    return run.device == "cuda" and any(a is torch.float64
                                        for a in (*s.args, *s.kwargs.values()))


_FLOAT64_CUDA = Refusal("a float64 result on the cuda backend (float32 elementwise kernels)",
                        _float64_on_cuda, UnsupportedOpError,
                        "float64 values in the cuda backend's elementwise kernels")
_LIST_INDEX = lambda s, run: any(    # noqa: E731
    isinstance(i, (list, tuple)) and not isinstance(i, torch.Tensor)
    for i in (s.args[0] if isinstance(s.args[0], tuple) else (s.args[0],)))
_BOOL_MASK = lambda s, run: any(     # noqa: E731
    isinstance(i, torch.Tensor) and i.dtype == torch.bool
    for i in (s.args[0] if isinstance(s.args[0], (tuple, list)) else (s.args[0],)))
U, S = UnsupportedOpError, ShapeError

# OpInfo name -> the rules of its refused samples (an op's variants share them)
REFUSALS: dict[str, tuple[Refusal, ...]] = {
    "matmul": (
        Refusal("a batched right operand of other batch dims than the left's "
                "((10,) @ (5, 10, 5), (5, 5, 5) @ (1, 5, 5))", _broadcast_batch, U,
                "batched operands need the same batch dims"),
        Refusal("K = 0 with batch dims ((5, 5, 0) @ (0, 5))",
                lambda s, r: len(_shape(s.input)) > 2 and _shape(s.input)[-1] == 0, S,
                "cannot view"),),
    "nn.functional.conv2d": (
        Refusal("unbatched (C, H, W) input", _unbatched(3), S, "input must be (N, C, H, W)"),
        Refusal("padding='same' needing asymmetric padding", _same_padding_asymmetric, U,
                "needs asymmetric padding"),),
    "nn.functional.max_pool2d": (
        Refusal("return_indices=True", _kw("return_indices", position=5), U,
                "with return_indices"),
        Refusal("unbatched (C, H, W) input", _unbatched(3), S, "input must be (N, C, H, W)"),),
    "nn.functional.max_pool1d": (
        Refusal("return_indices=True", _kw("return_indices", position=5), U,
                "with return_indices"),),
    "nn.functional.avg_pool1d": (
        Refusal("ceil_mode=True", _kw("ceil_mode", position=3), U, "with ceil_mode"),),
    "nn.functional.instance_norm": (
        Refusal("float64 running statistics to update (the update op takes float32)",
                lambda s, r: r.dtype == torch.float64
                and s.kwargs.get("running_mean") is not None
                and s.kwargs.get("use_input_stats", True), U,
                "updating float64 running statistics"),),
    "nn.functional.avg_pool2d": (
        Refusal("ceil_mode=True", _kw("ceil_mode", position=3), U, "with ceil_mode"),
        Refusal("divisor_override", _kw("divisor_override", lambda d: d is not None, 5), U,
                "divisor_override"),),
    "nn.functional.adaptive_avg_pool2d": (
        Refusal("unbatched (C, H, W) input", _unbatched(3), S, "input must be (N, C, H, W)"),),
    "nn.functional.adaptive_max_pool2d": (
        Refusal("return_indices=True", _kw("return_indices", position=1), U,
                "with return_indices"),
        Refusal("unbatched (C, H, W) input", _unbatched(3), S, "input must be (N, C, H, W)"),),
    "nn.functional.batch_norm": (
        Refusal("1-d input (no channel axis)", _unbatched(1), S, "input must be (N, C, ...)"),),
    "nn.functional.conv1d": (
        Refusal("unbatched (C, L) input", _unbatched(2), S, "input (N, C, L)"),),
    "nn.functional.conv_transpose2d": (
        Refusal("unbatched (C, H, W) input", _unbatched(3), S, "input (N, Cin, H, W)"),),
    "nn.functional.group_norm": (
        Refusal("an empty batch (N = 0)", lambda s, r: s.input.shape[0] == 0, S,
                "cannot view"),),
    "nn.functional.interpolate": (
        Refusal("modes other than nearest and bilinear; 3-d and 5-d inputs",
                lambda s, r: s.input.ndim != 4 or s.kwargs.get("mode") not in (
                    "nearest", "bilinear"), U, "only 4-d nearest and bilinear"),),
    "nn.functional.one_hot": (
        Refusal("num_classes=-1 (the width would depend on the data)",
                lambda s, r: s.kwargs.get("num_classes", _arg(s, 0, -1)) == -1, U,
                "without num_classes"),),
    "norm": (
        Refusal("'nuc' (a matrix norm: it needs an SVD)",
                lambda s, r: s.kwargs.get("p", _arg(s, 0)) == "nuc", U, "p='nuc'"),),
    "cumsum": (
        Refusal("dtype=float32 in the float64 run", _in_f64(_kw("dtype")), U, "cast first"),),
    "prod": (
        Refusal("dtype=float32 in the float64 run", _in_f64(_kw("dtype")), U, "cast first"),),
    "__getitem__": (
        Refusal("a Python list as an index (x[[1, 2]])", _LIST_INDEX, U,
                "indexing with a list operand"),
        Refusal("a boolean mask (its result's shape depends on the data)", _BOOL_MASK, U,
                "boolean-mask indexing"),),
    "einsum": (
        Refusal("an index repeated within one operand (a diagonal, 'iji->j')",
                lambda s, r: any(len(set(t)) < len(t) for t in s.args[0].replace(
                    "...", "").replace(" ", "").split("->")[0].split(",")), U,
                "repeats an index within one operand"),),
    "repeat_interleave": (
        Refusal("a tensor of repeats (the output's shape depends on the data)",
                lambda s, r: isinstance(s.kwargs.get("repeats", _arg(s, 0)), torch.Tensor)
                and s.kwargs.get("repeats", _arg(s, 0)).ndim > 0, U, "a tensor of repeats"),),
    **{name: (Refusal("memory_format=torch.channels_last", _CHANNELS_LAST, U,
                      "memory_format=torch.channels_last"),)
       for name in ("float", "bool", "int", "long")},
    "to": (Refusal("memory_format=torch.channels_last", _CHANNELS_LAST, U,
                   "memory_format=torch.channels_last"), _FLOAT64_CUDA),
    "double": (Refusal("memory_format=torch.channels_last", _CHANNELS_LAST, U,
                       "memory_format=torch.channels_last"),
               dataclasses.replace(_FLOAT64_CUDA, applies=lambda s, r: r.device == "cuda")),
    # (every sample of double and of softmin's with_dtype variant on cuda: CUDA_REFUSED_OPS)
    "nn.functional.softmin": (_FLOAT64_CUDA,),
    # float_power computes and returns float64, as torch's: every sample on cuda
    "float_power": (dataclasses.replace(_FLOAT64_CUDA, applies=lambda s, r: r.device == "cuda"),
                    ),
    "gather": (
        Refusal("a uint8 index", lambda s, r: _arg(s, 1).dtype == torch.uint8, S,
                "index must be int32 or int64"),
        Refusal("an index of another rank than the input (an empty (2, 0) index of a (5,) "
                "input)", lambda s, r: s.input.ndim and _arg(s, 1).ndim != s.input.ndim, S,
                "must have the rank of"),),
    "tensor_split": (
        Refusal("a 1-d tensor of indices (a graph input: the pieces' sizes would depend on its "
                "values)", lambda s, r: isinstance(_arg(s, 0), torch.Tensor) and
                _arg(s, 0).ndim == 1, U, "a traced tensor of indices_or_sections"),),
    "cat": (
        Refusal("a 1-d empty (0,) tensor beside tensors of higher rank (torch's legacy skip)",
                lambda s, r: any(t.shape == (0,) for t in s.input) and
                any(t.ndim > 1 for t in s.input), S, "out of range"),),
}

# (OpInfo name, dtype) -> its known mismatches, each naming its samples
KNOWN: dict[tuple[str, torch.dtype], tuple[Known, ...]] = {
    ("nn.functional.hardsigmoid", torch.float64): (
        Known("inputs in (-3, 3), where the gradient is g / 6",
              lambda s, r: bool(((s.input > -3) & (s.input < 3)).any()),
              "torch's float64 backward multiplies by the float32 constant 1.0f / 6.0f "
              "(0.1666666716, 5e-9 off 1/6): stepgraph's exact g / 6 is 4.7e-9 from it on a "
              "bound of 1.8e-16"),),
    **{("nn.functional.normalize", d): (
        Known("p=0.5 over a dim of length 1",
              lambda s, r: s.kwargs.get("p") == 0.5 and
              s.input.shape[s.kwargs.get("dim", 1)] == 1,
              "y = x / (sqrt|x|)^2 = sign(x), of true gradient 0: both sides give rounding "
              "noise of a cancelling difference, stepgraph's 8x torch float32's (3.81e-6 vs "
              "4.77e-7)"),) for d in (torch.float32, torch.float64)},
    ("pow", torch.float64): (
        Known("sample 1: a (5,) base with a 0-d tensor exponent", lambda s, r: r.index == 1,
              "the gradient of a 0-d exponent sums x^y * log(x) over terms that cancel: "
              "1.15x past the bound scaled down from torch float32's error (float64 has no "
              "finer reference to show the true one)"),),
    ("float_power", torch.float64): (
        Known("sample 1: a (5,) base with a 0-d tensor exponent", lambda s, r: r.index == 1,
              "pow's (the same float64 pow): the gradient of a 0-d exponent sums x^y * log(x) "
              "over terms that cancel, 1.15x past the bound scaled down from torch float32's "
              "error"),),
    ("nn.functional.hinge_embedding_loss", torch.float32): (
        Known("samples 1 and 2: margin 8.40, reduction 'mean' and 'sum'",
              lambda s, r: r.index in (1, 2) and r.device == "cpu",
              "every element equals torch float32's bit for bit; their sum cancels (16.35 "
              "against -17.0 over five terms), and the NumPy backend's float32 sum rounds it "
              "1.01e-6 from float64 (one rounding of the terms' size) where torch's summation "
              "order gave 6e-8: 1.9x past the bound of 5.35e-7 (sample 2, the sum)"),),
    ("nn.functional.nll_loss", torch.float32): (
        Known("samples 33 and 53: a (2, 3, 2, 2) input (the composed path), reduction "
              "'mean' and 'sum'", lambda s, r: r.index in (33, 53) and r.device == "cpu",
              "(N, C, d...) inputs take the composed path (a picked-value product and a mean) "
              "of the numpy backend: 1.64e-7 from float64 against a bound of 8.76e-8 (sample "
              "53, the sum: 1.31e-6 against 7.01e-7); the fused op covers (N, C). The cuda "
              "backend's reductions meet the bound (sample 33 on an H200, 2026-11-28)"),),
}

# OpInfo name -> CUDA float32 mismatches (the kernel is not strict FP32 on purpose)
KNOWN_CUDA: dict[str, tuple[Known, ...]] = {
    "nn.functional.scaled_dot_product_attention": (
        Known("every sample", lambda s, r: True,
              "the attention kernels' fp32 products are 3xTF32, not strict FP32: dv 9.61e-6 "
              "from float64 where torch float32's own error is 1.19e-7 (sample 4, H200, "
              "2026-11-28); judged against 32x the bound", looser=32.0),),
}

# Ops whose every sample is refused on the cuda backend, each checked to stay refused there:
# a float64 result (float_power's always), which the cuda backend's elementwise kernels do
# not compute
CUDA_REFUSED_OPS = {("double", ""), ("nn.functional.softmin", "with_dtype"),
                    ("float_power", "")}


def _random(sample) -> str | None:
    """Why a sample's result cannot be compared with torch's, or None. Dropout masks:
    stepgraph draws its own (Philox, rng.py); tests/ops/test_attention_ops.py checks them
    against the composed path instead."""
    return "random (dropout_p > 0)" if float(sample.kwargs.get("dropout_p", 0.0)) > 0 else None


@dataclasses.dataclass
class Report:
    """What became of each sample of one op in one run."""
    what: str
    compared: list[int] = dataclasses.field(default_factory=list)
    refused: list[str] = dataclasses.field(default_factory=list)
    known: list[str] = dataclasses.field(default_factory=list)
    left_out: list[str] = dataclasses.field(default_factory=list)
    failures: list[str] = dataclasses.field(default_factory=list)
    looser: list[int] = dataclasses.field(default_factory=list)   # met a Known's looser bound

    def listing(self) -> str:
        lines = [f"{self.what}: {len(self.compared)} compared, {len(self.looser)} compared "
                 f"at a looser bound, {len(self.refused)} refused, {len(self.known)} known "
                 f"mismatches, {len(self.left_out)} left out"]
        for title, items in (("refused", self.refused), ("known mismatch", self.known),
                             ("left out", self.left_out), ("FAILED", self.failures)):
            lines += [f"  {title}: {item}" for item in items]
        return "\n".join(lines)

    def check(self, all_refused: bool = False) -> None:
        """Fail on any failing sample; then on a run that compared nothing (or, for an op
        listed as wholly refused, on one that compared something)."""
        assert not self.failures, self.listing()
        if all_refused:
            assert self.refused and not self.compared and not self.known, \
                f"{self.listing()}\nno longer wholly refused: move the op to OPS"
        else:
            assert self.compared or self.looser, f"{self.listing()}\ncompared no sample"


def _rms_norm_terms(sample, cts: list, dtype: torch.dtype) -> dict:
    """rms_norm's input gradient rstd * (g w - y mean(g w y)) over the normalized dims is a
    difference of terms of scale |g w| rstd: where it cancels (a 1-element row, whose true
    gradient is ~0), a rounding of those terms is all either side can give, and torch
    float32 rounding to exactly 0 is no measure of it."""
    x = sample.input.detach().double()
    dims = tuple(range(-len(_shape_of(sample.args[0])), 0))
    eps = sample.kwargs.get("eps") or torch.finfo(dtype).eps
    rstd = (x.square().mean(dims, keepdim=True) + eps).rsqrt()
    weight = _arg(sample, 1)
    w = torch.ones(()) if weight is None else weight.detach().double()
    return {("grad", 0): float((torch.from_numpy(cts[0]).double() * w * rstd).abs().max())
            if x.numel() else 0.0}


def _shape_of(normalized_shape) -> tuple:
    return (normalized_shape,) if isinstance(normalized_shape, int) else \
        tuple(normalized_shape)


# OpInfo name -> {(kind, index): the scale of the terms that output cancels} for the floor of
# its bound (tests/reference.py `terms`), where the result is a difference of larger terms
TERMS = {"nn.functional.rms_norm": _rms_norm_terms}


def _compare(got, ref64, ref32, what: str, dtype: torch.dtype, terms: dict,
             factor: float = FACTOR) -> None:
    for kind, g, r64, r32 in (("out", got[0], ref64[0], ref32[0]),
                              ("grad", got[1], ref64[1], ref32[1])):
        assert len(g) == len(r64), f"{what}: {len(g)} {kind}s, torch {len(r64)}"
        for j, (a, b, c) in enumerate(zip(g, r64, r32)):
            if b.dtype.kind == "f":
                assert_close_to_reference(a, b, c, f"{what}: {kind} {j}",
                                          factor, precision=DTYPES[dtype],
                                          terms=terms.get((kind, j), 0.0))
            else:       # indices, masks: no rounding, so exactly torch's
                assert a.shape == b.shape, f"{what}: {kind} {j} shape {a.shape}, {b.shape}"
                np.testing.assert_array_equal(a, b, err_msg=f"{what}: {kind} {j}")


def _first_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def check_op(key: tuple[str, str], limit: int | None, device: str = "cpu",
             dtype: torch.dtype = torch.float32, inplace: bool = False) -> Report:
    """Run every sample of OpInfo `key` (the first `limit`) and judge each on its own (the
    module's docstring); the Report lists what became of each."""
    op = _opinfo(*key)
    fn = _inplace(key[0]) if inplace else {**OPS, **REFUSED_OPS}[key]
    rules = REFUSALS.get(key[0], ())
    known = KNOWN.get((key[0], dtype), ()) + (KNOWN_CUDA.get(key[0], ())
                                             if device == "cuda" else ())
    report = Report(f"{'.'.join(filter(None, key))}{'_' if inplace else ''} "
                    f"({str(dtype).removeprefix('torch.')}, {device})")
    for i, sample in enumerate(_samples(op, key, limit)):
        run = Run(i, dtype, device)
        what = f"sample {i} ({sample.summary()})"
        # an in-place form cannot write a result broadcast past its input (torch refuses too)
        skip = _random(sample) or ("broadcasts its input (in place)"
                                   if inplace and sample.broadcasts_input else None)
        if skip:
            report.left_out.append(f"{what}: {skip}")
            continue
        refusals = [r for r in rules if r.applies(sample, run)]
        expected = [k for k in known if k.applies(sample, run)]
        try:
            ref64_out, _ = torch_run(op, sample, torch.float64, None, dtype)
            gen = np.random.default_rng(i)
            cts = [gen.standard_normal(o.shape).astype(np.float32) if o.dtype.kind == "f"
                   else None for o in ref64_out]
            got = stepgraph_run(fn, sample, dtype, cts, device)
            ref64, ref32 = (torch_run(op, sample, d, cts, dtype)
                            for d in (torch.float64, torch.float32))
        except StepgraphError as err:
            match = next((r for r in refusals if isinstance(err, r.error)
                          and r.message in str(err)), None)
            if match is None:
                listed = "; ".join(f"{r.kind} ({r.error.__name__}: {r.message})"
                                   for r in refusals) or "no rule names this sample"
                report.failures.append(f"{what}: refused ({_first_line(err)}), not as "
                                       f"REFUSALS lists it ({listed})")
            else:
                report.refused.append(f"{what}: {match.kind}: {_first_line(err)}")
            continue
        except Exception as err:        # a crash, not a refusal
            report.failures.append(f"{what}: raised {_first_line(err)}")
            continue
        if refusals:
            report.failures.append(f"{what}: ran, but REFUSALS lists it as refused ("
                                   f"{'; '.join(r.kind for r in refusals)}): delete the rule "
                                   "or narrow it")
            continue
        terms = TERMS[key[0]](sample, cts, dtype) if key[0] in TERMS else {}
        if expected and expected[0].looser:
            try:
                _compare(got, ref64, ref32, what, dtype, terms, FACTOR * expected[0].looser)
                report.looser.append(i)
            except AssertionError as err:
                report.failures.append(f"{str(err).splitlines()[0]} (at {expected[0].looser:g}"
                                       f"x the bound: {expected[0].kind})")
            continue
        try:
            _compare(got, ref64, ref32, what, dtype, terms)
        except AssertionError as err:
            if expected:
                report.known.append(f"{what}: {expected[0].kind}: {str(err).splitlines()[0]}")
            else:
                report.failures.append(str(err).splitlines()[0])
            continue
        if expected:
            report.failures.append(f"{what}: matches torch, but KNOWN lists it as a mismatch "
                                   f"({expected[0].kind}): delete the entry or narrow it")
        else:
            report.compared.append(i)
    return report


KEYS = pytest.mark.parametrize("key", list(OPS), ids=lambda k: ".".join(filter(None, k)))
DTYPE = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])


@KEYS
@DTYPE
def test_opinfo_samples(key, dtype):
    report = check_op(key, FAST_SAMPLES, dtype=dtype)
    print(report.listing())
    report.check()


@pytest.mark.parametrize("key", list(REFUSED_OPS), ids=lambda k: ".".join(filter(None, k)))
@DTYPE
def test_opinfo_refused_samples(key, dtype):
    report = check_op(key, FAST_SAMPLES, dtype=dtype)
    print(report.listing())
    report.check(all_refused=True)


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
    report = check_op(key, FAST_SAMPLES, inplace=True)
    print(report.listing())
    report.check()


@pytest.mark.slow
@KEYS
@DTYPE
def test_opinfo_every_sample(key, dtype):
    report = check_op(key, None, dtype=dtype)
    print(report.listing())
    report.check()


@pytest.mark.cuda
@KEYS
def test_opinfo_samples_cuda(key):
    report = check_op(key, FAST_SAMPLES, device="cuda")
    print(report.listing())
    report.check(all_refused=key in CUDA_REFUSED_OPS)


def _documented_rows() -> list[str]:
    """The rows of docs/TESTING.md's refusal table."""
    text = TESTING_DOC.read_text()
    table = text[text.index("### Refusals"):]
    end = table.find("\n#")                  # the next heading ends it
    table = table if end < 0 else table[:end]
    return [line for line in table.splitlines()[4:] if line.startswith("| `")]


def test_refusals_are_documented():
    """Every rule of REFUSALS has a row of docs/TESTING.md's refusal table naming its op and
    its sample kind, and every row names a rule: the table is the rules, in words."""
    rows = _documented_rows()
    for name, rules in REFUSALS.items():
        for rule in rules:
            assert any(f"`{name}`" in row and rule.kind in row for row in rows), \
                f"docs/TESTING.md lists no refusal of {name}: {rule.kind}"
    for row in rows:
        name = re.match(r"\| `([^`]+)`", row).group(1)
        assert any(rule.kind in row for rule in REFUSALS.get(name, ())), \
            f"docs/TESTING.md lists a refusal REFUSALS does not have: {row}"
