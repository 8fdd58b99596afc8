"""Module buffers and the module tree: register_buffer, named_buffers, named_modules,
children, and state_dict key order as PyTorch's for nested modules (per module: its
parameters, its buffers, then its children)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn as tnn

import stepgraph as sg
from stepgraph import nn
from stepgraph.errors import StateDictError


class SgInner(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", np.array(0, np.int64))
        self.lin = nn.Linear(3, 2)
        self.scale = nn.Parameter(np.ones(2, np.float32))   # after a child: still listed first
        self.register_buffer("offset", np.zeros(2, np.float32))
        self.register_buffer("unused", None)


class SgOuter(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = SgInner()
        self.register_buffer("stats", np.zeros((2, 2), np.float32))
        self.blocks = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), SgInner())
        self.shared = self.inner               # the same module twice, as torch allows
        self.head = nn.Parameter(np.zeros(3, np.float32))


class TorchInner(tnn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.tensor(0))
        self.lin = tnn.Linear(3, 2)
        self.scale = tnn.Parameter(torch.ones(2))
        self.register_buffer("offset", torch.zeros(2))
        self.register_buffer("unused", None)


class TorchOuter(tnn.Module):
    def __init__(self):
        super().__init__()
        self.inner = TorchInner()
        self.register_buffer("stats", torch.zeros(2, 2))
        self.blocks = tnn.Sequential(tnn.Linear(2, 2), tnn.BatchNorm1d(2), TorchInner())
        self.shared = self.inner
        self.head = tnn.Parameter(torch.zeros(3))


def test_state_dict_keys_order_and_dtypes_match_torch():
    sd, want = SgOuter().state_dict(), TorchOuter().state_dict()
    assert list(sd) == list(want)
    for k, v in want.items():
        assert sd[k].dtype == v.numpy().dtype and sd[k].shape == tuple(v.shape), k


def test_named_buffers_modules_and_children_match_torch():
    m, tm = SgOuter(), TorchOuter()
    assert [k for k, _ in m.named_buffers()] == [k for k, _ in tm.named_buffers()]
    assert [k for k, _ in m.named_buffers(remove_duplicate=False)] == [
        k for k, _ in tm.named_buffers(remove_duplicate=False)]
    assert [k for k, _ in m.named_modules()] == [k for k, _ in tm.named_modules()]
    assert [k for k, _ in m.named_children()] == [k for k, _ in tm.named_children()]
    assert list(m.children()) == [c for _, c in m.named_children()]
    assert len(list(m.buffers())) == len(list(tm.buffers(recurse=True)))   # shared: once
    assert m.inner.unused is None and "unused" not in m.inner.state_dict()


def test_buffers_load_in_place_and_keep_their_dtype():
    m = SgOuter()
    count = m.inner.count
    sd = {k: np.full_like(v.numpy(), 3) for k, v in TorchOuter().state_dict().items()}
    m.load_state_dict(sd)
    assert m.inner.count is count and count.numpy().dtype == np.int64 and int(count.numpy()) == 3
    assert m.state_dict()["blocks.1.num_batches_tracked"].dtype == sg.int64


def test_register_buffer_rejects_bad_names():
    m = SgInner()
    with pytest.raises(KeyError, match="without '.'"):
        m.register_buffer("a.b", np.zeros(1))
    with pytest.raises(KeyError, match="already exists"):
        m.register_buffer("scale", np.zeros(1))


def test_unknown_buffer_key_is_rejected():
    m = SgInner()
    sd = dict(m.state_dict(), extra=np.zeros(1))
    with pytest.raises(StateDictError, match="extra"):
        m.load_state_dict(sd)


def test_unnamed_buffer_cannot_be_traced():
    from stepgraph.ir.trace import Tracer
    with pytest.raises(ValueError, match="no state_dict key"):
        Tracer().buffer(sg.nn.Buffer(np.zeros(2, np.float32)))
