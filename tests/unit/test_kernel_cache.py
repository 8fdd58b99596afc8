"""The on-disk cache of kernel choices (stepgraph/cache.py) and its users (autotune.py,
gemm.py), with a fake device identity: where it lives, what keys an entry, that damaged or
foreign entries are never trusted and get rewritten, concurrent writers, and the CLI."""
from __future__ import annotations

import json
import multiprocessing
import types

import numpy as np
import pytest

from stepgraph import cache, cli

IDENTITY = {"gpu": "Fake H100", "sm": "90", "driver": 13000, "cuda": 13000, "cublaslt": 130000,
            "cupy": "14.0.0", "stepgraph": "0.1.0", "kernels": "abc"}


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "sg-cache"))
    monkeypatch.delenv(cache.SWITCH_ENV, raising=False)
    return tmp_path / "sg-cache"


def test_cache_dir_follows_env_xdg_and_home(tmp_path, monkeypatch):
    monkeypatch.delenv(cache.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == tmp_path / "xdg" / "stepgraph"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.cache_dir() == tmp_path / "home" / ".cache" / "stepgraph"
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "elsewhere"))
    assert cache.cache_dir() == tmp_path / "elsewhere"


def test_round_trip_and_the_key(root):
    c = cache.ChoiceCache("paths", IDENTITY)
    assert c.get("('conv2d', 1)") is None and c.misses == 1
    assert c.put("('conv2d', 1)", "tiled:2x2k1")
    assert c.get("('conv2d', 1)") == "tiled:2x2k1" and c.hits == 1
    assert c.path("('conv2d', 1)").parent == root / "choices" / "paths"
    # another GPU, driver or library version, another problem or kind: another entry
    for other in ({**IDENTITY, "gpu": "Fake H200"}, {**IDENTITY, "driver": 13010},
                  {**IDENTITY, "kernels": "abd"}):
        assert cache.ChoiceCache("paths", other).get("('conv2d', 1)") is None
    assert c.get("('conv2d', 2)") is None
    assert cache.ChoiceCache("gemm", IDENTITY).get("('conv2d', 1)") is None


@pytest.mark.parametrize("damage", ["truncated", "garbage", "checksum", "identity",
                                    "problem", "format", "not-a-dict"])
def test_damaged_entries_are_ignored_and_rewritten(root, damage):
    c = cache.ChoiceCache("paths", IDENTITY)
    problem = "('linear', (128, 784))"
    c.put(problem, "cublaslt")
    path = c.path(problem)
    record = json.loads(path.read_text())
    if damage == "truncated":
        path.write_text(path.read_text()[:40])
    elif damage == "garbage":
        path.write_bytes(b"\x00\xff" * 10)
    elif damage == "checksum":                      # a value changed behind the checksum
        path.write_text(json.dumps({**record, "value": "tile:s4"}))
    elif damage in ("identity", "problem", "format"):   # consistent, but not for this key
        changed = {"identity": {**IDENTITY, "gpu": "other"}, "problem": "other",
                   "format": 99}[damage]
        forged = {**record, damage: changed}
        forged["sha256"] = cache._checksum(forged)
        path.write_text(json.dumps(forged))
    else:
        path.write_text(json.dumps(["cublaslt"]))
    assert c.get(problem) is None and c.rejected == 1
    c.put(problem, "tile:s2")                       # the fresh choice replaces it
    assert c.get(problem) == "tile:s2"


def test_values_must_pass_the_callers_check(root):
    c = cache.ChoiceCache("paths", IDENTITY)
    c.put("p", "tiled:2x4k5")
    assert c.get("p", lambda v: v in {"gemm", "direct"}) is None
    assert c.get("p", lambda v: v["index"] > 0) is None          # a raising check: rejected
    assert c.get("p", lambda v: v in {"gemm", "tiled:2x4k5"}) == "tiled:2x4k5"


def test_an_unwritable_cache_never_fails(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(cache.CACHE_ENV, str(blocker))
    c = cache.ChoiceCache("paths", IDENTITY)
    assert c.put("p", "gemm") is False and c.get("p") is None


def _hammer(args):
    root, worker, rounds = args
    c = cache.ChoiceCache("paths", IDENTITY, root=root)
    seen = set()
    for i in range(rounds):
        c.put("shared", f"w{worker}:{i}")
        value = c.get("shared")
        seen.add(value is not None and value.startswith("w"))
    return seen, c.rejected


def test_concurrent_processes_never_see_a_partial_entry(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(3) as pool:
        results = pool.map(_hammer, [(tmp_path, w, 40) for w in range(3)])
    assert all(seen == {True} and rejected == 0 for seen, rejected in results)
    assert not list((tmp_path / "choices").rglob("*.tmp"))
    assert cache.ChoiceCache("paths", IDENTITY, root=tmp_path).get("shared").startswith("w")


def test_clear_info_and_the_command_line(root, capsys):
    c = cache.ChoiceCache("gemm", IDENTITY)
    c.put("a", {"index": 1, "algo": "00"})
    c.put("b", {"index": 0, "algo": "01"})
    cache.ChoiceCache("paths", IDENTITY).put("c", "gemm")
    summary = cache.info()
    assert summary["directory"] == str(root)
    assert summary["namespaces"]["gemm"]["entries"] == 2
    assert summary["namespaces"]["paths"]["entries"] == 1
    assert cli.main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert str(root) in out and "gemm" in out
    assert cli.main(["cache", "clear"]) == 0
    assert "removed 3" in capsys.readouterr().out
    assert cache.info()["namespaces"] == {} and c.get("a") is None
    assert cli.main(["cache", "info"]) == 0
    assert "no kernel choices cached" in capsys.readouterr().out


# ---- the users: autotune.run_fastest and GemmCache ---------------------------------------

autotune = pytest.importorskip("stepgraph.backends.cuda.runtime.autotune")


class FakeStream:
    def is_capturing(self):
        return False


def fake_ctx():
    return types.SimpleNamespace(stream=FakeStream(), paths={}, capturing=False, device_id=0)


@pytest.fixture
def fake_device(root, monkeypatch):
    """autotune's identity and timing without a GPU: paths time as TIMES says."""
    monkeypatch.setattr(autotune, "device_identity", lambda device: dict(IDENTITY))
    monkeypatch.setattr(autotune, "_caches", {})
    timed, compiled = [], []
    monkeypatch.setattr(autotune, "time_on_device",
                        lambda ctx, run, **_: timed.append(run.__name__) or TIMES[run.__name__])
    monkeypatch.setattr(autotune.compiler, "compile_parallel",
                        lambda kernels: compiled.extend(kernels))
    return timed, compiled


TIMES = {"gemm": 3.0, "direct": 2.0, "tiled": 1.0}


def paths_and_runs():
    ran = []

    def make(name):
        def run():
            ran.append(name)
        run.__name__ = name
        return run
    paths = {name: make(name) for name in TIMES}
    autotune.compiling(paths["tiled"], ("conv_tiled.cu", "k<1>"))
    return paths, ran


def test_run_fastest_times_once_then_reads_the_disk(fake_device):
    timed, compiled = fake_device
    key = ("conv2d", (64, 1, 28, 28), "float32", "fp32")
    paths, ran = paths_and_runs()
    autotune.run_fastest(fake_ctx(), key, paths, "gemm")
    assert ran == ["tiled"] and sorted(timed) == sorted(TIMES)
    assert compiled == [("conv_tiled.cu", "k<1>")]      # compiled before timing
    timed.clear()
    autotune._caches.clear()                              # a new process: fresh memory
    paths, ran = paths_and_runs()
    autotune.run_fastest(fake_ctx(), key, paths, "gemm")
    assert ran == ["tiled"] and timed == []               # no timing, nothing compiled
    # a stored path that is no longer a candidate is not trusted: timed again
    paths, ran = paths_and_runs()
    del paths["tiled"]
    autotune.run_fastest(fake_ctx(), key, paths, "gemm")
    assert ran == ["direct"] and sorted(timed) == ["direct", "gemm"]


def test_run_fastest_without_the_disk(fake_device, monkeypatch):
    timed, _ = fake_device
    monkeypatch.setenv(cache.SWITCH_ENV, "0")
    for _ in range(2):
        autotune._caches.clear()
        paths, ran = paths_and_runs()
        autotune.run_fastest(fake_ctx(), "k", paths, "gemm")
        assert ran == ["tiled"]
    assert len(timed) == 2 * len(TIMES) and cache.entries() == []


def test_gemm_choices_must_match_an_offered_algorithm():
    """A stored choice names an algorithm by its bytes: found wherever the heuristic lists it
    now (its order may differ between processes), refused when nowhere usable."""
    gemm = pytest.importorskip("stepgraph.backends.cuda.matmul.gemm")
    results = np.zeros(3, [("algo", "<u8", (8,)), ("workspace_size", "<u8"), ("state", "<i4")])
    results["algo"][:, 0] = [11, 22, 33]
    results["workspace_size"][2] = 1 << 40                # needs more than the workspace
    planned = types.SimpleNamespace(heuristic=results)
    good = {"index": 1, "algo": results[1]["algo"].tobytes().hex()}
    assert gemm._offered(planned, good, gemm.WORKSPACE_BYTES) == 1
    assert gemm._offered(planned, {**good, "index": 0}, gemm.WORKSPACE_BYTES) == 1  # moved
    assert gemm._offered(planned, {**good, "index": 7}, gemm.WORKSPACE_BYTES) == 1
    unknown = {"index": 1, "algo": np.full(8, 99, "<u8").tobytes().hex()}
    assert gemm._offered(planned, unknown, gemm.WORKSPACE_BYTES) is None
    assert gemm._offered(planned, {"index": 2, "algo": results[2]["algo"].tobytes().hex()},
                         gemm.WORKSPACE_BYTES) is None        # offered, but not usable


def test_compile_parallel_compiles_each_once_and_leaves_failures_to_the_launch():
    compiler = pytest.importorskip("stepgraph.backends.cuda.runtime.compiler")
    done = []

    def one(pair):
        done.append(pair)
        if pair[1] == "bad":
            raise RuntimeError("nvrtc says no")

    pairs = [("a.cu", "k<1>"), ("a.cu", "bad"), ("a.cu", "k<1>"), ("b.cu", "k")]
    compiler.compile_parallel(pairs, compile_one=one)
    assert sorted(done) == sorted(set(pairs))


def test_typed_files_compile_chunks_per_element_type(monkeypatch):
    """A TYPED_SOURCES file is compiled in chunks per element type (its plain kernels in a
    module of their own), other files in chunks of every declared instantiation; prefetch
    starts only the types a plan names. No NVRTC here: the modules started are recorded."""
    compiler = pytest.importorskip("stepgraph.backends.cuda.runtime.compiler")
    started = []
    monkeypatch.setattr(compiler, "_declared", {})
    monkeypatch.setattr(compiler, "_chunk_maps", {})
    monkeypatch.setitem(compiler.CHUNK_INSTANTIATIONS, "loss.cu", 2)
    monkeypatch.setitem(compiler.CHUNK_INSTANTIATIONS, "optim.cu", 2)
    monkeypatch.setattr(compiler, "_start_module",
                        lambda filename, names=(): started.append((filename, names)))
    compiler.declare({"loss.cu": {"plain", "ce<int>", "ce<long long>", "nll<long long>",
                                  "a<long long>", "b<long long>"},
                      "optim.cu": {"upd<float>", "upd<double, 4>", "step", "upd<int>"}})
    assert "loss.cu" in compiler.TYPED_SOURCES and "optim.cu" not in compiler.TYPED_SOURCES

    compiler._start_kernel("loss.cu", "ce<long long>")
    compiler._start_kernel("loss.cu", "plain")
    compiler._start_kernel("loss.cu", "ce<double>")          # declared by nobody: its own
    compiler._start_kernel("optim.cu", "step")
    compiler._start_kernel("optim.cu", "upd<int>")
    assert started == [("loss.cu", ("ce<long long>", "nll<long long>")), ("loss.cu", ()),
                       ("loss.cu", ("ce<double>",)), ("optim.cu", ()), ("optim.cu", ("upd<int>",))]

    started.clear()
    compiler.prefetch(["loss.cu", "optim.cu"], ctypes={"long long", "float"})
    assert started == [("loss.cu", ()), ("loss.cu", ("a<long long>", "b<long long>")),
                       ("loss.cu", ("ce<long long>", "nll<long long>")),
                       ("optim.cu", ()), ("optim.cu", ("upd<double, 4>", "upd<float>")),
                       ("optim.cu", ("upd<int>",))]
    assert compiler._element_type("upd<double, 4>") == "double"
