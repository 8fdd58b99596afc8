"""JAX: the whole training step (forward, loss, grad, optax update) in one jax.jit, with the
params/optimizer-state/BatchNorm-statistics/RNG carry donated so XLA updates it in place, as
JAX's docs recommend. The step is compiled ahead of time (`jit(...).lower(...).compile()`, the
same executable a first call would build) so its optimized HLO can be counted: kernels and
layout transposes per step. The vision models live in jax_vision.py (NHWC).

Dropout's keys come from the "rbg" PRNG (`jax_default_prng_impl`), the setting speed-minded JAX
training code uses: XLA's RNG bit generator instead of the default threefry hash, which costs
many integer instructions per random bit.
"""

from __future__ import annotations

import dataclasses
import functools
import os

# JAX would otherwise grab 75% of GPU memory at import and starve the peers that run after it.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402

from stepgraph.bench.peers import (  # noqa: E402
    KernelCensus,
    MemoryReading,
    PreparedStep,
    RunSpec,
    Unsupported,
)
from stepgraph.bench.census import hlo_census  # noqa: E402
from stepgraph.bench.peers import jax_gpt, jax_vision  # noqa: E402
from stepgraph.bench.workloads import (  # noqa: E402
    ConvNet,
    DenseNet,
    GPT,
    OptimizerSpec,
    PlainConvNet,
    ResNet,
    Workload,
)

MATMUL_PRECISION = {"fp32": "highest", "tf32": "tensorfloat32", "bf16": "default"}
PRNG_IMPL = "rbg"


def configure(precision: str) -> dict[str, str]:
    """Set JAX's global options for a run at `precision` (before anything is traced or a key
    is made); returns them, for the notes."""
    options = {"jax_default_matmul_precision": MATMUL_PRECISION[precision],
               "jax_default_prng_impl": PRNG_IMPL}
    for name, value in options.items():
        jax.config.update(name, value)
    return options


def _dropout(x, rate: float, key, mask_shape=None):
    """Inverted dropout; `mask_shape` (N, C, 1, 1) drops whole channels (Dropout2d)."""
    keep = jax.random.bernoulli(key, 1.0 - rate, mask_shape or x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros((), x.dtype))


def _dense_forward(model: DenseNet, params, x, key):
    activation = {"relu": jax.nn.relu, "gelu": functools.partial(jax.nn.gelu,
                                                                 approximate=False)}
    act = activation[model.activation]
    keys = jax.random.split(key, len(params))
    for (w, b), k in zip(params[:-1], keys):
        x = act(x @ w.T + b)
        if model.dropout > 0:
            x = _dropout(x, model.dropout, k)
    w, b = params[-1]
    return x @ w.T + b


def _conv(x, w, b):
    y = lax.conv_general_dilated(x, w, (1, 1), "VALID", dimension_numbers=("NCHW", "OIHW", "NCHW"))
    return y + b[None, :, None, None]


def _max_pool_2x2(x):
    # A Python -inf init value is what lets JAX recognise (and differentiate) a max-pool.
    return lax.reduce_window(x, -jnp.inf, lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")


def _conv_forward(model: ConvNet, params, x, key):
    (w1, b1), (w2, b2), (w3, b3), (w4, b4) = params
    k2d, k1d = jax.random.split(key)
    x = jax.nn.relu(_max_pool_2x2(_conv(x, w1, b1)))
    x = _conv(x, w2, b2)
    x = _dropout(x, model.dropout, k2d, (x.shape[0], x.shape[1], 1, 1))
    x = jax.nn.relu(_max_pool_2x2(x)).reshape(x.shape[0], -1)
    x = _dropout(jax.nn.relu(x @ w3.T + b3), model.dropout, k1d)
    return jax.nn.log_softmax(x @ w4.T + b4, axis=1)


def _loss(workload: Workload, outputs, y):
    outputs = outputs.astype(jnp.float32)
    if workload.loss == "cross_entropy" and workload.label_smoothing:
        # PyTorch's label smoothing: targets (1 - eps) * one_hot + eps / classes.
        targets = optax.smooth_labels(jax.nn.one_hot(y, outputs.shape[-1]),
                                      workload.label_smoothing)
        return optax.softmax_cross_entropy(outputs, targets).mean()
    if workload.loss == "cross_entropy":
        return optax.softmax_cross_entropy_with_integer_labels(outputs, y).mean()
    return -jnp.take_along_axis(outputs, y[:, None], axis=1).mean()  # nll_loss


def _matrices(params):
    """The weight-decay mask of nanoGPT's parameter groups: parameters of 2 or more dims."""
    return jax.tree_util.tree_map(lambda p: p.ndim >= 2, params)


def _optimizer(spec: OptimizerSpec) -> optax.GradientTransformation:
    if spec.max_grad_norm is not None:   # torch's clip_grad_norm_ before the update
        return optax.chain(optax.clip_by_global_norm(spec.max_grad_norm),
                           _optimizer(dataclasses.replace(spec, max_grad_norm=None)))
    if spec.kind == "adamw":
        return optax.adamw(spec.lr, b1=spec.betas[0], b2=spec.betas[1], eps=spec.eps,
                           weight_decay=spec.weight_decay,
                           mask=_matrices if spec.decay_matrices_only else None)
    if spec.kind == "sgd":
        sgd = optax.sgd(spec.lr, momentum=spec.momentum or None, nesterov=spec.nesterov)
        if not spec.weight_decay:
            return sgd
        # torch.optim.SGD adds weight_decay * p to the gradient before the momentum.
        return optax.chain(optax.add_decayed_weights(spec.weight_decay), sgd)
    raise ValueError(f"unknown optimizer kind {spec.kind!r}")


def _forward(workload: Workload):
    """forward(params, state, x, key) -> (outputs, new state) for the workload's model."""
    model = workload.model
    if isinstance(model, GPT):
        return lambda params, state, x, key: (jax_gpt.gpt_forward(model, params, x, key), state)
    if isinstance(model, ResNet):
        return lambda params, state, x, key: jax_vision.resnet_forward(model, params, state, x)
    if isinstance(model, PlainConvNet):
        return lambda params, state, x, key: jax_vision.plain_convnet_forward(workload, params,
                                                                              state, x)
    forward = _dense_forward if isinstance(model, DenseNet) else _conv_forward
    return lambda params, state, x, key: (forward(model, params, x, key), state)


def make_train_step(workload: Workload, precision: str):
    """The jitted step: (params, opt_state, bn_state, key), x, y -> (new carry, loss); carry
    donated."""
    forward = _forward(workload)
    optimizer = _optimizer(workload.optimizer)
    compute_dtype = jnp.bfloat16 if precision == "bf16" else jnp.float32

    def loss_fn(params, state, x, y, key):
        # bf16: float32 master params cast to bfloat16 for the compute; grads come back f32.
        cast = jax.tree_util.tree_map(lambda p: p.astype(compute_dtype), params)
        if not jnp.issubdtype(x.dtype, jnp.integer):   # token indices stay integers
            x = x.astype(compute_dtype)
        outputs, state = forward(cast, state, x, key)
        return _loss(workload, outputs, y), state

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(carry, x, y):
        params, opt_state, state, key = carry
        key, step_key = jax.random.split(key)
        (loss, state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, state, x, y,
                                                                           step_key)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, state, key), loss

    return optimizer, train_step


def _memory_reader(device):
    """Peak bytes from the device allocator's stats, when this peer raised the high-water mark."""
    stats = device.memory_stats()
    if not stats or "peak_bytes_in_use" not in stats:
        return lambda: None
    before_peak, before_use = stats["peak_bytes_in_use"], stats.get("bytes_in_use", 0)

    def read() -> MemoryReading | None:
        peak = device.memory_stats()["peak_bytes_in_use"]
        # The high-water mark cannot be reset; an earlier, larger peak hides this peer's.
        return MemoryReading(peak - before_use, "peak") if peak > before_peak else None

    return read


def _initial_carry(spec: RunSpec, optimizer, device):
    """(params, optimizer state, BatchNorm state, RNG key) on the device."""
    workload = spec.workload
    if isinstance(workload.model, GPT):
        params = jax.device_put(jax_gpt.initial_params(spec.parameters), device)
        state = {}
    elif isinstance(workload.model, (ResNet, PlainConvNet)):
        params = jax.device_put(jax_vision.initial_params(workload, spec.parameters), device)
        state = jax.device_put(jax_vision.initial_state(workload), device)
    else:
        params = jax.device_put([(p.weight, p.bias) for p in spec.parameters], device)
        state = {}
    key = jax.device_put(jax.random.PRNGKey(spec.seed), device)
    return params, optimizer.init(params), state, key


def _device_batches(spec: RunSpec, device):
    vision = isinstance(spec.workload.model, (ResNet, PlainConvNet))
    return [jax.device_put((jax_vision.to_nhwc(b.x) if vision else b.x, b.y), device)
            for b in spec.batches]


def prepare(spec: RunSpec) -> PreparedStep:
    """jax.jit of the whole step, compiled ahead of time; data and params placed on the
    device before timing."""
    vision = isinstance(spec.workload.model, (ResNet, PlainConvNet))
    if vision and spec.precision == "bf16":
        raise Unsupported("the vision workloads are timed in fp32 and tf32")
    device = jax.devices("gpu" if spec.device == "cuda" else "cpu")[0]
    options = configure(spec.precision)
    memory = _memory_reader(device)
    optimizer, train_step = make_train_step(spec.workload, spec.precision)
    carry = [_initial_carry(spec, optimizer, device)]
    batches = _device_batches(spec, device)
    compiled = train_step.lower(carry[0], *batches[0]).compile()

    def run_step(i: int):
        x, y = batches[i]
        carry[0], loss = compiled(carry[0], x, y)
        return loss

    def census() -> KernelCensus:
        return hlo_census(compiled.as_text())

    def close() -> None:
        carry.clear()
        batches.clear()
        jax.clear_caches()

    notes = [", ".join(f"{name}={value}" for name, value in options.items()),
             "optax.adamw/sgd; carry donated; compiled ahead of time"]
    if vision:
        notes.append("NHWC activations, HWIO kernels; inputs transposed on the host")
    if spec.precision == "bf16":
        notes.append("bf16: params/inputs cast to bfloat16 inside the step, float32 master "
                     "params, loss and optimizer state")
    return PreparedStep(run_step, lambda: jax.block_until_ready(carry[0]),
                        lambda loss: float(loss), memory, close, notes, census)
