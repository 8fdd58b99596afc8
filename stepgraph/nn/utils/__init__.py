"""torch.nn.utils: gradient clipping for training scripts (clip_grad.py)."""
from .clip_grad import clip_grad_norm_, clip_grad_value_

__all__ = ["clip_grad_norm_", "clip_grad_value_"]


def __getattr__(name: str):
    """A torch.nn.utils name stepgraph lacks: UnsupportedOpError, an AttributeError."""
    from ...errors import lookup_torch_name
    return lookup_torch_name(__name__, "torch.nn.utils", name)
