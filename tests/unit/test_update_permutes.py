"""compile/update_permutes.py: a channels-last step's update reads each conv weight's gradient
as the convolution made it, (O, kh, kw, C), with attrs grad_dims in place of the permute back
to (O, C, kh, kw), and trains bit for bit as with the permutes; where something else reads the
gradient (the clipping norm), or a slice would not fit the CUDA update's tile, the permute
stays."""
from __future__ import annotations

import numpy as np
import pytest

import stepgraph as sg
from stepgraph import api, nn, optim
from stepgraph.compile import overlap
from stepgraph.ops.optim import UPDATE_OPS, UPDATE_TILE, slice_tile_fits

TO_KRSC, TO_KCRS = (0, 2, 3, 1), (0, 3, 1, 2)


class ConvNet(nn.Module):
    """Two 3x3 conv-BN-ReLU layers, global pooling and a classifier: two conv weights whose
    channels-last gradients come back through permutes (the first conv's 3 channels too)."""

    def __init__(self, width: int = 8, kernel: int = 3):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, kernel, padding=kernel // 2, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, 2 * width, kernel, padding=kernel // 2, bias=False)
        self.bn2 = nn.BatchNorm2d(2 * width)
        self.fc = nn.Linear(2 * width, 10)

    def forward(self, x):
        x = nn.functional.relu(self.bn1(self.conv1(x)))
        x = nn.functional.relu(self.bn2(self.conv2(x)))
        return self.fc(x.mean((2, 3)))


def batches(n: int = 4, size: int = 8):
    rng = np.random.default_rng(7)
    return [(rng.standard_normal((n, 3, size, size)).astype(np.float32),
             (np.arange(n) % 10).astype(np.int64)) for _ in range(3)]


def steps(monkeypatch, make_optimizer, precision="fp32", model=ConvNet,
          without=(api, "read_gradients_through_permutes", lambda graph: graph), **options):
    """The channels-last step with the pass and without it (built with `without`: module,
    name, replacement), the same starting weights."""
    data = batches()
    start = initial_weights(model)
    built = []
    for fused in (True, False):
        with monkeypatch.context() as patch:
            if not fused:
                patch.setattr(*without)
            step = channels_last_step(model, start, make_optimizer, data[0],
                                      precision=precision, **options)
            step(*data[0])
            built.append(step)
    return built, data


def initial_weights(model=ConvNet) -> dict:
    sg.nn.manual_seed(0)
    return model().state_dict()


def channels_last_step(model, start, make_optimizer, example, **options):
    """The channels-last step of a fresh `model` holding the weights `start`."""
    m = model()
    m.load_state_dict(start)
    return sg.compile_train_step(m, nn.functional.cross_entropy, make_optimizer(),
                                 example_inputs=example, memory_format="channels_last",
                                 **options)


def plan_nodes(step):
    return step.executable(step.signature).plan.graph.nodes


def gradient_permutes(nodes):
    """The permutes back to (O, C, kh, kw), alone or in a group."""
    return [d for n in nodes if n.op in ("permute", "permute_group")
            for d in ([n.attrs["dims"]] if n.op == "permute" else n.attrs["dims"])
            if tuple(d) == TO_KCRS]


def assert_same_training(fused, plain, data):
    for x, y in data:
        assert float(fused(x, y)) == float(plain(x, y))
    for k, v in plain.model.state_dict().items():
        np.testing.assert_array_equal(np.asarray(fused.model.state_dict()[k]), np.asarray(v),
                                      err_msg=k)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("make_optimizer", [
    lambda: optim.SGD(lr=0.1, momentum=0.9, weight_decay=1e-4),
    lambda: optim.AdamW(lr=1e-2)], ids=["sgd", "adamw"])
def test_update_reads_channels_last_gradients(precision, make_optimizer, monkeypatch):
    (fused, plain), data = steps(monkeypatch, make_optimizer, precision)
    nodes = plan_nodes(fused)
    update = next(n for n in nodes if n.op in UPDATE_OPS)
    k, n = update.attrs["n_scalars"], update.attrs["n_params"]
    dims = update.attrs["grad_dims"]
    transposed = [i for i in range(n) if dims[i] is not None]
    assert len(transposed) == 2 and all(dims[i] == TO_KRSC for i in transposed), dims
    for i in transposed:                    # the gradient as the convolution gave it
        p, g = update.inputs[k + i], update.inputs[k + n + i]
        assert g.shape == tuple(p.shape[d] for d in TO_KRSC)
    assert not gradient_permutes(nodes)
    assert len(gradient_permutes(plan_nodes(plain))) == 2
    assert_same_training(fused, plain, data)


def test_guarded_and_overlapped_updates_read_them_too(monkeypatch):
    """The guard's finiteness check reads the channels-last gradients as well; an update split
    into buckets (overlap_update) reads its own with its slice of grad_dims."""
    sgd = lambda: optim.SGD(lr=0.1, momentum=0.9)     # noqa: E731
    (fused, plain), data = steps(monkeypatch, sgd, on_bad_batch="skip")
    nodes = plan_nodes(fused)
    assert not gradient_permutes(nodes)
    assert any(n.op == "guard_check" for n in nodes)
    assert_same_training(fused, plain, data)

    monkeypatch.setattr(overlap, "UPDATE_BUCKET_CAP_MB", 1e-3)    # a bucket a kilobyte
    (fused, plain), data = steps(monkeypatch, sgd, overlap_update=True,
                                 on_bad_batch="ignore")
    nodes = plan_nodes(fused)
    updates = [n for n in nodes if n.op in UPDATE_OPS]
    assert len(updates) > 1 and not gradient_permutes(nodes)
    read = [d for u in updates for d in u.attrs.get("grad_dims") or () if d is not None]
    assert read == [TO_KRSC, TO_KRSC]
    assert_same_training(fused, plain, data)


def test_permutes_stay_where_the_norm_reads_the_gradients(monkeypatch):
    """Gradient clipping's global norm reads every gradient: the permutes stay (the norm's
    sum would otherwise run in another order)."""
    (fused, _), data = steps(monkeypatch, lambda: optim.SGD(lr=0.1, max_grad_norm=1.0))
    nodes = plan_nodes(fused)
    update = next(n for n in nodes if n.op in UPDATE_OPS)
    assert not any(update.attrs.get("grad_dims") or ())
    assert len(gradient_permutes(nodes)) == 2


def test_slices_past_the_tile_keep_their_permute(monkeypatch):
    """A 7x7 conv of 256 to 512 channels: its slices (49 rows of 257 floats) are past the
    tile, the first conv's (3 channels) are not."""
    assert 49 * (249 + 1) <= UPDATE_TILE < 49 * (250 + 1)
    assert slice_tile_fits((512, 249, 7, 7)) and not slice_tile_fits((512, 250, 7, 7))
    assert not slice_tile_fits((512, 8))

    class Wide(ConvNet):
        def __init__(self):
            super().__init__(width=256, kernel=7)

    (fused, plain), data = steps(monkeypatch, lambda: optim.SGD(lr=0.1), model=Wide)
    update = next(n for n in plan_nodes(fused) if n.op in UPDATE_OPS)
    dims = update.attrs["grad_dims"]
    assert sum(d is not None for d in dims) == 1
    assert len(gradient_permutes(plan_nodes(fused))) == 1
    assert_same_training(fused, plain, data[:1])


def test_update_tables_mark_the_transposed_entries(monkeypatch):
    """The CUDA update's table (backends/cuda/optim.py, without a GPU): a parameter read
    through a transposed gradient or copy gets its slice shape, whole slices a block (a
    multiple of four elements where a block holds several), its kinds bits, and its own jobs,
    launched with the tile they need; the others keep the plain chunks."""
    from stepgraph.backends.cuda import optim as cuda_optim
    from stepgraph.backends.cuda.runtime import launch
    from tests.unit.test_nvrtc_compile import Fake

    monkeypatch.setattr(cuda_optim.cp, "asarray", np.asarray)
    for module in (cuda_optim, launch):
        monkeypatch.setattr(module, "_check", lambda *a, **k: None)
    monkeypatch.setattr(launch, "current_sm_count", lambda: 132)     # an H200's
    shapes = [(64, 32, 3, 3), (6, 3, 5, 5), (10,), (3, 1024, 3, 3)]
    params = [Fake(s, ptr=0x10000 * (i + 1)) for i, s in enumerate(shapes)]
    grads = [Fake(tuple(s[d] for d in TO_KRSC) if len(s) == 4 else s, "uint16")
             for s in shapes]
    copies = {1: (Fake((6, 5, 5, 3), "uint16", 0x90000), True),
              0: (Fake((64, 3, 3, 32), "float32", 0xa0000), True)}
    tables = cuda_optim._build_update_tables(
        "sgd_update", params, grads, [[Fake(s) for s in shapes]], [0], [0] * 4, copies,
        (TO_KRSC, None, None, TO_KRSC))
    e = tables["entries"]
    kinds, cols, rest, span = e[:, 8], e[:, 10], e[:, 11], e[:, 12]
    # grad (and a float32 copy), copy, neither, grad; the copies' storage codes in bits 24-31
    assert [(k >> 16) & 0xff for k in kinds] == [3, 2, 0, 1]
    assert [k >> 24 for k in kinds] == [0, 1, 0, 0]
    assert cols.tolist() == [32, 3, 0, 1024] and rest.tolist() == [9, 25, 0, 9]
    # 288-element slices 14 a block; 75-element ones 52 (54 fit, 52 make whole float4s); one
    # 9,216-element slice a block
    assert span.tolist() == [14 * 288, 52 * 75, 0, 9216]
    assert e[:, 7].tolist() == [1, 1, 1, 1]                    # all float4-aligned
    assert tables["plain"].tolist() == [[2, 0]]
    assert tables["sliced"].tolist() == [[0, 0], [0, 1], [0, 2], [0, 3], [0, 4], [1, 0],
                                         [3, 0], [3, 1], [3, 2]]
    assert tables["tile"] == 9 * 1025 * 4                      # the largest block's bytes
    with pytest.raises(sg.errors.ShapeError, match="grad_dims"):
        cuda_optim._build_update_tables("sgd_update", params[:1], grads[:1], [[Fake(shapes[0])]],
                                        [0], [0], {}, ((0, 3, 1, 2),))
