"""A small TCP key-value store: the rendezvous of a data-parallel run and the channel of its
host-side collectives (the CPU backend's all-reduce, the NCCL id, barriers).

Rank 0 serves it from a daemon thread on MASTER_ADDR:MASTER_PORT; every rank (rank 0 too)
talks to it through one `StoreClient` connection. Values are bytes. Every wait has a timeout:
a `get` of a key that never appears fails with StoreTimeout, never hangs. A lost connection
(rank 0 exited) is a StoreError naming the store's address.

A rank registers its connection (`register`). When a registered connection drops without
`close()` (the process was killed, or crashed), the server marks that rank dead, and every
`get` waiting then, or later, fails at once with RankDied naming it, instead of waiting out
the timeout.

Under torchrun the ranks use the TCPStore that torchrun's agent serves instead
(`TorchStoreClient`: the same methods, keys under the run's namespace).

Wire format, one request and one reply per round trip:
    request  op (1 byte) | key length (u32) | key (utf-8) | value length (u64) | value | wait (f64)
    reply    status (1 byte: 0 ok, 1 missing, 2 a rank died: payload "1,3") | payload length
             (u64) | payload
"""
from __future__ import annotations

import socket
import socketserver
import struct
import threading
import time

from ..errors import DistributedError

SET, GET, ADD, DELETE, REGISTER, LEAVE = 1, 2, 3, 4, 5, 6
OK, MISSING, DEAD = 0, 1, 2
DEAD_PREFIX = "__dead__/"
_REQUEST = struct.Struct("!BI")
_VALUE = struct.Struct("!Q")
_WAIT = struct.Struct("!d")
_REPLY = struct.Struct("!BQ")
_INT = struct.Struct("!q")
CONNECT_RETRY_S = 0.05       # between attempts to reach a store that is not up yet
REPLY_MARGIN_S = 30.0        # a reply may take the server's wait plus this long


class StoreError(DistributedError):
    """The store cannot be reached or answered something unexpected."""


class StoreTimeout(StoreError):
    """A key did not appear within the timeout."""


class RankDied(StoreError):
    """A rank's connection to the store dropped without leaving: the process is gone."""

    def __init__(self, ranks: list[int], key: str):
        self.ranks = ranks
        super().__init__(f"rank(s) {ranks} died (connection to the store dropped without "
                         f"leaving) while waiting for {key!r}")


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


class _Table:
    """The server's keys, and a condition that wakes waiting readers when one is set."""

    def __init__(self):
        self.values: dict[str, bytes] = {}
        self.present: set[int] = set()     # ranks registered, not yet left nor dead
        self.changed = threading.Condition()

    def handle(self, op: int, key: str, value: bytes, wait: float) -> tuple[int, bytes]:
        with self.changed:
            if op == SET:
                self.values[key] = value
                self.changed.notify_all()
                return OK, b""
            if op == ADD:
                total = _INT.unpack(self.values.get(key, _INT.pack(0)))[0]
                total += _INT.unpack(value)[0]
                self.values[key] = _INT.pack(total)
                self.changed.notify_all()
                return OK, self.values[key]
            if op == GET:
                deadline = time.monotonic() + wait
                while key not in self.values:
                    dead = self.dead()
                    if dead:
                        return DEAD, ",".join(map(str, dead)).encode()
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return MISSING, b""
                    self.changed.wait(left)
                return OK, self.values[key]
            if op == DELETE:
                for k in value.decode().split("\n"):
                    self.values.pop(k, None)
                return OK, b""
        raise StoreError(f"unknown store operation {op}")

    def dead(self) -> list[int]:
        return sorted(int(k[len(DEAD_PREFIX):]) for k in self.values
                      if k.startswith(DEAD_PREFIX))

    def join(self, rank: int) -> None:
        with self.changed:
            self.present.add(rank)

    def leave(self, rank: int | None) -> None:
        with self.changed:
            self.present.discard(rank)
            self.changed.notify_all()

    def lost(self, rank: int | None) -> None:
        """A connection ended: its rank, if it registered and did not leave, is dead."""
        if rank is not None:
            self.leave(rank)
            self.handle(SET, f"{DEAD_PREFIX}{rank}", b"", 0.0)

    def wait_until_empty(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self.changed:
            while self.present and time.monotonic() < deadline:
                self.changed.wait(max(0.0, deadline - time.monotonic()))


class _Handler(socketserver.BaseRequestHandler):
    def handle(self):
        sock, table = self.request, self.server.table
        rank = None          # the rank this connection registered as, until it leaves
        while True:
            try:
                op, key_len = _REQUEST.unpack(_recv_exact(sock, _REQUEST.size))
                key = _recv_exact(sock, key_len).decode()
                (value_len,) = _VALUE.unpack(_recv_exact(sock, _VALUE.size))
                value = _recv_exact(sock, value_len)
                (wait,) = _WAIT.unpack(_recv_exact(sock, _WAIT.size))
                if op == REGISTER:
                    rank = int(value.decode())
                    table.join(rank)
                    status, payload = OK, b""
                elif op == LEAVE:
                    table.leave(rank)
                    rank, status, payload = None, OK, b""
                else:
                    status, payload = table.handle(op, key, value, wait)
                sock.sendall(_REPLY.pack(status, len(payload)) + payload)
            except (ConnectionError, OSError):
                table.lost(rank)
                return


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class StoreServer:
    """The store, served from a daemon thread of this process until `close()`."""

    def __init__(self, host: str, port: int):
        try:
            self._server = _Server((host, port), _Handler)
        except OSError as err:
            raise StoreError(f"cannot serve the store on {host}:{port} ({err}); is "
                             "MASTER_PORT in use by another run?") from err
        self._server.table = _Table()
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.05}, daemon=True,
                                        name="stepgraph-store")
        self._thread.start()

    def close(self, linger: float = 0.0) -> None:
        """Stop serving, after waiting up to `linger` seconds for every registered rank to
        leave or die (so that none loses the store while it still needs it, e.g. to learn
        which rank died)."""
        self._server.table.wait_until_empty(linger)
        self._server.shutdown()
        self._server.server_close()


class StoreClient:
    """One connection to the store. Thread-safe: requests are serialised."""

    def __init__(self, host: str, port: int, timeout: float):
        self.address = f"{host}:{port}"
        self.timeout = float(timeout)
        self._lock = threading.Lock()
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                self._sock = socket.create_connection((host, port), timeout=self.timeout)
                break
            except OSError as err:
                if time.monotonic() >= deadline:
                    raise StoreTimeout(
                        f"could not reach rank 0's store at {self.address} within "
                        f"{self.timeout:g} s: rank 0 never arrived ({err})") from err
                time.sleep(CONNECT_RETRY_S)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _request(self, op: int, key: str, value: bytes = b"", wait: float = 0.0):
        raw = key.encode()
        message = (_REQUEST.pack(op, len(raw)) + raw + _VALUE.pack(len(value)) + value
                   + _WAIT.pack(max(0.0, wait)))
        with self._lock:
            try:
                self._sock.settimeout(wait + REPLY_MARGIN_S)
                self._sock.sendall(message)
                status, length = _REPLY.unpack(_recv_exact(self._sock, _REPLY.size))
                payload = _recv_exact(self._sock, length)
            except (ConnectionError, OSError) as err:
                raise StoreError(f"lost the connection to the store at {self.address} "
                                 f"({err}): rank 0, which serves it, is gone (killed, "
                                 "crashed or finished)") from err
        return status, payload

    def set(self, key: str, value: bytes) -> None:
        self._request(SET, key, bytes(value))

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value of `key`, waiting up to `timeout` seconds (default: the client's) for
        it to be set; StoreTimeout when it is not."""
        wait = self.timeout if timeout is None else timeout
        status, payload = self._request(GET, key, wait=wait)
        if status == MISSING:
            raise StoreTimeout(f"store key {key!r} was not set within {wait:g} s")
        if status == DEAD:
            raise RankDied([int(r) for r in payload.decode().split(",")], key)
        return payload

    def has(self, key: str) -> bool:
        return self._request(GET, key, wait=0.0)[0] == OK

    def add(self, key: str, amount: int = 1) -> int:
        """Add `amount` to the integer at `key` (0 when unset); the new value."""
        return _INT.unpack(self._request(ADD, key, _INT.pack(amount))[1])[0]

    def delete_keys(self, keys: list[str]) -> None:
        self._request(DELETE, "", "\n".join(keys).encode())

    def register(self, rank: int) -> None:
        """Tell the server this connection is `rank`'s: should it drop before close(), the
        rank is dead (RankDied for everyone waiting)."""
        self._request(REGISTER, "", str(rank).encode())

    def close(self, leave: bool = True) -> None:
        """Leave (a registered rank is then not dead) and close. leave=False: close at once,
        waking a `get` blocked in another thread (a watchdog's)."""
        if leave:
            try:
                self._request(LEAVE, "")
            except StoreError:      # the server is gone already: nothing to leave
                pass
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


class TorchStoreClient:
    """StoreClient's methods on the torch.distributed TCPStore that torchrun's agent serves at
    host:port, as a client (torch is installed wherever torchrun runs). Keys live under
    `namespace` (the run id and restart count), apart from the agent's own. A dead rank is
    not detected here: torchrun stops every worker when one fails."""

    def __init__(self, host: str, port: int, timeout: float, namespace: str = ""):
        from datetime import timedelta

        from torch.distributed import TCPStore

        self.address, self.timeout, self._ns = f"{host}:{port}", float(timeout), namespace
        self._timedelta = timedelta
        try:
            self._store = TCPStore(host, port, is_master=False, wait_for_workers=False,
                                   timeout=timedelta(seconds=self.timeout))
        except Exception as err:     # torch's DistNetworkError / RuntimeError / TimeoutError
            raise StoreTimeout(f"could not reach torchrun's store at {self.address} within "
                               f"{self.timeout:g} s ({err})") from err

    def _call(self, what: str, fn, *args):
        try:
            return fn(*args)
        except Exception as err:
            raise StoreError(f"torchrun's store at {self.address}: {what} failed ({err}); did "
                             "the torchrun agent exit?") from err

    def set(self, key: str, value: bytes) -> None:
        self._call("set", self._store.set, self._ns + key, bytes(value))

    def get(self, key: str, timeout: float | None = None) -> bytes:
        wait = self.timeout if timeout is None else timeout
        try:
            self._store.wait([self._ns + key], self._timedelta(seconds=max(wait, 1e-3)))
        except Exception as err:
            if self.has(key):      # set just as the wait gave up
                return self._call("get", self._store.get, self._ns + key)
            raise StoreTimeout(f"store key {key!r} was not set within {wait:g} s "
                               f"({type(err).__name__})") from None
        return self._call("get", self._store.get, self._ns + key)

    def has(self, key: str) -> bool:
        return bool(self._call("check", self._store.check, [self._ns + key]))

    def add(self, key: str, amount: int = 1) -> int:
        return int(self._call("add", self._store.add, self._ns + key, amount))

    def delete_keys(self, keys: list[str]) -> None:
        for key in keys:
            self._call("delete", self._store.delete_key, self._ns + key)

    def register(self, rank: int) -> None:
        """Nothing to do: torchrun notices a dead worker itself."""

    def close(self, leave: bool = True) -> None:
        """Drop the client (`leave` is StoreClient's: torchrun tracks its workers itself)."""
        self._store = None
