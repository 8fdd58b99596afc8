"""backends/cuda/attention.py without a GPU: the launches it makes for sdpa and sdpa_grad pass
each kernel exactly the parameters NVRTC compiled (count, pointer or scalar, width,
float-ness), the tiles fit the shared memory of an H100, every template it may pick is listed
in kernel_names() (the NVRTC compile test instantiates those), and leading dims with strides
collapse into (batch, heads) as the kernels walk them."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("cupy")

from stepgraph.backends.cuda.attention import attention, attention_composed  # noqa: E402
from stepgraph.ir.graph import Node  # noqa: E402
from tests.unit.test_nvrtc_compile import (Fake, _nvrtc_usable,  # noqa: E402
                                           assert_args_match)

H100_SHARED = 227 * 1024        # bytes of shared memory one block may opt into


class CapturingStream:
    """A stream in the middle of a capture: the launchers run each kernel's default tile
    (autotune.run_fastest times nothing then)."""

    def is_capturing(self):
        return True


def fake_ctx(precision: str) -> SimpleNamespace:
    return SimpleNamespace(stream=CapturingStream(), paths={}, precision=precision)


def record(monkeypatch):
    """Patch out the CuPy-only parts; return the launches as (kernel, grid, block, args,
    shared bytes)."""
    launched = []

    def function(name, shared):
        return lambda grid, block, args, shared_mem, stream: launched.append(
            (name, grid, block, args, shared_mem))

    def contiguous(what, a, shape, dtype):
        assert a.dtype == dtype, what
        strides = np.cumprod((1,) + tuple(shape[::-1]))[:-1][::-1]
        lead = shape[:-2]
        head = int(strides[len(lead) - 1]) if len(lead) >= 2 else 0
        batch = int(strides[len(lead) - 2 if len(lead) >= 2 else 0]) if lead else 0
        return attention.Heads(batch, head, int(strides[-2]))

    monkeypatch.setattr(attention.attention_cudnn, "USE_CUDNN", False)   # the own kernels'
    monkeypatch.setenv("STEPGRAPH_DISK_CACHE", "0")       # no stored tile choices
    monkeypatch.setattr(attention, "_function", function)
    monkeypatch.setattr(attention, "_heads", contiguous)
    monkeypatch.setattr(attention, "storage", lambda q: attention.STORAGE[q.dtype])
    monkeypatch.setattr(attention, "_check_rows", lambda *a: None)
    monkeypatch.setattr(attention, "_check_step", lambda step: None)
    monkeypatch.setattr(attention, "_node_memory", lambda node, key, ctx, build: Fake((key[1],)))
    return launched


CASES = [((2, 3), 7, 7, 64, 64, True, 0.0), ((4,), 256, 256, 32, 32, True, 0.2),
         ((2, 2), 5, 9, 100, 72, False, 0.1), ((1,), 1, 1, 8, 8, False, 0.0),
         ((2, 6), 255, 255, 128, 128, True, 0.2)]


@pytest.mark.skipif(not _nvrtc_usable(), reason="libnvrtc is not loadable")
@pytest.mark.parametrize("precision,dtype", [("fp32", "float32"), ("tf32", "float32"),
                                             ("bf16", "uint16")])
@pytest.mark.parametrize("lead,L,S,E,Ev,causal,p", CASES)
def test_sdpa_launch_arguments_match_the_kernels(monkeypatch, lead, L, S, E, Ev, causal, p,
                                                 precision, dtype):
    launched = record(monkeypatch)
    attrs = dict(scale=0.125, causal=causal, dropout_p=p)
    if p:
        attrs.update(seed=2**40 + 3, site=5)
    q, k, v = Fake((*lead, L, E), dtype), Fake((*lead, S, E), dtype), Fake((*lead, S, Ev), dtype)
    out, lse, dout = Fake((*lead, L, Ev), dtype), Fake((*lead, L)), Fake((*lead, L, Ev), dtype)
    step = [Fake((), "int64")] if p else []
    ctx = fake_ctx(precision)
    attention.IMPLS["sdpa"](Node("sdpa", [], [], attrs), [q, k, v] + step, [out, lse], ctx)
    grads = [Fake(x.shape, dtype) for x in (q, k, v)]
    attention.IMPLS["sdpa_grad"](Node("sdpa_grad", [], [], attrs),
                                 [dout, q, k, v, out, lse] + step, grads, ctx)
    hd = attention.head_dim_template(E, Ev)
    ctype = "unsigned short" if dtype == "uint16" else "float"
    math = attention.TF32 if dtype == "uint16" else attention.MATH[precision]
    assert [name for name, *_ in launched] == [attention.kernel_name(kind, hd, math, ctype)
                                               for kind in ("forward", "backward_dq",
                                                            "backward_dkdv")]
    listed = attention.kernel_names()[attention.SOURCE]
    bh = int(np.prod(lead))
    for (name, grid, block, args, shared), kind in zip(launched, attention.TILES):
        assert name in listed
        assert_args_match(attention.SOURCE, name, args)
        bq, bk = attention.TILES[kind][hd]
        tiles = -(-S // bk) if kind == "backward_dkdv" else -(-L // bq)
        assert grid == (tiles * bh,) and block == (attention.THREADS,)
        assert shared == attention.shared_floats(kind, hd) * 4 <= H100_SHARED
        assert int(args[-8]) == (p > 0)                       # the dropout flag
        assert int(args[-6]) == 1 and args[-5] == 0           # no groups, no mask
        step_arg = args[5 if kind == "forward" else 6]
        assert step_arg is step[0] if p else step_arg == 0


@pytest.mark.parametrize("precision,dtype", [("fp32", "float32"), ("tf32", "float32"),
                                             ("bf16", "bfloat16")])
def test_kernels_ahead_name_what_the_launches_take(monkeypatch, precision, dtype):
    """The kernels a plan compiles ahead for each attention node (CudaBackend.prepare) are
    the ones its first step's launches may take, for the plain ops and the packed ones a
    GPT's attention becomes: every candidate tile of an untimed problem (the first eager step
    times them all), the default one among them (what a capture runs untimed)."""
    from stepgraph.ir.graph import Value

    launched = record(monkeypatch)
    storage = "uint16" if dtype == "bfloat16" else dtype
    lead, t, heads, hd = (2, 3), 9, 3, 40
    attrs = dict(scale=0.2, causal=True, dropout_p=0.0)
    ctx = fake_ctx(precision)
    q, lse = Fake((*lead, t, hd), storage), Fake((*lead, t))
    fwd = Node("sdpa", [Value(q.shape, dtype)] * 3, [], attrs)
    grad = Node("sdpa_grad", [Value(q.shape, dtype)] * 5, [], attrs)
    attention.IMPLS["sdpa"](fwd, [q, q, q], [Fake(q.shape, storage), lse], ctx)
    attention.IMPLS["sdpa_grad"](grad, [q, q, q, q, q, lse], [Fake(q.shape, storage)] * 3, ctx)
    forward, backward = attention.kernels_ahead(fwd, precision), \
        attention.kernels_ahead(grad, precision)
    # untimed: every candidate tile of each kernel, its default (what a capture runs) first
    template, ctype = 64, "unsigned short" if dtype == "bfloat16" else "float"
    math = attention.math_of(precision, ctype)
    tiles = {kind: [(attention.SOURCE, attention.kernel_name(kind, template, math, ctype, tile))
                    for tile in attention.CANDIDATES[kind][template]]
             for kind in attention.CANDIDATES}
    # float32: the composed path's row kernel too (attention_composed.py, timed against them)
    rows = ctype == "float"
    assert forward == tiles["forward"] + (attention_composed.kernels(True) if rows else [])
    assert backward == tiles["backward_dq"] + tiles["backward_dkdv"] + (
        attention_composed.kernels(False) if rows else [])
    assert [name for name, *_ in launched] == [
        attention.kernel_name(kind, template, math, ctype) for kind in attention.CANDIDATES]
    packed = Value((lead[0], t, 3 * heads * hd), dtype)
    out = Value((lead[0], t, heads * hd), dtype)
    assert attention.kernels_ahead(Node("sdpa_qkv", [packed], [], attrs | {"heads": heads}),
                                   precision) == forward
    assert attention.kernels_ahead(Node("sdpa_qkv_grad", [out, packed], [],
                                        attrs | {"heads": heads}), precision) == backward


def test_bf16_attention_that_cudnn_runs_compiles_no_own_kernels_ahead(monkeypatch):
    """Where cuDNN is usable, a bf16 attention it takes (equal head dims, multiples of 8, no
    bottom-right causal mask) compiles none of attention.cu ahead; the others and every
    float32 one still do."""
    from stepgraph.backends.cuda.conv import conv_cudnn
    from stepgraph.ir.graph import Value

    monkeypatch.setattr(conv_cudnn, "unavailable_reason", lambda: None)
    monkeypatch.setenv("STEPGRAPH_DISK_CACHE", "0")       # no stored tile choices

    def ahead(dtype, rows, keys, hd, causal=True, precision="bf16"):
        q, k = Value((2, 3, rows, hd), dtype), Value((2, 3, keys, hd), dtype)
        node = Node("sdpa", [q, k, k], [], dict(scale=0.1, causal=causal))
        return attention.kernels_ahead(node, precision)

    assert ahead("bfloat16", 16, 16, 64) == []
    assert ahead("bfloat16", 8, 16, 64, causal=False) == []
    assert ahead("bfloat16", 8, 16, 64) != []        # bottom-right causal: the own kernels
    assert ahead("bfloat16", 16, 16, 20) != []       # head dim not a multiple of 8
    assert ahead("float32", 16, 16, 64, precision="tf32") != []
    packed = Value((2, 16, 3 * 4 * 32), "bfloat16")
    assert attention.kernels_ahead(Node("sdpa_qkv", [packed], [],
                                        dict(heads=4, causal=True)), "bf16") == []


def test_every_tile_fits_two_blocks_where_it_matters():
    """The bench's head dim (64) and 32 run at least two blocks per SM; 128 at least one;
    on every candidate tile."""
    for kind, per_hd in attention.CANDIDATES.items():
        for hd, tiles in per_hd.items():
            for tile in tiles:
                shared = attention.shared_floats(kind, hd, tile) * 4
                blocks = (228 * 1024) // (shared + 1024)
                assert blocks >= (2 if hd <= 64 else 1), (kind, hd, tile, blocks)


def test_head_dim_templates():
    assert [attention.head_dim_template(e, e) for e in (1, 32, 33, 64, 65, 80, 96, 97, 128)] \
        == [32, 32, 64, 64, 96, 96, 96, 128, 128]
    assert attention.head_dim_template(16, 100) == 128
    with pytest.raises(Exception, match="head dims"):
        attention.head_dim_template(129, 8)


def test_leading_dims_collapse_to_one_stride():
    # (B, nh) of a contiguous (B, nh, T, hd): batch stride nh * T * hd
    assert attention._collapsed_stride((4,), (6 * 256 * 64,)) == 6 * 256 * 64
    # (A, B) flattened into one batch index: contiguous, or size-1 dims with any stride
    assert attention._collapsed_stride((2, 3), (30, 10)) == 10
    assert attention._collapsed_stride((2, 1, 3), (30, 999, 10)) == 10
    assert attention._collapsed_stride((), ()) == 0
    assert attention._collapsed_stride((1, 1), (5, 7)) == 0
    assert attention._collapsed_stride((2, 3), (40, 10)) is None


# (q lead, kv lead, L, S, E, mask shape or None, causal): grouped heads, masks broadcast over
# batch, heads, queries or keys, head dims 80 and 96 (96's template)
MASKED = [((2, 4), (2, 2), 7, 9, 64, (2, 1, 1, 9), False),
          ((2, 6), (2, 1), 33, 33, 80, (33, 33), True),
          ((3, 2), (3, 2), 5, 70, 96, (1, 2, 5, 70), False),
          ((2, 8), (2, 2), 40, 40, 128, (2, 1, 40, 1), False),
          ((1, 4), (1, 4), 16, 16, 32, None, True)]


@pytest.mark.skipif(not _nvrtc_usable(), reason="libnvrtc is not loadable")
@pytest.mark.parametrize("dtype", ["float32", "uint16"])
@pytest.mark.parametrize("lead,kv_lead,L,S,E,mshape,causal", MASKED)
def test_grouped_and_masked_launches_match_the_kernels(monkeypatch, lead, kv_lead, L, S, E,
                                                       mshape, causal, dtype):
    """Grouped heads and masks reach the kernels: the group, the mask's pointer and its
    broadcast strides as the last arguments, one dk/dv block per key tile and kv head, and
    neither on cuDNN's path (bf16 included)."""
    launched = record(monkeypatch)
    monkeypatch.setattr(attention.attention_cudnn, "USE_CUDNN", True)
    attrs = dict(scale=0.125, causal=causal, dropout_p=0.0, mask=mshape is not None)
    q, k, v = Fake((*lead, L, E), dtype), Fake((*kv_lead, S, E), dtype), \
        Fake((*kv_lead, S, E), dtype)
    out, lse, dout = Fake((*lead, L, E), dtype), Fake((*lead, L)), Fake((*lead, L, E), dtype)
    mask = [Fake(mshape, dtype, ptr=0x9000)] if mshape else []
    ctx = fake_ctx("fp32")
    attention.IMPLS["sdpa"](Node("sdpa", [], [], attrs), [q, k, v] + mask, [out, lse], ctx)
    grads = [Fake(x.shape, dtype) for x in (q, k, v)]
    attention.IMPLS["sdpa_grad"](Node("sdpa_grad", [], [], attrs),
                                 [dout, q, k, v, out, lse] + mask, grads, ctx)
    hd = attention.head_dim_template(E, E)
    assert len(launched) == 3 and all(f"<{hd}," in name for name, *_ in launched)
    bh, group = int(np.prod(lead)), lead[-1] // kv_lead[-1]
    want = (0, 0, 0, 0) if not mshape else attention.mask_strides(
        mshape, Fake(mshape).strides, 4, lead, L, S)
    for (name, grid, block, args, shared), kind in zip(launched, attention.TILES):
        assert_args_match(attention.SOURCE, name, args)
        bq, bk = attention.TILES[kind][hd]
        blocks = -(-S // bk) * bh // group if kind == "backward_dkdv" else -(-L // bq) * bh
        assert grid == (blocks,)
        assert int(args[-6]) == group
        assert (args[-5] is mask[0]) if mshape else args[-5] == 0
        assert tuple(int(a) for a in args[-4:]) == want


def test_mask_strides_follow_the_broadcast():
    """Element strides of masks broadcast to (B, H, L, S) scores: 0 along broadcast dims,
    None where the leading dims do not flatten (the launcher copies the mask then)."""
    def strides(shape, lead=(2, 3), L=5, S=7):
        return attention.mask_strides(shape, np.zeros(shape, np.float32).strides, 4, lead, L, S)

    assert strides((2, 1, 1, 7)) == (7, 0, 0, 1)              # key padding
    assert strides((5, 7)) == (0, 0, 7, 1)                    # one (L, S) for every head
    assert strides((1, 3, 5, 7)) == (0, 35, 7, 1)             # per head
    assert strides((2, 3, 5, 1)) == (15, 5, 1, 0)             # per query row
    assert strides((2, 3, 5, 7), lead=(2, 3)) == (105, 35, 7, 1)
    assert strides((4, 1, 1, 5, 7), lead=(4, 2, 3)) is None  # broadcast inside the batch
    assert strides((1, 1, 1, 5, 7), lead=(4, 2, 3)) == (0, 0, 7, 1)
    with pytest.raises(Exception, match="broadcast"):
        strides((2, 5, 7))


def test_kernel_names_cover_every_candidate_tile():
    """Every tile the autotuner may choose is one the kernels take (multiples of 32, BK <= BQ
    for dk/dv: attention.cu's static_asserts), its default first, and listed in
    kernel_names() in every arithmetic and storage (so the NVRTC compile test builds it)."""
    listed = attention.kernel_names()[attention.SOURCE]
    count = 0
    for kind, per_hd in attention.CANDIDATES.items():
        assert set(per_hd) == set(attention.HEAD_DIMS)
        for hd, tiles in per_hd.items():
            assert tiles[0] == attention.TILES[kind][hd] and len(set(tiles)) == len(tiles)
            for bq, bk in tiles:
                assert bq % 32 == 0 and bk % 32 == 0, (kind, hd, bq, bk)
                assert kind != "backward_dkdv" or bk <= bq
                for math, ctypes in attention.CTYPES.items():
                    for ctype in ctypes:
                        name = attention.kernel_name(kind, hd, math, ctype, (bq, bk))
                        assert name in listed and f"<{hd}, {bq}, {bk}, {math}," in name
                        count += 1
    assert count == len(listed)
    # the short-sequence tiles of the bench's head dims are among them
    assert all((32, 32) in attention.CANDIDATES[kind][hd] for kind in attention.CANDIDATES
               for hd in (32, 64))
