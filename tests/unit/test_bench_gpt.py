"""The `gpt` workload of `stepgraph bench` without a GPU: its definition against BENCHMARKS.md,
stepgraph's model against the PyTorch peer's (parameters, state_dict, logits), the tokens/s
column, and the installed peers trained a few steps on the CPU at the tiny size (each skipped
when its library is missing); without dropout they must agree step by step."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from stepgraph.bench import harness
from stepgraph.bench import workloads as wl
from stepgraph.bench.peers import select_peers
from tests.unit.bench_support import bench_config, can_run, peer_or_skip


def _without_dropout(workload: wl.Workload) -> wl.Workload:
    return dataclasses.replace(workload, model=dataclasses.replace(workload.model, dropout=0.0))


def test_gpt_workload_matches_benchmarks_md():
    gpt = wl.get_workload("gpt")
    assert gpt.model == wl.GPT(vocab_size=65, block_size=256, n_layer=6, n_head=6, n_embd=384,
                               dropout=0.2, bias=True)
    assert (gpt.batch, gpt.input_shape, gpt.tokens_per_step) == (64, (64, 256), 64 * 256)
    assert gpt.loss == "cross_entropy"
    assert gpt.optimizer == wl.OptimizerSpec("adamw", lr=1e-3, betas=(0.9, 0.99),
                                             weight_decay=0.1, decay_matrices_only=True,
                                             max_grad_norm=1.0)
    c, layers = 384, 6
    per_block = 4 * c + (3 * c * c + 3 * c) + (c * c + c) + (4 * c * c + 4 * c) + (4 * c * c + c)
    assert wl.parameter_count(gpt) == 65 * c + 256 * c + layers * per_block + 2 * c == 10_770_816
    linear = layers * (3 + 1 + 4 + 4) * c * c + 65 * c
    assert wl.flops_per_step(gpt) == 6 * 64 * 256 * linear + 12 * layers * 64 * 256 ** 2 * c
    assert wl.get_workload("mlp").tokens_per_step is None and "gpt" not in wl.DEFAULT_WORKLOADS


def test_gpt_batches_and_initial_parameters():
    gpt = wl.get_workload("gpt", tiny=True)
    batch = wl.make_batches(gpt, 2, seed=0)[1]
    assert batch.x.shape == batch.y.shape == (4, 8) and batch.x.dtype == np.int32
    np.testing.assert_array_equal(batch.x[:, 1:], batch.y[:, :-1])
    assert batch.x.max() < gpt.classes
    named = wl.named_parameters(wl.initial_parameters(wl.get_workload("gpt"), seed=0))
    assert named["lm_head.weight"] is named["transformer.wte.weight"]
    assert abs(named["transformer.wte.weight"].std() - 0.02) < 1e-3
    assert abs(named["transformer.h.5.mlp.c_proj.weight"].std() - 0.02 / np.sqrt(12)) < 1e-4
    assert np.all(named["transformer.h.0.ln_1.weight"] == 1)
    assert np.all(named["transformer.h.0.attn.c_attn.bias"] == 0)


@pytest.mark.parametrize("tiny", [False, True])
def test_stepgraph_and_torch_gpts_have_the_same_parameters(tiny):
    pytest.importorskip("torch")
    from stepgraph.bench.peers import stepgraph_runner, torch_gpt
    workload = wl.get_workload("gpt", tiny)
    ours = stepgraph_runner.build_model(workload)
    theirs = torch_gpt.gpt_model(workload, wl.initial_parameters(workload))
    unique = {id(p): p for _, p in ours.named_parameters()}
    ours_count = sum(int(np.prod(p.shape)) for p in unique.values())
    assert ours_count == sum(p.numel() for p in theirs.parameters()) \
        == wl.parameter_count(workload)
    assert list(ours.state_dict()) == list(theirs.state_dict())


def test_torch_gpt_state_dict_loads_and_gives_the_same_logits():
    torch = pytest.importorskip("torch")
    import stepgraph as sg
    from stepgraph.bench.peers import stepgraph_runner, torch_gpt
    workload = wl.get_workload("gpt", tiny=True)
    theirs = torch_gpt.gpt_model(workload, wl.initial_parameters(workload, seed=3)).eval()
    state = {k: v.detach().numpy().copy() for k, v in theirs.state_dict().items()}
    ours = stepgraph_runner.build_model(workload)
    ours.load_state_dict(state)
    for key, value in ours.state_dict().items():
        np.testing.assert_array_equal(value, state[key], err_msg=key)
    x = wl.make_batches(workload, 1, seed=5)[0].x
    predict = sg.compile_predict(ours, example_inputs=(x,), device="cpu")
    with torch.no_grad():
        expected = theirs(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(sg.to_numpy(predict(x)), expected, rtol=1e-4, atol=1e-5)


def test_table_has_a_tokens_column_for_gpt():
    rows = [harness.PeerResult("gpt", "fp32", "stepgraph graph", "ok", is_stepgraph=True),
            harness.PeerResult("gpt", "fp32", "jax jit", "failed", reason="RuntimeError: x")]
    timing = harness.Timing([1000.0, 1000.0], 10, 2.0)
    harness._record_timing(rows[0], timing, wl.get_workload("gpt"))
    rows[0].setup_s = 1.0
    assert rows[0].tokens_per_s == pytest.approx(64 * 256 / 1e-3)
    report = harness.BenchReport("2026-01-01", "Fake GPU", "host", "3.12", {}, bench_config(), {},
                                 rows)
    lines = harness.render_table(report).splitlines()
    assert "tokens/s" in lines[2] and "16,384,000" in lines[4]
    assert "tokens/s" in harness.describe_result(rows[0])
    plain = harness.BenchReport("2026-01-01", "Fake GPU", "host", "3.12", {}, bench_config(), {},
                                rows[1:])
    assert "tokens/s" not in harness.render_table(plain)


PEERS = ("stepgraph eager", "torch eager", "jax jit", "tinygrad jit")


@pytest.mark.parametrize("peer_name", PEERS)
def test_peer_trains_gpt_on_cpu(peer_name):
    peer = peer_or_skip(peer_name)
    spec = harness.make_spec(wl.get_workload("gpt", tiny=True), "fp32", bench_config(batches=1))
    losses = harness.loss_curve(peer, spec, 12)
    assert all(np.isfinite(losses)), losses
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.02, losses


def test_peers_agree_step_by_step_without_dropout():
    """Same init, data, tied weights, parameter groups and clipping: the same losses."""
    spec = harness.make_spec(_without_dropout(wl.get_workload("gpt", tiny=True)), "fp32",
                             bench_config(batches=1))
    curves = {name: harness.loss_curve(select_peers([name])[0], spec, 6)
              for name in PEERS if can_run(name)}
    if len(curves) < 2:
        pytest.skip("needs a second peer installed")
    reference = curves.pop("stepgraph eager")
    for name, losses in curves.items():
        np.testing.assert_allclose(losses, reference, rtol=1e-4, err_msg=name)
