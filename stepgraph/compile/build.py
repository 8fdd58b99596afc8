"""Building a step's graph: trace the model, append the backward and the optimizer update."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from ..autodiff import append_backward
from ..ir.graph import Graph, Node, Value
from ..ir.ops import OPS
from ..errors import LossSelectionError, NothingToTrainError, PlanError
from ..ir.trace import Tensor, Tracer
from ..nn.module import Module
from .feed import Signature
from .guard import emit_guard
from .history import emit_record_loss
from .autocast import PRECISION as BF16_PRECISION
from .autocast import LOW_DTYPES, as_float32, autocast, bind_weight_copies
from .weight_permutes import bind_permuted_weights
from .attention_rewrite import masks_supported, rewrite_attention
from .cross_entropy_rewrite import rewrite_cross_entropy
from .layout import apply_memory_format
from .norm_rewrite import rewrite_norms
from .loss_scale import LossScaling, emit_scale_update, unscale_gradients
from .recompute import recompute
from .zeros import fold_zeros


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


@dataclass(frozen=True)
class ModelLoss:
    """compile_train_step(loss=None): the model computes its own loss, returned by forward as
    a scalar, as one entry of a tuple or list (`index`; None: the only scalar entry, e.g.
    nanoGPT's (logits, loss)), or as the entry `key` of a dict."""

    index: int | None = None
    key: str = "loss"

    def pick(self, out) -> Tensor:
        if isinstance(out, dict):
            if self.key not in out:
                raise LossSelectionError(f"the model returned a dict without the loss key "
                                         f"{self.key!r} (keys {list(out)}); pass loss_key=")
            return self._scalar(out[self.key], f"entry {self.key!r}")
        if isinstance(out, (tuple, list)):
            if self.index is not None:
                return self._scalar(out[self.index], f"entry {self.index}")
            scalars = [i for i, t in enumerate(out) if isinstance(t, Tensor) and t.shape == ()]
            if len(scalars) != 1:
                raise LossSelectionError(
                    f"the model returned {len(out)} entries with scalar tensors at "
                    f"{scalars}: pass loss_index= to say which is the loss")
            return out[scalars[0]]
        return self._scalar(out, "output")

    @staticmethod
    def _scalar(t, what: str) -> Tensor:
        if not isinstance(t, Tensor) or t.shape != ():
            got = f"shape {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
            raise LossSelectionError(f"the model's {what} is not a scalar loss tensor (got "
                                     f"{got}); with loss=None forward must return the loss")
        return t


class ModuleValues:
    """known(v) of compile/attention_rewrite.py for one model: the host values of the buffer
    (or frozen parameter) a `state` value stands for, read when the step is compiled, each
    kept with the version its array had then. `check` (before every call of a compiled step)
    refuses to run once one of them was given other values (load_state_dict, `.data =`): the
    step folded the old ones in (a causal mask)."""

    def __init__(self, model: Module):
        self.model = model
        self.read: dict[str, tuple] = {}        # name -> (stored, version, values read)

    def __call__(self, v: Value):
        stored = {**dict(self.model.named_parameters()), **dict(self.model.named_buffers())}
        held = stored.get(v.name)
        if held is None:
            return None
        values = np.array(held.numpy(), copy=True)
        self.read[v.name] = (held, held.version, values)
        return values

    def check(self) -> None:
        for name, (held, version, values) in list(self.read.items()):
            if held.version == version:
                continue
            if not np.array_equal(held.numpy(), values):
                raise PlanError(f"{name} was given new values after the step was compiled, "
                                "which folded its old ones in (a hand-written attention mask, "
                                "compile/attention_rewrite.py): compile the step again, or "
                                "set STEPGRAPH_ATTENTION_REWRITE=0 before compiling")
            self.read[name] = (held, held.version, values)


def rewrite_forward_attention(graph: Graph, model: Module, device: str | None,
                              kept: tuple = (), values: ModuleValues | None = None) -> Graph:
    """The traced forward with hand-written attention as sdpa (compile/attention_rewrite.py);
    masks other than causal become sdpa inputs only on devices whose sdpa takes them. values:
    the step's ModuleValues (a fresh one, unchecked, without)."""
    known = ModuleValues(model) if values is None else values
    return rewrite_attention(graph, known, masks_supported(device), kept)


def rewrite_train_forward(graph: Graph, model: Module, device: str | None, loss: tuple,
                          recomputed: tuple, values: ModuleValues | None, memory_format: str,
                          precision: str) -> Graph:
    """The passes a training forward goes through before autodiff, in their order: attention
    and cross-entropy written by hand as the fused ops, the memory format, zeros folded,
    autocast, fused norms. `loss`: () or the loss Value, kept by the rewrites with the
    checkpointed values `recomputed`. Shared by build_train_graph and a captured loop's
    forward evaluated ahead of its step (loop/early.py), so both compute the same numbers."""
    graph = rewrite_forward_attention(graph, model, device, loss, values)
    graph = rewrite_cross_entropy(graph, (*loss, *recomputed))
    graph = apply_memory_format(graph, memory_format)
    graph = fold_zeros(graph, (*loss, *recomputed))
    if precision in LOW_DTYPES:
        autocast(graph, LOW_DTYPES[precision])
    return rewrite_norms(graph, loss)


def build_train_graph(model: Module, loss_fn, optimizer, signature: Signature, seed: int,
                      on_bad_batch: str = "ignore", memory_format: str = "contiguous",
                      precision: str = "fp32", frozen: frozenset = frozenset(),
                      extra_outputs: dict | None = None, grad_hook=None,
                      device: str | None = None, values: ModuleValues | None = None,
                      loss_scaling: LossScaling | None = None,
                      permuted_weights: bool = True) -> Graph:
    """forward + loss + backward (+ guard) + update. The last feed entry is the loss target,
    or with loss_fn a ModelLoss the model's last argument (it computes the loss itself).
    on_bad_batch "raise" or "skip" adds the guard (compile/guard.py); "ignore" does not.
    memory_format "channels_last" lays the forward's image tensors out NHWC before autodiff
    (compile/layout.py); "contiguous" keeps them NCHW; "auto" decides by the model
    (layout.channels_last_pays). precision "bf16" autocasts the forward
    before autodiff and has the update write the weights' bf16 copies (compile/autocast.py);
    "fp16" autocasts to float16 (each weight cast in the forward, as torch's autocast does).
    Before autocast, hand-written cross-entropy becomes the fused op
    (compile/cross_entropy_rewrite.py). After autocast, residual adds into LayerNorms and
    hand-written RMSNorms become fused ops (compile/norm_rewrite.py), so autodiff sees them
    whole.
    frozen: ids of the Parameters traced as constant `state` inputs (no gradient, no update).
    extra_outputs: a dict the forward fills with more outputs of the step (name -> Value: the
    values a captured loop keeps for the script, loop/step.py); they are outputs before the
    layout and precision passes, so those passes keep them readable. grad_hook(tracer, params,
    grads) -> grads: a rewrite of the gradients before the update (clip_grad_value_).
    device: where the step runs ("cpu", "cuda"; None: unknown), which decides the masks the
    attention rewrite hands to sdpa, values the step's ModuleValues (rewrite_forward_attention).
    loss_scaling: a GradScaler's (compile/loss_scale.py): the loss is already scaled (the
    script's scaler.scale), the gradients are unscaled before grad_hook, clipping and the
    guard (on_bad_batch "skip"), and the scale moves after the update. permuted_weights: a
    channels-last step's float32 conv weights become copies the update writes transposed
    (compile/weight_permutes.py); off where the update does not write every parameter (a
    sharded optimizer's, compile/distribute.py)."""
    model.name_parameters()
    tracer = Tracer(seed=seed, training=True, frozen=frozen)
    inputs = _trace_inputs(tracer, signature)
    target = inputs[-1]          # the labels a guard checks, where a loss reads them as such
    with _mode(model, True):
        if isinstance(loss_fn, ModelLoss):
            loss = loss_fn.pick(model(*inputs))
        else:
            out = model(*inputs[:-1])
            loss = loss_fn(out, target)
    tracer.graph.outputs = dict(extra_outputs or {})
    tracer.graph = rewrite_train_forward(tracer.graph, model, device, (loss.value,),
                                         tuple(tracer.recomputed), values, memory_format,
                                         precision)
    bf16 = precision == BF16_PRECISION
    params = list(tracer.graph.params)
    if not params:
        raise NothingToTrainError(_nothing_to_train(model))
    n_forward = len(tracer.graph.nodes)
    grads = append_backward(tracer, loss.value, params)
    if tracer.recomputed:       # torch.utils.checkpoint regions: recomputed in the backward
        recompute(tracer.graph, tracer.recomputed, n_forward)
    if loss_scaling is not None:
        grads = unscale_gradients(tracer, loss_scaling, grads)
    if grad_hook is not None:
        grads = grad_hook(tracer, params, grads)
    copies = bind_weight_copies(tracer.graph) if bf16 else []
    if permuted_weights:
        copies += bind_permuted_weights(tracer.graph, {c.param for c in copies})
    guard = emit_guard(tracer, on_bad_batch, loss.value, target.value, grads,
                       loss_scaled=loss_scaling is not None)
    optimizer.emit(tracer, params, grads, guard=guard, weight_copies=copies)
    if loss_scaling is not None:
        emit_scale_update(tracer, loss_scaling, guard)
    if guard is None:   # a guard records the loss itself, under its call counter
        emit_record_loss(tracer, loss.value)
    tracer.graph.outputs = {**tracer.graph.outputs, "loss": loss.value}
    return tracer.graph


def _nothing_to_train(model: Module) -> str:
    """Why a model's loss depends on no trainable parameter, and what to change."""
    named = list(model.named_parameters())
    trainable = [k for k, p in named if p.requires_grad]
    if not named:
        return ("nothing to train: the model has no parameters; give it a layer with weights "
                "(nn.Linear, nn.Conv2d, ...) that its output depends on")
    if not trainable:
        return (f"nothing to train: all {len(named)} parameters of the model have "
                "requires_grad=False; set requires_grad=True on those to train")
    shown = ", ".join(trainable[:3]) + (", ..." if len(trainable) > 3 else "")
    return (f"nothing to train: the loss depends on none of the model's {len(trainable)} "
            f"trainable parameters ({shown}); forward must compute its output from them")


# The predictor's own random counter (a `state` value bound by Predictor): what dropout with
# training=True and random draws read in a predict graph, advanced by the graph at each call.
PREDICT_RNG_KEY = "predict.rng_step"


def predict_tracer(seed: int = 0) -> Tracer:
    """The tracer of an eval-mode forward: its random draws read PREDICT_RNG_KEY."""
    return Tracer(seed=seed, training=False, rng_key=PREDICT_RNG_KEY)


def advance_predict_rng(tracer: Tracer) -> None:
    """A step_increment of the predictor's counter as the first node of a predict graph that
    draws (F.dropout(x, p, training=True), torch.rand, ...), so every call, a replayed CUDA
    graph's too, draws fresh values without a host write; a graph that draws nothing is left
    as it is."""
    counter = tracer.rng_counter
    if counter is None:
        return
    attrs: dict = {}
    tracer.graph.nodes.insert(0, Node("step_increment", [counter], [], attrs,
                                      OPS["step_increment"].mutates(attrs), "predict rng"))


def build_predict_graph(model: Module, signature: Signature,
                        memory_format: str = "contiguous", precision: str = "fp32",
                        seed: int = 0, device: str | None = None,
                        values: ModuleValues | None = None) -> Graph:
    """The forward pass in eval mode (nn.Dropout off, as its module's training flag is False;
    a dropout asked for with training=True and random draws read the predictor's counter,
    advance_predict_rng); memory_format, precision and device as build_train_graph's (a bf16
    output is returned as float32)."""
    model.name_parameters()
    tracer = predict_tracer(seed)
    xs = _trace_inputs(tracer, signature)
    with _mode(model, False):
        out = model(*xs)
    advance_predict_rng(tracer)
    tracer.graph.outputs = {"output": _predicted(out).value}
    graph = rewrite_forward_attention(tracer.graph, model, device, values=values)
    graph = rewrite_cross_entropy(graph)
    graph = fold_zeros(apply_memory_format(graph, memory_format))
    if precision in LOW_DTYPES:
        autocast(graph, LOW_DTYPES[precision])
    graph = rewrite_norms(graph)
    if precision == BF16_PRECISION:        # float16 outputs stay float16, as torch's
        graph.outputs["output"] = as_float32(graph, graph.outputs["output"])
    return graph


def _predicted(out) -> Tensor:
    """What a predict step returns: the output, or of a tuple or list the one tensor that is
    not None (nanoGPT's (logits, None) when called without targets)."""
    if isinstance(out, (tuple, list)):
        tensors = [t for t in out if t is not None]
        if len(tensors) != 1 or not isinstance(tensors[0], Tensor):
            raise LossSelectionError(f"compile_predict: the model returned {len(out)} entries, "
                                     f"{len(tensors)} not None; one output tensor is needed")
        return tensors[0]
    return out
