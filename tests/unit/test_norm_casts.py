"""compile/norm_casts.py: a normalisation gradient's float32 dx, cast to bf16 for the GEMM
before the norm, is stored in bf16 by the gradient itself: as a second copy (dx_half) where
the float32 dx is read too (the residual stream), or in its place where the cast was its only
reader; a LayerNorm and its gradient read a bf16 x without the cast to float32 before them.
The steps train to the same bits as with the casts."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import stepgraph.compile.norm_casts as norm_casts
from tests.unit.compat_training import torch_state, train_steps

pytest.importorskip("torch")

NORM_GRADS, NORM_INPUTS = norm_casts.NORM_GRADS, norm_casts.NORM_INPUTS


def norm_grad_forms(plan) -> Counter:
    """How each norm gradient of the plan stores dx: "float32", "copy" (float32 and a half
    copy) or "alone" (in half only); and "cast" for each cast that reads one's dx."""
    steps = [n for i, n in enumerate(plan.steps) if plan.runs(i)]
    made = {v: n for n in steps for v in n.outputs}
    forms = Counter()
    for n in steps:
        if n.op == "layer_norm" and n.inputs[0].dtype == "bfloat16":
            forms["bf16 x"] += 1
        if n.op in NORM_GRADS:
            forms["copy" if n.attrs.get("dx_half") else
                  "alone" if n.outputs[0].dtype != "float32" else "float32"] += 1
        elif n.op == "cast" and getattr(made.get(n.inputs[0]), "op", None) in NORM_GRADS:
            forms["cast"] += 1
    return forms


def trained(monkeypatch, name, cls, kw, batches, on, **options):
    monkeypatch.setattr(norm_casts, "NORM_GRADS", NORM_GRADS if on else ())
    monkeypatch.setattr(norm_casts, "NORM_INPUTS", NORM_INPUTS if on else ())
    plan, losses, params = train_steps(name, cls, kw, torch_state(name, cls, kw), batches,
                                       precision="bf16", **options)
    return norm_grad_forms(plan), losses, params


def assert_same_training(got, want):
    assert got[1] == want[1]
    for k in want[2]:
        np.testing.assert_array_equal(got[2][k], want[2][k], err_msg=k)


def test_the_gpt_files_residual_gradients_keep_float32_and_store_a_bf16_copy(monkeypatch):
    """tests/compat/models/gpt.py (pre-norm blocks): each add_layer_norm_grad's dx is the next
    block's float32 ds and the bf16 input of the Linear backward before it: a copy each; the
    first block's ln_1 gradient feeds the embeddings' float32 sum and its Linear: a copy too."""
    kw = dict(vocab_size=16, block_size=8, n_layer=3, n_head=2, n_embd=16)
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 16, (2, 8)), rng.integers(0, 16, (2, 8))) for _ in range(3)]
    got = trained(monkeypatch, "gpt", "GPT", kw, batches, True)
    want = trained(monkeypatch, "gpt", "GPT", kw, batches, False)
    grads = sum(want[0].values()) - want[0]["cast"]
    assert want[0]["cast"] == 2 * kw["n_layer"]
    assert got[0] == Counter(copy=2 * kw["n_layer"], float32=grads - 2 * kw["n_layer"])
    assert_same_training(got, want)


def test_the_convnext_files_block_norms_read_and_store_bf16(monkeypatch):
    """tests/compat/models/convnext.py at channels-last: a block's LayerNorm reads its
    depthwise convolution's bf16 output (its gradient too), and its gradient goes only to
    that convolution's backward (in bf16), so dx is stored in bf16 alone."""
    import torch.nn.functional as F  # noqa: F401  (the loss is the stepgraph module's)

    import stepgraph

    kw = dict(drop_path_rate=1e-9)
    rng = np.random.default_rng(0)
    batches = [(rng.standard_normal((2, 3, 32, 32)).astype(np.float32),
                rng.integers(0, 10, 2)) for _ in range(2)]
    loss = stepgraph.nn.functional.cross_entropy
    got = trained(monkeypatch, "convnext", "ConvNeXt", kw, batches, True, loss=loss,
                  memory_format="channels_last")
    want = trained(monkeypatch, "convnext", "ConvNeXt", kw, batches, False, loss=loss,
                   memory_format="channels_last")
    # a cast that pointwise fusion would have taken into a program is taken here too
    assert got[0]["cast"] == 0 < want[0]["cast"] <= got[0]["alone"] + got[0]["copy"]
    assert got[0]["alone"] >= 1
    assert got[0]["bf16 x"] >= 3 and want[0]["bf16 x"] == 0     # a stage's blocks and stem
    assert_same_training(got, want)


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_gpt_branch_bias_gradients_are_summed_by_the_norm_gradients(monkeypatch, dropout):
    """fuse_norm_grad_bias_sums, on the bundled GPT at precision="bf16": each block's attention
    and MLP c_proj end in the residual add the next norm reads, so their bias gradients are the
    column sums of the bf16 copies those norm gradients store (through resid_dropout's mask
    where there is one); the GEMMs keep only c_attn's. The same bits as the GEMMs' sums."""
    import stepgraph
    from stepgraph import api, models
    from stepgraph.compile import fuse as fuse_module

    cfg = models.GPTConfig(vocab_size=17, block_size=16, n_layer=2, n_head=2, n_embd=32,
                           dropout=dropout, bias=True)
    rng = np.random.default_rng(3)
    batches = [(rng.integers(0, 17, (3, 16)), rng.integers(0, 17, (3, 16))) for _ in range(3)]

    initial = models.GPT(cfg).state_dict()

    def train():
        model = models.GPT(cfg)
        model.load_state_dict(initial)
        step = stepgraph.compile_train_step(
            model, models.next_token_loss, model.configure_optimizers(0.1, 1e-2),
            example_inputs=batches[0], precision="bf16", seed=5)
        plan = step.plan(step.signature)
        losses = [float(step(*b)) for b in batches]
        return plan, losses, {k: np.asarray(v).copy() for k, v in model.state_dict().items()}

    got = train()
    without = tuple(p for p in fuse_module.PASSES if p is not norm_casts.fuse_norm_grad_bias_sums)
    monkeypatch.setattr(api, "fuse", lambda graph: fuse_module.fuse(graph, without))
    want = train()
    for plan, sums, joined in ((got[0], 2 * cfg.n_layer, cfg.n_layer),
                               (want[0], 0, 3 * cfg.n_layer)):
        steps = [n for i, n in enumerate(plan.steps) if plan.runs(i)]
        assert sum(bool(n.attrs.get("dx_sum")) for n in steps if n.op in NORM_GRADS) == sums
        assert sum(bool(n.attrs.get("bias_grad")) for n in steps if n.op == "matmul") == joined
    dropped = [n for n in got[0].steps if n.attrs.get("dx_sum") and
               n.attrs.get("dx_half_dropout")]
    assert len(dropped) == (2 * cfg.n_layer if dropout else 0)
    assert_same_training(got, want)
