"""The chunks the NVRTC compiler cuts the families' kernel files into (runtime/compiler.py):
every declared template instantiation in exactly one chunk of its file (and element type),
each kernel name found in the chunk that holds it, undeclared instantiations compiled alone,
and a launch that needs a module nobody has started compiling it itself. No GPU, no NVRTC:
test_nvrtc_compile.py compiles every chunk."""
from __future__ import annotations

import re
import threading

import pytest

pytest.importorskip("cupy")

from stepgraph.backends.cuda import backend  # noqa: E402
from stepgraph.backends.cuda.runtime import compiler  # noqa: E402


@pytest.fixture
def declared(monkeypatch):
    """The compiler's declarations as a backend makes them, in a private table."""
    monkeypatch.setattr(compiler, "_declared", {})
    monkeypatch.setattr(compiler, "_declared_per_shape", {})
    monkeypatch.setattr(compiler, "_chunk_maps", {})
    names = backend.declared_kernel_names()
    compiler.declare(names)
    return names


def test_split_evenly_cuts_runs_of_at_most_size_differing_by_one():
    names = [f"k<{i}>" for i in range(10)]
    runs = compiler.split_evenly(names, 4)
    assert [len(run) for run in runs] == [4, 3, 3]
    assert [n for run in runs for n in run] == names
    assert compiler.split_evenly(names[:4], 4) == [tuple(names[:4])]
    assert compiler.split_evenly(names[:5], 2) == [tuple(names[:2]), tuple(names[2:4]),
                                                   (names[4],)]
    assert compiler.split_evenly([], 3) == []


def test_chunks_cover_every_declared_instantiation_exactly_once(declared):
    """Of each file, the chunks hold each declared template instantiation once, none more
    than CHUNK_INSTANTIATIONS, and (TYPED_SOURCES) only those of one element type."""
    for filename, names in declared.items():
        chunks = compiler.chunks(filename)
        held = [name for chunk in chunks for name in chunk]
        assert sorted(held) == sorted(n for n in names
                                      if "<" in n and not compiler.per_shape(filename, n))
        size = compiler.CHUNK_INSTANTIATIONS.get(filename,
                                                 compiler.DEFAULT_CHUNK_INSTANTIATIONS)
        assert all(0 < len(chunk) <= size for chunk in chunks), filename
        if filename in compiler.TYPED_SOURCES:
            assert all(len({compiler._element_type(n) for n in chunk}) == 1
                       for chunk in chunks), filename


def test_a_kernel_name_maps_to_the_chunk_that_holds_it(declared):
    for filename, names in declared.items():
        for name in names:
            chunk = compiler.chunk_of(filename, name)
            if "<" not in name:
                assert chunk == ()                 # the file's plain module
            elif compiler.per_shape(filename, name):
                assert chunk == (name,)
            else:
                assert name in chunk and chunk in compiler.chunks(filename)


def test_an_undeclared_instantiation_compiles_alone(declared):
    assert compiler.chunk_of("loss.cu", "cross_entropy_train_kernel<double, double, int>") == \
        ("cross_entropy_train_kernel<double, double, int>",)
    assert compiler.chunk_of("nowhere.cu", "k<float>") == ("k<float>",)


def test_a_later_declaration_rechunks_its_file(monkeypatch):
    monkeypatch.setattr(compiler, "_declared", {})
    monkeypatch.setattr(compiler, "_chunk_maps", {})
    monkeypatch.setitem(compiler.CHUNK_INSTANTIATIONS, "x.cu", 2)
    compiler.declare({"x.cu": {"k<1>", "k<2>"}})
    assert compiler.chunk_of("x.cu", "k<2>") == ("k<1>", "k<2>")
    compiler.declare({"x.cu": {"k<3>"}})
    assert compiler.chunk_of("x.cu", "k<2>") == ("k<1>", "k<2>")
    assert compiler.chunk_of("x.cu", "k<3>") == ("k<3>",)
    compiler.declare({"x.cu": {"k<0>"}})
    assert compiler.chunk_of("x.cu", "k<1>") == ("k<0>", "k<1>")
    assert compiler.chunk_of("x.cu", "k<3>") == ("k<2>", "k<3>")


def test_file_modules_are_the_plain_module_and_the_chunks_of_the_types_asked(declared):
    loss = compiler.file_modules("loss.cu", {"float"})
    assert loss[0] == () and len(loss) > 2
    assert all(compiler._element_type(chunk[0]) == "float" for chunk in loss[1:])
    assert not any(() in [chunk] for chunk in compiler.file_modules("conv_direct.cu"))
    assert compiler.file_modules("optim.cu") == [()]              # plain kernels only
    # a per-shape file: its shape-free templates only (the partial sums, one per storage)
    assert [name.split("<")[0] for chunk in compiler.file_modules("conv_tiled.cu")
            for name in chunk] == ["conv2d_tiled_grad_weight_sum_kernel"] * 4
    assert compiler.file_modules("attention.cu") == []
    everything = compiler.declared_modules()
    assert len(everything) == len(set(everything))
    held = {(f, n) for f, chunk in everything for n in chunk}
    assert held == {(f, n) for f, names in declared.items() for n in names if "<" in n
                    and (f in compiler.PRECOMPILED_PER_SHAPE or not compiler.per_shape(f, n))}


def test_early_families_declare_their_files_whole(declared):
    """The backend starts the early families' chunks before the other families declare
    theirs: no other family adds an instantiation to their files, so those chunks are the
    ones every launch looks up (a later declaration would rechunk and compile again)."""
    early = backend.declared_kernel_names(backend.EARLY_FAMILIES)
    for filename, names in early.items():
        assert {n for n in declared[filename] if "<" in n} == {n for n in names if "<" in n}


def test_a_launch_compiles_a_module_no_pool_thread_has_started():
    """The waiting caller runs a queued compile itself, once; a pool thread taking it up
    later does nothing; a failure reaches the caller."""
    ran = []
    job = compiler.Job(lambda: ran.append(threading.current_thread().name) or "mod")
    assert not job.done()
    assert job.result() == "mod" and job.done()
    job.run()                                         # the pool thread, too late
    assert ran == [threading.current_thread().name]
    failing = compiler.Job(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failing.result()
    with pytest.raises(ZeroDivisionError):
        failing.result()


def test_no_kernel_file_instantiates_a_template_itself():
    """An explicit instantiation would be compiled into every chunk of its file: templates
    are instantiated by the name expressions of their chunk alone."""
    for path in compiler.kernel_sources():
        assert not re.search(r"^\s*template\s+__global__", path.read_text(), re.M), path.name


def test_prepare_starts_each_file_with_the_element_types_of_the_nodes_using_it(monkeypatch):
    """A float32 conv's files are not prefetched for the float64 of another node's values
    (the optimizer's hyperparameter table); files come in the order of first use."""
    from types import SimpleNamespace

    started = []
    monkeypatch.setattr(compiler, "prefetch",
                        lambda files, generated=(), kernels=(), ctypes=(): started.append(
                            (list(files), sorted(ctypes), list(generated), list(kernels))))
    cuda = backend.CudaBackend.__new__(backend.CudaBackend)
    cuda.kernel_files = {"conv2d": frozenset({"conv_direct.cu", "loss.cu"}),
                         "adam_update": frozenset({"optim_adam.cu", "loss.cu"})}
    cuda.generated_kernels, cuda.kernels_ahead = {}, {}
    value = lambda dtype: SimpleNamespace(dtype=dtype)          # noqa: E731
    nodes = [SimpleNamespace(op="conv2d", inputs=[value("float32")], outputs=[]),
             SimpleNamespace(op="adam_update", inputs=[value("float64"), value("float32")],
                             outputs=[])]
    cuda.prepare(nodes)
    assert started == [(["conv_direct.cu"], ["float"], [], []),
                       (["loss.cu"], ["double", "float"], [], []),
                       (["optim_adam.cu"], ["double", "float"], [], []),
                       ([], [], [], [])]


def test_precompile_compiles_every_declared_module_and_reports_each(monkeypatch, declared):
    class Done:
        def __init__(self, module):
            self.module = module

        def result(self):
            compiled.append(self.module)

    compiled, reported = [], []
    monkeypatch.setattr(compiler, "_start_module", lambda filename, names=(): Done(
        (filename, names)))
    count = compiler.precompile(lambda filename, names: reported.append((filename, names)))
    assert count == len(compiled) == len(reported) > 100
    assert compiled == reported == compiler.declared_modules()


def test_precompile_takes_every_attention_kernel_one_a_module(declared):
    """The attention kernels are made per head dim, tile, storage and arithmetic, a finite
    set: precompile compiles each as the module its first launch looks up, so a first
    training process does not wait for NVRTC on them; the tiled convolutions' kernels,
    made per conv geometry, are not among the modules."""
    from stepgraph.backends.cuda.attention import attention

    modules = compiler.declared_modules()
    own = [names for filename, names in modules if filename == attention.SOURCE]
    expected = attention.kernel_names()[attention.SOURCE]
    assert sorted(own) == sorted((name,) for name in expected)
    assert all(compiler.chunk_of(attention.SOURCE, name) == (name,) for name in expected)
    assert not any(filename == "conv_tiled.cu" and names
                   and names[0].startswith("conv2d_tiled_kernel") for filename, names in modules)
    assert len(modules) == len(set(modules))


def test_precompile_command_needs_a_gpu(capsys):
    from stepgraph.backends import cuda_available
    from stepgraph.cli import main

    if cuda_available():
        pytest.skip("a GPU is visible")
    assert main(["precompile"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_attention_head_dim_96_kernels_compile_one_at_a_time(declared):
    """attention.cu is compiled per kernel: the new head dim 96 instantiations (every kind,
    candidate tile, storage and arithmetic) are declared and each maps to a module of its
    own."""
    from stepgraph.backends.cuda.attention import attention

    names = [n for n in declared[attention.SOURCE] if re.match(r"sdpa_\w+_kernel<96,", n)]
    tiles = sum(len(per_hd[96]) for per_hd in attention.CANDIDATES.values())
    assert len(names) == tiles * sum(len(c) for c in attention.CTYPES.values())
    assert attention.SOURCE in compiler.PER_SHAPE_SOURCES
    assert all(compiler.chunk_of(attention.SOURCE, n) == (n,) for n in names)


def test_the_setup_log_gives_each_compile_its_queued_start_and_end_times(monkeypatch, tmp_path):
    """With STEPGRAPH_AUTOTUNE_LOG set, a compile writes when it was queued, started and ended
    and on which thread (scripts/cold-start lays a first step's waits out from them); without
    it, the build is run as it is."""
    import json

    def build():
        return "module"

    assert compiler._logged(("file", "conv_tiled.cu", ("k<1>",)), build) is build
    log = tmp_path / "setup.jsonl"
    monkeypatch.setenv("STEPGRAPH_AUTOTUNE_LOG", str(log))
    assert compiler._logged(("file", "conv_tiled.cu", ("k<1>",)), build)() == "module"
    assert compiler._logged(("generated", "extern \"C\" __global__ void f() {}"), build)() \
        == "module"
    tiled, generated = (json.loads(line) for line in log.read_text().splitlines())
    assert tiled["compile"] == "conv_tiled.cu" and tiled["names"] == ["k<1>"]
    assert generated["compile"].startswith("generated ") and generated["names"] == []
    for line in (tiled, generated):
        assert line["queued"] <= line["start"] <= line["end"]
        assert line["thread"] == threading.current_thread().name
