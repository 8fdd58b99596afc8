"""The worker pool behind parallel cuDNN plan builds (runtime/worker_pool.py), with real
subprocesses running tests/unit/echo_worker.py."""
from __future__ import annotations

import time

import pytest

from stepgraph.backends.cuda.runtime.worker_pool import WorkerError, WorkerPool

ECHO = "tests.unit.echo_worker"


def test_requests_are_answered_in_parallel_by_at_most_size_workers():
    pool = WorkerPool(ECHO, size=2, idle_s=5.0)
    futures = [pool.submit(("sleep", 0.5)) for _ in range(4)]
    answers = [f.result(timeout=60) for f in futures]
    assert [a[1] for a in answers] == [("sleep", 0.5) * 2] * 4
    assert len({pid for pid, _ in answers}) == 2 and pool.started == 2


def test_a_failed_request_is_reported_and_its_worker_goes_on():
    pool = WorkerPool(ECHO, size=1, idle_s=5.0)
    with pytest.raises(WorkerError, match="ValueError: asked to fail"):
        pool.submit("fail").result(timeout=60)
    pid, doubled = pool.submit(21).result(timeout=60)
    assert doubled == 42 and pool.started == 1


def test_a_worker_that_dies_is_reported_and_replaced():
    pool = WorkerPool(ECHO, size=1, idle_s=5.0)
    first, _ = pool.submit(1).result(timeout=60)
    with pytest.raises(WorkerError, match="exit status 3"):
        pool.submit("die").result(timeout=60)
    second, _ = pool.submit(1).result(timeout=60)
    assert second != first and pool.started == 2


def test_prints_on_a_workers_stdout_do_not_corrupt_its_answers():
    pool = WorkerPool(ECHO, size=1, idle_s=5.0)
    assert pool.submit("print").result(timeout=60)[1] == "printprint"


def test_workers_end_when_idle_and_start_again_for_new_requests():
    pool = WorkerPool(ECHO, size=2, idle_s=0.3)
    pool.submit(1).result(timeout=60)
    deadline = time.monotonic() + 10
    while pool.workers and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.workers == 0
    assert pool.submit(2).result(timeout=60)[1] == 4 and pool.started == 2
