"""Which tile the attention kernels run (attention.py `_run_tiled`, autotune.py): an untimed
problem times each candidate tile of each kernel once at its first eager call and keeps the
fastest, shared by every context of the backend and stored on disk (a later process times
nothing and compiles ahead only the chosen kernel); a capture before the choice runs the
default tile; another problem times again. The launches and the device clock are faked (no
GPU); the autotuner, the cache and the launchers are real."""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

cupy = pytest.importorskip("cupy")    # attention.py's launchers import CuPy (no GPU needed)

from stepgraph import cache  # noqa: E402
from stepgraph.backends.cuda.attention import attention  # noqa: E402
from stepgraph.backends.cuda.runtime import autotune  # noqa: E402
from stepgraph.ir.graph import Node, Value  # noqa: E402
from tests.unit.test_attention_launch import record  # noqa: E402
from tests.unit.test_nvrtc_compile import Fake  # noqa: E402

IDENTITY = {"gpu": "Fake H200", "sm": "90", "driver": 13000, "cuda": 13000, "cupy": "14.0.0",
            "stepgraph": "0.1.0", "kernels": "abc"}


class FakeStream:
    capturing = False

    def is_capturing(self):
        return self.capturing


class Clock:
    """The fake device clock: ms of a launch by its tile ("BQxBK") and kernel kind, 5 where
    `ms` names none; what was timed and compiled."""

    def __init__(self, launched: list):
        self.launched = launched
        self.ms: dict[tuple[str, str], float] = {}
        self.timed: list[tuple[str, str]] = []
        self.compiled: list[list[str]] = []

    def time_on_device(self, ctx, run, give_up_above=None) -> float:
        assert not ctx.stream.is_capturing()
        run()
        name = self.launched[-1][0]
        self.timed.append(kind_and_tile(name))
        return self.ms.get(kind_and_tile(name), 5.0)


def kind_and_tile(name: str) -> tuple[str, str]:
    """("forward", "64x32") of "sdpa_forward_kernel<64, 64, 32, 2, float>"."""
    kind, _, bq, bk = re.match(r"sdpa_(\w+)_kernel<(\d+), (\d+), (\d+),", name).groups()
    return kind, f"{bq}x{bk}"


@pytest.fixture
def clock(tmp_path, monkeypatch):
    """The launches recorded, the device identity fixed, the clock faked, the choices on
    disk under tmp_path, a fresh process."""
    launched = record(monkeypatch)
    # the tiles of the fused kernels only: the composed path (timed against them for float32,
    # test_attention_composed.py) is not a candidate here
    monkeypatch.setattr(attention.attention_composed, "takes", lambda pb, ctype: False)
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "sg-cache"))
    monkeypatch.delenv(cache.SWITCH_ENV, raising=False)
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    monkeypatch.setattr(autotune, "device_identity", lambda device: dict(IDENTITY))
    fake = Clock(launched)
    monkeypatch.setattr(autotune.compiler, "compile_parallel",
                        lambda kernels: fake.compiled.append([name for _, name in kernels]))
    monkeypatch.setattr(autotune, "time_on_device", fake.time_on_device)
    monkeypatch.setattr(autotune, "_caches", {})
    return fake


def fake_ctx(paths: dict | None = None, precision: str = "fp32"):
    """A context of the backend: `paths` is the backend's choices, shared by its contexts."""
    return SimpleNamespace(stream=FakeStream(), paths={} if paths is None else paths,
                           precision=precision, device_id=0)


def step(ctx, L: int, hd: int = 64, bh: tuple = (8, 4), causal: bool = False) -> list:
    """One sdpa forward and its gradient (float32) through the op table; the kernels' kinds
    and tiles launched (timing launches included)."""
    start = len(ctx.launched)
    attrs = dict(scale=0.125, causal=causal, dropout_p=0.0)
    q = Fake((*bh, L, hd))
    out, lse = Fake(q.shape), Fake((*bh, L))
    attention.IMPLS["sdpa"](Node("sdpa", [], [], attrs), [q, q, q], [out, lse], ctx)
    attention.IMPLS["sdpa_grad"](Node("sdpa_grad", [], [], attrs), [q, q, q, q, out, lse],
                                 [Fake(q.shape) for _ in range(3)], ctx)
    return [kind_and_tile(name) for name, *_ in ctx.launched[start:]]


def with_log(ctx, clock):
    ctx.launched = clock.launched
    return ctx


def test_each_candidate_is_timed_once_and_the_fastest_kept(clock):
    clock.ms = {("forward", "32x32"): 1.0, ("backward_dq", "64x32"): 2.0,
                ("backward_dkdv", "64x64"): 3.0}
    ctx = with_log(fake_ctx(), clock)
    step(ctx, 65)
    candidates = [(kind, attention.tile_label(tile)) for kind in attention.CANDIDATES
                  for tile in attention.CANDIDATES[kind][64]]
    assert clock.timed == candidates                    # each once, kind by kind
    # each kernel's candidates compiled side by side before its timing
    assert clock.compiled == [[attention.kernel_name(kind, 64, attention.TF32X3, "float", t)
                               for t in attention.CANDIDATES[kind][64]]
                              for kind in attention.CANDIDATES]
    chosen = [("forward", "32x32"), ("backward_dq", "64x32"), ("backward_dkdv", "64x64")]
    assert step(ctx, 65) == chosen and len(clock.timed) == len(candidates)
    # another context of the backend shares the choices: nothing timed
    other = with_log(fake_ctx(ctx.paths), clock)
    assert step(other, 65) == chosen and len(clock.timed) == len(candidates)
    # the chosen launches' grids: 3 query tiles of 32 for 65 rows, 2 key tiles of 64
    grids = [grid[0] for _, grid, *_ in clock.launched[-3:]]
    assert grids == [3 * 32, 2 * 32, 2 * 32]


def test_a_later_process_reads_the_choice_from_disk(clock, monkeypatch):
    clock.ms = {("forward", "64x32"): 1.0, ("backward_dq", "32x32"): 1.0,
                ("backward_dkdv", "32x32"): 1.0}
    step(with_log(fake_ctx(), clock), 65)
    timed = len(clock.timed)
    monkeypatch.setattr(autotune, "_caches", {})           # a new process: memory empty
    clock.compiled.clear()
    chosen = [("forward", "64x32"), ("backward_dq", "32x32"), ("backward_dkdv", "32x32")]
    assert step(with_log(fake_ctx(), clock), 65) == chosen
    assert len(clock.timed) == timed and clock.compiled == []
    # and compiles ahead only the chosen kernels
    q = Value((8, 4, 65, 64), "float32")
    attrs = dict(scale=0.125, causal=False, dropout_p=0.0)
    ahead = attention.kernels_ahead(Node("sdpa", [q] * 3, [], attrs), "fp32") + \
        attention.kernels_ahead(Node("sdpa_grad", [q] * 5, [], attrs), "fp32")
    assert [kind_and_tile(name) for _, name in ahead] == chosen
    # a problem not timed yet: every candidate
    other = attention.kernels_ahead(Node("sdpa", [Value((8, 4, 66, 64), "float32")] * 3, [],
                                         attrs), "fp32")
    assert len(other) == len(attention.CANDIDATES["forward"][64])


def test_a_capture_before_the_choice_runs_the_default_tile(clock):
    ctx = with_log(fake_ctx(), clock)
    ctx.stream.capturing = True
    defaults = [(kind, attention.tile_label(attention.TILES[kind][64]))
                for kind in attention.CANDIDATES]
    assert step(ctx, 65) == defaults and clock.timed == []
    assert ctx.paths == {}                              # nothing chosen: timed when eager
    clock.ms = {("forward", "32x32"): 1.0}
    ctx.stream.capturing = False
    step(ctx, 65)
    ctx.stream.capturing = True                         # a capture after the choice keeps it
    assert step(ctx, 65)[0] == ("forward", "32x32")


def test_each_problem_is_timed_on_its_own(clock):
    """Another length, batch x heads or causality is another problem; head dim 128's
    backward has one candidate, never timed."""
    ctx = with_log(fake_ctx(), clock)
    per_step = sum(len(attention.CANDIDATES[kind][64]) for kind in attention.CANDIDATES)
    step(ctx, 65)
    step(ctx, 100)
    step(ctx, 100, bh=(2, 4))
    step(ctx, 100, causal=True)
    assert len(clock.timed) == 4 * per_step
    assert len(ctx.paths) == 4 * len(attention.CANDIDATES)
    start = len(clock.timed)
    assert step(ctx, 65, hd=128)[-2:] == [("backward_dq", "32x32"), ("backward_dkdv", "32x32")]
    assert [kind for kind, _ in clock.timed[start:]] == \
        ["forward"] * len(attention.CANDIDATES["forward"][128])


def test_choice_keys_match_between_launch_and_ahead(clock):
    """kernels_ahead rebuilds the launchers' keys from the node (the packed op, grouped heads
    with a mask, dropout): a problem the launchers timed is found ahead."""
    clock.ms = {("forward", "32x32"): 1.0}
    ctx = with_log(fake_ctx(), clock)
    heads, t, hd = 4, 33, 32
    attrs = dict(scale=0.2, causal=True, dropout_p=0.1, seed=3, site=1)
    q = Fake((2, heads, t, hd))      # the heads of a packed (2, t, 3 heads hd) projection
    attention.IMPLS["sdpa"](Node("sdpa", [], [], attrs), [q, q, q, Fake((), "int64")],
                            [Fake(q.shape), Fake((2, heads, t))], ctx)
    node = Node("sdpa_qkv", [Value((2, t, 3 * heads * hd), "float32")], [],
                attrs | {"heads": heads})
    assert [kind_and_tile(name) for _, name in attention.kernels_ahead(node, "fp32")] == \
        [("forward", "32x32")]
    # grouped heads with a mask
    q, k = Fake((2, 4, 40, 64)), Fake((2, 2, 48, 64))
    mask = Fake((2, 1, 1, 48), ptr=0x9000)
    masked = dict(scale=0.2, causal=False, dropout_p=0.0, mask=True)
    attention.IMPLS["sdpa"](Node("sdpa", [], [], masked), [q, k, k, mask],
                            [Fake((2, 4, 40, 64)), Fake((2, 4, 40))], ctx)
    node = Node("sdpa", [Value(q.shape, "float32"), Value(k.shape, "float32"),
                         Value(k.shape, "float32"), Value(mask.shape, "float32")], [], masked)
    assert [kind_and_tile(name) for _, name in attention.kernels_ahead(node, "fp32")] == \
        [("forward", "32x32")]
    assert len(ctx.paths) == 2 and all(key[0] == "sdpa" for key in ctx.paths)
