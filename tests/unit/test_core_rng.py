"""stepgraph.rng: Philox4x32-10 known answers (Random123's kat_vectors) and the dropout mask
layout that the numpy and CUDA backends must both reproduce bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

from stepgraph import rng

ONES = 0xFFFFFFFF
# (counter words, key as a 64-bit seed = key1 << 32 | key0, expected output words)
KNOWN_ANSWERS = {
    "zeros": ([0, 0, 0, 0], 0, [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
    "ones": ([ONES] * 4, (ONES << 32) | ONES, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
    "pi": ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], (0x299F31D0 << 32) | 0xA4093822,
           [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
}


@pytest.mark.parametrize("case", KNOWN_ANSWERS)
def test_philox4x32_10_known_answers(case):
    counter, key, want = KNOWN_ANSWERS[case]
    words = rng.philox4x32([np.array([c], np.uint32) for c in counter], key)
    assert [int(w[0]) for w in words] == want


def test_philox_is_elementwise_over_counter_arrays():
    counters = [np.array([0, ONES, 0x243F6A88], np.uint32), np.array([0, ONES, 0x85A308D3]),
                np.array([0, ONES, 0x13198A2E]), np.array([0, ONES, 0x03707344])]
    batch = rng.philox4x32(counters, 0)
    for i in range(3):
        alone = rng.philox4x32([c[i:i + 1] for c in counters], 0)
        assert [int(w[i]) for w in batch] == [int(w[0]) for w in alone]


def test_mask_element_uses_word_i_mod_4_of_counter_i_div_4():
    seed, site, step, p = (7 << 32) | 3, 5, (2 << 32) | 9, 0.3
    n = 4 * 6 + 3    # not a multiple of 4: the last counter is partly used
    mask = rng.dropout_keep_mask(n, p, seed, site, step)
    for i in range(n):
        words = rng.philox4x32([np.array([i >> 2], np.uint32), np.array([site], np.uint32),
                                np.array([step & ONES], np.uint32),
                                np.array([step >> 32], np.uint32)], seed)
        keep = (int(words[i & 3][0]) >> 8) >= rng.keep_threshold(p)
        assert mask[i] == keep, f"element {i}"


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9])
def test_keep_fraction(p):
    mask = rng.dropout_keep_mask(60_000, p, seed=1, site=0, step=0)
    assert mask.dtype == np.uint8 and set(np.unique(mask)) <= {0, 1}
    assert abs(mask.mean() - (1 - p)) < 5 * np.sqrt(max(p * (1 - p), 1e-12) / mask.size) + 1e-9


def test_keep_threshold_is_p_in_24_bits():
    assert rng.keep_threshold(0.0) == 0
    assert rng.keep_threshold(0.5) == 1 << 23
    assert rng.keep_threshold(0.1) == int(0.1 * 2**24)


@pytest.mark.parametrize("change", ["seed", "site", "step", "step-high-word"])
def test_masks_are_independent_across_seed_site_and_step(change):
    args = dict(seed=3, site=1, step=4)
    other = dict(args)
    other.update({"seed": dict(seed=4), "site": dict(site=2), "step": dict(step=5),
                  "step-high-word": dict(step=4 + 2**32)}[change])
    a = rng.dropout_keep_mask(50_000, 0.5, **args)
    b = rng.dropout_keep_mask(50_000, 0.5, **other)
    assert abs((a != b).mean() - 0.5) < 0.02
    np.testing.assert_array_equal(a, rng.dropout_keep_mask(50_000, 0.5, **args))
