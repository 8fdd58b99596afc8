"""Torch-level functions (`torch.X` in a model file written as `import stepgraph as torch`),
one module per family, each with its `__all__`; stepgraph/__init__.py re-exports them all."""
from .asserts import *  # noqa: F401,F403
from .factories import *  # noqa: F401,F403
from .grids import *  # noqa: F401,F403
from .math import *  # noqa: F401,F403
from .tensors import *  # noqa: F401,F403
