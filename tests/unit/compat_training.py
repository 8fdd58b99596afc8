"""A compatibility file (tests/compat/models/) trained a few steps on NumPy from torch's
initial weights: the plan and what the steps gave, for tests that compare a pass on and off
bit for bit."""
from __future__ import annotations

import numpy as np

import stepgraph


def torch_state(name: str, cls: str, kw: dict) -> dict:
    """The initial state_dict (NumPy) torch's model of the file makes after manual_seed(0)."""
    import torch

    from tests.compat import loader

    torch.manual_seed(0)
    model = getattr(loader.load(name, "torch"), cls)(**kw)
    return {k: v.numpy() for k, v in model.state_dict().items()}


def train_steps(name: str, cls: str, kw: dict, state: dict, batches: list, loss=None,
                **options):
    """(plan, losses, parameters): the file's model loaded with `state`, compiled on the CPU
    with momentum SGD and `options` (precision, memory_format, ...), stepped once per batch."""
    from tests.compat import loader

    model = getattr(loader.load(name, "stepgraph"), cls)(**kw)
    model.load_state_dict(state)
    step = stepgraph.compile_train_step(
        model, loss, stepgraph.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        example_inputs=batches[0], device="cpu", **options)
    plan = step.plan(step.signature)
    losses = [float(step(*b)) for b in batches]
    return plan, losses, {k: np.asarray(v).copy() for k, v in model.state_dict().items()}
