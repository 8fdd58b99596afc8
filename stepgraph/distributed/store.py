"""A small TCP key-value store: the rendezvous of a data-parallel run and the channel of its
host-side collectives (the CPU backend's all-reduce, the NCCL id, barriers).

Rank 0 serves it from a daemon thread on MASTER_ADDR:MASTER_PORT; every rank (rank 0 too)
talks to it through one `StoreClient` connection. Values are bytes. Every wait has a timeout:
a `get` of a key that never appears fails with StoreTimeout, never hangs. A lost connection
(rank 0 exited) is a StoreError naming the store's address.

Wire format, one request and one reply per round trip:
    request  op (1 byte) | key length (u32) | key (utf-8) | value length (u64) | value | wait (f64)
    reply    status (1 byte: 0 ok, 1 missing) | payload length (u64) | payload
"""
from __future__ import annotations

import socket
import socketserver
import struct
import threading
import time

from ..errors import DistributedError

SET, GET, ADD, DELETE_PREFIX = 1, 2, 3, 4
OK, MISSING = 0, 1
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
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return MISSING, b""
                    self.changed.wait(left)
                return OK, self.values[key]
            if op == DELETE_PREFIX:
                for k in [k for k in self.values if k.startswith(key)]:
                    del self.values[k]
                return OK, b""
        raise StoreError(f"unknown store operation {op}")


class _Handler(socketserver.BaseRequestHandler):
    def handle(self):
        sock, table = self.request, self.server.table
        while True:
            try:
                op, key_len = _REQUEST.unpack(_recv_exact(sock, _REQUEST.size))
                key = _recv_exact(sock, key_len).decode()
                (value_len,) = _VALUE.unpack(_recv_exact(sock, _VALUE.size))
                value = _recv_exact(sock, value_len)
                (wait,) = _WAIT.unpack(_recv_exact(sock, _WAIT.size))
                status, payload = table.handle(op, key, value, wait)
                sock.sendall(_REPLY.pack(status, len(payload)) + payload)
            except (ConnectionError, OSError):
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

    def close(self) -> None:
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
                                 f"({err}); did rank 0 exit?") from err
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
        return payload

    def has(self, key: str) -> bool:
        return self._request(GET, key, wait=0.0)[0] == OK

    def add(self, key: str, amount: int = 1) -> int:
        """Add `amount` to the integer at `key` (0 when unset); the new value."""
        return _INT.unpack(self._request(ADD, key, _INT.pack(amount))[1])[0]

    def delete_prefix(self, prefix: str) -> None:
        self._request(DELETE_PREFIX, prefix)

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass
