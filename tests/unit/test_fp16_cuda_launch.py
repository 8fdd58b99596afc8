"""float16 on the cuda backend without a GPU: every float16 launcher path names a kernel the
NVRTC compile declares, its arguments fit that kernel's parameters (PTX of the real source,
the launches recorded on stand-in arrays, as test_nvrtc_compile.py does), a generated float16
program compiles, the float16 steps of the half_convnet model (model.half() and float16
autocast) use only ops whose families declare float16 kernels, and an op without one is
refused in one line naming it and precision='bf16'. Needs CuPy and libnvrtc, no GPU."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("cupy")

import stepgraph as sg  # noqa: E402
from stepgraph.errors import UnsupportedPrecisionError  # noqa: E402
from tests.unit.test_nvrtc_compile import (Fake, _assert_launches_match,  # noqa: E402
                                           _nvrtc_usable, _record_launches)

pytestmark = pytest.mark.skipif(not _nvrtc_usable(), reason="libnvrtc is not loadable")

F16 = "float16"


def test_fp16_header_rounds_in_ptx_to_nearest_even():
    """The conversions are the hardware's round-to-nearest-even cvt (overflow to inf), not a
    truncation: the PTX of a float16 store holds cvt.rn.f16.f32."""
    from cupy.cuda import nvrtc

    from stepgraph.backends.cuda.runtime import compiler

    source = ('#include "bf16.cuh"\nextern "C" __global__ void k(const float* x, fp16_bits* y)'
              ' { store_from_float(y, 0, load_as_float(x, 0)); }\n')
    headers = compiler.headers()
    prog = nvrtc.createProgram(source, "k.cu", [h.read_text().encode() for h in headers],
                               [h.name.encode() for h in headers])
    nvrtc.compileProgram(prog, ["-arch=compute_90", "-std=c++17", "-ftz=true"])
    ptx = nvrtc.getPTX(prog)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    assert "cvt.rn.f16.f32" in ptx


def test_elementwise_cast_and_fill_launches(monkeypatch):
    from stepgraph.backends.cuda import cast, elementwise

    launched = _record_launches(monkeypatch, elementwise, cast)
    x = Fake((8, 12), F16)
    elementwise.act_forward(None, x, Fake(x.shape, F16), "gelu")
    elementwise.act_backward(None, x, Fake(x.shape, F16), Fake(x.shape, F16), "gelu")
    elementwise.add_forward(None, x, Fake(x.shape, F16), Fake(x.shape, F16))
    elementwise.dropout_forward(None, x, Fake((), "int64"), Fake(x.shape, F16),
                                Fake(x.shape, "uint8"), 0.1, 3, 1)
    elementwise.dropout_backward(None, x, Fake(x.shape, "uint8"), Fake(x.shape, F16), 0.1)
    elementwise.linear_bias_act(None, Fake((8, 12)), Fake((12,), F16), x, Fake(x.shape, F16),
                                "gelu")
    elementwise.fill_forward(None, x, 1.0)
    for src, dst in (("float32", F16), (F16, "float32"), ("bfloat16", F16), (F16, "bfloat16")):
        storage = {"bfloat16": "uint16"}.get
        cast.cast_forward(None, Fake((64,), storage(src, src)), Fake((64,), storage(dst, dst)),
                          src, dst)
    names = [name for _, name, *_ in launched]
    assert names[:6] == [f"{k}<fp16_bits>" for k in (
        "act_forward_kernel", "act_backward_kernel", "add_forward_kernel",
        "dropout_forward_kernel", "dropout_backward_kernel", "linear_bias_act_kernel")]
    assert names[6] == "fill_forward_kernel<unsigned short>"       # float16 bits
    assert launched[6][4][-1] == np.float16(1.0).view(np.uint16)
    assert names[7:] == ["cast_forward_kernel<float, fp16_bits>",
                         "cast_forward_kernel<fp16_bits, float>",
                         "cast_forward_kernel<unsigned short, fp16_bits>",
                         "cast_forward_kernel<fp16_bits, unsigned short>"]
    declared = elementwise.kernel_names()["elementwise.cu"] | cast.kernel_names()["cast.cu"]
    assert set(names) <= declared
    _assert_launches_match(launched)


def test_fill_rounds_its_value_as_a_float16_store(monkeypatch):
    """fill's float16 value is the float32 value rounded once (overflow: inf), as the NumPy
    backend's store of a float32 fill rounds it."""
    from stepgraph.backends.cuda import elementwise

    launched = _record_launches(monkeypatch, elementwise)
    values = (0.1, 1 / 3, 70000.0, -2.0 ** -20)
    for value in values:
        elementwise.fill_forward(None, Fake((4,), F16), value)
    with np.errstate(over="ignore"):
        want = [np.float32(v).astype(np.float16).view(np.uint16) for v in values]
    got = [args[-1] for *_, args in launched]
    assert got == want and np.isinf(np.uint16(got[2]).view(np.float16))


def test_broadcast_reduce_loss_launches(monkeypatch):
    from stepgraph.backends.cuda import broadcast, loss, reduce

    launched = _record_launches(monkeypatch, broadcast, reduce, loss)
    x = Fake((4, 6, 5), F16)
    broadcast.binary_forward(None, x, Fake((1, 6, 1), F16), Fake(x.shape, F16), "mul")
    broadcast.scalar_forward(None, x, Fake(x.shape, F16), "mul", 0.5)
    broadcast.permute_forward(None, x, Fake((5, 6, 4), F16), (2, 1, 0))
    node = object()
    reduce.reduce_sum_forward(None, node, Fake((4, 30), F16), Fake((30,), F16), (0,))
    loss.log_softmax_forward(None, Fake((7, 10), F16), Fake((7, 10), F16))
    loss.log_softmax_backward(None, Fake((7, 10), F16), Fake((7, 10), F16), Fake((7, 10), F16))
    for n, c in ((5, 10), (4000, 10)):
        loss.cross_entropy_train(None, node, Fake((n, c), F16), Fake((n,), "int64"),
                                 Fake((), F16), Fake((n, c), F16), 0.2, -100)
    names = [name for _, name, *_ in launched]
    assert all("fp16_bits" in n for n in names if "count" not in n), names
    assert "cross_entropy_train_short_kernel<fp16_bits, fp16_bits, long long>" in names
    assert "cross_entropy_train_kernel<fp16_bits, fp16_bits, long long>" in names
    train = [args for _, name, _, _, args in launched if name.startswith("cross_entropy_train")]
    assert all(args[-1] == 2 for args in train)               # the float16 loss' storage
    _assert_launches_match(launched)


@pytest.mark.parametrize("shape", [(64, 16), (2, 4, 3, 4)], ids=["columns", "planes"])
def test_batch_norm_launches(monkeypatch, shape):
    """float16 activations with float32 per-channel values (BatchNorm turned back to float
    after model.half(), or autocast's batch_norm)."""
    from tests.unit.test_nvrtc_compile import test_batch_norm_launch_arguments_match_the_kernels

    test_batch_norm_launch_arguments_match_the_kernels(monkeypatch, shape, F16)


def test_update_guard_and_history_launches(monkeypatch):
    """model.half(): float16 parameters, gradients and momentum in the one update launch, a
    float16 loss in the guard and the loss history."""
    from stepgraph.backends.cuda import guards, optim
    from stepgraph.ir.graph import Node
    from stepgraph.ops.optim import HYPER_COLUMNS

    launched = _record_launches(monkeypatch, optim, guards)
    monkeypatch.setattr(guards, "_MAILBOXES", {})
    attrs = dict(n_params=2, n_scalars=3, n_slots=1, nesterov=True)
    hyper = Fake((2, len(HYPER_COLUMNS["sgd_update"])), "float64")
    params = [Fake((3, 4), F16), Fake((5,), F16)]
    ins = [Fake(()), Fake((), "int64"), hyper] + params + [Fake(p.shape, F16) for p in params] \
        + [Fake(p.shape, F16) for p in params]
    optim.sgd_update(None, Node("sgd_update", [], [], attrs), ins)
    loss, history = Fake((), F16), Fake((16,), F16)
    optim.advance_step(None, Fake((), "int64"), Fake((6,)), loss, history, Fake((16,), "int64"),
                       Fake(()))
    optim.record_loss(None, loss, Fake((), "int64"), history, Fake((16,), "int64"))
    flags = Fake((2,), "int32")
    guards.guard_check(None, Node("guard_check", [], [], {}), [flags, loss, *params])
    guards.guard_advance(None, Node("guard_advance", [], [], {}),
                         [flags, Fake((4,), "int64"), Fake((), "int64"), Fake((6,)), loss,
                          history, Fake((16,), "int64"), Fake((16,), "int32")], Fake(()))
    assert [name for _, name, *_ in launched] == [
        "sgd_update_kernel<false>", "advance_step_kernel", "record_loss_kernel",
        "guard_check_kernel", "guard_advance_kernel"]
    assert [args[-1] for _, _, _, _, args in launched[1:3]] == [2, 2]
    assert launched[4][4][-1] == 2
    _assert_launches_match(launched)


def test_update_tables_code_the_float16_storages(monkeypatch):
    """The UpdateEntry row of a float16 parameter: the gradient's storage code in bits 0-7,
    the parameter's (and its state's) in bits 8-15 (optim.cu update_chunk); state of another
    dtype than its parameter's is refused."""
    from stepgraph.backends.cuda import optim
    from stepgraph.backends.cuda.runtime import launch

    def dtype_check(what, a, dtype="float32", shape=None):
        if dtype is not None and a.dtype != np.dtype(dtype):
            raise sg.errors.ShapeError(f"{what}: the cuda kernels take {dtype}, got {a.dtype}")

    for mod in (optim, launch):
        monkeypatch.setattr(mod, "_check", dtype_check)
    monkeypatch.setattr(optim.cp, "asarray", np.asarray)
    monkeypatch.setattr(launch, "current_sm_count", lambda: 132)     # an H200's
    params = [Fake((4,), F16, 0x1000), Fake((4,), ptr=0x2000)]
    grads = [Fake((4,), F16, 0x3000), Fake((4,), "uint16", 0x4000)]
    slots = [[Fake((4,), F16, 0x5000), Fake((4,), ptr=0x6000)]]
    tables = optim._build_update_tables("sgd_update", params, grads, slots, [0], [0, 1], {})
    assert tables["entries"][:, 8].tolist() == [2 | 2 << 8, 1 | 0 << 8]
    with pytest.raises(sg.errors.ShapeError, match="float16"):
        optim._build_update_tables("sgd_update", params, grads, [[Fake((4,)), slots[0][1]]],
                                   [0], [0, 1], {})


@pytest.mark.parametrize("dtype", [F16])
def test_small_products_launch_the_small_kernels(monkeypatch, dtype):
    from types import SimpleNamespace

    from stepgraph.backends.cuda.matmul import linear, small_matmul
    from stepgraph.ir.graph import Node

    launched = []
    monkeypatch.setattr(small_matmul.compiler, "kernel", lambda filename, name: (
        lambda grid, block, args, stream: launched.append((filename, name, grid, block, args))))
    ctx = SimpleNamespace(stream=None, precision="fp16")
    node = Node("linear", [], [], dict(act="gelu", slope=0.01, save_preact=True))
    linear.IMPLS["linear"](node, [Fake((7, 33), dtype), Fake((5, 33), dtype), Fake((5,), dtype)],
                           [Fake((7, 5), dtype), Fake((7, 5), dtype)], ctx)
    node = Node("matmul", [], [], dict(trans_a=True, trans_b=False))
    linear.IMPLS["matmul"](node, [Fake((7, 5), dtype), Fake((7, 33), dtype)],
                           [Fake((5, 33), dtype)], ctx)
    names = {name for _, name, *_ in launched}
    assert names <= {f"small_matmul_{k}_kernel<fp16_bits, fp16_bits>" for k in ("thread", "warp")}
    assert names <= small_matmul.kernel_names()["small_matmul.cu"] and len(launched) == 2
    _assert_launches_match(launched)


def test_gemm_specs_take_float16_with_float32_compute():
    """cuBLASLt descriptors: CUDA_R_16F operands, COMPUTE_32F and a float32 scale whatever the
    precision; float16 operands may write a float32 D (the unfused epilogue's scratch)."""
    from stepgraph.backends.cuda.matmul import gemm
    from stepgraph.backends.cuda.runtime import nvmath_bindings

    try:
        nv = nvmath_bindings.load()
    except ImportError:
        pytest.skip("nvmath-python is not installed")
    assert gemm._data_type(F16) == nv.CudaDataType.CUDA_R_16F
    for precision in ("fp16", "tf32", "fp32"):
        assert gemm._compute_and_scale_type(F16, precision) == (
            nv.cublas.ComputeType.COMPUTE_32F, nv.CudaDataType.CUDA_R_32F)
    lay = gemm.Layout(4, 4, 4)
    gemm.GemmSpec(lay, lay, lay, dtype=F16, d_dtype="float32")
    with pytest.raises(sg.errors.ShapeError, match="float16 -> float32"):
        gemm.GemmSpec(lay, lay, lay, dtype="float32", d_dtype=F16)


def test_generated_float16_program_compiles_and_rounds_each_store():
    from stepgraph.backends.cuda.pointwise import kernel_source, vectorizable
    from stepgraph.backends.cuda.runtime.compiler import compile_source_to_cubin
    from stepgraph.ops.pointwise import Instr

    program = (Instr("binary", (0, 1), (("kind", "mul"),)),
               Instr("act", (2,), (("kind", "gelu"), ("slope", None))),
               Instr("cast", (3,), (("dtype", "float32"),)),
               Instr("compare", (0, 1), (("kind", "lt"),)))
    args = (program, (3, 4, 5), (8, 4), ((8, 4), (8, 4)), (F16, F16))
    source = kernel_source(*args)
    assert "fp16_round(__fmul_rn(r0, r1))" in source and "fp16_from_float(r3)" in source
    assert "const fp16_bits* __restrict__ in0" in source
    assert vectorizable(*args[:4], args[4])      # the bool result: four in one 4-byte store
    assert "store4_bytes(out2" in source
    assert compile_source_to_cubin(source, "pointwise_fp16.cu")
    only_floats = (program[:3], (4,), (8, 4), ((8, 4), (8, 4)), (F16, F16))
    assert vectorizable(*only_floats)
    assert compile_source_to_cubin(kernel_source(*only_floats), "pointwise_fp16_vec.cu")


# ---- the plans: which ops run float16 on cuda --------------------------------------------

@pytest.mark.parametrize("mode", ["half", "autocast"])
def test_half_convnet_steps_have_float16_kernels_on_cuda(mode):
    """Every op of the half_convnet model's float16 step (model.half() with BatchNorms in
    float, label smoothing, Nesterov SGD; or float16 autocast) has a float16 kernel on cuda:
    check_fp16_support lets the plan through."""
    from stepgraph.backends.cuda.backend import declared_fp16_ops
    from stepgraph.compile.autocast import check_fp16_support
    from tests.half_convnet_model import batches, convnet, loss_fn, optimizer

    model = convnet(sg, mode == "half")
    x, y = batches(1, np.float16 if mode == "half" else np.float32)[0]
    step = sg.compile_train_step(model, loss_fn(sg), optimizer(sg, model), (x, y),
                                 device="cpu", precision="fp16" if mode == "autocast" else "fp32")
    graph = step.plan(step.signature).graph
    assert any(v.dtype == F16 for n in graph.nodes for v in n.outputs)
    check_fp16_support(graph, declared_fp16_ops(), "cuda")
    with pytest.raises(UnsupportedPrecisionError, match="conv2d.*precision='bf16'"):
        check_fp16_support(graph, declared_fp16_ops() - {"conv2d"}, "cuda")


def test_an_op_without_float16_kernels_is_refused_in_one_line():
    """A model.half() with a float16 mse loss (no float16 mse kernel on cuda): refused when
    the step is planned, in one line that names the op and the bf16 alternative; its
    LayerNorm (float16 kernels) is not named."""
    from stepgraph.backends.cuda.backend import declared_fp16_ops
    from stepgraph.compile.autocast import check_fp16_support

    model = sg.nn.Sequential(sg.nn.Linear(6, 8), sg.nn.LayerNorm(8), sg.nn.Linear(8, 4)).half()
    x, y = np.ones((2, 6), np.float16), np.zeros((2, 4), np.float16)
    step = sg.compile_train_step(model, sg.nn.functional.mse_loss,
                                 sg.optim.SGD(model.parameters(), lr=0.1), (x, y), device="cpu")
    graph = step.plan(step.signature).graph
    with pytest.raises(UnsupportedPrecisionError) as err:
        check_fp16_support(graph, declared_fp16_ops(), "cuda")
    message = str(err.value)
    assert "\n" not in message and "mse" in message and "precision='bf16'" in message
    named = message.split("kernels yet for")[1].split(";")[0]
    assert "linear" not in named and "layer_norm" not in named
    check_fp16_support(graph, None, "cpu")    # the NumPy reference runs everything


@pytest.mark.parametrize("c", [33, 384, 8196])
@pytest.mark.parametrize("x_dtype", [F16, "float32"], ids=["half-model", "fused-cast"])
def test_layer_norm_launches(monkeypatch, c, x_dtype):
    """model.half(): x, weight, bias, y, dy, dx, dweight and dbias float16 (X = fp16_bits, the
    finalize writing float16); precision="fp16": a float32 x with the float16 y or dy of a
    fused cast (fuse_layer_norm_casts)."""
    from stepgraph.backends.cuda import layer_norm

    launched = _record_launches(monkeypatch, layer_norm)
    monkeypatch.setattr(layer_norm, "resident_blocks", lambda name, threads: 528)
    x, stats = Fake((3, 7, c), x_dtype), [Fake((21,)), Fake((21,))]
    w, b = Fake((c,), x_dtype), Fake((c,), x_dtype)
    layer_norm.layer_norm_forward(None, x, w, b, Fake(x.shape, F16), *stats, 1e-5)
    layer_norm.layer_norm_backward(None, object(), Fake(x.shape, F16), x, w, *stats,
                                   Fake(x.shape, x_dtype), Fake((c,), x_dtype),
                                   Fake((c,), x_dtype))
    names = [name for _, name, *_ in launched]
    assert len(names) == 3 and all(n.split("<")[1].startswith("fp16_bits") for n in names[:2])
    half_x = x_dtype == F16
    assert all(n.endswith(", fp16_bits>") == half_x for n in names[:2] if "loop" not in n)
    assert names[2] == f"layer_norm_grad_finalize_kernel<{'fp16_bits' if half_x else 'float'}>"
    assert set(names) <= layer_norm.kernel_names()["layer_norm.cu"]
    _assert_launches_match(launched)


def test_layer_norm_refuses_mixed_float16_inputs():
    """A float16 x takes float16 parameters and output (torch's half LayerNorm)."""
    from stepgraph.backends.cuda import layer_norm

    with pytest.raises(sg.errors.ShapeError, match="float32 or float16"):
        layer_norm._x_ctype("layer_norm input", Fake((2, 4), "float64"))


def test_softmax_launches(monkeypatch):
    """float16 x, y, dy and dx: the plain and the scaled (causal) kernels' fp16_bits twins."""
    from stepgraph.backends.cuda import softmax

    launched = _record_launches(monkeypatch, softmax)
    x = Fake((2, 3, 5, 9), F16)
    softmax.softmax_forward(None, x, Fake(x.shape, F16))
    softmax.softmax_backward(None, x, Fake(x.shape, F16), Fake(x.shape, F16))
    softmax.softmax_forward(None, x, Fake(x.shape, F16), 0.125, True)
    softmax.softmax_backward(None, x, Fake(x.shape, F16), Fake(x.shape, F16), 0.5, True)
    names = [name for _, name, *_ in launched]
    assert names == [f"softmax_{k}_kernel<fp16_bits>" for k in (
        "forward", "backward", "scaled_forward", "scaled_backward")]
    assert set(names) <= softmax.kernel_names()["softmax.cu"]
    _assert_launches_match(launched)
    with pytest.raises(sg.errors.ShapeError, match="float32 or float16"):
        softmax._rows("softmax input", Fake((4, 4), "uint16"))


@pytest.mark.parametrize("ptr", [0x7000, 0x7004], ids=["vec4", "vec1"])
def test_embedding_launches(monkeypatch, ptr):
    """A float16 table: the lookup and both gradient paths take T = fp16_bits (the float32
    names unchanged: T defaults to float)."""
    from stepgraph.backends.cuda import embedding

    launched = _record_launches(monkeypatch, embedding)
    v, c, n = 300, 12, 2500
    idx = Fake((5, n // 5), "int64")
    embedding.embedding_forward(None, Fake((v, c), F16, ptr), idx, Fake((5, n // 5, c), F16, ptr))
    for path in ("scan", "sorted"):
        monkeypatch.setattr(embedding, "PATH", path)
        embedding.embedding_backward(None, object(), Fake((5, n // 5, c), F16, ptr), idx,
                                     Fake((v, c), F16, ptr))
    names = [name for _, name, *_ in launched]
    assert names[:3] == ["embedding_forward_kernel<long long, fp16_bits>",
                         "embedding_backward_scan_kernel<long long, fp16_bits>",
                         "embedding_scan_sum_kernel<fp16_bits>"]
    assert names[-1] == "embedding_backward_sorted_kernel<fp16_bits>"
    assert set(names) <= embedding.kernel_names()["embedding.cu"]
    _assert_launches_match(launched)


def _gpt_half_graph():
    from stepgraph.models import gpt, next_token_loss

    sg.manual_seed(0)
    model = gpt(64, block_size=16, n_layer=1, n_head=2, n_embd=32, dropout=0.1).half()
    x = np.random.default_rng(0).integers(0, 64, (2, 16)).astype(np.int64)
    step = sg.compile_train_step(model, next_token_loss,
                                 sg.optim.AdamW(model.parameters(), lr=1e-3), (x, x))
    return step.plan(step.signature).graph


def test_a_half_gpt_has_float16_kernels_on_cuda():
    """model.half() of the GPT (Embedding, LayerNorm, attention, AdamW): every op of its step
    has a float16 kernel on cuda; without layer_norm's and embedding's it would be refused."""
    from stepgraph.backends.cuda.backend import declared_fp16_ops
    from stepgraph.compile.autocast import check_fp16_support

    graph = _gpt_half_graph()
    half_ops = {n.op for n in graph.nodes if any(v.dtype == F16 for v in n.outputs)}
    assert {"embedding", "embedding_grad", "layer_norm", "layer_norm_grad"} <= half_ops
    check_fp16_support(graph, declared_fp16_ops(), "cuda")
    for op in ("layer_norm", "embedding"):
        with pytest.raises(UnsupportedPrecisionError, match=op):
            check_fp16_support(graph, declared_fp16_ops() - {op}, "cuda")


def test_a_gpt_under_float16_autocast_and_grad_scaler_has_float16_kernels_on_cuda():
    """A GPT model file with hand-written attention (masked_fill, softmax), trained by a
    script under torch.autocast(dtype=torch.float16) with a GradScaler: the step's plan passes
    the float16 check, its LayerNorms write the float16 y the next GEMM reads (the cast fused
    into the kernel, fuse_layer_norm_casts) and their gradients read float16 dy."""
    from stepgraph.backends.cuda.backend import declared_fp16_ops
    from stepgraph.compile.autocast import check_fp16_support
    from stepgraph.loop import hooks
    from tests.compat.loader import load

    sg.manual_seed(0)
    model = load("gpt", "stepgraph").GPT()
    model.name_parameters()
    opt = sg.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = sg.amp.GradScaler()
    gen = np.random.default_rng(0)
    for _ in range(2):
        idx = sg.from_numpy(gen.integers(0, 64, (2, 16)))
        opt.zero_grad()
        with sg.autocast("cuda", dtype=sg.float16):
            _, loss = model(idx, idx)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    assert hooks.SESSION.last_step.precision == "fp16"
    graph = hooks.SESSION.last_executable.plan.graph
    check_fp16_support(graph, declared_fp16_ops(), "cuda")
    # residual sums reach their LayerNorm fused (compile/norm_rewrite.py): 4 of the 5
    norms = [n for n in graph.nodes if n.op in ("layer_norm", "add_layer_norm")]
    grads = [n for n in graph.nodes if n.op in ("layer_norm_grad", "add_layer_norm_grad")]
    assert len(norms) == len(grads) == 5
    assert sum(n.op == "add_layer_norm" for n in norms) == 4
    assert all(n.inputs[0].dtype == "float32" for n in norms)
    assert sum(n.outputs[0].dtype == F16 for n in norms) == 5
    assert sum(n.inputs[0].dtype == F16 for n in grads) >= 4


def test_float16_gradients_all_reduce_as_ncclfloat16():
    """A model.half()'s gradient buckets: all_reduce takes float16 and sums in float16
    (ncclFloat16, 6 in nccl.h, whether or not CuPy names it); other reduce dtypes refused."""
    from types import SimpleNamespace

    from stepgraph.backends.cuda import collective
    from stepgraph.ir.graph import Value
    from stepgraph.ir.ops import infer_outputs

    assert {"all_reduce", "all_reduce_join"} <= collective.FP16_OPS
    assert collective._nccl_dtype(SimpleNamespace(), Fake((3,), F16)) == 6
    assert collective._nccl_dtype(SimpleNamespace(NCCL_FLOAT16=6), Fake((3,), F16)) == 6
    grads = [Value((3, 2), F16), Value((5,), F16)]
    assert [d for _, d in infer_outputs("all_reduce", grads, {"group": 0})] == [F16, F16]
    with pytest.raises(sg.errors.ShapeError, match="summed in float16"):
        infer_outputs("all_reduce", grads, {"group": 0, "reduce_dtype": "float32"})
