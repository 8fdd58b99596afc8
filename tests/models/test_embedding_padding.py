"""nn.Embedding / F.embedding with padding_idx as torch's: the row starts at zero, its lookups
give its value and no gradient (so it never trains), a negative index counts from the end,
and one out of range is refused with torch's message; a model with padded batches trains like
torch by the tolerance policy."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import stepgraph as sg
from stepgraph import nn as snn
from stepgraph import optim
from stepgraph.errors import ShapeError
from tests.reference import assert_close_to_reference, assert_state_changes_close

V, C, T, BATCH, CLASSES = 9, 6, 5, 4, 3


def test_the_padding_row_starts_at_zero_and_indices_are_checked_as_torchs():
    emb = snn.Embedding(V, C, padding_idx=-2)
    assert emb.padding_idx == torch.nn.Embedding(V, C, padding_idx=-2).padding_idx == V - 2
    weight = emb.weight.numpy()
    assert not weight[V - 2].any() and weight[np.arange(V) != V - 2].all()
    assert "padding_idx=7" in repr(emb)
    for bad in (V, -V - 1):
        with pytest.raises(ShapeError, match="Padding_idx must be within num_embeddings"):
            snn.Embedding(V, C, padding_idx=bad)


def make(nn):
    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, C, padding_idx=0)
            self.proj = nn.Linear(C, CLASSES)

        def forward(self, ids):
            return self.proj(self.emb(ids).mean(1))

    return Tagger()


def batches(steps: int):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(steps):
        ids = rng.integers(0, V, (BATCH, T))
        ids[:, -2:] = 0                                      # every row padded
        out.append((ids.astype(np.int64), rng.integers(0, CLASSES, BATCH).astype(np.int64)))
    return out


def torch_run(ref, data, dtype, padding_row):
    ref = copy.deepcopy(ref).to(dtype)
    with torch.no_grad():
        ref.emb.weight[0] = torch.as_tensor(padding_row, dtype=dtype)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for ids, y in data:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ref(torch.from_numpy(ids)), torch.from_numpy(y))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.double().numpy() for k, v in ref.state_dict().items()}


@pytest.mark.parametrize("padding_row", ["zero", "nonzero"])
def test_a_padded_model_trains_like_torch_and_never_moves_the_padding_row(padding_row):
    """Three SGD steps with momentum; a padding row the user set to other values is looked up
    with those values (torch's forward) and still gets no gradient."""
    row = np.zeros(C, np.float32) if padding_row == "zero" else np.linspace(-1, 1, C,
                                                                            dtype=np.float32)
    ref = make(torch.nn)
    data = batches(3)
    losses64, after64 = torch_run(ref, data, torch.float64, row)
    losses32, after32 = torch_run(ref, data, torch.float32, row)
    model = make(snn)
    state = {k: v.numpy() for k, v in ref.state_dict().items()}
    state["emb.weight"] = state["emb.weight"].copy()
    state["emb.weight"][0] = row
    model.load_state_dict(state)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    step = sg.compile_train_step(model, sg.nn.functional.cross_entropy,
                                 optim.SGD(lr=0.5, momentum=0.9), example_inputs=data[0],
                                 device="cpu")
    got = [float(step(ids, y)) for ids, y in data]
    assert_close_to_reference(got, losses64, losses32, "losses")
    assert_state_changes_close(before, model.state_dict(), after64, after32)
    np.testing.assert_array_equal(model.state_dict()["emb.weight"][0], row)
