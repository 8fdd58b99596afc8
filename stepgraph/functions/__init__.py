"""Torch-level functions (`torch.X` in a model file written as `import stepgraph as torch`),
one module per family; stepgraph/__init__.py re-exports them all."""
from .factories import *  # noqa: F401,F403
