"""torch.utils.checkpoint: activation checkpointing (DenseNet's memory-efficient path).

`checkpoint(fn, *args)` runs `fn(*args)` where it is called, and in a traced train forward
marks every value computed inside but its result as recomputed: after autodiff, the `recompute` pass
(compile/recompute.py) gives the backward copies of the nodes that computed them, placed where
the backward first needs them, so the forward's copies die at their last forward use instead
of living until the backward, as torch's checkpoint trades compute for memory. The recomputed
values are bit for bit the forward's (the same ops on the same inputs; dropout draws the same
Philox mask from the same step counter and site), so `preserve_rng_state` and
`determinism_check` have nothing to change; `use_reentrant`, `context_fn` and `debug` are
accepted and change nothing either. Nodes that update state in place (BatchNorm's running
statistics) are not recomputed: their outputs are kept, as without checkpoint. Outside a
train trace (eager code, compile_predict) `fn` simply runs."""
from __future__ import annotations

from ..ir.trace import current_tracer


def checkpoint(function, *args, use_reentrant=None, context_fn=None,
               determinism_check: str = "default", debug: bool = False,
               early_stop: bool = True, preserve_rng_state: bool = True, **kwargs):
    """function(*args, **kwargs), its activations recomputed in the backward (module doc)."""
    tracer = current_tracer()
    if tracer is None or not tracer.training:
        return function(*args, **kwargs)
    start = len(tracer.graph.nodes)
    out = function(*args, **kwargs)
    kept = {t.value for t in _tensors(out)}     # what leaves the region is kept, as in torch
    tracer.recomputed.update(v for node in tracer.graph.nodes[start:] for v in node.outputs
                             if v not in kept)
    return out


def _tensors(out) -> list:
    """The tensors of a function's result: itself, or those in a tuple, list or dict."""
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        return [t for item in out for t in _tensors(item)]
    return [out] if hasattr(type(out), "is_eager") else []


def checkpoint_sequential(functions, segments: int, input, use_reentrant=None, **kwargs):
    """The modules of `functions` (a Sequential or a list) applied in order to `input`, in
    `segments` runs of about equal length, each but the last checkpointed (as torch's)."""
    functions = list(functions.children()) if hasattr(functions, "children") else \
        list(functions)
    if not 0 < segments <= max(len(functions), 1):
        raise ValueError(f"checkpoint_sequential: segments must be in [1, {len(functions)}], "
                         f"got {segments}")
    size = len(functions) // segments
    bounds = [i * size for i in range(segments)] + [len(functions)]

    def run(part):
        def forward(x):
            for f in part:
                x = f(x)
            return x
        return forward

    for i, (start, end) in enumerate(zip(bounds, bounds[1:])):
        part = functions[start:end]
        input = run(part)(input) if i == segments - 1 else checkpoint(run(part), input)
    return input
