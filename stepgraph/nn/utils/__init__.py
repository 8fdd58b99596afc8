"""torch.nn.utils: gradient clipping for training scripts (clip_grad.py), parameters to and
from one vector (convert_parameters.py)."""
from .clip_grad import clip_grad_norm_, clip_grad_value_
from .convert_parameters import parameters_to_vector, vector_to_parameters

__all__ = ["clip_grad_norm_", "clip_grad_value_", "parameters_to_vector",
           "vector_to_parameters"]


def __getattr__(name: str):
    """A torch.nn.utils name stepgraph lacks: UnsupportedOpError, an AttributeError."""
    from ...errors import lookup_torch_name
    return lookup_torch_name(__name__, "torch.nn.utils", name)
