"""Building a step's graph: trace the model, append the backward and the optimizer update."""
from __future__ import annotations

from contextlib import contextmanager

from ..autodiff import append_backward
from ..ir.graph import Graph
from ..ir.trace import Tracer
from ..nn.module import Module
from .feed import Signature
from .guard import emit_guard
from .history import emit_record_loss


@contextmanager
def _mode(model: Module, training: bool):
    before = [(m, m.training) for m in model.modules()]
    model.train(training)
    try:
        yield
    finally:
        for m, was in before:
            object.__setattr__(m, "training", was)


def _trace_inputs(tracer: Tracer, signature: Signature) -> list:
    return [tracer.input(s.shape, s.dtype, s.name) for s in signature]


def build_train_graph(model: Module, loss_fn, optimizer, signature: Signature, seed: int,
                      on_bad_batch: str = "ignore") -> Graph:
    """forward + loss + backward (+ guard) + update. The last feed entry is the loss target.
    on_bad_batch "raise" or "skip" adds the guard (compile/guard.py); "ignore" does not."""
    model.name_parameters()
    tracer = Tracer(seed=seed, training=True)
    *xs, target = _trace_inputs(tracer, signature)
    with _mode(model, True):
        out = model(*xs)
    loss = loss_fn(out, target)
    params = list(tracer.graph.params)
    grads = append_backward(tracer, loss.value, params)
    guard = emit_guard(tracer, on_bad_batch, loss.value, target.value, grads)
    optimizer.emit(tracer, params, grads, guard=guard)
    if guard is None:   # a guard records the loss itself, under its call counter
        emit_record_loss(tracer, loss.value)
    tracer.graph.outputs = {"loss": loss.value}
    return tracer.graph


def build_predict_graph(model: Module, signature: Signature) -> Graph:
    """The forward pass in eval mode (dropout off)."""
    model.name_parameters()
    tracer = Tracer(training=False)
    xs = _trace_inputs(tracer, signature)
    with _mode(model, False):
        out = model(*xs)
    tracer.graph.outputs = {"output": out.value}
    return tracer.graph
