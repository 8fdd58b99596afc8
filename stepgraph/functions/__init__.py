"""Torch-level functions (`torch.X` in a model file imported as `import stepgraph as torch`),
one module per area, each with `__all__`."""
from .tensors import *  # noqa: F401,F403
