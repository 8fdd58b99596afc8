"""state_dict values are tensors, as torch's: what torch users do with a model's and an
optimizer's state_dict (snapshot the best model with clone() and restore it, numel(), dtype
checks, torch.equal, deepcopy, torch.save / torch.load), written once and run on torch and on
stepgraph where the behaviour is observable. stepgraph's values are copies (torch's share the
parameters' storage): the tests that write them say so."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import stepgraph as sg
from stepgraph import losses, optim
from stepgraph.errors import StateDictError
from tests.reference import (assert_close_to_reference, assert_state_changes_close,
                             state_float64)

D_IN, HIDDEN, CLASSES = 6, 8, 3


def net(fw):
    """Linear, BatchNorm (float32 statistics, an int64 counter), ReLU, Linear."""
    return fw.nn.Sequential(fw.nn.Linear(D_IN, HIDDEN), fw.nn.BatchNorm1d(HIDDEN),
                            fw.nn.ReLU(), fw.nn.Linear(HIDDEN, CLASSES))


def mlp(fw):
    """No BatchNorm: every gradient is the loss's own, none float32 noise (a bias before
    BatchNorm has a true gradient of 0), so optimizer state compares with torch's."""
    return fw.nn.Sequential(fw.nn.Linear(D_IN, HIDDEN), fw.nn.Tanh(),
                            fw.nn.Linear(HIDDEN, CLASSES))


def twins(make=net):
    """torch float32 / float64 and stepgraph copies of make(fw), with the same weights."""
    torch.manual_seed(0)
    t32 = make(torch)
    t64 = copy.deepcopy(t32).double()
    ours = make(sg)
    ours.load_state_dict(t32.state_dict())            # torch tensors load as they are
    return t32, t64, ours


def batches(n, batch=16, seed=0):
    gen = np.random.default_rng(seed)
    return [(gen.standard_normal((batch, D_IN)).astype(np.float32),
             gen.integers(0, CLASSES, batch).astype(np.int64)) for _ in range(n)]


# ---- the values themselves -----------------------------------------------------------------

def test_values_are_tensors_of_torchs_keys_dtypes_and_shapes():
    t32, _, ours = twins()
    sd, want = ours.state_dict(), t32.state_dict()
    assert list(sd) == list(want)
    for k, v in want.items():
        assert isinstance(sd[k], sg.Tensor), k
        assert str(sd[k].dtype) == str(v.dtype).removeprefix("torch."), k
        assert sd[k].shape == sg.Size(v.shape) and isinstance(sd[k].shape, sg.Size), k
        assert sd[k].numel() == v.numel() and sd[k].dim() == v.dim(), k
        assert sd[k].is_floating_point() == v.is_floating_point(), k
        np.testing.assert_array_equal(sd[k].numpy(), v.numpy(), err_msg=k)
    assert sd["0.weight"].dtype == sg.float32 and sd["1.num_batches_tracked"].dtype == sg.int64
    assert sd["1.num_batches_tracked"].item() == want["1.num_batches_tracked"].item() == 0
    assert sum(v.numel() for v in sd.values()) == sum(v.numel() for v in want.values())


def test_half_models_give_float16_values_as_torch():
    _, _, ours = twins()
    theirs = net(torch).half()
    ours.half()
    for (k, v), (tk, tv) in zip(ours.state_dict().items(), theirs.state_dict().items()):
        assert k == tk and str(v.dtype) == str(tv.dtype).removeprefix("torch."), k
    assert ours.state_dict()["0.weight"].dtype == sg.float16


def test_torch_tensor_methods_work_on_the_values():
    _, _, ours = twins()
    sd = ours.state_dict()
    w = sd["0.weight"]
    for same in (w.cpu(), w.to("cpu"), w.to("cuda"), w.float(), w.detach(), w.clone(),
                 copy.deepcopy(w)):
        assert sg.equal(same, w) and same.dtype == sg.float32
    assert w.to(sg.float16).dtype == sg.float16 and w.double().dtype == sg.float64
    assert w.size() == (HIDDEN, D_IN) and w.size(-1) == D_IN
    again = ours.state_dict()
    assert all(sg.equal(sd[k], again[k]) for k in sd)
    assert not sg.equal(sd["0.weight"], sd["0.weight"] + 1)


def test_a_value_minus_a_numpy_snapshot_is_a_tensor_as_torchs():
    """`after[k] - before[k]` where before holds .numpy() snapshots: torch takes the array as
    a tensor; so does an eager tensor (float64 arrays promote as torch's)."""
    ours, theirs = sg.tensor([1.5, -2.0, 3.25]), torch.tensor([1.5, -2.0, 3.25])
    for snapshot in (np.array([0.5, 1.0, -1.0], np.float32), np.array([0.5, 1.0, -1.0])):
        for got, want in ((ours - snapshot, theirs - snapshot),
                          (ours * snapshot, theirs * snapshot)):
            assert isinstance(got, sg.Tensor) and str(got.dtype) == str(want.dtype).split(".")[1]
            np.testing.assert_array_equal(got.numpy(), want.numpy())
    with pytest.raises(sg.errors.UnsupportedOpError, match="uint16 operand|ndarray operand"):
        ours + np.zeros(3, np.uint16)


def test_a_buffer_of_a_dtype_tensors_lack_is_refused_by_name():
    model = sg.nn.Linear(2, 2)
    model.register_buffer("codes", np.arange(4, dtype=np.int16))
    with pytest.raises(StateDictError, match="codes: a buffer of int16"):
        model.state_dict()
    assert model.state_dict(keep_vars=True)["codes"].numpy().dtype == np.int16


# ---- copies, not views ---------------------------------------------------------------------

def test_writing_a_value_leaves_the_model_alone_where_torch_writes_through():
    """torch's values share the parameters' storage; stepgraph's are copies (documented in
    docs/TORCH_COMPAT.md): the same writes change torch's model and leave stepgraph's alone."""
    t32, _, ours = twins()
    want = {k: v.numpy().copy() for k, v in ours.state_dict().items()}
    for fw, model in ((torch, t32), (sg, ours)):
        sd = model.state_dict()
        with fw.no_grad():
            sd["0.weight"].zero_()
            sd["0.bias"].add_(1)
            sd["3.weight"].copy_(fw.ones(CLASSES, HIDDEN))
            sd["3.bias"][0] = 5
        assert not sd["0.weight"].any() and float(sd["3.bias"][0]) == 5
    torch_sd = t32.state_dict()
    assert not torch_sd["0.weight"].any() and float(torch_sd["3.bias"][0]) == 5
    for k, v in ours.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), want[k], err_msg=k)


def test_values_are_a_snapshot_later_steps_do_not_change():
    _, _, ours = twins()
    data = batches(2)
    step = sg.compile_train_step(ours, losses.cross_entropy, optim.SGD(lr=0.5),
                                 example_inputs=data[0], device="cpu")
    taken = ours.state_dict()
    kept = {k: v.numpy().copy() for k, v in taken.items()}
    step(*data[0])
    for k, v in taken.items():
        np.testing.assert_array_equal(v.numpy(), kept[k], err_msg=k)
    assert not np.array_equal(ours.state_dict()["0.weight"].numpy(), kept["0.weight"])


# ---- after training ------------------------------------------------------------------------

def test_a_compiled_steps_model_state_dict_is_its_parameters_and_buffers():
    _, _, ours = twins()
    data = batches(3)
    step = sg.compile_train_step(ours, losses.cross_entropy, optim.Adam(lr=1e-2),
                                 example_inputs=data[0], device="cpu")
    for x, y in data:
        step(x, y)
    sd, held = ours.state_dict(), ours.state_dict(keep_vars=True)
    step_sd = step.state_dict()                        # the step's own: NumPy, as before
    assert list(sd) == list(held) == [k for k in step_sd if not k.startswith("optimizer.")]
    for k, v in sd.items():
        np.testing.assert_array_equal(v.numpy(), held[k].numpy(), err_msg=k)
        assert isinstance(step_sd[k], np.ndarray), k
        np.testing.assert_array_equal(v.numpy(), step_sd[k], err_msg=k)
    assert sd["1.num_batches_tracked"].item() == 3
    for name, p in ours.named_parameters():
        np.testing.assert_array_equal(sd[name].numpy(), p.numpy(), err_msg=name)


def keep_the_best(fw, model, data, dtype, best_at):
    """torch's early-stopping idiom as users write it: clone the state_dict at the best epoch
    (here a fixed one), train on, load the snapshot back. Returns the snapshot, a deepcopy of
    it taken then, and the state after training."""
    F = fw.nn.functional
    opt = fw.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = F.cross_entropy(model(fw.from_numpy(x.astype(dtype))), fw.from_numpy(y))
        loss.backward()
        opt.step()
        if i == best_at:
            best = {k: v.clone() for k, v in model.state_dict().items()}
            deep = copy.deepcopy(model.state_dict())
    final = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(best)
    return best, deep, final


def test_the_best_model_snapshot_restores_it_as_in_torch():
    t32, t64, ours = twins()
    start = state_float64(t32)
    data = batches(6, seed=1)
    runs = {}
    for fw, model, dtype in ((torch, t32, np.float32), (torch, t64, np.float64),
                             (sg, ours, np.float32)):
        best, deep, final = keep_the_best(fw, model, data, dtype, best_at=2)
        restored = model.state_dict()
        assert list(restored) == list(best) == list(deep) == list(final)
        for k in best:
            assert fw.equal(restored[k], best[k]) and fw.equal(deep[k], best[k]), k
        assert not fw.equal(final["0.weight"], best["0.weight"])     # training moved on
        assert int(final["1.num_batches_tracked"]) == 6
        assert int(restored["1.num_batches_tracked"]) == 3
        runs[dtype if fw is torch else "sg"] = state_float64(model)
    assert_state_changes_close(start, runs["sg"], runs[np.float64], runs[np.float32],
                               "restored ", counters=3)


# ---- torch.save / torch.load ---------------------------------------------------------------

def test_saved_state_dict_loads_in_torch_as_its_own_and_back(tmp_path):
    t32, _, ours = twins()
    ours.load_state_dict({k: v * 2 for k, v in t32.state_dict().items()})
    sg.save(ours.state_dict(), tmp_path / "ours.pt")
    torch.save(t32.state_dict(), tmp_path / "theirs.pt")
    got = torch.load(tmp_path / "ours.pt", weights_only=True)
    like = torch.load(tmp_path / "theirs.pt", weights_only=True)
    assert list(got) == list(like)
    for k, v in got.items():
        assert type(v) is type(like[k]) is torch.Tensor and v.dtype == like[k].dtype, k
        assert torch.equal(v, like[k] * 2) if v.is_floating_point() else torch.equal(v, like[k])
    fresh = net(torch)
    fresh.load_state_dict(got)
    again = net(sg)
    again.load_state_dict(sg.load(tmp_path / "ours.pt"))
    for k, v in ours.state_dict().items():
        assert sg.equal(again.state_dict()[k], v), k


class Tied:
    """An embedding and a head sharing one weight (GPT's), in either framework."""

    @staticmethod
    def make(fw):
        class Model(fw.nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = fw.nn.Embedding(7, 4)
                self.head = fw.nn.Linear(4, 7, bias=False)
                self.head.weight = self.emb.weight

        return Model()


def test_a_tied_weight_saves_one_storage_as_torch(tmp_path):
    for fw in (torch, sg):
        fw.save(Tied.make(fw).state_dict(), tmp_path / f"{fw.__name__}.pt")
        loaded = torch.load(tmp_path / f"{fw.__name__}.pt", weights_only=True)
        assert list(loaded) == ["emb.weight", "head.weight"]
        assert loaded["emb.weight"].untyped_storage().data_ptr() == \
            loaded["head.weight"].untyped_storage().data_ptr(), fw.__name__


def test_load_state_dict_takes_tensors_numpy_and_torch_values():
    t32, _, ours = twins()
    sources = {"stepgraph": ours.state_dict(),
               "numpy": {k: v.numpy() * 3 for k, v in t32.state_dict().items()},
               "torch": {k: v * 5 for k, v in t32.state_dict().items()}}
    for name, sd in sources.items():
        model = net(sg)
        model.load_state_dict(sd)
        for k, v in model.state_dict().items():
            np.testing.assert_array_equal(v.numpy(), np.asarray(sd[k]), err_msg=f"{name} {k}")


# ---- the optimizer's state -----------------------------------------------------------------

def train(fw, model, opt, data, dtype=np.float32):
    """The classic loop's steps (cross-entropy) on `data`, inputs in `dtype`; returns `opt`."""
    for x, y in data:
        opt.zero_grad()
        fw.nn.functional.cross_entropy(model(fw.from_numpy(x.astype(dtype))),
                                       fw.from_numpy(y)).backward()
        opt.step()
    return opt


@pytest.mark.parametrize("make", [
    lambda fw, ps: fw.optim.Adam(ps, lr=1e-2), lambda fw, ps: fw.optim.AdamW(ps, lr=1e-2),
    lambda fw, ps: fw.optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda fw, ps: fw.optim.RMSprop(ps, lr=1e-2, momentum=0.5),
    lambda fw, ps: fw.optim.Adagrad(ps, lr=0.1)], ids=["adam", "adamw", "sgd", "rmsprop",
                                                       "adagrad"])
def test_optimizer_state_values_are_tensors_as_torchs(make):
    t32, t64, ours = twins(mlp)
    data = batches(3, seed=2)
    theirs = train(torch, t32, make(torch, t32.parameters()), data).state_dict()["state"]
    theirs64 = train(torch, t64, make(torch, t64.parameters()), data,
                     np.float64).state_dict()["state"]
    opt = train(sg, ours, make(sg, ours.parameters()), data)
    got = opt.state_dict()["state"]
    assert set(got) == set(theirs)
    for i, entry in theirs.items():
        for k, v in entry.items():
            value = got[i][k]
            assert isinstance(value, sg.Tensor) and isinstance(v, torch.Tensor), (i, k)
            assert str(value.dtype) == str(v.dtype).removeprefix("torch."), (i, k)
            assert value.shape == v.shape, (i, k)
            assert_close_to_reference(value.numpy(), theirs64[i][k].numpy(), v.numpy(),
                                      f"{i} {k}")
        if "step" in entry:                      # torch's: a 0-d float32 tensor
            assert got[i]["step"].shape == () and got[i]["step"].item() == 3.0
    p = next(iter(ours.parameters()))
    assert all(isinstance(v, sg.Tensor) for v in opt.state[p].values())


def test_an_optimizer_state_dict_of_tensors_or_numpy_loads_and_continues_alike():
    """A model and Adam state_dict taken after 3 steps, loaded into a fresh model and
    optimizer (the state's values as given, or as NumPy arrays): 2 more steps end where the
    original's 2 more steps end, bit for bit."""
    data = batches(5, seed=3)
    _, _, ours = twins()
    opt = train(sg, ours, sg.optim.Adam(ours.parameters(), lr=1e-2), data[:3])
    saved = copy.deepcopy(opt.state_dict())
    middle = {k: v.clone() for k, v in ours.state_dict().items()}
    train(sg, ours, opt, data[3:])
    want = ours.state_dict()
    as_numpy = copy.deepcopy(saved)
    as_numpy["state"] = {i: {k: v.numpy() for k, v in e.items()}
                         for i, e in saved["state"].items()}
    for what, state in (("tensors", saved), ("numpy", as_numpy)):
        fresh = net(sg)
        fresh.load_state_dict(middle)
        opt2 = sg.optim.Adam(fresh.parameters(), lr=1e-2)
        opt2.load_state_dict(state)
        train(sg, fresh, opt2, data[3:])
        assert opt2.state_dict()["state"][0]["step"].item() == 5.0
        for k, v in fresh.state_dict().items():
            assert sg.equal(v, want[k]), f"{what} {k}"
