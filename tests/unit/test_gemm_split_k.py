"""Split-K variants of the heuristic's GEMM candidates (backends/cuda/matmul/split_k.py),
against a fake cuBLASLt that keeps an algorithm's configuration in its struct's words and
refuses what a real library may refuse. tests/cuda/test_gemm_split_k_cuda.py runs the real
one and compares every variant's product with NumPy's."""
from __future__ import annotations

import ctypes
import enum
from types import SimpleNamespace

import numpy as np

from stepgraph.backends.cuda.matmul import split_k
from stepgraph.backends.cuda.matmul.gemm import GemmSpec, Layout

RESULT = np.dtype([("algo", np.uint64, (8,)), ("workspace_size", np.uint64),
                   ("state", np.int32), ("waves_count", np.float32),
                   ("reserved", np.int32, (4,))])
ID, TILE, SPLIT, SCHEME = range(4)          # the words of the fake's algorithm struct


class Config(enum.IntEnum):
    SPLITK_NUM = 2
    REDUCTION_SCHEME = 3


class Cap(enum.IntEnum):
    SPLITK_SUPPORT = 10
    REDUCTION_SCHEME_MASK = 11


class Scheme(enum.IntEnum):
    NONE, INPLACE, COMPUTE_TYPE, OUTPUT_TYPE = 0, 1, 2, 4


class Refused(Exception):
    pass


def fake_lt(no_split_ids=(), masks=None, refuse=lambda id_, split, scheme: False):
    """A cuBLASLt whose algorithms `no_split_ids` cannot split K, whose reduction schemes are
    masks[id] (INPLACE | COMPUTE_TYPE by default), and whose check refuses what `refuse`
    says; checks are recorded."""
    masks = masks or {}
    checks = []

    def word(algo, i):
        return ctypes.c_uint64.from_address(algo + 8 * i)

    def config_get(algo, attr, buf, size, written):
        ctypes.c_uint32.from_address(buf).value = word(algo, attr).value

    def config_set(algo, attr, buf, size):
        word(algo, attr).value = ctypes.c_uint32.from_address(buf).value

    def cap_get(algo, attr, buf, size, written):
        id_ = word(algo, ID).value
        value = (id_ not in no_split_ids if attr == Cap.SPLITK_SUPPORT
                 else masks.get(id_, Scheme.INPLACE | Scheme.COMPUTE_TYPE))
        ctypes.c_int32.from_address(buf).value = int(value)

    def check(handle, desc, a, b, c, d, algo, result):
        id_, split, scheme = (word(algo, i).value for i in (ID, SPLIT, SCHEME))
        checks.append((id_, split, scheme))
        if refuse(id_, split, scheme):
            raise Refused(f"id {id_} split {split} scheme {scheme}")
        out = np.frombuffer((ctypes.c_char * RESULT.itemsize).from_address(result), RESULT)
        out["workspace_size"] = 4096 * split

    lt = SimpleNamespace(
        MatmulAlgoConfigAttribute=Config, MatmulAlgoCapAttribute=Cap, ReductionScheme=Scheme,
        cuBLASLtError=Refused, matmul_algo_config_get_attribute=config_get,
        matmul_algo_config_set_attribute=config_set, matmul_algo_cap_get_attribute=cap_get,
        get_matmul_algo_config_attribute_dtype=lambda attr: np.uint32,
        get_matmul_algo_cap_attribute_dtype=lambda attr: np.int32, matmul_algo_check=check)
    return lt, checks


def spec(m=384, n=96, k=32768, **kw):
    """A weight gradient's GEMM, column-major: D (m, n) = A (m, k) @ B^T."""
    return GemmSpec(a=Layout(m, k, m), b=Layout(n, k, n), d=Layout(m, n, m), trans_b=True, **kw)


def planned(rows, s=None):
    """A planned GEMM whose heuristic offered `rows`: (id, tile, split[, scheme])."""
    heuristic = np.zeros(len(rows), RESULT)
    for i, row in enumerate(rows):
        heuristic["algo"][i, [ID, TILE, SPLIT, SCHEME][:len(row)]] = row
    return SimpleNamespace(spec=s or spec(), heuristic=heuristic, desc=1, layouts=(2, 3, 4))


def configs(rows):
    return [tuple(int(w) for w in row["algo"][[ID, TILE, SPLIT, SCHEME]]) for row in rows]


def test_deep_narrow_products_are_wanted_and_others_not():
    assert split_k.wanted(spec())                          # ConvNeXt's weight gradient
    assert not split_k.wanted(spec(m=4096, n=4096))        # 1,024 tiles fill the GPU
    assert not split_k.wanted(spec(k=1024))                # too shallow to split
    assert not split_k.wanted(spec(accumulate=True))       # never autotuned
    assert split_k.splits_for(32768) == (2, 4, 8, 16, 32)
    assert split_k.splits_for(2048) == (2, 4, 8)           # parts of at least 256


def test_every_split_and_scheme_of_every_candidate_is_checked_and_kept():
    lt, checks = fake_lt()
    p = planned([(16, 5, 1), (17, 6, 1), (18, 7, 1), (19, 8, 1)])
    rows = split_k.variants(lt, 0, p)
    kept = configs(rows)
    # each algorithm, each split of K = 32768, both deterministic schemes
    assert kept == [(id_, tile, split, scheme)
                    for id_, tile in ((16, 5), (17, 6), (18, 7), (19, 8))
                    for split in (2, 4, 8, 16, 32) for scheme in (1, 2)]
    assert len(checks) == len(kept)
    assert list(rows["workspace_size"]) == [4096 * c[2] for c in kept]   # from the check
    assert (rows["state"] == 0).all()
    # the heuristic's own rows are left as they were
    assert configs(p.heuristic) == [(16, 5, 1, 0), (17, 6, 1, 0), (18, 7, 1, 0), (19, 8, 1, 0)]


def test_refused_configurations_and_algorithms_that_cannot_split_are_left_out():
    lt, checks = fake_lt(no_split_ids={17}, masks={16: Scheme.COMPUTE_TYPE},
                         refuse=lambda id_, split, scheme: split == 32 or id_ == 19)
    p = planned([(16, 5, 1), (17, 6, 1), (18, 7, 4, 2), (19, 8, 1), (20, 9, 1)],
                spec(k=4096))
    kept = configs(split_k.variants(lt, 0, p))
    assert kept == [(16, 5, s, 2) for s in (2, 4, 8, 16)] + \
        [(18, 7, s, 2) for s in (2, 8, 16)] + \
        [(20, 9, s, c) for s in (2, 4, 8, 16) for c in (1, 2)]
    # 17 cannot split: never checked; 19's variants are all refused
    assert {c[0] for c in checks} == {16, 18, 19, 20}


def test_an_already_split_candidate_keeps_its_scheme_and_tries_the_other_counts():
    lt, _ = fake_lt()
    kept = configs(split_k.variants(lt, 0, planned([(16, 5, 16, 1)])))
    assert kept == [(16, 5, s, 1) for s in (2, 4, 8, 32)]


def test_a_failed_row_is_skipped_and_nothing_offered_twice():
    lt, _ = fake_lt()
    p = planned([(9, 1, 1), (16, 5, 1), (16, 5, 1), (21, 2, 1)])
    p.heuristic["state"][0] = 7                         # a row the heuristic marked failed
    kept = configs(split_k.variants(lt, 0, p))
    assert len(kept) == len(set(kept)) == 2 * 5 * 2     # 16's variants once, and 21's
    assert {c[0] for c in kept} == {16, 21}


def test_no_variant_gives_an_empty_array_of_the_heuristics_rows():
    lt, _ = fake_lt(refuse=lambda *a: True)
    rows = split_k.variants(lt, 0, planned([(16, 5, 1)]))
    assert rows.dtype == RESULT and len(rows) == 0


def test_the_variant_is_the_base_algorithm_but_for_split_and_scheme():
    lt, _ = fake_lt()
    p = planned([(16, 5, 1)])
    p.heuristic["algo"][0, 5:] = (11, 12, 13)            # the rest of the struct is kept
    for variant in split_k.variants(lt, 0, p):
        assert list(variant["algo"][[0, 1, 5, 6, 7]]) == [16, 5, 11, 12, 13]
