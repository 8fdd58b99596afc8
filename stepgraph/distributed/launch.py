"""`stepgraph launch --gpus N -- CMD...`: start N copies of CMD, one per GPU, as torchrun does.

Each process gets RANK, LOCAL_RANK (0..N-1), WORLD_SIZE (N), MASTER_ADDR and MASTER_PORT (a
free port unless given), LOCAL_WORLD_SIZE, and NCCL_NVLS_ENABLE=0 (NVLink multicast stays off:
see DESIGN.md). The launcher forwards SIGINT, SIGTERM and SIGHUP to every process; when one
process fails, the others are stopped (SIGTERM, then SIGKILL after a grace period) and the
launcher exits with the failed one's code (a rank that ended because a peer died, status 75,
is reported only when no other failure is seen). Processes die with the launcher
(PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import StepgraphError
from .group import FAULT_EXIT_CODE, TIMEOUT_ENV

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
GRACE_S = 5.0              # after SIGTERM, before SIGKILL
POLL_S = 0.05
DEFAULT_ADDR = "127.0.0.1"
_PR_SET_PDEATHSIG = 1


class LaunchError(StepgraphError, ValueError):
    """Launcher arguments that cannot work."""


@dataclass(frozen=True)
class LaunchArgs:
    nprocs: int
    command: tuple[str, ...]
    master_addr: str = DEFAULT_ADDR
    master_port: int = 0          # 0: a free port
    timeout: float | None = None  # seconds; exported as STEPGRAPH_DIST_TIMEOUT


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stepgraph launch", usage="stepgraph launch --gpus N [options] -- CMD [ARGS...]",
        description="Start N processes of CMD for data-parallel training, one per GPU, with "
        "torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); rank 0 "
        "serves the rendezvous store. A script runs unchanged under torchrun, Slurm's srun "
        "or mpirun too (stepgraph.distributed.detect_launch).",
        epilog="example: stepgraph launch --gpus 4 -- python train.py --epochs 5")
    parser.add_argument("--gpus", type=int, required=True, help="processes to start (one a GPU)")
    parser.add_argument("--master-addr", default=DEFAULT_ADDR,
                        help=f"where rank 0 serves the rendezvous store (default {DEFAULT_ADDR})")
    parser.add_argument("--master-port", type=int, default=0,
                        help="its port (default: a free one)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds a rank waits for the others before failing (default "
                        f"${TIMEOUT_ENV} or 120)")
    return parser


def parse_launch_args(argv: Sequence[str]) -> LaunchArgs:
    """Options before `--`, the command after it. LaunchError (or argparse's SystemExit for
    malformed options) says what is wrong."""
    argv = list(argv)
    if "--" not in argv:
        if "-h" in argv or "--help" in argv:
            build_parser().parse_args(["--help"])      # prints the usage; SystemExit(0)
        raise LaunchError("give the command to run after `--`: stepgraph launch --gpus 2 -- "
                          "python train.py")
    cut = argv.index("--")
    options, command = argv[:cut], argv[cut + 1:]
    args = build_parser().parse_args(options)
    if not command:
        raise LaunchError("no command after `--`")
    if args.gpus < 1:
        raise LaunchError(f"--gpus must be >= 1, got {args.gpus}")
    if not 0 <= args.master_port < 65536:
        raise LaunchError(f"--master-port must be in [0, 65535], got {args.master_port}")
    if args.timeout is not None and not args.timeout > 0:
        raise LaunchError(f"--timeout must be positive, got {args.timeout}")
    return LaunchArgs(args.gpus, tuple(command), args.master_addr, args.master_port,
                      args.timeout)


def free_port(addr: str = DEFAULT_ADDR) -> int:
    """A TCP port nothing listens on now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def worker_env(base: Mapping[str, str], rank: int, nprocs: int, addr: str, port: int,
               timeout: float | None = None) -> dict[str, str]:
    """The environment of process `rank`: `base` plus the launch variables."""
    env = dict(base)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs),
               LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR=addr, MASTER_PORT=str(port),
               NCCL_NVLS_ENABLE="0")
    if timeout is not None:
        env[TIMEOUT_ENV] = repr(float(timeout))
    return env


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the launcher dies (Linux)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
    except Exception:   # not Linux: the launcher's own handlers still stop the processes
        pass


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _stop(procs: list[subprocess.Popen], grace: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def launch(args: LaunchArgs, env: Mapping[str, str] | None = None, grace: float = GRACE_S,
           log=None) -> int:
    """Run args.nprocs processes of args.command to the end; the exit code: 0 when all
    succeeded, else the first failure's (128 + signal number for a signal)."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    base = os.environ if env is None else env
    port = args.master_port or free_port(args.master_addr)
    received: list[int] = []

    def forward(signum, frame):
        received.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    procs: list[subprocess.Popen] = []
    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        for rank in range(args.nprocs):
            procs.append(subprocess.Popen(
                list(args.command), start_new_session=True, preexec_fn=_die_with_parent,
                env=worker_env(base, rank, args.nprocs, args.master_addr, port, args.timeout)))
        return _supervise(procs, received, grace, log)
    except OSError as err:
        raise LaunchError(f"cannot start {args.command[0]!r}: {err}") from err
    finally:
        _stop(procs, grace)
        for s, handler in previous.items():
            signal.signal(s, handler)


def _supervise(procs: list[subprocess.Popen], received: list[int], grace: float, log) -> int:
    """Wait for every process; on the first failure stop the others."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            # A rank that ended because a peer died (FAULT_EXIT_CODE) is not the cause:
            # report the peer when both are seen at once.
            rank, code = next(((r, c) for r, c in failed if c != FAULT_EXIT_CODE), failed[0])
            if not received and any(c is None for c in codes):
                log(f"stepgraph launch: rank {rank} (pid {procs[rank].pid}) exited with code "
                    f"{code}; stopping the other ranks")
            _stop(procs, grace)
            return _exit_code(code)
        if received:     # forwarded; the processes decide how to end, within the grace
            deadline = time.monotonic() + grace
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                time.sleep(POLL_S)
            _stop(procs, 0.0)
            codes = [p.poll() for p in procs]
            bad = [c for c in codes if c != 0]
            return _exit_code(bad[0]) if bad else 128 + received[0]
        if all(c == 0 for c in codes):
            return 0
        time.sleep(POLL_S)


def main(argv: Sequence[str]) -> int:
    """`stepgraph launch` (cli.py delegates here); 2 on bad arguments."""
    try:
        args = parse_launch_args(argv)
        return launch(args)
    except LaunchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except SystemExit as exit_:        # argparse: --help (0) or bad options (2)
        return exit_.code if isinstance(exit_.code, int) else 2
