"""The nn.Module API against torch.nn on twin model structures: walking orders, lookups,
registration, apply, containers, state_dict strictness, repr, Parameter attributes and the
placement/precision methods."""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
import torch

from stepgraph import StateDictError, UnsupportedOpError, nn


def twins(lib):
    """The same structure built with stepgraph.nn or torch.nn: nesting, a shared module, a
    ModuleDict, a ParameterList, a registered None, a buffer."""

    class Block(lib.Module):
        def __init__(self, shared):
            super().__init__()
            self.shared = shared
            self.fc = lib.Linear(4, 4, bias=False)
            self.norm = lib.LayerNorm(4)
            self.register_parameter("gate", lib.Parameter(lib_tensor(lib, np.ones(4))))
            self.register_parameter("unused", None)

    class Net(lib.Module):
        def __init__(self):
            super().__init__()
            shared = lib.Linear(4, 4)
            self.embed = lib.Linear(3, 4)
            self.blocks = lib.ModuleList([Block(shared), Block(shared)])
            self.heads = lib.ModuleDict({"a": lib.Linear(4, 2), "b": lib.Sequential(
                lib.ReLU(), lib.Linear(4, 1))})
            self.scales = lib.ParameterList([lib.Parameter(lib_tensor(lib, np.ones(2)))] * 2)
            self.register_buffer("mask", lib_tensor(lib, np.ones(3)))

    return Net()


def lib_tensor(lib, array):
    return torch.tensor(array, dtype=torch.float32) if lib is torch.nn else array


def names(pairs):
    return [k for k, _ in pairs]


def test_walking_orders_match_torch():
    sg, tm = twins(nn), twins(torch.nn)
    assert names(sg.named_modules()) == names(tm.named_modules())
    assert names(sg.named_modules(remove_duplicate=False)) == names(
        tm.named_modules(remove_duplicate=False))
    assert names(sg.named_modules(prefix="m")) == names(tm.named_modules(prefix="m"))
    for kwargs in [{}, {"remove_duplicate": False}, {"recurse": False}, {"prefix": "net"}]:
        assert names(sg.named_parameters(**kwargs)) == names(tm.named_parameters(**kwargs)), \
            kwargs
        assert names(sg.named_buffers(**kwargs)) == names(tm.named_buffers(**kwargs)), kwargs
    assert names(sg.named_children()) == names(tm.named_children())
    assert names(sg.blocks[0].named_parameters(recurse=False)) == ["gate"]
    assert len(list(sg.parameters())) == len(list(tm.parameters()))
    assert list(sg.state_dict()) == list(tm.state_dict())


def test_a_memo_skips_modules_already_listed():
    sg = twins(nn)
    memo = {id(sg.embed)}
    assert "embed" not in names(sg.named_modules(memo))


def test_apply_visits_children_first_and_returns_self():
    sg, tm = twins(nn), twins(torch.nn)
    seen, tseen = [], []
    assert sg.apply(lambda m: seen.append(type(m).__name__)) is sg
    tm.apply(lambda m: tseen.append(type(m).__name__))
    assert seen == tseen and seen[-1] == "Net"


def test_lookups_by_dotted_path():
    sg = twins(nn)
    assert sg.get_submodule("blocks.1.fc") is sg.blocks[1].fc
    assert sg.get_submodule("") is sg
    assert sg.get_parameter("heads.b.1.weight") is sg.heads["b"][1].weight
    assert sg.get_buffer("mask") is sg.mask
    with pytest.raises(AttributeError, match="blocks.1 has no submodule 'nope'"):
        sg.get_submodule("blocks.1.nope.fc")
    with pytest.raises(AttributeError, match="has no parameter 'bias'"):
        sg.get_parameter("blocks.0.fc.bias")


def test_registration_and_reassignment():
    m = nn.Module()
    m.add_module("body", nn.Linear(2, 2))
    m.register_module("head", nn.Linear(2, 1))
    m.register_parameter("scale", nn.Parameter(np.ones(1)))
    assert list(m.state_dict()) == ["scale", "body.weight", "body.bias", "head.weight",
                                    "head.bias"]
    m.body.bias = None                           # as torch: the key goes away
    del m.head
    assert list(m.state_dict()) == ["scale", "body.weight"]
    with pytest.raises(TypeError, match="is not a Module subclass"):
        m.register_module("x", 3)
    with pytest.raises(TypeError, match="cannot assign ndarray as parameter 'w'"):
        m.register_parameter("w", np.ones(2))
    with pytest.raises(KeyError, match="without '.'"):
        m.register_parameter("a.b", None)


def test_sequential_and_module_list_index_slice_insert_and_delete_as_torch():
    layers = lambda lib: [lib.Linear(1, i + 1) for i in range(4)]   # noqa: E731
    seq, tseq = nn.Sequential(*layers(nn)), torch.nn.Sequential(*layers(torch.nn))
    for lib_seq in (seq, tseq):
        lib_seq.append(type(lib_seq[0])(1, 9))
        lib_seq.insert(1, type(lib_seq[0])(1, 7))
        del lib_seq[0]
    assert len(seq) == len(tseq) == 5
    assert list(seq.state_dict()) == list(tseq.state_dict())
    assert [m.out_features for m in seq] == [m.out_features for m in tseq]
    assert [m.out_features for m in seq[1:4]] == [m.out_features for m in tseq[1:4]]
    assert list(seq[1:4].state_dict()) == list(tseq[1:4].state_dict())
    assert seq[-1].out_features == 9
    with pytest.raises(IndexError, match="out of range"):
        seq[5]

    ml, tml = nn.ModuleList(layers(nn)), torch.nn.ModuleList(layers(torch.nn))
    for lib_ml, lib in ((ml, nn), (tml, torch.nn)):
        lib_ml.extend([lib.ReLU()])
        lib_ml += [lib.Tanh()]
        lib_ml.insert(0, lib.Identity())
        del lib_ml[2]
        lib_ml[1] = lib.Linear(1, 5)
    assert [type(m).__name__ for m in ml] == [type(m).__name__ for m in tml]
    assert list(ml.state_dict()) == list(tml.state_dict())
    assert isinstance(ml[1:], nn.ModuleList) and len(ml[1:]) == len(tml) - 1


def test_sequential_from_an_ordered_dict_keeps_its_keys():
    seq = nn.Sequential(OrderedDict([("conv", nn.Conv2d(1, 2, 3)), ("act", nn.ReLU())]))
    assert list(seq.state_dict()) == ["conv.weight", "conv.bias"]
    assert isinstance(seq[0], nn.Conv2d) and isinstance(seq[-1], nn.ReLU)


def test_module_dict_and_parameter_containers_as_torch():
    md = nn.ModuleDict({"a": nn.Linear(1, 1)})
    md["b"] = nn.ReLU()
    assert list(md) == ["a", "b"] and "b" in md and len(md) == 2
    assert md.pop("a") is not None and list(md.keys()) == ["b"]
    md.clear()
    assert len(md) == 0
    pl = nn.ParameterList([np.zeros(2), nn.Parameter(np.ones(3))])
    pl.append(np.ones(1))
    tpl = torch.nn.ParameterList([torch.zeros(2), torch.ones(3), torch.ones(1)])
    assert list(pl.state_dict()) == list(tpl.state_dict())
    assert all(isinstance(p, nn.Parameter) for p in pl) and pl[-1].shape == (1,)
    pd = nn.ParameterDict({"w": np.ones((2, 2))})
    pd["b"] = nn.Parameter(np.zeros(2))
    assert list(pd.state_dict()) == ["w", "b"] and pd["w"].shape == (2, 2)


def test_load_state_dict_reports_missing_and_unexpected_keys():
    sg = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    sd = sg.state_dict()
    partial = {k: v for k, v in sd.items() if k != "1.bias"}
    partial["extra"] = np.zeros(1)
    with pytest.raises(StateDictError, match=r"missing keys \['1.bias'\], unexpected keys "
                                             r"\['extra'\]"):
        sg.load_state_dict(partial)
    partial["0.weight"] = np.full((3, 2), 4.0)
    result = sg.load_state_dict(partial, strict=False)
    assert result.missing_keys == ["1.bias"] and result.unexpected_keys == ["extra"]
    assert (sg.state_dict()["0.weight"] == 4.0).all()
    tm = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    want = tm.load_state_dict({k: torch.tensor(np.asarray(v)) for k, v in partial.items()},
                              strict=False)
    assert (result.missing_keys, result.unexpected_keys) == (want.missing_keys,
                                                             want.unexpected_keys)
    with pytest.raises(StateDictError, match="0.weight: expected shape"):
        sg.load_state_dict({**sd, "0.weight": np.zeros((2, 2))}, strict=False)


def test_repr_matches_torch():
    def build(lib):
        return lib.Sequential(
            lib.Conv2d(3, 8, 3, padding=1, bias=False), lib.BatchNorm2d(8), lib.ReLU(),
            lib.MaxPool2d(2), lib.Dropout(0.1),
            lib.Sequential(lib.Flatten(), lib.Linear(8, 6), lib.GELU(), lib.LayerNorm(6),
                           lib.LeakyReLU(), lib.LogSoftmax(dim=1)),
            lib.ModuleDict({"emb": lib.Embedding(10, 4)}))

    assert repr(build(nn)) == repr(build(torch.nn))


def test_parameter_attributes():
    p = nn.Parameter(np.ones((3, 4)))
    assert (p.numel(), p.dim(), p.size(), p.size(1), p.size(-1)) == (12, 2, (3, 4), 4, 4)
    assert p.shape == (3, 4) and p.dtype == "float32" and p.requires_grad
    assert p.data is p and np.asarray(p).shape == (3, 4)
    frozen = nn.Parameter(np.zeros(2), requires_grad=False)
    assert not frozen.requires_grad and frozen.requires_grad_() is frozen and \
        frozen.requires_grad
    assert nn.Parameter(torch.ones(2, requires_grad=True)).numpy().tolist() == [1.0, 1.0]
    assert nn.Parameter([[1, 2]]).shape == (1, 2)
    with pytest.raises(IndexError, match="dim 2 out of range"):
        p.size(2)


def test_a_zero_d_parameter_stays_zero_d_and_loads_from_torch():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(np.float32(2.0))

    m = Scaled()
    assert m.scale.shape == () and m.state_dict()["scale"].shape == ()
    m.load_state_dict({"scale": torch.tensor(5.0)})
    assert float(m.state_dict()["scale"]) == 5.0


def test_requires_grad_zero_grad_and_placement_hints():
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    assert m[0].requires_grad_(False) is m[0]
    assert [p.requires_grad for p in m.parameters()] == [False, False, True, True]
    assert m.to("cuda") is m and m.cuda() is m and m.cpu() is m and m.float() is m
    assert m.to("cpu", np.float32) is m and m.to(dtype="float32", non_blocking=True) is m
    assert m.to(torch.float32) is m and m.to(torch.device("cuda:0")) is m
    assert m.zero_grad() is None and m.zero_grad(set_to_none=False) is None
    for method in ("bfloat16", "double"):
        with pytest.raises(UnsupportedOpError, match="precision='bf16'"):
            getattr(m, method)()
    with pytest.raises(UnsupportedOpError, match="asked for float64"):
        m.to(np.float64)
    assert m.train() is m and m[1].training and m.eval() is m and not m[1].training


def test_assigning_a_plain_array_to_a_parameter_name_is_refused():
    lin = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="cannot assign ndarray as parameter 'weight'"):
        lin.weight = np.zeros((2, 2))
    lin.weight.data = np.zeros((2, 2))           # the in-place way
    assert not lin.state_dict()["weight"].any()


def test_non_persistent_buffer_is_bound_but_not_in_the_state_dict():
    import stepgraph as sg

    def build(lib):
        class Masked(lib.Module):
            def __init__(self):
                super().__init__()
                self.fc = lib.Linear(3, 3)
                self.register_buffer("mask", lib_tensor(lib, [1.0, 0.0, 2.0]), persistent=False)

            def forward(self, x):
                return self.fc(x) * self.mask

        return Masked()

    m, tm = build(nn), build(torch.nn)
    assert list(m.state_dict()) == list(tm.state_dict()) == ["fc.weight", "fc.bias"]
    assert names(m.named_buffers()) == names(tm.named_buffers()) == ["mask"]
    tm.load_state_dict({k: torch.tensor(v.numpy()) for k, v in m.state_dict().items()})
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    got = sg.compile_predict(m, example_inputs=(x,))(x)
    np.testing.assert_allclose(got, tm(torch.tensor(x)).detach().numpy(), rtol=1e-6, atol=1e-6)
    assert not got[:, 1].any()
