"""Random tensors and the random in-place Tensor methods (torch.rand / randn / randint /
rand_like / randn_like / bernoulli inside forward, Tensor.bernoulli / bernoulli_ / uniform_ /
normal_ / exponential_), attached to Tensor when this module is imported
(stepgraph/__init__.py imports it).

Two sources, by where the tensor lives:
- an eager tensor (constructors, initialisation, scripts) draws from the host generator that
  module initialisation and the random factories share (`torch.manual_seed`, nn/init.py): the
  in-place methods are nn.init's (`normal_`, `uniform_`) and their kin;
- a traced tensor (inside a train forward) draws inside the step: a `random` node (uniform or
  standard normal draws from the step's Philox stream, ops/random.py) and ordinary elementwise
  ops after it. Every step draws fresh values, deterministically: the same in an eager CUDA
  run and in a replayed graph, and bit for bit the NumPy backend's (seen on an H200).
  torchvision's stochastic depth (`torch.empty(...).bernoulli_(1 - p).div_(1 - p)`) is one.
A predict trace (compile_predict) draws the same way from the predictor's own counter, which
its graph advances at every call (compile/build.py): fresh values each call, deterministic
given compile_predict(seed=...).
"""
from __future__ import annotations

import numbers

import numpy as np

from ..errors import UnsupportedOpError
from .tensor import Tensor, _is_scalar
from .trace import EAGER, current_tracer, tensor_of


def host_rng(generator, what: str) -> np.random.Generator:
    """The host generator (or `generator`, a numpy.random.Generator) for an eager draw;
    refused while a forward is traced: drawn once at trace time, the values would repeat
    every step."""
    from ..nn import init
    tracer = current_tracer()
    if tracer is not None:
        raise UnsupportedOpError(
            f"{what} of an eager tensor inside a traced forward is not supported by "
            f"stepgraph (called in {tracer.where()}): values drawn once at trace time would "
            "repeat every step; draw on a tensor of the forward (torch.empty(..., device="
            "x.device), x.new_empty(...), torch.rand_like(x)), which draws every step")
    return init._rng(generator)


def draw(tracer, kind: str, shape, what: str) -> Tensor:
    """float32 draws of `kind` ("uniform" on [0, 1), "normal") of `shape`: a `random` node of
    a train or predict trace, or host-generator values for the eager tracer."""
    shape = tuple(int(d) for d in shape)
    if tracer is EAGER:
        rng = host_rng(None, what)
        values = rng.random(shape) if kind == "uniform" else rng.standard_normal(shape)
        return tensor_of(np.asarray(values, np.float32))
    return tracer.op("random", [tracer.rng_step()], kind=kind, shape=shape, seed=tracer.seed,
                     site=tracer.next_dropout_site())


def _no_generator(t: Tensor, generator, what: str) -> None:
    if generator is not None and not t.is_eager:
        t._unsupported(f"{what}(generator=...) inside a forward (the step's draws come from "
                       "compile_train_step(seed=...) / compile_predict(seed=...))")


def _float_only(t: Tensor, what: str) -> None:
    if not t.dtype.is_floating_point:
        t._unsupported(f"{what} of a {t.dtype} tensor (floating point tensors only, as torch)")


def _drawn(self: Tensor, values: Tensor, what: str) -> Tensor:
    """This tensor holds `values` (float32 draws, transformed) cast to its dtype."""
    return self._assign(values._cast(self.dtype), what)


def uniform_(self: Tensor, a: float = 0.0, b: float = 1.0, *, generator=None,
             **bounds) -> Tensor:
    """Draws from U(a, b) in place (torch's `from` / `to` keywords also taken)."""
    a, b = bounds.pop("from", a), bounds.pop("to", b)
    if bounds:
        raise TypeError(f"uniform_: unexpected keyword arguments {sorted(bounds)}")
    _float_only(self, "Tensor.uniform_")
    if self.is_eager:
        from ..nn import init
        return init.uniform_(self, a, b, generator=host_rng(generator, "Tensor.uniform_"))
    _no_generator(self, generator, "Tensor.uniform_")
    u = draw(self.tracer, "uniform", self.shape, "Tensor.uniform_")
    return _drawn(self, u * float(b - a) + float(a), "Tensor.uniform_")


def normal_(self: Tensor, mean: float = 0.0, std: float = 1.0, *, generator=None) -> Tensor:
    """Draws from N(mean, std^2) in place (ViT's `torch.empty(1, n, d).normal_(std=0.02)`)."""
    _float_only(self, "Tensor.normal_")
    if self.is_eager:
        from ..nn import init
        return init.normal_(self, mean, std, generator=host_rng(generator, "Tensor.normal_"))
    _no_generator(self, generator, "Tensor.normal_")
    z = draw(self.tracer, "normal", self.shape, "Tensor.normal_")
    return _drawn(self, z * float(std) + float(mean), "Tensor.normal_")


def exponential_(self: Tensor, lambd: float = 1.0, *, generator=None) -> Tensor:
    """Draws from the exponential distribution of rate `lambd` in place: -log(1 - u) /
    lambd of a uniform u."""
    _float_only(self, "Tensor.exponential_")
    if self.is_eager:
        from ..nn import init
        rng = host_rng(generator, "Tensor.exponential_")
        return init._write(self, rng.exponential(1.0 / lambd, self.shape))
    _no_generator(self, generator, "Tensor.exponential_")
    u = draw(self.tracer, "uniform", self.shape, "Tensor.exponential_")
    return _drawn(self, (-u).log1p() * (-1.0 / float(lambd)), "Tensor.exponential_")


def _bernoulli(self: Tensor, p, shape, what: str, generator) -> Tensor:
    """Bool draws of `shape`: True with probability p (a number, or a tensor of
    probabilities broadcast to `shape`), as u < p of a uniform u."""
    if not _is_scalar(p):
        p = self._coerce(p, what)
    if self.is_eager and (_is_scalar(p) or p.is_eager):
        u = host_rng(generator, what).random(shape)
        return tensor_of(u < (float(p) if _is_scalar(p) else np.asarray(p.numpy(), np.float64)))
    _no_generator(self, generator, what)
    tracer = self.tracer if not self.is_eager else p.tracer
    u = draw(tracer, "uniform", shape, what)
    if _is_scalar(p):
        return u < float(p)
    return u < (p if p.dtype == "float32" else p.float())


def bernoulli_(self: Tensor, p=0.5, *, generator=None) -> Tensor:
    """1 with probability p (a number, or a tensor of probabilities broadcast to this
    shape), else 0, in place (torchvision's stochastic depth)."""
    return self._assign(_bernoulli(self, p, self.shape, "Tensor.bernoulli_",
                                   generator)._cast(self.dtype), "Tensor.bernoulli_")


def bernoulli(self: Tensor, p=None, *, generator=None) -> Tensor:
    """Draws of 1 with this tensor's values as probabilities (or with the number p), of
    this shape and dtype; no gradient, as torch's."""
    _float_only(self, "Tensor.bernoulli")
    return _bernoulli(self, self if p is None else p, self.shape, "Tensor.bernoulli",
                      generator)._cast(self.dtype)


def random_like(input, kind: str, what: str, dtype=None) -> Tensor:
    """Draws of `kind` of input's shape, in `dtype` (input's unless given)."""
    from ..dtypes import tensor_dtype
    if not isinstance(input, Tensor):
        input = tensor_of(np.asarray(input))
    dtype = str(tensor_dtype(dtype or input.dtype, what))
    return draw(input.tracer, kind, input.shape, what)._cast(dtype)


def randint_values(tracer, low: int, high: int, shape, dtype: str, what: str) -> Tensor:
    """Integers uniform on [low, high) drawn in the step: floor(u (high - low)) + low of a
    uniform u, in float64 (exact for ranges up to 2^24 values, u's resolution)."""
    if not (isinstance(low, numbers.Integral) and isinstance(high, numbers.Integral)
            and low < high):
        raise ValueError(f"{what}: expects integers low < high, got low={low}, high={high}")
    u = draw(tracer, "uniform", shape, what)
    return ((u.double() * float(high - low)).floor() + float(low))._cast(dtype)


def attach(cls: type) -> None:
    """Give Tensor the random methods of this module."""
    for fn in (uniform_, normal_, exponential_, bernoulli_, bernoulli):
        setattr(cls, fn.__name__, fn)


attach(Tensor)
