"""torch.autograd as model files use it: `Variable` (pre-0.4 code wraps tensors in it) and
the grad-mode context managers torch also exports here.

Since torch 0.4 `Variable(t)` returns `t` itself and every tensor is a Variable; here too:
`Variable(t)` is `t` (array-likes become tensors) and `isinstance(x, Variable)` holds for every
stepgraph tensor. Everything else of torch.autograd (`grad`, `backward`, `Function`,
`functional`, anomaly detection) computes or customises gradients in Python, which a compiled
step derives from the loss itself: refused (UnsupportedOpError, an AttributeError) with the
way to train instead."""
from __future__ import annotations

from .grad_mode import enable_grad, inference_mode, no_grad, set_grad_enabled  # noqa: F401
from .ir.trace import Tensor


class _VariableMeta(type):
    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, Tensor)


class Variable(metaclass=_VariableMeta):
    """torch.autograd.Variable(data, requires_grad=False, volatile=False): `data` itself (a
    tensor), or a tensor of it; requires_grad and volatile change nothing (gradients are
    derived from the loss at compile time)."""

    def __new__(cls, data, requires_grad: bool = False, volatile: bool = False):
        if isinstance(data, Tensor):
            return data
        from .functions.factories import tensor
        return tensor(data)


def __getattr__(name: str):
    """A torch.autograd name stepgraph lacks: UnsupportedOpError naming the alternative."""
    from .errors import missing_torch_name
    if name.startswith("_"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    raise missing_torch_name(f"torch.autograd.{name}")
