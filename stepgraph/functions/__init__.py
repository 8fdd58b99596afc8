"""Torch-level functions (`torch.X` in a model file written as `import stepgraph as torch`),
one module per family, each with its `__all__`."""
from .math import *  # noqa: F401,F403
