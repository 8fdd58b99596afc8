"""parameters_to_vector and vector_to_parameters, torch.nn.utils.convert_parameters's: a flat
view of a model's parameters (an eager tensor of their values outside a forward, a traced one
inside, through which gradients flow) and the way back, which writes the values into the
parameters' storage (`p.data = ...`, module.py `_Stored.assign`), so compiled steps see them."""
from __future__ import annotations

from ...errors import UnsupportedOpError
from ...functions.tensors import cat
from ...ir.trace import Tensor


def parameters_to_vector(parameters) -> Tensor:
    """The parameters flattened and joined in order into one 1-d tensor, as torch's."""
    return cat([p.view(-1) for p in parameters])


def vector_to_parameters(vec, parameters) -> None:
    """Write consecutive slices of the 1-d `vec` into the parameters, each reshaped to its
    parameter's shape, as torch's (`param.data = vec[i:i + n].view_as(param).data`); `vec`
    must hold values, so a traced tensor inside a forward is refused (a step changes its
    parameters only through its optimizer)."""
    if not isinstance(vec, Tensor):
        raise TypeError(f"expected torch.Tensor, but got: {type(vec).__module__}."
                        f"{type(vec).__qualname__}")
    if not vec.is_eager:
        raise UnsupportedOpError(
            f"torch.nn.utils.vector_to_parameters of a traced tensor (in "
            f"{vec.tracer.where()}) is not supported by stepgraph: a step changes its "
            "parameters only through its optimizer; call it outside forward")
    pointer = 0
    for param in parameters:
        n = param.numel()
        param.data = vec[pointer:pointer + n].reshape(*param.shape)
        pointer += n
