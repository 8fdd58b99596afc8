"""torch.backends' flags, for model code that sets them: `torch.backends.cudnn.benchmark`,
`.deterministic`, `.allow_tf32`, `.enabled` and `torch.backends.cuda.matmul.allow_tf32`
(and `torch.backends.mps.is_available()`, always False).

Each is a plain attribute that keeps what it is set to and changes nothing: compiled steps
take these choices as compile options. cudnn.benchmark: kernels are always chosen by timing
(autotuning); cudnn.deterministic: `compile_train_step(deterministic=...)`, True unless
passed; allow_tf32 and torch.set_float32_matmul_precision: `compile_train_step(precision=
"tf32")`; cudnn.enabled: cuDNN is used where its plans win the timing.
"""
from __future__ import annotations


class Flags:
    """A namespace of settable flags, repr listing them."""

    def __init__(self, **flags):
        self.__dict__.update(flags)

    def __repr__(self):
        return f"Flags({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


cudnn = Flags(benchmark=False, deterministic=False, allow_tf32=True, enabled=True)
# device pickers ask torch.backends.mps.is_available(): stepgraph has no Apple GPU backend
mps = Flags(is_available=lambda: False, is_built=lambda: False)
matmul = Flags(allow_tf32=False, allow_fp16_reduced_precision_reduction=True,
               allow_bf16_reduced_precision_reduction=True)

_float32_matmul_precision = "highest"


def set_float32_matmul_precision(precision: str) -> None:
    """torch.set_float32_matmul_precision("highest" | "high" | "medium"): kept, without
    effect (use `compile_train_step(precision="tf32")` for TF32 matmuls)."""
    global _float32_matmul_precision
    if precision not in ("highest", "high", "medium"):
        raise ValueError(f"set_float32_matmul_precision: expected 'highest', 'high' or "
                         f"'medium', got {precision!r}")
    _float32_matmul_precision = precision


def get_float32_matmul_precision() -> str:
    return _float32_matmul_precision


_deterministic = {"mode": False, "warn_only": False}


def use_deterministic_algorithms(mode: bool, *, warn_only: bool = False) -> None:
    """torch.use_deterministic_algorithms: kept for are_deterministic_algorithms_enabled, without
    effect: compiled steps are deterministic unless compile_train_step(deterministic=False)
    says otherwise (every kernel then gives the same bits on every run), whatever this says."""
    _deterministic.update(mode=bool(mode), warn_only=bool(warn_only))


def are_deterministic_algorithms_enabled() -> bool:
    return _deterministic["mode"]


def is_deterministic_algorithms_warn_only_enabled() -> bool:
    return _deterministic["warn_only"]
