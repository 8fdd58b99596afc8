"""`stepgraph bench` keeps each peer's measured row in a cache file and a later run with the
same peer versions, device, workload, precision and options reuses it (the table marks it and
names the file); stepgraph's rows, and rows that did not measure, are never cached. CPU only,
with fake peers (a prepare that counts its calls)."""
from __future__ import annotations

import json

import pytest

from stepgraph.bench import harness, result_cache
from stepgraph.bench import workloads as wl
from stepgraph.bench.peers import PreparedStep, select_peers
from stepgraph.bench.result_cache import PeerResultCache, peer_key
from tests.unit.bench_support import bench_config

PEERS = ["stepgraph eager", "torch eager", "torch compile", "tinygrad jit"]


@pytest.fixture
def prepared(monkeypatch):
    """Fake peers: every prepare is counted by peer name; 'fail' names peers that raise."""
    calls: dict[str, int] = {}
    fail: set[str] = set()

    def load(peer):
        def prepare(spec):
            calls[peer.name] = calls.get(peer.name, 0) + 1
            if peer.name in fail:
                raise RuntimeError("driver fell over")
            return PreparedStep(lambda i: 1.5, lambda: None, float)
        return prepare

    monkeypatch.setattr(harness, "_load_prepare", load)
    return calls, fail


def run(tmp_path, **overrides):
    cache = PeerResultCache(tmp_path / "peer-results.json", enabled=True)
    config = bench_config(peers=PEERS, workloads=["mlp"], **overrides)
    return harness.run_benchmark(config, cache)


def by_peer(report) -> dict[str, harness.PeerResult]:
    return {r.peer: r for r in report.results}


def test_a_second_run_reuses_the_peers_rows_and_the_table_says_so(tmp_path, prepared, capsys):
    calls, _ = prepared
    first = run(tmp_path)
    assert calls == dict.fromkeys(PEERS, 1) and not any(r.cached for r in first.results)
    stored = json.loads((tmp_path / "peer-results.json").read_text())["entries"]
    assert sorted(e["key"]["peer"] for e in stored.values()) == sorted(PEERS[1:])
    capsys.readouterr()
    second = run(tmp_path)
    assert calls == {"stepgraph eager": 2, "torch eager": 1, "torch compile": 1,
                     "tinygrad jit": 1}            # stepgraph measured again, the peers not
    rows = by_peer(second)
    assert rows["stepgraph eager"].cached == ""
    for name in PEERS[1:]:
        assert rows[name].cached == first.date and rows[name].status == "ok"
        assert rows[name].step_us == by_peer(first)[name].step_us
    table = harness.render_table(second)
    assert "torch eager (cached)" in table and "stepgraph eager (cached)" not in table
    assert str(tmp_path / "peer-results.json") in table.splitlines()[-1]
    progress = capsys.readouterr().err
    assert "stepgraph bench [1/4, 0:00]: mlp fp32 stepgraph eager ..." in progress
    assert f"-> cached (measured {first.date}): " in progress


def test_no_cache_measures_again_and_replaces_the_rows(tmp_path, prepared):
    calls, _ = prepared
    first = run(tmp_path)
    again = run(tmp_path, use_cache=False)
    assert calls == dict.fromkeys(PEERS, 2) and not any(r.cached for r in again.results)
    assert harness.parse_config(["--no-cache"]).use_cache is False
    assert harness.parse_config([]).use_cache is True
    third = run(tmp_path)
    assert by_peer(third)["torch eager"].cached == again.date
    assert first.date <= again.date


@pytest.mark.parametrize("change, remeasured", [
    ({"precisions": ["tf32"]}, {"torch eager", "torch compile", "tinygrad jit"}),
    ({"tinygrad_beam": 2}, {"tinygrad jit"}),
    ({"compile_modes": ("default",)}, {"torch compile"}),
    ({"repeats": 3}, {"torch eager", "torch compile", "tinygrad jit"}),
])
def test_a_change_of_what_is_timed_measures_the_rows_it_touches(tmp_path, prepared, change,
                                                                remeasured):
    calls, _ = prepared
    run(tmp_path)
    run(tmp_path, **change)
    assert {name for name, n in calls.items() if n == 2} == {"stepgraph eager"} | remeasured


def test_the_key_holds_versions_device_and_workload_definition(monkeypatch):
    config = bench_config()
    peer = select_peers(["torch eager"])[0]
    mlp = wl.get_workload("mlp", tiny=True)
    key = peer_key(peer, config, "NVIDIA H200", mlp, "fp32")
    assert set(key.versions) == {"torch", "triton"}
    assert key.digest() == peer_key(peer, config, "NVIDIA H200", mlp, "fp32").digest()
    assert key.digest() != peer_key(peer, config, "NVIDIA H100", mlp, "fp32").digest()
    assert key.digest() != peer_key(peer, config, "NVIDIA H200",
                                    wl.get_workload("mlp"), "fp32").digest()   # other sizes
    monkeypatch.setattr(result_cache, "distribution_versions",
                        lambda library: {"torch": "9.9", "triton": None})
    assert key.digest() != peer_key(peer, config, "NVIDIA H200", mlp, "fp32").digest()


def test_failed_rows_are_not_cached(tmp_path, prepared):
    calls, fail = prepared
    fail.add("torch eager")
    first = run(tmp_path)
    assert by_peer(first)["torch eager"].status == "failed"
    fail.clear()
    second = run(tmp_path)
    assert calls["torch eager"] == 2 and by_peer(second)["torch eager"].status == "ok"
    assert not by_peer(second)["torch eager"].cached


def test_a_damaged_cache_file_is_measured_again_and_replaced(tmp_path, prepared):
    calls, _ = prepared
    (tmp_path / "peer-results.json").write_text("{not json")
    run(tmp_path)
    assert calls["torch eager"] == 1
    assert json.loads((tmp_path / "peer-results.json").read_text())["format"] == 1


def test_the_cache_lives_in_the_stepgraph_cache_dir_and_can_be_switched_off(tmp_path,
                                                                           monkeypatch):
    monkeypatch.setenv("STEPGRAPH_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("STEPGRAPH_DISK_CACHE", raising=False)
    cache = PeerResultCache()
    assert cache.path == tmp_path / "bench" / "peer-results.json" and cache.enabled
    monkeypatch.setenv("STEPGRAPH_DISK_CACHE", "0")
    assert not PeerResultCache().enabled


def test_a_cpu_smoke_run_keeps_nothing(tmp_path, monkeypatch, prepared):
    monkeypatch.setenv("STEPGRAPH_CACHE_DIR", str(tmp_path))
    report = harness.run_benchmark(bench_config(peers=PEERS, workloads=["mlp"]))
    assert report.cache_file == "" and not (tmp_path / "bench").exists()
