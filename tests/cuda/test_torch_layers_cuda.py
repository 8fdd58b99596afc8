"""The torch layers composed on the host side (nn.Transformer's family, Embedding's
padding_idx) in a CUDA graph: the CPU tests' models (tests/models/) trained as replays, judged
against torch float64 by the same policy, and the padding row left exactly as it was."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda
cp = require_gpu("nvmath")

import stepgraph as sg  # noqa: E402
from stepgraph import nn as snn  # noqa: E402
from stepgraph import optim  # noqa: E402
from tests.models import test_embedding_padding as padding  # noqa: E402
from tests.models.test_transformer_layers import (VOCAB, assert_trained_like_torch,  # noqa: E402
                                                  start)
from tests.reference import assert_close_to_reference, assert_state_changes_close  # noqa: E402


def test_an_encoder_decoder_trains_like_torch_in_a_cuda_graph():
    model, before, data, run64, run32 = start({})

    def loss(logits, y):
        return sg.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))

    step = sg.compile_train_step(model, loss, optim.SGD(lr=0.1, momentum=0.9),
                                 example_inputs=data[0], device="cuda", graph=True)
    got = [float(step(*(cp.asarray(a) for a in batch))) for batch in data]
    assert_trained_like_torch(got, model, before, run64, run32, "cuda graph losses")


def test_the_padding_row_never_moves_in_a_cuda_graph():
    row = np.linspace(-1, 1, padding.C, dtype=np.float32)
    ref, data = padding.make(torch.nn), padding.batches(3)
    losses64, after64 = padding.torch_run(ref, data, torch.float64, row)
    losses32, after32 = padding.torch_run(ref, data, torch.float32, row)
    model = padding.make(snn)
    state = {k: v.numpy().copy() for k, v in ref.state_dict().items()}
    state["emb.weight"][0] = row
    model.load_state_dict(state)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    step = sg.compile_train_step(model, sg.nn.functional.cross_entropy,
                                 optim.SGD(lr=0.5, momentum=0.9), example_inputs=data[0],
                                 device="cuda", graph=True)
    got = [float(step(cp.asarray(ids), cp.asarray(y))) for ids, y in data]
    assert_close_to_reference(got, losses64, losses32, "losses")
    assert_state_changes_close(before, model.state_dict(), after64, after32)
    np.testing.assert_array_equal(model.state_dict()["emb.weight"][0], row)
