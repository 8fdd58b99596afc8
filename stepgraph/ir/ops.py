"""The op table: every op's name, meaning and shape rule.

Each op is one registration below; its docstring is the op's contract, which the numpy reference
(`backends/numpy/kernels.py`) and the CUDA launchers (`backends/cuda/launchers.py`) implement.
Shapes follow PyTorch: NCHW images, Linear weights (out, in). "Rows" are the batch axis.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..errors import ShapeError
from .graph import BF16, Value

Shape = tuple[int, ...]
OutSpec = tuple[Shape, str]


@dataclass(frozen=True)
class OpDef:
    name: str
    infer: Callable[[list[Value], dict], list[OutSpec]]
    doc: str
    # Input positions written in place, as a function of attrs (multi-tensor updates).
    mutates: Callable[[dict], tuple[int, ...]] = lambda attrs: ()


OPS: dict[str, OpDef] = {}

ACTIVATIONS = ("relu", "leaky_relu", "sigmoid", "tanh", "gelu", "gelu_tanh", "silu")
# Activations whose derivative is computed from the output y; the others need the input z.
GRAD_FROM_OUTPUT = ("relu", "sigmoid", "tanh")


def defop(name: str, mutates=None):
    def register(infer):
        OPS[name] = OpDef(name, infer, (infer.__doc__ or "").strip(),
                          mutates or (lambda attrs: ()))
        return infer
    return register


def infer_outputs(op: str, inputs: list[Value], attrs: dict) -> list[OutSpec]:
    if op not in OPS:
        raise KeyError(f"unknown op {op!r}")
    return OPS[op].infer(inputs, attrs)


def _need(cond: bool, op: str, what: str):
    if not cond:
        raise ShapeError(f"{op}: {what}")


def _f32(v: Value) -> bool:
    return v.dtype in ("float32", "float64")


# ---- dense ---------------------------------------------------------------------------------

@defop("matmul")
def _matmul(ins, attrs):
    """c = op(a) @ op(b), op = transpose when attrs trans_a / trans_b. 2-D only."""
    a, b = ins
    _need(len(a.shape) == 2 and len(b.shape) == 2, "matmul", f"2-D operands, got {a.shape} @ {b.shape}")
    m, k = a.shape[::-1] if attrs.get("trans_a") else a.shape
    k2, n = b.shape[::-1] if attrs.get("trans_b") else b.shape
    _need(k == k2, "matmul", f"inner dims differ: {a.shape} @ {b.shape} with {attrs}")
    return [((m, n), a.dtype)]


@defop("linear")
def _linear(ins, attrs):
    """y = act(x @ w.T + b); x (N, K), w (M, K), b (M,) optional; act = attrs["act"] or None.
    With attrs["save_preact"] a second output z = x @ w.T + b (what act_grad needs)."""
    x, w = ins[0], ins[1]
    _need(len(x.shape) == 2, "linear", f"input must be (batch, features), got {x.shape}")
    _need(x.shape[1] == w.shape[1], "linear",
          f"input has {x.shape[1]} features, weight expects {w.shape[1]}")
    if len(ins) == 3:
        _need(ins[2].shape == (w.shape[0],), "linear", f"bias shape {ins[2].shape}")
    out = ((x.shape[0], w.shape[0]), x.dtype)
    return [out, out] if attrs.get("save_preact") else [out]


@defop("act")
def _act(ins, attrs):
    """y = kind(x) elementwise; kind in ACTIVATIONS, leaky_relu uses attrs["slope"];
    gelu is the exact erf form, gelu_tanh the tanh approximation, silu x * sigmoid(x)."""
    _need(attrs["kind"] in ACTIVATIONS, "act", f"unknown activation {attrs['kind']}")
    return [(ins[0].shape, ins[0].dtype)]


@defop("act_grad")
def _act_grad(ins, attrs):
    """dx = dy * kind'(.) where saved = y for GRAD_FROM_OUTPUT kinds, else the input z."""
    dy, saved = ins
    _need(dy.shape == saved.shape, "act_grad", f"{dy.shape} vs {saved.shape}")
    return [(dy.shape, dy.dtype)]


@defop("act_bias_grad")
def _act_bias_grad(ins, attrs):
    """Fused: dz = act_grad(dy, saved) (kind "none": dz = dy); db = dz.sum(axis 0). (N,M)->(N,M),(M,)"""
    dy = ins[0]
    return [(dy.shape, dy.dtype), ((dy.shape[1],), dy.dtype)]


@defop("reduce_sum")
def _reduce_sum(ins, attrs):
    """y = x.sum(axis=attrs["axes"]) (no keepdims)."""
    x = ins[0]
    axes = tuple(attrs["axes"])
    return [(tuple(d for i, d in enumerate(x.shape) if i not in axes), x.dtype)]


@defop("add")
def _add(ins, attrs):
    """c = a + b, same shapes (no broadcasting)."""
    a, b = ins
    _need(a.shape == b.shape and a.dtype == b.dtype, "add", f"{a!r} + {b!r}")
    return [(a.shape, a.dtype)]


@defop("fill")
def _fill(ins, attrs):
    """y = attrs["value"] everywhere; shape attrs["shape"], dtype attrs["dtype"]. No inputs."""
    return [(tuple(attrs["shape"]), attrs["dtype"])]


@defop("reshape")
def _reshape(ins, attrs):
    """y = x viewed with attrs["shape"] (same element count, contiguous: no copy)."""
    x = ins[0]
    shape = tuple(attrs["shape"])
    n = 1
    for d in shape:
        n *= d
    _need(n == x.size, "reshape", f"cannot view {x.shape} as {shape}")
    return [(shape, x.dtype)]


# ---- convolution and pooling ---------------------------------------------------------------

def conv_out(size: int, k: int, stride: int, pad: int, dilation: int = 1) -> int:
    return (size + 2 * pad - dilation * (k - 1) - 1) // stride + 1


# Memory layouts of the image ops' 4-D tensors (attrs "layout", default "NCHW"): "NHWC" is
# channels-last, x (N, H, W, C), and a conv weight (O, kh, kw, C/groups). compile/layout.py
# rewrites a graph's image ops to NHWC; shapes stay row-major, whatever the layout.
LAYOUTS = ("NCHW", "NHWC")
TO_NHWC, TO_NCHW = (0, 2, 3, 1), (0, 3, 1, 2)     # permute dims between the two


def layout_of(op: str, attrs) -> str:
    """A node's layout attr ("NCHW" when absent), checked."""
    layout = attrs.get("layout", "NCHW")
    _need(layout in LAYOUTS, op, f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def nchw_shape(shape, layout: str) -> tuple[int, ...]:
    """The (N, C, H, W) shape of a 4-D array stored in `layout` ((O, C, kh, kw) of an
    (O, kh, kw, C) weight); other ranks as they are."""
    shape = tuple(shape)
    return tuple(shape[d] for d in TO_NCHW) if layout == "NHWC" and len(shape) == 4 else shape


def stored_shape(shape, layout: str) -> tuple[int, ...]:
    """The inverse of nchw_shape: the shape an (N, C, H, W) array has in `layout`."""
    shape = tuple(shape)
    return tuple(shape[d] for d in TO_NHWC) if layout == "NHWC" and len(shape) == 4 else shape


SHAPE_ATTRS = ("input_shape", "weight_shape")   # image ops' attrs holding stored shapes


def nchw_attrs(attrs) -> dict:
    """A channels-last image node's attrs for its NCHW twin: the layout dropped and the
    stored-shape attrs (SHAPE_ATTRS) in NCHW order."""
    return {k: nchw_shape(v, "NHWC") if k in SHAPE_ATTRS else v
            for k, v in attrs.items() if k != "layout"}


def channel_sum_axes(layout: str) -> tuple[int, int, int]:
    """The axes of a 4-D image gradient that a per-channel bias gradient sums: every axis but
    the channels' ((N, H, W) of either layout)."""
    return (0, 1, 2) if layout == "NHWC" else (0, 2, 3)


def conv_geometry(attrs) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int], int]:
    """(stride, padding, dilation, groups) of a conv node; nodes made before dilation and
    groups existed mean (1, 1) and 1."""
    return (tuple(attrs["stride"]), tuple(attrs["padding"]),
            tuple(attrs.get("dilation", (1, 1))), int(attrs.get("groups", 1)))


def pool_geometry(op: str, shape, attrs) -> tuple[int, int]:
    """(Ho, Wo) of a pooling window sweep over an (N, C, H, W) input, checking the attrs
    kernel, stride and padding (default (0, 0); at most half the kernel)."""
    _need(len(shape) == 4, op, f"input must be (N, C, H, W), got {tuple(shape)}")
    (kh, kw), (sh, sw) = attrs["kernel"], attrs["stride"]
    ph, pw = attrs.get("padding", (0, 0))
    _need(2 * ph <= kh and 2 * pw <= kw, op,
          f"padding {(ph, pw)} must be at most half the kernel {(kh, kw)}")
    ho, wo = conv_out(shape[2], kh, sh, ph), conv_out(shape[3], kw, sw, pw)
    _need(ho > 0 and wo > 0, op, f"window {(kh, kw)} larger than padded input {shape[2:]}")
    return ho, wo


@defop("conv2d")
def _conv2d(ins, attrs):
    """y = cross-correlation of x (N,C,H,W) with w (O,C/groups,kh,kw) + b (O,); attrs stride,
    padding, dilation (pairs; dilation default (1, 1)), groups (default 1; output channels
    of group g read only input channels of group g, both split in equal groups), zero
    padding; y (N,O,Ho,Wo), Ho = (H + 2 ph - dh (kh - 1) - 1) // sh + 1 (PyTorch's).
    attrs layout "NHWC" (default "NCHW"): x (N,H,W,C), w (O,kh,kw,C/groups), y (N,Ho,Wo,O),
    the same numbers stored channels-last."""
    layout = layout_of("conv2d", attrs)
    _need(len(ins[0].shape) == 4, "conv2d",
          f"input must be ({'N, H, W, C' if layout == 'NHWC' else 'N, C, H, W'}), got "
          f"{ins[0].shape}")
    _need(len(ins[1].shape) == 4, "conv2d", f"weight must be 4-D, got {ins[1].shape}")
    xs, ws = nchw_shape(ins[0].shape, layout), nchw_shape(ins[1].shape, layout)
    (sh, sw), (ph, pw), (dh, dw), groups = conv_geometry(attrs)
    _need(groups >= 1 and xs[1] % groups == 0 and ws[0] % groups == 0, "conv2d",
          f"groups={groups} must divide input channels {xs[1]} and output channels {ws[0]}")
    _need(xs[1] == ws[1] * groups, "conv2d",
          f"input has {xs[1]} channels, weight expects {ws[1]} x {groups} groups")
    ho = conv_out(xs[2], ws[2], sh, ph, dh)
    wo = conv_out(xs[3], ws[3], sw, pw, dw)
    _need(ho > 0 and wo > 0, "conv2d",
          f"kernel {ws[2:]} (dilation {(dh, dw)}) larger than padded input {xs[2:]}")
    return [(stored_shape((xs[0], ws[0], ho, wo), layout), ins[0].dtype)]


@defop("conv2d_grad_input")
def _conv2d_grad_input(ins, attrs):
    """dx (attrs input_shape) of conv2d given dy and w; attrs as conv2d's (with layout "NHWC",
    input_shape, dy and w are stored channels-last)."""
    layout_of("conv2d_grad_input", attrs)
    return [(tuple(attrs["input_shape"]), ins[0].dtype)]


@defop("conv2d_grad_weight")
def _conv2d_grad_weight(ins, attrs):
    """dw (attrs weight_shape) of conv2d given dy and x (attrs as conv2d's; with layout
    "NHWC" dy, x and weight_shape (O, kh, kw, C/groups) are stored channels-last); with attrs
    bias (the conv bias's gradient, fused), also db (O,) = dy summed over (N, Ho, Wo)."""
    o = attrs["weight_shape"][0]
    layout_of("conv2d_grad_weight", attrs)
    return [(tuple(attrs["weight_shape"]), ins[0].dtype)] + (
        [((o,), ins[0].dtype)] if attrs.get("bias") else [])


@defop("maxpool2d")
def _maxpool2d(ins, attrs):
    """y = max over kernel windows (attrs kernel, stride, padding pairs; padding default
    (0, 0), implicit -inf padding of at most half the kernel, floor mode); idx (int32) =
    h*W + w of the first maximum (row-major window order) in each window, within its (n, c)
    plane: always a real element. With attrs relu, y = relu(max) (the ReLU that followed the
    pool, fused). attrs layout "NHWC": x, y and idx stored (N, H, W, C) (idx still h*W + w)."""
    x, layout = ins[0], layout_of("maxpool2d", attrs)
    xs = nchw_shape(x.shape, layout)
    ho, wo = pool_geometry("maxpool2d", xs, attrs)
    shape = stored_shape((xs[0], xs[1], ho, wo), layout)
    return [(shape, x.dtype), (shape, "int32")]


@defop("maxpool2d_grad")
def _maxpool2d_grad(ins, attrs):
    """dx (attrs input_shape): each dy element added at its idx in its (n, c) plane. With attrs
    relu, ins (dy, idx, y) and only the elements with y > 0 are added (ReLU's gradient).
    attrs layout as maxpool2d's (input_shape stored in it)."""
    layout_of("maxpool2d_grad", attrs)
    return [(tuple(attrs["input_shape"]), ins[0].dtype)]


# ---- dropout -------------------------------------------------------------------------------

@defop("dropout")
def _dropout(ins, attrs):
    """y = x * mask / (1 - p); mask (uint8) keeps an element when its Philox4x32-10 uniform
    >= p (see rng.py: key = attrs seed, counter = (index >> 2, site, step lo, step hi)).
    ins = (x, step); with attrs per_channel the mask is (N, C) and spans each plane."""
    x = ins[0]
    mshape = x.shape[:2] if attrs.get("per_channel") else x.shape
    return [(x.shape, x.dtype), (mshape, "uint8")]


@defop("dropout_grad")
def _dropout_grad(ins, attrs):
    """dx = dy * mask / (1 - p), mask broadcast over planes when per_channel."""
    return [(ins[0].shape, ins[0].dtype)]


# ---- softmax and losses --------------------------------------------------------------------

@defop("log_softmax")
def _log_softmax(ins, attrs):
    """y = x - logsumexp(x, last axis, keepdims); x any rank >= 1 (rows = product of the
    leading dims)."""
    _need(len(ins[0].shape) >= 1, "log_softmax", f"input must have rank >= 1, got {ins[0].shape}")
    return [(ins[0].shape, ins[0].dtype)]


@defop("log_softmax_grad")
def _log_softmax_grad(ins, attrs):
    """dx = dy - exp(y) * dy.sum(last axis, keepdims)."""
    return [(ins[0].shape, ins[0].dtype)]


# The cross-entropy ops' ignore_index when their attrs give none (PyTorch's default): a label
# the loss skips, not a bad one.
IGNORE_INDEX = -100


def _check_labels(op, logits, labels):
    _need(len(logits.shape) == 2, op, f"logits must be (batch, classes), got {logits.shape}")
    _need(labels.shape == (logits.shape[0],), op,
          f"labels must be ({logits.shape[0]},) for logits {logits.shape}, got {labels.shape}")
    _need(labels.dtype in ("int32", "int64"), op, f"labels must be integers, got {labels.dtype}")


@defop("cross_entropy")
def _cross_entropy(ins, attrs):
    """loss = mean_i((1-eps)(lse_i - logits[i, labels_i]) + eps (lse_i - mean_j logits[i, j]))
    with eps = attrs label_smoothing (default 0.0, PyTorch's), the mean over the rows whose
    label is not attrs ignore_index (default -100; every row ignored: NaN, as PyTorch);
    second output lse (N,) = logsumexp rows."""
    _check_labels("cross_entropy", *ins)
    return [((), ins[0].dtype), ((ins[0].shape[0],), ins[0].dtype)]


@defop("cross_entropy_grad")
def _cross_entropy_grad(ins, attrs):
    """dlogits = dloss * (exp(logits - lse) - (1-eps) onehot(labels) - eps/C) / kept, eps =
    attrs label_smoothing (default 0.0), kept = the rows whose label is not attrs ignore_index
    (default -100); those rows get 0; ins (dloss, logits, lse, labels)."""
    return [(ins[1].shape, ins[1].dtype)]


@defop("cross_entropy_train")
def _cross_entropy_train(ins, attrs):
    """Fused forward and backward with dloss = 1: (loss, dlogits) from (logits, labels);
    attrs label_smoothing and ignore_index as cross_entropy's. bf16 logits (compile/fuse.py
    fuse_loss_casts) are widened exactly and give bf16 dlogits, rounded once; the loss is
    float32."""
    _check_labels("cross_entropy", *ins)
    loss_dtype = "float32" if ins[0].dtype == BF16 else ins[0].dtype
    return [((), loss_dtype), (ins[0].shape, ins[0].dtype)]


@defop("nll_loss")
def _nll_loss(ins, attrs):
    """loss = -mean_i(logp[i, labels_i])."""
    _check_labels("nll_loss", *ins)
    return [((), ins[0].dtype)]


@defop("nll_loss_grad")
def _nll_loss_grad(ins, attrs):
    """dlogp (N, attrs classes) = -dloss / N at (i, labels_i), zero elsewhere; ins (dloss, labels)."""
    dloss, labels = ins
    return [((labels.shape[0], attrs["classes"]), dloss.dtype)]


@defop("mse")
def _mse(ins, attrs):
    """loss = mean((pred - target)^2) over all elements."""
    pred, target = ins
    _need(pred.shape == target.shape, "mse", f"pred {pred.shape} vs target {target.shape}")
    return [((), pred.dtype)]


@defop("mse_grad")
def _mse_grad(ins, attrs):
    """dpred = dloss * 2 (pred - target) / numel; ins (dloss, pred, target)."""
    return [(ins[1].shape, ins[1].dtype)]


# ---- optimizer -----------------------------------------------------------------------------

@defop("step_increment", mutates=lambda attrs: (0,))
def _step_increment(ins, attrs):
    """step += 1 (int64 scalar state), in place."""
    return []


@defop("lr_schedule")
def _lr_schedule(ins, attrs):
    """lr = schedule_lr(schedule, step): ins (step int64 scalar, schedule float32 (6,) =
    [base_lr, warmup_steps, total_steps, min_lr, step_size, gamma]); optim/schedules.py has
    the formulas, computed in double."""
    return [((), "float32")]


@defop("record_loss", mutates=lambda attrs: (2, 3))
def _record_loss(ins, attrs):
    """history_loss[step % R] = loss; history_step[step % R] = step. ins (loss, step,
    history_loss float32 (R,), history_step int64 (R,)): each step's loss stays readable on
    the device for R steps without a copy from the host."""
    return []


@defop("advance_step", mutates=lambda attrs: (0, 3, 4))
def _advance_step(ins, attrs):
    """step_increment, lr_schedule and record_loss of one step in one op: ins (step, schedule,
    loss, history_loss, history_step); step += 1, then lr = schedule_lr(schedule, step) and
    the loss recorded under the new step."""
    return [((), "float32")]


@defop("global_norm")
def _global_norm(ins, attrs):
    """norm = sqrt(sum over every input of sum(g^2)); float32 when the inputs are bf16
    gradients (compile/fuse.py fuse_gradient_casts)."""
    return [((), "float32" if ins[0].dtype == BF16 else ins[0].dtype)]


def _update_mutates(attrs) -> tuple[int, ...]:
    # inputs: n_scalars scalars (lr, step[, norm]), then params, grads and n_slots groups of
    # per-parameter state (momentum buffers; Adam's exp_avg, exp_avg_sq), n_params each, then
    # one bf16 weight copy per entry of attrs copies (precision="bf16").
    n, k = attrs["n_params"], attrs["n_scalars"]
    written = list(range(k, k + n))
    for s in range(attrs["n_slots"]):
        written += range(k + (2 + s) * n, k + (3 + s) * n)
    written += [at for _, at, _ in update_weight_copies(attrs)]
    return tuple(written)


def update_weight_copies(attrs) -> list[tuple[int, int, tuple[int, ...] | None]]:
    """(parameter input index, copy input index, transpose dims or None) of each bf16 weight
    copy an update writes (attrs copies, copy_dims; sgd_update's docstring)."""
    n, k = attrs["n_params"], attrs["n_scalars"]
    first = k + (2 + attrs["n_slots"]) * n
    indices = attrs.get("copies", ())
    dims = attrs.get("copy_dims") or (None,) * len(indices)
    return [(k + i, first + j, d) for j, (i, d) in enumerate(zip(indices, dims))]


@defop("sgd_update", mutates=_update_mutates)
def _sgd_update(ins, attrs):
    """PyTorch SGD over every parameter in one op. ins = lr, step[, norm], params, grads,
    momentum buffers[, bf16 weight copies][, guard flags]. Grads are scaled by min(1, max_norm
    / (norm + 1e-6)) when clipping. attrs copies (precision="bf16", compile/autocast.py): the
    indices of the parameters with a bf16 copy, one copy input each in that order; after the
    update, copy j = bf16(params[copies[j]]) rounded to nearest even, transposed by copy_dims[j]
    when attrs copy_dims gives dims (not None) and viewed with the copy's shape (a conv
    weight's channels-last copy (O, kh, kw, C/groups)). With attrs guard, the
    last input is a guard's flags (ops/guard.py): nothing is written when flags[1]
    (FLAG_SKIP) is set. attrs update_stream (compile/overlap.py: one bucket of a step's
    parameters, placed inside the backward pass): on a backend with streams it runs beside the
    nodes after it, until the next update_join; the results are the same."""
    return []


@defop("adam_update", mutates=_update_mutates)
def _adam_update(ins, attrs):
    """PyTorch Adam (decoupled=False) or AdamW (decoupled=True) over every parameter.
    ins = lr, step[, norm], params, grads, exp_avg, exp_avg_sq[, bf16 weight copies][, guard
    flags] (as sgd_update)."""
    return []


@defop("update_join")
def _update_join(ins, attrs):
    """Wait until every update with attrs update_stream before it has finished. ins: the
    temporaries those updates read (gradients, lr), read by nothing; listed so that their
    memory stays untouched until here."""
    return []
