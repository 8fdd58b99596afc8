"""The `stepgraph` command line: `stepgraph train [options]`."""
from __future__ import annotations

import argparse
import sys

from .errors import StepgraphError

DESCRIPTION = "stepgraph: compile a whole training step once, run each step as one call."


def run_bench(argv: list[str]) -> int:
    from .bench.harness import main as bench_main

    return bench_main(argv)


def run_profile(argv: list[str]) -> int:
    from .profile import main as profile_main

    return profile_main(argv)


# Commands with their own argument parsers: everything after the name is passed on.
DELEGATED = {"bench": (run_bench, "time a training step against PyTorch, JAX, tinygrad (GPU)"),
             "profile": (run_profile, "per-op device times of a training step (GPU)")}


def build_parser() -> argparse.ArgumentParser:
    from .train import DATASETS, DEVICES, MODELS

    parser = argparse.ArgumentParser(prog="stepgraph", description=DESCRIPTION)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in DELEGATED.items():
        commands.add_parser(name, help=help_text, add_help=False)
    train = commands.add_parser("train", help="train a model and report its test accuracy",
                                description="Train a model; write metrics.json, metrics.png "
                                "and checkpoint.safetensors into --out.")
    train.add_argument("--model", choices=MODELS, default="mlp")
    train.add_argument("--data", choices=DATASETS, default="digits",
                       help="digits: bundled 8x8 images; mnist: IDX files in --data-dir")
    train.add_argument("--data-dir", default=None,
                       help="directory holding the MNIST IDX files (default: data/mnist)")
    train.add_argument("--epochs", type=int, default=None,
                       help="total epochs (default: 20 for digits, 5 for mnist)")
    train.add_argument("--batch-size", type=int, default=None,
                       help="default: 32 for digits, 64 for mnist")
    train.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    train.add_argument("--device", choices=DEVICES, default="auto",
                       help="auto: cuda when a GPU is usable, else cpu")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--out", default=None, help="output directory (default: runs/DATA-MODEL)")
    train.add_argument("--resume", action="store_true",
                       help="continue from the checkpoint in --out up to --epochs in total")
    train.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def run_train(args: argparse.Namespace) -> int:
    from .train import TrainConfig, train

    config = TrainConfig(model=args.model, data=args.data, data_dir=args.data_dir,
                         epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                         device=args.device, seed=args.seed, out=args.out, resume=args.resume,
                         progress=not args.no_progress)
    result = train(config, log=lambda line: print(line, flush=True))
    print(f"wrote {result.out_dir}/ (metrics.json, metrics.png, checkpoint.safetensors)")
    print(f"test accuracy: {result.test_accuracy:.4f}")
    return 0


def exit_code(exit_: SystemExit) -> int:
    if exit_.code is None or isinstance(exit_.code, int):
        return exit_.code or 0
    return 2


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `stepgraph` command; returns the exit code (2 on any error)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    try:
        if argv and argv[0] in DELEGATED:
            return DELEGATED[argv[0]][0](argv[1:])
        args = parser.parse_args(argv)
    except SystemExit as exit_:     # argparse exits on --help (0) and on bad usage (2)
        return exit_code(exit_)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return run_train(args)
    except (StepgraphError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
