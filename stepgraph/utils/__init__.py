"""torch.utils as training scripts use it: `torch.utils.data` (datasets, samplers, DataLoader).
A torch.utils name stepgraph lacks raises UnsupportedOpError (an AttributeError)."""
from . import data


def __getattr__(name: str):
    """A torch.utils name stepgraph lacks: UnsupportedOpError, which is an AttributeError."""
    from ..errors import lookup_torch_name
    return lookup_torch_name(__name__, "torch.utils", name)
