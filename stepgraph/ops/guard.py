"""Guard family: the checks that keep a bad batch from changing a model (compile/guard.py
emits them into a train step's graph; backends/cuda/guards.py runs them on the GPU).

A guarded step keeps two small state values on the device:
  flags    int32 (2,):  [FLAG_PENDING] what this step found wrong (GUARD_* bits, OR-ed in by
                        guard_check, cleared by guard_advance), [FLAG_SKIP] whether this step's
                        update is skipped (written by guard_advance, read by the update op).
  counters int64 (4,):  [CALLS] steps run, [SKIPPED] steps whose update was skipped,
                        [FIRST_BAD] the call number of the first bad step not yet reported
                        (0: none), [FIRST_BITS] what was wrong with it.
The step counter, parameters and optimizer state only change on steps that pass. State the
forward pass updates in place before the guard can know (BatchNorm's running statistics) is
copied by guard_save before anything runs and put back by guard_restore on a skipped step.

Dynamic loss scaling (GradScaler, compile/loss_scale.py) adds loss_scale_update: the scale and
its growth counter are state too, moved after guard_advance by what it decided.
"""
from __future__ import annotations

import numpy as np

from ..ir.ops import _need, defop, impl
from ..optim.schedules import schedule_factor

GUARD_LABELS = 1        # a label outside [0, classes)
GUARD_LOSS = 2          # the loss is NaN or infinite
GUARD_GRADS = 4         # a gradient element is NaN, infinite, or so large its square is
                        # (Adam's exp_avg_sq would hold Inf for good: see guard_check)
GUARD_HELD = 8          # skipped because an earlier bad step is still unreported ("raise")
FLAG_PENDING, FLAG_SKIP = 0, 1
CALLS, SKIPPED, FIRST_BAD, FIRST_BITS = 0, 1, 2, 3
N_FLAGS, N_COUNTERS = 2, 4
SAVE_ALIGN = 16         # bytes: each saved buffer starts at a multiple (vector copies)


def save_layout(buffers) -> tuple[tuple[int, ...], int]:
    """(offsets, total bytes) of `buffers` (Values or arrays) packed in guard_save's output."""
    offsets, end = [], 0
    for b in buffers:
        offsets.append(end)
        end += -(-int(b.nbytes) // SAVE_ALIGN) * SAVE_ALIGN
    return tuple(offsets), max(end, SAVE_ALIGN)


def describe_bits(bits: int, classes: int | None = None) -> str:
    """What the GUARD_* bits say went wrong, in words."""
    words = []
    if bits & GUARD_LABELS:
        span = f"[0, {classes})" if classes is not None else "[0, classes)"
        words.append(f"labels outside {span}")
    if bits & GUARD_LOSS:
        words.append("a non-finite loss (NaN or Inf)")
    if bits & GUARD_GRADS:
        words.append("non-finite gradients (NaN or Inf, or so large that their square, "
                     "which Adam's exp_avg_sq holds, overflows)")
    if bits & GUARD_HELD and not words:
        words.append("an earlier bad step was not yet reported")
    return " and ".join(words) or "nothing"


@defop("guard_check", mutates=lambda attrs: (0,))
def _guard_check(ins, attrs):
    """flags[FLAG_PENDING] |= GUARD_LABELS if a label lies outside [0, classes) and is not
    attrs ignore_index (the loss's; None: no such label), | GUARD_LOSS if the loss is not
    finite, | GUARD_GRADS if any gradient element g has a non-finite g * g (NaN, Inf, or
    |g| above sqrt of the dtype's max, ~1.8e19 in float32). ins (flags int32 (2,), loss (),
    [labels (N,) int32/int64 when attrs classes is not None], gradients...). One pass over
    the gradients; reads nothing else.

    Why the square: the optimizer state after an update must stay finite, and it does exactly
    when g * g is finite. SGD's buffers and Adam's exp_avg are convex combinations of
    gradients; Adam's exp_avg_sq is one of their squares, so it overflows (and freezes the
    weight for good: its update is then 0 forever) exactly when some g * g does. A finite but
    huge batch (1e38) gives such gradients with a finite loss.

    attrs check_loss False: the loss is not checked (GradScaler's found_inf reads the
    gradients only: a scaled loss may overflow while its gradients stay finite)."""
    flags, loss = ins[0], ins[1]
    _need(flags.shape == (N_FLAGS,) and flags.dtype == "int32", "guard_check",
          f"flags must be int32 ({N_FLAGS},), got {flags!r}")
    # float16: a model.half() loss (checked widened, as the gradients)
    _need(loss.shape == () and loss.dtype in ("float32", "float64", "float16"), "guard_check",
          f"loss must be a float scalar, got {loss!r}")
    if attrs.get("classes") is not None:
        _need(len(ins) > 2 and ins[2].dtype in ("int32", "int64"), "guard_check",
              "labels must be int32 or int64")
    return []


@defop("guard_advance", mutates=lambda attrs: (0, 1, 2, 5, 6, 7))
def _guard_advance(ins, attrs):
    """The bookkeeping of a guarded step, after guard_check and before the update. ins (flags,
    counters, step, schedule, loss, history_loss (R,), history_step int64 (R,), history_flag
    int32 (R,)); attrs sticky ("raise": once a step is bad, skip every later one until the
    host has reported it). bits = flags[PENDING]; flags[PENDING] = 0; calls += 1; the first bad
    step is noted in FIRST_BAD/FIRST_BITS; skip = bits != 0 or (sticky and FIRST_BAD != 0);
    flags[SKIP] = skip; skipped += skip, else step += 1; lr = schedule_factor(schedule, step) (the
    output); the loss, the call number and bits (| GUARD_HELD when skipped for an earlier
    step) recorded at slot calls % R."""
    counters, step = ins[1], ins[2]
    _need(counters.shape == (N_COUNTERS,) and counters.dtype == "int64", "guard_advance",
          f"counters must be int64 ({N_COUNTERS},), got {counters!r}")
    _need(step.shape == () and step.dtype == "int64", "guard_advance",
          f"step must be an int64 scalar, got {step!r}")
    return [((), "float32")]


@defop("guard_save")
def _guard_save(ins, attrs):
    """saved (uint8 (attrs nbytes,)) = the bytes of every input, input i at attrs offsets[i]
    (save_layout): a copy of the state the forward pass updates in place, taken first."""
    _need(len(attrs["offsets"]) == len(ins), "guard_save",
          f"{len(ins)} inputs but {len(attrs['offsets'])} offsets")
    return [((attrs["nbytes"],), "uint8")]


@defop("guard_restore", mutates=lambda attrs: tuple(range(2, 2 + len(attrs["offsets"]))))
def _guard_restore(ins, attrs):
    """ins (flags, saved, buffers...): when flags[FLAG_SKIP] is set, each buffer gets back
    the bytes guard_save took (a skipped step leaves it as it was); else nothing happens."""
    _need(ins[1].dtype == "uint8", "guard_restore", f"saved must be uint8, got {ins[1]!r}")
    return []


@defop("loss_scale_update", mutates=lambda attrs: (1, 2))
def _loss_scale_update(ins, attrs):
    """GradScaler.update on the device, after guard_advance. ins (flags int32 (2,), scale
    float32 (), growth_tracker int32 ()); attrs growth_factor, backoff_factor,
    growth_interval. A skipped step (flags[FLAG_SKIP]): scale *= backoff_factor, tracker = 0;
    else tracker += 1, and when it reaches growth_interval: scale *= growth_factor (kept
    only if finite) and tracker = 0. float32 arithmetic, as torch's _amp_update_scale_."""
    flags, scale, tracker = ins
    _need(flags.shape == (N_FLAGS,) and flags.dtype == "int32", "loss_scale_update",
          f"flags must be int32 ({N_FLAGS},), got {flags!r}")
    _need(scale.shape == () and scale.dtype == "float32", "loss_scale_update",
          f"scale must be a float32 scalar, got {scale!r}")
    _need(tracker.shape == () and tracker.dtype == "int32", "loss_scale_update",
          f"growth_tracker must be an int32 scalar, got {tracker!r}")
    return []


@impl("loss_scale_update")
def _loss_scale_update_impl(node, ins, outs, ctx):
    flags, scale, tracker = ins
    a = node.attrs
    if flags[FLAG_SKIP]:
        scale[...] = scale * np.float32(a["backoff_factor"])
        tracker[...] = 0
        return
    good = int(tracker) + 1
    if good == a["growth_interval"]:
        with np.errstate(over="ignore"):
            grown = scale * np.float32(a["growth_factor"])
        if np.isfinite(grown):
            scale[...] = grown
        good = 0
    tracker[...] = good


def _bytes_of(array: np.ndarray) -> np.ndarray:
    """A writable uint8 view of a contiguous array's memory (0-d arrays too)."""
    return array.reshape(-1).view(np.uint8)


@impl("guard_save")
def _guard_save_impl(node, ins, outs, ctx):
    for array, offset in zip(ins, node.attrs["offsets"]):
        raw = _bytes_of(array)
        outs[0][offset:offset + raw.size] = raw


@impl("guard_restore")
def _guard_restore_impl(node, ins, outs, ctx):
    flags, saved = ins[0], ins[1]
    if not flags[FLAG_SKIP]:
        return
    for array, offset in zip(ins[2:], node.attrs["offsets"]):
        raw = _bytes_of(array)
        raw[...] = saved[offset:offset + raw.size]


@impl("guard_check")
def _guard_check_impl(node, ins, outs, ctx):
    flags, loss, rest = ins[0], ins[1], list(ins[2:])
    bits = 0
    classes = node.attrs.get("classes")
    if classes is not None:
        labels = rest.pop(0)
        ignore = node.attrs.get("ignore_index")
        outside = (labels < 0) | (labels >= classes)
        if ignore is not None:
            outside &= labels != ignore
        if outside.any():
            bits |= GUARD_LABELS
    if node.attrs.get("check_loss", True) and not np.isfinite(loss).all():
        bits |= GUARD_LOSS
    with np.errstate(over="ignore", invalid="ignore"):
        if not all(np.isfinite(g * g).all() for g in rest):
            bits |= GUARD_GRADS
    flags[FLAG_PENDING] |= bits


@impl("guard_advance")
def _guard_advance_impl(node, ins, outs, ctx):
    flags, counters, step, schedule, loss, history_loss, history_step, history_flag = ins
    bits = int(flags[FLAG_PENDING])
    flags[FLAG_PENDING] = 0
    counters[CALLS] += 1
    calls = int(counters[CALLS])
    if bits and not counters[FIRST_BAD]:
        counters[FIRST_BITS] = bits
        counters[FIRST_BAD] = calls
    skip = bool(bits) or (bool(node.attrs.get("sticky")) and bool(counters[FIRST_BAD]))
    flags[FLAG_SKIP] = int(skip)
    if skip:
        counters[SKIPPED] += 1
    else:
        step[...] += 1
    outs[0][...] = schedule_factor(schedule, int(step))
    slot = calls % history_loss.shape[0]
    history_loss[slot] = loss
    history_step[slot] = calls
    history_flag[slot] = bits | (GUARD_HELD if skip and not bits else 0)
