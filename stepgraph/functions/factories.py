"""Tensor factories with torch's names and arguments: zeros, ones, full, empty, the *_like
forms, randn, rand, randint, randperm (and rand_like, randn_like, randint_like, bernoulli),
eye, tensor, as_tensor, from_numpy, arange, linspace.

Outside a traced forward they make eager tensors (values at once, in host memory); inside
one (`current_tracer`), graph values: `fill` and `arange` nodes where those ops make them,
else a `constant` of the values computed at trace time. Random factories draw from the
generator the module constructors use (`manual_seed`), or a `generator=` (generator.py): the
same distributions as torch, not torch's bits; inside a train forward they draw in the step,
anew every step, from the step's Philox stream (ir/tensor_random.py).
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from ..devices import as_device
from ..dtypes import as_dtype, get_default_dtype, tensor_dtype
from ..errors import UnsupportedOpError
from .generator import (Generator, default_generator, get_rng_state, host_rng, initial_seed,
                        seed, set_rng_state)
from ..ir.graph import BF16, storage_dtype
from ..ir import tensor_random as _random_tensors
from ..ir.tensor import _shape_args
from ..ir.trace import Tensor, current_tracer, tensor_of
from ..ops.shape import ARANGE_DTYPES


def _size(size, what: str) -> tuple[int, ...]:
    """A shape given as varargs or one tuple/list/Size, checked to be non-negative ints."""
    shape = _shape_args(tuple(size))
    if not all(isinstance(d, numbers.Integral) and d >= 0 for d in shape):
        raise TypeError(f"{what}: size must be non-negative ints, got {shape}")
    return tuple(int(d) for d in shape)


def _storage(values, dtype: str) -> np.ndarray:
    """`values` as a C-contiguous array in the storage dtype of IR dtype `dtype`."""
    if dtype == BF16:
        from ..backends.numpy import bf16
        return bf16.to_bits(np.asarray(values, np.float32))
    return np.array(values, dtype=storage_dtype(dtype), order="C")


def _place(array: np.ndarray, dtype: str, tracer=None) -> Tensor:
    """An eager tensor of `array`, or (inside a traced forward) a constant of the trace."""
    t = tensor_of(_storage(array, dtype))
    tracer = tracer or current_tracer()
    return t if tracer is None else Tensor(tracer.constant(t), tracer)


def _fill(shape, value, dtype, device, what: str, tracer=None) -> Tensor:
    as_device(device)
    dtype = tensor_dtype(dtype, what)
    tracer = tracer or current_tracer()
    if tracer is not None:
        return tracer.op("fill", [], value=value, shape=shape, dtype=str(dtype))
    return _place(np.full(shape, value), dtype)


def _value_dtype(value):
    """torch's dtype for a Python fill value: bool, int64 or the default float dtype."""
    if isinstance(value, (bool, np.bool_)):
        return "bool"
    return "int64" if isinstance(value, numbers.Integral) else get_default_dtype()


def zeros(*size, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    """A tensor of zeros (float32 unless `dtype`). `requires_grad` is accepted: gradients are
    derived from the loss at compile time, so it changes nothing."""
    return _fill(_size(size, "zeros"), 0, dtype or get_default_dtype(), device, "zeros")


def ones(*size, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    """A tensor of ones (float32 unless `dtype`)."""
    return _fill(_size(size, "ones"), 1, dtype or get_default_dtype(), device, "ones")


def empty(*size, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    """An uninitialised tensor in torch; here zeros, so nothing depends on stale memory."""
    return _fill(_size(size, "empty"), 0, dtype or get_default_dtype(), device, "empty")


def full(size, fill_value, *, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    """A tensor of `fill_value`; dtype as torch infers it (bool, int64 or float32)."""
    return _fill(_size((size,), "full"), fill_value, dtype or _value_dtype(fill_value), device,
                 "full")


def _like(input, value, dtype, device, what: str) -> Tensor:
    if not isinstance(input, Tensor):
        input = tensor_of(np.asarray(input))
    tracer = None if input.is_eager else input.tracer
    return _fill(tuple(input.shape), value, dtype or input.dtype, device, what, tracer)


def zeros_like(input, *, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    """Zeros of input's shape and (unless `dtype`) dtype."""
    return _like(input, 0, dtype, device, "zeros_like")


def ones_like(input, *, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    """Ones of input's shape and (unless `dtype`) dtype."""
    return _like(input, 1, dtype, device, "ones_like")


def empty_like(input, *, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    """As empty: zeros of input's shape and (unless `dtype`) dtype."""
    return _like(input, 0, dtype, device, "empty_like")


def full_like(input, fill_value, *, dtype=None, device=None,
              requires_grad: bool = False) -> Tensor:
    """`fill_value` everywhere, input's shape and (unless `dtype`) dtype."""
    return _like(input, fill_value, dtype, device, "full_like")


# ---- random ---------------------------------------------------------------------------------

def manual_seed(seed: int) -> Generator:
    """Seed the generator of the random factories and of module initialisation (one
    generator, as torch's default one); returns it (`default_generator`). Same distributions
    as torch, not torch's values."""
    return default_generator.manual_seed(seed)


def _random(what: str, generator, device):
    """(tracer, None) inside a train forward (its step draws the values, anew every step:
    ir/tensor_random.py), else (None, the host generator: `generator=` or manual_seed's)."""
    as_device(device)
    tracer = current_tracer()
    if tracer is None:
        return None, host_rng(generator, f"torch.{what}")
    if generator is not None:
        raise UnsupportedOpError(f"torch.{what}(generator=...) inside a forward is not "
                                 "supported by stepgraph: the step draws from its own stream, "
                                 "seeded by compile_train_step(seed=...)")
    return tracer, None


def randn(*size, generator=None, dtype=None, device=None, requires_grad: bool = False):
    """Standard normal draws (float32 unless `dtype`); inside a train forward drawn anew
    every step (ir/tensor_random.py)."""
    dtype = tensor_dtype(dtype or get_default_dtype(), "randn")
    (tracer, rng), shape = _random("randn", generator, device), _size(size, "randn")
    if tracer is not None:
        return _random_tensors.draw(tracer, "normal", shape, "torch.randn")._cast(str(dtype))
    return _place(rng.standard_normal(shape), dtype)


def rand(*size, generator=None, dtype=None, device=None, requires_grad: bool = False):
    """Uniform draws on [0, 1) (float32 unless `dtype`); inside a train forward drawn anew
    every step."""
    dtype = tensor_dtype(dtype or get_default_dtype(), "rand")
    (tracer, rng), shape = _random("rand", generator, device), _size(size, "rand")
    if tracer is not None:
        return _random_tensors.draw(tracer, "uniform", shape, "torch.rand")._cast(str(dtype))
    return _place(rng.random(shape), dtype)


def randint(*args, size=None, generator=None, dtype=None, device=None,
            requires_grad: bool = False):
    """Integers uniform on [low, high): randint(high, size) or randint(low, high, size)
    (int64 unless `dtype`); inside a train forward drawn anew every step."""
    if size is None:
        *args, size = args
    low, high = (0, *args) if len(args) == 1 else args
    dtype = tensor_dtype(dtype or "int64", "randint")
    (tracer, rng), shape = _random("randint", generator, device), _size((size,), "randint")
    if tracer is not None:
        return _random_tensors.randint_values(tracer, low, high, shape, str(dtype),
                                              "torch.randint")
    return _place(rng.integers(int(low), int(high), shape), dtype)


def rand_like(input, *, dtype=None, device=None, requires_grad: bool = False,
              memory_format=None):
    """Uniform draws on [0, 1) of input's shape and (unless `dtype`) dtype; of a traced
    tensor drawn anew every step."""
    as_device(device)
    return _random_tensors.random_like(input, "uniform", "torch.rand_like", dtype)


def randn_like(input, *, dtype=None, device=None, requires_grad: bool = False,
               memory_format=None):
    """Standard normal draws of input's shape and (unless `dtype`) dtype."""
    as_device(device)
    return _random_tensors.random_like(input, "normal", "torch.randn_like", dtype)


def randint_like(input, low=0, high=None, *, dtype=None, device=None,
                 requires_grad: bool = False, memory_format=None):
    """Integers uniform on [low, high) (randint_like(input, high) too) of input's shape and
    (unless `dtype`) dtype."""
    as_device(device)
    if high is None:
        low, high = 0, low
    if not isinstance(input, Tensor):
        input = tensor_of(np.asarray(input))
    dtype = str(tensor_dtype(dtype or input.dtype, "randint_like"))
    return _random_tensors.randint_values(input.tracer, low, high, input.shape, dtype,
                                          "torch.randint_like")


def bernoulli(input, p=None, *, generator=None, out=None):
    """1 with probability input (or the number p), else 0, of input's shape and dtype (as
    Tensor.bernoulli)."""
    if out is not None:
        raise UnsupportedOpError("torch.bernoulli(out=...) is not supported by stepgraph: use "
                                 "the result")
    return input.bernoulli(p, generator=generator)


def randperm(n: int, *, generator=None, dtype=None, device=None, requires_grad: bool = False,
             pin_memory: bool = False) -> Tensor:
    """A random permutation of 0..n-1 (int64 unless `dtype`), from `generator` or the host
    generator: a different permutation from torch's for the same seed."""
    if not isinstance(n, numbers.Integral) or n < 0:
        raise RuntimeError(f"randperm: n must be a non-negative int, got {n!r}")
    dtype = tensor_dtype(dtype or "int64", "randperm")
    tracer, rng = _random("randperm", generator, device)
    if tracer is not None:
        raise UnsupportedOpError("torch.randperm inside a forward is not supported by "
                                 "stepgraph: permute the batch in the script")
    return _place(rng.permutation(int(n)), dtype)


def multinomial(input, num_samples: int, replacement: bool = False, *, generator=None,
                out=None) -> Tensor:
    """Category indices drawn from each row of `input` (C,) or (N, C), non-negative weights
    that need not sum to 1: (num_samples,) or (N, num_samples) int64, with or without
    replacement, as torch.multinomial; from `generator` or the host generator (not torch's
    draws). Eager tensors (a predictor's output, as a sampling loop has): inside a traced
    forward it is refused."""
    if out is not None:
        raise UnsupportedOpError("torch.multinomial(out=...) is not supported by stepgraph")
    tracer, rng = _random("multinomial", generator, None)
    if isinstance(input, Tensor) and not input.is_eager:
        tracer = input.tracer
    if tracer is not None:
        raise UnsupportedOpError(f"torch.multinomial inside a traced forward (called in "
                                 f"{tracer.where()}) is not supported by stepgraph: sample "
                                 "from the model's output in the script (outside the step)")
    weights = np.asarray(input.numpy() if isinstance(input, Tensor) else input, np.float64)
    if weights.ndim not in (1, 2):
        raise RuntimeError("prob_dist must be 1 or 2 dim")
    rows = weights.reshape(-1, weights.shape[-1])
    if not np.isfinite(rows).all() or (rows < 0).any():
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
    if (rows.sum(1) <= 0).any():
        raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")
    if num_samples <= 0:
        raise RuntimeError("cannot sample n_sample <= 0 samples")
    if not replacement and num_samples > rows.shape[1]:
        raise RuntimeError("cannot sample n_sample > prob_dist.size(-1) samples without "
                           "replacement")
    if replacement:             # inverse CDF: the first category whose cumulative weight
        cdf = np.cumsum(rows, 1)    # exceeds a uniform draw of the row's total
        draws = rng.random((rows.shape[0], num_samples)) * cdf[:, -1:]
        drawn = np.stack([np.searchsorted(c, d, side="right") for c, d in zip(cdf, draws)])
        drawn = np.minimum(drawn, rows.shape[1] - 1)
    else:                       # the smallest Exp(1) / weight keys: sampling without
        with np.errstate(divide="ignore"):      # replacement in proportion to the weights;
            keys = rng.standard_exponential(rows.shape) / rows   # zero weights come last
        drawn = np.argsort(keys, axis=1, kind="stable")[:, :num_samples]
    return _place(drawn.reshape(*weights.shape[:-1], num_samples), "int64")


# ---- from data ------------------------------------------------------------------------------

def eye(n: int, m: int | None = None, *, dtype=None, device=None,
        requires_grad: bool = False) -> Tensor:
    """The n x m identity (m = n unless given)."""
    as_device(device)
    return _place(np.eye(n, n if m is None else m),
                  tensor_dtype(dtype or get_default_dtype(), "eye"))


def _data_dtype(data: np.ndarray) -> str:
    """torch's dtype for data from Python values: float -> float32, int -> int64."""
    if data.dtype.kind == "f":
        return get_default_dtype()
    return "bool" if data.dtype.kind == "b" else "int64"


def _data(data, dtype, device, what: str, copy: bool) -> Tensor:
    as_device(device)
    if isinstance(data, Tensor) and not data.is_eager:
        if dtype is not None and as_dtype(dtype) != data.dtype:
            raise UnsupportedOpError(f"torch.{what} of a traced tensor with another dtype: use "
                                     "its .to(dtype)")
        return data
    if isinstance(data, Tensor):
        array, dtype = np.asarray(data), tensor_dtype(dtype or data.dtype, what)
    elif isinstance(data, np.ndarray):
        array, dtype = data, tensor_dtype(dtype or data.dtype.name, what)
    else:
        array = np.asarray(data)
        dtype = tensor_dtype(dtype or _data_dtype(array), what)
    if not copy and current_tracer() is None and array.dtype == np.dtype(storage_dtype(dtype)) \
            and array.flags.c_contiguous:
        return tensor_of(array)
    return _place(np.array(array, copy=True), dtype)


def tensor(data, *, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    """A tensor holding a copy of `data` (numbers, nested lists, a NumPy array or a tensor):
    floats become float32, ints int64, bools bool, a NumPy array keeps its dtype."""
    return _data(data, dtype, device, "tensor", copy=True)


def as_tensor(data, dtype=None, device=None) -> Tensor:
    """As `tensor`, sharing a NumPy array's memory when no conversion is needed."""
    return _data(data, dtype, device, "as_tensor", copy=False)


def from_numpy(ndarray: np.ndarray) -> Tensor:
    """A tensor sharing `ndarray`'s memory (made contiguous if it is not)."""
    if not isinstance(ndarray, np.ndarray):
        raise TypeError(f"from_numpy: expected a numpy.ndarray, got {type(ndarray).__name__}")
    return _data(ndarray, None, None, "from_numpy", copy=False)


def arange(start=0, end=None, step=1, *, dtype=None, device=None,
           requires_grad: bool = False) -> Tensor:
    """start, start + step, ... below end (arange(end) starts at 0), as torch.arange: int64
    when every argument is an int, else float32. Inside a traced forward, 0..n-1 is an
    `arange` node, any other range a constant."""
    if end is None:
        start, end = 0, start
    as_device(device)
    ints = all(isinstance(v, numbers.Integral) for v in (start, end, step))
    dtype = tensor_dtype(dtype or ("int64" if ints else get_default_dtype()), "arange")
    if step == 0:
        raise ValueError("arange: step must be nonzero")
    n = max(0, math.ceil((end - start) / step))
    tracer = current_tracer()
    if tracer is not None and (start, step) == (0, 1) and dtype in ARANGE_DTYPES:
        return tracer.op("arange", [], n=int(n), dtype=str(dtype))
    return _place(start + step * np.arange(n, dtype=np.float64 if not ints else np.int64),
                  dtype)


def linspace(start, end, steps: int, *, dtype=None, device=None,
             requires_grad: bool = False) -> Tensor:
    """`steps` evenly spaced values from start to end inclusive (float32 unless `dtype`)."""
    as_device(device)
    return _place(np.linspace(start, end, int(steps)),
                  tensor_dtype(dtype or get_default_dtype(), "linspace"))


# ---- tensor predicates ----------------------------------------------------------------------

def is_tensor(obj) -> bool:
    """True for stepgraph tensors, traced or eager."""
    return isinstance(obj, Tensor)


def numel(input) -> int:
    """The number of elements of a tensor."""
    return input.numel()


__all__ = ["zeros", "ones", "empty", "full", "zeros_like", "ones_like", "empty_like",
           "full_like", "manual_seed", "randn", "rand", "randint", "rand_like", "randn_like",
           "randint_like", "bernoulli", "eye", "tensor", "as_tensor", "from_numpy", "arange",
           "linspace", "is_tensor", "numel", "Generator", "randperm", "default_generator",
           "initial_seed", "seed", "get_rng_state", "set_rng_state", "multinomial"]
