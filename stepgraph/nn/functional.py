"""Functional ops on symbolic tensors: what modules and losses call while being traced."""
from __future__ import annotations

import math

from ..errors import ShapeError, UnsupportedOpError
from ..ir.trace import Tensor
from ..ops.attention import MAX_HEAD_DIM
from . import losses as _losses


def _pair(v) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else tuple(v)


def _traced(x: Tensor, t):
    """A Parameter or Buffer argument as a tensor of x's trace; tensors pass through."""
    return t if t is None or isinstance(t, Tensor) else x._coerce(t, "argument")


def linear(input: Tensor, weight, bias=None) -> Tensor:
    """y = input @ weight.T + bias over any leading dims; weight (out, in), bias (out,).
    weight and bias may be Parameters or traced Tensors."""
    w, b = _traced(input, weight), _traced(input, bias)
    if input.ndim == 0:
        raise ShapeError("linear: input must have at least one dimension")
    x = input if input.ndim == 2 else input.reshape(-1, input.shape[-1])
    y = x.tracer.op("linear", [x, w] + ([b] if b is not None else []), act=None)
    return y if input.ndim == 2 else y.reshape(*input.shape[:-1], w.shape[0])


def activation(x: Tensor, kind: str, slope: float = 0.01) -> Tensor:
    return x.tracer.op("act", [x], kind=kind, slope=float(slope))


# ---- activations, softmax, dropout and mse with torch.nn.functional's signatures ----------

def relu(input: Tensor, inplace: bool = False) -> Tensor:
    """max(input, 0). `inplace` is accepted for PyTorch compatibility (traced ops never
    overwrite their input)."""
    return activation(input, "relu")


def leaky_relu(input: Tensor, negative_slope: float = 0.01, inplace: bool = False) -> Tensor:
    return activation(input, "leaky_relu", negative_slope)


def gelu(input: Tensor, approximate: str = "none") -> Tensor:
    """GELU, exact (erf) or approximate="tanh"."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    return activation(input, "gelu" if approximate == "none" else "gelu_tanh")


def silu(input: Tensor, inplace: bool = False) -> Tensor:
    """input * sigmoid(input)."""
    return activation(input, "silu")


def sigmoid(input: Tensor) -> Tensor:
    return activation(input, "sigmoid")


def tanh(input: Tensor) -> Tensor:
    return activation(input, "tanh")


def _softmax_dim(ndim: int) -> int:
    # PyTorch's implicit dim when none is given (deprecated there, kept for old call sites).
    return 0 if ndim in (0, 1, 3) else 1


def softmax(input: Tensor, dim: int | None = None) -> Tensor:
    """softmax over `dim`."""
    return input.softmax(_softmax_dim(input.ndim) if dim is None else dim)


def log_softmax(input: Tensor, dim: int | None = None) -> Tensor:
    """log(softmax) over `dim`."""
    return input.log_softmax(_softmax_dim(input.ndim) if dim is None else dim)


def _dropout(x: Tensor, p: float, training: bool, per_channel: bool) -> Tensor:
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    # A predict trace (compile_predict) has dropout off even where the model asks for it
    # (training=True): it has no step counter to draw fresh masks from, as sdpa's dropout_p.
    if not training or p == 0.0 or not x.tracer.training:
        return x
    if per_channel and x.ndim != 4:
        raise ShapeError(f"Dropout2d expects (N, C, H, W) input, got {x.shape}")
    t = x.tracer
    return t.op_all("dropout", [x, t.rng_step()], p=float(p), seed=t.seed,
                    site=t.next_dropout_site(), per_channel=per_channel)[0]


def dropout(input: Tensor, p: float = 0.5, training: bool = True,
            inplace: bool = False) -> Tensor:
    """Zero each element with probability p and scale the rest by 1/(1-p) when training."""
    return _dropout(input, p, training, per_channel=False)


def dropout2d(input: Tensor, p: float = 0.5, training: bool = True,
              inplace: bool = False) -> Tensor:
    """Zero whole channels of an (N, C, H, W) input with probability p when training."""
    return _dropout(input, p, training, per_channel=True)


def mse_loss(input: Tensor, target: Tensor, size_average=None, reduce=None,
             reduction: str = "mean") -> Tensor:
    """(input - target)^2 reduced by `reduction` ("mean", "sum" or "none"); the shapes must
    match (no broadcasting). The deprecated size_average / reduce are not supported."""
    target = _traced(input, target)
    if input.shape != target.shape:
        raise ShapeError(f"mse_loss: input {input.shape} and target {target.shape} differ")
    if size_average is not None or reduce is not None or \
            reduction not in ("mean", "sum", "none"):
        raise UnsupportedOpError(f"mse_loss supports reduction='mean', 'sum' or 'none' "
                                 f"(without size_average / reduce), got {reduction!r} (in "
                                 f"{input.tracer.where()})")
    if reduction == "none":
        return (input - target) ** 2
    loss = input.tracer.op("mse", [input, target])
    return loss * float(input.value.size) if reduction == "sum" else loss


# ---- convolution, pooling, batch norm and classification losses ---------------------------

def _conv_padding(padding, kernel: tuple[int, int], dilation: tuple[int, int], stride):
    """PyTorch's conv padding argument as a pair; "valid" is 0, "same" the symmetric padding
    keeping the size at stride 1."""
    if padding == "valid":
        return (0, 0)
    if padding == "same":
        total = [d * (k - 1) for d, k in zip(dilation, kernel)]
        if _pair(stride) != (1, 1) or any(t % 2 for t in total):
            raise UnsupportedOpError(f"conv2d padding='same' with stride {stride} and kernel "
                                     f"{kernel} (dilation {dilation}) needs asymmetric padding")
        return (total[0] // 2, total[1] // 2)
    return _pair(padding)


def conv2d(input: Tensor, weight, bias=None, stride=1, padding=0, dilation=1,
           groups: int = 1) -> Tensor:
    """2-D cross-correlation of an (N, C, H, W) input with weight (O, C/groups, kh, kw) and
    an optional bias (O,), zero padding, as torch.nn.functional.conv2d."""
    w, b = _traced(input, weight), _traced(input, bias)
    dilation = _pair(dilation)
    padding = _conv_padding(padding, w.shape[2:], dilation, stride)
    return input.tracer.op("conv2d", [input, w] + ([b] if b is not None else []),
                           stride=_pair(stride), padding=padding, dilation=dilation,
                           groups=int(groups))


def _pool_args(op: str, kernel_size, stride, ceil_mode: bool):
    if ceil_mode:
        raise UnsupportedOpError(f"{op} with ceil_mode=True is not supported")
    kernel = _pair(kernel_size)
    return kernel, kernel if stride is None or stride == [] else _pair(stride)


def max_pool2d(input: Tensor, kernel_size, stride=None, padding=0, dilation=1,
               ceil_mode: bool = False, return_indices: bool = False) -> Tensor:
    """Max over kernel windows (stride defaults to the kernel; -inf padding of at most half
    the kernel), as torch.nn.functional.max_pool2d."""
    kernel, stride = _pool_args("max_pool2d", kernel_size, stride, ceil_mode)
    if _pair(dilation) != (1, 1) or return_indices:
        raise UnsupportedOpError("max_pool2d with dilation or return_indices is not supported")
    return input.tracer.op_all("maxpool2d", [input], kernel=kernel, stride=stride,
                               padding=_pair(padding))[0]


def avg_pool2d(input: Tensor, kernel_size, stride=None, padding=0, ceil_mode: bool = False,
               count_include_pad: bool = True, divisor_override=None) -> Tensor:
    """Mean over kernel windows (stride defaults to the kernel; zero padding of at most half
    the kernel, counted in the divisor when count_include_pad), as
    torch.nn.functional.avg_pool2d."""
    kernel, stride = _pool_args("avg_pool2d", kernel_size, stride, ceil_mode)
    if divisor_override is not None:
        raise UnsupportedOpError("avg_pool2d with divisor_override is not supported")
    return input.tracer.op("avgpool2d", [input], kernel=kernel, stride=stride,
                           padding=_pair(padding), count_include_pad=bool(count_include_pad))


def adaptive_avg_pool2d(input: Tensor, output_size) -> Tensor:
    """Average pooling to `output_size` (None keeps that axis). Supported where the output
    size divides the input size: then every window is kernel = stride = input / output (1x1
    is the mean over H and W), exactly PyTorch's windows."""
    if input.ndim != 4:
        raise ShapeError(f"adaptive_avg_pool2d: input must be (N, C, H, W), got {input.shape}")
    h, w = input.shape[2:]
    oh, ow = (None, None) if output_size is None else \
        (output_size, output_size) if isinstance(output_size, int) else tuple(output_size)
    oh, ow = oh or h, ow or w
    if h % oh or w % ow:
        raise UnsupportedOpError(f"adaptive_avg_pool2d from {(h, w)} to {(oh, ow)}: the output "
                                 f"size must divide the input size (in {input.tracer.where()})")
    kernel = (h // oh, w // ow)
    return avg_pool2d(input, kernel, kernel)


def batch_norm(input: Tensor, running_mean, running_var, weight=None, bias=None,
               training: bool = False, momentum: float | None = 0.1, eps: float = 1e-5, *,
               num_batches_tracked=None) -> Tensor:
    """Batch normalisation over axis 1 of an (N, C, ...) input, as
    torch.nn.functional.batch_norm. Training: batch statistics, and running_mean/running_var
    (when given) updated in place with `momentum` (None: cumulative average, which needs the
    `num_batches_tracked` counter; the counter is incremented when given). Eval: the running
    statistics, as y = (x - running_mean) * scale + bias with scale = weight /
    sqrt(running_var + eps)."""
    t = input.tracer
    if input.ndim < 2:
        raise ShapeError(f"batch_norm: input must be (N, C, ...), got {input.shape}")
    rm, rv = _traced(input, running_mean), _traced(input, running_var)
    w, b = _traced(input, weight), _traced(input, bias)
    if (rm is None) != (rv is None):
        raise ValueError("batch_norm: give both running_mean and running_var, or neither")
    if not training:
        if rm is None:
            raise ValueError("batch_norm in eval mode needs running_mean and running_var")
        return _batch_norm_eval(input, rm, rv, w, b, eps)
    affine, track = w is not None and b is not None, rm is not None
    ins = [input] + ([w, b] if affine else []) + (
        [rm, rv, _batches_tracked(input, num_batches_tracked, momentum)] if track else [])
    y = t.op_all("batch_norm_train", ins, eps=float(eps), momentum=momentum, affine=affine,
                 track=track, act="none")[0]
    if (w is None) != (b is None):         # one of the two: applied after the op
        channel = _channel_shape(input)
        y = y * w.reshape(channel) if w is not None else y + b.reshape(channel)
    return y


def _channel_shape(x: Tensor) -> tuple[int, ...]:
    """(1, C, 1, ...): the shape a per-channel (C,) tensor takes to broadcast against x."""
    return (1, x.shape[1]) + (1,) * (x.ndim - 2)


def _batches_tracked(input: Tensor, counter, momentum):
    if counter is not None:
        return _traced(input, counter)
    if momentum is None:
        raise ValueError("batch_norm with momentum=None (cumulative average) needs the "
                         "num_batches_tracked counter")
    # The op counts batches in place; without a counter to keep, it counts into a scratch one.
    return input.tracer.op("fill", [], value=0, shape=(), dtype="int64")


def _batch_norm_eval(x: Tensor, rm: Tensor, rv: Tensor, w, b, eps: float) -> Tensor:
    # Centre first, as torch does: x * scale + (b - rm * scale) is the same function, but its
    # weight gradient, inv * (sum(dy * x) - rm * sum(dy)), cancels when |rm| >> |x - rm|.
    channel = _channel_shape(x)
    scale = (rv + float(eps)) ** -0.5
    if w is not None:
        scale = w * scale
    y = (x - rm.reshape(channel)) * scale.reshape(channel)
    return y if b is None else y + b.reshape(channel)


def cross_entropy(input: Tensor, target: Tensor, weight=None, size_average=None,
                  ignore_index: int = -100, reduce=None, reduction: str = "mean",
                  label_smoothing: float = 0.0) -> Tensor:
    """Mean softmax cross-entropy of (N, C) logits against integer class targets (N,), with
    PyTorch's ignore_index and label smoothing (torch.nn.functional.cross_entropy with no
    class weights and mean reduction)."""
    if weight is not None or size_average is not None or reduce is not None or \
            reduction != "mean":
        raise UnsupportedOpError("cross_entropy supports only reduction='mean' without class "
                                 f"weights (in {input.tracer.where()})")
    return _losses.cross_entropy(input, target, label_smoothing, ignore_index)


def nll_loss(input: Tensor, target: Tensor, weight=None, size_average=None,
             ignore_index: int = -100, reduce=None, reduction: str = "mean") -> Tensor:
    """Mean negative log-likelihood of (N, C) log-probabilities at integer targets (N,)
    (torch.nn.functional.nll_loss with no class weights, mean reduction and no target equal
    to ignore_index)."""
    if weight is not None or size_average is not None or reduce is not None or \
            reduction != "mean" or ignore_index != -100:
        raise UnsupportedOpError("nll_loss supports only reduction='mean' without class "
                                 f"weights or ignore_index (in {input.tracer.where()})")
    return _losses.nll_loss(input, target)


# ---- transformer ops ---------------------------------------------------------------------

def embedding(input: Tensor, weight, padding_idx=None, max_norm=None, norm_type: float = 2.0,
              scale_grad_by_freq: bool = False, sparse: bool = False) -> Tensor:
    """The rows of weight (V, C) at the integer indices `input` (any shape): input.shape +
    (C,), as torch.nn.functional.embedding."""
    if padding_idx is not None or max_norm is not None or scale_grad_by_freq or sparse:
        raise UnsupportedOpError("embedding with padding_idx, max_norm, scale_grad_by_freq "
                                 f"or sparse is not supported (in {input.tracer.where()})")
    w = _traced(input, weight)
    if input.dtype not in ("int32", "int64"):
        raise ShapeError(f"embedding: indices must be int32 or int64, got {input.dtype}")
    return input.tracer.op("embedding", [w, input])


def last_dim_shape(normalized_shape, what: str, where: str | None = None) -> tuple[int]:
    """layer_norm's normalized_shape (an int or a tuple of one) as a 1-tuple; a longer one
    raises UnsupportedOpError naming `what` (the caller) and the module path `where`."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else \
        tuple(normalized_shape)
    if len(shape) != 1:
        raise UnsupportedOpError(f"{what} over {shape}: only the last dim (a normalized_shape "
                                 "of one int) is supported" + (f" (in {where})" if where else ""))
    return shape


def _normalized_last_dim(input: Tensor, normalized_shape) -> int:
    shape = last_dim_shape(normalized_shape, "layer_norm", input.tracer.where())
    if not input.ndim or input.shape[-1] != shape[0]:
        raise ShapeError(f"layer_norm: normalized_shape {shape} does not match the last dim "
                         f"of input {input.shape}")
    return shape[0]


def layer_norm(input: Tensor, normalized_shape, weight=None, bias=None,
               eps: float = 1e-5) -> Tensor:
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dim, as
    torch.nn.functional.layer_norm with normalized_shape = (C,); weight and bias (C,) are
    optional."""
    _normalized_last_dim(input, normalized_shape)
    w, b = _traced(input, weight), _traced(input, bias)
    ins = [input] + [t for t in (w, b) if t is not None]
    return input.tracer.op("layer_norm", ins, eps=float(eps), weight=w is not None,
                           bias=b is not None)


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask=None,
                                 dropout_p: float = 0.0, is_causal: bool = False,
                                 scale: float | None = None) -> Tensor:
    """softmax(q @ k^T * scale (+ causal mask)) @ v over (..., L, E) queries, (..., S, E)
    keys and (..., S, Ev) values with the same batch dims, as
    torch.nn.functional.scaled_dot_product_attention; scale defaults to 1/sqrt(E). One
    `sdpa` op (flash-style kernels: no (L, S) scores in memory, the mask costs nothing);
    dropout_p > 0 drops attention weights, when the trace is in training mode, with the mask
    the dropout op would draw. Head dims above ops.attention.MAX_HEAD_DIM take the composed
    ops (bmm, softmax, dropout, bmm). attn_mask, and is_causal with L != S (PyTorch aligns
    that mask top-left, the op bottom-right), are not supported."""
    t = query.tracer
    k, v = _traced(query, key), _traced(query, value)
    if attn_mask is not None:
        raise UnsupportedOpError(f"scaled_dot_product_attention with an attn_mask (use "
                                 f"is_causal) is not supported (in {t.where()})")
    if query.ndim < 2 or not (query.ndim == k.ndim == v.ndim) or \
            not (query.shape[:-2] == k.shape[:-2] == v.shape[:-2]):
        raise UnsupportedOpError(f"scaled_dot_product_attention needs q, k, v of the same "
                                 f"batch dims, got {query.shape}, {k.shape}, {v.shape} "
                                 f"(in {t.where()})")
    (length, e), (s, e_k), (s_v, ev) = query.shape[-2:], k.shape[-2:], v.shape[-2:]
    if e != e_k or s != s_v:
        raise ShapeError(f"scaled_dot_product_attention: q {query.shape}, k {k.shape}, "
                         f"v {v.shape} do not fit together")
    if is_causal and length != s:
        raise UnsupportedOpError(f"scaled_dot_product_attention with is_causal and {length} "
                                 f"queries != {s} keys is not supported (in {t.where()})")
    scale = 1.0 / math.sqrt(e) if scale is None else float(scale)
    if max(e, ev) > MAX_HEAD_DIM or min(length, s) == 0:
        return _composed_attention(query, k, v, dropout_p, bool(is_causal), scale)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {dropout_p}")
    p = float(dropout_p) if t.training else 0.0
    if p == 0.0:
        return t.op("sdpa", [query, k, v], scale=scale, causal=bool(is_causal), dropout_p=0.0)
    return t.op("sdpa", [query, k, v, t.rng_step()], scale=scale, causal=bool(is_causal),
                dropout_p=p, seed=t.seed, site=t.next_dropout_site())


def _composed_attention(query: Tensor, k: Tensor, v: Tensor, dropout_p: float, causal: bool,
                        scale: float) -> Tensor:
    """Attention as bmm, softmax (scale, causal), dropout, bmm: the (L, S) scores in memory."""
    t = query.tracer
    lead, length, ev = query.shape[:-2], query.shape[-2], v.shape[-1]
    q3, k3, v3 = (x.reshape(-1, *x.shape[-2:]) for x in (query, k, v))
    scores = t.op("bmm", [q3, k3], trans_b=True)
    attn = t.op("softmax", [scores], scale=scale, causal=causal)
    attn = _dropout(attn, dropout_p, t.training, per_channel=False)
    return t.op("bmm", [attn, v3]).reshape(*lead, length, ev)


def flatten(x: Tensor, start_dim: int = 1) -> Tensor:
    size = 1
    for d in x.shape[start_dim:]:
        size *= d
    return x.reshape(*x.shape[:start_dim], size)


# ---- more activations, composed of the elementwise ops (ops/unary.py, ops/compare.py) -----
# Each is a few elementwise nodes that the pointwise fusion pass runs as one kernel, forward
# and backward; the forms are the numerically stable ones (no exp of a large positive value
# in either branch, so no inf * 0 in a gradient).

SELU_ALPHA = 1.6732632423543772848170429916717
SELU_SCALE = 1.0507009873554804934193349852946


def elu(input: Tensor, alpha: float = 1.0, inplace: bool = False) -> Tensor:
    """x for x > 0, alpha * (exp(x) - 1) otherwise (as relu(x) + alpha * expm1(min(x, 0)))."""
    return input.relu() + input.clamp(max=0.0).expm1() * float(alpha)


def selu(input: Tensor, inplace: bool = False) -> Tensor:
    """SELU_SCALE * elu(x, SELU_ALPHA)."""
    return elu(input, SELU_ALPHA) * SELU_SCALE


def celu(input: Tensor, alpha: float = 1.0, inplace: bool = False) -> Tensor:
    """max(0, x) + min(0, alpha * (exp(x / alpha) - 1))."""
    return input.relu() + (input.clamp(max=0.0) / float(alpha)).expm1() * float(alpha)


def softplus(input: Tensor, beta: float = 1.0, threshold: float = 20.0) -> Tensor:
    """log(1 + exp(beta x)) / beta, and x itself where beta x > threshold (as PyTorch);
    computed as relu(beta x) + log1p(exp(-|beta x|)), which never overflows."""
    z = input * float(beta) if beta != 1.0 else input
    soft = z.relu() + (-z.abs()).exp().log1p()
    soft = soft / float(beta) if beta != 1.0 else soft
    return input.where(z > float(threshold), soft)


def mish(input: Tensor, inplace: bool = False) -> Tensor:
    """x * tanh(softplus(x))."""
    return input * softplus(input).tanh()


def hardtanh(input: Tensor, min_val: float = -1.0, max_val: float = 1.0,
             inplace: bool = False) -> Tensor:
    """clamp(x, min_val, max_val)."""
    return input.clamp(float(min_val), float(max_val))


def relu6(input: Tensor, inplace: bool = False) -> Tensor:
    """min(max(x, 0), 6)."""
    return hardtanh(input, 0.0, 6.0)


def hardsigmoid(input: Tensor, inplace: bool = False) -> Tensor:
    """relu6(x + 3) / 6."""
    return relu6(input + 3.0) / 6.0


def hardswish(input: Tensor, inplace: bool = False) -> Tensor:
    """x * relu6(x + 3) / 6."""
    return input * relu6(input + 3.0) / 6.0


def logsigmoid(input: Tensor) -> Tensor:
    """log(sigmoid(x)) = -softplus(-x)."""
    return -softplus(-input)


def glu(input: Tensor, dim: int = -1) -> Tensor:
    """a * sigmoid(b), a and b the two halves of input along dim (its size must be even)."""
    if input.size(dim) % 2:
        raise ShapeError(f"glu: dim {dim} of {input.shape} has odd size {input.size(dim)}")
    a, b = input.chunk(2, dim)
    return a * b.sigmoid()


def __getattr__(name: str):
    """A torch.nn.functional name stepgraph lacks: UnsupportedOpError (an AttributeError)."""
    if name.startswith("_"):
        raise AttributeError(f"module 'stepgraph.nn.functional' has no attribute {name!r}")
    raise UnsupportedOpError(f"torch.nn.functional.{name} is not supported by stepgraph (see "
                             "docs/TORCH_COMPAT.md for the torch names it has)")
