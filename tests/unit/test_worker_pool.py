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


def busy_with_one_queued(pool, seconds):
    """Submit a request that sleeps `seconds` and a second behind it; return both once a
    worker has taken the first up."""
    busy, queued = pool.submit(("sleep", seconds)), pool.submit(1)
    deadline = time.monotonic() + 60
    while busy.taken_at is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert busy.taken_at is not None and busy.worker_pid is not None
    return busy, queued


def test_a_request_knows_when_a_worker_took_it_up_and_wait_bounds_each_phase():
    """One worker busy on a long request: the second waits in the queue (taken_at None),
    so only its queued limit applies; the first has been taken up, so its run limit does."""
    pool = WorkerPool(ECHO, size=1, idle_s=5.0)
    busy, queued = busy_with_one_queued(pool, 3.0)
    assert queued.taken_at is None
    with pytest.raises(TimeoutError):
        queued.wait(run_s=60.0, queued_s=0.2)
    with pytest.raises(TimeoutError):
        busy.wait(run_s=0.2, queued_s=60.0)
    assert busy.wait(run_s=60.0, queued_s=60.0)[1] == ("sleep", 3.0) * 2
    assert queued.wait(run_s=60.0, queued_s=60.0)[1] == 2
    pool.close()


def test_close_kills_a_hung_worker_and_cancels_what_waits():
    """close() ends a worker in the middle of a request (its waiter gets a WorkerError), the
    queued request and any later one are cancelled."""
    pool = WorkerPool(ECHO, size=1, idle_s=5.0)
    hung, queued = busy_with_one_queued(pool, 600.0)
    start = time.monotonic()
    pool.close()
    with pytest.raises(WorkerError, match="exit status -9"):
        hung.result(timeout=30)
    assert time.monotonic() - start < 30
    assert queued.cancelled() and pool.submit(2).cancelled()
