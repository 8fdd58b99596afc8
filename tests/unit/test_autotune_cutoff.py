"""The autotuner's early cut (runtime/autotune.py _fastest): every candidate is timed in
order, the first in full, each later one given the device time past which it cannot win
(give_up_above); the winner is the fastest whatever the order. No GPU: time_on_device is a
fake that honours the cut as graph.py's does (tests/cuda/test_autotune_cutoff_cuda.py runs
the real one)."""
from __future__ import annotations

import pytest

from stepgraph.backends.cuda.runtime import autotune, graph


def fake_clock(monkeypatch, graph_ms: dict[str, float], eager_gap_ms: float = 0.01):
    """time_on_device over named runs: a candidate's eager time is its graph time plus a
    launch gap, and the device time it implies its graph time; past give_up_above the eager
    time is returned and no capture is made."""
    calls = []

    def time_on_device(ctx, run, repeats=5, give_up_above=None):
        name = run()
        eager = graph_ms[name] + eager_gap_ms
        if give_up_above is not None and graph_ms[name] > give_up_above:
            calls.append((name, give_up_above, "cut"))
            return graph.EagerMs(eager)
        calls.append((name, give_up_above, "captured"))
        return graph_ms[name]

    monkeypatch.setattr(autotune, "time_on_device", time_on_device)
    return calls


def paths_of(names):
    return {name: (lambda name=name: name) for name in names}


def test_the_first_candidate_is_timed_in_full_and_later_ones_get_the_cut(monkeypatch):
    calls = fake_clock(monkeypatch, {"a": 1.0, "b": 0.4, "c": 5.0, "d": 0.45})
    assert autotune._fastest(None, paths_of("abcd")) == "b"
    assert calls == [("a", None, "captured"), ("b", 2.0, "captured"),
                     ("c", pytest.approx(0.8), "cut"), ("d", pytest.approx(0.8), "captured")]


def test_the_cut_is_twice_the_best_device_time():
    """graph.time_on_device compares it with device time (host time taken out), so even a
    few-µs best needs no margin for launch costs."""
    assert autotune.give_up_above(float("inf")) is None
    assert autotune.give_up_above(0.01) == pytest.approx(0.02)
    assert autotune.give_up_above(1.0) == pytest.approx(2.0)


@pytest.mark.parametrize("order", ["abc", "cba", "bca"])
def test_the_winner_is_the_fastest_in_any_order(monkeypatch, order):
    fake_clock(monkeypatch, {"a": 0.3, "b": 0.2, "c": 3.0})
    assert autotune._fastest(None, paths_of(order)) == "b"


def test_the_log_names_each_candidates_time_and_the_choice(monkeypatch, tmp_path):
    import json

    fake_clock(monkeypatch, {"a": 1.0, "b": 0.4, "c": 5.0})
    log = tmp_path / "autotune.jsonl"
    monkeypatch.setenv("STEPGRAPH_AUTOTUNE_LOG", str(log))
    autotune._fastest(None, paths_of("abc"), key=("conv2d", (8, 3)))
    autotune._fastest(None, paths_of("cb"), key="second")
    first, second = (json.loads(line) for line in log.read_text().splitlines())
    assert 0 <= first.pop("s") < 5 and 0 <= second.pop("s") < 5
    assert first.pop("end") <= second.pop("end")      # time.perf_counter() at each's end
    # each candidate's own host seconds: the fake clock takes none
    for row in (first, second):
        assert all(0 <= timing.pop() < 1 for timing in row["ms"].values())
    assert first == {"key": "('conv2d', (8, 3))", "chosen": "b",
                     "ms": {"a": [1.0, "graph"], "b": [0.4, "graph"], "c": [5.01, "eager"]}}
    assert second["chosen"] == "b" and second["ms"]["c"] == [5.0, "graph"]


def test_candidates_compiling_kernels_of_their_own_are_timed_after_the_others(monkeypatch):
    """Their compiles go on while the others are timed; all of them are waited for once,
    before the first of them is timed. The winner is the fastest still."""
    calls = fake_clock(monkeypatch, {"tiled:a": 0.1, "cudnn:0": 0.3, "tiled:b": 0.2,
                                     "direct": 0.5})
    waits = []
    monkeypatch.setattr(autotune.compiler, "compile_parallel",
                        lambda kernels: waits.append((len(calls), sorted(kernels))))
    paths = paths_of(["tiled:a", "cudnn:0", "tiled:b", "direct"])
    for name in ("tiled:a", "tiled:b"):
        autotune.compiling(paths[name], ("conv_tiled.cu", f"k_{name}"))
    assert autotune._fastest(None, paths) == "tiled:a"
    assert [c[0] for c in calls] == ["cudnn:0", "direct", "tiled:a", "tiled:b"]
    assert waits == [(2, [("conv_tiled.cu", "k_tiled:a"), ("conv_tiled.cu", "k_tiled:b")])]


def test_searching_candidates_come_last_under_the_cut_of_all_the_others(monkeypatch):
    """A candidate whose first call times candidates of its own (a conv's GEMM path) is timed
    after the plain and the compiling ones, and sees the cut they set while it runs (and
    nothing after)."""
    graph_ms = {"gemm": 0.9, "direct": 0.5, "tiled:a": 0.2, "cudnn:0": 0.3}
    calls = fake_clock(monkeypatch, graph_ms)
    monkeypatch.setattr(autotune.compiler, "compile_parallel", lambda kernels: None)
    seen = {}
    paths = paths_of(graph_ms)
    paths["gemm"] = autotune.searching(
        lambda: seen.setdefault("gemm", autotune.enclosing_cut()) and "gemm")
    paths["direct"] = lambda: seen.setdefault("direct", autotune.enclosing_cut()) or "direct"
    autotune.compiling(paths["tiled:a"], ("conv_tiled.cu", "k"))
    assert autotune._fastest(None, paths) == "tiled:a"
    assert [c[0] for c in calls] == ["direct", "cudnn:0", "tiled:a", "gemm"]
    assert seen == {"direct": None, "gemm": pytest.approx(0.4)}
    assert autotune.enclosing_cut() is None


def test_a_timing_inside_a_candidate_takes_the_tighter_cut(monkeypatch):
    """run_fastest nested in a candidate's first call: each of its candidates gets the
    smaller of its own cut and the enclosing one, the first included."""
    calls = fake_clock(monkeypatch, {"x": 0.3, "y": 0.1, "z": 0.15})
    monkeypatch.setattr(autotune._enclosing, "cut", 0.25, raising=False)
    assert autotune._fastest(None, paths_of("xyz")) == "y"
    assert calls == [("x", 0.25, "cut"), ("y", 0.25, "captured"),
                     ("z", pytest.approx(0.2), "captured")]
    assert autotune.enclosing_cut() == 0.25
    assert autotune.tighter(None, None) is None and autotune.tighter(None, 2.0, 1.0) == 1.0


def test_a_wrapped_launch_keeps_its_marks():
    """conv.py wraps launches (a fused ReLU after, a bias gradient): the wrapper is still
    compiled ahead and still timed last."""
    def run():
        return None
    autotune.searching(autotune.compiling(run, ("conv_tiled.cu", "k")))

    def wrapper():
        return run()
    wrapped = autotune.marked_like(wrapper, run)
    assert wrapped.kernels == (("conv_tiled.cu", "k"),) and wrapped.searches
    assert not hasattr(autotune.marked_like(lambda: None, lambda: None), "searches")


def searching_gemm(seen: list):
    """A searching candidate whose time depends on how far its search went: its light search
    (the heuristic's candidates) gives 'gemm-light', its full one 'gemm-full'."""
    def run():
        seen.append(autotune.light_search())
        return "gemm-light" if autotune.light_search() else "gemm-full"
    return autotune.searching(run)


@pytest.mark.parametrize("light_ms, full_ms, chosen, searches", [
    (0.9, 0.3, "direct", [True]),               # past the cut light: no full search
    (0.5, 0.3, "gemm", [True, False]),          # within reach: searched in full, wins
    (0.5, 0.45, "direct", [True, False]),       # within reach, still slower in full
    (0.35, 0.3, "gemm", [True]),                # the best already: full search comes later
])
def test_a_searching_candidate_is_searched_in_full_only_within_reach(
        monkeypatch, light_ms, full_ms, chosen, searches):
    calls = fake_clock(monkeypatch, {"direct": 0.4, "gemm-light": light_ms,
                                     "gemm-full": full_ms})
    seen = []
    paths = {"gemm": searching_gemm(seen), "direct": lambda: "direct"}
    assert autotune._fastest(None, paths) == chosen
    assert seen == searches
    assert [c[0] for c in calls] == ["direct"] + ["gemm-light", "gemm-full"][:len(searches)]
    assert autotune.light_search() is False and autotune.enclosing_cut() is None


def test_inside_a_light_timing_every_search_stays_light(monkeypatch):
    """A timing nested in a light one keeps its searches light, and searches nothing in full
    itself: the enclosing timing decides that."""
    fake_clock(monkeypatch, {"direct": 0.4, "gemm-light": 0.5, "gemm-full": 0.3})
    monkeypatch.setattr(autotune._enclosing, "light", True, raising=False)
    seen = []
    paths = {"gemm": searching_gemm(seen), "direct": lambda: "direct"}
    assert autotune._fastest(None, paths) == "direct"
    assert seen == [True] and autotune.light_search() is True
