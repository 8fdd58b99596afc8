"""torch.utils as training scripts and model files use it: `torch.utils.data` (datasets,
samplers, DataLoader) and `torch.utils.checkpoint` (imported on first use). A torch.utils
name stepgraph lacks raises UnsupportedOpError (an AttributeError)."""
from . import data


def __getattr__(name: str):
    """A submodule not imported yet, else UnsupportedOpError naming torch.utils.<name>."""
    from ..errors import lookup_torch_name
    return lookup_torch_name(__name__, "torch.utils", name)
