"""New tensors made from a tensor: new_full / new_zeros / new_ones / new_empty / new_tensor
(its dtype unless given) and clone. Attached to Tensor when this module is imported
(ir/tensor.py `attach_methods`).
"""
from __future__ import annotations

import numpy as np

from .graph import BF16, storage_dtype
from .tensor import Tensor, _shape_args, attach_methods
from .trace import tensor_of


class _NewMethods:
    """Tensor's new tensors (module doc)."""

    # ---- new tensors of this dtype (torch.Tensor.new_*) ----
    def new_full(self, size, fill_value, *, dtype=None, device=None,
                 requires_grad: bool = False) -> Tensor:
        """`fill_value` everywhere, of shape `size` and (unless `dtype`) this dtype: a `fill`
        node of this tensor's trace (computed at once for an eager tensor). `device` is
        checked and ignored, as the factories do."""
        from ..devices import as_device
        from ..dtypes import tensor_dtype
        as_device(device)
        shape = tuple(int(d) for d in _shape_args((size,)))
        return self.tracer.op("fill", [], value=fill_value, shape=shape,
                              dtype=str(tensor_dtype(dtype or self.dtype, "new_full")))

    def new_zeros(self, *size, dtype=None, device=None, requires_grad: bool = False):
        return self.new_full(_shape_args(size), 0, dtype=dtype, device=device)

    def new_ones(self, *size, dtype=None, device=None, requires_grad: bool = False):
        return self.new_full(_shape_args(size), 1, dtype=dtype, device=device)

    def new_empty(self, *size, dtype=None, device=None, requires_grad: bool = False):
        """As new_zeros (nothing may depend on stale memory)."""
        return self.new_zeros(*size, dtype=dtype, device=device)

    def new_tensor(self, data, *, dtype=None, device=None, requires_grad: bool = False):
        """An eager tensor holding a copy of `data` in this dtype (unless `dtype`); where it
        meets a traced tensor it is a constant of its values."""
        from ..devices import as_device
        from ..dtypes import tensor_dtype
        as_device(device)
        dtype = str(tensor_dtype(dtype or self.dtype, "new_tensor"))
        values = data.numpy() if isinstance(data, Tensor) else np.asarray(data)
        if dtype == BF16:
            from ..backends.numpy import bf16
            return tensor_of(bf16.to_bits(np.asarray(values, np.float32)))
        return tensor_of(np.array(values, dtype=storage_dtype(dtype), order="C"))

    # ---- copies ----
    def clone(self, *, memory_format=None) -> Tensor:
        """A copy (eager); a traced value is never overwritten, so its clone is a new object
        holding the same value: an in-place method on one leaves the other as it was."""
        self._memory_format(memory_format, "Tensor.clone")
        return tensor_of(self.array.copy()) if self.is_eager else Tensor(self.value, self.tracer)


def attach(cls: type) -> None:
    """Give Tensor the new-tensor methods of this module."""
    attach_methods(_NewMethods, cls)


attach(Tensor)
