"""The vision workloads (`resnet`, `convnet`) in plain JAX for the JAX peer:
lax.conv_general_dilated convolutions and a train-mode BatchNorm whose running statistics are
returned, not mutated.

Layout: NHWC activations and HWIO kernels, Flax's convention and the natural one for XLA's GPU
convolutions (cuDNN's tensor-core kernels are NHWC). XLA's layout assignment still picks the
physical layout of every buffer itself; writing the model NHWC means the logical layout already
agrees with it. The shared batches (NCHW) are transposed once on the host before timing, as a
NHWC data pipeline would hand them over, and the shared OIHW weights are transposed at load.

Parameters are a dict keyed by PyTorch's state_dict names ("layer1.0.conv1.weight"), BatchNorm
running statistics a second dict ("layer1.0.bn1.running_mean"); num_batches_tracked is left out,
as it changes nothing when the momentum is set.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from stepgraph.bench.workloads import (
    LayerParams,
    PlainConvNet,
    ResNet,
    Workload,
    layer_shapes,
    named_parameters,
    plain_convnet_layers,
    resnet_blocks,
)


def to_nhwc(x: np.ndarray) -> np.ndarray:
    """(N, C, H, W) images as a contiguous (N, H, W, C) array."""
    return np.ascontiguousarray(x.transpose(0, 2, 3, 1))


def initial_params(workload: Workload, parameters: list[LayerParams]) -> dict[str, np.ndarray]:
    """The shared parameters, conv kernels OIHW -> HWIO. The convnet's Linear after Flatten gets
    its input features reordered from (C, H, W) to (H, W, C), the order NHWC flattens in, so the
    network computes the same function as the PyTorch one."""
    params = {}
    for key, value in named_parameters(parameters).items():
        params[key] = np.ascontiguousarray(value.transpose(2, 3, 1, 0)) if value.ndim == 4 \
            else value
    model = workload.model
    if isinstance(model, PlainConvNet):
        layers = plain_convnet_layers(model, workload.sample_shape)
        fc = next(layer for layer in layers if layer.kind == "linear")
        channels = model.stages[-1][-1]
        side = int(round((fc.in_features // channels) ** 0.5))
        weight = params[f"{fc.index}.weight"].reshape(fc.out_features, channels, side, side)
        params[f"{fc.index}.weight"] = np.ascontiguousarray(
            weight.transpose(0, 2, 3, 1).reshape(fc.out_features, -1))
    return params


def initial_state(workload: Workload) -> dict[str, np.ndarray]:
    """BatchNorm running statistics at PyTorch's start values (mean 0, variance 1)."""
    state = {}
    for shape in layer_shapes(workload):
        if shape.kind == "batchnorm":
            state[f"{shape.name}.running_mean"] = np.zeros(shape.weight, np.float32)
            state[f"{shape.name}.running_var"] = np.ones(shape.weight, np.float32)
    return state


def _conv(x, w, stride: int = 1, padding: int = 1):
    return lax.conv_general_dilated(x, w, (stride, stride), [(padding, padding)] * 2,
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _batch_norm(x, params, state, new_state, name: str, model: ResNet):
    """Train-mode BatchNorm2d over (N, H, W), PyTorch semantics: normalise with the batch's
    biased variance, update the running variance with the unbiased one. Statistics in float32."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=(0, 1, 2))
    var = jnp.mean(jnp.square(xf - mean), axis=(0, 1, 2))
    scale = params[f"{name}.weight"].astype(jnp.float32) * lax.rsqrt(var + model.bn_eps)
    shift = params[f"{name}.bias"].astype(jnp.float32) - mean * scale
    count = x.size // x.shape[-1]
    m = model.bn_momentum
    mean, var = lax.stop_gradient(mean), lax.stop_gradient(var)
    new_state[f"{name}.running_mean"] = (1 - m) * state[f"{name}.running_mean"] + m * mean
    new_state[f"{name}.running_var"] = ((1 - m) * state[f"{name}.running_var"]
                                        + m * var * (count / (count - 1)))
    return (xf * scale + shift).astype(x.dtype)


def resnet_forward(model: ResNet, params, state, x):
    """Logits and the updated running statistics of one train-mode forward pass (NHWC)."""
    new_state: dict = {}

    def conv_bn(x, conv: str, bn: str, stride: int = 1, padding: int = 1):
        return _batch_norm(_conv(x, params[f"{conv}.weight"], stride, padding), params, state,
                           new_state, bn, model)

    x = jax.nn.relu(conv_bn(x, "conv1", "bn1"))
    for block in resnet_blocks(model):
        name = block.name
        out = jax.nn.relu(conv_bn(x, f"{name}.conv1", f"{name}.bn1", block.stride))
        out = conv_bn(out, f"{name}.conv2", f"{name}.bn2")
        shortcut = x
        if block.downsample:
            shortcut = conv_bn(x, f"{name}.downsample.0", f"{name}.downsample.1", block.stride,
                               padding=0)
        x = jax.nn.relu(out + shortcut)
    x = jnp.mean(x, axis=(1, 2))
    return x @ params["fc.weight"].T + params["fc.bias"], new_state


def _max_pool_2x2(x):
    # A Python -inf init value is what lets JAX recognise (and differentiate) a max-pool.
    return lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


def plain_convnet_forward(workload: Workload, params, state, x):
    """Logits of the convnet (NHWC); it has no running state."""
    for layer in plain_convnet_layers(workload.model, workload.sample_shape):
        key = str(layer.index)
        if layer.kind == "conv":
            x = _conv(x, params[f"{key}.weight"]) + params[f"{key}.bias"]
        elif layer.kind == "relu":
            x = jax.nn.relu(x)
        elif layer.kind == "maxpool":
            x = _max_pool_2x2(x)
        elif layer.kind == "flatten":
            x = x.reshape(x.shape[0], -1)
        else:
            x = x @ params[f"{key}.weight"].T + params[f"{key}.bias"]
    return x, state
