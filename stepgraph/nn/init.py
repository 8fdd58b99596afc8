"""torch.nn.init: in-place initialisers with torch's names, arguments and fan rules.

Each fills its argument in place and returns it. The argument may be a Parameter or Buffer
(written through `assign`, so compiled steps keep their storage), a NumPy array, or any tensor
with `copy_` (an eager tensor). Draws come from one NumPy generator (`manual_seed` seeds it);
`generator=` may pass a `torch.Generator` (stepgraph's) or a `numpy.random.Generator` instead;
other generators are refused with TypeError. Values are drawn in float64 and stored at the
argument's dtype.
"""
from __future__ import annotations

import math

import numpy as np

_generator = np.random.default_rng(0)
_seed = 0                                  # what _generator was seeded with (initial_seed)

# torch's gains (calculate_gain): every linear-like op has gain 1
_LINEAR = ("linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
           "conv_transpose3d", "sigmoid")


def manual_seed(seed: int) -> None:
    """Seed the generator that module constructors and nn.init draw initial weights from."""
    global _generator, _seed
    _generator, _seed = np.random.default_rng(seed), int(seed)


def _rng(generator) -> np.random.Generator:
    if generator is None:
        return _generator
    if isinstance(generator, np.random.Generator):
        return generator
    own = getattr(generator, "numpy_generator", None)      # a stepgraph (torch.) Generator
    if isinstance(own, np.random.Generator):
        return own
    raise TypeError(f"generator must be None, a stepgraph Generator or a "
                    f"numpy.random.Generator, got {type(generator).__name__} (seed "
                    "stepgraph.nn.init.manual_seed instead)")


def _shape(tensor) -> tuple[int, ...]:
    return tuple(int(d) for d in tensor.shape)


def _write(tensor, values: np.ndarray, drawn: bool = True):
    """Copy values into tensor in place; returns tensor. Drawn values are refused for a
    traced tensor (inside a forward) or while a forward is traced: drawn once at trace time,
    they would repeat every step (Tensor.normal_ and its kin draw in the step instead)."""
    from ..ir.trace import Tensor, current_tracer
    traced = isinstance(tensor, Tensor) and not tensor.is_eager
    if drawn and (traced or isinstance(tensor, Tensor) and current_tracer() is not None):
        from ..errors import UnsupportedOpError
        where = (tensor.tracer if traced else current_tracer()).where()
        raise UnsupportedOpError(
            f"nn.init's random initialisers on a tensor inside a traced forward are not "
            f"supported by stepgraph (called in {where}): values drawn once at trace time "
            "would repeat every step; initialise in the constructor, or use the tensor's "
            "normal_ / uniform_ methods on a tensor of the forward, which draw every step")
    if hasattr(tensor, "assign"):                     # Parameter, Buffer
        tensor.assign(values)
    elif isinstance(tensor, np.ndarray):
        tensor[...] = values
    elif hasattr(tensor, "copy_"):
        tensor.copy_(values)
    else:
        raise TypeError(f"cannot initialise a {type(tensor).__name__} in place (a Parameter, "
                        "Buffer, NumPy array or tensor with copy_ is required)")
    return tensor


def calculate_gain(nonlinearity: str, param=None) -> float:
    """The recommended gain for a nonlinearity (torch's table): 1 for linear, conv and
    sigmoid, 5/3 for tanh, sqrt(2) for relu, sqrt(2 / (1 + slope^2)) for leaky_relu
    (param: the slope, default 0.01), 3/4 for selu."""
    if nonlinearity in _LINEAR:
        return 1.0
    if nonlinearity == "tanh":
        return 5.0 / 3
    if nonlinearity == "relu":
        return math.sqrt(2.0)
    if nonlinearity == "leaky_relu":
        if param is None:
            slope = 0.01
        elif isinstance(param, (int, float)) and not isinstance(param, bool):
            slope = param
        else:
            raise ValueError(f"negative_slope {param} is not a valid number")
        return math.sqrt(2.0 / (1 + slope ** 2))
    if nonlinearity == "selu":
        return 3.0 / 4
    raise ValueError(f"unsupported nonlinearity {nonlinearity}")


def _calculate_fan_in_and_fan_out(tensor) -> tuple[int, int]:
    """(fan_in, fan_out) as torch's: size(1) and size(0) times the receptive field (the
    product of the dims after the first two); fewer than 2 dims is a ValueError."""
    shape = _shape(tensor)
    if len(shape) < 2:
        raise ValueError("Fan in and fan out can not be computed for tensor with fewer than "
                         f"2 dimensions (shape {shape})")
    receptive = math.prod(shape[2:])
    return shape[1] * receptive, shape[0] * receptive


def _calculate_correct_fan(tensor, mode: str) -> int:
    if mode not in ("fan_in", "fan_out"):
        raise ValueError(f"Mode {mode} not supported, please use one of fan_in, fan_out")
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    return fan_in if mode == "fan_in" else fan_out


def uniform_(tensor, a: float = 0.0, b: float = 1.0, generator=None):
    """Fill with draws from U(a, b)."""
    return _write(tensor, _rng(generator).uniform(a, b, size=_shape(tensor)))


def normal_(tensor, mean: float = 0.0, std: float = 1.0, generator=None):
    """Fill with draws from N(mean, std^2)."""
    return _write(tensor, _rng(generator).normal(mean, std, size=_shape(tensor)))


def trunc_normal_(tensor, mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0,
                  generator=None):
    """Fill with draws from N(mean, std^2) truncated to [a, b] (a and b are absolute bounds,
    as torch's): normal draws, those outside redrawn until all lie inside."""
    if not a < b:
        raise ValueError(f"trunc_normal_ needs a < b, got a={a}, b={b}")
    rng = _rng(generator)
    values = rng.normal(mean, std, size=_shape(tensor))
    outside = (values < a) | (values > b)
    while outside.any():
        values[outside] = rng.normal(mean, std, size=int(outside.sum()))
        outside = (values < a) | (values > b)
    return _write(tensor, values)


def constant_(tensor, val: float):
    """Fill with `val`."""
    return _write(tensor, np.full(_shape(tensor), val), drawn=False)


def ones_(tensor):
    return constant_(tensor, 1.0)


def zeros_(tensor):
    return constant_(tensor, 0.0)


def eye_(tensor):
    """The identity matrix (2-D only; ones on the diagonal of a non-square one)."""
    shape = _shape(tensor)
    if len(shape) != 2:
        raise ValueError(f"Only tensors with 2 dimensions are supported, got shape {shape}")
    return _write(tensor, np.eye(*shape), drawn=False)


def dirac_(tensor, groups: int = 1):
    """The Dirac delta of a (3, 4 or 5)-D convolution weight: per group, output channel d
    passes input channel d through at the kernel's centre (identity convolution)."""
    shape = _shape(tensor)
    if len(shape) not in (3, 4, 5):
        raise ValueError(f"Only tensors with 3, 4, or 5 dimensions are supported, got {shape}")
    if shape[0] % groups:
        raise ValueError(f"dim 0 ({shape[0]}) must be divisible by groups ({groups})")
    per_group = shape[0] // groups
    values = np.zeros(shape)
    centre = tuple(k // 2 for k in shape[2:])
    for g in range(groups):
        for d in range(min(per_group, shape[1])):
            values[(g * per_group + d, d) + centre] = 1.0
    return _write(tensor, values, drawn=False)


def xavier_uniform_(tensor, gain: float = 1.0, generator=None):
    """U(-a, a) with a = gain * sqrt(6 / (fan_in + fan_out)) (Glorot & Bengio)."""
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    bound = gain * math.sqrt(6.0 / (fan_in + fan_out))
    return uniform_(tensor, -bound, bound, generator)


def xavier_normal_(tensor, gain: float = 1.0, generator=None):
    """N(0, std^2) with std = gain * sqrt(2 / (fan_in + fan_out))."""
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    return normal_(tensor, 0.0, gain * math.sqrt(2.0 / (fan_in + fan_out)), generator)


def _kaiming_std(tensor, a: float, mode: str, nonlinearity: str) -> float:
    fan = _calculate_correct_fan(tensor, mode)
    if fan == 0:                               # torch warns and leaves such a tensor as is
        return 0.0
    return calculate_gain(nonlinearity, a) / math.sqrt(fan)


def kaiming_uniform_(tensor, a: float = 0.0, mode: str = "fan_in",
                     nonlinearity: str = "leaky_relu", generator=None):
    """U(-bound, bound) with bound = gain * sqrt(3 / fan) (He et al.); gain from
    calculate_gain(nonlinearity, a), fan by mode ("fan_in" or "fan_out")."""
    bound = math.sqrt(3.0) * _kaiming_std(tensor, a, mode, nonlinearity)
    if bound == 0.0:
        return tensor
    return uniform_(tensor, -bound, bound, generator)


def kaiming_normal_(tensor, a: float = 0.0, mode: str = "fan_in",
                    nonlinearity: str = "leaky_relu", generator=None):
    """N(0, std^2) with std = gain / sqrt(fan), as kaiming_uniform_'s."""
    std = _kaiming_std(tensor, a, mode, nonlinearity)
    if std == 0.0:
        return tensor
    return normal_(tensor, 0.0, std, generator)


def orthogonal_(tensor, gain: float = 1.0, generator=None):
    """A (semi-)orthogonal matrix times gain, viewed as (size(0), rest): orthonormal rows
    (or columns, whichever are fewer); from the QR decomposition of a normal draw with the
    signs of R's diagonal folded in, so the result is uniformly distributed."""
    shape = _shape(tensor)
    if len(shape) < 2:
        raise ValueError("Only tensors with 2 or more dimensions are supported")
    rows, cols = shape[0], math.prod(shape[1:])
    if rows * cols == 0:
        return tensor
    flat = _rng(generator).normal(size=(rows, cols))
    if rows < cols:
        flat = flat.T
    q, r = np.linalg.qr(flat)
    q = q * np.sign(np.diag(r))
    if rows < cols:
        q = q.T
    return _write(tensor, gain * q.reshape(shape))


def sparse_(tensor, sparsity: float, std: float = 0.01, generator=None):
    """A 2-D N(0, std^2) matrix with ceil(sparsity * rows) entries of each column zeroed."""
    shape = _shape(tensor)
    if len(shape) != 2:
        raise ValueError(f"Only tensors with 2 dimensions are supported, got shape {shape}")
    rng = _rng(generator)
    rows, cols = shape
    values = rng.normal(0.0, std, size=shape)
    zeros = int(math.ceil(sparsity * rows))
    for c in range(cols):
        values[rng.permutation(rows)[:zeros], c] = 0.0
    return _write(tensor, values)
