"""Recurrent layers with torch.nn's names, arguments, parameters and initialisation: RNN, LSTM,
GRU and their cells RNNCell, LSTMCell, GRUCell.

A layer is composed of traced ops, so it trains on every backend inside one compiled step and
its backward comes from the ops' VJPs. Per layer and direction: one linear projects the
inputs of every time step at once; `unstack` (ops/recurrent.py) hands out the steps; each
step adds the hidden projection (one linear) and applies the gates (pointwise ops; an LSTM's
in one lstm_cell node, ops/lstm_cell.py, whose gradient is one lstm_cell_grad node); the
hidden states are stacked back into the output with one concat. The sequence is unrolled at
trace time, so the graph grows with its length. The layers walk (T, B, ...) tensors, so the
planner (compile/aliases.py) makes the unstack views of the projection, the concat the steps
writing their places of the output in place, and likewise in the backward: no copies per
step. Without a given state, the first step's hidden product of zeros is folded away
(compile/zeros.py).

Gate orders are torch's, so a torch state_dict loads: LSTM (i, f, g, o), GRU (r, z, n) with
n = tanh(W_in x + b_in + r * (W_hn h + b_hn)).
"""
from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import dataclass, replace

import numpy as np

from ..errors import ShapeError, UnsupportedOpError
from ..functions.tensors import cat, stack
from ..ir.trace import Tensor
from . import functional as F
from . import init
from .module import Module, Parameter

# Gate blocks of each mode's weights: weight_ih is (GATES * hidden_size, input_size).
GATES = {"RNN_TANH": 1, "RNN_RELU": 1, "LSTM": 4, "GRU": 3}
PACKED_HINT = ("pad the sequences to one length (torch.nn.utils.rnn.pad_sequence) and mask "
               "the padded steps in the loss (e.g. cross_entropy(..., ignore_index=...))")


@dataclass(frozen=True)
class CellWeights:
    """One layer and direction's parameters (biases None when bias=False)."""

    weight_ih: Parameter
    weight_hh: Parameter
    bias_ih: Parameter | None
    bias_hh: Parameter | None


def refuse_packed(input, where: str) -> None:
    """Packed sequences (torch.nn.utils.rnn.PackedSequence) have data-dependent lengths."""
    if type(input).__name__ == "PackedSequence":
        raise UnsupportedOpError(f"{where}: a PackedSequence input is not supported by "
                                 f"stepgraph; {PACKED_HINT}")


def _check_dtype(where: str, dtype) -> None:
    if dtype is not None and dtype != "float32":
        raise UnsupportedOpError(f"{where}(dtype={dtype}): parameters are float32 (for 16-bit "
                                 'compute use compile_train_step(precision="bf16"))')


def _gates(x: Tensor, k: int) -> tuple[Tensor, ...]:
    """The k gate blocks of (B, k * H) pre-activations, each (B, H): one unstack node, whose
    gradient is one concat (chunk's slices would each give a zero-filled (B, k * H))."""
    if k == 1:
        return (x,)
    rows = x.reshape(x.shape[0], k, x.shape[1] // k)
    return tuple(x.tracer.op_all("unstack", [rows], dim=1, reverse=False))


def time_steps(x: Tensor, time_dim: int, reverse: bool) -> list[Tensor]:
    """The steps of x along time_dim in the order a walk takes them (last first: reverse)."""
    return x.tracer.op_all("unstack", [x], dim=time_dim, reverse=reverse)


def _hidden(h: Tensor, w: CellWeights) -> Tensor:
    return F.linear(h, w.weight_hh, w.bias_hh)


def rnn_step(mode: str, xp: Tensor, state: tuple, w: CellWeights) -> tuple:
    """The next state of one time step: xp = W_ih x + b_ih (B, GATES * H), state (h,) or
    (h, c) for an LSTM, each (B, H)."""
    h = state[0]
    hh = _hidden(h, w)
    if mode == "GRU":
        xr, xz, xn = _gates(xp, 3)
        hr, hz, hn = _gates(hh, 3)
        r, z = (xr + hr).sigmoid(), (xz + hz).sigmoid()
        n = (xn + r * hn).tanh()
        return (n + z * (h - n),)                 # (1 - z) * n + z * h
    if mode == "LSTM":
        # one lstm_cell node adds the two products and applies the gates (ops/lstm_cell.py)
        h, c, _ = xp.tracer.op_all("lstm_cell", [xp, hh, xp._coerce(state[1], "c")])
        return h, c
    pre = xp + hh
    return (pre.tanh() if mode == "RNN_TANH" else pre.relu(),)


class RNNBase(Module):
    """The multi-layer, optionally bidirectional recurrent layer behind RNN, LSTM and GRU
    (torch.nn.RNNBase's arguments; proj_size != 0 is refused)."""

    def __init__(self, mode: str, input_size: int, hidden_size: int, num_layers: int = 1,
                 bias: bool = True, batch_first: bool = False, dropout: float = 0.0,
                 bidirectional: bool = False, proj_size: int = 0, device=None, dtype=None):
        super().__init__()
        _check_sizes(type(self).__name__, input_size, hidden_size, num_layers, dropout,
                     proj_size, mode)
        _check_dtype(type(self).__name__, dtype)
        self.mode, self.input_size, self.hidden_size = mode, input_size, hidden_size
        self.num_layers, self.bias, self.batch_first = num_layers, bias, batch_first
        self.dropout, self.bidirectional = float(dropout), bidirectional
        self.proj_size = proj_size
        directions = 2 if bidirectional else 1
        rows = GATES[mode] * hidden_size
        self._flat_weights_names = []
        for layer in range(num_layers):
            cols = input_size if layer == 0 else hidden_size * directions
            for direction in range(directions):
                suffix = f"_l{layer}" + ("_reverse" if direction else "")
                shapes = {"weight_ih": (rows, cols), "weight_hh": (rows, hidden_size)}
                if bias:
                    shapes.update(bias_ih=(rows,), bias_hh=(rows,))
                for name, shape in shapes.items():
                    setattr(self, name + suffix, Parameter(np.empty(shape, np.float32)))
                    self._flat_weights_names.append(name + suffix)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Every weight and bias U(-1/sqrt(hidden_size), 1/sqrt(hidden_size)), as torch."""
        bound = 1.0 / math.sqrt(self.hidden_size)
        for p in self.parameters():
            init.uniform_(p, -bound, bound)

    def flatten_parameters(self) -> None:
        """Accepted without effect: torch packs weights for cuDNN here; stepgraph's plan
        places parameters itself."""

    @property
    def _flat_weights(self) -> list[Parameter]:
        return [getattr(self, name) for name in self._flat_weights_names]

    @property
    def all_weights(self) -> list[list[Parameter]]:
        """The parameters per layer and direction, as torch."""
        per = 4 if self.bias else 2
        flat = self._flat_weights
        return [flat[i:i + per] for i in range(0, len(flat), per)]

    def weights(self, layer: int, direction: int) -> CellWeights:
        suffix = f"_l{layer}" + ("_reverse" if direction else "")
        get = lambda name: getattr(self, name + suffix, None)  # noqa: E731
        return CellWeights(get("weight_ih"), get("weight_hh"), get("bias_ih"), get("bias_hh"))

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}"
        if self.num_layers != 1:
            s += f", num_layers={self.num_layers}"
        if not self.bias:
            s += ", bias=False"
        if self.batch_first:
            s += ", batch_first=True"
        if self.dropout:
            s += f", dropout={self.dropout}"
        if self.bidirectional:
            s += ", bidirectional=True"
        return s

    # ---- forward -------------------------------------------------------------------------
    def forward(self, input, hx=None):
        """output, h_n (an LSTM: output, (h_n, c_n)) for input (T, B, input_size) ((B, T, ...)
        with batch_first; (T, input_size) unbatched), as torch."""
        name = type(self).__name__
        refuse_packed(input, name)
        if input.ndim not in (2, 3):
            raise ShapeError(f"{name}: Expected input to be 2D or 3D, got {input.ndim}D input "
                             "instead")
        if input.shape[-1] != self.input_size:
            raise ShapeError(f"{name}: input.size(-1) must be equal to input_size. Expected "
                             f"{self.input_size}, got {input.shape[-1]}")
        batched = input.ndim == 3
        x = input if batched else input.unsqueeze(1)
        # The layers walk (T, B, ...): each step's slice of the input projection and each
        # step's place in the output are then contiguous, so the planner makes them views
        # into one buffer (compile/aliases.py); batch_first costs one transpose each way.
        batch_first = batched and self.batch_first
        if batch_first:
            x = x.transpose(0, 1)
        states = self._initial_states(x, hx, batched, x.shape[1])
        output, finals = self._layers(x, states)
        final = tuple(stack([s[k] for s in finals], 0) for k in range(len(finals[0])))
        if batch_first:
            output = output.transpose(0, 1)
        if not batched:
            output, final = output.squeeze(1), tuple(f.squeeze(1) for f in final)
        return output, (final if self.mode == "LSTM" else final[0])

    def _layers(self, x: Tensor, states: list[tuple]):
        """The last layer's output (T, B, directions * H) and every layer and direction's
        final state, for x (T, B, features)."""
        directions = 2 if self.bidirectional else 1
        finals = []
        for layer in range(self.num_layers):
            outputs = []
            for direction in range(directions):
                state = states[layer * directions + direction]
                hs, state = self._walk(x, state, self.weights(layer, direction),
                                       reverse=direction == 1)
                outputs.append(stack(hs, 0))
                finals.append(state)
            x = outputs[0] if directions == 1 else cat(outputs, -1)
            if self.dropout and layer < self.num_layers - 1:
                x = F.dropout(x, self.dropout, self.training)
        return x, finals

    def _walk(self, x: Tensor, state: tuple, w: CellWeights, reverse: bool):
        """One direction of one layer over x (T, B, features): the hidden state of every step
        in time order, and the final state."""
        bias = w.bias_ih
        if self.mode != "GRU" and w.bias_hh is not None:
            # b_hh joins b_ih in the projection of all steps: its gradient is then one sum
            # over the sequence, not one per step (GRU's b_hn stays inside r * (...)).
            bias, w = x._coerce(w.bias_ih, "bias_ih") + w.bias_hh, replace(w, bias_hh=None)
        hs = []
        for xp in time_steps(F.linear(x, w.weight_ih, bias), 0, reverse):
            state = rnn_step(self.mode, xp, state, w)
            hs.append(state[0])
        return (hs[::-1] if reverse else hs), state

    def _initial_states(self, x: Tensor, hx, batched: bool, batch: int) -> list[tuple]:
        """(h,) or (h, c) per layer and direction, each (B, H): slices of hx, or zeros."""
        count = self.num_layers * (2 if self.bidirectional else 1)
        parts = 2 if self.mode == "LSTM" else 1
        if hx is None:
            zeros = x.new_zeros((batch, self.hidden_size))
            return [(zeros,) * parts] * count
        if parts == 2 and (not isinstance(hx, (tuple, list)) or len(hx) != 2):
            raise ShapeError(f"{type(self).__name__}: hx must be a tuple (h_0, c_0)")
        given = tuple(hx) if parts == 2 else (hx,)
        want = (count, batch, self.hidden_size) if batched else (count, self.hidden_size)
        for what, t in zip(("h_0", "c_0"), given):
            if tuple(t.shape) != want:
                raise ShapeError(f"{type(self).__name__}: Expected hidden size {want} for "
                                 f"{what}, got {list(t.shape)}")
        given = tuple(x._coerce(t, "hx") if batched else x._coerce(t, "hx").unsqueeze(1)
                      for t in given)
        return [tuple(t[k] for t in given) for k in range(count)]


def _check_sizes(name, input_size, hidden_size, num_layers, dropout, proj_size, mode) -> None:
    """torch's constructor checks, with its messages."""
    for what, v in (("input_size", input_size), ("hidden_size", hidden_size),
                    ("num_layers", num_layers)):
        if not isinstance(v, numbers.Integral) or isinstance(v, bool):
            raise TypeError(f"{what} should be of type int, got: {type(v).__name__}")
        if v <= 0:
            raise ValueError(f"{what} must be greater than zero")
    if isinstance(dropout, bool) or not isinstance(dropout, numbers.Number) \
            or not 0 <= dropout <= 1:
        raise ValueError("dropout should be a number in range [0, 1] representing the "
                         "probability of an element being zeroed")
    if dropout > 0 and num_layers == 1:
        warnings.warn("dropout option adds dropout after all but last recurrent layer, so "
                      "non-zero dropout expects num_layers greater than 1, but got "
                      f"dropout={dropout} and num_layers={num_layers}", stacklevel=3)
    if proj_size:
        if mode != "LSTM":
            raise ValueError("proj_size argument is only supported for LSTM, not RNN or GRU")
        raise UnsupportedOpError(f"{name}(proj_size={proj_size}) is not supported by stepgraph "
                                 "(LSTM with projections); use proj_size=0 and an nn.Linear "
                                 "on the output")


class RNN(RNNBase):
    """Elman RNN, h_t = tanh or relu(W_ih x_t + b_ih + W_hh h_{t-1} + b_hh), as torch.nn.RNN."""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1,
                 nonlinearity: str = "tanh", bias: bool = True, batch_first: bool = False,
                 dropout: float = 0.0, bidirectional: bool = False, device=None, dtype=None):
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"Unknown nonlinearity '{nonlinearity}'. Select from 'tanh' or "
                             "'relu'.")
        super().__init__("RNN_TANH" if nonlinearity == "tanh" else "RNN_RELU", input_size,
                         hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
                         device=device, dtype=dtype)
        self.nonlinearity = nonlinearity


class LSTM(RNNBase):
    """LSTM with torch's gates (i, f, g, o) and parameters, as torch.nn.LSTM; forward takes
    and returns (h, c) pairs."""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1,
                 bias: bool = True, batch_first: bool = False, dropout: float = 0.0,
                 bidirectional: bool = False, proj_size: int = 0, device=None, dtype=None):
        super().__init__("LSTM", input_size, hidden_size, num_layers, bias, batch_first,
                         dropout, bidirectional, proj_size, device, dtype)


class GRU(RNNBase):
    """GRU with torch's gates (r, z, n) and parameters, as torch.nn.GRU."""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1,
                 bias: bool = True, batch_first: bool = False, dropout: float = 0.0,
                 bidirectional: bool = False, device=None, dtype=None):
        super().__init__("GRU", input_size, hidden_size, num_layers, bias, batch_first,
                         dropout, bidirectional, device=device, dtype=dtype)


# ---- cells ---------------------------------------------------------------------------------

class RNNCellBase(Module):
    """One step of a recurrent layer: weight_ih, weight_hh, bias_ih, bias_hh as torch."""

    def __init__(self, mode: str, input_size: int, hidden_size: int, bias: bool,
                 device=None, dtype=None):
        super().__init__()
        _check_sizes(type(self).__name__, input_size, hidden_size, 1, 0, 0, mode)
        _check_dtype(type(self).__name__, dtype)
        self.mode, self.input_size, self.hidden_size, self.bias = mode, input_size, \
            hidden_size, bias
        rows = GATES[mode] * hidden_size
        self.weight_ih = Parameter(np.empty((rows, input_size), np.float32))
        self.weight_hh = Parameter(np.empty((rows, hidden_size), np.float32))
        self.bias_ih = Parameter(np.empty(rows, np.float32)) if bias else None
        self.bias_hh = Parameter(np.empty(rows, np.float32)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Every weight and bias U(-1/sqrt(hidden_size), 1/sqrt(hidden_size)), as torch."""
        bound = 1.0 / math.sqrt(self.hidden_size)
        for p in self.parameters():
            init.uniform_(p, -bound, bound)

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}"
        if not self.bias:
            s += ", bias=False"
        if getattr(self, "nonlinearity", "tanh") != "tanh":
            s += f", nonlinearity={self.nonlinearity}"
        return s

    def forward(self, input, hx=None):
        """The next hidden state (an LSTMCell: (h', c')) for input (B, input_size) or
        (input_size,) unbatched, hx as the input's batch (zeros when None)."""
        name = type(self).__name__
        if input.ndim not in (1, 2):
            raise ShapeError(f"{name}: Expected input to be 1D or 2D, got {input.ndim}D input "
                             "instead")
        if input.shape[-1] != self.input_size:
            raise ShapeError(f"{name}: input has inconsistent input_size: got "
                             f"{input.shape[-1]} expected {self.input_size}")
        batched = input.ndim == 2
        x = input if batched else input.unsqueeze(0)
        state = self._state(x, hx, batched)
        w = CellWeights(self.weight_ih, self.weight_hh, self.bias_ih, self.bias_hh)
        state = rnn_step(self.mode, F.linear(x, w.weight_ih, w.bias_ih), state, w)
        if not batched:
            state = tuple(s.squeeze(0) for s in state)
        return state if self.mode == "LSTM" else state[0]

    def _state(self, x: Tensor, hx, batched: bool) -> tuple:
        parts = 2 if self.mode == "LSTM" else 1
        if hx is None:
            return (x.new_zeros((x.shape[0], self.hidden_size)),) * parts
        if parts == 2 and not isinstance(hx, (tuple, list)):
            raise ShapeError(f"{type(self).__name__}: hx must be a tuple (h, c)")
        given = tuple(hx) if parts == 2 else (hx,)
        want = (x.shape[0], self.hidden_size) if batched else (self.hidden_size,)
        if len(given) != parts or any(tuple(t.shape) != want for t in given):
            raise ShapeError(f"{type(self).__name__}: hidden state must be {parts} tensor(s) "
                             f"of shape {want}, got {[tuple(t.shape) for t in given]}")
        return tuple(x._coerce(t, "hx") if batched else x._coerce(t, "hx").unsqueeze(0)
                     for t in given)


class RNNCell(RNNCellBase):
    """h' = tanh or relu(W_ih x + b_ih + W_hh h + b_hh), as torch.nn.RNNCell."""

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True,
                 nonlinearity: str = "tanh", device=None, dtype=None):
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"Unknown nonlinearity: {nonlinearity}")
        super().__init__("RNN_TANH" if nonlinearity == "tanh" else "RNN_RELU", input_size,
                         hidden_size, bias, device, dtype)
        self.nonlinearity = nonlinearity


class LSTMCell(RNNCellBase):
    """One LSTM step, (h', c') from (h, c), as torch.nn.LSTMCell."""

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True, device=None,
                 dtype=None):
        super().__init__("LSTM", input_size, hidden_size, bias, device, dtype)


class GRUCell(RNNCellBase):
    """One GRU step, as torch.nn.GRUCell."""

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True, device=None,
                 dtype=None):
        super().__init__("GRU", input_size, hidden_size, bias, device, dtype)
