"""The process group of a data-parallel run: who I am (RANK of WORLD_SIZE), the rendezvous
through rank 0's store, host-side collectives over that store, and the NCCL communicator.

Who started the run and where the ranks meet is detect.py's (torchrun, `stepgraph launch`,
Slurm, mpirun). Every rank calls the same collectives in the same order; each one gets the
next sequence number, which names its keys in the store.
"""
from __future__ import annotations

import atexit
import itertools
import json
import os
import sys
import threading
import time
import weakref

import numpy as np

from ..errors import DistributedError
from .detect import DistEnv
from .store import RankDied, StoreClient, StoreServer, StoreTimeout, TorchStoreClient
from .watchdog import Watchdog

DEFAULT_TIMEOUT_S = 120.0
TIMEOUT_ENV = "STEPGRAPH_DIST_TIMEOUT"
LEAVING_S = 10.0              # at most this long at exit for the other ranks
FAULT_EXIT_CODE = 75          # a rank ended because another died (EX_TEMPFAIL: run it again)
ABORT_WAIT_S = 5.0            # at most this long for ncclCommAbort before the process ends

# Groups by id: graph nodes name their group in attrs (plain data), the op impls look it up.
_GROUPS: "weakref.WeakValueDictionary[str, ProcessGroup]" = weakref.WeakValueDictionary()
_GROUP_SERIAL = itertools.count()
_WATCHED: "weakref.WeakSet[ProcessGroup]" = weakref.WeakSet()    # see _note_crashes


def default_timeout() -> float:
    """Seconds a rank waits for the others: $STEPGRAPH_DIST_TIMEOUT, else DEFAULT_TIMEOUT_S."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise DistributedError(f"{TIMEOUT_ENV} must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise DistributedError(f"{TIMEOUT_ENV} must be positive, got {raw!r}")
    return value


class ProcessGroup:
    """The ranks of one run. A world of one needs no store: its collectives are copies."""

    def __init__(self, env: DistEnv, store: StoreClient | None, server: StoreServer | None,
                 timeout: float):
        self.env, self.store, self._server, self.timeout = env, store, server, timeout
        # Unique per group, not per address: a process may make several (tests, a world of
        # one beside a stale group), and a graph names the one it was compiled with.
        self.id = (f"{env.master_addr}:{env.master_port}/rank{env.rank}/pid{os.getpid()}"
                   f"/{next(_GROUP_SERIAL)}")
        self._seq = 0
        self._nccl = None
        self._watchdog: Watchdog | None = None
        self._closed = False
        self._crashed = False
        self._graphs: list[weakref.ref] = []   # captured CUDA graphs holding our NCCL work
        _GROUPS[self.id] = self
        atexit.register(self.destroy)
        if store is not None:
            _note_crashes(self)

    rank = property(lambda self: self.env.rank)
    world_size = property(lambda self: self.env.world_size)
    local_rank = property(lambda self: self.env.local_rank)

    def __repr__(self):
        return f"ProcessGroup(rank={self.rank}, world_size={self.world_size}, id={self.id!r})"

    def _next(self, what: str) -> str:
        self._seq += 1
        return f"{what}/{self._seq}/"

    def _gather(self, prefix: str, what: str, timeout: float | None = None) -> list[bytes]:
        """The value every rank set under prefix + rank, in rank order; DistributedError
        naming the ranks that set nothing within the timeout."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        values = []
        for r in range(self.world_size):
            try:
                values.append(self.store.get(f"{prefix}{r}",
                                             max(0.0, deadline - time.monotonic())))
            except RankDied as err:
                raise self._died(err, what) from None
            except StoreTimeout:
                missing = [q for q in range(r, self.world_size)
                           if not self.store.has(f"{prefix}{q}")]
                raise DistributedError(
                    f"rank {self.rank}: {what} timed out after {timeout:g} s: rank(s) "
                    f"{missing} of {self.world_size} never arrived (exited, or stuck "
                    f"elsewhere?)") from None
        return values

    def _died(self, err: RankDied, what: str) -> DistributedError:
        return DistributedError(f"rank {self.rank}: {what} failed: rank(s) {err.ranks} of "
                                f"{self.world_size} died (killed or crashed) during the run")

    def _done(self, prefix: str, readers: int) -> None:
        """Drop a collective's keys once its last reader has read them."""
        if self.store.add(f"{prefix}done", 1) == readers:
            self.store.delete_keys([f"{prefix}{r}" for r in range(self.world_size)]
                                   + [f"{prefix}done"])

    # ---- host collectives (the store) ----------------------------------------------------

    def barrier(self, what: str = "barrier", timeout: float | None = None) -> None:
        if self.world_size == 1:
            return
        prefix = self._next("barrier")
        self.store.set(f"{prefix}{self.rank}", b"")
        self._gather(prefix, what, timeout)
        self._done(prefix, self.world_size)

    def all_reduce_mean(self, arrays: list[np.ndarray], what: str = "all_reduce",
                        round_sum=None) -> list[np.ndarray]:
        """The mean over ranks of each array (one dtype), summed in rank order, so every
        rank gets the same bits. round_sum (an elementwise rounding, e.g. to bf16): applied
        to every partial sum and to the mean, as a reduction in a narrower type is."""
        if self.world_size == 1:
            return [np.array(a, copy=True) for a in arrays]
        flat = np.concatenate([np.ascontiguousarray(a).reshape(-1) for a in arrays])
        prefix = self._next("all_reduce")
        self.store.set(f"{prefix}{self.rank}", flat.tobytes())
        parts = self._gather(prefix, what)
        self._done(prefix, self.world_size)
        total = np.frombuffer(parts[0], dtype=flat.dtype).copy()
        for part in parts[1:]:
            total += np.frombuffer(part, dtype=flat.dtype)
            if round_sum is not None:
                total = round_sum(total)
        total /= flat.dtype.type(self.world_size)
        if round_sum is not None:
            total = round_sum(total)
        return _split(total, arrays)

    def all_reduce_max(self, arrays: list[np.ndarray], what: str = "all_reduce") \
            -> list[np.ndarray]:
        """The elementwise maximum over ranks of each array (one dtype)."""
        if self.world_size == 1:
            return [np.array(a, copy=True) for a in arrays]
        flat = np.concatenate([np.ascontiguousarray(a).reshape(-1) for a in arrays])
        prefix = self._next("all_reduce_max")
        self.store.set(f"{prefix}{self.rank}", flat.tobytes())
        parts = self._gather(prefix, what)
        self._done(prefix, self.world_size)
        total = np.maximum.reduce([np.frombuffer(p, dtype=flat.dtype) for p in parts])
        return _split(total, arrays)

    def all_gather(self, array: np.ndarray, what: str = "all_gather") -> list[np.ndarray]:
        """Every rank's `array` (one shape and dtype on every rank), in rank order."""
        if self.world_size == 1:
            return [np.array(array, copy=True)]
        array = np.asarray(array, order="C")          # 0-d stays 0-d, as with one rank
        prefix = self._next("all_gather")
        self.store.set(f"{prefix}{self.rank}", array.tobytes())
        parts = self._gather(prefix, what)
        self._done(prefix, self.world_size)
        sizes = {len(p) for p in parts}
        if sizes != {array.nbytes}:
            raise DistributedError(f"{what}: ranks sent {sorted(sizes)} bytes, rank "
                                   f"{self.rank} expected {array.nbytes} (different models?)")
        return [np.frombuffer(p, array.dtype).reshape(array.shape).copy() for p in parts]

    def broadcast(self, arrays: list[np.ndarray], root: int = 0,
                  what: str = "broadcast") -> list[np.ndarray]:
        """Root's arrays on every rank (any dtypes; shapes must agree)."""
        if self.world_size == 1:
            return [np.array(a, copy=True) for a in arrays]
        prefix = self._next("broadcast")
        if self.rank == root:
            payload = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
            self.store.set(f"{prefix}{root}", payload)
            return [np.array(a, copy=True) for a in arrays]
        try:
            payload = self.store.get(f"{prefix}{root}")
        except RankDied as err:
            raise self._died(err, what) from None
        except StoreTimeout:
            raise DistributedError(f"rank {self.rank}: {what} timed out after "
                                   f"{self.timeout:g} s waiting for rank {root}") from None
        self._done(prefix, self.world_size - 1)
        out, offset = [], 0
        for a in arrays:
            a = np.asarray(a)
            out.append(np.frombuffer(payload, a.dtype, a.size, offset).reshape(a.shape).copy())
            offset += a.nbytes
        if offset != len(payload):
            raise DistributedError(f"{what}: rank {root} sent {len(payload)} bytes, rank "
                                   f"{self.rank} expected {offset} (different models?)")
        return out

    # ---- NCCL ----------------------------------------------------------------------------

    def nccl_communicator(self, device_id: int):
        """This rank's NCCL communicator on GPU `device_id`, made on the first call (every
        rank must make it: NcclCommunicator() waits for all of them). Rank 0's unique id
        travels through the store. Destroyed by destroy() (at exit)."""
        if self._nccl is not None:
            return self._nccl
        try:
            from cupy.cuda import nccl
        except ImportError as err:
            raise DistributedError(f"NCCL needs CuPy: pip install -e '.[cuda]' ({err})") from err
        if not getattr(nccl, "available", True):
            raise DistributedError("CuPy cannot load libnccl: pip install 'nvidia-nccl-cu13' "
                                   "(part of the cuda extra)")
        key = "nccl/unique_id"
        if self.rank == 0:
            # CuPy 14 gives the id as bytes (hex through the store), older CuPy as a tuple of
            # ints; each NcclCommunicator takes back the type it gave
            raw = nccl.get_unique_id()
            payload = raw.hex() if isinstance(raw, (bytes, bytearray)) else list(raw)
            self.store.set(key, json.dumps(payload).encode())
        try:
            payload = json.loads(self.store.get(key))
            uid = bytes.fromhex(payload) if isinstance(payload, str) else tuple(payload)
        except StoreTimeout:
            raise DistributedError(f"rank {self.rank}: rank 0 published no NCCL id within "
                                   f"{self.timeout:g} s") from None
        import cupy

        # The watch starts first: NcclCommunicator() waits, with no timeout, for every rank,
        # and a rank that dies before it arrives must end this one too.
        if isinstance(self.store, StoreClient) and self._watchdog is None:
            self._watchdog = Watchdog(self.rank, self.world_size, self.env.master_addr,
                                      self.env.master_port, self.timeout, self._fault)
        with cupy.cuda.Device(device_id):
            self._nccl = nccl.NcclCommunicator(self.world_size, uid, self.rank)
        return self._nccl

    def _fault(self, error: DistributedError) -> None:
        """(the watchdog's thread) A peer died: report, abort the communicator, so that
        nothing of ours waits on the dead rank, and end this process; its main thread may be
        blocked in a wait on the device that would not return."""
        print(f"stepgraph: DistributedError: {error}", file=sys.stderr, flush=True)
        _abort(self._nccl)      # NCCL may wait for our graphs (hold_graph): bounded
        os._exit(FAULT_EXIT_CODE)

    @property
    def has_nccl(self) -> bool:
        return self._nccl is not None

    def hold_graph(self, captured) -> None:
        """Note a captured CUDA graph holding this group's NCCL work (runtime/graph.py):
        destroy() releases it before the communicator, because NCCL (2.26 on) destroys or
        aborts a communicator only once every graph holding its work is gone: a graph
        still referenced at exit would hang the process there."""
        self._graphs = [ref for ref in self._graphs if ref() is not None]
        self._graphs.append(weakref.ref(captured))

    def _release_graphs(self) -> None:
        for ref in self._graphs:
            captured = ref()
            if captured is not None:
                captured.release()
        self._graphs = []

    def destroy(self) -> None:
        """Leave the run. A clean end: wait for the device (the watchdog still guards the
        wait), stop the watchdog, meet the others in a leaving barrier (at most LEAVING_S; a
        dead rank ends it at once), release the graphs holding our collectives (hold_graph),
        then destroy the NCCL communicator, or abort it when the barrier failed (a peer
        that never arrives would not take part in the teardown). A rank that crashed (an
        uncaught exception) drops its store connection first, without leaving, so that the
        others see it die and end, then releases its graphs and aborts its communicator
        without waiting for the device, whose queued collectives may wait for peers that
        will never join them. Rank 0 serves the store until every other rank has left or
        died (at most LEAVING_S)."""
        if self._closed:
            return
        self._closed = True
        comm, self._nccl = self._nccl, None
        if self._crashed:
            if self._watchdog is not None:
                self._watchdog.stop()
            if self.store is not None:
                self.store.close(leave=False)      # the others see this rank die, at once
            self._release_graphs()
            _abort(comm)
        else:
            self._leave(comm)
        if self._server is not None:
            self._server.close(min(self.timeout, LEAVING_S))
        _GROUPS.pop(self.id, None)

    def _leave(self, comm) -> None:
        """destroy() at a clean end (see there)."""
        if comm is not None:
            try:
                import cupy

                cupy.cuda.Device().synchronize()
            except Exception:   # at exit, after a failure: nothing left to report to
                pass
        if self._watchdog is not None:
            self._watchdog.stop()
        met = self.store is None
        if self.store is not None:
            try:
                self.barrier("leaving", timeout=min(self.timeout, LEAVING_S))
                met = True
            except Exception:   # a peer died or never came: leave regardless
                pass
            self.store.close()
        if comm is None:
            return
        self._release_graphs()
        if not met:
            _abort(comm)
            return
        try:
            comm.destroy()
        except Exception:
            pass


def _abort(comm, wait: float = ABORT_WAIT_S) -> None:
    """Abort an NCCL communicator (None: nothing), waiting at most `wait` seconds: the caller
    ends the process next, and an abort stuck behind a kernel must not keep it alive."""
    if comm is None:
        return

    def abort():
        try:
            comm.abort()
        except Exception:      # aborting is all that is left to do
            pass

    thread = threading.Thread(target=abort, daemon=True, name="stepgraph-nccl-abort")
    thread.start()
    thread.join(wait)


def _note_crashes(group: ProcessGroup) -> None:
    """Mark `group` crashed when the program ends on an uncaught exception other than a
    DistributedError (those report another rank's failure): its destroy() then drops the
    store connection without leaving, so the other ranks fail at once naming this one,
    instead of waiting out their timeout for collectives it will never join."""
    if not getattr(sys.excepthook, "marks_crashed_groups", False):
        previous = sys.excepthook

        def hook(kind, value, traceback):
            if not issubclass(kind, DistributedError):
                for watched in list(_WATCHED):
                    watched._crashed = True
            previous(kind, value, traceback)

        hook.marks_crashed_groups = True
        sys.excepthook = hook
    _WATCHED.add(group)


def _split(flat: np.ndarray, like: list[np.ndarray]) -> list[np.ndarray]:
    out, offset = [], 0
    for a in like:
        n = int(np.size(a))
        out.append(flat[offset:offset + n].reshape(np.shape(a)))
        offset += n
    return out


def lookup_group(group_id: str) -> ProcessGroup:
    """The live group a graph node names (attrs group)."""
    group = _GROUPS.get(group_id)
    if group is None:
        raise DistributedError(f"process group {group_id!r} is gone (destroyed, or the step "
                               "was compiled in another process)")
    return group


def rendezvous(env: DistEnv, timeout: float | None = None) -> ProcessGroup:
    """Meet the other ranks: rank 0 serves the store, every rank connects, claims its rank
    and waits (at most `timeout` seconds) until all WORLD_SIZE ranks have; DistributedError
    names the ranks that never arrived, or a rank claimed twice. The store is env.store's:
    torchrun's agent's (every rank a client; nothing binds MASTER_PORT), or stepgraph's own,
    served by rank 0."""
    timeout = default_timeout() if timeout is None else float(timeout)
    if env.world_size == 1:
        return ProcessGroup(env, None, None, timeout)
    own = env.store != "torch"
    server = StoreServer(env.master_addr, env.master_port) if own and env.rank == 0 else None
    try:
        try:
            store = (StoreClient(env.master_addr, env.master_port, timeout) if own else
                     TorchStoreClient(env.master_addr, env.master_port, timeout,
                                      env.namespace))
        except StoreTimeout as err:
            raise DistributedError(f"rank {env.rank}: rendezvous failed: {err}") from None
        if store.add(f"rendezvous/claims/{env.rank}", 1) != 1:
            store.close()
            raise DistributedError(f"rank {env.rank}: another process already claimed RANK="
                                   f"{env.rank} (two launches on one MASTER_PORT?)")
        store.register(env.rank)
        group = ProcessGroup(env, store, server, timeout)
    except BaseException:
        if server is not None:
            server.close()
        raise
    prefix = "rendezvous/rank/"
    store.set(f"{prefix}{env.rank}", json.dumps({"pid": os.getpid(),
                                                 "local_rank": env.local_rank}).encode())
    try:
        group._gather(prefix, "rendezvous")
    except DistributedError:
        group.destroy()
        raise
    return group
