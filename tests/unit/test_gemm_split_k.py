"""cuBLASLt's configurations beyond its heuristic's (backends/cuda/matmul/split_k.py), against
a fake cuBLASLt that keeps an algorithm's configuration in its struct's words and refuses what
a real library may refuse. tests/cuda/test_gemm_split_k_cuda.py runs the real one and
compares every configuration's product with NumPy's."""
from __future__ import annotations

import ctypes
import enum
from types import SimpleNamespace

import numpy as np

from stepgraph.backends.cuda.matmul import split_k
from stepgraph.backends.cuda.matmul.gemm import GemmSpec, Layout

ALGO = np.dtype([("data", np.uint64, (8,))])
RESULT = np.dtype([("algo", ALGO), ("workspace_size", np.uint64), ("state", np.int32),
                   ("waves_count", np.float32), ("reserved", np.int32, (4,))])
TYPES = (68, 0, 0, 0)                        # compute, scale, A/B and D types: passed through


class Config(enum.IntEnum):                  # each the index of the word the fake keeps it in
    ID = 0
    TILE_ID = 1
    SPLITK_NUM = 2
    REDUCTION_SCHEME = 3
    STAGES_ID = 4


class Cap(enum.IntEnum):
    SPLITK_SUPPORT = 10
    REDUCTION_SCHEME_MASK = 11
    TILE_IDS = 12
    STAGES_IDS = 13


class Scheme(enum.IntEnum):
    NONE, INPLACE, COMPUTE_TYPE, OUTPUT_TYPE = 0, 1, 2, 4


class Refused(Exception):
    pass


def fake_lt(algos: dict, refuse=lambda id_, tile, stage, split: False):
    """A cuBLASLt with the algorithms `algos`: id -> dict(tiles, stages, split, mask), whose
    check refuses what `refuse` says; the checks and the ids asked for are recorded."""
    calls = {"checks": [], "ids": []}

    def word(algo, i):
        return ctypes.c_uint64.from_address(algo + 8 * i)

    def get_ids(handle, compute, scale, a, b, c, d, count):
        calls["ids"].append((compute, count))
        return tuple(algos)

    def init(handle, compute, scale, a, b, c, d, id_, algo):
        word(algo, Config.ID).value = id_

    def cap_get(algo, attr, buf, size, written):
        caps = algos[word(algo, Config.ID).value]
        values = {Cap.SPLITK_SUPPORT: [int(caps.get("split", True))],
                  Cap.REDUCTION_SCHEME_MASK: [int(caps.get("mask", 3))],
                  Cap.TILE_IDS: caps.get("tiles", []),
                  Cap.STAGES_IDS: caps.get("stages", [])}[attr]
        ctypes.c_uint64.from_address(written).value = 4 * len(values)
        for i, v in enumerate(values[:size // 4]):
            ctypes.c_uint32.from_address(buf + 4 * i).value = v

    def config_set(algo, attr, buf, size):
        word(algo, attr).value = ctypes.c_uint32.from_address(buf).value

    def check(handle, desc, a, b, c, d, algo, result):
        id_, tile, split, scheme, stage = (word(algo, i).value for i in range(5))
        calls["checks"].append((id_, tile, stage, split, scheme))
        if refuse(id_, tile, stage, split):
            raise Refused(f"id {id_}")
        out = np.frombuffer((ctypes.c_char * RESULT.itemsize).from_address(result), RESULT)
        out["workspace_size"] = 4096 * split

    lt = SimpleNamespace(
        MatmulAlgoConfigAttribute=Config, MatmulAlgoCapAttribute=Cap, ReductionScheme=Scheme,
        cuBLASLtError=Refused, matmul_algo_dtype=ALGO, matmul_algo_get_ids=get_ids,
        matmul_algo_init=init, matmul_algo_cap_get_attribute=cap_get,
        matmul_algo_config_set_attribute=config_set,
        get_matmul_algo_config_attribute_dtype=lambda attr: np.uint32, matmul_algo_check=check)
    return lt, calls


def spec(m=384, n=96, k=32768, **kw):
    """A weight gradient's GEMM, column-major: D (m, n) = A (m, k) @ B^T."""
    return GemmSpec(a=Layout(m, k, m), b=Layout(n, k, n), d=Layout(m, n, m), trans_b=True, **kw)


def planned(offered=(), s=None):
    """A planned GEMM whose heuristic offered `offered`: (id, tile, split, scheme, stage)."""
    heuristic = np.zeros(len(offered), RESULT)
    for i, words in enumerate(offered):
        heuristic["algo"]["data"][i, :5] = words
    return SimpleNamespace(spec=s or spec(), heuristic=heuristic, desc=1, layouts=(2, 3, 4))


def configs(rows):
    """(id, tile, stage, split, scheme) of each row."""
    return [tuple(int(row["algo"]["data"][i]) for i in (0, 1, 4, 2, 3)) for row in rows]


def test_deep_narrow_products_are_wanted_and_others_not():
    assert split_k.wanted(spec())                          # ConvNeXt's weight gradient
    assert not split_k.wanted(spec(m=4096, n=4096))        # 1,024 tiles fill the GPU
    assert not split_k.wanted(spec(k=1024))                # too shallow to split
    assert not split_k.wanted(spec(accumulate=True))       # never autotuned
    # 16 bits: the narrowest results only (an LM head's weight gradient); ConvNeXt-sized
    # ones measured slower in a step
    assert split_k.wanted(spec(m=384, n=65, dtype="bfloat16"))
    assert split_k.wanted(spec(dtype="float16"))
    assert not split_k.wanted(spec(m=384, n=384, dtype="bfloat16"))     # 9 tiles
    assert split_k.wanted(spec(precision="tf32"))
    assert split_k.splits_for(32768) == (4, 8, 16, 32)
    assert split_k.splits_for(2048) == (4, 8)              # parts of at least 256


def test_every_tile_stage_and_split_is_checked_and_the_accepted_ones_kept():
    lt, calls = fake_lt({20: dict(tiles=[17, 18], stages=[28, 29], mask=3),
                         55: dict(tiles=[11], stages=[31], mask=1),
                         7: dict(tiles=[3], stages=[], split=False)},
                        refuse=lambda id_, tile, stage, split: stage == 29 and split == 4)
    found = list(split_k.configurations(lt, 0, planned(), TYPES, (1, 4, 16)))
    names = [name for name, _ in found]
    kept = [c for _, row in found for c in configs(row)]
    assert calls["ids"] == [(68, 256)]
    # split counts past 1 add their parts in the compute type where the algorithm can, else
    # in place; an algorithm that cannot split and lists no stages runs once, unsplit
    assert kept == [(20, t, s, k, 2 if k > 1 else 0) for t in (17, 18) for s in (28, 29)
                    for k in (1, 4, 16) if not (s == 29 and k == 4)] + \
        [(55, 11, 31, k, 1 if k > 1 else 0) for k in (1, 4, 16)] + [(7, 3, 0, 1, 0)]
    assert len(calls["checks"]) == len(kept) + 2                     # the two refused
    assert names[0] == "id 20 tile 17 stages 28 split 1"
    assert [int(row["workspace_size"][0]) for _, row in found] == [4096 * c[3] for c in kept]


def test_candidates_leave_out_what_the_heuristic_offered_and_stop_at_the_cap(monkeypatch):
    lt, _ = fake_lt({20: dict(tiles=[17, 18], stages=[28], mask=2)})
    p = planned([(20, 17, 16, 2, 28)], spec(k=4096))               # offered: split 16
    rows = split_k.candidates(lt, 0, p, TYPES)
    assert configs(rows) == [(20, t, 28, k, 2) for t in (17, 18)
                             for k in (4, 8, 16) if (t, k) != (17, 16)]
    assert rows.dtype == RESULT
    monkeypatch.setattr(split_k, "MAX_CANDIDATES", 3)
    assert len(split_k.candidates(lt, 0, p, TYPES)) == 3


def test_nothing_accepted_gives_an_empty_array_of_the_heuristics_rows():
    lt, _ = fake_lt({20: dict(tiles=[17], stages=[28])}, refuse=lambda *a: True)
    rows = split_k.candidates(lt, 0, planned(), TYPES)
    assert rows.dtype == RESULT and len(rows) == 0


def test_a_16_bit_result_is_never_split_in_place():
    """Parts added in place would be added in D's 16 bits: an algorithm that can split only so
    runs unsplit for a bf16 result, one with the compute-type scheme splits as for float32."""
    lt, _ = fake_lt({20: dict(tiles=[17], stages=[28], mask=3),
                     55: dict(tiles=[11], stages=[31], mask=1)})
    p = planned(s=spec(dtype="bfloat16"))
    kept = [c for _, row in split_k.configurations(lt, 0, p, TYPES, (1, 4, 16))
            for c in configs(row)]
    assert kept == [(20, 17, 28, k, 2 if k > 1 else 0) for k in (1, 4, 16)] + \
        [(55, 11, 31, 1, 0)]
