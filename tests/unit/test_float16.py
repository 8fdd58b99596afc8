"""float16 (torch.half) on the NumPy backend: an IR dtype computed in float32 and rounded once
where a node stores it, `torch.autocast(dtype=torch.float16)` (precision="fp16") and
`model.half()` training, each against torch's own float16 on the CPU, judged by the tolerance
policy (float64 reference; the bound a small multiple of torch float16's error)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import stepgraph as sg
from stepgraph.errors import UnsupportedPrecisionError
from tests.reference import assert_close_to_reference, state_float64
from tests.unit.test_grad_scaler import batches, twins


def test_float16_tensors_round_once_after_float32_compute():
    gen = np.random.default_rng(0)
    a = gen.standard_normal((16, 64)).astype(np.float16)
    b = gen.standard_normal((64, 8)).astype(np.float16)
    got = (sg.from_numpy(a) @ sg.from_numpy(b)).numpy()
    assert got.dtype == np.float16
    want = (a.astype(np.float32) @ b.astype(np.float32)).astype(np.float16)   # one rounding
    np.testing.assert_array_equal(got, want)
    theirs = (torch.from_numpy(a) @ torch.from_numpy(b)).numpy()
    ulp = np.spacing(np.abs(want)).astype(np.float32)
    assert np.all(np.abs(got.astype(np.float32) - theirs.astype(np.float32)) <= ulp)
    x = sg.from_numpy(gen.standard_normal(8).astype(np.float32))
    assert x.half().dtype == sg.float16 == sg.half and x.half().float().dtype == sg.float32
    assert x.to(sg.float16).numpy().dtype == np.float16
    assert sg.finfo(sg.float16).eps == 2.0 ** -10 and sg.finfo(sg.half).max == 65504.0


def judge(start, t16, t64, ours, untrained=()):
    """Changes of every floating state entry within 4x torch float16's error of float64's."""
    s16, s64, ssg = state_float64(t16), state_float64(t64), state_float64(ours)
    for k in s64:
        c64 = s64[k] - start[k]
        assert k in untrained or np.abs(c64).max() > 1e-4, f"{k} did not train"
        assert_close_to_reference(ssg[k] - start[k], c64, s16[k] - start[k], f"change of {k}",
                                  precision=np.float16)


def test_autocast_float16_loop_as_torch_autocast():
    t16, t64, ours = twins(norm=False)
    start = state_float64(t16)
    data = batches(4)

    def loop(fw, model, dtype, autocast):
        opt = fw.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for x, y in data:
            opt.zero_grad()
            with fw.autocast("cpu", dtype=fw.float16, enabled=autocast):
                out = model(fw.from_numpy(x.astype(dtype)))
                if fw is torch:     # stepgraph's traced dtypes are autocast at compile time
                    assert out.dtype == (fw.float16 if autocast else fw.float64)
                loss = fw.nn.functional.cross_entropy(out, fw.from_numpy(y))
            loss.backward()
            opt.step()

    loop(torch, t16, np.float32, True)
    loop(torch, t64, np.float64, False)
    loop(sg, ours, np.float32, True)
    from stepgraph.loop.hooks import SESSION
    assert SESSION.last_step.precision == "fp16"
    assert all(v.dtype == sg.float32 for v in ours.state_dict().values())
    judge(start, t16, t64, ours)


def half_net(fw, model):
    """airbench's way: the whole net in float16, then its BatchNorms back in float32."""
    model.half()
    for m in model.modules():
        if isinstance(m, fw.nn.BatchNorm1d):
            m.float()
    return model


def test_half_model_trains_as_torch_half():
    """model.half() with BatchNorm back in float32, SGD nesterov with weight decay and a
    label-smoothing cross-entropy: float16 parameters updated in float16."""
    t16, t64, ours = twins(norm=True)
    half_net(torch, t16)
    half_net(sg, ours)
    start = state_float64(t16)
    data = batches(4)

    def loop(fw, model, dtype):
        opt = fw.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True,
                           weight_decay=5e-4)
        criterion = fw.nn.CrossEntropyLoss(label_smoothing=0.2)
        for x, y in data:
            opt.zero_grad()
            loss = criterion(model(fw.from_numpy(x.astype(dtype))), fw.from_numpy(y))
            assert loss.dtype == (fw.float16 if dtype == np.float16 else fw.float64)
            loss.backward()
            opt.step()

    loop(torch, t16, np.float16)
    loop(torch, t64, np.float64)
    loop(sg, ours, np.float16)
    theirs = {k: str(v.dtype).removeprefix("torch.") for k, v in t16.state_dict().items()}
    assert {k: str(v.dtype) for k, v in ours.state_dict().items()} == theirs
    judge(start, t16, t64, ours)


def test_half_then_float_and_to():
    model = sg.nn.Sequential(sg.nn.Linear(3, 2), sg.nn.BatchNorm1d(2))
    w = model[0].weight.numpy().copy()
    model.to(sg.float16)
    assert model[0].weight.dtype == "float16" and model[1].running_var.dtype == "float16"
    assert model[1].num_batches_tracked.dtype == "int64"
    np.testing.assert_array_equal(model[0].weight.numpy(), w.astype(np.float16))
    model.float()
    assert all(p.dtype == "float32" for p in model.parameters())
    with pytest.raises(sg.UnsupportedOpError, match="bf16"):
        model.double()


def test_grad_scaler_refuses_float16_parameters_as_torch():
    _, _, ours = twins(norm=False)
    ours.half()
    opt = sg.optim.SGD(ours.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="unscale FP16 gradients"):
        sg.amp.GradScaler().step(opt)


def test_float16_on_cuda_is_checked_per_op():
    """No blanket refusal of float16 on cuda: a plan with float16 values is checked op by op
    against the ops with float16 kernels (tests/unit/test_fp16_cuda_launch.py runs the cuda
    families' declarations), the refusal naming the op and precision='bf16'."""
    import stepgraph.api as api
    from stepgraph.compile.autocast import check_fp16_support

    assert not hasattr(api, "_refuse_float16_on_cuda")
    model = sg.nn.Linear(3, 2).half()
    x, y = np.ones((4, 3), np.float16), np.zeros(4, np.int64)
    step = sg.compile_train_step(model, sg.nn.functional.cross_entropy,
                                 sg.optim.SGD(model.parameters(), lr=0.1), (x, y))
    graph = step.plan(step.signature).graph
    with pytest.raises(UnsupportedPrecisionError,
                       match="float16 on cuda.*linear.*precision='bf16'"):
        check_fp16_support(graph, frozenset(), "cuda")
    check_fp16_support(graph, frozenset({n.op for n in graph.nodes}), "cuda")


def test_float16_embedding_and_indexing_as_torch():
    """A float16 table (a model.half()'s Embedding): the lookup returns its values, x[idx] and
    index_select too, and the gradient sums float16 rows once rounded, as torch's CPU half."""
    gen = np.random.default_rng(3)
    w = gen.standard_normal((11, 6)).astype(np.float16)
    idx = gen.integers(0, 11, (4, 5))
    got = sg.nn.functional.embedding(sg.from_numpy(idx), sg.from_numpy(w))
    assert got.dtype == sg.float16
    np.testing.assert_array_equal(got.numpy(), w[idx])
    np.testing.assert_array_equal(sg.from_numpy(w)[sg.from_numpy(idx[0])].numpy(), w[idx[0]])
    emb = torch.nn.Embedding(11, 6).half()
    ours = sg.nn.Embedding(11, 6).half()
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(w))
    ours.load_state_dict({"weight": w})
    dy = gen.standard_normal((4, 5, 6)).astype(np.float16)
    out = emb(torch.from_numpy(idx))
    out.backward(torch.from_numpy(dy))
    step = sg.compile_train_step(ours, lambda out, d: (out.float() * d).sum(),
                                 sg.optim.SGD(ours.parameters(), lr=1.0),
                                 (idx, dy.astype(np.float32)))
    step(idx, dy.astype(np.float32))
    grad64 = np.zeros((11, 6))
    np.add.at(grad64, idx.reshape(-1), dy.reshape(-1, 6).astype(np.float64))
    before = w.astype(np.float64)
    got = ours.weight.numpy()
    assert got.dtype == np.float16
    theirs = before - emb.weight.grad.double().numpy()        # torch half's sums, SGD lr 1
    assert_close_to_reference(got.astype(np.float64) - before, -grad64,
                              theirs.astype(np.float16).astype(np.float64) - before,
                              "embedding change", precision=np.float16)
