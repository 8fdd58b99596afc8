"""scripts/compat-bench's --compile-cache, --compile-only and --jobs, on the CPU without running
torch.compile (Inductor's CPU compiles take minutes): the cache folder and switches are set
before Inductor is imported and reported, a compile-only run times nothing, its builds are
recorded with their cache use, and --jobs processes compile into private copies of the folder
that are merged back (stepgraph/bench/inductor_cache.py)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stepgraph.bench import inductor_cache
from stepgraph.bench.peers import PeerTimeout
from tests.compat.test_compat_bench import ROOT, load_script

SCRIPT = str(ROOT / "scripts" / "compat-bench")


def run_script(*argv, timeout=180):
    run = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--tiny", *argv],
                         cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def test_the_new_options_are_parsed():
    bench = load_script()
    args = bench.parse_args(["--compile-cache", "c", "--compile-only", "--jobs", "3"])
    assert (args.compile_cache, args.compile_only, args.jobs) == ("c", True, 3)
    args = bench.parse_args([])
    assert (args.compile_cache, args.compile_only, args.jobs) == (None, False, 1)


def test_jobs_need_compile_only_and_a_cache(capsys):
    bench = load_script()
    assert bench.main(["--device", "cpu", "--jobs", "2", "--compile-only"]) == 2
    assert bench.main(["--device", "cpu", "--jobs", "2", "--compile-cache", "x"]) == 2
    assert bench.main(["--device", "cpu", "--jobs", "0"]) == 2
    assert "--jobs needs --compile-only and --compile-cache" in capsys.readouterr().err


def test_a_job_command_line_keeps_every_option_that_shapes_the_compiles(tmp_path):
    bench = load_script()
    args = bench.parse_args(["--models", "gpt", "vit", "--compile-only", "--jobs", "2",
                             "--compile-cache", "c", "--compile-modes", "max-autotune",
                             "--precisions", "bf16", "tf32", "--optimizer", "adamw",
                             "--warmup", "3", "--stage-timeout", "0", "--tiny",
                             "--class", "Net", "--kwargs", '{"d": 4}', "--loss", "none",
                             "--batch", "float32:2x4"])
    job = bench.parse_args(bench.job_argv(args, "vit", tmp_path / "c0", tmp_path / "o.json"))
    changed = {"models": ["vit"], "compile_cache": str(tmp_path / "c0"),
               "out": str(tmp_path / "o.json"), "jobs": 1}
    assert vars(job) == {**vars(args), **changed}


def test_the_cache_folder_is_set_before_inductor_loads_and_reported(tmp_path):
    """A timed run with --compile-cache: the JSON config names the folder, the environment and
    the switches, set while Inductor was not yet imported; the footer says the cache was used."""
    cache, out = tmp_path / "cache", tmp_path / "report.json"
    run = run_script("--models", "gpt", "--precisions", "fp32", "--compile-modes", "none",
                     "--steps", "1", "--repeats", "1", "--warmup", "1",
                     "--compile-cache", str(cache), "--out", str(out))
    data = json.loads(out.read_text())
    setup = data["config"]["inductor_cache"]
    assert data["config"]["compile_cache"] == str(cache)
    assert setup["dir"] == str(cache) and cache.is_dir()
    assert setup["env"] == {"TORCHINDUCTOR_CACHE_DIR": str(cache),
                            "TRITON_CACHE_DIR": str(cache / "triton"),
                            "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
                            "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}
    assert setup["config"] == {"torch._inductor.config.force_disable_caches": False,
                               "torch._inductor.config.fx_graph_cache": True,
                               "torch._inductor.config.autotune_local_cache": True,
                               "torch._functorch.config.enable_autograd_cache": True}
    assert setup["missing"] == [] and setup["inductor_loaded_before"] is False
    (row,) = data["rows"]
    assert row["systems"]["torch eager"]["status"] == "ok"   # the run itself goes on
    assert any(line.startswith(f"compile cache: {cache} (") for line in run.stdout.splitlines())


def test_a_run_without_the_option_reports_no_cache(tmp_path):
    out = tmp_path / "report.json"
    run = run_script("--compile-only", "--models", "gpt", "--out", str(out))
    assert json.loads(out.read_text())["config"]["inductor_cache"] is None
    assert "compile cache:" not in run.stdout


def test_use_sets_the_environment_and_the_config_modules(tmp_path):
    """In a fresh interpreter: what `use` reports is what Inductor then reads (its cache_dir(),
    which builds every cache's path, and the config values)."""
    code = ("import json, sys; from stepgraph.bench import inductor_cache as c; "
            "r = c.use(sys.argv[1]); "
            "from torch._inductor.runtime.cache_dir_utils import cache_dir; "
            "import torch._inductor.config as ic, torch._functorch.config as fc; "
            "print(json.dumps([r['inductor_loaded_before'], cache_dir(), ic.fx_graph_cache, "
            "ic.autotune_local_cache, ic.force_disable_caches, fc.enable_autograd_cache]))")
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path / "c")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout) == [False, str(tmp_path / "c"), True, True, False, True]


def test_compile_only_times_nothing_and_says_so(tmp_path):
    out = tmp_path / "report.json"
    run = run_script("--compile-only", "--compile-modes", "none", "--models", "gpt",
                     "--compile-cache", str(tmp_path / "cache"), "--out", str(out))
    data = json.loads(out.read_text())
    assert data["rows"] == [] and data["compiled"] == [] and list(data["models"]) == ["gpt"]
    assert "--compile-only: no system timed (0 torch.compile builds)" in run.stdout
    assert "no torch.compile mode to build" in run.stderr


class FakeStep:
    """A prepared torch.compile step that counts its steps and bumps Inductor's cache counters
    as a compile that hits (or misses) would."""

    def __init__(self, hit: bool):
        self.steps, self.hit = 0, hit

    precision_label = "max-autotune"
    notes: list = []
    read_loss = float

    def run_step(self, i):
        from torch._dynamo.utils import counters
        if self.steps == 0:
            key = "fxgraph_cache_hit" if self.hit else "fxgraph_cache_miss"
            counters["inductor"][key] += 2
        self.steps += 1
        return 1.0

    def synchronize(self):
        pass


def test_compile_only_builds_each_mode_and_precision_untimed(tmp_path, monkeypatch):
    """In-process with the torch.compile step faked: every (precision, mode) is built and run
    for the warm-up steps; no system is prepared for timing and nothing is timed."""
    bench = load_script()
    built = []

    def prepare(s, precision, device, mode):
        built.append((precision, mode, FakeStep(hit=precision == "fp32")))
        return built[-1][2]

    def refuse(*a, **k):
        raise AssertionError("timed or prepared a system under --compile-only")
    monkeypatch.setattr(bench, "prepare_torch_compile", prepare)
    monkeypatch.setattr(bench, "time_repeats", refuse)
    monkeypatch.setattr(bench, "PREPARE", {s: refuse for s in bench.PREPARE})
    out = tmp_path / "report.json"
    assert bench.main(["--device", "cpu", "--tiny", "--compile-only", "--models", "gpt",
                       "--precisions", "fp32", "bf16", "--compile-modes", "max-autotune",
                       "default", "--warmup", "3", "--out", str(out)]) == 0
    assert [(p, m, f.steps) for p, m, f in built] == [
        ("fp32", "max-autotune", 3), ("fp32", "default", 3), ("bf16", "max-autotune", 3),
        ("bf16", "default", 3)]
    data = json.loads(out.read_text())
    assert data["rows"] == []
    entries = [(e["precision"], e["mode"], e["status"], e["compile_cache"]["cache"],
                e["compile_cache"]["inductor.fxgraph_cache_hit"]) for e in data["compiled"]]
    assert entries == [("fp32", "max-autotune", "ok", "warm", 2), ("fp32", "default", "ok",
                                                                   "warm", 2),
                       ("bf16", "max-autotune", "ok", "cold", 0),
                       ("bf16", "default", "ok", "cold", 0)]


def test_a_timed_compile_row_says_whether_its_setup_was_warm(monkeypatch, tmp_path):
    """With --compile-cache, measure() notes a torch compile setup's cache use, and the table
    shows it by the mode; without it (inductor's default caches) no verdict is given."""
    bench = load_script()
    monkeypatch.setattr(bench, "prepare_torch_compile",
                        lambda s, precision, device, mode: FakeStep(hit=True))
    plain = ["--device", "cpu", "--warmup", "2", "--steps", "1", "--repeats", "1"]
    unnamed = bench.measure("torch compile", None, "fp32", bench.parse_args(plain), "default")
    assert unnamed.status == "ok" and unnamed.compile_cache is None
    args = bench.parse_args(plain + ["--compile-cache", str(tmp_path / "cache")])
    m = bench.measure("torch compile", None, "fp32", args, "max-autotune")
    assert m.status == "ok", m.error
    assert m.compile_cache["cache"] == "warm" and m.setup_s is not None and m.step_us > 0
    monkeypatch.setattr(bench, "prepare_torch_compile",
                        lambda s, precision, device, mode: FakeStep(hit=False))
    cold = bench.measure("torch compile", None, "fp32", args, "default")
    assert cold.compile_cache["cache"] == "cold"
    row = {"model": "gpt", "precision": "fp32", "speedup_vs_eager": None,
           "speedup_vs_graph": None, "speedup_vs_compile": None,
           "systems": {"stepgraph": {"step_us": 1.0, "status": "ok", "precision_label": ""},
                       "torch eager": {"step_us": 2.0, "status": "ok"},
                       "torch graph": {"step_us": None, "status": "n/a"},
                       "torch compile": vars(m)}}
    assert f"{m.step_us:.1f} (max-autotune, warm cache)" in bench.table([row])


def test_a_compile_cut_by_its_time_limit_says_where_its_progress_is(monkeypatch, tmp_path):
    bench = load_script()

    def cut(s, precision, device, mode):
        raise PeerTimeout("no result within 1 s (--stage-timeout)")
    monkeypatch.setattr(bench, "prepare_torch_compile", cut)
    plain = ["--device", "cpu", "--warmup", "1", "--steps", "1", "--repeats", "1"]
    m = bench.measure("torch compile", None, "fp32", bench.parse_args(plain), "max-autotune")
    assert m.status == "failed" and m.notes == []
    cache = str(tmp_path / "cache")
    args = bench.parse_args(plain + ["--compile-cache", cache])
    m = bench.measure("torch compile", None, "fp32", args, "max-autotune")
    assert m.status == "failed" and "PeerTimeout" in m.error
    assert m.notes == [f"its benchmarked selections stay in {cache}; "
                       "scripts/compile-choices pack carries them to another machine"]


@pytest.mark.parametrize("hits, misses, verdict", [
    ({"inductor.fxgraph_cache_hit": 2}, {}, "warm"),
    ({}, {"inductor.fxgraph_cache_miss": 1}, "cold"),
    ({"aot_autograd.autograd_cache_hit": 1}, {"inductor.select_algorithm_autotune": 3},
     "partial"),
    ({}, {}, "none"),
])
def test_the_cache_verdict(hits, misses, verdict):
    before = {f"{g}.{n}": 10 for g, n in inductor_cache.HITS + inductor_cache.MISSES}
    after = {key: value + hits.get(key, 0) + misses.get(key, 0) for key, value in
             before.items()}
    got = inductor_cache.state(before, after)
    assert got["cache"] == verdict
    assert {k: v for k, v in got.items() if k != "cache" and v} == {**hits, **misses}


def test_job_folders_are_seeded_and_merged_back(tmp_path):
    """A job's folder starts as a copy of the cache (locks left out); merging copies the files
    the cache lacks, keeps the ones it has, and merges the autotune timings file key by key."""
    cache = tmp_path / "cache"
    (cache / "fxgraph" / "ab").mkdir(parents=True)
    (cache / "fxgraph" / "ab" / "entry").write_text("old graph")
    (cache / "locks").mkdir()
    (cache / "locks" / "x.lock").write_text("")
    (cache / "cache").mkdir()
    timings = cache / "cache" / "syshash"
    timings.write_text(json.dumps({"system": {"d": 1}, "cache": {
        "mm": {"[shape1]": {"highest": {"choiceA": 1.0}}}}}))
    job = inductor_cache.job_folder(cache, "0-gpt")
    assert job == cache / ".jobs" / "0-gpt"
    assert (job / "fxgraph" / "ab" / "entry").read_text() == "old graph"
    assert not (job / "locks").exists()
    # what the job's process adds: a new graph, a changed copy of an old file, new timings
    (job / "fxgraph" / "cd").mkdir()
    (job / "fxgraph" / "cd" / "entry").write_text("new graph")
    (job / "fxgraph" / "ab" / "entry").write_text("rewritten")
    (job / "triton" / "0").mkdir(parents=True)
    (job / "triton" / "0" / "k.cubin").write_bytes(b"\x00\x01")
    (job / "cache" / "syshash").write_text(json.dumps({"system": {"d": 1}, "cache": {
        "mm": {"[shape1]": {"highest": {"choiceA": 9.0, "choiceB": 2.0}},
               "[shape2]": {"highest": {"choiceA": 3.0}}}}}))
    assert inductor_cache.merge(job, cache) == 3
    assert (cache / "fxgraph" / "cd" / "entry").read_text() == "new graph"
    assert (cache / "fxgraph" / "ab" / "entry").read_text() == "old graph"
    assert (cache / "triton" / "0" / "k.cubin").read_bytes() == b"\x00\x01"
    assert json.loads(timings.read_text()) == {"system": {"d": 1}, "cache": {"mm": {
        "[shape1]": {"highest": {"choiceA": 1.0, "choiceB": 2.0}},
        "[shape2]": {"highest": {"choiceA": 3.0}}}}}
    assert inductor_cache.merge(job, cache) == 0    # nothing new the second time


def test_jobs_compile_each_model_in_its_own_process(tmp_path):
    """--jobs 2 over three models (no mode to build on the CPU): one process a model, each
    with its own log and report merged into the run's, the job folders gone afterwards."""
    cache, out = tmp_path / "cache", tmp_path / "report.json"
    run_script("--compile-only", "--compile-modes", "none", "--models", "gpt", "mixer",
               "prefix_seq", "--jobs", "2", "--compile-cache", str(cache), "--out", str(out),
               timeout=300)
    data = json.loads(out.read_text())
    assert data["rows"] == [] and data["setup_errors"] == {}
    assert sorted(data["models"]) == ["gpt", "mixer", "prefix_seq"]
    logs = Path(str(out) + ".jobs")
    assert sorted(p.name for p in logs.glob("*.log")) == ["0-gpt.log", "1-mixer.log",
                                                          "2-prefix_seq.log"]
    assert "--compile-only: no system timed" in (logs / "1-mixer.log").read_text()
    assert not (cache / ".jobs").exists()


def test_stepgraph_bench_takes_the_cache_folder_before_anything_runs(tmp_path, monkeypatch):
    """`stepgraph bench --compile-cache DIR`: the config keeps it, run_benchmark points the
    caches at it before it looks at the device, and the table's footer names it."""
    from stepgraph.bench import harness
    folder = str(tmp_path / "c")
    config = harness.parse_config(["--compile-cache", folder, "--device", "cpu", "--tiny",
                                   "--workloads", "mlp", "--peers", "stepgraph"])
    assert config.compile_cache == folder
    assert harness.parse_config(["--device", "cpu"]).compile_cache == ""
    calls = []
    monkeypatch.setattr(harness.inductor_cache, "use", lambda d: calls.append(("use", d)))

    def no_device(config):
        calls.append(("device",))
        raise harness.NoGpuError("stop here")
    monkeypatch.setattr(harness, "require_device", no_device)
    with pytest.raises(harness.NoGpuError):
        harness.run_benchmark(config)
    assert calls == [("use", folder), ("device",)]
    report = harness.BenchReport("today", "cpu", "host", "3", {}, config, {}, [])
    assert f"compile cache: {folder} (" in harness.render_table(report)
    plain = harness.BenchReport("today", "cpu", "host", "3", {},
                                harness.parse_config(["--device", "cpu"]), {}, [])
    assert "compile cache:" not in harness.render_table(plain)


@pytest.mark.parametrize("hit, note", [
    (True, "Inductor caches warm: autograd_cache_hit 1"),
    (False, "Inductor caches cold: fxgraph_cache_miss 1"),
])
def test_the_bench_torch_compile_row_notes_its_cache_use(monkeypatch, hit, note):
    """stepgraph bench's torch compile peer (its mode search faked: what a compile that hits
    or misses counts) notes how its compile used the on-disk caches."""
    from torch._dynamo.utils import counters

    from stepgraph.bench import harness
    from stepgraph.bench import workloads as wl
    from stepgraph.bench.peers import torch_compile as tc
    from tests.unit.bench_support import bench_config

    def search(spec, layout, synchronize):
        if hit:
            counters["aot_autograd"]["autograd_cache_hit"] += 1
        else:
            counters["inductor"]["fxgraph_cache_miss"] += 1
        return tc._Candidate("default", lambda i: 0.0, lambda: None), ["searched"]
    monkeypatch.setattr(tc, "_search", search)
    spec = harness.make_spec(wl.get_workload("mlp", tiny=True), "fp32", bench_config())
    prepared = tc.prepare(spec)
    try:
        assert note in prepared.notes and "searched" in prepared.notes
        assert sum(n.startswith("Inductor caches") for n in prepared.notes) == 1
    finally:
        prepared.close()


def test_the_choices_pack_carries_timings_and_best_configs_only(tmp_path):
    """pack_choices keeps the autotune timings and the kernels' best configs (not graphs, kernels,
    locks or job copies); unpack_choices merges them into another folder by key, so a compile
    on a fresh machine skips the selections already benchmarked."""
    cache = tmp_path / "cache"
    for name, text in {"cache/syshash": json.dumps({"system": {"d": 1}, "cache": {
                           "mm": {"[s1]": {"highest": {"A": 1.0}}}}}),
                       "fxgraph/ab/entry": "graph", "triton/0/k.cubin": "kernel",
                       "x7/kernel.py": "source", "x7/key1.best_config": '{"XBLOCK": 64}',
                       "locks/l.lock": "", ".jobs/0-gpt/x8/key2.best_config": "{}"}.items():
        (cache / name).parent.mkdir(parents=True, exist_ok=True)
        (cache / name).write_text(text)
    assert [p.relative_to(cache).as_posix() for p in inductor_cache.choice_files(cache)] == \
        ["cache/syshash", "x7/key1.best_config"]
    files, size_bytes = inductor_cache.pack_choices(cache, tmp_path / "choices.tgz")
    assert files == 2 and size_bytes == (tmp_path / "choices.tgz").stat().st_size

    other = tmp_path / "other"
    (other / "cache").mkdir(parents=True)
    (other / "cache" / "syshash").write_text(json.dumps({"system": {"d": 1}, "cache": {
        "mm": {"[s1]": {"highest": {"A": 5.0}}, "[s2]": {"highest": {"B": 2.0}}}}}))
    assert inductor_cache.main(["unpack", str(tmp_path / "choices.tgz"), str(other)]) == 0
    assert sorted(p.relative_to(other).as_posix() for p in other.rglob("*") if p.is_file()) == \
        ["cache/syshash", "x7/key1.best_config"]
    assert json.loads((other / "cache" / "syshash").read_text())["cache"] == {"mm": {
        "[s1]": {"highest": {"A": 5.0}}, "[s2]": {"highest": {"B": 2.0}}}}
    assert (other / "x7" / "key1.best_config").read_text() == '{"XBLOCK": 64}'
    fresh = tmp_path / "fresh"
    assert inductor_cache.unpack_choices(tmp_path / "choices.tgz", fresh) == 2
    assert json.loads((fresh / "cache" / "syshash").read_text())["cache"] == {"mm": {
        "[s1]": {"highest": {"A": 1.0}}}}


def test_the_choices_script_packs_and_says_what_went_wrong(tmp_path):
    (tmp_path / "c" / "cache").mkdir(parents=True)
    (tmp_path / "c" / "cache" / "syshash").write_text("{}")
    script = str(ROOT / "scripts" / "compile-choices")
    run = subprocess.run([sys.executable, script, "pack", str(tmp_path / "c"),
                          str(tmp_path / "c.tgz")], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "packed 1 files" in run.stdout, run.stderr
    run = subprocess.run([sys.executable, script, "pack", str(tmp_path / "none"),
                          str(tmp_path / "n.tgz")], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "no compile cache folder" in run.stderr
    assert not (tmp_path / "n.tgz").exists()
