"""Which cuDNN conv plans are built (conv.py `_with_cudnn`, conv_cudnn.plans_for): a problem
with no known choice builds every candidate's plan and times them all; a later process that
finds the choice on disk builds only the chosen plan (none for an own path) and times nothing;
a cached plan that no longer builds sends the problem back to timing, never to another
candidate untimed. cuDNN is faked at its ranked plan lists (conv_cudnn._ranked), so no GPU,
frontend or libcudnn is needed; the cache, the autotuner and the conv launchers are real."""
from __future__ import annotations

import time
import types
from dataclasses import dataclass, field

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")    # conv.py's launchers import CuPy (no GPU needed)

from stepgraph import cache  # noqa: E402
from stepgraph.backends.cuda.conv import (conv, conv_cudnn, cudnn_build_worker,  # noqa: E402
                                          cudnn_compiled)
from stepgraph.backends.cuda.runtime import autotune  # noqa: E402
from stepgraph.backends.cuda.runtime.worker_pool import Request  # noqa: E402
from stepgraph.ir.graph import BF16, Node, Value  # noqa: E402

IDENTITY = {"gpu": "Fake H100", "sm": "90", "driver": 13000, "cuda": 13000, "cudnn": 91000,
            "cupy": "14.0.0", "stepgraph": "0.1.0", "kernels": "abc"}
# Ranked engines of each heuristic list (by its first mode). "eng2" is barred by a filter;
# B ranks eng0 and eng3 again, which A's candidates hold already.
ENGINES = {"A": [f"eng{i}" for i in range(9)], "B": ["eng0", "engB1", "engB2", "eng3", "engB4"]}
# A: eng0, eng1, eng3..eng6 (MAX_PLANS); B: the three not in A
CANDIDATES = ["cudnn:0", "cudnn:1", "cudnn:3", "cudnn:4", "cudnn:5", "cudnn:6",
              "cudnn:B1", "cudnn:B2", "cudnn:B4"]
BUILT_ON_A_MISS = [f"eng{i}" for i in range(7)] + ["engB1", "engB2", "engB4"]


@dataclass
class FakeCudnn:
    """The fake cudnn module (its version is part of a choice's key) and what its plan lists
    did: the engines they built, ran and timed; the engines they decline, each one's time."""
    declined: set[str] = field(default_factory=lambda: {"eng2"})
    times: dict[str, float] = field(default_factory=dict)     # ms; 5 for any other
    built: list[str] = field(default_factory=list)
    ran: list[str] = field(default_factory=list)
    timed: list[str] = field(default_factory=list)
    compiled: set[str] = field(default_factory=set)    # engines compiled at build (NVRTC)
    loaded: list[str] = field(default_factory=list)     # serialized plans deserialized
    behavior_note = types.SimpleNamespace(RUNTIME_COMPILATION="runtime compilation")
    __version__: str = "1.99.0"

    def forget(self) -> None:
        """Empty the logs (a new process)."""
        for log in (self.built, self.ran, self.timed, self.loaded):
            log.clear()

    def pygraph(self, handle=None):
        return FakeLoadedGraph(self)

    def create_handle(self):
        return "worker handle"


class FakeLoadedGraph:
    """A graph deserialized from FakeGraph.serialize's blob: one plan, run by execute()."""

    def __init__(self, fake: FakeCudnn):
        self.fake, self.engine = fake, None

    def deserialize(self, handle, blob):
        self.engine = blob.decode().removeprefix("plan:")
        self.fake.loaded.append(self.engine)

    def execute(self, operands, workspace, handle):
        self.fake.ran.append(self.engine)


class FakeGraph:
    """A cudnn.pygraph after create_execution_plans: plan names known before building.
    A fused forward's engines are named "fused-<engine>" (a graph of its own)."""

    def __init__(self, fake: FakeCudnn, engines: list[str]):
        self.fake, self.engines = fake, engines

    def get_plan_name_at_index(self, index):
        return self.engines[index]

    def get_behavior_notes_for_plan_at_index(self, index):
        compiled = self.engines[index].removeprefix("fused-") in self.fake.compiled
        return [self.fake.behavior_note.RUNTIME_COMPILATION] if compiled else []

    def build_plan_at_index(self, index):
        self.fake.built.append(self.engines[index])
        if self.engines[index].removeprefix("fused-") in self.fake.declined:
            raise RuntimeError("CUDNN_STATUS_NOT_SUPPORTED")
        self.selected = index

    def serialize(self, as_bytes=False):
        return f"plan:{self.engines[self.selected]}".encode()

    def get_workspace_size_plan_at_index(self, index):
        return 0

    def execute_plan_at_index(self, operands, workspace, index, handle):
        self.fake.ran.append(self.engines[index])


class FakeTensor:
    def __init__(self, uid):
        self.uid = uid

    def get_uid(self):
        return self.uid


class FakeStream:
    capturing = False

    def is_capturing(self):
        return self.capturing


def fake_array(shape, dtype=np.float32):
    """What the conv launchers read of a CuPy array (its device address is never used)."""
    return types.SimpleNamespace(shape=shape, dtype=np.dtype(dtype),
                                 flags=types.SimpleNamespace(c_contiguous=True),
                                 data=types.SimpleNamespace(ptr=id(shape)))


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """cuDNN faked at its plan lists, the device identity fixed, each path's time set by
    fake.times (by engine), and the choices on disk under tmp_path."""
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "sg-cache"))
    monkeypatch.delenv(cache.SWITCH_ENV, raising=False)
    monkeypatch.setattr(conv, "PATH", "auto")
    monkeypatch.setenv(cudnn_compiled.WORKERS_ENV, "0")     # no build workers unless a test
    monkeypatch.setattr(conv_cudnn, "MAX_PLANS", 6)          # what ENGINES above count with
    monkeypatch.setattr(conv_cudnn, "MAX_PLANS_B", 4)
    monkeypatch.setattr(conv_cudnn, "MAX_PLANS_GROUPED", 6)  # the problems here are grouped
    monkeypatch.setattr(conv_cudnn, "MAX_PLANS_B_GROUPED", 4)
    monkeypatch.setattr(conv_cudnn, "SMALL_MACS", 0)         # the problems here are small
    monkeypatch.setattr(conv_cudnn, "workspace_limit", lambda: 256 << 20)
    fake = FakeCudnn()
    monkeypatch.setattr(conv_cudnn, "_load", lambda: (fake, None))
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)

    def ranked(cudnn, p, handle, modes):
        engines = [("fused-" if p.bias else "") + e for e in ENGINES[modes[0]]]
        ops = {name: FakeTensor(uid) for uid, name in enumerate(("x", "w", "b", "y", "dy",
                                                                 "dx", "dw"))}
        return FakeGraph(fake, engines), ops, len(engines)

    monkeypatch.setattr(conv_cudnn, "_ranked", ranked)
    monkeypatch.setattr(conv, "conv2d_bias_act", lambda *args: None)
    monkeypatch.setattr(autotune, "device_identity", lambda device: dict(IDENTITY))
    monkeypatch.setattr(autotune.compiler, "compile_parallel", lambda kernels: list(kernels))

    def time_on_device(ctx, run, give_up_above=None):
        run()
        fake.timed.append(fake.ran[-1])
        return fake.times.get(fake.ran[-1], 5.0)

    monkeypatch.setattr(autotune, "time_on_device", time_on_device)
    new_process(monkeypatch)
    return fake


def new_process(monkeypatch):
    """A fresh process: no plans built, no choices in memory (the disk's stay)."""
    monkeypatch.setattr(conv_cudnn, "_PLANS", {})
    monkeypatch.setattr(conv_cudnn, "_CHOSEN", {})
    monkeypatch.setattr(autotune, "_caches", {})
    monkeypatch.setattr(cudnn_compiled, "_asked", {})
    monkeypatch.setattr(cudnn_compiled, "_pool", None)


def fake_ctx():
    return types.SimpleNamespace(stream=FakeStream(), paths={}, capturing=False, device_id=0,
                                 precision="fp32", deterministic=True,
                                 extras={"cudnn_handle": "handle"})


ATTRS = {"stride": (1, 1), "padding": (1, 1), "groups": 2}    # grouped: only cuDNN runs it
X, W, Y = (2, 4, 8, 8), (6, 2, 3, 3), (2, 6, 8, 8)


def grad_input(ctx, ahead: bool = False):
    """Run a grouped conv2d_grad_input through conv.py on fake arrays (`ahead`: start its
    plans' builds instead, as binding a plan does)."""
    node = Node("conv2d_grad_input", [Value(Y, "float32"), Value(W, "float32")],
                [Value(X, "float32")], {**ATTRS, "input_shape": X})
    ins, outs = [fake_array(Y), fake_array(W)], [fake_array(X)]
    if ahead:
        conv.start_plans(conv._grad_input_offer, node, ins, outs, ctx)
    else:
        conv.IMPLS[node.op](node, ins, outs, ctx)


def forward_with_bias(ctx):
    """Run a grouped conv2d with bias: fused plans and plain plans + the epilogue compete."""
    node = Node("conv2d", [Value(X, "float32"), Value(W, "float32"), Value((6,), "float32")],
                [Value(Y, "float32")], dict(ATTRS))
    conv.IMPLS[node.op](node, [fake_array(X), fake_array(W), fake_array((6,))],
                        [fake_array(Y)], ctx)


def fresh(fake, monkeypatch):
    """A new process's view: memory cleared, the fake's logs emptied."""
    new_process(monkeypatch)
    fake.forget()
    return fake_ctx()


@pytest.mark.parametrize("winner", ["eng4", "engB2"])
def test_a_miss_times_every_plan_and_a_warm_cache_builds_only_the_chosen(fake, monkeypatch,
                                                                         winner):
    fake.times[winner] = 1.0
    ctx = fake_ctx()
    grad_input(ctx)
    assert fake.built == BUILT_ON_A_MISS                 # every candidate's plan
    assert sorted(fake.timed) == sorted(BUILT_ON_A_MISS[:2] + BUILT_ON_A_MISS[3:])
    assert list(ctx.paths.values()) == [f"cudnn:{winner.removeprefix('eng')}"]
    assert fake.ran[-1] == winner

    ctx = fresh(fake, monkeypatch)
    grad_input(ctx)
    assert fake.built == [winner] and fake.timed == [] and fake.ran == [winner]
    ctx.stream.capturing = True                          # the capture: nothing more built
    grad_input(ctx)
    assert fake.built == [winner] and fake.ran == [winner, winner]


def test_a_warm_forward_builds_only_the_chosen_plain_plan_and_its_epilogue(fake, monkeypatch):
    fake.times["engB1"] = 1.0                            # plain engB1 + the epilogue wins
    ctx = fake_ctx()
    forward_with_bias(ctx)
    assert sorted(fake.built) == sorted(BUILT_ON_A_MISS + ["fused-" + e
                                                           for e in BUILT_ON_A_MISS])
    assert list(ctx.paths.values()) == ["cudnn:B1+epilogue"]

    forward_with_bias(fresh(fake, monkeypatch))
    assert fake.built == ["engB1"] and fake.timed == [] and fake.ran == ["engB1"]


def test_runtime_compiled_plans_are_capped_per_problem(fake, monkeypatch):
    """Engines cuDNN compiles at their build (admitted for grouped convs) cost seconds each:
    only the first MAX_RUNTIME_COMPILED (two here) of a problem are candidates, A's first,
    then B's; each list's others fill its remaining places."""
    monkeypatch.setattr(conv_cudnn, "MAX_RUNTIME_COMPILED", 2)
    fake.compiled = {"eng1", "eng3", "eng4", "engB1", "engB2"}
    grad_input(fake_ctx())
    # A (6 places): eng0, eng1 and eng3 (compiled, the two allowed), eng2 declined at its
    # build, eng4 skipped unbuilt, eng5..eng7; B: engB1 and engB2 skipped (the problem has
    # its two), engB4
    assert fake.built == ["eng0", "eng1", "eng2", "eng3", "eng5", "eng6", "eng7", "engB4"]


def test_b_gives_the_runtime_compiled_plans_a_left(fake, monkeypatch):
    monkeypatch.setattr(conv_cudnn, "MAX_RUNTIME_COMPILED", 2)
    fake.compiled = {"eng1", "engB1", "engB2", "engB4"}
    grad_input(fake_ctx())
    # A: eng1 its one compiled; B: engB1 the problem's second, engB2 and engB4 skipped
    assert fake.built == [f"eng{i}" for i in range(7)] + ["engB1"]


def test_a_cached_plan_that_no_longer_builds_is_timed_again(fake, monkeypatch):
    fake.times |= {"eng4": 1.0, "engB1": 2.0}
    grad_input(fake_ctx())
    fake.declined.add("eng4")                            # e.g. another library build

    ctx = fresh(fake, monkeypatch)
    grad_input(ctx)
    assert fake.built == ["eng4"] + BUILT_ON_A_MISS[:7] + ["eng7"] + BUILT_ON_A_MISS[7:]
    assert "eng4" not in fake.timed and len(fake.timed) == len(CANDIDATES)
    assert list(ctx.paths.values()) == ["cudnn:B1"] and fake.ran[-1] == "engB1"

    ctx = fresh(fake, monkeypatch)                       # the new choice is on disk
    grad_input(ctx)
    assert fake.built == ["engB1"] and fake.timed == []


def test_a_corrupt_entry_is_a_miss(fake, monkeypatch):
    fake.times["eng5"] = 1.0
    grad_input(fake_ctx())
    for path in cache.entries():
        path.write_text("{not json")

    ctx = fresh(fake, monkeypatch)
    grad_input(ctx)
    assert fake.built == BUILT_ON_A_MISS and len(fake.timed) == len(CANDIDATES)
    assert list(ctx.paths.values()) == ["cudnn:5"]


def test_an_own_path_choice_builds_no_plan(fake):
    """A problem the own kernels can run, whose known choice is one of them: no cuDNN plan is
    asked for; unknown, every one is."""
    plain_w = (6, 4, 3, 3)
    node = Node("conv2d_grad_input", [Value(Y, "float32"), Value(plain_w, "float32")],
                [Value(X, "float32")], {"stride": (1, 1), "padding": (1, 1), "input_shape": X})
    g = conv._geometry(X, plain_w, node.attrs)
    own = {"direct": lambda: None, "gemm": lambda: None}
    asked = []

    def cudnn(only):
        asked.append(only)
        return {"cudnn:0": lambda: None, "cudnn:1": lambda: None}

    ctx = fake_ctx()
    assert set(conv._with_cudnn(node, ctx, g, "float32", own, cudnn)) == {
        "direct", "gemm", "cudnn:0", "cudnn:1"} and asked == [None]     # a miss: all
    ctx.paths[conv._choice_key(node, ctx, g, "float32", own)] = "gemm"
    assert conv._with_cudnn(node, ctx, g, "float32", own, cudnn) == own and asked == [None]


def test_choice_keys_do_not_name_the_built_plans(fake):
    """The key is known before any plan is built, and changes with what decides the plans."""
    node = Node("conv2d_grad_input", [Value(Y, "float32"), Value(W, "float32")],
                [Value(X, "float32")], {**ATTRS, "input_shape": X})
    g = conv._geometry(X, W, node.attrs)
    key = conv._choice_key(node, fake_ctx(), g, "float32", {})
    assert fake.built == [] and key[-1] == conv_cudnn.candidates_key()
    fake.__version__ = "2.0.0"
    assert conv._choice_key(node, fake_ctx(), g, "float32", {}) != key


def test_a_later_process_compiles_ahead_only_the_chosen_tiled_kernels(fake, monkeypatch):
    """tiled_kernels names every tiled variant while the problem is untimed; once a process
    has chosen, later ones compile ahead that path's kernels only (none for cuDNN or GEMM)."""
    attrs = {"stride": (1, 1), "padding": (1, 1)}
    x, w = (2, 4, 12, 12), (8, 4, 3, 3)
    node = Node("conv2d", [Value(x, "float32"), Value(w, "float32")],
                [Value((2, 8, 12, 12), "float32")], attrs)
    every = conv.tiled_kernels(node)
    assert len(every) > 1
    g = conv._geometry(x, w, attrs)
    ctx = fake_ctx()
    conv._remember_kernels(node, ctx, g, np.dtype("float32"),
                           autotune.compiling(lambda: None, every[1]))
    new_process(monkeypatch)
    monkeypatch.setattr(conv, "_remembered", set())
    assert conv.tiled_kernels(node) == [every[1]]
    assert conv.tiled_kernels(node, "tf32") == every          # another problem: untimed

    conv._remember_kernels(node, ctx, g, "float32", lambda: None)   # e.g. a cuDNN plan won
    assert conv.tiled_kernels(node) == []                     # no own kernel to compile
    conv._remember_kernels(node, ctx, g, "float32", autotune.compiling(lambda: None, every[0]))
    assert conv.tiled_kernels(node) == []                     # written once per process


def test_bf16_nchw_problems_offer_the_tiled_kernels_beside_cudnn(fake, monkeypatch):
    """A plain NCHW bfloat16 conv (the cnn's conv2) offers every tiled variant float32 does
    (the shared arrays hold float32 either way) and the cuDNN plans, never direct or im2col +
    GEMM (float only); its tiled grad_weight sums in float32 scratch, db alongside dw; the
    kernels compiled ahead are the bf16 instantiations of float32's."""
    offered = {}
    monkeypatch.setattr(conv, "_run_faster",
                        lambda node, ctx, g, dtype, paths: offered.update({dtype: paths}))
    attrs = {"stride": (1, 1), "padding": (0, 0)}
    x, w, y = (64, 10, 12, 12), (20, 10, 5, 5), (64, 20, 8, 8)
    names = {}
    for dtype, storage in (("float32", np.float32), (BF16, np.uint16)):
        arrays = [fake_array(s, storage) for s in (x, w, (20,), y)]
        node = Node("conv2d", [Value(s, dtype) for s in (x, w, (20,))], [Value(y, dtype)],
                    dict(attrs))
        conv.IMPLS["conv2d"](node, arrays[:3], arrays[3:], fake_ctx())
        names[dtype] = [k for _, k in conv.tiled_kernels(node)]
    tiled = {dtype: [p for p in paths if p.startswith("tiled:")]
             for dtype, paths in offered.items()}
    assert tiled[BF16] and tiled[BF16] == tiled["float32"]
    assert {p.split(":")[0] for p in offered[BF16]} == {"tiled", "cudnn"}
    assert {"direct", "gemm"} <= set(offered["float32"])
    assert names[BF16] == [k.replace("<float, float,", "<unsigned short, float,")
                           for k in names["float32"]]

    got = {}
    monkeypatch.setattr(conv, "_scratch", lambda ctx, shapes, dtype: [
        types.SimpleNamespace(shape=s, dtype=np.dtype(dtype)) for s in shapes])
    monkeypatch.setattr(conv.tiled, "conv2d_tiled_grad_weight",
                        lambda ctx, plan, dy, x, dw, db, partial: got.update(
                            plan=plan, db=db, partial=partial.dtype))
    monkeypatch.setattr(conv.reduce, "reduce_sum_forward",
                        lambda *a, **k: pytest.fail("db summed apart on the tiled path"))
    node = Node("conv2d_grad_weight", [Value(y, BF16), Value(x, BF16)],
                [Value(w, BF16), Value((20,), BF16)], {**attrs, "weight_shape": w, "bias": True})
    db = fake_array((20,), np.uint16)
    conv.IMPLS[node.op](node, [fake_array(y, np.uint16), fake_array(x, np.uint16)],
                        [fake_array(w, np.uint16), db], fake_ctx())
    paths = offered[BF16]
    assert {p.split(":")[0] for p in paths} == {"tiled", "cudnn"}
    paths[next(p for p in paths if p.startswith("tiled:"))]()
    assert got["partial"] == np.float32 and got["db"] is db and got["plan"].bias


def test_a_small_problem_times_few_candidates(fake, monkeypatch):
    """A problem of fewer than SMALL_MACS multiply-adds runs in its launch time on any plan:
    only MAX_PLANS_SMALL of A's list and MAX_PLANS_B_SMALL of B's are candidates."""
    monkeypatch.setattr(conv_cudnn, "SMALL_MACS", conv._geometry(X, W, ATTRS).macs + 1)
    monkeypatch.setattr(conv_cudnn, "MAX_PLANS_SMALL", 3)
    monkeypatch.setattr(conv_cudnn, "MAX_PLANS_B_SMALL", 1)
    grad_input(fake_ctx())
    # A: eng0, eng1, (eng2 declined), eng3; B: engB1
    assert fake.built == ["eng0", "eng1", "eng2", "eng3", "engB1"]
    assert len(fake.timed) == 4


def test_every_geometry_counts_its_multiply_adds_for_the_candidate_limits():
    """A 3-D problem's limits read its multiply-adds too (conv3d raised AttributeError), and a
    grouped convolution's output sums over C / groups channels only."""
    from stepgraph.backends.cuda.conv.conv3d import Geometry3d
    from stepgraph.backends.cuda.conv.geometry import Geometry

    depthwise = Geometry(n=2, c=8, h=4, w=4, o=8, kh=3, kw=3, sh=1, sw=1, ph=1, pw=1, groups=8)
    assert depthwise.macs == 2 * 8 * 16 * 9
    volume = Geometry3d(2, 4, 3, 4, 4, 6, (3, 3, 3), (1, 1, 1), (1, 1, 1), groups=2)
    assert volume.macs == 2 * 6 * 48 * 2 * 27
    small = conv_cudnn.Problem("conv3d", volume, "float32", "fp32")
    assert conv_cudnn._limits(small) == (conv_cudnn.MAX_PLANS_SMALL, conv_cudnn.MAX_PLANS_B_SMALL)
    large = conv_cudnn.Problem("conv3d", Geometry3d(64, 64, 16, 32, 32, 64, (3, 3, 3), (1, 1, 1),
                                                    (1, 1, 1)), "float32", "fp32")
    assert conv_cudnn._limits(large) == (conv_cudnn.MAX_PLANS, conv_cudnn.MAX_PLANS_B)


def test_a_runtime_compiled_plan_built_once_is_loaded_by_later_processes(fake, monkeypatch):
    """Its serialized plan goes to disk: a later process that must time every candidate loads
    it rather than build it, and one that knows the choice runs the loaded plan."""
    fake.compiled = {"eng1"}
    fake.times["eng1"] = 1.0
    grad_input(fake_ctx())
    assert "eng1" in fake.built and fake.loaded == []

    ctx = fresh(fake, monkeypatch)                       # the choice known: only eng1's plan
    grad_input(ctx)
    assert fake.built == [] and fake.loaded == ["eng1"] and fake.ran == ["eng1"]

    for path in cache.entries():                         # choices gone, the plan kept
        if path.parent.name == "paths":
            path.unlink()
    ctx = fresh(fake, monkeypatch)
    grad_input(ctx)
    assert fake.built == [e for e in BUILT_ON_A_MISS if e != "eng1"]
    assert fake.loaded == ["eng1"] and list(ctx.paths.values()) == ["cudnn:1"]
    assert fake.ran[-1] == "eng1"


class AnsweringPool:
    """A build pool whose workers answer each request with `answer(request)`; an answer of
    "hang" (taken up by a worker) or "queued" (taken up by none) never comes."""

    def __init__(self, answer):
        self.answer, self.requests, self.closed = answer, [], False

    def submit(self, request):
        self.requests.append(request)
        future = Request()
        try:
            answer = self.answer(request)
        except cudnn_compiled.WorkerError as err:
            future.set_exception(err)
            return future
        if answer == "hang":
            future.set_running_or_notify_cancel()
            future.taken_at, future.worker_pid = time.monotonic(), 4242
        elif answer != "queued":
            future.set_result(answer)
        return future

    def close(self):
        self.closed = True


@pytest.mark.parametrize("answer", ["eng1", "eng3", "died"])
def test_plans_started_ahead_ask_the_build_workers_for_the_runtime_compiled_one(
        fake, monkeypatch, answer):
    """start_ahead sends the problem to the workers; the build takes their plan where it is
    the one it would build (eng1: the first compiled), and builds it here otherwise (a plan at
    another index; a worker that died)."""
    fake.compiled = {"eng1", "eng3"}
    monkeypatch.setenv(cudnn_compiled.WORKERS_ENV, "2")

    def reply(request):
        if answer == "died":
            raise cudnn_compiled.WorkerError("worker ended (EOFError; exit status -9)")
        index = int(answer.removeprefix("eng"))
        return cudnn_compiled.CompiledPlan(("A", "FALLBACK"), index, answer, 0,
                                           f"plan:{answer}".encode())

    pool = AnsweringPool(reply)
    monkeypatch.setattr(cudnn_compiled, "WorkerPool", lambda module, size: pool)
    ctx = fake_ctx()
    grad_input(ctx, ahead=True)
    ((problem, want),) = pool.requests
    assert problem.op == "conv2d_grad_input" and problem.g.groups == 2 and want is None
    grad_input(ctx)
    if answer == "eng1":
        assert fake.loaded == ["eng1"] and "eng1" not in fake.built
    else:
        assert fake.loaded == [] and "eng1" in fake.built
    assert "eng3" not in fake.built                      # one compiled plan a problem


@pytest.mark.parametrize("stall", ["hang", "queued"])
def test_a_stalled_build_pool_is_closed_and_the_plans_built_here_with_one_warning(
        fake, monkeypatch, stall):
    """A worker that took the problem up and never answers (or a problem no worker takes
    up) holds the build for BUILD_TIMEOUT_S (QUEUE_TIMEOUT_S), not longer: the plan is built
    here, the pool closed, one warning names the switch, and later problems are not sent."""
    fake.compiled = {"eng1"}
    monkeypatch.setenv(cudnn_compiled.WORKERS_ENV, "2")
    # the limit that applies is short, the other long: each stall must end by its own
    monkeypatch.setattr(cudnn_compiled, "BUILD_TIMEOUT_S", 0.3 if stall == "hang" else 60.0)
    monkeypatch.setattr(cudnn_compiled, "QUEUE_TIMEOUT_S", 0.3 if stall == "queued" else 60.0)
    pool = AnsweringPool(lambda request: stall)
    monkeypatch.setattr(cudnn_compiled, "WorkerPool", lambda module, size: pool)
    ctx = fake_ctx()
    grad_input(ctx, ahead=True)
    start = time.monotonic()
    with pytest.warns(RuntimeWarning, match=f"stalled.*{cudnn_compiled.WORKERS_ENV}=0") as seen:
        grad_input(ctx)
    waited = time.monotonic() - start
    assert 0.3 <= waited < 5.0
    assert len(seen) == 1 and ("worker 4242" in str(seen[0].message)) == (stall == "hang")
    assert pool.closed and "eng1" in fake.built and fake.loaded == []
    new_process(monkeypatch)
    monkeypatch.setattr(cudnn_compiled, "_pool", pool)    # this process's closed pool
    cudnn_compiled.prefetch(conv_cudnn.Problem("conv2d_grad_input", conv._geometry(X, W, ATTRS),
                                               "float32", "fp32"), "another")
    assert len(pool.requests) == 1


def test_a_build_worker_builds_the_first_runtime_compiled_plan_or_the_one_asked(fake,
                                                                              monkeypatch):
    monkeypatch.setattr(cupy.cuda, "Device", lambda device: types.SimpleNamespace(use=lambda: 0))
    fake.compiled = {"eng3", "engB2"}
    fake.declined.add("eng3")                            # the next that builds: engB2
    p = conv_cudnn.Problem("conv2d_grad_input", conv._geometry(X, W, ATTRS), "float32", "fp32")
    plan = cudnn_build_worker.build_requested((p, None))
    assert (plan.modes, plan.index, plan.name, plan.blob) == (("B",), 2, "engB2", b"plan:engB2")
    assert cudnn_build_worker.build_requested((p, (("A", "FALLBACK"), 1))) is None   # not compiled
    fake.declined.discard("eng3")
    assert cudnn_build_worker.build_requested((p, (("A", "FALLBACK"), 3))).name == "eng3"


def test_the_gemm_paths_search_and_wrapped_paths_keep_their_marks(fake, monkeypatch):
    """Every float32 op's im2col + GEMM path is marked as searching (timed last, its cuBLASLt
    search kept light: autotune._fastest); the tiled paths of a forward with a fused ReLU keep
    the kernels they compile ahead through the ReLU wrapped after them."""
    offered = []
    monkeypatch.setattr(conv, "_run_faster",
                        lambda node, ctx, g, dtype, paths: offered.append((node.op, paths)))
    attrs = {"stride": (1, 1), "padding": (0, 0)}
    x, w, y = (64, 10, 12, 12), (20, 10, 5, 5), (64, 20, 8, 8)
    for op, ins, outs, extra in (("conv2d", (x, w), (y,), {"act": "relu"}),
                                 ("conv2d_grad_input", (y, w), (x,), {"input_shape": x}),
                                 ("conv2d_grad_weight", (y, x), (w,), {"weight_shape": w})):
        node = Node(op, [Value(s, "float32") for s in ins], [Value(s, "float32") for s in outs],
                    {**attrs, **extra})
        conv.IMPLS[op](node, [fake_array(s) for s in ins], [fake_array(s) for s in outs],
                       fake_ctx())
    assert [op for op, _ in offered] == ["conv2d", "conv2d_grad_input", "conv2d_grad_weight"]
    for op, paths in offered:
        assert getattr(paths["gemm"], "searches", False), op
        assert not any(getattr(run, "searches", False) for name, run in paths.items()
                       if name != "gemm"), op
        tiled = [run for name, run in paths.items() if name.startswith("tiled:")]
        assert tiled and all(run.kernels for run in tiled), op
