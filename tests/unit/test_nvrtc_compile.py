"""Every op family's .cu file compiles with NVRTC for sm_90, every kernel a launcher names
(template instantiations included) exists in the compiled code, and every kernel a .cu file
defines is one that a family launches. The families are found by walking backends/cuda, not
named here. Needs CuPy and libnvrtc, but no GPU."""
from __future__ import annotations

import functools
import importlib
import inspect
import re

import pytest

pytest.importorskip("cupy")

from cupy.cuda import nvrtc  # noqa: E402

from stepgraph.backends.cuda.runtime import compiler  # noqa: E402

CUDA_PACKAGE = "stepgraph.backends.cuda"


def _nvrtc_usable() -> bool:
    try:
        nvrtc.getVersion()
    except Exception:      # CuPy without a loadable libnvrtc: nothing to compile with
        return False
    return True


pytestmark = pytest.mark.skipif(not _nvrtc_usable(), reason="libnvrtc is not loadable")


@pytest.mark.parametrize("path", compiler.kernel_sources(), ids=lambda p: p.name)
def test_kernel_source_compiles_for_sm90(path):
    assert compiler.compile_to_cubin(path, "sm_90")


def test_the_autotuners_host_gate_compiles_for_sm90():
    """runtime/host_gate.py's kernel (source text, not a family's file)."""
    from stepgraph.backends.cuda.runtime import host_gate

    assert compiler.compile_source_to_cubin(host_gate.SOURCE, host_gate.NAME, "sm_90")


def family_modules() -> list[str]:
    """Every module of the backend outside runtime/ (dotted below backends/cuda): the op
    families and the modules of the family packages."""
    root = compiler.SOURCE_ROOT
    found = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[0] != "runtime" and parts[-1] not in ("__init__", "backend"):
            found.append(".".join(parts))
    return found


def family(name: str):
    return importlib.import_module(f"{CUDA_PACKAGE}.{name}")


def kernel_families() -> list[str]:
    """The family modules whose kernel_names() takes no arguments: the names the compiler
    declares (conv_tiled's, per problem, come through conv.py's)."""
    return [m for m in family_modules() if hasattr(family(m), "kernel_names")
            and not inspect.signature(family(m).kernel_names).parameters]


def launchers_of(name: str) -> dict[str, set[str]]:
    """{file: kernel names} that module `name` passes to _launch by literal file and name,
    templates expanded over the C types they are instantiated with (LABEL_CTYPES,
    FILL_CTYPES); a name built from other parts (template dims) is left to the module's
    kernel_names(), which the tests below compile."""
    from stepgraph.backends.cuda.elementwise import FILL_CTYPES
    from stepgraph.backends.cuda.runtime.launch import LABEL_CTYPES

    found: dict[str, set[str]] = {}
    source = family(name).__file__
    with open(source) as f:
        text = f.read()
    for filename, name in re.findall(r'_launch\(ctx, "([\w.]+)", (f?"[^"]+")', text):
        if name.startswith("f"):
            name = name[2:-1]
            table = LABEL_CTYPES if "LABEL" in name else FILL_CTYPES if "fill" in name else None
            if table is None:
                continue
            names = [re.sub(r"\{[^}]*\}", ctype, name) for ctype in table.values()]
        else:
            names = [name[1:-1]]
        found.setdefault(filename, set()).update(names)
    return found


def launched_kernels() -> dict[str, set[str]]:
    """launchers_of every family module, merged."""
    found: dict[str, set[str]] = {}
    for name in family_modules():
        for filename, names in launchers_of(name).items():
            found.setdefault(filename, set()).update(names)
    return found


def test_families_are_found():
    """The walk finds the op families at the top and in the family packages."""
    modules = set(family_modules())
    assert {"elementwise", "reduce", "loss", "optim", "conv.conv", "conv.conv_tiled",
            "conv.conv_depthwise", "attention.attention", "matmul.small_matmul"} <= modules
    from stepgraph.backends.cuda.backend import IMPL_MODULES

    assert set(IMPL_MODULES) <= modules


def test_launchers_name_existing_kernels():
    """NVRTC rejects a name expression that names no kernel, so compiling each file with every
    name its launchers use proves that each one exists (templates get instantiated too)."""
    kernels = launched_kernels()
    assert {"elementwise.cu", "reduce.cu", "loss.cu", "optim.cu"} <= set(kernels)
    for filename, names in sorted(kernels.items()):
        assert compiler.compile_to_cubin(compiler.source_path(filename), "sm_90", tuple(names))


def test_conv_launchers_name_existing_kernels():
    """conv.py names its kernels from template parts (dtype, tile), so it lists every name it
    may launch (im2col path, direct path, tiled kernels); the compile tests of every declared
    kernel below instantiate each one."""
    from stepgraph.backends.cuda.conv import conv

    kernels = conv.kernel_names()
    assert {"conv.cu", "conv_direct.cu"} <= set(kernels)
    # the tiled kernels in every storage they run, bfloat16's (S = unsigned short, computing
    # in float) included: the same variants as float32's, the shared arrays being float either way
    tiled = kernels["conv_tiled.cu"]
    for kernel in ("conv2d_tiled_kernel", "conv2d_tiled_grad_weight_kernel",
                   "conv2d_tiled_grad_weight_sum_kernel"):
        for types in ("float, float", "double, double", "unsigned short, float"):
            assert any(name.startswith(f"{kernel}<{types}") for name in tiled), (kernel, types)
    as_float = {name.replace("<unsigned short, float", "<float, float") for name in tiled
                if name.startswith("conv2d_tiled") and "<unsigned short, float" in name}
    assert as_float == {name for name in tiled if "<float, float" in name}


def test_depthwise_launchers_name_existing_kernels():
    """conv_depthwise.py names its kernels from layout and storage: every one it lists (conv.py
    declares them) compiles, in each storage and layout."""
    from stepgraph.backends.cuda.conv import conv_depthwise

    names = conv_depthwise.kernel_names()[conv_depthwise.SOURCE]
    flat = {conv_depthwise.kernel_name(kind, layout, dtype, taps)
            for kind in conv_depthwise.KINDS for layout in conv_depthwise.LAYOUTS
            for dtype in conv_depthwise.CTYPES for taps in conv_depthwise.TAP_BLOCKS}
    plane = conv_depthwise.plane_kernel_names()
    sums = {conv_depthwise.sum_kernel_name(dtype) for dtype in conv_depthwise.CTYPES}
    # grad_weight's in both tap blocks: a 1 x 3 filter and its bias (4 sums) takes the small
    assert conv_depthwise.kernel_name("grad_weight", "NCHW", "float32", 4).endswith(", 4>")
    assert conv_depthwise.kernel_name("grad_weight", "NCHW", "float32", 10).endswith(", 16>")
    assert names == flat | plane | sums and len(names) == 30
    assert compiler.compile_to_cubin(compiler.source_path(conv_depthwise.SOURCE), "sm_90",
                                     tuple(sorted(names)))


@pytest.mark.parametrize("name", kernel_families())
def test_family_lists_kernels_of_existing_files(name):
    """Every family lists the kernels its launchers may launch (names built from template
    dims included) in kernel_names(), of kernel files that exist; the compile tests below
    instantiate each one."""
    kernels = family(name).kernel_names()
    assert kernels and all(names for names in kernels.values()), kernels
    for filename in kernels:
        assert compiler.source_path(filename).is_file()


@pytest.mark.parametrize("filename", sorted(compiler.PER_SHAPE_SOURCES))
def test_per_shape_files_compile_with_every_declared_kernel(filename):
    """The files compiled one kernel at a time at run time (tiled convolutions, attention):
    every name a family lists for them exists."""
    from stepgraph.backends.cuda.backend import declared_kernel_names

    names = declared_kernel_names(tuple(kernel_families()))[filename]
    assert compiler.compile_to_cubin(compiler.source_path(filename), "sm_90",
                                     tuple(sorted(names)))


@pytest.mark.parametrize("name", family_modules())
def test_launchers_list_every_kernel_they_name(name):
    """A family's kernel_names() (what the compiler declares) covers every name its source
    passes to _launch."""
    launched = launchers_of(name)
    listed = family(name).kernel_names() if launched else {}
    for filename, names in launched.items():
        assert names <= listed[filename], (filename, names - listed[filename])


def _defined_kernels(source: str) -> set[str]:
    """The names of the __global__ functions of CUDA source (templates, their explicit
    instantiations and extern "C" kernels alike; a __launch_bounds__(...) between
    __global__ and the name is skipped)."""
    names = set()
    for match in re.finditer(r"__global__\s+(?:void\s+)?", source):
        rest = source[match.end():]
        if rest.startswith("__launch_bounds__"):
            depth, i = 0, len("__launch_bounds__")
            while True:
                depth += {"(": 1, ")": -1}.get(rest[i], 0)
                i += 1
                if depth == 0:
                    break
            rest = rest[i:]
        names.add(re.match(r"\s*(?:void\s+)?(\w+)\s*[(<]", rest).group(1))
    return names


def test_every_kernel_is_launched_by_a_family_beside_it():
    """Each .cu file's kernels are exactly those the families declare for it (no kernel without
    a launcher, no launcher of a missing kernel), and a family declaring the file lives in its
    folder."""
    from stepgraph.backends.cuda.backend import declared_kernel_names

    declared = declared_kernel_names(tuple(kernel_families()))
    sources = compiler.kernel_sources()
    assert len(sources) == len({path.name for path in sources}) >= 20
    for path in sources:
        defined = _defined_kernels(path.read_text())
        assert defined == {name.split("<")[0] for name in declared[path.name]}, path.name
        beside = [m for m in kernel_families() if path.name in family(m).kernel_names()]
        assert any(compiler.SOURCE_ROOT.joinpath(*m.split(".")[:-1]) == path.parent
                   for m in beside), (path, beside)


def test_headers_live_in_the_include_folder():
    """NVRTC is given one include folder: every .cuh is there, and what a .cu includes is."""
    headers = {path.name for path in compiler.headers()}
    assert {"bf16.cuh", "philox.cuh", "reduce.cuh"} <= headers
    assert {path.name for path in compiler.SOURCE_ROOT.rglob("*.cuh")} == headers
    for path in compiler.kernel_sources():
        assert set(re.findall(r'#include "(\w+\.cuh)"', path.read_text())) <= headers, path


def _declared_files() -> list[str]:
    from stepgraph.backends.cuda.backend import declared_kernel_names

    return sorted(set(declared_kernel_names(tuple(kernel_families())))
                  - compiler.PER_SHAPE_SOURCES)


def test_every_kernel_file_with_declared_kernels_is_compiled_below():
    assert {"elementwise.cu", "loss.cu", "optim.cu", "guard.cu", "optim_adam.cu"} \
        <= set(_declared_files())


@pytest.mark.parametrize("filename", _declared_files())
def test_each_module_of_a_file_compiles_with_its_declared_kernels(filename):
    """At run time a file is compiled as several modules (compiler.file_modules): one of its
    plain kernels, and chunks of a few of the instantiations any family declares for it
    (of one element type for a TYPED_SOURCES file), which together hold every one: each
    module compiles, as it is compiled at run time."""
    from stepgraph.backends.cuda.backend import declared_kernel_names

    compiler.declare(declared_kernel_names(tuple(kernel_families())))
    modules = compiler.file_modules(filename)
    assert modules
    for names in modules:
        assert compiler.compile_to_cubin(compiler.source_path(filename), "sm_90", names)


def test_reduce_sum_fallback_is_launched():
    """The any-axes reduce_sum kernel (a template on the element type since bf16) is among
    the names the launchers declare, for float32 and bfloat16, and so compiled above."""
    from stepgraph.backends.cuda import reduce

    assert {"reduce_sum_strided_kernel<float>", "reduce_sum_strided_kernel<unsigned short>"} \
        <= reduce.kernel_names()["reduce.cu"]


@pytest.mark.parametrize("family,sources", [("norm", {"norm.cu"}),
                                             ("pool", {"avgpool.cu", "pool.cu"})])
def test_norm_and_pool_launchers_name_existing_kernels(family, sources):
    """norm.py and pool.py list every kernel they may launch (layouts, float4 variants) in
    kernel_names(); compiling with each name proves that it exists."""
    import importlib

    module = importlib.import_module(f"stepgraph.backends.cuda.{family}")
    kernels = module.kernel_names()
    assert set(kernels) == sources
    for filename, names in sorted(kernels.items()):
        assert compiler.compile_to_cubin(compiler.source_path(filename), "sm_90",
                                         tuple(sorted(names)))


def test_pool_launchers_name_listed_kernels():
    """Every kernel name pool.py builds (layout suffixes, the channel-pack max pooling kernels,
    every element storage) is one kernel_names() lists."""
    from stepgraph.backends.cuda import pool

    listed = set().union(*pool.kernel_names().values())
    for _, ctype in pool.POOL_CTYPES.values():
        for name in ("maxpool2d_forward_kernel", "maxpool2d_backward_kernel",
                     "maxpool2d_backward_tiling_kernel", "avgpool2d_forward_kernel",
                     "avgpool2d_backward_kernel", "avgpool2d_backward_tiling_kernel"):
            for suffix in ("", "_nhwc"):
                assert pool._kernel(name, suffix, ctype) in listed
            if name.startswith("maxpool2d"):            # channels-last, 16 bytes a thread
                assert pool._kernel(name, "_nhwc_vec", ctype) in listed
        assert pool._kernel("avgpool2d_forward_warp_kernel", "", ctype) in listed


def test_norm_layouts_name_listed_kernels():
    """Every kernel name norm.py builds for a layout (planes, float4 planes, columns with
    vector accesses or without) is one that kernel_names() lists, so the compile test above
    covers it."""
    from stepgraph.backends.cuda import norm

    listed = norm.kernel_names()["norm.cu"]
    for columns, vec in ((False, 1), (False, 4), (True, 1)):
        for c, aligned in ((3, True), (8, True), (64, True), (64, False)):
            layout = norm.Layout(n=2, c=c, inner=1 if columns else 4, columns=columns,
                                 vec=vec, aligned=aligned)
            for kind in norm.KINDS:
                for _, ctype in norm.ACTIVATION_CTYPES.values():
                    for dy_sum in (False, True):
                        assert layout.pass_shape(kind, ctype, dy_sum).kernel in listed


def test_norm_column_walks_fall_back_to_a_channel_a_thread():
    """Columns passes take V channels a thread only where C % V == 0 and every array is
    16-byte aligned; the block's lanes then cover C / V channel groups, at most 32."""
    from stepgraph.backends.cuda import norm

    wide = norm.Layout(n=4096, c=64, inner=1, columns=True, vec=1)
    assert wide.column_walk("backward", "unsigned short") == norm.COLUMN_WALKS[
        "unsigned short"]["backward"]
    shape = wide.pass_shape("grad_stats", "float")
    vec = norm.COLUMN_WALKS["float"]["grad_stats"][0]
    assert shape.block == (min(32, 64 // vec), norm.STATS_ROWS)      # C / vec lanes, <= 32
    assert shape.grid[0] * shape.block[0] * vec >= 64
    assert f"<float, {vec}," in shape.kernel
    for layout in (norm.Layout(n=4096, c=9, inner=1, columns=True, vec=1),
                   norm.Layout(n=4096, c=64, inner=1, columns=True, vec=1, aligned=False)):
        for kind in norm.KINDS:
            assert layout.column_walk(kind, "unsigned short")[0] == 1
            assert "short, 1," in layout.pass_shape(kind, "unsigned short").kernel


def test_guard_launchers_name_existing_kernels():
    """guards.py lists its kernels (guard.cu, guard_advance among them)."""
    from stepgraph.backends.cuda import guards

    kernels = guards.kernel_names()
    assert set(kernels) == {"guard.cu"} and "guard_advance_kernel" in kernels["guard.cu"]
    for filename, names in sorted(kernels.items()):
        assert compiler.compile_to_cubin(compiler.source_path(filename), "sm_90",
                                         tuple(sorted(names)))


# ---- launch arguments against the kernels' parameters (no GPU: fake arrays, PTX) ----------

PTX_BYTES = {"u32": 4, "s32": 4, "b32": 4, "f32": 4, "u64": 8, "s64": 8, "b64": 8, "f64": 8,
             "u16": 2, "s16": 2, "b16": 2}


def kernel_params(filename: str, name: str) -> tuple[str, ...]:
    """The PTX parameter types ("u64", "f32", ...) of kernel `name` of kernel file `filename`, a
    template instantiation ("k<int>") or an extern "C" kernel. The file is compiled once
    with every template the backend declares for it (and `name`)."""
    from stepgraph.backends.cuda.backend import declared_kernel_names

    templates = {n for n in declared_kernel_names().get(filename, ()) if "<" in n}
    if "<" in name:
        templates.add(name)
    ptx, lowered = _module_ptx(filename, tuple(sorted(templates)))
    entry = re.search(rf"\.entry {re.escape(lowered.get(name, name))}\((.*?)\)", ptx, re.S)
    assert entry, (filename, name, lowered.get(name, name))
    return tuple(re.findall(r"\.param \.(\w+)", entry.group(1)))


@functools.cache
def _module_ptx(filename: str, templates: tuple[str, ...]) -> tuple[str, dict[str, str]]:
    """The PTX of kernel file `filename` with `templates` instantiated, and their lowered
    names."""
    headers = compiler.headers()
    prog = nvrtc.createProgram(compiler.source_path(filename).read_text(), filename,
                               [h.read_text().encode() for h in headers],
                               [h.name.encode() for h in headers])
    for name in templates:
        nvrtc.addNameExpression(prog, name)
    nvrtc.compileProgram(prog, ["-arch=compute_90", "-std=c++17"])

    def text(x) -> str:
        return x.decode() if isinstance(x, bytes) else x

    return text(nvrtc.getPTX(prog)), {n: text(nvrtc.getLoweredName(prog, n)) for n in templates}


class Fake:
    """Just enough of a CuPy array for the launchers' bookkeeping."""

    def __init__(self, shape, dtype="float32", ptr=0x7000):
        import numpy as np

        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.size, self.ndim = int(np.prod(self.shape)), len(self.shape)
        self.strides = tuple(int(np.prod(self.shape[i + 1:])) * self.dtype.itemsize
                             for i in range(self.ndim))                     # C-contiguous
        self.flags = type("Flags", (), {"c_contiguous": True})()
        self.nbytes = self.size * self.dtype.itemsize
        self.data = type("Ptr", (), {"ptr": ptr})()

    def __len__(self):
        return self.shape[0]

    @property
    def itemsize(self):
        return self.dtype.itemsize


def _fake_memory(node, key, ctx, build, required=True):
    """Stand-ins for the scratch each launcher asks _node_memory for."""
    kind = key[0]
    if kind == "update":        # jobs in plain chunks only: one launch
        return {"entries": Fake((4,), "int64"), "plain": Fake((3, 2)), "sliced": Fake((0, 2)),
                "tile": 0, "chunk": 4096}
    if kind in ("guard_check", "guard_save", "guard_restore"):
        return {"entries": Fake((4,), "int64"), "jobs": Fake((3, 2))}
    if kind == "embedding_sort":
        blocks = -(-key[1] // 1024)
        return dict(keys=(Fake((key[1],), "int32"), Fake((key[1],), "int32")),
                    positions=(Fake((key[1],), "int32"), Fake((key[1],), "int32")),
                    hist=Fake((256 * blocks,), "int32"), blocks=blocks)
    if kind in ("layer_norm_grad", "add_layer_norm_grad", "rms_norm_grad", "add_rms_norm_grad"):
        return [Fake((key[1] * key[2],)) if want else None for want in key[3]]   # blocks x C
    if kind == "cross_entropy":        # (op, rows, rowloss, blocks with partials)
        return dict(counter=Fake((1,), "uint32"), count=Fake((1,), "int32"),
                    rowloss=Fake((key[1],)), partials=Fake((max(key[3], 1),), "float64"))
    if kind == "cross_entropy_count":
        return Fake((1,), "int32")
    if kind == "mse":
        return dict(partials=Fake((key[1],), "float64"), counter=Fake((1,), "uint32"))
    if kind == "embedding_scan":       # (op, segments, V * C): the segments' sums
        return Fake((key[1] * key[2],))
    if kind == "reduce_sum":           # (op, planes, splits): the float64 partial sums
        return Fake((key[1] * key[2],), "float64")
    if kind == "batch_norm":           # (op, channels, splits, extra floats per channel)
        return dict(partial=Fake((key[2] * key[3] * 2,), "float64"),
                    coef=Fake((key[2] * max(key[4], 1),)))
    raise AssertionError(f"unexpected scratch {key}")


def _record_launches(monkeypatch, *modules):
    """Patch out the CuPy-only parts of launcher modules (and of the shared launch helpers and
    the families other launchers call: fills, sums, losses); return the launches they make,
    as (file, kernel, grid, block, args)."""
    from stepgraph.backends.cuda import elementwise, loss, optim, reduce
    from stepgraph.backends.cuda.runtime import launch

    launched = []
    for mod in set(modules) | {launch, elementwise, reduce, loss, optim}:
        for name, fake in (("_check", lambda *a, **k: None), ("_node_memory", _fake_memory),
                           ("_launch", lambda ctx, filename, name, grid, block, args, *_, **__:
                            launched.append((filename, name, grid, block, args)))):
            monkeypatch.setattr(mod, name, fake, raising=False)
    for mod in set(modules) | {launch, elementwise, reduce, loss, optim}:
        monkeypatch.setattr(mod, "current_sm_count", lambda: 132, raising=False)  # an H200's
    return launched


def assert_args_match(filename: str, name: str, args) -> None:
    """A launch's arguments have kernel `name`'s parameter types: pointers for arrays, the
    same size and float-ness for scalars."""
    import numpy as np

    params = kernel_params(filename, name)
    assert len(params) == len(args), (name, params, args)
    for i, (param, arg) in enumerate(zip(params, args)):
        if isinstance(arg, Fake):
            assert param in ("u64", "b64"), (name, i, param)
            continue
        arg = np.asarray(arg)
        assert PTX_BYTES[param] == arg.itemsize, (name, i, param, arg.dtype)
        assert (param[0] == "f") == (arg.dtype.kind == "f"), (name, i, param, arg.dtype)


def _assert_launches_match(launched) -> None:
    """Each launch's arguments have its kernel's parameter types (assert_args_match), and its
    block and grid are valid."""
    import numpy as np

    assert launched
    for filename, name, grid, block, args in launched:
        assert_args_match(filename, name, args)
        threads = int(np.prod(block))
        assert 32 <= threads <= 1024 and threads % 32 == 0, (name, block)
        assert all(g >= 1 for g in grid) and len(grid) <= 3, (name, grid)


# op -> (n_slots, attrs of the formula), one case each: every slot layout the launchers take
UPDATE_CASES = {
    "sgd_update": (1, dict(nesterov=False)),
    "adam_update": (2, dict(decoupled=True)),
    "adam_update-amsgrad": (3, dict(decoupled=False, amsgrad=True, maximize=True)),
    "rmsprop_update": (1, dict()),
    "rmsprop_update-centered-momentum": (3, dict(centered=True)),
    "adagrad_update": (1, dict(maximize=True)),
}


@pytest.mark.parametrize("guarded", [False, True])
@pytest.mark.parametrize("case", UPDATE_CASES)
def test_update_launch_arguments_match_the_kernels(monkeypatch, case, guarded):
    from stepgraph.backends.cuda import optim
    from stepgraph.ir.graph import Node
    from stepgraph.ops.optim import HYPER_COLUMNS

    launched = _record_launches(monkeypatch, optim)
    op = case.split("-")[0]
    slots, formula = UPDATE_CASES[case]
    attrs = dict(n_params=2, n_scalars=4, n_slots=slots, max_norm=1.0, **formula)
    if guarded:
        attrs["guard"] = True
    hyper = Fake((2, len(HYPER_COLUMNS[op])), "float64")
    ins = [Fake(()), Fake((), "int64"), hyper, Fake(())] \
        + [Fake((3, 4)) for _ in range((2 + slots) * 2)] \
        + ([Fake((2,), "int32")] if guarded else [])
    getattr(optim, op)(None, Node(op, [], [], attrs), ins)
    (filename, name, _, _, args), = launched
    assert (filename, name) == (optim.UPDATE_SOURCES[op], f"{op}_kernel<false>")
    _assert_launches_match(launched)
    assert args[5] is hyper and args[6] == len(HYPER_COLUMNS[op])    # the device rows
    assert (args[10] is ins[-1]) if guarded else (args[10] == 0)    # the guard flags pointer


@pytest.mark.parametrize("dtype", ["float32", "uint16"])
@pytest.mark.parametrize("shape", [(64, 16), (64, 9), (2, 4, 3, 4), (2, 3, 5, 5)],
                         ids=["columns", "columns-odd", "planes-vec4", "planes"])
def test_batch_norm_launch_arguments_match_the_kernels(monkeypatch, shape, dtype):
    """batch_norm_train (with the fused residual, its shortcut BatchNorm and the ReLU),
    batch_norm_stats and batch_norm_grad (with the fused ReLU and gradient sum): every pass
    and finalize launch fits its kernel's parameters."""
    from stepgraph.backends.cuda import cast, norm
    from stepgraph.ir.graph import Node

    launched = _record_launches(monkeypatch, norm, cast)
    c = shape[1]
    x = Fake(shape, dtype)
    channel = lambda: Fake((c,))      # noqa: E731
    train = Node("batch_norm_train", [], [], dict(
        eps=1e-5, momentum=0.1, affine=True, track=True, act="relu", residual=True,
        residual_norm=True, residual_affine=True, residual_eps=1e-5))
    norm.batch_norm_train_forward(None, train, [x, channel(), channel(), channel(), channel(),
                                                Fake((), "int64"), Fake(shape, dtype),
                                                channel(), channel(), channel(), channel()],
                                  [Fake(shape, dtype), channel(), channel()])
    grad = Node("batch_norm_grad", [], [], dict(affine=True, act="relu", dy_sum=True))
    norm.batch_norm_grad_backward(None, grad, [Fake(shape, dtype), x, channel(), channel(),
                                               channel(), channel(), Fake(shape, dtype)],
                                  [Fake(shape, dtype), channel(), channel()])
    stats = Node("batch_norm_stats", [], [], dict(eps=1e-5, momentum=None, track=True))
    norm.batch_norm_stats_forward(None, stats, [x, channel(), channel(), Fake((), "int64")],
                                  [channel(), channel()])
    layout = "columns" if len(shape) == 2 else "planes"
    names = [name.split("<")[0] for _, name, *_ in launched]
    assert [n.replace("_vec4", "") for n in names] == [
        f"batch_norm_stats_{layout}_kernel", "batch_norm_finalize_kernel",
        f"batch_norm_forward_{layout}_kernel", f"batch_norm_grad_stats_{layout}_kernel",
        "batch_norm_grad_finalize_kernel", f"batch_norm_backward_{layout}_kernel",
        f"batch_norm_stats_{layout}_kernel", "batch_norm_finalize_kernel"]
    assert "true>" in launched[2][1] and "true>" in launched[3][1]     # the fused variants
    _assert_launches_match(launched)


def test_guard_launch_arguments_match_the_kernels(monkeypatch):
    from stepgraph import errors as sg_errors
    from stepgraph.backends.cuda import guards
    from stepgraph.ir.graph import Node

    launched = _record_launches(monkeypatch, guards)
    monkeypatch.setattr(guards, "_MAILBOXES", {})
    flags, loss = Fake((2,), "int32"), Fake(())
    check = Node("guard_check", [], [], {"classes": 10, "ignore_index": -100})
    guards.guard_check(None, check, [flags, loss, Fake((8,), "int64"), Fake((3, 4))])
    advance = Node("guard_advance", [], [], {"sticky": True})
    guards.guard_advance(None, advance, [flags, Fake((4,), "int64"), Fake((), "int64"),
                                         Fake((6,)), loss, Fake((16,)),
                                         Fake((16,), "int64"), Fake((16,), "int32")],
                         Fake(()))
    buffers = [Fake((8,)), Fake((), "int64")]
    saved = Fake((48,), "uint8")
    copy = {"offsets": (0, 32), "nbytes": 48}
    guards.IMPLS["guard_save"](Node("guard_save", [], [], copy), buffers, [saved], None)
    guards.IMPLS["guard_restore"](Node("guard_restore", [], [], copy),
                                  [flags, saved] + buffers, [], None)
    assert [(f, n) for f, n, *_ in launched] == [("guard.cu", "guard_check_kernel"),
                                                ("guard.cu", "guard_advance_kernel"),
                                                ("guard.cu", "guard_copy_kernel"),
                                                ("guard.cu", "guard_copy_kernel")]
    assert launched[2][4][-1] == 0 and launched[3][4][-1] is flags
    buffers = [Fake((8,), ptr=0x1000), Fake((), "int64", ptr=0x2000)]
    saved = Fake((48,), "uint8", ptr=0x9000)
    node = Node("guard_save", [], [], copy)
    assert guards._saved_pairs(node, saved, buffers, to_saved=True) == [
        (0x1000, 0x9000, 32), (0x2000, 0x9000 + 32, 8)]
    assert guards._saved_pairs(node, saved, buffers, to_saved=False)[1] == (0x9020, 0x2000, 8)
    with pytest.raises(sg_errors.ShapeError, match="overruns"):
        guards._saved_pairs(node, Fake((36,), "uint8"), buffers, to_saved=True)
    _assert_launches_match(launched)


@pytest.mark.parametrize("dtype", ["float32", "uint16"])
def test_small_products_launch_the_small_kernels(monkeypatch, dtype):
    """linear and matmul route float32 and bf16 (uint16 bits) products of at most SMALL_MACS
    to the small kernels: the cnn's Linear(320, 50) and Linear(50, 10) at batch 64, their
    gradient products and an odd shape, every transpose. Each launch names the instantiation
    for its storage, one that kernel_names() lists (so compiled above), both the thread and the
    warp kernel run, and the arguments fit the kernels' parameters."""
    from types import SimpleNamespace

    from stepgraph.backends.cuda.matmul import linear, small_matmul
    from stepgraph.ir.graph import Node

    launched = []
    monkeypatch.setattr(small_matmul.compiler, "kernel", lambda filename, name: (
        lambda grid, block, args, stream: launched.append((filename, name, grid, block, args))))
    ctx = SimpleNamespace(stream=None, precision="bf16" if dtype == "uint16" else "fp32")
    arr = lambda *shape: Fake(shape, dtype)      # noqa: E731
    for n, k, m, act, save in ((64, 320, 50, "relu", False), (64, 50, 10, None, False),
                               (7, 33, 5, "gelu", True)):
        node = Node("linear", [], [], dict(act=act, slope=0.01, save_preact=save))
        linear.IMPLS["linear"](node, [arr(n, k), arr(m, k), arr(m)],
                               [arr(n, m)] + ([arr(n, m)] if save else []), ctx)
        # dx = dy @ w: (n, m) @ (m, k); dw = dy^T @ x: (m, n) @ (n, k); each transpose
        for rows, inner, cols in ((n, m, k), (m, n, k)):
            for ta in (False, True):
                for tb in (False, True):
                    node = Node("matmul", [], [], dict(trans_a=ta, trans_b=tb))
                    a = arr(inner, rows) if ta else arr(rows, inner)
                    b = arr(cols, inner) if tb else arr(inner, cols)
                    linear.IMPLS["matmul"](node, [a, b], [arr(rows, cols)], ctx)
    assert len(launched) == 3 * 9
    ctype = "unsigned short" if dtype == "uint16" else "float"
    names = {name for _, name, *_ in launched}
    assert names == {f"small_matmul_{kind}_kernel<{ctype}, {ctype}>" for kind in ("thread", "warp")}
    assert names <= small_matmul.kernel_names()["small_matmul.cu"]
    _assert_launches_match(launched)


def test_small_kernels_take_one_storage():
    """The small kernels hold float32 -> float32 and bf16 -> bf16 (the IR's products write
    their operands' dtype); any other mix goes to cuBLASLt, whose checks name it."""
    from stepgraph.backends.cuda.matmul import small_matmul
    from stepgraph.errors import ShapeError

    f32, bf, f64 = Fake((4, 4)), Fake((4, 4), "uint16"), Fake((4, 4), "float64")
    assert small_matmul.has_small_kernel(f32, f32, f32)
    assert small_matmul.has_small_kernel(bf, bf, bf)
    for a, b, c in ((bf, bf, f32), (bf, f32, bf), (f32, bf, f32), (f64, f64, f64)):
        assert not small_matmul.has_small_kernel(a, b, c)
    with pytest.raises(ShapeError, match="bias bfloat16"):
        small_matmul.small_matmul_forward(None, f32, f32, f32, bias=Fake((4,), "uint16"))


def test_cross_entropy_count_kernel_is_launched():
    """The ignore_index count kernel is among the names the launchers' test compiles."""
    names = launched_kernels()["loss.cu"]
    assert {"cross_entropy_count_kernel<int>", "cross_entropy_count_kernel<long long>"} <= names


def test_layer_norm_layouts_name_listed_kernels():
    """Every kernel name layer_norm.py picks for a row width (registers or loop, float4 or
    not) is one that kernel_names() lists, so the compile test above covers it."""
    from types import SimpleNamespace

    from stepgraph.backends.cuda import layer_norm

    listed = layer_norm.kernel_names()["layer_norm.cu"]
    for c in (1, 33, 37, 384, 768, 1000, 2304, 4096, 4100, 5000, 8192, 8196, 2049, 40000):
        for ptr in (0, 4):     # 16-byte aligned or not
            arrays = [SimpleNamespace(data=SimpleNamespace(ptr=ptr))]
            lay = layer_norm.row_layout(c, arrays)
            assert lay.threads * lay.rows_per_block <= layer_norm.MAX_THREADS
            assert lay.k == 0 or lay.k * lay.threads * lay.vec >= c
            if 0 < lay.k * lay.vec < layer_norm.FLOATS_PER_THREAD:   # the backward's bounds
                assert lay.threads * lay.rows_per_block <= layer_norm.ROWS_BLOCK_THREADS
            for direction in ("forward", "backward"):
                for ctype in ("float", "unsigned short"):      # bf16 y or dy
                    assert lay.kernel(direction, ctype) in listed


def test_new_families_are_in_the_backend_table():
    from stepgraph.backends.cuda.backend import IMPL_MODULES

    assert {"embedding", "layer_norm", "matmul.bmm", "shape", "cast", "index",
            "reduce_axis"} <= set(IMPL_MODULES)


@pytest.mark.parametrize("ptr", [0x7000, 0x7008])          # 4 elements a thread or not
@pytest.mark.parametrize("src,dst", [("float32", "bfloat16"), ("bfloat16", "float32")])
def test_cast_launch_arguments_match_the_kernels(monkeypatch, src, dst, ptr):
    """cast's launcher names a declared kernel for each direction, bf16 held as uint16."""
    from stepgraph.backends.cuda import cast
    from stepgraph.ir.graph import storage_dtype

    launched = _record_launches(monkeypatch, cast)
    for n in (64, 10):
        cast.cast_forward(None, Fake((n,), storage_dtype(src), ptr),
                          Fake((n,), storage_dtype(dst), ptr), src, dst)
    names = [name for _, name, _, _, _ in launched]
    assert set(names) <= cast.kernel_names()["cast.cu"] and len(set(names)) == 1
    vecs = [int(args[-1]) for *_, args in launched]
    assert vecs == ([4, 1] if ptr == 0x7000 else [1, 1])
    _assert_launches_match(launched)


# (storage, C): the 16-byte channel packs of the _nhwc_vec_ max pooling kernels (4 float32, 8
# 16-bit values) fit C = 64 and 8 in every storage, 12 in float32 only, 3 in none
POOL_PACKS = {"float32": 4, "uint16": 8, "float16": 8}


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
@pytest.mark.parametrize("ptr", [0x7000, 0x7008])          # 16-byte aligned or not
@pytest.mark.parametrize("channels", [64, 8, 12, 3])
@pytest.mark.parametrize("dtype", sorted(POOL_PACKS))
def test_maxpool_launches_take_the_channel_pack_kernels_where_they_fit(monkeypatch, dtype,
                                                                      channels, ptr, layout):
    """Channels-last max pooling (forward, the gather backward of overlapping padded windows,
    the tiling backward; fused ReLU or not) launches the _nhwc_vec_ kernels, a thread per
    PACK<T> channels, exactly where C % PACK<T> == 0 and every array is 16-byte aligned;
    else, and for NCHW, the element kernels. The grids cover the threads either way."""
    from stepgraph.backends.cuda import cast, pool

    launched = _record_launches(monkeypatch, pool, cast)
    pack = POOL_PACKS[dtype]
    vec = layout == "NHWC" and channels % pack == 0 and ptr == 0x7000
    ctype = dict((s, t) for s, t in pool.POOL_CTYPES.values())[dtype]

    def stored(n, h, w):
        return (n, h, w, channels) if layout == "NHWC" else (n, channels, h, w)

    windows = [((9, 9), (3, 3), (2, 2), (1, 1), (5, 5), "maxpool2d_backward"),
               ((8, 6), (2, 2), (2, 2), (0, 0), (4, 3), "maxpool2d_backward_tiling")]
    expected = []
    for (h, w), kernel, stride, padding, (ho, wo), backward in windows:
        for relu in (False, True):
            x, y = Fake(stored(2, h, w), dtype, ptr), Fake(stored(2, ho, wo), dtype, ptr)
            idx = Fake(stored(2, ho, wo), "int32", ptr)
            pool.maxpool2d_forward(None, x, y, idx, kernel, stride, relu, padding, layout)
            pool.maxpool2d_backward(None, Fake(y.shape, dtype, ptr), idx,
                                    Fake(x.shape, dtype, ptr), kernel, stride,
                                    y if relu else None, padding, layout)
            expected += [("maxpool2d_forward", y.size), (backward, y.size if "tiling"
                                                         in backward else x.size)]
    suffix = {"NCHW": "", "NHWC": "_nhwc"}[layout] + ("_vec" if vec else "")
    per_thread = pack if vec else 1
    got = [(name, grid) for _, name, grid, _, _ in launched]
    assert got == [(f"{k}{suffix}_kernel<{ctype}>", pool._grid(size // per_thread))
                   for k, size in expected]
    assert {name for name, _ in got} <= pool.kernel_names()["pool.cu"]
    _assert_launches_match(launched)


# ---- the transformer families' launch arguments against their kernels (templates too) -----

@pytest.mark.parametrize("idx_dtype", ["int32", "int64"])
@pytest.mark.parametrize("ptr", [0x7000, 0x7004])          # float4 path or not
def test_embedding_launch_arguments_match_the_kernels(monkeypatch, idx_dtype, ptr):
    from stepgraph.backends.cuda import embedding

    launched = _record_launches(monkeypatch, embedding)
    v, c, n = 300, 12, 2500
    idx = Fake((5, n // 5), idx_dtype)
    embedding.embedding_forward(None, Fake((v, c), ptr=ptr), idx, Fake((5, n // 5, c), ptr=ptr))
    for path in ("scan", "sorted"):
        monkeypatch.setattr(embedding, "PATH", path)
        embedding.embedding_backward(None, object(), Fake((5, n // 5, c), ptr=ptr), idx,
                                     Fake((v, c), ptr=ptr))
    names = [name for _, name, _, _, _ in launched]
    ctype = "int" if idx_dtype == "int32" else "long long"
    assert names[0] == f"embedding_forward_kernel<{ctype}>"
    # 300 x 1 blocks of 2,500 positions: 4 segments of 768 make 8 an SM of 132, then their sum
    assert names[1:3] == [f"embedding_backward_scan_kernel<{ctype}>",
                          "embedding_scan_sum_kernel<float>"]
    assert launched[1][2] == (v, -(-c // (4 if ptr == 0x7000 else 1) // 32), 4)
    assert int(launched[1][4][-1]) == 768 and int(launched[2][4][-1]) == 4
    assert names[3:] == [f"embedding_sort_histogram_kernel<{ctype}>",      # 300: two passes
                         "embedding_sort_scan_kernel", f"embedding_sort_scatter_kernel<{ctype}>",
                         "embedding_sort_histogram_kernel<int>", "embedding_sort_scan_kernel",
                         "embedding_sort_scatter_kernel<int>",
                         "embedding_backward_sorted_kernel<float>"]
    assert set(names) <= embedding.kernel_names()["embedding.cu"]
    _assert_launches_match(launched)


@pytest.mark.parametrize("c", [1, 33, 384, 768, 4096, 2049, 8196])
@pytest.mark.parametrize("has_w,has_b", [(False, False), (True, False), (True, True),
                                         (False, True)])
@pytest.mark.parametrize("io", ["float32", "uint16"])     # y and dy: float32 or bf16 bits
def test_layer_norm_launch_arguments_match_the_kernels(monkeypatch, c, has_w, has_b, io):
    from stepgraph.backends.cuda import layer_norm

    launched = _record_launches(monkeypatch, layer_norm)
    monkeypatch.setattr(layer_norm, "resident_blocks", lambda name, threads: 528)
    x, stats = Fake((3, 7, c)), [Fake((21,)), Fake((21,))]
    w, b = (Fake((c,)) if has_w else None), (Fake((c,)) if has_b else None)
    layer_norm.layer_norm_forward(None, x, w, b, Fake((3, 7, c), io), *stats, 1e-5)
    layer_norm.layer_norm_backward(None, object(), Fake((3, 7, c), io), x, w, *stats,
                                   Fake((3, 7, c)), Fake((c,)) if has_w else None,
                                   Fake((c,)) if has_b else None)
    names = [name for _, name, _, _, _ in launched]
    ctype = "unsigned short" if io == "uint16" else "float"
    assert all(f"<{ctype}" in name for name in names[:2])
    assert len(names) == 2 + (has_w or has_b)
    assert set(names) <= layer_norm.kernel_names()["layer_norm.cu"]
    _assert_launches_match(launched)
    if has_w or has_b:        # the finalize: one grid row per table, over the backward's blocks
        (_, _, grid, _, args), blocks = launched[2], launched[1][2][0]
        assert grid == (-(-c // 32), has_w + has_b) and int(args[-2]) == blocks
        assert 1 <= blocks <= min(21, 528)


@pytest.mark.parametrize("c", [33, 384, 8196])
@pytest.mark.parametrize("op", ["layer_norm", "add_layer_norm", "rms_norm", "add_rms_norm"])
@pytest.mark.parametrize("half", ["uint16", "float16"])
@pytest.mark.parametrize("form", ["copy", "alone"])
def test_norm_grads_store_a_half_dx(monkeypatch, c, op, half, form):
    """compile/norm_casts.py: a float32 x's backward stores dx rounded to bf16 / float16 beside
    the float32 dx (copy: the node's dx_half output) or alone (a half dx output, the float32
    pointer null), with dy float32 or of that half dtype."""
    from stepgraph.backends.cuda import layer_norm

    launched = _record_launches(monkeypatch, layer_norm)
    monkeypatch.setattr(layer_norm, "resident_blocks", lambda name, threads: 528)
    x, w, stats = Fake((3, 7, c)), Fake((c,)), [Fake((21,)), Fake((21,))]
    dx, copy = (Fake(x.shape), Fake(x.shape, half)) if form == "copy" else \
        (Fake(x.shape, half), None)
    for dy in (Fake(x.shape), Fake(x.shape, half)):
        if op.endswith("rms_norm"):
            layer_norm.rms_norm_backward(None, object(), dy, x, w, stats[1], dx, Fake((c,)),
                                         dx_half=copy,
                                         ds=Fake(x.shape) if op == "add_rms_norm" else None)
        else:
            layer_norm.layer_norm_backward(None, object(), dy, x, w, *stats, dx, Fake((c,)),
                                           ds=Fake(x.shape) if op == "add_layer_norm" else None,
                                           dx_half=copy)
    ctype = "unsigned short" if half == "uint16" else "fp16_bits"
    backwards = [(name, args) for _, name, _, _, args in launched if "finalize" not in name]
    assert [name.startswith(f"{op}_backward") and name.endswith(f", float, {ctype}>")
            for name, _ in backwards] == [True, True]
    dx_at = 5 + op.startswith("add_") - op.endswith("rms_norm")    # after dy, x, w, stats[, ds]
    for _, args in backwards:      # a null pointer is np.uint64(0); an array a Fake
        assert isinstance(args[dx_at], Fake) == (form == "copy")
        assert args[dx_at + 1] is (copy if form == "copy" else dx)
    assert {name for _, name, *_ in launched} <= layer_norm.kernel_names()["layer_norm.cu"]
    _assert_launches_match(launched)


@pytest.mark.parametrize("c", [33, 384, 8196])
@pytest.mark.parametrize("op", ["layer_norm", "add_layer_norm", "rms_norm", "add_rms_norm"])
@pytest.mark.parametrize("copy", ["float32", "uint16", "float16"])
def test_norm_grads_sum_the_copy_they_store(monkeypatch, c, op, copy):
    """compile/norm_casts.py fuse_norm_grad_bias_sums: a backward's dsum, the column sum of the
    dx copy it stores last (dx_half, else dx), takes a partial table after partial_w and
    partial_b, and the finalize's last table, stored in the copy's C type."""
    from stepgraph.backends.cuda import layer_norm

    launched = _record_launches(monkeypatch, layer_norm)
    monkeypatch.setattr(layer_norm, "resident_blocks", lambda name, threads: 528)
    x, w, stats = Fake((3, 7, c)), Fake((c,)), [Fake((21,)), Fake((21,))]
    half = None if copy == "float32" else Fake(x.shape, copy)
    dsum, ds = Fake((c,), copy), Fake(x.shape) if op.startswith("add_") else None
    if op.endswith("rms_norm"):
        layer_norm.rms_norm_backward(None, object(), Fake(x.shape), x, w, stats[1],
                                     Fake(x.shape), Fake((c,)), dx_half=half, ds=ds, dsum=dsum)
    else:
        layer_norm.layer_norm_backward(None, object(), Fake(x.shape), x, w, *stats,
                                       Fake(x.shape), Fake((c,)), Fake((c,)), ds=ds,
                                       dx_half=half, dsum=dsum)
    (_, _, _, _, backward), (_, name, grid, _, args) = launched
    tables = 3 - op.endswith("rms_norm")
    at = 7 + op.startswith("add_") - op.endswith("rms_norm")     # the first partial table
    assert all(isinstance(t, Fake) for t in backward[at:at + tables])
    stype = {"float32": "", "uint16": ", unsigned short", "float16": ", fp16_bits"}[copy]
    assert name == f"layer_norm_grad_finalize_kernel<float{stype}>"
    assert grid == (-(-c // 32), tables) and args[5] is dsum
    assert {name for _, name, *_ in launched} <= layer_norm.kernel_names()["layer_norm.cu"]
    _assert_launches_match(launched)


@pytest.mark.parametrize("op", ["add_layer_norm", "add_rms_norm"])
def test_norm_grads_too_wide_for_their_shared_sums_leave_them_to_a_column_kernel(monkeypatch,
                                                                                 op):
    """A register kernel of one row lane whose row is wider than its shared table (6,144
    floats over 384 threads of 16) takes no partial_s: a column sum of the copy follows."""
    from stepgraph.backends.cuda import layer_norm

    launched = _record_launches(monkeypatch, layer_norm)
    monkeypatch.setattr(layer_norm, "resident_blocks", lambda name, threads: 528)
    c = 6144
    x, w, stats = Fake((3, 7, c)), Fake((c,)), [Fake((21,)), Fake((21,))]
    half, dsum = Fake(x.shape, "uint16"), Fake((c,), "uint16")
    if op == "add_rms_norm":
        layer_norm.rms_norm_backward(None, object(), Fake(x.shape), x, w, stats[1],
                                     Fake(x.shape), Fake((c,)), dx_half=half, ds=Fake(x.shape),
                                     dsum=dsum)
    else:
        layer_norm.layer_norm_backward(None, object(), Fake(x.shape), x, w, *stats,
                                       Fake(x.shape), Fake((c,)), Fake((c,)), ds=Fake(x.shape),
                                       dx_half=half, dsum=dsum)
    names = [name for _, name, *_ in launched]
    assert "_loop" not in names[0] and names[1] == "layer_norm_grad_finalize_kernel<float>"
    assert names[2].startswith("reduce_sum_columns_kernel<unsigned short")
    assert launched[1][2][1] == 2 - (op == "add_rms_norm") and launched[2][4][:2] == (half, dsum)
    _assert_launches_match(launched)


@pytest.mark.parametrize("c", [33, 384, 8196])
@pytest.mark.parametrize("y", ["float32", "uint16"])
@pytest.mark.parametrize("copy", [False, True])
def test_layer_norm_reads_a_bf16_x_with_float32_parameters(monkeypatch, c, y, copy):
    """compile/norm_casts.py fuse_norm_input_casts: layer_norm and layer_norm_grad read a bf16
    x (XI) beside float32 weight, bias, statistics and dx; y and dy float32 or bf16; the
    backward with or without its bf16 dx copy."""
    from stepgraph.backends.cuda import layer_norm

    launched = _record_launches(monkeypatch, layer_norm)
    monkeypatch.setattr(layer_norm, "resident_blocks", lambda name, threads: 528)
    x, w, b, stats = Fake((3, 7, c), "uint16"), Fake((c,)), Fake((c,)), [Fake((21,)), Fake((21,))]
    layer_norm.layer_norm_forward(None, x, w, b, Fake(x.shape, y), *stats, 1e-5)
    layer_norm.layer_norm_backward(None, object(), Fake(x.shape, y), x, w, *stats,
                                   Fake(x.shape), Fake((c,)), Fake((c,)),
                                   dx_half=Fake(x.shape, "uint16") if copy else None)
    ctype = "unsigned short" if y == "uint16" else "float"
    names = [name for _, name, *_ in launched]
    assert names[0].startswith("layer_norm_forward") and \
        names[0].endswith(", float, unsigned short>") and f"<{ctype}" in names[0]
    h = "unsigned short" if copy else "float"
    assert names[1].startswith("layer_norm_backward") and \
        names[1].endswith(f", float, {h}, unsigned short>") and f"<{ctype}" in names[1]
    assert set(names) <= layer_norm.kernel_names()["layer_norm.cu"]
    _assert_launches_match(launched)


@pytest.mark.parametrize("c", [33, 384, 8196])
@pytest.mark.parametrize("b", ["float32", "uint16", "float16"])   # a widened half b, or not
@pytest.mark.parametrize("y", ["float32", "uint16"])
@pytest.mark.parametrize("has_w", [False, True])
def test_add_rms_norm_launch_arguments_match_the_kernels(monkeypatch, c, b, y, has_w):
    """add_rms_norm: a, b (float32, or a bf16 / float16 b beside a float32 a), weight, y, s,
    rstd forward; dy, s, weight, rstd, ds, dx backward, with dweight's finalize when wanted."""
    from stepgraph.backends.cuda import layer_norm

    launched = _record_launches(monkeypatch, layer_norm)
    monkeypatch.setattr(layer_norm, "resident_blocks", lambda name, threads: 528)
    a, rstd, w = Fake((3, 7, c)), Fake((21,)), Fake((c,)) if has_w else None
    layer_norm.rms_norm_forward(None, a, w, Fake(a.shape, y), rstd, 1e-6, b=Fake(a.shape, b),
                                s=Fake(a.shape))
    layer_norm.rms_norm_backward(None, object(), Fake(a.shape, y), a, w, rstd, Fake(a.shape),
                                 Fake((c,)) if has_w else None, ds=Fake(a.shape))
    names = [name for _, name, *_ in launched]
    assert names[0].startswith("add_rms_norm_forward") and names[1].startswith(
        "add_rms_norm_backward") and len(names) == 2 + has_w
    btype = {"float32": "", "uint16": ", float, unsigned short", "float16": ", float, fp16_bits"}
    assert names[0].endswith(f"{btype[b]}>")
    assert set(names) <= layer_norm.kernel_names()["layer_norm.cu"]
    _assert_launches_match(launched)


@pytest.mark.parametrize("c", [33, 384, 8196])
@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
def test_norms_with_a_folded_dropout_launch_arguments_match_the_kernels(monkeypatch, c, norm):
    """The dropouts folded into the norms: an add_* forward's dropout of a bf16 b (the step
    counter, its keep mask, seed, site, threshold and scale after eps), and each backward's
    dropout of its half dx copy (the mask and scale last)."""
    import numpy as np

    from stepgraph.backends.cuda import layer_norm

    launched = _record_launches(monkeypatch, layer_norm)
    monkeypatch.setattr(layer_norm, "resident_blocks", lambda name, threads: 528)
    a, w, stats = Fake((3, 7, c)), Fake((c,)), [Fake((21,)), Fake((21,))]
    b, mask = Fake(a.shape, "uint16"), Fake(a.shape, "uint8")
    drop = layer_norm.BranchDropout(Fake((), "int64"), mask, 0.2, 2**40 + 5, 7)
    half = layer_norm.HalfDropout(Fake(a.shape, "uint8"), 0.2)
    if norm == "rms_norm":
        layer_norm.rms_norm_forward(None, a, w, Fake(a.shape, "uint16"), stats[1], 1e-6, b=b,
                                    s=Fake(a.shape), dropout=drop)
        for ds in (None, Fake(a.shape)):
            layer_norm.rms_norm_backward(None, object(), Fake(a.shape, "uint16"), a, w,
                                         stats[1], Fake(a.shape), Fake((c,)),
                                         Fake(a.shape, "uint16"), ds=ds, half_dropout=half)
    else:
        layer_norm.add_layer_norm_forward(None, a, b, w, Fake((c,)), Fake(a.shape, "uint16"),
                                          Fake(a.shape), *stats, 1e-5, drop)
        for ds in (None, Fake(a.shape)):
            layer_norm.layer_norm_backward(None, object(), Fake(a.shape, "uint16"), a, w,
                                           *stats, Fake(a.shape), Fake((c,)), Fake((c,)), ds=ds,
                                           dx_half=Fake(a.shape, "uint16"), half_dropout=half)
    kernels = [(name, args) for _, name, _, _, args in launched if "finalize" not in name]
    assert [name.split("_kernel")[0].rsplit("_loop")[0] for name, _ in kernels] == \
        [f"add_{norm}_forward", f"{norm}_backward", f"add_{norm}_backward"]
    forward = kernels[0][1]
    assert forward[-6] is drop.step and forward[-5] is mask and int(forward[-4]) == 2**40 + 5
    assert int(forward[-3]) == 7 and float(forward[-1]) == np.float32(1 / 0.8)
    for _, args in kernels[1:]:
        assert args[-2] is half.mask and float(args[-1]) == np.float32(1 / 0.8)
    assert {name for _, name, *_ in launched} <= layer_norm.kernel_names()["layer_norm.cu"]
    _assert_launches_match(launched)


def test_a_bf16_x_is_layer_norms_alone(monkeypatch):
    from stepgraph.backends.cuda import layer_norm
    from stepgraph.errors import ShapeError

    _record_launches(monkeypatch, layer_norm)
    x, stats = Fake((4, 8), "uint16"), [Fake((4,)), Fake((4,))]
    with pytest.raises(ShapeError, match="layer_norm_grad's alone"):
        layer_norm.layer_norm_backward(None, object(), Fake((4, 8)), x, None, *stats,
                                       Fake((4, 8)), ds=Fake((4, 8)))
    with pytest.raises(ShapeError, match="float32 or float16"):
        layer_norm.rms_norm_forward(None, x, None, Fake((4, 8)), stats[1], 1e-5)


def test_a_half_dx_copy_is_of_a_float32_x(monkeypatch):
    from stepgraph.backends.cuda import layer_norm
    from stepgraph.errors import ShapeError

    _record_launches(monkeypatch, layer_norm)
    x, stats = Fake((4, 8), "float16"), [Fake((4,)), Fake((4,))]
    with pytest.raises(ShapeError, match="half dx copy"):
        layer_norm.layer_norm_backward(None, object(), Fake((4, 8), "float16"), x, None, *stats,
                                       Fake((4, 8), "float16"), dx_half=Fake((4, 8), "uint16"))


def test_softmax_shape_and_loss_launch_arguments_match_the_kernels(monkeypatch):
    from stepgraph.backends.cuda import loss, shape, softmax

    launched = _record_launches(monkeypatch, softmax, shape)
    x = Fake((2, 3, 5, 9))
    softmax.softmax_forward(None, x, Fake(x.shape), 0.125, True)
    softmax.softmax_backward(None, x, Fake(x.shape), Fake(x.shape), 0.5, False)
    softmax.softmax_forward(None, x, Fake(x.shape))
    for dtype in ("float32", "int64", "uint8"):
        shape.slice_forward(None, Fake((4, 6, 5), dtype), Fake((4, 3, 5), dtype), 1, 2, 5)
        shape.slice_backward(None, Fake((4, 3, 5), dtype), Fake((4, 6, 5), dtype), 1, 2)
        shape.slice_forward(None, Fake((4, 6, 5), dtype), Fake((4, 2, 5), dtype), 1, 1, 6, 3)
        shape.slice_backward(None, Fake((4, 2, 5), dtype), Fake((4, 6, 5), dtype), 1, 1, 3)
    shape.arange_forward(None, Fake((7,), "int64"))
    node = object()
    for n, c in ((5, 10), (4000, 10), (40, 1500)):
        logits, labels = Fake((n, c)), Fake((n,), "int64")
        loss.cross_entropy_forward(None, node, logits, labels, Fake(()), Fake((n,)), 0.1, 3)
        loss.cross_entropy_backward(None, Fake(()), logits, Fake((n,)), labels,
                                    Fake((n, c)), 0.0, node, -100)
        loss.cross_entropy_train(None, node, logits, labels, Fake(()), Fake((n, c)), 0.0, -1)
        # bf16 logits and dlogits (fuse_loss_casts)
        loss.cross_entropy_train(None, node, Fake((n, c), "uint16"), labels, Fake(()),
                                 Fake((n, c), "uint16"), 0.0, -1)
    for size in (100, 8 * 2 * 128 * 128, 2_000_000):      # one block, 64, the cap of 264
        loss.mse_forward(None, Fake((size,)), Fake((size,)), Fake(()), node)
    loss.mse_backward(None, Fake(()), Fake((9,)), Fake((9,)), Fake((9,)))
    names = [name for _, name, _, _, _ in launched]
    assert [grid for _, name, grid, _, _ in launched if name == "mse_forward_kernel"] == \
        [(1,), (64,), (264,)]
    assert "cross_entropy_train_short_kernel<unsigned short, unsigned short, long long>" in names
    assert "cross_entropy_train_kernel<unsigned short, unsigned short, long long>" in names
    assert names[:3] == ["softmax_scaled_forward_kernel<float>",
                         "softmax_scaled_backward_kernel<float>", "softmax_forward_kernel<float>"]
    assert names.count("cross_entropy_count_kernel<long long>") == 3 + 4   # grads, train x4
    _assert_launches_match(launched)


@pytest.mark.parametrize("dtype", ["float32", "uint16"])
def test_reduce_sum_launch_arguments_match_the_kernels(monkeypatch, dtype):
    """reduce_sum's paths name declared kernels with arguments of their parameters' types; many
    short last-axis rows take a warp per row, few planes or an outer axis the planes kernel."""
    from stepgraph.backends.cuda import reduce

    launched = _record_launches(monkeypatch, reduce)
    cases = [((32768, 96), (1,)), ((4, 16, 16, 96), (3,)), ((128, 4, 4, 5), (2, 3)),
             ((8, 64, 1024), (0, 2)), ((3, 5, 300), (2,)), ((600, 1025), (1,)),
             ((40, 30), (0,)), ((4, 5, 6, 7), (0, 2))]
    first = []
    for shape, axes in cases:
        first.append(len(launched))
        out = tuple(d for i, d in enumerate(shape) if i not in axes)
        reduce.reduce_sum_forward(None, object(), Fake(shape, dtype), Fake(out, dtype), axes)
    ctype = {"float32": "float", "uint16": "unsigned short"}[dtype]
    names = [launched[i][1].removesuffix(f"<{ctype}>").removesuffix(f"<{ctype}, 1>")
             for i in first]
    assert names == ["reduce_sum_rows_kernel"] * 3 + ["reduce_sum_planes_kernel"] * 3 + \
        ["reduce_sum_columns_kernel", "reduce_sum_strided_kernel"]
    _, _, grid, block, args = launched[0]                 # 32768 rows, 8 a block
    assert (grid, block, args[2:]) == ((4096,), (32, 8), (32768, 96))
    assert launched[first[3] + 1][1] == f"reduce_sum_splits_kernel<{ctype}>"  # outer 8 split
    assert {name for _, name, *_ in launched} <= reduce.kernel_names()["reduce.cu"]
    _assert_launches_match(launched)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("idx_dtype", ["int32", "int64"])
def test_index_and_reduce_axis_launch_arguments_match_the_kernels(monkeypatch, dtype,
                                                                  idx_dtype):
    """The index and reduce_axis families name declared kernels with arguments of their
    parameters' types, for every element type they take."""
    from stepgraph.backends.cuda import index, reduce_axis

    launched = _record_launches(monkeypatch, index, reduce_axis)
    x, i = Fake((3, 5, 4), dtype), Fake((3, 2, 4), idx_dtype)
    index.concat_forward(None, [x, Fake((3, 1, 4), dtype)], Fake((3, 6, 4), dtype), 1)
    index.concat_forward(None, [Fake((3, 5, 3), "uint16"), Fake((3, 5, 1), "uint16")],
                         Fake((3, 5, 4), "uint16"), 2)
    index.concat_forward(None, [Fake((3, 5, 64), "uint16"), Fake((3, 5, 64), "uint16")],
                         Fake((3, 5, 128), "uint16"), 2)
    index.gather_forward(None, x, i, Fake((3, 2, 4), dtype), 1)
    index.gather_backward(None, Fake((3, 2, 4), dtype), i, x, 1)
    for element in (dtype, "int64", "uint8", "uint16"):
        index.triangle_forward(None, Fake((2, 3, 5), element), Fake((2, 3, 5), element), -1,
                               True)
    for kind in ("max", "min"):
        reduce_axis.reduce_max_forward(None, x, Fake((3, 4), dtype), 1, kind)
        reduce_axis.reduce_max_forward(None, x, Fake((3, 5), dtype), 2, kind)   # rows
    reduce_axis.reduce_max_backward(None, Fake((3, 5), dtype), x, Fake((3, 5), dtype), x, 2)
    reduce_axis.topk_forward(None, x, Fake((3, 5, 2), dtype), Fake((3, 5, 2), "int64"), 2, 2,
                             False)
    reduce_axis.topk_forward(None, x, Fake((3, 5, 1), dtype), Fake((3, 5, 1), "int64"), 2, 1,
                             True)
    reduce_axis.cumsum_forward(None, x, x, 0, True)
    names = [name for _, name, _, _, _ in launched]
    ctype = {"float32": "float", "float64": "double"}[dtype]
    itype = {"int32": "int", "int64": "long long"}[idx_dtype]
    # rows of 16 or 32 bytes move as uint4; last-axis runs of 6 and 2 bytes (uint16) as units
    # of 2 bytes, runs of 128 bytes in rows of 256 as uint4
    assert names[:6] == ["concat_forward_kernel<uint4>"] * 2 + \
        ["concat_forward_kernel<unsigned short>"] * 2 + ["concat_forward_kernel<uint4>"] * 2
    assert f"gather_forward_kernel<{ctype}, {itype}>" in names
    assert f"gather_backward_kernel<{ctype}, {itype}>" in names
    assert f"reduce_max_forward_kernel<{ctype}, false>" in names
    assert f"reduce_max_rows_kernel<{ctype}, true>" in names
    assert names[-3:-1] == [f"topk_forward_kernel<{ctype}>", f"top1_rows_kernel<{ctype}>"]
    assert set(names) <= index.kernel_names()["index.cu"] | \
        reduce_axis.kernel_names()["reduce_axis.cu"]
    _assert_launches_match(launched)


def test_plain_kernels_keep_their_names():
    """A kernel launched by a plain name (no template arguments) is extern "C": CuPy looks it
    up by that symbol, which a C++ (mangled) kernel lacks, and the compile above resolves names
    through name expressions, so it would not notice (random.cu's kernels were found so on a
    GPU)."""
    kernels = launched_kernels()
    for name in kernel_families():
        for filename, names in family(name).kernel_names().items():
            kernels.setdefault(filename, set()).update(names)
    assert "random.cu" in kernels
    for filename, names in sorted(kernels.items()):
        plain = sorted(n for n in names if "<" not in n)
        if plain:
            cubin = compiler.compile_to_cubin(compiler.source_path(filename), "sm_90", ())
            missing = [n for n in plain if b"\0" + n.encode() + b"\0" not in cubin]
            assert not missing, f"{filename}: {missing} are not extern \"C\""


def test_attention_head_dim_96_compiles_in_every_storage_and_kernel():
    """The head dim template 96 (head dims 65..96: 80, 96), with the mask and grouped-head
    parameters every attention kernel now takes, in each storage and arithmetic the launchers
    pick: declared, and compiled by NVRTC."""
    from stepgraph.backends.cuda.attention import attention

    names = {attention.kernel_name(kind, 96, math, ctype) for kind in attention.TILES
             for math, ctypes in attention.CTYPES.items() for ctype in ctypes}
    assert len(names) == 12 and names <= attention.kernel_names()[attention.SOURCE]
    assert compiler.compile_to_cubin(compiler.source_path(attention.SOURCE), "sm_90",
                                     tuple(sorted(names)))
    for name in names:          # (..., vec, group, mask, its four strides)
        assert kernel_params(attention.SOURCE, name)[-6:] == ("u32", "u64", "u64", "u64",
                                                              "u64", "u64"), name


@pytest.mark.parametrize("c,block", [(1, (1, 256)), (2, (2, 128)), (5, (8, 32)), (16, (16, 16)),
                                     (17, (32, 8)), (1000, (32, 8)), (5000, (128, 2))])
def test_softmax_rows_of_at_most_16_columns_share_warps(monkeypatch, c, block):
    """log_softmax and softmax give a row of at most 16 columns the power of two of lanes that
    covers it, several rows a warp; longer rows keep a warp or more (runtime/launch.py
    _row_block narrow)."""
    from stepgraph.backends.cuda import loss, softmax
    from stepgraph.ir.graph import Node

    launched = _record_launches(monkeypatch, loss, softmax)
    x, y = Fake((300, c)), Fake((300, c))
    loss.log_softmax_forward(None, x, y)
    loss.log_softmax_backward(None, x, y, Fake((300, c)))
    softmax.IMPLS["softmax"](Node("softmax", [], [], {}), [x], [y], None)
    assert [launch[3] for launch in launched] == [block] * 3
    _assert_launches_match(launched)
