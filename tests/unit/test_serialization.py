"""torch.save / torch.load in torch's file format: files stepgraph writes load in torch 2.x
(weights_only and not), files torch writes load in stepgraph, and hostile pickles are refused
without running anything."""
from __future__ import annotations

import io
import os
import pickle
import struct
import zipfile
from collections import OrderedDict

import numpy as np
import pytest
import torch

import stepgraph as sg
from stepgraph.errors import StepgraphError
from stepgraph.ir.trace import tensor_of
from stepgraph.serialization import SerializationError, UnsafePickleError

DTYPES = ["float32", "float64", "int64", "int32", "uint8", "bool", "bfloat16", "float16"]


def _values(dtype: str, shape, seed: int = 0) -> torch.Tensor:
    """Random torch values of `dtype` (bfloat16: random bits of finite values)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == "bool":
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype in ("uint8", "int32", "int64"):
        low = 0 if dtype == "uint8" else -1000
        return torch.randint(low, 255, shape, generator=g, dtype=getattr(torch, dtype))
    return torch.randn(shape, generator=g, dtype=torch.float64).to(getattr(torch, dtype)) * 7


def _bits(t: torch.Tensor) -> np.ndarray:
    """A torch tensor's values exactly: bfloat16 as its uint16 bits (as stepgraph holds it)."""
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _same(ours: sg.Tensor, theirs: torch.Tensor) -> None:
    assert isinstance(ours, sg.Tensor) and ours.is_eager
    assert str(ours.dtype) == str(theirs.dtype).removeprefix("torch.")
    assert tuple(ours.shape) == tuple(theirs.shape)
    assert ours.array.dtype == _bits(theirs).dtype
    np.testing.assert_array_equal(ours.array, _bits(theirs))


def _from_torch(t: torch.Tensor) -> sg.Tensor:
    return tensor_of(_bits(t).copy())


# ------------------------------------------------------------ stepgraph -> torch


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 4), (), (0,), (2, 0, 3)])
def test_stepgraph_to_torch_every_dtype(tmp_path, dtype, shape):
    expected = _values(dtype, shape)
    path = tmp_path / "t.pt"
    sg.save({"x": _from_torch(expected)}, path)
    for weights_only in (True, False):
        got = torch.load(path, weights_only=weights_only)["x"]
        assert got.dtype == expected.dtype and got.shape == expected.shape
        np.testing.assert_array_equal(_bits(got), _bits(expected))
    if dtype != "bfloat16":       # NumPy arrays (model.state_dict()'s values) save as tensors
        sg.save([expected.numpy()], str(path))
        got = torch.load(path)[0]
        assert got.dtype == expected.dtype and got.shape == expected.shape
        np.testing.assert_array_equal(got.numpy(), expected.numpy())


def test_nested_containers_and_scalars_reach_torch(tmp_path):
    obj = OrderedDict(a=[1, -2, 2 ** 40, -2 ** 70, 2.5, float("inf"), "é\n", None, True],
                      b=(3, (4.0, "x"), []), c={"k": {1: None, (1, 2): b"\x00\xff"}},
                      d=np.float32(1.5), e=np.int64(7), f={1, 2}, g=1 + 2j,
                      h=sg.Size([2, 3]), i=sg.bfloat16, j=sg.device("cuda", 1))
    sg.save(obj, tmp_path / "c.pt")
    got = torch.load(tmp_path / "c.pt", weights_only=True)
    assert type(got) is OrderedDict and list(got) == list(obj)
    assert got["a"] == obj["a"] and got["b"] == obj["b"] and got["c"] == obj["c"]
    assert type(got["d"]) is float and got["d"] == 1.5 and type(got["e"]) is int
    assert got["f"] == {1, 2} and got["g"] == 1 + 2j
    assert got["h"] == torch.Size([2, 3]) and isinstance(got["h"], torch.Size)
    assert got["i"] is torch.bfloat16 and got["j"] == torch.device("cuda", 1)
    assert sg.load(tmp_path / "c.pt") == obj         # and back


def test_shared_and_many_containers_round_trip(tmp_path):
    shared = [1, 2]
    obj = {"s1": shared, "s2": shared, "many": [{"i": i, "t": (i,)} for i in range(300)]}
    sg.save(obj, tmp_path / "m.pt")                  # past 256 memo slots (LONG_BINPUT)
    for got in (torch.load(tmp_path / "m.pt"), sg.load(tmp_path / "m.pt")):
        assert got == obj and got["s1"] is got["s2"]


def test_save_and_load_need_no_torch(tmp_path):
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None\n"
            "import numpy as np, stepgraph as sg\n"
            f"sg.save({{'w': sg.ones(2).bfloat16(), 'n': [1]}}, {str(tmp_path / 'n.pt')!r})\n"
            f"r = sg.load({str(tmp_path / 'n.pt')!r})\n"
            "assert r['n'] == [1] and r['w'].dtype == sg.bfloat16\n"
            "assert 'torch' not in [m.split('.')[0] for m in sys.modules if sys.modules[m]]")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)
    assert torch.load(tmp_path / "n.pt")["w"].tolist() == [1.0, 1.0]


def test_parameters_and_buffers_save_as_torch_does(tmp_path):
    weight = sg.nn.Parameter(np.arange(6, dtype=np.float32).reshape(2, 3))
    frozen = sg.nn.Parameter(np.ones(2, np.float32), requires_grad=False)
    count = sg.nn.Buffer(np.array(5, np.int64))
    sg.save({"w": weight, "f": frozen, "n": count}, tmp_path / "p.pt")
    got = torch.load(tmp_path / "p.pt")
    assert isinstance(got["w"], torch.nn.Parameter) and got["w"].requires_grad
    assert isinstance(got["f"], torch.nn.Parameter) and not got["f"].requires_grad
    np.testing.assert_array_equal(got["w"].detach().numpy(), weight.numpy())
    assert got["n"].dtype == torch.int64 and got["n"].shape == () and int(got["n"]) == 5
    back = sg.load(tmp_path / "p.pt")
    assert isinstance(back["w"], sg.nn.Parameter) and not back["f"].requires_grad
    np.testing.assert_array_equal(back["w"].numpy(), weight.numpy())


def test_the_same_array_twice_is_one_storage(tmp_path):
    a = np.arange(4, dtype=np.float32)
    sg.save({"x": a, "y": a, "z": a.copy()}, tmp_path / "s.pt")
    records = [n for n in zipfile.ZipFile(tmp_path / "s.pt").namelist() if "/data/" in n]
    assert len(records) == 2
    got = torch.load(tmp_path / "s.pt")
    assert got["x"].data_ptr() == got["y"].data_ptr() != got["z"].data_ptr()


def test_storages_are_aligned_as_torch_writes_them(tmp_path):
    """Each storage at a 64-byte offset, laid out as torch's writer lays them out: torch's
    mmap load with offsets computed from its own layout rules reads the right bytes."""
    from torch.utils.serialization import config

    state = {f"w{i}": np.random.default_rng(i).standard_normal((i + 1, 5)).astype(np.float32)
             for i in range(4)}
    sg.save(state, tmp_path / "a.pt")
    raw = (tmp_path / "a.pt").read_bytes()
    for info in zipfile.ZipFile(tmp_path / "a.pt").infolist():
        if "/data/" in info.filename:
            name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26:][:4])
            assert (info.header_offset + 30 + name_len + extra_len) % 64 == 0
    before = config.load.calculate_storage_offsets
    try:
        for calculate in (False, True):
            config.load.calculate_storage_offsets = calculate
            got = torch.load(tmp_path / "a.pt", mmap=True, weights_only=True)
            for key, value in state.items():
                np.testing.assert_array_equal(got[key].numpy(), value)
    finally:
        config.load.calculate_storage_offsets = before


def test_file_objects_both_ways():
    x = _values("float32", (2, 3))
    buffer = io.BytesIO()
    sg.save({"x": _from_torch(x)}, buffer)
    buffer.seek(0)
    np.testing.assert_array_equal(torch.load(buffer)["x"].numpy(), x.numpy())

    class WriteOnly:                          # a pipe: no seek, no tell
        def __init__(self):
            self.parts = []

        def write(self, data):
            self.parts.append(bytes(data))

    class ReadOnly:
        def __init__(self, data):
            self.f = io.BytesIO(data)

        def read(self, n=-1):
            return self.f.read(n)

    pipe = WriteOnly()
    sg.save([_from_torch(x)], pipe)
    data = b"".join(pipe.parts)
    np.testing.assert_array_equal(torch.load(io.BytesIO(data))[0].numpy(), x.numpy())
    buffer = io.BytesIO()
    torch.save([x], buffer)
    _same(sg.load(ReadOnly(buffer.getvalue()))[0], x)


def test_unsupported_objects_are_not_saved(tmp_path):
    with pytest.raises(SerializationError, match="cannot save a .*Path"):
        sg.save({"x": tmp_path}, tmp_path / "bad.pt")
    with pytest.raises(SerializationError, match="uint16 array is ambiguous"):
        sg.save(np.zeros(2, np.uint16), tmp_path / "bad.pt")
    with pytest.raises(SerializationError, match="int16"):
        sg.save(np.zeros(2, np.int16), tmp_path / "bad.pt")


# ------------------------------------------------------------ torch -> stepgraph


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 5), (), (0,), (3, 0)])
def test_torch_to_stepgraph_every_dtype(tmp_path, dtype, shape):
    expected = _values(dtype, shape, seed=1)
    torch.save({"x": expected, "nested": [expected, (expected,)]}, tmp_path / "t.pt")
    got = sg.load(tmp_path / "t.pt")
    _same(got["x"], expected)
    _same(got["nested"][1][0], expected)
    assert got["x"].array.flags.writeable and got["x"].array.flags.owndata   # not the file


def test_views_saved_by_torch_load_with_their_offsets_and_strides(tmp_path):
    base = torch.arange(60, dtype=torch.float64).reshape(5, 12)
    views = {"tail": base[1:, ::2], "t": base.t(), "row": base[3], "elem": base[2, 7],
             "expanded": torch.arange(3.0).expand(4, 3), "base": base,
             "bf16": base.bfloat16()[::2, 3:9:3], "bool": (base > 30)[:, 5:]}
    torch.save(views, tmp_path / "v.pt")
    got = sg.load(tmp_path / "v.pt")
    for key, view in views.items():
        _same(got[key], view)
    got["base"].array[0, 0] = -1              # copies: views do not alias after loading
    assert got["tail"].array[0, 0] == 12 and got["t"].array[0, 0] == 0


def _twin(nn):
    """The same model in torch.nn or stepgraph.nn (the same state_dict keys by design)."""
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def test_a_torch_state_dict_loads_into_the_stepgraph_model_and_back(tmp_path):
    torch.manual_seed(0)
    theirs = _twin(torch.nn)
    theirs.train()
    theirs(torch.randn(16, 4))                # running statistics and num_batches_tracked
    torch.save(theirs.state_dict(), tmp_path / "model.pt")
    ours = _twin(sg.nn)
    ours.load_state_dict(sg.load(tmp_path / "model.pt", map_location="cpu"))
    for key, value in theirs.state_dict().items():
        np.testing.assert_array_equal(ours.state_dict()[key], value.numpy())
    assert list(ours.state_dict()) == list(theirs.state_dict())

    sg.save(ours.state_dict(), tmp_path / "ours.pt")       # eager tensors -> torch tensors
    again = _twin(torch.nn)
    again.load_state_dict(torch.load(tmp_path / "ours.pt", weights_only=True))
    for key, value in theirs.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key


def test_a_torch_optimizer_state_dict_loads(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.9))
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    expected = opt.state_dict()
    got = sg.load(tmp_path / "opt.pt", map_location=torch.device("cpu"))
    assert got["param_groups"] == expected["param_groups"]
    for i, state in expected["state"].items():
        for key, value in state.items():
            _same(got["state"][i][key], value)


@pytest.mark.parametrize("map_location", ["cpu", "cuda", "cuda:1", {"cuda:0": "cpu"},
                                          lambda storage, location: storage, sg.device("cpu")])
def test_map_location_and_weights_only_are_accepted(tmp_path, map_location):
    x = _values("float32", (3,))
    torch.save(x, tmp_path / "x.pt")
    for weights_only in (None, True, False):
        _same(sg.load(tmp_path / "x.pt", map_location, weights_only=weights_only), x)


def test_torch_parameters_load_as_parameters(tmp_path):
    torch.save({"w": torch.nn.Parameter(torch.ones(2, 2)),
                "d": torch.nn.Parameter(torch.ones(2, dtype=torch.float64))}, tmp_path / "p.pt")
    got = sg.load(tmp_path / "p.pt")
    assert isinstance(got["w"], sg.nn.Parameter) and got["w"].requires_grad
    assert isinstance(got["d"], sg.Tensor) and got["d"].dtype == sg.float64


def test_the_legacy_format_loads(tmp_path):
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    obj = {"view": base[1:, 1::2], "i": torch.tensor([1, 2], dtype=torch.int32),
           "b": base.bfloat16(), "p": torch.nn.Parameter(base[0].clone()), "n": [1, "a"]}
    torch.save(obj, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    got = sg.load(tmp_path / "old.pt")
    for key in ("view", "i", "b"):
        _same(got[key], obj[key])
    np.testing.assert_array_equal(got["p"].numpy(), base[0].numpy())
    assert got["n"] == [1, "a"]


def test_a_big_endian_file_loads(tmp_path):
    """A file torch wrote on a big-endian machine: its `byteorder` record says so and its
    storages hold big-endian bytes (made here from a little-endian one)."""
    obj = {"f": _values("float32", (2, 3)), "l": _values("int64", (4,)),
           "b": _values("bfloat16", (3,)), "m": _values("bool", (2,))}
    torch.save(obj, tmp_path / "le.pt")
    dtypes = {"f": ">f4", "l": ">i8", "b": ">u2", "m": "|b1"}
    loaded = torch.load(tmp_path / "le.pt")
    keys = {}                                 # storage key of each entry
    with zipfile.ZipFile(tmp_path / "le.pt") as source:
        (prefix,) = {n.split("/")[0] for n in source.namelist()}
        pickled = source.read(f"{prefix}/data.pkl")
        for name, tensor in loaded.items():
            raw = _bits(tensor).astype(dtypes[name]).tobytes()
            keys[next(n for n in source.namelist() if "/data/" in n
                      and source.read(n) == _bits(tensor).tobytes())] = raw
        with zipfile.ZipFile(tmp_path / "be.pt", "w") as out:
            out.writestr(f"{prefix}/data.pkl", pickled)
            out.writestr(f"{prefix}/byteorder", "big")
            out.writestr(f"{prefix}/version", "3\n")
            for name, raw in keys.items():
                out.writestr(name, raw)
    assert len(keys) == 4
    assert torch.equal(torch.load(tmp_path / "be.pt")["f"], obj["f"])    # torch agrees
    got = sg.load(tmp_path / "be.pt")
    for key, value in obj.items():
        _same(got[key], value)


def test_dtypes_stepgraph_tensors_lack_are_refused_by_name(tmp_path):
    torch.save({"h": torch.ones(2, dtype=torch.int16)}, tmp_path / "h.pt")
    with pytest.raises(SerializationError, match="a tensor of int16"):
        sg.load(tmp_path / "h.pt")


def test_files_of_other_formats_are_refused(tmp_path):
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(SerializationError, match="not a file torch.save writes"):
        sg.load(tmp_path / "junk.pt")
    (tmp_path / "plain.pkl").write_bytes(pickle.dumps({"a": 1}, protocol=2))
    with pytest.raises(SerializationError, match="legacy format starts with"):
        sg.load(tmp_path / "plain.pkl")


# ------------------------------------------------------------ hostile pickles


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class _Anything:
    pass


def _zip_with(data_pkl: bytes) -> io.BytesIO:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("archive/data.pkl", data_pkl)
        archive.writestr("archive/version", "3\n")
    buffer.seek(0)
    return buffer


@pytest.mark.parametrize("weights_only", [None, True, False])
def test_a_pickle_that_runs_code_is_refused_and_nothing_runs(tmp_path, weights_only):
    marker = tmp_path / "ran"
    payload = pickle.dumps({"w": [1, _RunsCode(marker)]}, protocol=2)
    pickle.loads(pickle.dumps(_RunsCode(tmp_path / "live"), protocol=2))
    assert (tmp_path / "live").exists()       # the payload is live under plain pickle
    with pytest.raises(UnsafePickleError) as info:
        sg.load(_zip_with(payload), weights_only=weights_only)
    message = str(info.value)
    assert f"the global {os.system.__module__}.system" in message
    assert "only tensors and plain containers" in message
    assert "weights_only=False does not change this" in message
    assert isinstance(info.value, StepgraphError) and isinstance(info.value,
                                                                 pickle.UnpicklingError)
    assert not marker.exists()

    legacy = b"".join(pickle.dumps(x, protocol=2) for x in (
        0x1950A86A20F9469CFC6C, 1001, {"little_endian": True}, _RunsCode(marker), []))
    with pytest.raises(UnsafePickleError, match="system"):
        sg.load(io.BytesIO(legacy))
    assert not marker.exists()


def test_an_unknown_class_is_refused_by_name():
    payload = pickle.dumps(OrderedDict(x=_Anything()), protocol=2)
    with pytest.raises(UnsafePickleError, match=f"the global {__name__}._Anything: only "
                                                "tensors and plain containers"):
        sg.load(_zip_with(payload))


def test_a_pickle_cannot_change_the_loader():
    """BUILD on the objects the unpickler hands out (a storage kind shared by every load, an
    allowed global) is refused, and a later load is unaffected."""
    x = b"X\x01\x00\x00\x00x"
    for target in (b"ctorch\nFloatStorage\n", b"ccollections\nOrderedDict\n"):
        with pytest.raises(UnsafePickleError, match="a BUILD of"):
            sg.load(_zip_with(b"\x80\x02" + target + b"(" + x + x + b"K\x01tb."))
    buffer = io.BytesIO()
    torch.save(OrderedDict(a=torch.ones(2)), buffer)
    buffer.seek(0)
    np.testing.assert_array_equal(sg.load(buffer)["a"].numpy(), np.ones(2, np.float32))


def test_a_half_model_state_dict_round_trips_both_ways(tmp_path):
    """model.half()'s float16 parameters and buffers: stepgraph's save loads in torch (a
    Parameter as nn.Parameter) with the same bits, torch's half state_dict loads into the
    stepgraph model; non-finite and subnormal float16 values survive."""
    ours = sg.nn.Sequential(sg.nn.Linear(3, 4), sg.nn.BatchNorm1d(4)).half()
    theirs = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).half()
    special = np.array([np.inf, -np.inf, 6e-8, 65504.0], np.float16)
    ours[1].weight.storage[...] = special
    sg.save({"sd": ours.state_dict(), "w": ours[0].weight}, tmp_path / "ours.pt")
    got = torch.load(tmp_path / "ours.pt")
    assert isinstance(got["w"], torch.nn.Parameter) and got["w"].dtype == torch.float16
    theirs.load_state_dict(got["sd"])
    for key, value in ours.state_dict().items():
        assert str(theirs.state_dict()[key].dtype).removeprefix("torch.") == str(value.dtype)
        np.testing.assert_array_equal(theirs.state_dict()[key].numpy(), value)
    with torch.no_grad():
        theirs[0].weight.mul_(3)
    torch.save(theirs.state_dict(), tmp_path / "theirs.pt")
    loaded = sg.load(tmp_path / "theirs.pt")
    assert loaded["0.weight"].dtype == sg.float16
    ours.load_state_dict(loaded)
    np.testing.assert_array_equal(ours[0].weight.numpy(), theirs[0].weight.detach().numpy())
    np.testing.assert_array_equal(ours[1].weight.numpy(), special)
