"""JAX: the whole training step (forward, loss, grad, optax update) in one jax.jit, with the
params/optimizer-state/RNG carry donated so XLA updates it in place, as JAX's docs recommend.
"""

from __future__ import annotations

import functools
import os

# JAX would otherwise grab 75% of GPU memory at import and starve the peers that run after it.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402

from stepgraph.bench.peers import MemoryReading, PreparedStep, RunSpec  # noqa: E402
from stepgraph.bench.workloads import ConvNet, DenseNet, OptimizerSpec, Workload  # noqa: E402

MATMUL_PRECISION = {"fp32": "highest", "tf32": "tensorfloat32", "bf16": "default"}


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
    if workload.loss == "cross_entropy":
        return optax.softmax_cross_entropy_with_integer_labels(outputs, y).mean()
    return -jnp.take_along_axis(outputs, y[:, None], axis=1).mean()  # nll_loss


def _optimizer(spec: OptimizerSpec) -> optax.GradientTransformation:
    if spec.kind == "adamw":
        return optax.adamw(spec.lr, b1=spec.betas[0], b2=spec.betas[1], eps=spec.eps,
                           weight_decay=spec.weight_decay)
    if spec.kind == "sgd":
        if spec.weight_decay:
            raise ValueError("SGD weight decay is not wired for the JAX peer")
        return optax.sgd(spec.lr, momentum=spec.momentum or None)
    raise ValueError(f"unknown optimizer kind {spec.kind!r}")


def make_train_step(workload: Workload, precision: str):
    """The jitted step: (params, opt_state, key), x, y -> (new carry, loss); carry donated."""
    forward = _dense_forward if isinstance(workload.model, DenseNet) else _conv_forward
    optimizer = _optimizer(workload.optimizer)
    compute_dtype = jnp.bfloat16 if precision == "bf16" else jnp.float32

    def loss_fn(params, x, y, key):
        # bf16: float32 master params cast to bfloat16 for the compute; grads come back f32.
        cast = jax.tree_util.tree_map(lambda p: p.astype(compute_dtype), params)
        return _loss(workload, forward(workload.model, cast, x.astype(compute_dtype), key), y)

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(carry, x, y):
        params, opt_state, key = carry
        key, step_key = jax.random.split(key)
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y, step_key)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, key), loss

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


def prepare(spec: RunSpec) -> PreparedStep:
    """jax.jit of the whole step, data and params placed on the device before timing."""
    device = jax.devices("gpu" if spec.device == "cuda" else "cpu")[0]
    jax.config.update("jax_default_matmul_precision", MATMUL_PRECISION[spec.precision])
    memory = _memory_reader(device)
    optimizer, train_step = make_train_step(spec.workload, spec.precision)
    params = jax.device_put([(p.weight, p.bias) for p in spec.parameters], device)
    carry = [(params, optimizer.init(params), jax.device_put(jax.random.PRNGKey(spec.seed),
                                                             device))]
    batches = [jax.device_put((b.x, b.y), device) for b in spec.batches]

    def run_step(i: int):
        x, y = batches[i]
        carry[0], loss = train_step(carry[0], x, y)
        return loss

    def close() -> None:
        carry.clear()
        batches.clear()
        jax.clear_caches()

    notes = [f"jax_default_matmul_precision={MATMUL_PRECISION[spec.precision]}",
             "optax.adamw/sgd; carry donated"]
    if spec.precision == "bf16":
        notes.append("bf16: params/inputs cast to bfloat16 inside the step, float32 master "
                     "params, loss and optimizer state")
    return PreparedStep(run_step, lambda: jax.block_until_ready(carry[0]),
                        lambda loss: float(loss), memory, close, notes)
