"""torch.optim's loop methods on stepgraph's optimizers: zero_grad() and step() of a training
script (loop/session.py runs them). Kept apart from the update rules (optim/), which only
emit graph ops."""
from __future__ import annotations

from . import hooks             # imports nothing: no cycle through the optimizers


class LoopMethods:
    """zero_grad / step for an optimizer made with parameters, as torch's."""

    def _join_loop(self) -> None:
        """An optimizer made with parameters may drive a training script's loop."""
        hooks.session().register(self)

    def trained_parameters(self) -> list:
        """The Parameters this optimizer updates (none when it was made without them, for
        compile_train_step, which updates every parameter of the step)."""
        if getattr(self, "_implicit", False):
            return []
        return [p for g in self.param_groups for p in g["params"]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's: clear the gradients. A captured loop keeps no gradients between steps;
        backward() passes that no step() used are dropped (with a warning)."""
        if hooks.SESSION is not None:
            hooks.SESSION.zero_grad()

    def step(self, closure=None):
        """torch's: apply the update. In a training script this runs every backward() pass
        since the last step as one compiled step (forward, backward, update). closure (as
        torch's LBFGS-style optimizers take): called first, its loss returned."""
        loss = None
        if closure is not None:
            from ..grad_mode import enable_grad

            with enable_grad():
                loss = closure()
        hooks.session().step(self)
        return loss
