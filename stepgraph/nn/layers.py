"""Layers with torch.nn's names, constructor arguments, parameter shapes and initialisation."""
from __future__ import annotations

import math
import warnings

import numpy as np

from ..errors import ShapeError, UnsupportedOpError
from . import functional as F
from . import init
from .module import Module, Parameter


def _reset_fan_in(weight: Parameter, bias: Parameter | None) -> None:
    """torch's default for Linear and Conv: kaiming_uniform_(a=sqrt(5)), i.e.
    U(-1/sqrt(fan_in), 1/sqrt(fan_in)), and the bias from the same range."""
    init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        fan_in, _ = init._calculate_fan_in_and_fan_out(weight)
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0.0
        init.uniform_(bias, -bound, bound)


class Linear(Module):
    """y = x W^T + b, weight (out_features, in_features), initialised by reset_parameters."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = Parameter(np.empty((out_features, in_features), np.float32))
        self.bias = Parameter(np.empty(out_features, np.float32)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _reset_fan_in(self.weight, self.bias)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")

    def _label_args(self):
        return f"{self.in_features},{self.out_features}"


class Embedding(Module):
    """A (num_embeddings, embedding_dim) table of rows looked up by integer indices; weight
    initialised N(0, 1) as torch.nn.Embedding, the padding_idx row (if any) zero, looked up
    without gradient (F.embedding)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx=None,
                 max_norm=None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                 sparse: bool = False):
        super().__init__()
        if max_norm is not None or scale_grad_by_freq or sparse:
            raise UnsupportedOpError("Embedding with max_norm, scale_grad_by_freq or sparse "
                                     "is not supported")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = None if padding_idx is None else \
            F.padding_index(padding_idx, num_embeddings)
        self.weight = Parameter(np.empty((num_embeddings, embedding_dim), np.float32))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init.normal_(self.weight)
        if self.padding_idx is not None:
            values = np.array(self.weight.numpy())
            values[self.padding_idx] = 0
            self.weight.assign(values)

    def forward(self, input):
        return F.embedding(input, self.weight, self.padding_idx)

    def extra_repr(self):
        padding = "" if self.padding_idx is None else f", padding_idx={self.padding_idx}"
        return f"{self.num_embeddings}, {self.embedding_dim}{padding}"


class LayerNorm(Module):
    """Normalisation over the trailing normalized_shape dims (an int or a tuple), weight 1
    and bias 0 of that shape when elementwise_affine (bias=False: no bias), as
    torch.nn.LayerNorm."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True):
        super().__init__()
        self.normalized_shape, self.eps = F.normalized_dims(normalized_shape), eps
        self.elementwise_affine, self.has_bias = elementwise_affine, bias
        shape = self.normalized_shape
        self.weight = Parameter(np.empty(shape, np.float32)) if elementwise_affine else None
        self.bias = Parameter(np.empty(shape, np.float32)) if elementwise_affine and bias \
            else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            init.ones_(self.weight)
        if self.bias is not None:
            init.zeros_(self.bias)

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self):
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}, bias={self.has_bias}")

    def _label_args(self):
        return f"{self.normalized_shape}, eps={self.eps}"


def _check_conv_args(layer: str, in_channels: int, out_channels: int, groups: int,
                     padding_mode: str) -> None:
    """The constructor checks every convolution layer shares (torch's errors)."""
    if in_channels % groups or out_channels % groups:
        raise ValueError(f"groups={groups} must divide in_channels {in_channels} and "
                         f"out_channels {out_channels}")
    if padding_mode != "zeros":
        raise UnsupportedOpError(f"{layer} padding_mode={padding_mode!r} (only 'zeros')")


class _ConvNd(Module):
    """Conv2d and Conv3d: the same arguments, weight (out, in/groups, *kernel), bias (out,),
    torch's init, the functional form of their rank."""

    _rank = 2
    _conv = staticmethod(F.conv2d)

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0,
                 dilation=1, groups: int = 1, bias: bool = True, padding_mode: str = "zeros"):
        super().__init__()
        n = self._rank
        _check_conv_args(f"Conv{n}d", in_channels, out_channels, groups, padding_mode)
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.stride = F._ntuple(kernel_size, n), F._ntuple(stride, n)
        self.padding = padding if isinstance(padding, str) else F._ntuple(padding, n)
        self.dilation, self.groups = F._ntuple(dilation, n), groups
        self.padding_mode = padding_mode
        self.weight = Parameter(np.empty((out_channels, in_channels // groups,
                                          *self.kernel_size), np.float32))
        self.bias = Parameter(np.empty(out_channels, np.float32)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _reset_fan_in(self.weight, self.bias)

    def forward(self, x):
        return self._conv(x, self.weight, self.bias, self.stride, self.padding, self.dilation,
                          self.groups)

    def _padding_repr(self) -> str:
        return str(self.padding)

    def extra_repr(self):
        s = (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
             f"stride={self.stride}")
        if self.padding != (0,) * self._rank:
            s += f", padding={self._padding_repr()}"
        if self.dilation != (1,) * self._rank:
            s += f", dilation={self.dilation}"
        if self.groups != 1:
            s += f", groups={self.groups}"
        return s + (", bias=False" if self.bias is None else "")

    def _label_args(self):
        return f"{self.in_channels},{self.out_channels},{self.kernel_size[0]}"


class Conv2d(_ConvNd):
    def _padding_repr(self) -> str:
        return repr(self.padding)       # a string padding quoted (torch's is not)


class _MaxPoolNd(Module):
    """MaxPool2d and MaxPool3d: the same arguments, the functional form of their rank."""

    _pool = staticmethod(F.max_pool2d)

    def __init__(self, kernel_size, stride=None, padding=0, dilation=1,
                 return_indices: bool = False, ceil_mode: bool = False):
        super().__init__()
        self.kernel_size, self.stride, self.padding = kernel_size, stride, padding
        self.dilation, self.return_indices, self.ceil_mode = dilation, return_indices, ceil_mode

    def forward(self, x):
        return self._pool(x, self.kernel_size, self.stride, self.padding, self.dilation,
                          self.ceil_mode, self.return_indices)

    def extra_repr(self):
        stride = self.kernel_size if self.stride is None else self.stride
        return (f"kernel_size={self.kernel_size}, stride={stride}, padding={self.padding}, "
                f"dilation={self.dilation}, ceil_mode={self.ceil_mode}")

    def _label_args(self):
        return f"{self.kernel_size}"


class MaxPool2d(_MaxPoolNd):
    pass


class _AvgPoolNd(Module):
    """AvgPool2d and AvgPool3d: the same arguments, the functional form of their rank."""

    _pool = staticmethod(F.avg_pool2d)

    def __init__(self, kernel_size, stride=None, padding=0, ceil_mode: bool = False,
                 count_include_pad: bool = True, divisor_override=None):
        super().__init__()
        self.kernel_size, self.stride, self.padding = kernel_size, stride, padding
        self.ceil_mode, self.count_include_pad = ceil_mode, count_include_pad
        self.divisor_override = divisor_override

    def forward(self, x):
        return self._pool(x, self.kernel_size, self.stride, self.padding, self.ceil_mode,
                          self.count_include_pad, self.divisor_override)

    def extra_repr(self):
        stride = self.kernel_size if self.stride is None else self.stride
        return f"kernel_size={self.kernel_size}, stride={stride}, padding={self.padding}"

    def _label_args(self):
        return f"{self.kernel_size}"


class AvgPool2d(_AvgPoolNd):
    pass


class _AdaptiveAvgPoolNd(Module):
    """Average pooling to a fixed output size (1: global), torch's bins."""

    _pool = staticmethod(F.adaptive_avg_pool2d)

    def __init__(self, output_size):
        super().__init__()
        self.output_size = output_size

    def forward(self, x):
        return self._pool(x, self.output_size)

    def extra_repr(self):
        return f"output_size={self.output_size}"

    def _label_args(self):
        return f"{self.output_size}"


class AdaptiveAvgPool2d(_AdaptiveAvgPoolNd):
    pass


class _BatchNorm(Module):
    """PyTorch's _BatchNorm: weight 1, bias 0 (when affine); buffers running_mean 0,
    running_var 1, num_batches_tracked 0 (when track_running_stats), updated in place by
    every training step; eval mode normalises with them."""

    ranks: tuple[int, ...] = ()

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, *, bias: bool = True):
        super().__init__()
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.affine, self.track_running_stats = affine, track_running_stats
        self.weight = Parameter(np.empty(num_features, np.float32)) if affine else None
        self.bias = Parameter(np.empty(num_features, np.float32)) if affine and bias else None
        track = track_running_stats
        self.register_buffer("running_mean", np.zeros(num_features, np.float32) if track else None)
        self.register_buffer("running_var", np.ones(num_features, np.float32) if track else None)
        self.register_buffer("num_batches_tracked", np.array(0, np.int64) if track else None)
        self.reset_parameters()

    def reset_running_stats(self) -> None:
        if self.track_running_stats:
            self.running_mean.zero_()
            self.running_var.fill_(1)
            self.num_batches_tracked.zero_()

    def reset_parameters(self) -> None:
        self.reset_running_stats()
        if self.affine:
            init.ones_(self.weight)
        if self.bias is not None:
            init.zeros_(self.bias)

    def forward(self, x):
        if x.ndim not in self.ranks:
            raise ShapeError(f"{type(self).__name__} expects a {' or '.join(map(str, self.ranks))}"
                             f"-D input, got {x.shape}")
        # As torch: without running statistics, eval mode normalises with the batch's too.
        use_batch = self.training or self.running_mean is None
        update = self.training and self.track_running_stats
        keep = update or not self.training
        return F.batch_norm(x, self.running_mean if keep else None,
                            self.running_var if keep else None, self.weight, self.bias,
                            use_batch, self.momentum, self.eps,
                            num_batches_tracked=self.num_batches_tracked if update else None)

    def extra_repr(self):
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, "
                f"affine={self.affine}, bias={self.bias is not None}, "   # torch 2.13's
                f"track_running_stats={self.track_running_stats}")

    def _label_args(self):
        return f"{self.num_features}"


class BatchNorm1d(_BatchNorm):
    """Over (N, C) or (N, C, L) inputs."""
    ranks = (2, 3)


class BatchNorm2d(_BatchNorm):
    """Over (N, C, H, W) inputs."""
    ranks = (4,)


class BatchNorm3d(_BatchNorm):
    """Over (N, C, D, H, W) inputs: the batch_norm_train op takes (N, C, *spatial) as it is
    (statistics over N and every spatial axis), no reshape."""
    ranks = (5,)


class Conv3d(_ConvNd):
    """F.conv3d; weight (out, in/groups, kd, kh, kw), bias (out,); torch's init."""

    _rank = 3
    _conv = staticmethod(F.conv3d)


class MaxPool3d(_MaxPoolNd):
    _pool = staticmethod(F.max_pool3d)


class AvgPool3d(_AvgPoolNd):
    _pool = staticmethod(F.avg_pool3d)


class AdaptiveAvgPool3d(_AdaptiveAvgPoolNd):
    """Average pooling of (N, C, D, H, W) inputs to a fixed output size, torch's bins."""

    _pool = staticmethod(F.adaptive_avg_pool3d)


class Flatten(Module):
    def __init__(self, start_dim: int = 1):
        super().__init__()
        self.start_dim = start_dim

    def forward(self, x):
        return F.flatten(x, self.start_dim)

    def extra_repr(self):
        return f"start_dim={self.start_dim}, end_dim=-1"

    def _label_args(self):
        return ""


class Dropout(Module):
    """Zeroes elements with probability p when training. `inplace` is accepted, as torch's:
    the result is the same (a traced value is never overwritten; ir/tensor_inplace.py _assign)."""
    per_channel = False

    def __init__(self, p: float = 0.5, inplace: bool = False):
        super().__init__()
        if not 0.0 <= p <= 1.0:     # p = 1 drops everything, as torch
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        self.p = p
        self.inplace = bool(inplace)

    def forward(self, x):
        drop = F.dropout2d if self.per_channel else F.dropout
        return drop(x, self.p, self.training)

    def extra_repr(self):
        return f"p={self.p}, inplace={self.inplace}"

    def _label_args(self):
        return f"p={self.p}"


class Dropout2d(Dropout):
    """Zeroes whole channels of an (N, C, H, W) input."""
    per_channel = True


class Dropout1d(Dropout):
    """Zeroes whole channels of an (N, C, L) or unbatched (C, L) input (F.dropout1d)."""

    def forward(self, x):
        return F.dropout1d(x, self.p, self.training)


class _Activation(Module):
    kind = ""

    def __init__(self, inplace: bool = False):
        super().__init__()              # inplace: accepted as PyTorch does; traced ops copy
        self.inplace = bool(inplace)

    def forward(self, x):
        return F.activation(x, self.kind)


class ReLU(_Activation):
    kind = "relu"


class Sigmoid(_Activation):
    kind = "sigmoid"


class Tanh(_Activation):
    kind = "tanh"


class SiLU(_Activation):
    """x * sigmoid(x)."""
    kind = "silu"


class Identity(Module):
    """Returns its input; takes and ignores any constructor arguments, as PyTorch's."""

    def __init__(self, *args, **kwargs):
        super().__init__()

    def forward(self, x):
        return x


class LeakyReLU(Module):
    def __init__(self, negative_slope: float = 0.01, inplace: bool = False):
        super().__init__()              # inplace: accepted as PyTorch does; traced ops copy
        self.negative_slope = negative_slope
        self.inplace = bool(inplace)

    def forward(self, x):
        return F.activation(x, "leaky_relu", self.negative_slope)

    def extra_repr(self):
        return f"negative_slope={self.negative_slope}" + (", inplace=True" if self.inplace
                                                          else "")

    def _label_args(self):
        return ""


class GELU(Module):
    def __init__(self, approximate: str = "none"):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x):
        return F.activation(x, "gelu" if self.approximate == "none" else "gelu_tanh")

    def extra_repr(self):
        return f"approximate={self.approximate!r}"

    def _label_args(self):
        return ""


class Softmax(Module):
    def __init__(self, dim: int | None = None):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return F.softmax(x, self.dim)

    def extra_repr(self):
        return f"dim={self.dim}"


class Softmin(Softmax):
    def forward(self, x):
        return F.softmin(x, self.dim)


class LogSoftmax(Module):
    def __init__(self, dim: int = 1):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return F.log_softmax(x, self.dim)

    def extra_repr(self):
        return f"dim={self.dim}"

    def _label_args(self):
        return ""


# ---- activations composed of elementwise ops (nn/functional.py) ----------------------------

class ELU(Module):
    def __init__(self, alpha: float = 1.0, inplace: bool = False):
        super().__init__()
        self.alpha = alpha

    def forward(self, x):
        return F.elu(x, self.alpha)


class CELU(ELU):
    def forward(self, x):
        return F.celu(x, self.alpha)


class _Composed(Module):
    """A parameterless activation: forward is the F function `fn`; `inplace` is accepted as
    PyTorch's (traced ops never overwrite their input)."""
    fn = None

    def __init__(self, inplace: bool = False):
        super().__init__()
        self.inplace = bool(inplace)

    def forward(self, x):
        return type(self).fn(x)


class SELU(_Composed):
    fn = staticmethod(F.selu)


class Mish(_Composed):
    fn = staticmethod(F.mish)


class Hardswish(_Composed):
    fn = staticmethod(F.hardswish)


class Hardsigmoid(_Composed):
    fn = staticmethod(F.hardsigmoid)


class ReLU6(_Composed):
    fn = staticmethod(F.relu6)


class LogSigmoid(_Composed):
    fn = staticmethod(F.logsigmoid)


class Softplus(Module):
    def __init__(self, beta: float = 1.0, threshold: float = 20.0):
        super().__init__()
        self.beta, self.threshold = beta, threshold

    def forward(self, x):
        return F.softplus(x, self.beta, self.threshold)


class Hardtanh(Module):
    def __init__(self, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False):
        super().__init__()
        self.min_val, self.max_val = min_val, max_val

    def forward(self, x):
        return F.hardtanh(x, self.min_val, self.max_val)


class GLU(Module):
    def __init__(self, dim: int = -1):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return F.glu(x, self.dim)


# ---- normalisation, 1-d and transposed convolution, resampling, attention -------------------

class GroupNorm(Module):
    """F.group_norm over num_groups channel groups; weight 1 and bias 0 (C,) when affine."""

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5,
                 affine: bool = True):
        super().__init__()
        if num_channels % num_groups:
            raise ValueError(f"num_groups {num_groups} must divide num_channels "
                             f"{num_channels}")
        self.num_groups, self.num_channels, self.eps, self.affine = \
            num_groups, num_channels, eps, affine
        self.weight = Parameter(np.empty(num_channels, np.float32)) if affine else None
        self.bias = Parameter(np.empty(num_channels, np.float32)) if affine else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.affine:
            init.ones_(self.weight)
        if self.bias is not None:
            init.zeros_(self.bias)

    def forward(self, x):
        return F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)

    def extra_repr(self):
        return f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}"


class RMSNorm(Module):
    """F.rms_norm over the trailing normalized_shape; weight 1 when elementwise_affine; eps
    None is the input dtype's machine epsilon."""

    def __init__(self, normalized_shape, eps: float | None = None,
                 elementwise_affine: bool = True):
        super().__init__()
        self.normalized_shape = (normalized_shape,) if isinstance(normalized_shape, int) \
            else tuple(normalized_shape)
        self.eps, self.elementwise_affine = eps, elementwise_affine
        self.weight = Parameter(np.empty(self.normalized_shape, np.float32)) \
            if elementwise_affine else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.elementwise_affine:
            init.ones_(self.weight)

    def forward(self, x):
        return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}"


class Conv1d(Module):
    """F.conv1d; weight (out, in/groups, k), bias (out,)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0,
                 dilation=1, groups: int = 1, bias: bool = True, padding_mode: str = "zeros"):
        super().__init__()
        _check_conv_args("Conv1d", in_channels, out_channels, groups, padding_mode)
        k = F._single(kernel_size)
        self.in_channels, self.out_channels, self.kernel_size = in_channels, out_channels, (k,)
        self.stride, self.dilation, self.groups = (F._single(stride),), (F._single(dilation),), \
            groups
        self.padding = padding if isinstance(padding, str) else (F._single(padding),)
        self.weight = Parameter(np.zeros((out_channels, in_channels // groups, k), np.float32))
        self.bias = Parameter(np.zeros(out_channels, np.float32)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _reset_fan_in(self.weight, self.bias)

    def forward(self, x):
        padding = self.padding if isinstance(self.padding, str) else self.padding[0]
        return F.conv1d(x, self.weight, self.bias, self.stride[0], padding, self.dilation[0],
                        self.groups)

    def extra_repr(self):
        return f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}"


class _ConvTranspose(Module):
    """What ConvTranspose1d and 2d share: torch's arguments as `dims`-tuples, weight (in,
    out/groups, *kernel), bias (out,), torch's init (fan_in weight.size(1) * kernel
    positions: out/groups * the kernel's)."""

    dims = 2

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0,
                 output_padding=0, groups: int = 1, bias: bool = True, dilation=1,
                 padding_mode: str = "zeros"):
        super().__init__()
        _check_conv_args(type(self).__name__, in_channels, out_channels, groups, padding_mode)
        size = lambda v: F._ntuple(v, self.dims)       # noqa: E731
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.stride = size(kernel_size), size(stride)
        self.padding, self.output_padding = size(padding), size(output_padding)
        self.groups, self.dilation = groups, size(dilation)
        self.weight = Parameter(np.zeros((in_channels, out_channels // groups,
                                          *self.kernel_size), np.float32))
        self.bias = Parameter(np.zeros(out_channels, np.float32)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _reset_fan_in(self.weight, self.bias)


class ConvTranspose2d(_ConvTranspose):
    """F.conv_transpose2d; weight (in, out/groups, kh, kw), bias (out,); torch's init, whose
    fan_in is weight.size(1) * kh * kw (out/groups * kh * kw)."""

    def forward(self, x):
        return F.conv_transpose2d(x, self.weight, self.bias, self.stride, self.padding,
                                  self.output_padding, self.groups, self.dilation)

    def extra_repr(self):
        return f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}"


class Upsample(Module):
    """F.interpolate to `size` or by `scale_factor` (nearest or bilinear)."""

    def __init__(self, size=None, scale_factor=None, mode: str = "nearest",
                 align_corners: bool | None = None, recompute_scale_factor=None):
        super().__init__()
        self.size, self.scale_factor, self.mode = size, scale_factor, mode
        self.align_corners, self.recompute_scale_factor = align_corners, recompute_scale_factor

    def forward(self, x):
        return F.interpolate(x, self.size, self.scale_factor, self.mode, self.align_corners,
                             self.recompute_scale_factor)

    def extra_repr(self):
        return f"size={self.size}, scale_factor={self.scale_factor}, mode={self.mode!r}"


class UpsamplingNearest2d(Upsample):
    def __init__(self, size=None, scale_factor=None):
        super().__init__(size, scale_factor, "nearest")


class UpsamplingBilinear2d(Upsample):
    """Bilinear with align_corners=True, as torch's."""

    def __init__(self, size=None, scale_factor=None):
        super().__init__(size, scale_factor, "bilinear", align_corners=True)


class _OutProjection(Linear):
    """MultiheadAttention's out_proj (torch's NonDynamicallyQuantizableLinear): a Linear."""


class MultiheadAttention(Module):
    """torch.nn.MultiheadAttention with kdim = vdim = embed_dim: in_proj_weight (3E, E),
    in_proj_bias (3E,), out_proj (a Linear), the same state_dict keys and init (xavier
    uniform in_proj_weight, zero biases). forward returns (output, weights): the weights
    averaged over heads (or per head) when need_weights, through the composed attention;
    need_weights=False takes F.scaled_dot_product_attention's fused op where it can."""

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim=None, vdim=None,
                 batch_first: bool = False):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim {embed_dim} must be divisible by num_heads {num_heads}")
        if add_bias_kv or add_zero_attn or kdim not in (None, embed_dim) or \
                vdim not in (None, embed_dim):
            raise UnsupportedOpError("MultiheadAttention with add_bias_kv, add_zero_attn or "
                                     "kdim/vdim other than embed_dim is not supported")
        self.embed_dim, self.num_heads, self.dropout = embed_dim, num_heads, dropout
        self.batch_first, self.head_dim = batch_first, embed_dim // num_heads
        self.in_proj_weight = Parameter(np.zeros((3 * embed_dim, embed_dim), np.float32))
        self.in_proj_bias = Parameter(np.zeros(3 * embed_dim, np.float32)) if bias else None
        self.out_proj = _OutProjection(embed_dim, embed_dim, bias=bias)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init.xavier_uniform_(self.in_proj_weight)
        if self.in_proj_bias is not None:
            init.zeros_(self.in_proj_bias)
            init.zeros_(self.out_proj.bias)

    def forward(self, query, key, value, key_padding_mask=None, need_weights: bool = True,
                attn_mask=None, average_attn_weights: bool = True, is_causal: bool = False):
        if is_causal and attn_mask is None:
            raise ValueError("MultiheadAttention: is_causal is a hint that attn_mask is the "
                             "causal mask; give the mask too (as torch)")
        q, k, v = self._project(query, key, value)
        n, length, s = q.shape[0], q.shape[2], k.shape[2]
        mask = _mha_mask(q, attn_mask, key_padding_mask, n, self.num_heads, length, s)
        p = self.dropout if self.training else 0.0
        if need_weights:
            probs = F._attention_probs(q, k, mask, False, 1.0 / self.head_dim ** 0.5)
            out = F.dropout(probs, p, self.training) @ v
            weights = probs.mean(1) if average_attn_weights else probs
        else:
            out, weights = F.scaled_dot_product_attention(q, k, v, mask, p), None
        out = out.permute(2, 0, 1, 3).reshape(length, n, self.embed_dim)  # (L, N, E)
        out = self.out_proj(out)
        return (out.transpose(0, 1) if self.batch_first else out), weights

    def _project(self, query, key, value):
        """q, k, v as (N, heads, L or S, head_dim)."""
        if self.batch_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        w = F._traced(query, self.in_proj_weight)
        b = F._traced(query, self.in_proj_bias)
        e = self.embed_dim
        if query is key is value:
            parts = F.linear(query, w, b).chunk(3, -1)
        else:
            parts = [F.linear(x, w.narrow(0, i * e, e),
                              None if b is None else b.narrow(0, i * e, e))
                     for i, x in enumerate((query, key, value))]
        return [x.reshape(x.shape[0], x.shape[1], self.num_heads, self.head_dim)
                .permute(1, 2, 0, 3) for x in parts]

    def extra_repr(self):
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}"


def _mha_mask(q, attn_mask, key_padding_mask, n: int, heads: int, length: int, s: int):
    """MultiheadAttention's masks (bool True: do not attend, or additive float; attn_mask
    (L, S) or (N * heads, L, S), key_padding_mask (N, S)) as one additive float mask
    broadcasting to (N, heads, L, S), or None."""
    masks = []
    if attn_mask is not None:
        m = F._traced(q, attn_mask)
        if m.ndim == 3:
            m = m.reshape(n, heads, length, s)
        masks.append(F._blocked(m, q.dtype) if m.dtype == "bool" else m._cast(q.dtype))
    if key_padding_mask is not None:
        m = F._traced(q, key_padding_mask).reshape(n, 1, 1, s)
        masks.append(F._blocked(m, q.dtype) if m.dtype == "bool" else m._cast(q.dtype))
    if not masks:
        return None
    return masks[0] if len(masks) == 1 else masks[0] + masks[1]


class AdaptiveMaxPool2d(Module):
    """F.adaptive_max_pool2d to a fixed output size, torch's bins."""

    def __init__(self, output_size, return_indices: bool = False):
        super().__init__()
        self.output_size, self.return_indices = output_size, return_indices

    def forward(self, x):
        return F.adaptive_max_pool2d(x, self.output_size, self.return_indices)

    def extra_repr(self):
        return f"{self.output_size}"


# ---- shape-only and distance layers ---------------------------------------------------------

class PixelShuffle(Module):
    def __init__(self, upscale_factor: int):
        super().__init__()
        self.upscale_factor = upscale_factor

    def forward(self, x):
        return F.pixel_shuffle(x, self.upscale_factor)

    def extra_repr(self):
        return f"upscale_factor={self.upscale_factor}"


class PixelUnshuffle(Module):
    def __init__(self, downscale_factor: int):
        super().__init__()
        self.downscale_factor = downscale_factor

    def forward(self, x):
        return F.pixel_unshuffle(x, self.downscale_factor)

    def extra_repr(self):
        return f"downscale_factor={self.downscale_factor}"


class Unflatten(Module):
    def __init__(self, dim: int, unflattened_size):
        super().__init__()
        self.dim, self.unflattened_size = dim, tuple(unflattened_size)

    def forward(self, x):
        return x.unflatten(self.dim, self.unflattened_size)

    def extra_repr(self):
        return f"dim={self.dim}, unflattened_size={self.unflattened_size}"


class CosineSimilarity(Module):
    def __init__(self, dim: int = 1, eps: float = 1e-8):
        super().__init__()
        self.dim, self.eps = dim, eps

    def forward(self, x1, x2):
        return F.cosine_similarity(x1, x2, self.dim, self.eps)


class PairwiseDistance(Module):
    def __init__(self, p: float = 2.0, eps: float = 1e-6, keepdim: bool = False):
        super().__init__()
        self.norm, self.eps, self.keepdim = p, eps, keepdim

    def forward(self, x1, x2):
        return F.pairwise_distance(x1, x2, self.norm, self.eps, self.keepdim)


class _Pad(Module):
    """F.pad of every input with `padding` (an int: the same on each side of the module's
    axes; or a tuple as F.pad takes it) in `mode`."""

    mode, axes = "constant", 2

    def __init__(self, padding, value: float = 0.0):
        super().__init__()
        self.padding = (padding,) * (2 * self.axes) if isinstance(padding, int) \
            else tuple(padding)
        self.value = value

    def forward(self, x):
        return F.pad(x, self.padding, self.mode, self.value if self.mode == "constant" else None)

    def extra_repr(self):
        return f"padding={self.padding}, value={self.value}"


class ConstantPad1d(_Pad):
    axes = 1


class ConstantPad2d(_Pad):
    pass


class ZeroPad2d(_Pad):
    def __init__(self, padding):
        super().__init__(padding, 0.0)

    def extra_repr(self):
        return f"{self.padding}"


class ReflectionPad1d(_Pad):
    mode, axes = "reflect", 1

    def __init__(self, padding):
        super().__init__(padding)

    def extra_repr(self):
        return f"{self.padding}"


class ReflectionPad2d(ReflectionPad1d):
    axes = 2


class ReplicationPad1d(ReflectionPad1d):
    mode = "replicate"


class ReplicationPad2d(ReplicationPad1d):
    axes = 2


# ---- more activations, PReLU, Bilinear, 1-d pooling and transposed convolution, InstanceNorm --

class Softsign(_Composed):
    fn = staticmethod(F.softsign)


class Tanhshrink(_Composed):
    fn = staticmethod(F.tanhshrink)


class Threshold(Module):
    """F.threshold: x where x > threshold, else value."""

    def __init__(self, threshold: float, value: float, inplace: bool = False):
        super().__init__()
        self.threshold, self.value, self.inplace = threshold, value, bool(inplace)

    def forward(self, x):
        return F.threshold(x, self.threshold, self.value)

    def extra_repr(self):
        return f"threshold={self.threshold}, value={self.value}" + (
            ", inplace=True" if self.inplace else "")


class PReLU(Module):
    """F.prelu with a learned slope: weight (num_parameters,) filled with `init`, as
    torch.nn.PReLU (one slope, or one per channel of dim 1)."""

    def __init__(self, num_parameters: int = 1, init: float = 0.25):
        super().__init__()
        self.num_parameters, self.init = num_parameters, init
        self.weight = Parameter(np.empty(num_parameters, np.float32))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init.constant_(self.weight, self.init)      # the module `init`: the argument is kept

    def forward(self, x):
        return F.prelu(x, self.weight)

    def extra_repr(self):
        return f"num_parameters={self.num_parameters}"


class Bilinear(Module):
    """F.bilinear; weight (out, in1, in2), bias (out,), both U(-1/sqrt(in1), 1/sqrt(in1)) as
    torch.nn.Bilinear's reset_parameters."""

    def __init__(self, in1_features: int, in2_features: int, out_features: int,
                 bias: bool = True):
        super().__init__()
        self.in1_features, self.in2_features = in1_features, in2_features
        self.out_features = out_features
        self.weight = Parameter(np.empty((out_features, in1_features, in2_features),
                                         np.float32))
        self.bias = Parameter(np.empty(out_features, np.float32)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1 / math.sqrt(self.weight.size(1))
        init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            init.uniform_(self.bias, -bound, bound)

    def forward(self, input1, input2):
        return F.bilinear(input1, input2, self.weight, self.bias)

    def extra_repr(self):
        return (f"in1_features={self.in1_features}, in2_features={self.in2_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}")


class MaxPool1d(_MaxPoolNd):
    _pool = staticmethod(F.max_pool1d)


class AvgPool1d(Module):
    """F.avg_pool1d; kernel_size, stride (the kernel's by default) and padding kept as
    1-tuples, as torch's."""

    def __init__(self, kernel_size, stride=None, padding=0, ceil_mode: bool = False,
                 count_include_pad: bool = True):
        super().__init__()
        self.kernel_size = F._ntuple(kernel_size, 1)
        self.stride = F._ntuple(kernel_size if stride is None else stride, 1)
        self.padding = F._ntuple(padding, 1)
        self.ceil_mode, self.count_include_pad = ceil_mode, count_include_pad

    def forward(self, x):
        return F.avg_pool1d(x, self.kernel_size, self.stride, self.padding, self.ceil_mode,
                            self.count_include_pad)

    def extra_repr(self):
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class AdaptiveAvgPool1d(_AdaptiveAvgPoolNd):
    _pool = staticmethod(F.adaptive_avg_pool1d)


class ConvTranspose1d(_ConvTranspose):
    """F.conv_transpose1d; weight (in, out/groups, k), bias (out,); torch's init (fan_in
    out/groups * k, as ConvTranspose2d's)."""

    dims = 1

    def forward(self, x):
        return F.conv_transpose1d(x, self.weight, self.bias, self.stride, self.padding,
                                  self.output_padding, self.groups, self.dilation)

    def extra_repr(self):
        s = (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
             f"stride={self.stride}")
        for name, default in (("padding", (0,)), ("dilation", (1,)), ("output_padding", (0,))):
            if getattr(self, name) != default:
                s += f", {name}={getattr(self, name)}"
        if self.groups != 1:
            s += f", groups={self.groups}"
        return s + (", bias=False" if self.bias is None else "")


class _InstanceNorm(_BatchNorm):
    """torch's _InstanceNorm: BatchNorm's parameters and buffers (weight 1, bias 0 when
    affine; running_mean, running_var and num_batches_tracked when track_running_stats,
    the counter never advanced, as torch's), affine and track_running_stats off by default.
    forward is F.instance_norm with the batch's statistics in training mode or without
    running statistics, else with those; an unbatched input runs as a batch of one."""

    rank = 3            # of a batched input

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = False, track_running_stats: bool = False, *,
                 bias: bool = True):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, bias=bias)

    def forward(self, x):
        if x.ndim not in (self.rank - 1, self.rank):
            raise ValueError(f"expected {self.rank - 1}D or {self.rank}D input (got {x.ndim}D "
                             f"input)")
        feature_dim = x.ndim - (self.rank - 1)
        if x.shape[feature_dim] != self.num_features:
            if self.affine:
                raise ValueError(f"expected input's size at dim={feature_dim} to match "
                                 f"num_features ({self.num_features}), but got: "
                                 f"{x.shape[feature_dim]}.")
            warnings.warn(f"input's size at dim={feature_dim} does not match num_features. You "
                          "can silence this warning by not passing in num_features, which is "
                          "not used because affine=False")
        if x.ndim == self.rank - 1:
            return self._normalise(x.unsqueeze(0)).squeeze(0)
        return self._normalise(x)

    def _normalise(self, x):
        # torch's momentum None (a cumulative average for BatchNorm) is 0 here: no update
        return F.instance_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                               self.training or not self.track_running_stats,
                               0.0 if self.momentum is None else self.momentum, self.eps)


class InstanceNorm1d(_InstanceNorm):
    """Over (N, C, L) or (C, L) inputs."""
    rank = 3


class InstanceNorm2d(_InstanceNorm):
    """Over (N, C, H, W) or (C, H, W) inputs."""
    rank = 4


class InstanceNorm3d(_InstanceNorm):
    """Over (N, C, D, H, W) or (C, D, H, W) inputs."""
    rank = 5
