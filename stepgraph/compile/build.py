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
from .autocast import PRECISION as BF16_PRECISION
from .autocast import as_float32, autocast, bind_weight_copies
from .layout import apply_memory_format


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
                      on_bad_batch: str = "ignore", memory_format: str = "contiguous",
                      precision: str = "fp32") -> Graph:
    """forward + loss + backward (+ guard) + update. The last feed entry is the loss target.
    on_bad_batch "raise" or "skip" adds the guard (compile/guard.py); "ignore" does not.
    memory_format "channels_last" lays the forward's image tensors out NHWC before autodiff
    (compile/layout.py); "contiguous" keeps them NCHW; "auto" decides by the model
    (layout.channels_last_pays). precision "bf16" autocasts the forward
    before autodiff and has the update write the weights' bf16 copies (compile/autocast.py)."""
    model.name_parameters()
    tracer = Tracer(seed=seed, training=True)
    *xs, target = _trace_inputs(tracer, signature)
    with _mode(model, True):
        out = model(*xs)
    loss = loss_fn(out, target)
    tracer.graph = apply_memory_format(tracer.graph, memory_format)
    bf16 = precision == BF16_PRECISION
    if bf16:
        autocast(tracer.graph)
    params = list(tracer.graph.params)
    grads = append_backward(tracer, loss.value, params)
    copies = bind_weight_copies(tracer.graph) if bf16 else None
    guard = emit_guard(tracer, on_bad_batch, loss.value, target.value, grads)
    optimizer.emit(tracer, params, grads, guard=guard, weight_copies=copies)
    if guard is None:   # a guard records the loss itself, under its call counter
        emit_record_loss(tracer, loss.value)
    tracer.graph.outputs = {"loss": loss.value}
    return tracer.graph


def build_predict_graph(model: Module, signature: Signature,
                        memory_format: str = "contiguous", precision: str = "fp32") -> Graph:
    """The forward pass in eval mode (dropout off); memory_format and precision as
    build_train_graph's (a bf16 output is returned as float32)."""
    model.name_parameters()
    tracer = Tracer(training=False)
    xs = _trace_inputs(tracer, signature)
    with _mode(model, False):
        out = model(*xs)
    tracer.graph.outputs = {"output": out.value}
    graph = tracer.graph
    graph = apply_memory_format(graph, memory_format)
    if precision == BF16_PRECISION:
        autocast(graph)
        graph.outputs["output"] = as_float32(graph, graph.outputs["output"])
    return graph
