"""The elements a block of an optimizer update or gradient norm takes (runtime/launch.py
update_chunk): 4,096 where the parameters still fill every SM with UPDATE_BLOCKS_PER_SM
blocks, smaller for small models; the update tables' plain jobs and the kernel's chunk
argument follow it. No GPU: the SM count is an H200's."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("cupy")

from stepgraph.backends.cuda import optim  # noqa: E402
from stepgraph.backends.cuda.runtime import launch  # noqa: E402
from tests.unit.test_nvrtc_compile import Fake  # noqa: E402

SMS = 132


@pytest.fixture(autouse=True)
def h200(monkeypatch):
    monkeypatch.setattr(launch, "current_sm_count", lambda: SMS)


@pytest.mark.parametrize("total,chunk", [
    (10_770_000, 4096),                          # the bundled gpt's parameters
    (4096 * 4 * SMS, 4096), (4096 * 4 * SMS - 1, 2048),
    (2048 * 4 * SMS, 2048), (2048 * 4 * SMS - 1, 1024),
    (669_706, 1024), (10, 1024), (0, 1024)])     # the mlp's; a bias alone; nothing
def test_update_chunk_keeps_every_sm_busy(total, chunk):
    assert launch.update_chunk(total) == chunk
    assert chunk in launch.UPDATE_CHUNKS


def test_update_tables_cut_the_plain_parameters_by_that_chunk(monkeypatch):
    monkeypatch.setattr(optim.cp, "asarray", np.asarray)
    for module in (optim, launch):
        monkeypatch.setattr(module, "_check", lambda *a, **k: None)
    shapes = [(2048, 1024), (1024,), (300,)]          # 2.1M elements: 4 blocks an SM at 2,048
    params = [Fake(s, ptr=0x1000000 * (i + 1)) for i, s in enumerate(shapes)]
    grads = [Fake(s, ptr=0x1000000 * (i + 4)) for i, s in enumerate(shapes)]
    tables = optim._build_update_tables("sgd_update", params, grads, [], [], [0] * 3, {})
    assert tables["chunk"] == 2048
    jobs = tables["plain"].tolist()
    assert jobs == [[0, c] for c in range(1024)] + [[1, 0]] + [[2, 0]]
