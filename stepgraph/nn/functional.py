"""Functional ops on symbolic tensors: what modules and losses call while being traced."""
from __future__ import annotations

import math

import numpy as np

from ..errors import ShapeError, UnsupportedOpError
from ..ir.trace import Tensor, tensor_of
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


def bilinear(input1: Tensor, input2: Tensor, weight, bias=None) -> Tensor:
    """y_k = input1 @ weight[k] @ input2 + bias_k over any leading dims (the same in both
    inputs), weight (out, in1, in2), bias (out,), as torch.nn.functional.bilinear (torch's
    shape errors). Composed: one matmul of input1 with the weight laid out as (in1, out *
    in2), then a product with input2 summed over in2, so no (in1 * in2) outer product is
    held per row; the gradients follow from the matmul's and the product's."""
    w, b = _traced(input1, weight), _traced(input1, bias)
    input2 = _traced(input1, input2)
    if input1.ndim != input2.ndim:
        raise ShapeError(f"bilinear(): input dimensions do not match: got {input1.ndim} and "
                         f"{input2.ndim}")
    for i, (n1, n2) in enumerate(zip(input1.shape[:-1], input2.shape[:-1])):
        if n1 != n2:
            raise ShapeError(f"bilinear(): input batch dimensions do not match at dim {i}: "
                             f"got {n1} and {n2}")
    if w.ndim != 3:
        raise ShapeError(f"bilinear(): weight must be (out, in1, in2), got {w.shape}")
    out, in1, in2 = w.shape
    for k, (x, n) in enumerate(((input1, in1), (input2, in2)), start=1):
        if x.shape[-1] != n:
            raise ShapeError(f"bilinear(): input{k} size does not match weight size: got "
                             f"{x.shape[-1]} but expected {n}")
    if b is not None and b.shape != (out,):
        raise ShapeError(f"bilinear(): bias size does not match weight size: got "
                         f"{b.shape[0] if b.ndim else b.shape} but expected {out}")
    x1, x2 = input1.reshape(-1, in1), input2.reshape(-1, in2)
    mixed = x1 @ w.permute(1, 0, 2).reshape(in1, out * in2)         # (M, out * in2)
    y = (mixed.reshape(-1, out, in2) * x2.reshape(-1, 1, in2)).sum(-1)
    y = y if b is None else y + b
    return y.reshape(*input1.shape[:-1], out)


def activation(x: Tensor, kind: str, slope: float = 0.01) -> Tensor:
    return x.tracer.op("act", [x], kind=kind, slope=float(slope))


# ---- activations, softmax, dropout and mse with torch.nn.functional's signatures ----------

def relu(input: Tensor, inplace: bool = False) -> Tensor:
    """max(input, 0); inplace=True makes input hold the result too (Tensor.relu_)."""
    return input.relu_() if inplace else activation(input, "relu")


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
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    # `training` alone decides, as torch's: nn.Dropout passes its module's flag (False in
    # compile_predict's eval-mode trace), while F.dropout(x, p, training=True) drops there too
    # (Monte-Carlo dropout), drawing from the predictor's own counter (compile/build.py).
    if not training or p == 0.0:
        return x
    if per_channel and x.ndim == 3:
        # torch reads a 3-d input of dropout2d as (N, C, L) (with a warning that a future
        # release reads it as unbatched (C, H, W)): one draw per (N, C) row
        return _dropout(x.reshape(*x.shape, 1), p, training, True).reshape(*x.shape)
    if per_channel and x.ndim != 4:
        raise ShapeError(f"Dropout2d expects (N, C, H, W) or 3-d input, got {x.shape}")
    if p == 1.0:                # every element dropped: x * 0, as torch (inf * 0 is NaN)
        return x * 0.0
    t = x.tracer
    return t.op_all("dropout", [x, t.rng_step()], p=float(p), seed=t.seed,
                    site=t.next_dropout_site(), per_channel=per_channel)[0]


def dropout(input: Tensor, p: float = 0.5, training: bool = True,
            inplace: bool = False) -> Tensor:
    """Zero each element with probability p and scale the rest by 1/(1-p) when training."""
    return _dropout(input, p, training, per_channel=False)


def dropout2d(input: Tensor, p: float = 0.5, training: bool = True,
              inplace: bool = False) -> Tensor:
    """Zero whole channels of an (N, C, H, W) input with probability p when training; a 3-d
    input is read as (N, C, L), as torch does (one draw per (N, C) row)."""
    return _dropout(input, p, training, per_channel=True)


def dropout1d(input: Tensor, p: float = 0.5, training: bool = True,
              inplace: bool = False) -> Tensor:
    """Zero whole channels of an (N, C, L) input, or of an unbatched (C, L) one, with
    probability p when training (the rest scaled by 1/(1-p)), as
    torch.nn.functional.dropout1d: one draw per (N, C) row, dropout2d's per-channel draw of
    a 3-d input; a 2-d input runs as a batch of one."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if input.ndim not in (2, 3):
        raise ShapeError(f"dropout1d: Expected 2D or 3D input, but received a {input.ndim}D "
                         "input. Note that dropout1d exists to provide channel-wise dropout on "
                         "inputs with 1 spatial dimension, a channel dimension, and an optional "
                         "batch dimension (i.e. 2D or 3D inputs).")
    if input.ndim == 2:
        return _dropout(input.reshape(1, *input.shape), p, training, True).reshape(*input.shape)
    return _dropout(input, p, training, per_channel=True)


# ---- convolution, pooling, batch norm and classification losses ---------------------------

def _conv_padding(padding, kernel: tuple[int, ...], dilation: tuple[int, ...], stride,
                  what: str = "conv2d"):
    """PyTorch's conv padding argument as a tuple (one entry per kernel axis); "valid" is 0,
    "same" the symmetric padding keeping the size at stride 1."""
    dims = len(kernel)
    if padding == "valid":
        return (0,) * dims
    if padding == "same":
        total = [d * (k - 1) for d, k in zip(dilation, kernel)]
        if _ntuple(stride, dims) != (1,) * dims or any(t % 2 for t in total):
            raise UnsupportedOpError(f"{what} padding='same' with stride {stride} and kernel "
                                     f"{kernel} (dilation {dilation}) needs asymmetric padding")
        return tuple(t // 2 for t in total)
    return _ntuple(padding, dims)


def _ntuple(v, n: int) -> tuple[int, ...]:
    """An int or a sequence as an n-tuple of ints (torch's _ntuple)."""
    return (int(v),) * n if isinstance(v, int) else tuple(int(e) for e in v)


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
    return _kernel_stride(kernel_size, stride)


def _kernel_stride(kernel_size, stride):
    kernel = _pair(kernel_size)
    return kernel, kernel if stride is None or stride == [] else _pair(stride)


def max_pool2d(input: Tensor, kernel_size, stride=None, padding=0, dilation=1,
               ceil_mode: bool = False, return_indices: bool = False) -> Tensor:
    """Max over kernel windows (stride defaults to the kernel; -inf padding of at most half
    the kernel; dilation; ceil_mode: a last partial window that starts inside the input or
    its left padding), as torch.nn.functional.max_pool2d: op maxpool2d (with its ceil_mode
    where a partial window exists), whose gradient goes to the first maximum of
    a window, as torch's. Dilation takes a composed form (a max over the kernel's offsets of
    selections, per axis; ties there split the gradient)."""
    kernel, stride = _kernel_stride(kernel_size, stride)
    padding, dilation = _pair(padding), _pair(dilation)
    if return_indices:
        raise UnsupportedOpError("max_pool2d with return_indices is not supported")
    if input.ndim != 4:
        raise ShapeError(f"max_pool2d: input must be (N, C, H, W), got {input.shape}")
    if any(2 * p > k for p, k in zip(padding, kernel)):
        raise ShapeError(f"max_pool2d: padding {padding} must be at most half the kernel "
                         f"{kernel}")
    outs = []
    for n, k, s, p, d in zip(input.shape[2:], kernel, stride, padding, dilation):
        span = n + 2 * p - d * (k - 1) - 1
        out = (-(-span // s) if ceil_mode else span // s) + 1
        if ceil_mode and (out - 1) * s >= n + p:       # the last window starts in the padding
            out -= 1
        outs.append(out)
    if dilation == (1, 1):
        # the op's first-maximum rule routes a tie's gradient to one element, as torch does
        # (a max of selections would split it); ceil_mode's partial last windows are the op's
        # own (clipped at the input's end), asked for only where they exist
        extra = any((o - 1) * s + k > n + 2 * p for o, n, k, s, p in
                    zip(outs, input.shape[2:], kernel, stride, padding))
        ceil = {"ceil_mode": True} if extra else {}
        return input.tracer.op_all("maxpool2d", [input], kernel=kernel, stride=stride,
                                   padding=padding, **ceil)[0]
    axes = []
    for n, k, s, p, d, out in zip(input.shape[2:], kernel, stride, padding, dilation, outs):
        o = _positions(input, out)
        axes.append([o * float(s) + float(a * d - p) for a in range(k)])
    return _max_of_selections(input, *axes)


def _max_of_selections(x: Tensor, rows: list[Tensor], cols: list[Tensor]) -> Tensor:
    """max over a of x[..., rows[a], :], then over b of [..., cols[b]]: rows / cols are
    float64 source indices (one per output position); out-of-range ones read -inf."""
    for sources in (cols, rows):
        n_in = x.shape[-1]
        best = None
        for src in sources:
            n_out = src.shape[0]
            i = _positions(x, n_in).reshape(1, n_in)
            picked = x @ (i == src.reshape(n_out, 1))._cast(x.dtype).transpose(0, 1)
            outside = (src < 0.0).logical_or(src > float(n_in - 1))
            picked = picked + _blocked(outside, x.dtype)
            best = picked if best is None else best.maximum(picked)
        x = best.transpose(-1, -2)
    return x


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
    """Average pooling to `output_size` (None keeps that axis) over torch's bins: output o
    averages inputs [floor(o * In / Out), ceil((o + 1) * In / Out)). Where the output size
    divides the input size the bins are kernel = stride = In / Out windows (avg_pool2d);
    otherwise an averaging matrix per axis, applied by matmul."""
    oh, ow = _adaptive_size(input, output_size, "adaptive_avg_pool2d")
    h, w = input.shape[2:]
    if h % oh or w % ow:
        return _resample(input, _adaptive_bins(input, oh, h), _adaptive_bins(input, ow, w))
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
    # A float16 x with float32 statistics (a net.half() whose BatchNorms were turned back
    # with float()): computed in float32, y in x's dtype, as torch's mixed-type BatchNorm.
    mixed = x.dtype != rm.dtype and x.dtype == "float16"
    channel = _channel_shape(x)
    scale = (rv + float(eps)) ** -0.5
    if w is not None:
        scale = w * scale
    y = ((x.float() if mixed else x) - rm.reshape(channel)) * scale.reshape(channel)
    y = y if b is None else y + b.reshape(channel)
    return y.to(x.dtype) if mixed else y


# ---- transformer ops ---------------------------------------------------------------------

def embedding(input: Tensor, weight, padding_idx=None, max_norm=None, norm_type: float = 2.0,
              scale_grad_by_freq: bool = False, sparse: bool = False) -> Tensor:
    """The rows of weight (V, C) at the integer indices `input` (any shape, 0-d included):
    input.shape + (C,), as torch.nn.functional.embedding. `input` may be an eager tensor
    (torch.tensor(3)), a Python int or a NumPy integer array: constant indices.
    padding_idx (negative counts from V): the row's lookups give its value and no gradient,
    as torch's; composed as a where() over the looked-up rows and their detached copy, so
    every backend's embedding kernels serve it unchanged."""
    if not isinstance(input, Tensor):       # a Python int or NumPy integer array: constant
        index = np.asarray(input)
        if index.dtype not in (np.int32, np.int64):
            raise ShapeError(f"embedding: indices must be int32 or int64, got {index.dtype}")
        input = tensor_of(index)
    if max_norm is not None or scale_grad_by_freq or sparse:
        raise UnsupportedOpError("embedding with max_norm, scale_grad_by_freq or sparse is "
                                 f"not supported (in {input.tracer.where()})")
    if input.dtype not in ("int32", "int64"):
        raise ShapeError(f"embedding: indices must be int32 or int64, got {input.dtype}")
    # an eager index (torch.tensor(3)) beside a traced weight is a constant of its trace
    weight = _traced(input, weight)
    rows = input.tracer.op("embedding", [weight, input])
    if padding_idx is None:
        return rows
    padding_idx = padding_index(padding_idx, weight.shape[0])
    return rows.detach().where((input == padding_idx).unsqueeze(-1), rows)


def padding_index(padding_idx: int, num_embeddings: int) -> int:
    """padding_idx in [0, num_embeddings), a negative one counted from the end, as torch's
    checks ("Padding_idx must be within num_embeddings")."""
    if not -num_embeddings <= padding_idx < num_embeddings:
        raise ShapeError("Padding_idx must be within num_embeddings")
    return padding_idx + num_embeddings if padding_idx < 0 else padding_idx


def normalized_dims(normalized_shape) -> tuple[int, ...]:
    """layer_norm's normalized_shape (an int or a tuple) as a tuple."""
    return (normalized_shape,) if isinstance(normalized_shape, int) else \
        tuple(normalized_shape)


def layer_norm(input: Tensor, normalized_shape, weight=None, bias=None,
               eps: float = 1e-5) -> Tensor:
    """(x - mean) / sqrt(var + eps) * weight + bias over the trailing normalized_shape dims,
    as torch.nn.functional.layer_norm; weight and bias (normalized_shape) are optional. More
    than one normalized dim: the op over those dims flattened into one."""
    shape = normalized_dims(normalized_shape)
    if not shape or tuple(input.shape[input.ndim - len(shape):]) != shape:
        raise ShapeError(f"layer_norm: normalized_shape {shape} does not match the last dims "
                         f"of input {input.shape}")
    w, b = _traced(input, weight), _traced(input, bias)
    x = input
    if len(shape) > 1:
        x = input.reshape(*input.shape[:input.ndim - len(shape)], -1)
        w, b = (None if t is None else t.reshape(-1) for t in (w, b))
    ins = [x] + [t for t in (w, b) if t is not None]
    y = input.tracer.op("layer_norm", ins, eps=float(eps), weight=w is not None,
                        bias=b is not None)
    return y.reshape(*input.shape) if len(shape) > 1 else y


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask=None,
                                 dropout_p: float = 0.0, is_causal: bool = False,
                                 scale: float | None = None, enable_gqa: bool = False) -> Tensor:
    """softmax(q @ k^T * scale + mask) @ v over (..., L, E) queries, (..., S, E) keys and
    (..., S, Ev) values whose batch dims broadcast, as
    torch.nn.functional.scaled_dot_product_attention; scale defaults to 1/sqrt(E). attn_mask
    broadcasts to (..., L, S): bool (True: attend) or float (added to the scores); is_causal
    lets query i attend keys j <= i (torch's top-left alignment when L != S). enable_gqa: k
    and v may have fewer heads (dim -3) than q, each shared by q_heads / kv_heads query
    heads, which the sdpa op indexes without copies (as a k, v head dim of 1 broadcasts).
    Without a mask, or causal with L == S, one `sdpa` op (flash-style kernels: no (L, S)
    scores in memory); otherwise, and for head dims above ops.attention.MAX_HEAD_DIM, the
    composed ops (bmm, softmax, dropout, bmm), which compile/attention_rewrite.py turns into
    sdpa with its additive mask input where the mask needs no gradient. dropout_p > 0 drops
    attention weights when the trace is in training mode."""
    t = query.tracer
    k, v = _traced(query, key), _traced(query, value)
    if min(query.ndim, k.ndim, v.ndim) < 2:
        raise UnsupportedOpError(f"scaled_dot_product_attention needs q, k, v of at least two "
                                 f"dims, got {query.shape}, {k.shape}, {v.shape} "
                                 f"(in {t.where()})")
    (length, e), (s, e_k), (s_v, ev) = query.shape[-2:], k.shape[-2:], v.shape[-2:]
    if e != e_k or s != s_v:
        raise ShapeError(f"scaled_dot_product_attention: q {query.shape}, k {k.shape}, "
                         f"v {v.shape} do not fit together")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {dropout_p}")
    if is_causal and attn_mask is not None:
        raise ValueError("scaled_dot_product_attention: give attn_mask or is_causal, not both")
    query, k, v = _attention_operands(query, k, v, bool(enable_gqa))
    scale = 1.0 / math.sqrt(e) if scale is None else float(scale)
    mask = _attention_mask(query, _traced(query, attn_mask), bool(is_causal), length, s)
    if mask is not None or max(e, ev) > MAX_HEAD_DIM or min(length, s) == 0:
        if k.shape[:-2] != query.shape[:-2]:       # grouped heads: repeated for the bmm
            group = query.shape[-3] // k.shape[-3]
            k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
        probs = _attention_probs(query, k, mask, is_causal and mask is None, scale)
        return _dropout(probs, dropout_p, t.training, per_channel=False) @ v
    p = float(dropout_p) if t.training else 0.0
    if p == 0.0:
        return t.op("sdpa", [query, k, v], scale=scale, causal=bool(is_causal), dropout_p=0.0)
    return t.op("sdpa", [query, k, v, t.rng_step()], scale=scale, causal=bool(is_causal),
                dropout_p=p, seed=t.seed, site=t.next_dropout_site())


def _attention_operands(query: Tensor, k: Tensor, v: Tensor, gqa: bool):
    """q, k, v expanded to one set of batch dims (torch broadcasts them), except that k and v
    keep a head dim (-3) that divides q's: fewer heads with enable_gqa, or one head, which
    both mean query head h reads kv head h // (q_heads / kv_heads) (the sdpa op's grouped
    heads: no repeated copies)."""
    t = query.tracer
    rank = max(query.ndim, k.ndim, v.ndim)
    query, k, v = (x.reshape(*(1,) * (rank - x.ndim), *x.shape) if x.ndim < rank else x
                   for x in (query, k, v))
    try:
        lead = tuple(np.broadcast_shapes(query.shape[:-2], *(
            x.shape[:-3] + (query.shape[-3] if gqa and x.ndim >= 3 else x.shape[-3],)
            if x.ndim >= 3 else () for x in (k, v))))
    except ValueError:
        raise ShapeError(f"scaled_dot_product_attention: the batch dims of q {query.shape}, "
                         f"k {k.shape}, v {v.shape} do not broadcast (in {t.where()})") from None
    heads = k.shape[-3] if query.ndim >= 3 else None
    grouped = heads is not None and heads == v.shape[-3] and len(lead) >= 1 and \
        lead[-1] % heads == 0 and (gqa or heads == 1)
    if gqa and query.ndim >= 3 and not grouped:
        raise ShapeError(f"scaled_dot_product_attention: enable_gqa needs k and v of one head "
                         f"count dividing q's, got q {query.shape}, k {k.shape}, v {v.shape}")
    kv_lead = lead[:-1] + (heads,) if grouped else lead
    query = query.expand(*lead, *query.shape[-2:])
    k, v = (x.expand(*kv_lead, *x.shape[-2:]) for x in (k, v))
    return query, k, v


def _attention_mask(query: Tensor, attn_mask, causal: bool, length: int, s: int):
    """The additive float mask (0 where attended, -inf where not) of a bool or float
    attn_mask, or torch's top-left causal mask when L != S; None when the sdpa op's own
    causal flag (L == S) or no mask is needed."""
    if attn_mask is not None:
        if attn_mask.dtype != "bool":
            return attn_mask._cast(query.dtype)
        return _blocked(attn_mask.logical_not(), query.dtype)
    if not causal or length == s:
        return None
    rows = query.tracer.op("arange", [], n=length, dtype="int64").reshape(length, 1)
    cols = query.tracer.op("arange", [], n=s, dtype="int64").reshape(1, s)
    return _blocked(cols > rows, query.dtype)


def _blocked(blocked: Tensor, dtype: str) -> Tensor:
    """-inf where `blocked` (bool), else 0, in `dtype`: an additive attention mask."""
    return blocked._cast(dtype).masked_fill(blocked, float("-inf"))


def _attention_probs(query: Tensor, k: Tensor, mask, causal: bool, scale: float) -> Tensor:
    """softmax(q @ k^T * scale + mask) (causal: the bottom-right mask of the softmax op, the
    same as top-left for L == S) as (..., L, S): the scores in memory."""
    t = query.tracer
    lead, length, s = query.shape[:-2], query.shape[-2], k.shape[-2]
    q3, k3 = (x.reshape(-1, *x.shape[-2:]) for x in (query, k))
    scores = t.op("bmm", [q3, k3], trans_b=True)
    if mask is None:
        return t.op("softmax", [scores], scale=scale, causal=causal).reshape(*lead, length, s)
    scores = scores.reshape(*lead, length, s) * scale + mask
    if scores.shape[:-2] != tuple(lead):
        raise ShapeError(f"scaled_dot_product_attention: attn_mask of shape {mask.shape} does "
                         f"not broadcast to the scores {tuple(lead) + (length, s)}")
    return scores.softmax(-1)


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


def softsign(input: Tensor) -> Tensor:
    """x / (1 + |x|), torch's composition."""
    return input / (input.abs() + 1.0)


def tanhshrink(input: Tensor) -> Tensor:
    """x - tanh(x), torch's composition."""
    return input - input.tanh()


def threshold(input: Tensor, threshold: float, value: float, inplace: bool = False) -> Tensor:
    """x where x > threshold, else `value`; the gradient passes where x > threshold only, as
    torch.nn.functional.threshold's."""
    return input.where(input > float(threshold), float(value))


def prelu(input: Tensor, weight) -> Tensor:
    """x where x > 0, else weight * x, as torch.nn.functional.prelu: weight is one slope or
    one per channel (dim 1; a 1-d input has one channel), torch's mismatch error."""
    w = _traced(input, weight)
    if w.ndim > 1:
        raise ShapeError(f"prelu: Expected `weight` to be a scalar or 1D tensor, but got: "
                         f"ndim = {w.ndim}")
    if w.numel() != 1:
        if input.ndim == 0:
            raise ShapeError("Not allow zero-dim input tensor.")
        channels = input.shape[1] if input.ndim > 1 else 1
        if channels != w.numel():
            raise ShapeError(f"Mismatch of parameter numbers and input channel size. Found "
                             f"parameter numbers = {w.numel()} and channel size = {channels}.")
    # one slope per channel broadcast along dim 1 (a single slope: to the input's rank, so
    # a 0-d input stays 0-d)
    shape = [1] * input.ndim
    if input.ndim > 1:
        shape[1] = w.numel()
    return input.where(input > 0.0, w.reshape(tuple(shape)) * input)


# ---- losses: reduction mean / sum / none and class weights, as torch.nn.functional --------
# The default cases (mean, no weights) keep the fused ops (ops/loss.py); the others are
# composed of log_softmax, a one-hot of the targets (arange == target) and sums, which
# pointwise fusion runs as a few kernels and whose gradients follow from the ops'.

REDUCTIONS = ("mean", "sum", "none")


def _reduction(reduction: str, size_average=None, reduce=None) -> str:
    """torch's legacy size_average / reduce flags folded into `reduction`, which is checked."""
    if size_average is not None or reduce is not None:
        keep = True if reduce is None else reduce
        reduction = "none" if not keep else "mean" if size_average in (None, True) else "sum"
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    return reduction


def _reduce(loss: Tensor, reduction: str) -> Tensor:
    return loss if reduction == "none" else loss.sum() if reduction == "sum" else loss.mean()


def _same_shape(what: str, input: Tensor, target: Tensor) -> None:
    if input.shape != target.shape:
        raise ShapeError(f"{what}: input {input.shape} and target {target.shape} differ")


def _class_rows(input: Tensor, target: Tensor, what: str) -> tuple[Tensor, Tensor]:
    """(N, C, d1, ...) scores and (N, d1, ...) targets as (M, C) rows and (M,) targets, M the
    number of targets; (C,) and () as one row."""
    if input.ndim == 1:
        input, target = input.reshape(1, -1), target.reshape(1)
    expect = input.shape[:1] + input.shape[2:]
    if target.shape != expect:
        raise ShapeError(f"{what}: input {input.shape} needs targets of shape {expect}, got "
                         f"{target.shape}")
    if input.ndim > 2:
        input = input.reshape(*input.shape[:2], -1).permute(0, 2, 1)
    return input.reshape(-1, input.shape[-1]), target.reshape(-1)


def _one_hot(target: Tensor, classes: int, dtype: str) -> Tensor:
    """(M, C) float one-hot rows of integer targets (M,); a target outside [0, C) gives a
    row of zeros."""
    cls = target.tracer.op("arange", [], n=classes, dtype="int64").reshape(1, classes)
    return (target.long().reshape(-1, 1) == cls)._cast(dtype)


def _weighted_nll(logp: Tensor, target: Tensor, weight, ignore_index: int,
                  label_smoothing: float, reduction: str, out_shape) -> Tensor:
    """The class-target loss of (M, C) log-probabilities: -w[t] ((1 - eps) logp[t] +
    eps / C sum_c w_c logp_c / w[t]) per row, zero where t == ignore_index; the weighted mean
    divides by the sum of w[t] over the rows not ignored (torch's rule)."""
    m, classes = logp.shape
    w = _traced(logp, weight)
    if w is not None and w.shape != (classes,):
        raise ShapeError(f"class weight must be ({classes},), got {w.shape}")
    valid = (target.long() != int(ignore_index))._cast(logp.dtype)
    hot = _one_hot(target, classes, logp.dtype) * valid.reshape(m, 1)
    picked = hot if w is None else hot * w.reshape(1, classes)
    row_weight = valid if w is None else picked.sum(1)
    loss = -(picked * logp).sum(1)
    if label_smoothing:
        spread = logp if w is None else logp * w.reshape(1, classes)
        smooth = -(spread.sum(1) * valid) / float(classes)
        loss = loss * (1.0 - label_smoothing) + smooth * float(label_smoothing)
    if reduction == "none":
        return loss.reshape(*out_shape)
    return loss.sum() if reduction == "sum" else loss.sum() / row_weight.sum()


def cross_entropy(input: Tensor, target: Tensor, weight=None, size_average=None,
                  ignore_index: int = -100, reduce=None, reduction: str = "mean",
                  label_smoothing: float = 0.0) -> Tensor:
    """Softmax cross-entropy of (N, C) or (N, C, d1, ...) logits (class dim 1) against
    integer class targets (N,) / (N, d1, ...), or class probabilities of the input's shape,
    with class `weight` (C,), ignore_index, label_smoothing and reduction, as
    torch.nn.functional.cross_entropy. Integer targets of (N, C) logits with mean reduction
    and no weights run the fused softmax-cross-entropy op."""
    reduction = _reduction(reduction, size_average, reduce)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    target = _traced(input, target)
    if target.dtype not in ("int32", "int64"):
        return _soft_cross_entropy(input, target, weight, label_smoothing, reduction)
    if input.ndim == 2 and weight is None and reduction == "mean":
        return _losses.cross_entropy(input, target, label_smoothing, ignore_index)
    rows, labels = _class_rows(input, target, "cross_entropy")
    return _weighted_nll(rows.log_softmax(1), labels, weight, ignore_index, label_smoothing,
                         reduction, target.shape)


def _soft_cross_entropy(input: Tensor, target: Tensor, weight, label_smoothing: float,
                        reduction: str) -> Tensor:
    """Cross-entropy against class probabilities (torch's float targets): -sum_c w_c y_c
    logp_c per sample, y smoothed to (1 - eps) y + eps / C; mean divides by the sample count."""
    _same_shape("cross_entropy", input, target)
    classes = input.shape[1] if input.ndim > 1 else input.shape[0]
    dim = 1 if input.ndim > 1 else 0
    if label_smoothing:
        target = target * (1.0 - label_smoothing) + label_smoothing / classes
    term = input.log_softmax(dim) * target
    w = _traced(input, weight)
    if w is not None:
        term = term * w.reshape((classes,) + (1,) * (input.ndim - 1 - dim))
    return _reduce(-term.sum(dim), reduction)


def nll_loss(input: Tensor, target: Tensor, weight=None, size_average=None,
             ignore_index: int = -100, reduce=None, reduction: str = "mean") -> Tensor:
    """Negative log-likelihood of (N, C) or (N, C, d1, ...) log-probabilities at integer
    targets, with class `weight`, ignore_index and reduction, as
    torch.nn.functional.nll_loss. (N, C), mean, no weights, no ignored class: the nll op."""
    reduction = _reduction(reduction, size_average, reduce)
    target = _traced(input, target)
    if input.ndim == 2 and weight is None and reduction == "mean" and ignore_index == -100:
        return _losses.nll_loss(input, target)
    rows, labels = _class_rows(input, target, "nll_loss")
    return _weighted_nll(rows, labels, weight, ignore_index, 0.0, reduction, target.shape)


def mse_loss(input: Tensor, target: Tensor, size_average=None, reduce=None,
             reduction: str = "mean") -> Tensor:
    """(input - target)^2, reduced; the shapes must match. Mean: the fused mse op."""
    reduction = _reduction(reduction, size_average, reduce)
    target = _traced(input, target)
    _same_shape("mse_loss", input, target)
    if reduction == "mean":
        return input.tracer.op("mse", [input, target])
    return _reduce((input - target).square(), reduction)


def l1_loss(input: Tensor, target: Tensor, size_average=None, reduce=None,
            reduction: str = "mean") -> Tensor:
    """|input - target|, reduced."""
    reduction = _reduction(reduction, size_average, reduce)
    target = _traced(input, target)
    _same_shape("l1_loss", input, target)
    return _reduce((input - target).abs(), reduction)


def smooth_l1_loss(input: Tensor, target: Tensor, size_average=None, reduce=None,
                   reduction: str = "mean", beta: float = 1.0) -> Tensor:
    """0.5 d^2 / beta where d = |input - target| < beta, else d - 0.5 beta; beta = 0 is
    l1_loss."""
    reduction = _reduction(reduction, size_average, reduce)
    if beta < 0:
        raise ValueError(f"smooth_l1_loss: beta must be >= 0, got {beta}")
    if beta == 0:
        return l1_loss(input, target, reduction=reduction)
    target = _traced(input, target)
    _same_shape("smooth_l1_loss", input, target)
    d = (input - target).abs()
    return _reduce((d.square() * (0.5 / beta)).where(d < float(beta), d - 0.5 * beta),
                   reduction)


def huber_loss(input: Tensor, target: Tensor, reduction: str = "mean",
               delta: float = 1.0, weight=None) -> Tensor:
    """0.5 d^2 where d = |input - target| < delta, else delta (d - 0.5 delta); elementwise
    `weight` (broadcast with the loss) when given."""
    reduction = _reduction(reduction)
    if delta <= 0:
        raise ValueError(f"huber_loss: delta must be > 0, got {delta}")
    target = _traced(input, target)
    _same_shape("huber_loss", input, target)
    d = (input - target).abs()
    loss = (d.square() * 0.5).where(d < float(delta), (d - 0.5 * delta) * float(delta))
    return _reduce(_weighted(loss, weight), reduction)


def _weighted(loss: Tensor, weight) -> Tensor:
    return loss if weight is None else loss * _traced(loss, weight)


def binary_cross_entropy_with_logits(input: Tensor, target: Tensor, weight=None,
                                     size_average=None, reduce=None, reduction: str = "mean",
                                     pos_weight=None) -> Tensor:
    """-(p y log sigmoid(x) + (1 - y) log(1 - sigmoid(x))) per element, p = pos_weight
    (broadcast along the last, class dim), times `weight`; as (1 - y) x + (1 + (p - 1) y)
    softplus(-x), with softplus(-x) = relu(-x) + log1p(exp(-|x|)), which never overflows."""
    reduction = _reduction(reduction, size_average, reduce)
    target = _traced(input, target)
    _same_shape("binary_cross_entropy_with_logits", input, target)
    soft = (-input).relu() + (-input.abs()).exp().log1p()
    pw = _traced(input, pos_weight)
    scale = 1.0 if pw is None else (pw - 1.0) * target + 1.0
    loss = (1.0 - target) * input + scale * soft
    return _reduce(_weighted(loss, weight), reduction)


def binary_cross_entropy(input: Tensor, target: Tensor, weight=None, size_average=None,
                         reduce=None, reduction: str = "mean") -> Tensor:
    """-(y log p + (1 - y) log(1 - p)) of probabilities p, each log clamped at -100 as
    torch's (so p = 0 or 1 gives a finite loss), times `weight`."""
    reduction = _reduction(reduction, size_average, reduce)
    target = _traced(input, target)
    _same_shape("binary_cross_entropy", input, target)
    log_p, log_q = input.log().clamp(min=-100.0), (1.0 - input).log().clamp(min=-100.0)
    loss = -(target * log_p + (1.0 - target) * log_q)
    return _reduce(_weighted(loss, weight), reduction)


def kl_div(input: Tensor, target: Tensor, size_average=None, reduce=None,
           reduction: str = "mean", log_target: bool = False) -> Tensor:
    """Pointwise KL divergence of log-probabilities `input` from `target` (probabilities, or
    log-probabilities when log_target): y (log y - x), 0 where y = 0; reduction "batchmean"
    divides the sum by the batch size (input.size(0)), "mean" by the element count."""
    if reduction == "batchmean" and size_average is None and reduce is None:
        return kl_div(input, target, reduction="sum", log_target=log_target) / \
            float(input.shape[0] if input.ndim else 1)
    reduction = _reduction(reduction, size_average, reduce)
    target = _traced(input, target)
    _same_shape("kl_div", input, target)
    if log_target:
        loss = target.exp() * (target - input)
    else:   # log of 1 where y = 0: y log y is 0 there, without a NaN in either branch
        loss = target * (target.where(target > 0.0, 1.0).log() - input)
    return _reduce(loss, reduction)


# ---- margin, embedding and likelihood losses, composed as torch's own (aten's loss.cpp and
# torch.nn.functional's Python): clamps, where()s and sums whose gradients follow from the
# ops'. Inputs broadcast together, as torch's.

def margin_ranking_loss(input1: Tensor, input2: Tensor, target: Tensor, margin: float = 0.0,
                        size_average=None, reduce=None, reduction: str = "mean") -> Tensor:
    """max(0, -target * (input1 - input2) + margin), reduced, as
    torch.nn.functional.margin_ranking_loss; the three must have one rank (torch's error)."""
    reduction = _reduction(reduction, size_average, reduce)
    input2, target = _traced(input1, input2), _traced(input1, target)
    if not input1.ndim == input2.ndim == target.ndim:
        raise ShapeError(f"margin_ranking_loss : All input tensors should have same dimension "
                         f"but got sizes: input1: {input1.shape}, input2: {input2.shape}, "
                         f"target: {target.shape} ")
    loss = (-target * (input1 - input2) + float(margin)).clamp(min=0.0)
    return _reduce(loss, reduction)


def hinge_embedding_loss(input: Tensor, target: Tensor, margin: float = 1.0,
                         size_average=None, reduce=None, reduction: str = "mean") -> Tensor:
    """x where target == 1, max(0, margin - x) where target == -1, as aten's: the margin term
    where target != 1 plus x where target != -1 (so another target value gets both)."""
    reduction = _reduction(reduction, size_average, reduce)
    target = _traced(input, target)
    hinge = (float(margin) - input).clamp(min=0.0)
    loss = hinge.where(target != 1, 0.0) + input.where(target != -1, 0.0)
    return _reduce(loss, reduction)


def _softplus(z: Tensor) -> Tensor:
    """log(1 + exp(z)) as relu(z) + log1p(exp(-|z|)): no overflow for large z."""
    return z.relu() + (-z.abs()).exp().log1p()


def soft_margin_loss(input: Tensor, target: Tensor, size_average=None, reduce=None,
                     reduction: str = "mean") -> Tensor:
    """log(1 + exp(-target * input)), reduced, as torch.nn.functional.soft_margin_loss (in
    the overflow-free form: torch's log1p(exp(.)) is inf past exp's range)."""
    reduction = _reduction(reduction, size_average, reduce)
    return _reduce(_softplus(-_traced(input, target) * input), reduction)


def multilabel_soft_margin_loss(input: Tensor, target: Tensor, weight=None, size_average=None,
                                reduce=None, reduction: str = "mean") -> Tensor:
    """-(y log sigmoid(x) + (1 - y) log sigmoid(-x)) times `weight`, averaged over the last
    (class) dim, then reduced over the samples, as
    torch.nn.functional.multilabel_soft_margin_loss."""
    reduction = _reduction(reduction, size_average, reduce)
    target = _traced(input, target)
    loss = -(target * logsigmoid(input) + (1.0 - target) * logsigmoid(-input))
    loss = _weighted(loss, weight)
    classes = input.shape[-1] if input.ndim else 1
    return _reduce(loss.sum(input.ndim - 1) / float(classes) if input.ndim else loss,
                   reduction)


COSINE_EPSILON = 1e-12      # aten's cosine_embedding_loss: added to each squared norm


def cosine_embedding_loss(input1: Tensor, input2: Tensor, target: Tensor, margin: float = 0.0,
                          size_average=None, reduce=None, reduction: str = "mean") -> Tensor:
    """1 - cos(x1, x2) where target == 1, max(0, cos(x1, x2) - margin) where target == -1, 0
    elsewhere, as torch.nn.functional.cosine_embedding_loss: (N, D) inputs with (N,) targets
    or (D,) with a 0-d one (torch's errors); cos = sum(x1 x2) / sqrt((|x1|^2 + 1e-12)
    (|x2|^2 + 1e-12)), aten's form."""
    reduction = _reduction(reduction, size_average, reduce)
    input2, target = _traced(input1, input2), _traced(input1, target)
    if target.ndim not in (0, 1):
        raise ShapeError("0D or 1D target tensor expected, multi-target not supported")
    want = 2 if target.ndim == 1 else 1
    if input1.ndim != want or input2.ndim != want:
        raise ShapeError(f"{target.ndim}D target tensor expects {want}D input tensors, but "
                         f"found inputs with sizes {list(input1.shape)} and "
                         f"{list(input2.shape)}.")
    dim = target.ndim
    prod = (input1 * input2).sum(dim)
    norms = ((input1 * input1).sum(dim) + COSINE_EPSILON) * \
        ((input2 * input2).sum(dim) + COSINE_EPSILON)
    cos = prod / norms.sqrt()
    loss = (1.0 - cos).where(target == 1, 0.0) + \
        (cos - float(margin)).clamp(min=0.0).where(target == -1, 0.0)
    return _reduce(loss, reduction)


def triplet_margin_loss(anchor: Tensor, positive: Tensor, negative: Tensor,
                        margin: float = 1.0, p: float = 2, eps: float = 1e-6,
                        swap: bool = False, size_average=None, reduce=None,
                        reduction: str = "mean") -> Tensor:
    """max(0, margin + d(a, p) - d(a, n)), d = pairwise_distance(., ., p, eps) over the last
    dim; swap: d(a, n) replaced by min(d(a, n), d(p, n)), as
    torch.nn.functional.triplet_margin_loss (torch's checks)."""
    reduction = _reduction(reduction, size_average, reduce)
    if margin <= 0:
        raise ValueError(f"margin must be greater than 0, got {margin}")
    positive, negative = _traced(anchor, positive), _traced(anchor, negative)
    if not anchor.ndim == positive.ndim == negative.ndim:
        raise ShapeError(f"The anchor, positive, and negative tensors are expected to have the "
                         f"same number of dimensions, but got: anchor {anchor.ndim}D, positive "
                         f"{positive.ndim}D, and negative {negative.ndim}D inputs")
    d_pos = pairwise_distance(anchor, positive, p, eps)
    d_neg = pairwise_distance(anchor, negative, p, eps)
    if swap:
        d_neg = d_neg.minimum(pairwise_distance(positive, negative, p, eps))
    return _reduce((float(margin) + d_pos - d_neg).clamp(min=0.0), reduction)


def poisson_nll_loss(input: Tensor, target: Tensor, log_input: bool = True, full: bool = False,
                     size_average=None, eps: float = 1e-8, reduce=None,
                     reduction: str = "mean") -> Tensor:
    """exp(x) - y x (log_input), else x - y log(x + eps); full adds Stirling's term y log y -
    y + log(2 pi y) / 2 where y > 1, as torch.nn.functional.poisson_nll_loss. The term reads
    log of max(y, 1) elsewhere, so a target of 0 has a finite gradient (torch's is NaN)."""
    reduction = _reduction(reduction, size_average, reduce)
    target = _traced(input, target)
    if log_input:
        loss = input.exp() - target * input
    else:
        loss = input - target * (input + float(eps)).log()
    if full:
        big = target > 1.0
        y = target.where(big, 1.0)
        stirling = y * y.log() - y + (y * (2.0 * math.pi)).log() * 0.5
        loss = loss + stirling.where(big, 0.0)
    return _reduce(loss, reduction)


def gaussian_nll_loss(input: Tensor, target: Tensor, var, full: bool = False,
                      eps: float = 1e-6, reduction: str = "mean") -> Tensor:
    """(log(max(var, eps)) + (input - target)^2 / max(var, eps)) / 2, plus log(2 pi) / 2 when
    full, reduced, as torch.nn.functional.gaussian_nll_loss: var of input's shape, or one
    short of it (the last dim) or with one dim of 1 (homoscedastic), or a number; torch's
    errors. The clamp at eps passes the gradient through unchanged, as torch's (it clamps
    under no_grad). A negative var raises where its values are known (eager or a number);
    a traced var is not checked (that would read the data during the step)."""
    target = _traced(input, target)
    if isinstance(var, (int, float)):
        if var < 0:
            raise ValueError("var has negative entry/entries")
        var = input.new_full(tuple(input.shape), float(var))
    var = _traced(input, var)
    if var.is_eager and bool((var < 0.0).any()):
        raise ValueError("var has negative entry/entries")
    if var.shape != input.shape:
        if var.shape == input.shape[:-1]:
            var = var.unsqueeze(-1)
        elif not (input.ndim == var.ndim and
                  sum(v for i, v in zip(input.shape, var.shape) if i != v) == 1):
            raise ValueError("var is of incorrect size")
    if reduction not in REDUCTIONS:
        raise ValueError(reduction + " is not valid")
    # torch clamps a copy of var in place under no_grad: the value clamped, the gradient as
    # if unclamped (var - var.detach() is 0 with gradient 1)
    var = var.clamp(min=float(eps)).detach() + (var - var.detach())
    loss = (var.log() + (input - target).square() / var) * 0.5
    if full:
        loss = loss + 0.5 * math.log(2 * math.pi)
    return _reduce(loss, reduction)


# ---- group and RMS normalisation, composed (their gradients follow from the ops') -----------

def group_norm(input: Tensor, num_groups: int, weight=None, bias=None,
               eps: float = 1e-5) -> Tensor:
    """Normalise each of num_groups channel groups of an (N, C, ...) input over its channels
    and positions, then weight * y + bias per channel, as torch.nn.functional.group_norm.
    One layer_norm op over (N * groups, C / groups * positions) rows."""
    if input.ndim < 2 or input.shape[1] % num_groups:
        raise ShapeError(f"group_norm: {num_groups} groups must divide the channels (dim 1) "
                         f"of input {input.shape}")
    n, c = input.shape[:2]
    rows = input.reshape(n * num_groups, -1)
    y = input.tracer.op("layer_norm", [rows], eps=float(eps), weight=False, bias=False)
    y = y.reshape(*input.shape)
    w, b = _traced(input, weight), _traced(input, bias)
    channel = _channel_shape(input)
    y = y if w is None else y * w.reshape(channel)
    return y if b is None else y + b.reshape(channel)


def rms_norm(input: Tensor, normalized_shape, weight=None, eps: float | None = None) -> Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last len(normalized_shape) dims, as
    torch.nn.functional.rms_norm; eps None is the machine epsilon of the input's dtype."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else \
        tuple(normalized_shape)
    if tuple(input.shape[input.ndim - len(shape):]) != shape:
        raise ShapeError(f"rms_norm: normalized_shape {shape} does not match the last dims "
                         f"of input {input.shape}")
    eps = float(np.finfo(input.dtype).eps) if eps is None else float(eps)
    dims = tuple(range(input.ndim - len(shape), input.ndim))
    y = input * (input.square().mean(dims, keepdim=True) + eps).rsqrt()
    w = _traced(input, weight)
    return y if w is None else y * w


def instance_norm(input: Tensor, running_mean=None, running_var=None, weight=None, bias=None,
                  use_input_stats: bool = True, momentum: float = 0.1,
                  eps: float = 1e-5) -> Tensor:
    """Normalise each (n, c) slice of an (N, C, ...) input over its positions, then weight *
    y + bias per channel, as torch.nn.functional.instance_norm: group_norm with one group per
    channel (one layer_norm op over N * C rows). With use_input_stats and running_mean /
    running_var, those are updated in place as torch's: momentum towards the mean over the
    batch of each instance's mean and of its unbiased variance (running_stats_update, the
    SyncBatchNorm op, with each instance's position count; its counter is a scratch one, as
    torch never counts InstanceNorm's batches). use_input_stats=False normalises with the
    running statistics (BatchNorm's eval form)."""
    if input.ndim < 2:
        raise ShapeError(f"instance_norm: input must be (N, C, ...), got {input.shape}")
    rm, rv = _traced(input, running_mean), _traced(input, running_var)
    if (rm is None) != (rv is None):
        raise ValueError("instance_norm: give both running_mean and running_var, or neither")
    if not use_input_stats:
        if rm is None:
            raise ValueError("Expected running_mean and running_var to be defined when "
                             "use_input_stats is false")
        return _batch_norm_eval(input, rm, rv, _traced(input, weight), _traced(input, bias),
                                eps)
    positions = int(np.prod(input.shape[2:], dtype=np.int64))
    if positions == 1:
        raise ValueError(f"Expected more than 1 spatial element when training, got input "
                         f"size {list(input.shape)}")
    y = group_norm(input, input.shape[1], weight, bias, eps)
    if rm is not None:
        if rm.dtype != "float32" or rv.dtype != "float32":
            raise UnsupportedOpError(f"instance_norm updating {rm.dtype} running statistics "
                                     "is not supported (float32 only, as the modules keep "
                                     "them)")
        _instance_running_stats(input.detach(), rm, rv, positions, momentum)
    return y


def _instance_running_stats(x: Tensor, rm: Tensor, rv: Tensor, positions: int,
                            momentum) -> None:
    """running_mean/var moved towards the batch mean of the instances' means and of their
    variances: the op scales the biased variance it is given by L / (L - 1), L = positions,
    so the mean of biased variances becomes the mean of torch's unbiased ones."""
    rows = x.reshape(x.shape[0], x.shape[1], positions)
    mean = rows.mean(-1, keepdim=True)
    var = (rows - mean).square().mean(-1)
    count = tensor_of(np.array([positions], np.dtype(x.dtype)))
    x.tracer.op_all("running_stats_update",
                    [rm, rv, _batches_tracked(x, None, momentum), mean.reshape(*mean.shape[:2])
                     .mean(0), var.mean(0), count],
                    momentum=None if momentum is None else float(momentum))


# ---- 1-d convolution, transposed convolution, interpolation, adaptive pooling --------------
# Resampling along an axis is a linear map: a (out, in) matrix built on the device from arange
# and comparisons (the sizes are static, so it is a constant the planner computes each step in
# a few fused pointwise kernels), applied by matmul; gradients are the transposed matmuls.

def conv1d(input: Tensor, weight, bias=None, stride=1, padding=0, dilation=1,
           groups: int = 1) -> Tensor:
    """1-D cross-correlation of an (N, C, L) input with weight (O, C/groups, k), as
    torch.nn.functional.conv1d: conv2d over a unit height axis."""
    w = _traced(input, weight)
    if input.ndim != 3 or w.ndim != 3:
        raise ShapeError(f"conv1d: input (N, C, L) and weight (O, C/groups, k) expected, got "
                         f"{input.shape} and {w.shape}")
    pad = padding if isinstance(padding, str) else (0, _single(padding))
    y = conv2d(input.reshape(input.shape[0], input.shape[1], 1, input.shape[2]),
               w.reshape(w.shape[0], w.shape[1], 1, w.shape[2]), bias, (1, _single(stride)),
               pad, (1, _single(dilation)), groups)
    return y.reshape(y.shape[0], y.shape[1], y.shape[3])


def _single(v) -> int:
    """conv1d's int-or-1-tuple arguments as an int."""
    return v if isinstance(v, int) else tuple(v)[0]


def _positions(x: Tensor, n: int) -> Tensor:
    """0, 1, ..., n - 1 as an eager float64 tensor (exact, and exact products with sizes
    below 2^53): the index matrices built from it depend on shapes only, so they are computed
    once at trace time and enter the graph as constants in x's dtype."""
    return tensor_of(np.arange(n, dtype=np.float64))


def _placement(x: Tensor, n_out: int, n_in: int, stride: int, offset: int) -> Tensor:
    """(n_out, n_in) matrix in x's dtype: 1 where out == offset + stride * in, else 0."""
    o = _positions(x, n_out).reshape(n_out, 1)
    i = _positions(x, n_in).reshape(1, n_in)
    return (o == i * float(stride) + float(offset))._cast(x.dtype)


def _resample(x: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
    """rows @ x @ cols^T over the last two axes of x (..., H, W): (..., H', W')."""
    y = x @ cols.transpose(0, 1)
    return (y.transpose(-1, -2) @ rows.transpose(0, 1)).transpose(-1, -2)


def conv_transpose2d(input: Tensor, weight, bias=None, stride=1, padding=0, output_padding=0,
                     groups: int = 1, dilation=1) -> Tensor:
    """Transposed 2-D convolution of an (N, Cin, H, W) input with weight (Cin, Cout/groups,
    kh, kw) and an optional bias (Cout,), as torch.nn.functional.conv_transpose2d. It is the
    input gradient of the conv2d that maps Cout channels to Cin with that very weight, so it
    runs as one conv2d_grad_input node (cuDNN's data-gradient kernels on CUDA; no zeros spread
    between the pixels); output_padding only sets the output size."""
    w, b = _traced(input, weight), _traced(input, bias)
    if input.ndim != 4 or w.ndim != 4 or input.shape[1] != w.shape[0] or \
            w.shape[0] % groups:
        raise ShapeError(f"conv_transpose2d: input (N, Cin, H, W) and weight (Cin, Cout/groups,"
                         f" kh, kw) with groups={groups} expected, got {input.shape} and "
                         f"{w.shape}")
    stride, padding, dilation = _pair(stride), _pair(padding), _pair(dilation)
    output_padding = _pair(output_padding)
    if any(op >= max(s, d) for op, s, d in zip(output_padding, stride, dilation)):
        raise ValueError(f"conv_transpose2d: output_padding {output_padding} must be smaller "
                         f"than the stride {stride} or the dilation {dilation}")
    size = tuple((n - 1) * s - 2 * p + d * (k - 1) + op + 1 for n, k, s, p, d, op in
                 zip(input.shape[2:], w.shape[2:], stride, padding, dilation, output_padding))
    if min(size) < 1:
        raise ShapeError(f"conv_transpose2d: the output size {size} of input {input.shape} "
                         f"is not positive")
    # An output_padding of a stride or more (allowed below the dilation) makes conv2d map the
    # output onto more positions than the input has: the input is zero-padded to them (zeros
    # give no contribution), so the data gradient has exactly the transposed size.
    covers = [(o + 2 * p - d * (k - 1) - 1) // s + 1 for o, k, s, p, d in
              zip(size, w.shape[2:], stride, padding, dilation)]
    extra = [c - n for c, n in zip(covers, input.shape[2:])]
    x = pad(input, (0, extra[1], 0, extra[0])) if any(extra) else input
    n, cout = input.shape[0], w.shape[1] * groups
    y = input.tracer.op("conv2d_grad_input", [x, w], input_shape=(n, cout, *size),
                        stride=stride, padding=padding, dilation=dilation, groups=int(groups))
    return y if b is None else y + b.reshape(1, cout, 1, 1)


def _one_axis(input: Tensor, what: str, run) -> Tensor:
    """run(x) over x = an (N, C, L) input with a unit axis inserted, (N, C, 1, L), the result
    back to (N, C', L'); an unbatched (C, L) input as a batch of one, as torch's 1-d pools."""
    if input.ndim not in (2, 3):
        raise ShapeError(f"{what}: input must be (N, C, L) or (C, L), got {input.shape}")
    x = input if input.ndim == 3 else input.reshape(1, *input.shape)
    y = run(x.reshape(x.shape[0], x.shape[1], 1, x.shape[2]))
    y = y.reshape(y.shape[0], y.shape[1], y.shape[3])
    return y if input.ndim == 3 else y.reshape(*y.shape[1:])


def max_pool1d(input: Tensor, kernel_size, stride=None, padding=0, dilation=1,
               ceil_mode: bool = False, return_indices: bool = False) -> Tensor:
    """Max over windows of the last axis of an (N, C, L) or (C, L) input, as
    torch.nn.functional.max_pool1d: max_pool2d over a unit height axis (its padding,
    dilation and ceil_mode rules; the gradient to a window's first maximum); return_indices
    is refused, as max_pool2d's."""
    if return_indices:
        raise UnsupportedOpError("max_pool1d with return_indices is not supported")
    k = _single(kernel_size)
    s = k if stride is None or stride == [] else _single(stride)
    return _one_axis(input, "max_pool1d", lambda x: max_pool2d(
        x, (1, k), (1, s), (0, _single(padding)), (1, _single(dilation)), ceil_mode))


def avg_pool1d(input: Tensor, kernel_size, stride=None, padding=0, ceil_mode: bool = False,
               count_include_pad: bool = True) -> Tensor:
    """Mean over windows of the last axis of an (N, C, L) or (C, L) input (zero padding,
    counted when count_include_pad), as torch.nn.functional.avg_pool1d: avg_pool2d over a
    unit height axis; ceil_mode is refused, as avg_pool2d's."""
    if ceil_mode:
        raise UnsupportedOpError("avg_pool1d with ceil_mode=True is not supported")
    k = _single(kernel_size)
    s = k if stride is None or stride == [] else _single(stride)
    return _one_axis(input, "avg_pool1d", lambda x: avg_pool2d(
        x, (1, k), (1, s), (0, _single(padding)), False, count_include_pad))


def adaptive_avg_pool1d(input: Tensor, output_size) -> Tensor:
    """Average pooling of the last axis of an (N, C, L) or (C, L) input to `output_size`
    over torch's bins, as torch.nn.functional.adaptive_avg_pool1d: adaptive_avg_pool2d to
    (1, output_size) over a unit height axis."""
    out = _single(output_size)
    return _one_axis(input, "adaptive_avg_pool1d",
                     lambda x: adaptive_avg_pool2d(x, (1, out)))


def conv_transpose1d(input: Tensor, weight, bias=None, stride=1, padding=0, output_padding=0,
                     groups: int = 1, dilation=1) -> Tensor:
    """Transposed 1-D convolution of an (N, Cin, L) or (Cin, L) input with weight (Cin,
    Cout/groups, k) and an optional bias (Cout,), as torch.nn.functional.conv_transpose1d:
    conv_transpose2d over a unit height axis."""
    w = _traced(input, weight)
    if w.ndim != 3:
        raise ShapeError(f"conv_transpose1d: weight must be (Cin, Cout/groups, k), got "
                         f"{w.shape}")
    w = w.reshape(w.shape[0], w.shape[1], 1, w.shape[2])
    return _one_axis(input, "conv_transpose1d", lambda x: conv_transpose2d(
        x, w, bias, (1, _single(stride)), (0, _single(padding)), (0, _single(output_padding)),
        groups, (1, _single(dilation))))


def _out_size(size, scale_factor, recompute: bool, shape: tuple[int, ...], what: str):
    """The output (H, W) and the per-axis scale (in / out, or 1 / scale_factor when given
    and not recomputed: torch's source-index scale) of interpolate's size or scale_factor."""
    if (size is None) == (scale_factor is None):
        raise ValueError(f"{what}: give exactly one of size and scale_factor")
    if size is not None:
        out = _pair(size)
        return out, [i / o for i, o in zip(shape, out)]
    factors = (float(scale_factor),) * 2 if isinstance(scale_factor, (int, float)) else \
        tuple(float(f) for f in scale_factor)
    out = tuple(int(i * f) for i, f in zip(shape, factors))
    return out, [i / o if recompute else 1.0 / f for i, o, f in zip(shape, out, factors)]


def _nearest(x: Tensor, n_out: int, n_in: int, scale: float) -> Tensor:
    """(n_out, n_in): out o reads in min(floor(o * scale), n_in - 1), torch's "nearest"."""
    src = (_positions(x, n_out) * scale).floor().clamp(max=float(n_in - 1)).reshape(n_out, 1)
    return (_positions(x, n_in).reshape(1, n_in) == src)._cast(x.dtype)


def _linear_weights(x: Tensor, n_out: int, n_in: int, scale: float,
                    align_corners: bool) -> Tensor:
    """(n_out, n_in) linear interpolation weights: source s = o * (in - 1) / (out - 1) with
    align_corners, else (o + 0.5) * scale - 0.5 clamped at 0; weights 1 - f and f on floor(s)
    and floor(s) + 1 (both clamped to the last input)."""
    o = _positions(x, n_out)
    if align_corners:
        src = o * ((n_in - 1) / (n_out - 1) if n_out > 1 else 0.0)
    else:
        src = ((o + 0.5) * scale - 0.5).clamp(min=0.0)
    lo = src.floor().clamp(max=float(n_in - 1))
    frac = (src - lo).reshape(n_out, 1)
    lo = lo.reshape(n_out, 1)
    hi = (lo + 1.0).clamp(max=float(n_in - 1))
    i = _positions(x, n_in).reshape(1, n_in)
    weights = (i == lo)._cast("float64") * (1.0 - frac) + (i == hi)._cast("float64") * frac
    return weights._cast(x.dtype)


def interpolate(input: Tensor, size=None, scale_factor=None, mode: str = "nearest",
                align_corners: bool | None = None, recompute_scale_factor=None,
                antialias: bool = False) -> Tensor:
    """Resize the (H, W) axes of an (N, C, H, W) input by `size` or `scale_factor`, mode
    "nearest" or "bilinear" (align_corners; recompute_scale_factor: the source scale from
    the sizes), as torch.nn.functional.interpolate."""
    if input.ndim != 4 or mode not in ("nearest", "bilinear") or antialias:
        raise UnsupportedOpError(f"interpolate of a {input.ndim}-d input with mode={mode!r}"
                                 f"{', antialias' if antialias else ''} (only 4-d nearest and "
                                 f"bilinear; in {input.tracer.where()})")
    if mode == "nearest" and align_corners is not None:
        raise ValueError("interpolate: align_corners is only for the linear modes")
    out, scale = _out_size(size, scale_factor, bool(recompute_scale_factor), input.shape[2:],
                           "interpolate")
    maps = [_nearest(input, o, n, s) if mode == "nearest" else
            _linear_weights(input, o, n, s, bool(align_corners))
            for o, n, s in zip(out, input.shape[2:], scale)]
    return _resample(input, *maps)


def _adaptive_bins(x: Tensor, n_out: int, n_in: int) -> Tensor:
    """(n_out, n_in) averaging matrix of torch's adaptive bins: bin o covers
    [floor(o * in / out), ceil((o + 1) * in / out))."""
    o = _positions(x, n_out).reshape(n_out, 1)
    start = (o * float(n_in) / float(n_out)).floor()
    end = ((o + 1.0) * float(n_in) / float(n_out)).ceil()
    i = _positions(x, n_in).reshape(1, n_in)
    inside = (i >= start).logical_and(i < end)._cast("float64")
    return (inside / (end - start))._cast(x.dtype)


def adaptive_max_pool2d(input: Tensor, output_size, return_indices: bool = False) -> Tensor:
    """Max pooling to `output_size` (None keeps that axis) over torch's bins [floor(o * In /
    Out), ceil((o + 1) * In / Out)), as torch.nn.functional.adaptive_max_pool2d: a max over
    the bin offsets of selections, per axis (offsets past a bin's end repeat its last
    input, which changes neither the max nor, as the gradient of tied maxima is split among
    copies of one input, the gradient)."""
    if return_indices:
        raise UnsupportedOpError("adaptive_max_pool2d with return_indices is not supported")
    oh, ow = _adaptive_size(input, output_size, "adaptive_max_pool2d")
    axes = []
    for n, out in zip(input.shape[2:], (oh, ow)):
        o = _positions(input, out)
        start = (o * float(n) / float(out)).floor()
        last = ((o + 1.0) * float(n) / float(out)).ceil() - 1.0
        widest = max(-(-(i + 1) * n // out) - i * n // out for i in range(out))
        axes.append([(start + float(a)).minimum(last) for a in range(widest)])
    return _max_of_selections(input, *axes)


def _adaptive_size(input: Tensor, output_size, what: str) -> tuple[int, int]:
    if input.ndim != 4:
        raise ShapeError(f"{what}: input must be (N, C, H, W), got {input.shape}")
    h, w = input.shape[2:]
    oh, ow = (None, None) if output_size is None else \
        (output_size, output_size) if isinstance(output_size, int) else tuple(output_size)
    return oh or h, ow or w


# ---- 3-d convolution and pooling ------------------------------------------------------------
# Ops of their own (conv3d, maxpool3d, avgpool3d: ops/conv.py, ops/pool.py) over (N, C, D, H, W)
# input; an unbatched (C, D, H, W) input runs as a batch of one, as torch.

def _unbatched(input: Tensor, what: str, run) -> Tensor:
    """run(x) over a 5-d input, or over a 4-d one as a batch of one (the result unbatched)."""
    if input.ndim == 4:
        y = run(input.reshape(1, *input.shape))
        return y.reshape(*y.shape[1:])
    if input.ndim != 5:
        raise ShapeError(f"{what}: input must be (N, C, D, H, W) or (C, D, H, W), got "
                         f"{input.shape}")
    return run(input)


def conv3d(input: Tensor, weight, bias=None, stride=1, padding=0, dilation=1,
           groups: int = 1) -> Tensor:
    """3-D cross-correlation of an (N, C, D, H, W) input with weight (O, C/groups, kd, kh,
    kw) and an optional bias (O,), zero padding (also "valid" and "same"), as
    torch.nn.functional.conv3d."""
    w, b = _traced(input, weight), _traced(input, bias)
    if w.ndim != 5:
        raise ShapeError(f"conv3d: weight must be (O, C/groups, kd, kh, kw), got {w.shape}")
    dilation = _ntuple(dilation, 3)
    padding = _conv_padding(padding, tuple(w.shape[2:]), dilation, stride, "conv3d")
    return _unbatched(input, "conv3d", lambda x: x.tracer.op(
        "conv3d", [x, w] + ([b] if b is not None else []), stride=_ntuple(stride, 3),
        padding=padding, dilation=dilation, groups=int(groups)))


def _window3d(kernel_size, stride, padding):
    kernel = _ntuple(kernel_size, 3)
    stride = kernel if stride is None or stride == [] else _ntuple(stride, 3)
    return kernel, stride, _ntuple(padding, 3)


def max_pool3d(input: Tensor, kernel_size, stride=None, padding=0, dilation=1,
               ceil_mode: bool = False, return_indices: bool = False) -> Tensor:
    """Max over the windows of an (N, C, D, H, W) input (stride defaults to the kernel; -inf
    padding of at most half the kernel; dilation; ceil_mode), as
    torch.nn.functional.max_pool3d: op maxpool3d."""
    if return_indices:
        raise UnsupportedOpError("max_pool3d with return_indices is not supported")
    kernel, stride, padding = _window3d(kernel_size, stride, padding)
    return _unbatched(input, "max_pool3d", lambda x: x.tracer.op_all(
        "maxpool3d", [x], kernel=kernel, stride=stride, padding=padding,
        dilation=_ntuple(dilation, 3), ceil_mode=bool(ceil_mode))[0])


def avg_pool3d(input: Tensor, kernel_size, stride=None, padding=0, ceil_mode: bool = False,
               count_include_pad: bool = True, divisor_override=None) -> Tensor:
    """Mean over the windows of an (N, C, D, H, W) input (stride defaults to the kernel; zero
    padding of at most half the kernel; ceil_mode; count_include_pad; divisor_override), as
    torch.nn.functional.avg_pool3d: op avgpool3d."""
    kernel, stride, padding = _window3d(kernel_size, stride, padding)
    if divisor_override is not None and int(divisor_override) <= 0:
        raise ValueError(f"avg_pool3d: divisor_override must be positive, got "
                         f"{divisor_override}")
    return _unbatched(input, "avg_pool3d", lambda x: x.tracer.op(
        "avgpool3d", [x], kernel=kernel, stride=stride, padding=padding,
        ceil_mode=bool(ceil_mode), count_include_pad=bool(count_include_pad),
        divisor_override=None if divisor_override is None else int(divisor_override)))


def adaptive_avg_pool3d(input: Tensor, output_size) -> Tensor:
    """Average pooling of an (N, C, D, H, W) input to `output_size` (an int or a triple; None
    keeps that axis) over torch's bins [floor(o * In / Out), ceil((o + 1) * In / Out)), as
    torch.nn.functional.adaptive_avg_pool3d. Where every output size divides its input size
    the bins are kernel = stride = In / Out windows (avg_pool3d); otherwise an averaging
    matrix per resized axis, applied by matmul."""
    sizes = (output_size,) * 3 if output_size is None or isinstance(output_size, int) \
        else tuple(output_size)
    if len(sizes) != 3:
        raise ValueError(f"adaptive_avg_pool3d: output_size must be an int or a triple, got "
                         f"{output_size}")

    def run(x: Tensor) -> Tensor:
        spatial = x.shape[2:]
        out = tuple(n if o is None else int(o) for o, n in zip(sizes, spatial))
        if all(n % o == 0 for n, o in zip(spatial, out)):
            kernel = tuple(n // o for n, o in zip(spatial, out))
            return avg_pool3d(x, kernel, kernel)
        for axis, (o, n) in enumerate(zip(out, spatial), start=2):
            if o == n:
                continue
            bins = _adaptive_bins(x, o, n).transpose(0, 1)      # x @ bins^T along `axis`
            x = x @ bins if axis == 4 else (x.transpose(axis, 4) @ bins).transpose(axis, 4)
        return x

    return _unbatched(input, "adaptive_avg_pool3d", run)


# ---- normalize, pad ------------------------------------------------------------------------

def normalize(input: Tensor, p: float = 2.0, dim: int = 1, eps: float = 1e-12,
              out=None) -> Tensor:
    """input / max(||input||_p over dim, eps), as torch.nn.functional.normalize."""
    from ..ir.tensor import _is_scalar
    from ..ir.tensor_reduce import _vector_norm
    if out is not None:
        input._unsupported("normalize with out= (use the returned tensor)")
    if _is_scalar(p) and not p > 0:     # p = 0 or negative: the norm clamped below at eps
        return input / _vector_norm(input, p, dim, keepdim=True, eps=0.0).clamp_min(eps)
    return input / _vector_norm(input, p, dim, keepdim=True, eps=float(eps))


_PAD_INDEX = {   # the source position of each padded position o in [-before, n + after)
    "reflect": lambda o, n: np.abs(o) if n == 1 else (n - 1) - np.abs((n - 1) - np.abs(o)),
    "replicate": lambda o, n: np.clip(o, 0, n - 1),
    "circular": lambda o, n: o % n,
}


def pad(input: Tensor, pad, mode: str = "constant", value: float | None = None) -> Tensor:
    """input padded by `pad` = (last dim before, after, the dim before it before, after,
    ...), as torch.nn.functional.pad; a negative amount crops. "constant" joins `value`
    (0 by default) blocks on (concat); "reflect", "replicate" and "circular" read the
    padded axis at constant source positions (float input; the gradient adds up where a
    position is read twice)."""
    if len(pad) % 2 or len(pad) > 2 * input.ndim:
        raise ShapeError(f"pad: {tuple(pad)} must hold a (before, after) pair per padded "
                         f"axis, at most {input.ndim} pairs for a tensor of shape "
                         f"{tuple(input.shape)}")
    if mode not in ("constant", *_PAD_INDEX):
        raise ValueError(f"pad: mode must be 'constant', 'reflect', 'replicate' or "
                         f"'circular', got {mode!r}")
    if mode != "constant" and value:
        raise ValueError(f"pad: value {value} is for mode='constant' only")
    y = input
    for i in range(len(pad) // 2):
        axis, before, after = input.ndim - 1 - i, int(pad[2 * i]), int(pad[2 * i + 1])
        y = _pad_axis(y, axis, before, after, mode, 0.0 if value is None else value)
    return y


def _pad_axis(x: Tensor, axis: int, before: int, after: int, mode: str, value) -> Tensor:
    n = x.shape[axis]
    # crop first, then pad what is left to pad; replicate reads the clamped source position
    # of the uncropped axis (torch's: the last element kept even where all are cropped)
    if mode != "replicate" and (before < 0 or after < 0):
        start, stop = max(-before, 0), n - max(-after, 0)
        if stop < start:
            raise ShapeError(f"pad: cropping {-before}, {-after} of axis {axis} of length {n}")
        x = x.narrow(axis, start, stop - start)
        before, after, n = max(before, 0), max(after, 0), stop - start
    if before == after == 0:
        return x
    if mode == "constant":
        from ..functions.tensors import cat
        blocks = [x.new_full((*x.shape[:axis], k, *x.shape[axis + 1:]), value)
                  for k in (before, after)]
        return cat([b for b, k in zip((blocks[0], x, blocks[1]), (before, 1, after)) if k],
                   axis)
    if mode == "reflect" and max(before, after) >= n or mode == "circular" and \
            max(before, after) > n:
        raise ShapeError(f"pad: {mode} padding of {before}, {after} is too large for axis "
                         f"{axis} of length {n}")
    if n + before + after < 0:
        raise ShapeError(f"pad: cropping {-before}, {-after} of axis {axis} of length {n}")
    source = _PAD_INDEX[mode](np.arange(-before, n + after), n)
    return x.index_select(axis, tensor_of(source.astype(np.int64)))


def softmin(input: Tensor, dim: int | None = None, _stacklevel: int = 3,
            dtype=None) -> Tensor:
    """softmax of -input over `dim` (of input cast to `dtype` first, if given)."""
    return softmax(-(input if dtype is None else input.to(dtype)), dim)


def cosine_similarity(x1: Tensor, x2: Tensor, dim: int = 1, eps: float = 1e-8) -> Tensor:
    """The sum over `dim` of x1 / max(||x1||, eps) times x2 / max(||x2||, eps), the two
    broadcast together, as torch's (each normalised before the product)."""
    shape = np.broadcast_shapes(tuple(x1.shape), tuple(x2.shape))
    x1, x2 = x1.expand(*shape), x2.expand(*shape)
    return (normalize(x1, 2.0, dim, eps) * normalize(x2, 2.0, dim, eps)).sum(dim)


def pairwise_distance(x1: Tensor, x2: Tensor, p: float = 2.0, eps: float = 1e-6,
                      keepdim: bool = False) -> Tensor:
    """||x1 - x2 + eps||_p over the last dim, as torch."""
    from ..ir.tensor_reduce import _vector_norm
    return _vector_norm(x1 - x2 + eps, p, -1, keepdim, eps=0.0)


def one_hot(tensor: Tensor, num_classes: int = -1) -> Tensor:
    """int64 (..., num_classes) with 1 at each index; num_classes must be given (the
    default -1, the largest index + 1, depends on the data)."""
    if num_classes < 0:
        tensor._unsupported("F.one_hot without num_classes (the width would depend on the "
                            "data; pass num_classes)")
    if tensor.dtype != "int64":
        raise ShapeError(f"one_hot: expects an int64 tensor of indices, got {tensor.dtype}")
    classes = tensor.new_tensor(np.arange(num_classes))
    return (tensor.unsqueeze(-1) == classes).long()


def pixel_shuffle(input: Tensor, upscale_factor: int) -> Tensor:
    """(..., C r^2, H, W) -> (..., C, H r, W r), as torch: views and one permute."""
    r = int(upscale_factor)
    *lead, c, h, w = input.shape
    if c % (r * r):
        raise ShapeError(f"pixel_shuffle: {c} channels do not divide by upscale_factor^2 = "
                         f"{r * r}")
    k = len(lead)
    y = input.reshape(*lead, c // (r * r), r, r, h, w)
    y = y.permute(*range(k + 1), k + 3, k + 1, k + 4, k + 2)
    return y.reshape(*lead, c // (r * r), h * r, w * r)


def pixel_unshuffle(input: Tensor, downscale_factor: int) -> Tensor:
    """(..., C, H r, W r) -> (..., C r^2, H, W), the inverse of pixel_shuffle."""
    r = int(downscale_factor)
    *lead, c, h, w = input.shape
    if h % r or w % r:
        raise ShapeError(f"pixel_unshuffle: {h}x{w} does not divide by downscale_factor {r}")
    k = len(lead)
    y = input.reshape(*lead, c, h // r, r, w // r, r)
    y = y.permute(*range(k + 1), k + 2, k + 4, k + 1, k + 3)
    return y.reshape(*lead, c * r * r, h // r, w // r)


def __getattr__(name: str):
    """A torch.nn.functional name stepgraph lacks: UnsupportedOpError (an AttributeError)."""
    if name.startswith("_"):
        raise AttributeError(f"module 'stepgraph.nn.functional' has no attribute {name!r}")
    from ..errors import missing_torch_name
    raise missing_torch_name(f"torch.nn.functional.{name}")
