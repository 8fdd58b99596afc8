"""torch.device: where a tensor lives, as model code names it.

Where a compiled step runs is chosen by `compile_train_step(device=...)`, not by tensors:
eager tensors (made outside a traced forward) always live in host memory, and a factory's
`device=` argument is accepted and checked, never acted on.
"""
from __future__ import annotations

TYPES = ("cpu", "cuda")


class device:
    """torch.device("cuda"), device("cuda", 0), device("cuda:1"), device("cpu"); equal to
    another device or a string naming the same place ("cuda" equals device("cuda"), not
    device("cuda", 0), as in torch)."""

    def __init__(self, type, index: int | None = None):
        if isinstance(type, device):
            type, index = type.type, type.index if index is None else index
        elif isinstance(type, int) and not isinstance(type, bool):
            type, index = "cuda", type                  # torch.device(0) is cuda:0
        elif not isinstance(type, str):
            raise TypeError(f"device: expected a str, int or device, got {type!r}")
        if ":" in type:
            if index is not None:
                raise ValueError(f"device: {type!r} already names an index")
            type, number = type.split(":", 1)
            index = int(number)
        if type not in TYPES:
            raise ValueError(f"device: expected one of {TYPES}, got {type!r}")
        if index is not None and (int(index) < 0 or (type == "cpu" and int(index) != 0)):
            raise ValueError(f"device: bad index {index} for {type}")
        self.type = type
        self.index = None if index is None else int(index)

    def __str__(self):
        return self.type if self.index is None else f"{self.type}:{self.index}"

    def __repr__(self):
        index = "" if self.index is None else f", index={self.index}"
        return f"device(type='{self.type}'{index})"

    def __eq__(self, other):
        if isinstance(other, (str, int)) and not isinstance(other, bool):
            try:
                other = device(other)
            except (TypeError, ValueError):
                return False
        return isinstance(other, device) and (self.type, self.index) == (other.type,
                                                                          other.index)

    def __hash__(self):
        return hash((self.type, self.index))


def as_device(d) -> device:
    """`d` (None, a str, an int or a device) as a device; None is the CPU."""
    return device("cpu") if d is None else device(d)


__all__ = ["device", "memory_format", "channels_last", "channels_last_3d", "contiguous_format",
           "preserve_format"]


class memory_format:  # noqa: N801 - torch's name
    """torch.memory_format: channels_last and the others, as names. Tensors, modules and
    casts accept them (`model.to(memory_format=torch.channels_last)`); where a step stores its
    image tensors is compile_train_step(memory_format=...)'s (channels-last on CUDA at tf32 and
    bf16 by default), for a training script too."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self):
        return f"torch.{self.name}"

    __str__ = __repr__


channels_last = memory_format("channels_last")
channels_last_3d = memory_format("channels_last_3d")
contiguous_format = memory_format("contiguous_format")
preserve_format = memory_format("preserve_format")
