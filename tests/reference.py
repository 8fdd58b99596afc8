"""The tolerance policy (docs/TESTING.md) as assertions.

A float32 result is judged against a float64 reference of the same problem; the bound is a
small multiple of the error PyTorch's own float32 makes against that reference, plus a tiny
absolute floor (a few float32 roundings of the reference's scale) for results torch gets
exactly right. Nothing here is a tolerance chosen to pass.
"""
from __future__ import annotations

import numpy as np

FACTOR = 4.0                  # how much farther from float64 than torch's float32 we may be
FLOOR_ULPS = 4.0              # the absolute floor, in float32 roundings of the largest value


def state_float64(model) -> dict[str, np.ndarray]:
    """A torch or stepgraph model's state_dict as float64 arrays (integer counters too): what
    the judges below compare."""
    return {k: np.asarray(v.detach().double().numpy() if hasattr(v, "detach") else v,
                          np.float64) for k, v in model.state_dict().items()}


def max_error(got, ref64) -> float:
    """The largest elementwise |got - ref64| (in float64); 0 for empty arrays."""
    got, ref64 = np.asarray(got, np.float64), np.asarray(ref64, np.float64)
    return float(np.max(np.abs(got - ref64))) if got.size else 0.0


def reference_bound(ref64, ref32, factor: float = FACTOR, precision=np.float32,
                    terms: float = 0.0) -> float:
    """factor x torch float32's largest error against float64, plus the absolute floor. For a
    result computed in float64 (`precision`), torch float32's error scaled by the ratio of the
    unit roundoffs stands for torch's own float64 error, which nothing finer can measure.
    `terms`: the scale of terms the result cancels (a gradient near zero computed as a
    difference of large ones): the floor covers a few roundings of those too."""
    ref64 = np.asarray(ref64, np.float64)
    scale = float(np.max(np.abs(ref64))) if ref64.size else 0.0
    eps = float(np.finfo(precision).eps)
    ratio = eps / float(np.finfo(np.float32).eps)
    return factor * ratio * max_error(ref32, ref64) + FLOOR_ULPS * eps * max(scale, terms) \
        + 1e-300


def assert_close_to_reference(got, ref64, ref32, what: str = "",
                              factor: float = FACTOR, precision=np.float32,
                              terms: float = 0.0) -> None:
    """`got` (computed in `precision`, float32 by default) is within `factor` times torch
    float32's error (`ref32`) of the float64 reference `ref64`, elementwise max over the
    tensor, plus the floor (reference_bound). Shapes must match and non-finite values must sit
    where the reference has them."""
    got, ref64 = np.asarray(got), np.asarray(ref64, np.float64)
    assert got.shape == ref64.shape, f"{what}: shape {got.shape}, reference {ref64.shape}"
    finite = np.isfinite(ref64)
    np.testing.assert_array_equal(np.isfinite(got), finite, err_msg=f"{what}: non-finite "
                                  "values where the reference has none (or the reverse)")
    err = max_error(np.where(finite, got, 0), np.where(finite, ref64, 0))
    bound = reference_bound(np.where(finite, ref64, 0),
                            np.where(finite, np.asarray(ref32, np.float64), 0), factor,
                            precision, terms)
    torch_err = max_error(np.where(finite, np.asarray(ref32, np.float64), 0),
                          np.where(finite, ref64, 0))
    assert err <= bound, (f"{what}: max error {err:.3g} against float64 exceeds the bound "
                          f"{bound:.3g} (torch float32's own error {torch_err:.3g}, "
                          f"x{factor:g} plus the floor)")


def change_bound(change64, change32, factor: float = FACTOR, held=None) -> float:
    """The bound on a parameter change's largest elementwise error against float64: `factor`
    times torch float32's own largest error there. A floor only where that error is (in
    float32's terms) 0, below one float32 rounding of the change's largest element: torch
    float32 then landed on float64 by luck of its last rounding, which measures nothing, and
    one rounding is the finest float32 can hold the change to; the bound is then `factor`
    roundings, still far below the change itself, so a missing update cannot pass.

    held: the parameter's float64 values after the run, when the floor should be one float32
    rounding of those instead (opt-in): a parameter held in float32 is rounded to its value's
    grid at every update, so where the values are far larger than the change (a bias near 0.3
    that moves by 0.03) one rounding landing on the other neighbour of a near-tie, as torch's
    may not, is an error of one ulp of the value that no arithmetic can avoid."""
    change64 = np.asarray(change64, np.float64)
    scale = float(np.max(np.abs(change64))) if change64.size else 0.0
    if held is not None and np.size(held):
        scale = max(scale, float(np.max(np.abs(np.asarray(held, np.float64)))))
    resolution = float(np.finfo(np.float32).eps) * scale
    return factor * max(max_error(change32, change64), resolution)


def assert_changes_close(before, after, after64, after32, what: str = "",
                         factor: float = FACTOR, moves: bool | None = True,
                         value_floor: bool = False) -> None:
    """Parameter *changes* (after - before), the tolerance policy's one judge of training:
    the change is within `factor` x torch float32's error (change_bound) of a float64 run's
    change from the same `before`, elementwise max over the tensor. A missing, halved or 1%
    off update fails here even when it is small next to the parameter's value.

    moves: True, the float64 change must not be zero (the parameter trains in this problem), so
    a test whose reference did not train cannot pass; False (a frozen parameter), it must keep
    its value exactly; None (a buffer), either, as the float64 run's does. value_floor: the
    floor is one float32 rounding of the parameter's values (change_bound held=)."""
    before = np.asarray(before, np.float64)
    ours = np.asarray(after, np.float64) - before
    change64 = np.asarray(after64, np.float64) - before
    change32 = np.asarray(after32, np.float64) - before
    assert ours.shape == change64.shape, f"{what}: shape {ours.shape}, reference {change64.shape}"
    assert np.isfinite(ours).all(), f"{what}: a non-finite change"
    size = float(np.max(np.abs(change64))) if change64.size else 0.0
    if moves is False or (moves is None and size == 0):
        assert not ours.any(), (f"{what}: {'frozen' if moves is False else 'constant'}, but it "
                                f"changed by up to {np.abs(ours).max():.3g}")
        return
    assert size > 0, f"{what}: the float64 run did not change it: the test cannot fail"
    err = max_error(ours, change64)
    bound = change_bound(change64, change32, factor, after64 if value_floor else None)
    assert err <= bound, (f"{what}: change (largest {size:.3g}) off float64's by {err:.3g}, past "
                          f"the bound {bound:.3g} (torch float32's own error "
                          f"{max_error(change32, change64):.3g}, x{factor:g})")


def assert_state_changes_close(before: dict, after: dict, after64: dict, after32: dict,
                               what: str = "", factor: float = FACTOR, frozen=(),
                               trained=None, counters: int | None = None,
                               value_floor: bool = False) -> None:
    """assert_changes_close over every floating entry of a state_dict (parameters and running
    statistics), with the same keys on every side; integer entries must equal float64's, and
    BatchNorm's num_batches_tracked `counters` when given (value_floor: assert_changes_close's).
    `frozen` names the
    entries that must not change; `trained` those that must (None: every floating entry not
    frozen); the others (constant buffers) change as the float64 run's do, or not at all."""
    assert list(after) == list(after64), f"{what}: keys {list(after)} vs {list(after64)}"
    for key, value64 in after64.items():
        value = np.asarray(after[key])
        if not np.issubdtype(value.dtype, np.floating):
            counter = counters is not None and key.endswith("num_batches_tracked")
            want = np.asarray(counters if counter else value64)
            assert np.array_equal(value, want), f"{what}{key}: {value}, expected {want}"
            continue
        moves = False if key in frozen else (trained is None or key in trained) or None
        assert_changes_close(before[key], value, value64, after32[key], f"{what}{key}", factor,
                             moves, value_floor)
