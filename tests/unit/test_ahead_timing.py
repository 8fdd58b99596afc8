"""The ahead lane (runtime/ahead.py) starts no job while a thread times on the device
(ahead.timing_on_device held, as graph.time_on_device holds it), and the timing thread can
still run a job the lane has not taken up (the lock is reentrant). No GPU."""
from __future__ import annotations

import threading
import time

from stepgraph.backends.cuda.runtime import ahead


def test_the_lane_waits_for_a_timing_to_end():
    ran = threading.Event()
    with ahead.timing_on_device():
        job = ahead.start(ahead.Job(lambda: ran.set() or "built"))
        time.sleep(0.05)                  # time enough for an idle lane to take it up
        assert not job.started() and not ran.is_set(), "the lane built during a timing"
    assert job.result() == "built"


def test_a_timing_thread_runs_a_job_the_lane_has_not_taken():
    with ahead.timing_on_device():
        job = ahead.start(ahead.Job(lambda: threading.current_thread().name))
        assert job.result() == threading.current_thread().name


def test_a_waiting_timer_goes_before_the_lanes_next_job():
    """A lock's release does not hand it over: without letting waiting timers go first, the
    lane going from job to job kept a timer waiting until its whole queue was built."""
    order, release_first = [], threading.Event()
    first = ahead.start(ahead.Job(lambda: release_first.wait(5) and order.append("job 1")))
    second = ahead.start(ahead.Job(lambda: order.append("job 2")))
    while not first.started():
        time.sleep(0.001)

    def timer():
        with ahead.timing_on_device():
            order.append("timed")

    t = threading.Thread(target=timer)
    t.start()
    time.sleep(0.02)                      # the timer waits for job 1
    release_first.set()
    t.join(5)
    second.result()
    assert order == ["job 1", "timed", "job 2"]


def test_a_job_waiting_for_another_process_lets_a_timing_run():
    """While a lane job waits for a build worker (waiting_elsewhere) it holds no GIL: a
    timing goes ahead rather than waiting for the worker's answer too."""
    order, answer = [], threading.Event()

    def waits_for_a_worker():
        with ahead.waiting_elsewhere():
            answer.wait(5)
        order.append("job")

    job = ahead.start(ahead.Job(waits_for_a_worker))
    while not job.started():
        time.sleep(0.001)
    with ahead.timing_on_device():
        order.append("timed")
    answer.set()
    job.result()
    assert order == ["timed", "job"]


def test_waiting_elsewhere_off_the_lane_changes_nothing():
    with ahead.timing_on_device():
        with ahead.waiting_elsewhere():
            pass
        job = ahead.start(ahead.Job(lambda: "built"))
        time.sleep(0.05)
        assert not job.started()          # the timing still holds the lane off
    assert job.result() == "built"
