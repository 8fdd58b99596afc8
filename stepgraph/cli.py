"""The `stepgraph` command line: `stepgraph train|sample|bench|profile|cache|launch [options]`."""
from __future__ import annotations

import argparse
import sys

from .errors import StepgraphError

DESCRIPTION = "stepgraph: compile a whole training step once, run each step as one call."


def run_bench(argv: list[str]) -> int:
    if any(a == "--gpus" or a.startswith("--gpus=") for a in argv):    # data-parallel scaling
        from .bench.multigpu import main as bench_main
    else:
        from .bench.harness import main as bench_main

    return bench_main(argv)


def run_profile(argv: list[str]) -> int:
    from .profile import main as profile_main

    return profile_main(argv)


def run_cache(argv: list[str]) -> int:
    from .cache import main as cache_main

    return cache_main(argv)


def run_precompile(argv: list[str]) -> int:
    from .precompile import main as precompile_main

    return precompile_main(argv)


def run_run(argv: list[str]) -> int:
    from .run_script import main as run_main

    return run_main(argv)


def run_launch(argv: list[str]) -> int:
    from .distributed.launch import main as launch_main

    return launch_main(argv)


# Commands with their own argument parsers: everything after the name is passed on.
DELEGATED = {"bench": (run_bench, "time a training step against PyTorch, JAX, tinygrad (GPU)"),
             "profile": (run_profile, "per-op device times of a training step, a bench "
                         "workload's or your own (--script) (GPU)"),
             "cache": (run_cache, "show (info) or empty (clear) the on-disk kernel choices"),
             "precompile": (run_precompile, "compile every kernel into the kernel cache once "
                            "per install, so that the first run starts warm (GPU)"),
             "launch": (run_launch, "start N processes of a command for data-parallel "
                        "training (--gpus N -- CMD ...), as torchrun does"),
             "run": (run_run, "run a PyTorch training script unchanged, with torch resolved "
                     "to stepgraph (SCRIPT.py ARGS ...)")}


def model_choice(value: str) -> str:
    """--model: a built-in model's name or a model file FILE.py:CLASS."""
    from .model_file import is_model_file
    from .train import MODELS

    if value in MODELS or is_model_file(value):
        return value
    raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from "
                                     f"{', '.join(MODELS)}, or FILE.py:CLASS)")


def build_parser() -> argparse.ArgumentParser:
    from .api import PRECISIONS
    from .train import BAD_BATCH_POLICIES, DATA, DEVICES

    from .version import __version__

    parser = argparse.ArgumentParser(prog="stepgraph", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"stepgraph {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in DELEGATED.items():
        commands.add_parser(name, help=help_text, add_help=False)
    train = commands.add_parser("train", help="train a model and report its test accuracy "
                                "(text: its validation loss)",
                                description="Train a model; write metrics.json, metrics.png "
                                "and checkpoint.safetensors into --out.")
    train.add_argument("--model", type=model_choice, default="mlp",
                       metavar="{mlp,cnn,resnet,gpt,FILE.py:CLASS}",
                       help="resnet: the CIFAR ResNet-8-style network of stepgraph.models; "
                       "gpt: a character-level GPT (nanoGPT's) on --data text; "
                       "FILE.py:CLASS: your own nn.Module class in a Python file, built with "
                       "--model-args, trained on any --data (images (N, C, H, W) -> logits "
                       "with cross-entropy; text tokens (B, T) -> logits (B, T, V))")
    train.add_argument("--model-args", default=None, metavar="JSON",
                       help="keyword arguments of a model file's class, as a JSON object "
                       "(default: none)")
    train.add_argument("--data", choices=tuple(DATA), default=None,
                       help="digits (the default for image models): bundled 8x8 images; mnist: "
                       "IDX files in --data-dir; cifar10: the CIFAR-10 batches (python or "
                       "binary version) in --data-dir; text (gpt): --text-file, or Python's "
                       "own help topics")
    train.add_argument("--data-dir", default=None,
                       help="directory holding the dataset's files (default: data/mnist, "
                       "data/cifar10)")
    train.add_argument("--epochs", type=int, default=None,
                       help="total epochs (default: 20 for digits, 5 for mnist, 20 for cifar10)")
    train.add_argument("--batch-size", type=int, default=None,
                       help="default: 32 for digits, 64 for mnist, 512 for cifar10, 64 for text")
    train.add_argument("--lr", type=float, default=None,
                       help="peak learning rate (default: 1e-3 with AdamW for mlp, cnn, gpt "
                       "and model files; 0.4 with SGD, warmup and cosine decay for resnet)")
    train.add_argument("--device", choices=DEVICES, default="auto",
                       help="auto: cuda when a GPU is usable, else cpu")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--out", default=None, help="output directory (default: "
                       "runs/DATA-MODEL); one that holds a run is refused unless --resume or "
                       "--overwrite")
    train.add_argument("--resume", action="store_true",
                       help="continue from the checkpoint in --out up to --epochs (text: "
                       "--steps) in total; refused if a setting that changes the run differs "
                       "from the checkpoint's")
    train.add_argument("--force", action="store_true",
                       help="with --resume: resume even where settings differ from the "
                       "checkpoint's (the model's state must still fit)")
    train.add_argument("--overwrite", action="store_true",
                       help="replace the run in --out (its files are replaced as this run "
                       "writes its own)")
    train.add_argument("--no-progress", action="store_true", help="no progress bars")
    train.add_argument("--on-bad-batch", choices=BAD_BATCH_POLICIES, default="raise",
                       help="a batch with labels out of range or a NaN/Inf loss or gradient: "
                       "stop naming it (raise), or skip its update and go on (skip)")
    train.add_argument("--gpus", type=int, default=None,
                       help="data-parallel over N processes, one per GPU (stepgraph launch); "
                       "--batch-size stays the global batch, split evenly across them")
    train.add_argument("--precision", choices=PRECISIONS, default=None,
                       help="fp32 (default); tf32: TF32 tensor-core matrix products (cuda); "
                       "bf16: mixed precision as PyTorch autocast, float32 master weights "
                       "(cpu: the NumPy emulation; cuda: where its bf16 kernels exist)")
    add_text_arguments(train)
    add_sample_parser(commands, DEVICES)
    return parser


# Flags of text data (--data text) and of --model gpt, with the TrainConfig field each sets
# (None: its default).
TEXT_FLAGS = {"--text-file": "text_file", "--steps": "steps", "--eval-interval": "eval_interval",
              "--block-size": "block_size"}
GPT_FLAGS = {"--n-layer": "n_layer", "--n-head": "n_head", "--n-embd": "n_embd",
             "--dropout": "dropout"}


def add_text_arguments(train: argparse.ArgumentParser) -> None:
    group = train.add_argument_group(
        "text", "--data text (--model gpt, or a model file): trained for --steps iterations "
        "(--batch-size default 64; gpt: --lr default 1e-3 with AdamW, warmup and cosine decay)")
    group.add_argument("--text-file", default=None,
                       help="UTF-8 text to train on (default: the help topics every Python "
                       "installation carries, pydoc_data/topics.py)")
    group.add_argument("--steps", type=int, default=None, help="training steps (default 2000)")
    group.add_argument("--eval-interval", type=int, default=None,
                       help="steps between validation losses and checkpoints (default 250)")
    group.add_argument("--block-size", type=int, default=None,
                       help="context length in characters (default 256)")
    group = train.add_argument_group("gpt", "the sizes of --model gpt")
    group.add_argument("--n-layer", type=int, default=None, help="transformer blocks (default 6)")
    group.add_argument("--n-head", type=int, default=None, help="attention heads (default 6)")
    group.add_argument("--n-embd", type=int, default=None, help="embedding width (default 384)")
    group.add_argument("--dropout", type=float, default=None, help="dropout (default 0.2)")


def add_sample_parser(commands, devices) -> None:
    from .sample import DEFAULT_TEMPERATURE, DEFAULT_TOKENS, DEFAULT_TOP_K

    sample = commands.add_parser("sample", help="generate text with a trained GPT",
                                 description="Generate text with the GPT checkpointed in --out "
                                 "by `stepgraph train --model gpt`; the same seed gives the "
                                 "same text.")
    sample.add_argument("--out", required=True, help="the training run's output directory")
    sample.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    sample.add_argument("--tokens", type=int, default=DEFAULT_TOKENS,
                        help=f"characters to generate (default {DEFAULT_TOKENS})")
    sample.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE,
                        help=f"softmax temperature; 0: always the most likely character "
                        f"(default {DEFAULT_TEMPERATURE})")
    sample.add_argument("--top-k", type=int, default=DEFAULT_TOP_K,
                        help=f"draw from the k most likely characters only; 0: from all "
                        f"(default {DEFAULT_TOP_K})")
    sample.add_argument("--seed", type=int, default=0)
    sample.add_argument("--device", choices=devices, default="auto",
                        help="auto: cuda when a GPU is usable, else cpu")


def relaunch(gpus: int, argv: list[str]) -> int | None:
    """`stepgraph train --gpus N` outside a launched run: the same command in N processes
    through `stepgraph launch` (its exit code); None when this process should train itself."""
    from .distributed import launched_world_size
    from .distributed.launch import LaunchArgs, launch
    from .train import TrainConfigError

    if gpus < 1:
        raise TrainConfigError(f"--gpus must be >= 1, got {gpus}")
    world = launched_world_size()
    if world > 1 and world != gpus:
        raise TrainConfigError(f"--gpus {gpus}, but this process was launched as one of "
                               f"WORLD_SIZE={world}")
    if gpus == 1 or world > 1:
        return None
    command = [sys.executable, "-m", "stepgraph", *without_gpus(argv)]
    return launch(LaunchArgs(gpus, tuple(command)))


def without_gpus(argv: list[str]) -> list[str]:
    """argv less its --gpus option (both spellings: `--gpus N`, `--gpus=N`)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--gpus":
            skip = True
        elif not a.startswith("--gpus="):
            out.append(a)
    return out


def run_train(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    from .model_file import parse_model_args
    from .train import DATA, TrainConfig, TrainConfigError, model_entry, train

    entry = model_entry(args.model)
    data = args.data or entry.data[0]
    text = DATA[data].kind == "text"
    if text:
        from .distributed import launched_world_size

        if args.gpus not in (None, 1) or launched_world_size() > 1:
            raise TrainConfigError("data-parallel training (--gpus) applies to image data only "
                                   "(mlp, cnn, resnet and model files)")
    elif args.gpus is not None:
        code = relaunch(args.gpus, argv if argv is not None else ["train"])
        if code is not None:
            return code
    flags = {**({} if text else TEXT_FLAGS), **({} if args.model == "gpt" else GPT_FLAGS)}
    given = [flag for flag, name in flags.items() if getattr(args, name) is not None]
    if given and data in entry.data:
        raise TrainConfigError(f"{given[0]} applies to --model gpt only"
                               + (" (and model files on --data text)"
                                  if given[0] in TEXT_FLAGS else ""))
    options = {name: getattr(args, name) for name in (*TEXT_FLAGS.values(), *GPT_FLAGS.values())}
    config = TrainConfig(model=args.model, data=data, data_dir=args.data_dir,
                         epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                         device=args.device, seed=args.seed, out=args.out, resume=args.resume,
                         overwrite=args.overwrite, force=args.force,
                         progress=not args.no_progress, on_bad_batch=args.on_bad_batch,
                         precision=args.precision or "fp32",
                         model_args=(parse_model_args(args.model_args)
                                     if args.model_args is not None else None),
                         **{k: v for k, v in options.items() if v is not None})
    result = train(config, log=lambda line: print(line, flush=True))
    if result.rank == 0:
        print(f"wrote {result.out_dir}/ (metrics.json, metrics.png, checkpoint.safetensors)")
        if result.val_loss is not None:
            print(f"validation loss: {result.val_loss:.4f}")
        else:
            print(f"test accuracy: {result.test_accuracy:.4f}")
    return 0


def run_sample(args: argparse.Namespace) -> int:
    from .sample import SampleConfig, sample

    config = SampleConfig(out=args.out, prompt=args.prompt, tokens=args.tokens,
                          temperature=args.temperature, top_k=args.top_k or None,
                          seed=args.seed, device=args.device)
    sample(config, on_text=lambda text: print(text, end="", flush=True))
    print()
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
        return run_sample(args) if args.command == "sample" else run_train(args, argv)
    except (StepgraphError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
