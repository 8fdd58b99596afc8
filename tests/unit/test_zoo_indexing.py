"""Index assignment against torch: eager tensors written in place (ints, slices, ..., None,
bool masks, integer tensors and lists; numbers and broadcast tensors; `x[idx] += v`), and
traced tensors rebound to a functional index-put whose values and gradients to both x and v
equal torch's (float64); Swin's window mask; formatting 0-d tensors."""
from __future__ import annotations

import numpy as np
import pytest
import torch as real

import stepgraph as torch
from stepgraph import nn
from stepgraph.errors import ShapeError, UnsupportedOpError
from tests.ops.helpers import forward_and_grads, torch_forward_and_grads

MASK = np.array([True, False, True, True, False])
# (name, assignment on (y, v, t): t is the framework (stepgraph or torch), v's shape)
CASES = [
    ("slices", lambda y, v, t: y.__setitem__((slice(1, 4), slice(None, None, 2)), v), (3, 3)),
    ("broadcast_row", lambda y, v, t: y.__setitem__((slice(1, 4), slice(0, 3)), v), (1, 3)),
    ("leading_ones", lambda y, v, t: y.__setitem__(2, v), (1, 6)),
    ("ellipsis", lambda y, v, t: y.__setitem__((Ellipsis, 0), v), (5,)),
    ("none", lambda y, v, t: y.__setitem__((slice(None), None, 1), v), (5, 1)),
    ("int_and_slice", lambda y, v, t: y.__setitem__((-1, slice(2, None)), v), (4,)),
    ("eager_mask", lambda y, v, t: y.__setitem__(t.tensor(MASK), v), (3, 6)),
    ("list", lambda y, v, t: y.__setitem__(([0, 3], [1, 5]), v), (2,)),
    ("index_tensor", lambda y, v, t: y.__setitem__((slice(None), t.tensor([4, 0, 2])), v),
     (5, 3)),
    ("add_in_place", lambda y, v, t: y[1].__iadd__(v) and None or
     y.__setitem__(1, y[1] + v), (6,)),
    ("number", lambda y, v, t: y.__setitem__((slice(0, 2), slice(1, 3)), 4.5), (1,)),
]


@pytest.mark.parametrize("name,assign,vshape", CASES, ids=[c[0] for c in CASES])
def test_traced_index_put_equals_torch(name, assign, vshape):
    rng = np.random.default_rng(len(name))
    arrays = {"x": rng.standard_normal((5, 6)), "v": rng.standard_normal(vshape),
              "target": rng.standard_normal((5, 6))}

    def run(framework):
        def body(x, v):
            y = x * 1.0
            if name == "add_in_place":
                y[1] += v * 2.0
            else:
                assign(y, v * 2.0, framework)
            return y * y
        return body

    wrt = ("x",) if name == "number" else ("x", "v")
    y, grads = forward_and_grads(lambda tracer, t: run(torch)(t["x"], t["v"]), arrays, wrt,
                                 fused=False)
    ty, tgrads = torch_forward_and_grads(run(real), arrays, wrt)
    np.testing.assert_allclose(y, ty, rtol=1e-14)
    for k in wrt:
        np.testing.assert_allclose(grads[k], tgrads[k], rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("kind", ["mask", "index", "index_number"])
def test_traced_index_put_with_traced_indices_equals_torch(kind):
    rng = np.random.default_rng(7)
    arrays = {"x": rng.standard_normal((5, 6)), "v": rng.standard_normal((5, 3)),
              "i": np.array([4, 1, 2]), "target": rng.standard_normal((5, 6))}

    def body(x, v, i):
        y = x * 1.0
        if kind == "mask":
            y[x > 0.3] = v[0, 0] * 3.0
        elif kind == "index":
            y[..., i] = v.exp()
        else:
            y[:, i] = -2.0
        return y * y

    wrt = ("x",) if kind == "index_number" else ("x", "v")
    y, grads = forward_and_grads(lambda tracer, t: body(t["x"], t["v"], t["i"]), arrays,
                                 wrt, fused=False)
    ty, tgrads = torch_forward_and_grads(body, arrays, wrt)
    np.testing.assert_allclose(y, ty, rtol=1e-14)
    for k in wrt:
        np.testing.assert_allclose(grads[k], tgrads[k], rtol=1e-13, atol=1e-15)


def test_repeated_positions_keep_the_last_write():
    def assign(t, x):
        y = x + 1.0
        y[[0, 2, 0]] = t.tensor([[1.0, 2, 3], [4, 5, 6], [7, 8, 9]], dtype=t.float64)
        return y
    arrays = {"x": np.zeros((4, 3)), "target": np.zeros((4, 3))}
    y, _ = forward_and_grads(lambda tracer, t: assign(torch, t["x"]), arrays, ("x",), False)
    np.testing.assert_array_equal(y, assign(real, real.tensor(arrays["x"])).numpy())


def test_swin_window_mask_in_forward():
    """torchvision's shifted_window_attention builds its mask this way, in forward."""
    def mask(t, x, window=(4, 4), shift=(2, 2)):
        pad_h, pad_w = x.shape[1], x.shape[2]
        attn_mask = x.new_zeros((pad_h, pad_w))
        h_slices = ((0, -window[0]), (-window[0], -shift[0]), (-shift[0], None))
        w_slices = ((0, -window[1]), (-window[1], -shift[1]), (-shift[1], None))
        count = 0
        for h in h_slices:
            for w in w_slices:
                attn_mask[h[0]:h[1], w[0]:w[1]] = count
                count += 1
        attn_mask = attn_mask.view(pad_h // window[0], window[0], pad_w // window[1], window[1])
        attn_mask = attn_mask.permute(0, 2, 1, 3).reshape(4, window[0] * window[1])
        attn_mask = attn_mask.unsqueeze(1) - attn_mask.unsqueeze(2)
        return attn_mask.masked_fill(attn_mask != 0, float(-100.0)).masked_fill(
            attn_mask == 0, float(0.0))

    x = np.zeros((1, 8, 8, 3), np.float64)
    y, _ = forward_and_grads(lambda tracer, t: mask(torch, t["x"]) + t["x"].sum(),
                             {"x": x, "target": np.zeros((4, 16, 16))}, ("x",), False)
    np.testing.assert_array_equal(y, mask(real, real.tensor(x)).numpy())


def test_eager_index_assignment_equals_torch():
    def run(t):
        x = t.zeros(4, 5, 3)
        x[1] = 2.0
        x[:, 0, :] = t.arange(3.0)
        x[..., 2] += t.ones(4, 5)
        x[x > 1.5] = -1.0
        x[t.tensor([0, 3]), 4] = t.tensor([[9.0, 8, 7]])
        x[[1, 2], [2, 3], [0, 1]] = 5.0
        x[None, 2, 1:3] *= 3
        rel = t.arange(24).reshape(2, 4, 3)            # Swin's relative_coords in __init__
        rel[:, :, 0] += 3
        rel[:, :, 1] += 3
        rel[:, :, 0] *= 7
        losses = t.zeros(3)
        losses[2] = 0.25                               # losses[k] = loss.item()
        picked = x[t.tensor([[True, False, True, False, False]] * 4)]
        return x, rel, losses, picked, x[[0, 2]]

    for ours, theirs in zip(run(torch), run(real)):
        assert tuple(ours.shape) == tuple(theirs.shape)
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy())


def test_format_of_tensors():
    loss = torch.tensor(0.123456)
    assert f"{loss:.4f}" == f"{real.tensor(0.123456):.4f}" == "0.1235"
    assert format(torch.tensor(3), "d") == "3" and f"{torch.ones(2)}" == str(torch.ones(2))
    with pytest.raises(TypeError):
        format(torch.ones(2), ".2f")


def test_refusals():
    class Bad(nn.Module):
        def __init__(self, how):
            super().__init__()
            self.how, self.fc, self.table = how, nn.Linear(3, 3), torch.zeros(2, 3)

        def forward(self, x):
            y = self.fc(x)
            if self.how == "eager":
                self.table[0] = y[0]
            elif self.how == "mask_values":
                y[y > 0] = y[0, :1].expand(2)
            else:
                y[y.argmax(1), y.argmax(1)] = 0.0
            return y
    x = np.ones((2, 3), np.float32)
    for how, match in (("eager", "writing traced values into an eager tensor"),
                       ("mask_values", "a v per masked element"),
                       ("two", "this traced index")):
        with pytest.raises(UnsupportedOpError, match=match):
            torch.compile_predict(Bad(how), (x,))
    with pytest.raises(ShapeError, match="cannot be broadcast"):
        Bad("eager")(torch.ones(2, 3)).__setitem__(0, torch.ones(2))
