"""`stepgraph train --model gpt` and `stepgraph sample` on the GPU with a tiny GPT: the loop
trains from device-resident batches through the captured step, a resume continues bit for
bit, sampling is reproducible by seed, and the bench workload's stepgraph rows run."""
from __future__ import annotations

import functools
import random

import numpy as np
import pytest

from stepgraph import train as train_gpt_module
from stepgraph.sample import SampleConfig, sample
from stepgraph.train import GPTTrainConfig
from stepgraph.train import train as train_gpt
from tests.cuda.gpu import require_gpu
from tests.helpers import run_interrupted

pytestmark = pytest.mark.cuda
require_gpu()

TINY = dict(batch_size=8, block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.1,
            eval_batches=4, device="cuda", progress=False)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while seven wizards hex mice".split()
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))).capitalize() + "."
             for _ in range(400)]
    path = tmp_path_factory.mktemp("text") / "sentences.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_gpt_trains_and_resumes_exactly_on_cuda(tmp_path, text_file, monkeypatch):
    config = functools.partial(GPTTrainConfig, text_file=str(text_file), steps=40,
                               eval_interval=20, **TINY)
    straight = train_gpt(config(out=str(tmp_path / "straight")), log=lambda _: None)
    assert straight.device == "cuda" and straight.step.use_graph
    first, last = straight.history
    assert np.isfinite(last.val_loss) and last.val_loss < first.val_loss

    run_interrupted(monkeypatch, train_gpt_module, "train_interval",
                    lambda session, start, stop, bar: start == 20,
                    lambda: train_gpt(config(out=str(tmp_path / "split")), log=lambda _: None))
    resumed = train_gpt(config(out=str(tmp_path / "split"), resume=True), log=lambda _: None)
    expected, got = straight.step.state_dict(), resumed.step.state_dict()
    assert expected.keys() == got.keys()
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)

    texts = [sample(SampleConfig(str(tmp_path / "split"), prompt="The ", tokens=50, seed=seed,
                                 device="cuda")) for seed in (1, 1, 2)]
    assert len(texts[0]) == 50 and texts[0] == texts[1] != texts[2]


@pytest.mark.parametrize("peer_name", ["stepgraph eager", "stepgraph graph"])
def test_gpt_bench_rows_run_on_cuda(peer_name):
    from stepgraph.bench import harness
    from stepgraph.bench import workloads as wl
    from stepgraph.bench.peers import select_peers

    config = harness.BenchConfig(device="cuda", tiny=True, batches=2)
    spec = harness.make_spec(wl.get_workload("gpt", tiny=True), "fp32", config)
    losses = harness.loss_curve(select_peers([peer_name])[0], spec, 8)
    assert all(np.isfinite(losses)), losses
