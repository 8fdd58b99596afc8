"""Op families: each module registers, per op, its shape rule (`defop`), its VJP (`vjp`)
and its NumPy reference (`impl`) in the registry (ir/ops.py), side by side. The CUDA
launchers live beside their kernels in backends/cuda/<family>.py. Importing this package
registers every family."""
from . import (activation, attention, bmm, cast, collective, compare, conv,  # noqa: F401
               dropout, elementwise, embedding, guard, index, layer_norm, linear, loss, norm,
               optim, pointwise, pool, random, reduce, reduce_axis, shape, softmax, unary)
from . import sync_batch_norm  # noqa: F401
from . import recurrent  # noqa: F401
from . import lstm_cell  # noqa: F401
