"""torch._assert: the assert statement as a function (torchvision's shape checks).

The condition of a traced program's asserts is a Python bool computed from shapes (`x.dim()
== 3`, `h == self.image_size`): checked when the forward is traced, which is when those
shapes are known (a new batch shape is traced again), and nothing is recorded in the graph.
A condition that is a traced tensor has no value at trace time: it is accepted and not checked
(checking it each step would need the device to report back to the host); an eager tensor's
value is checked at once."""
from __future__ import annotations

__all__ = ["_assert"]


def _assert(condition, message):
    """AssertionError(message) where `condition` (a bool, a number or an eager tensor) is
    false; a traced tensor condition is not checked (module doc)."""
    if getattr(condition, "is_eager", True) is False:
        return
    assert condition, message
