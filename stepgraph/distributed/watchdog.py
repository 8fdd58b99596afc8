"""A rank's watch on the others while NCCL averages its gradients.

A GPU step never waits on the store: its all-reduces run inside the captured graph, so a peer
that dies (kill -9, a crash) would leave every other rank waiting in an NCCL kernel forever.
The watchdog thread holds its own connection to stepgraph's store and waits there for the
server's news that a registered rank's connection dropped (store.py, RankDied), or for the
store itself to vanish (rank 0 died). Then it hands a DistributedError naming the dead rank
to `on_fault` (ProcessGroup: abort the communicator, report, exit). Under torchrun there is
no watchdog: its agent stops every worker when one fails.
"""
from __future__ import annotations

import threading
from typing import Callable

from ..errors import DistributedError
from .store import RankDied, StoreClient, StoreError, StoreTimeout

WATCH_KEY = "watchdog/never-set"     # waited for, never set: only a death ends the wait
POLL_S = 5.0                         # a wait's length; a stopped watchdog ends at once anyway


class Watchdog:
    """Watches the store at host:port from a daemon thread until `stop()`."""

    def __init__(self, rank: int, world_size: int, host: str, port: int, timeout: float,
                 on_fault: Callable[[DistributedError], None]):
        self.rank, self.world_size, self._on_fault = rank, world_size, on_fault
        self._client = StoreClient(host, port, timeout)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="stepgraph-watchdog")
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                self._client.get(WATCH_KEY, POLL_S)
                continue
            except StoreTimeout:
                continue
            except RankDied as err:
                what = f"rank(s) {err.ranks} of {self.world_size} died (killed or crashed)"
            except StoreError:
                what = "rank 0 died (its store is gone)"
            if not self._stopped.is_set():
                self._on_fault(DistributedError(f"rank {self.rank}: {what} during the run; "
                                                "the NCCL communicator is aborted"))
            return

    def stop(self) -> None:
        """End the watch (at a clean exit); on_fault is not called after this returns."""
        self._stopped.set()
        self._client.close(leave=False)
        self._thread.join(POLL_S)
