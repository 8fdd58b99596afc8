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


def assert_changes_close(before, after, after64, after32, what: str = "",
                         factor: float = FACTOR) -> None:
    """Parameter *changes* (after - before) judged by the policy against a float64 run's and
    a torch float32 run's changes from the same `before`: a missing or halved update fails
    here even when it is small next to the parameter's value."""
    before = np.asarray(before, np.float64)
    assert_close_to_reference(np.asarray(after, np.float64) - before,
                              np.asarray(after64, np.float64) - before,
                              np.asarray(after32, np.float64) - before, what, factor)
