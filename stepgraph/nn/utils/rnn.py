"""torch.nn.utils.rnn: pad_sequence, and the packed-sequence names refused with the way to
the same result.

A packed sequence's per-step batch sizes depend on the data (the lengths), and a compiled
step has one static shape per value, so stepgraph's recurrent layers walk padded batches:
pad the sequences to one length and mask the padded steps in the loss.
"""
from __future__ import annotations

from ...errors import UnsupportedOpError
from ...functions.tensors import cat, stack
from ..recurrent import PACKED_HINT


def pad_sequence(sequences, batch_first: bool = False, padding_value: float = 0.0,
                 padding_side: str = "right"):
    """Tensors (L_i, *) padded with padding_value to the longest and stacked: (L, B, *), or
    (B, L, *) with batch_first, as torch.nn.utils.rnn.pad_sequence."""
    if padding_side not in ("right", "left"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    sequences = list(sequences)
    if not sequences:
        raise ValueError("pad_sequence: received an empty list of sequences")
    longest = max(s.shape[0] for s in sequences)
    padded = []
    for s in sequences:
        short = longest - s.shape[0]
        if short:
            fill = s.new_full((short, *s.shape[1:]), padding_value)
            s = cat([s, fill] if padding_side == "right" else [fill, s], 0)
        padded.append(s)
    return stack(padded, 0 if batch_first else 1)


def _refused(name: str):
    def refuse(*args, **kwargs):
        raise UnsupportedOpError(f"torch.nn.utils.rnn.{name} is not supported by stepgraph "
                                 f"(a packed batch's shape depends on the lengths); "
                                 f"{PACKED_HINT}")
    refuse.__name__ = refuse.__qualname__ = name
    refuse.__doc__ = f"Refused: {PACKED_HINT}."
    return refuse


pack_padded_sequence = _refused("pack_padded_sequence")
pad_packed_sequence = _refused("pad_packed_sequence")
pack_sequence = _refused("pack_sequence")
unpack_sequence = _refused("unpack_sequence")
unpad_sequence = _refused("unpad_sequence")


class PackedSequence:
    """Refused on construction (see the module docstring); the name exists so that model
    files importing it load, and isinstance checks against it work."""

    def __init__(self, *args, **kwargs):
        _refused("PackedSequence")()


__all__ = ["pad_sequence", "pack_padded_sequence", "pad_packed_sequence", "pack_sequence",
           "unpack_sequence", "unpad_sequence", "PackedSequence"]
