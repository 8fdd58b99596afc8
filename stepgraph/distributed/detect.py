"""Which launcher started this process, and where its ranks meet: `detect_launch()`.

    torchrun      TORCHELASTIC_RUN_ID with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT
                  (GROUP_RANK the node). Its agent serves a TCPStore on MASTER_ADDR:MASTER_PORT
                  when TORCHELASTIC_USE_AGENT_STORE=True (torch >= 2.3): every rank connects
                  to it as a client (store "torch"); no rank binds MASTER_PORT then.
    stepgraph     `stepgraph launch`, or anything else that sets RANK, WORLD_SIZE and
                  MASTER_PORT: rank 0 serves stepgraph's own store (store.py) there.
    slurm         `srun`: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID; the master
                  is MASTER_ADDR or the first host of SLURM_NODELIST; port MASTER_PORT or
                  DEFAULT_PORT. Rank 0 serves stepgraph's store there.
    mpi           `mpirun`: OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK (Open MPI) or PMI_RANK/
                  PMI_SIZE with MPI_LOCALRANKID or PMI_LOCAL_RANK (MPICH, Intel MPI); MPI
                  names no master, so MASTER_ADDR is required; port as Slurm's.

torchrun's variables win over Slurm's and MPI's, so `srun torchrun ...` is a torchrun run.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import DistributedError

DEFAULT_PORT = 29517           # Slurm and MPI runs without MASTER_PORT
LAUNCHERS = ("single", "torchrun", "stepgraph", "slurm", "mpi")
STORES = ("none", "own", "torch")     # none: a world of one; own: rank 0 serves store.py's


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the run, as its launcher says: `rank` of `world_size`,
    `local_rank` on its node (its GPU), the `master_addr`:`master_port` where the ranks meet,
    and the store there: "own" (rank 0 serves stepgraph's), "torch" (torchrun's agent serves
    a torch TCPStore; keys go under `namespace`), "none" (a world of one)."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str = "stepgraph"
    store: str = "own"
    node_rank: int = 0
    namespace: str = ""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "DistEnv | None":
        """detect_launch(environ), for callers that know DistEnv."""
        return detect_launch(environ)

    def check(self) -> None:
        if self.world_size < 1:
            raise DistributedError(f"WORLD_SIZE must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise DistributedError(f"RANK must be in [0, {self.world_size}), got {self.rank}")
        if self.local_rank < 0:
            raise DistributedError(f"LOCAL_RANK must be >= 0, got {self.local_rank}")
        if not 0 < self.master_port < 65536:
            raise DistributedError(f"MASTER_PORT must be in [1, 65535], got {self.master_port}")
        if self.store not in STORES:
            raise DistributedError(f"store must be one of {STORES}, got {self.store!r}")


def detect_launch(environ: Mapping[str, str] | None = None) -> DistEnv | None:
    """This process's DistEnv from `environ` (default os.environ), or None when no launcher
    started it. DistributedError names a missing or malformed variable."""
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" in env:
        out = _torchrun(env) if "TORCHELASTIC_RUN_ID" in env else _plain(env)
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        out = _slurm(env)
    elif "OMPI_COMM_WORLD_RANK" in env or "PMI_RANK" in env:
        out = _mpi(env)
    else:
        return None
    out.check()
    return out


def _int(env: Mapping[str, str], name: str, default: str | None = None,
         why: str = "the launcher sets it") -> int:
    raw = env.get(name, default)
    if raw is None:
        raise DistributedError(f"{name} is not set ({why})")
    try:
        return int(raw)
    except ValueError:
        raise DistributedError(f"{name} must be an integer, got {raw!r}") from None


def _plain(env: Mapping[str, str]) -> DistEnv:
    why = "WORLD_SIZE is set; the launcher sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_PORT"
    rank = _int(env, "RANK", why=why)
    return DistEnv(rank, _int(env, "WORLD_SIZE"), _int(env, "LOCAL_RANK", str(rank)),
                   env.get("MASTER_ADDR", "127.0.0.1"), _int(env, "MASTER_PORT", why=why),
                   "stepgraph", "own", _int(env, "GROUP_RANK", "0"))


def _torchrun(env: Mapping[str, str]) -> DistEnv:
    why = "torchrun sets it"
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    namespace = (f"stepgraph/{env['TORCHELASTIC_RUN_ID']}/"
                 f"{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/")
    return DistEnv(_int(env, "RANK", why=why), _int(env, "WORLD_SIZE", why=why),
                   _int(env, "LOCAL_RANK", why=why), env.get("MASTER_ADDR", "127.0.0.1"),
                   _int(env, "MASTER_PORT", why=why), "torchrun",
                   "torch" if agent else "own", _int(env, "GROUP_RANK", "0"),
                   namespace if agent else "")


def _master(env: Mapping[str, str], fallback: str | None, launcher: str) -> tuple[str, int]:
    addr = env.get("MASTER_ADDR", fallback)
    if not addr:
        raise DistributedError(f"{launcher} names no master host: set MASTER_ADDR to the host "
                               "of rank 0 (and MASTER_PORT, default "
                               f"{DEFAULT_PORT}), e.g. mpirun -x MASTER_ADDR=node01 ...")
    return addr, _int(env, "MASTER_PORT", str(DEFAULT_PORT))


def _slurm(env: Mapping[str, str]) -> DistEnv:
    nodes = env.get("SLURM_NODELIST") or env.get("SLURM_JOB_NODELIST")
    addr, port = _master(env, slurm_hosts(nodes)[0] if nodes else None, "Slurm")
    rank = _int(env, "SLURM_PROCID")
    return DistEnv(rank, _int(env, "SLURM_NTASKS"), _int(env, "SLURM_LOCALID", str(rank)),
                   addr, port, "slurm", "own", _int(env, "SLURM_NODEID", "0"))


def _mpi(env: Mapping[str, str]) -> DistEnv:
    addr, port = _master(env, None, "mpirun")
    if "OMPI_COMM_WORLD_RANK" in env:
        rank, world = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
        local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK")
    else:
        rank, world = _int(env, "PMI_RANK"), _int(env, "PMI_SIZE")
        local_name = next((n for n in ("MPI_LOCALRANKID", "PMI_LOCAL_RANK", "LOCAL_RANK")
                           if n in env), None)
        if local_name is None:
            raise DistributedError("mpirun set PMI_RANK but no local rank (MPI_LOCALRANKID or "
                                   "PMI_LOCAL_RANK): set LOCAL_RANK, this rank's GPU index")
        local = _int(env, local_name)
    return DistEnv(rank, world, local, addr, port, "mpi", "own")


_RANGE = re.compile(r"\[([^\]]*)\]")


def slurm_hosts(nodelist: str) -> list[str]:
    """The hosts of a Slurm node list, in order: "node[01-03,07],gpu5" -> node01, node02,
    node03, node07, gpu5 (zero padding kept; several bracket groups in one name expand
    as a product, as Slurm's do)."""
    hosts, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist + ","):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            if i > start:
                hosts.extend(_expand(nodelist[start:i]))
            start = i + 1
    if depth != 0 or not hosts:
        raise DistributedError(f"cannot read the Slurm node list {nodelist!r}")
    return hosts


def _expand(name: str) -> list[str]:
    match = _RANGE.search(name)
    if match is None:
        return [name]
    head, tail = name[:match.start()], name[match.end():]
    out = []
    for part in match.group(1).split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise DistributedError(f"cannot read the Slurm node range [{match.group(1)}]")
        for n in range(int(low), int(high or low) + 1):
            out.extend(head + str(n).zfill(len(low)) + rest for rest in _expand(tail))
    return out
