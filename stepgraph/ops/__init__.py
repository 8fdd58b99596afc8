"""Op families: each module registers, per op, its shape rule (ir.ops.defop), its VJP
(autodiff.rules.vjp) and its NumPy reference (backends.numpy.kernels.impl), side by side.
The CUDA launchers live beside their kernels in backends/cuda/<family>.py. Importing this
package registers every family."""
from . import (attention, bmm, cast, collective, elementwise, embedding,  # noqa: F401
               guard, index, layer_norm, norm, pointwise, pool, reduce_axis, shape,
               softmax)
