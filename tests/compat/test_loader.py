"""The compatibility loader rewrites torch import lines, and only those."""
from __future__ import annotations

import stepgraph
from tests.compat import loader


def test_import_lines_point_at_stepgraph():
    source = "\n".join([
        "import math",
        "import torch",
        "import torch.nn as nn",
        "import torch.nn.functional as F",
        "from torch.nn import functional as F",
        "from torch import nn",
        "import torch.nn",
        "    import torch as T",
        "x = torch.nn.Linear(2, 2)  # import torch",
        "import torchvision",
    ])
    assert loader.substitute_imports(source).splitlines() == [
        "import math",
        "import stepgraph as torch",
        "import stepgraph.nn as nn",
        "import stepgraph.nn.functional as F",
        "from stepgraph.nn import functional as F",
        "from stepgraph import nn",
        "import stepgraph as torch",
        "    import stepgraph as T",
        "x = torch.nn.Linear(2, 2)  # import torch",
        "import torchvision",
    ]


def test_a_model_file_loads_against_each_framework():
    import torch
    as_torch, as_stepgraph = loader.load("gpt", "torch"), loader.load("gpt", "stepgraph")
    assert as_torch.torch is torch and as_torch.nn is torch.nn
    assert as_stepgraph.torch is stepgraph and as_stepgraph.nn is stepgraph.nn
    assert as_stepgraph.F is stepgraph.nn.functional
    assert issubclass(as_stepgraph.GPT, stepgraph.nn.Module)
