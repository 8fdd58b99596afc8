"""Work that holds the GIL for seconds, done in parallel in worker processes: cuDNN's plan
builds of runtime-compiled engines run NVRTC inside calls that keep the GIL (two threads
building two plans took the sum of their times on an H200), so only processes overlap them.

A worker is `python -m <module>` (the module calls `serve(handler)`): each request is one
pickled object on its stdin, each answer one pickled ("ok", value) or ("error", text) on its
stdout (the worker's own fd 1 is pointed at its stderr, so a library that prints cannot
corrupt the answers). Workers are started as requests wait, at most `size`, and each ends
after `idle_s` seconds without a request: a pool holds no process (nor its CUDA context)
once its work is done. Workers are plain subprocesses, not multiprocessing's: those import
the user's __main__ again, which re-runs a training script that has no main guard.

A request's future (`Request`) knows when a worker took it up, so that a caller can tell a
long queue from a worker that hangs (`Request.wait`); `close()` ends the workers and cancels
what no worker has taken.
"""
from __future__ import annotations

import os
import pickle
import queue
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

from ....errors import StepgraphError


class WorkerError(StepgraphError):
    """A worker process failed a request or died; the text says how."""


class Request(Future):
    """The future of one request's answer, with when it was submitted and taken up."""

    def __init__(self):
        super().__init__()
        self.submitted_at = time.monotonic()
        self.taken_at: float | None = None      # when a worker took it up (None: queued)
        self.worker_pid: int | None = None

    def wait(self, run_s: float, queued_s: float):
        """The answer, waited for at most `run_s` after a worker took the request up and at
        most `queued_s` after it was submitted while none had; TimeoutError past either."""
        while True:
            now = time.monotonic()
            deadline = (self.submitted_at + queued_s if self.taken_at is None
                        else self.taken_at + run_s)
            if now >= deadline and not self.done():
                raise TimeoutError
            try:
                # in slices, so that a queued request's deadline moves once a worker takes it
                return self.result(timeout=min(max(deadline - now, 0.0), 0.25))
            except TimeoutError:
                continue


class WorkerPool:
    """Up to `size` worker processes running `python -m module` (module docstring)."""

    def __init__(self, module: str, size: int, idle_s: float = 2.0):
        self.module, self.size, self.idle_s = module, size, idle_s
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._workers = self._idle = 0
        self._processes: set[_Worker] = set()
        self.closed = False
        self.started = 0                    # processes started over the pool's life

    def submit(self, request: Any) -> Request:
        """A future of the answer to `request`."""
        future = Request()
        self._queue.put((request, future))
        with self._lock:
            if self.closed:
                future.cancel()
            elif self._queue.qsize() > self._idle and self._workers < self.size:
                self._workers += 1
                threading.Thread(target=self._serve, daemon=True,
                                 name=f"stepgraph-{self.module.rsplit('.', 1)[-1]}").start()
        return future

    def close(self) -> None:
        """End every worker process now (a hung one included) and cancel the requests no
        worker has taken up; a later submit is cancelled at once."""
        with self._lock:
            self.closed = True
            processes = list(self._processes)
        while True:
            try:
                _, future = self._queue.get_nowait()
            except queue.Empty:
                break
            future.cancel()
        for worker in processes:
            worker.kill()

    @property
    def workers(self) -> int:
        """Worker threads alive now (each owns at most one process)."""
        with self._lock:
            return self._workers

    def _serve(self) -> None:
        """One worker: its process is started at its first request and ended with it."""
        worker = None
        try:
            while True:
                with self._lock:
                    self._idle += 1
                try:
                    request, future = self._queue.get(timeout=self.idle_s)
                except queue.Empty:
                    with self._lock:
                        self._idle -= 1
                        if self._queue.empty():     # else one came as the wait ended
                            self._workers -= 1
                            return
                    continue
                with self._lock:
                    self._idle -= 1
                    if self.closed:
                        self._workers -= 1
                        future.cancel()
                        return
                if not future.set_running_or_notify_cancel():
                    continue
                if worker is None:
                    worker = _Worker(self.module)
                    with self._lock:
                        self._processes.add(worker)
                        self.started += 1
                future.taken_at, future.worker_pid = time.monotonic(), worker.process.pid
                try:
                    kind, value = worker.ask(request)
                except WorkerError as err:
                    self._end(worker)
                    worker = None
                    future.set_exception(err)
                    continue
                if kind == "ok":
                    future.set_result(value)
                else:
                    future.set_exception(WorkerError(value))
        finally:
            if worker is not None:
                self._end(worker)

    def _end(self, worker: _Worker) -> None:
        with self._lock:
            self._processes.discard(worker)
        worker.close()


class _Worker:
    """One worker process and its pipes."""

    def __init__(self, module: str):
        self.module = module
        self.stderr = tempfile.TemporaryFile()
        # the parent's import path, so that the worker imports the same stepgraph
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.process = subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self.stderr, env=env)

    def ask(self, request: Any) -> tuple[str, Any]:
        try:
            pickle.dump(request, self.process.stdin)
            self.process.stdin.flush()
            return pickle.load(self.process.stdout)
        except (OSError, EOFError, pickle.UnpicklingError) as err:
            raise WorkerError(f"worker `python -m {self.module}` ended ({type(err).__name__}"
                              f"; exit status {self._exit_status()}): {self._stderr_tail()}")

    def _exit_status(self, wait_s: float = 5.0) -> int | None:
        """The process's exit status, waited for a moment: its stdout closes just before it
        exits, so polling at once may find it still running (None where it still is)."""
        try:
            return self.process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            return None

    def _stderr_tail(self, limit: int = 2000) -> str:
        try:
            self.stderr.seek(0)
            return self.stderr.read().decode(errors="replace")[-limit:].strip()
        except OSError:
            return ""

    def kill(self) -> None:
        """End the process at once; the thread waiting for its answer gets a WorkerError."""
        try:
            self.process.kill()
        except OSError:
            pass

    def close(self) -> None:
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:
                pass
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.stderr.close()


def serve(handler: Callable[[Any], Any]) -> None:
    """A worker's loop: answer each request on stdin with handler(request), until stdin
    closes (the parent's pool ended the worker, or the parent is gone)."""
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)                       # stray prints go to stderr, not into the answers
    requests = sys.stdin.buffer
    while True:
        try:
            request = pickle.load(requests)
        except EOFError:
            return
        try:
            answer = ("ok", handler(request))
        except Exception as err:        # reported to the parent, which decides what to do
            answer = ("error", f"{type(err).__name__}: {err}")
        pickle.dump(answer, answers)
        answers.flush()
