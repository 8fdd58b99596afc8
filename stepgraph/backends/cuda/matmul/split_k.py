"""Split-K variants of the heuristic's GEMM candidates, for deep products with a small result.

A weight gradient of a convolution or linear layer over a large batch is such a product: D is
(out, in) and K runs over every pixel or token of the batch (ConvNeXt's 384 x 96 result over
K = 32768). Its few output tiles leave most SMs idle unless K is split over more thread
blocks and the partial results added in a second step. cuBLASLt's heuristic does split such
products, but not by the best count: on an H200 its best fp32 candidate for that product took
134.6 µs with K in 11 parts, where timing every configuration cuBLASLt accepts found 103 µs
with 16 (scripts/gemm-algos; 192 x 768 x 8192: 97 -> 76 µs, also 16 parts).

The variants copy each heuristic candidate's algorithm (its tile, stages and the rest, chosen
for this problem) with other split counts, each accepted by cublasLtMatmulAlgoCheck before it
joins the candidates the autotuner times. A candidate already split keeps its reduction
scheme; an unsplit one is tried with both schemes that add the parts in a fixed order
(in place in D, or in the compute type in the workspace), so a variant is as deterministic as
the heuristic's own candidates.
"""
from __future__ import annotations

import math

import numpy as np

SPLITS = (2, 4, 8, 16, 32)
MIN_K_PER_SPLIT = 256      # a part shorter than this costs more in the reduction than it saves
MAX_TILES = 64             # D's 128 x 128 tiles below which the GPU's 132 SMs sit mostly idle
MIN_K = 2048


def wanted(spec) -> bool:
    """Whether `spec` is deep and narrow enough for split-K to be worth timing. Accumulating
    GEMMs are never autotuned (repeated calls would change D), so none is split here."""
    tiles = math.ceil(spec.m / 128) * math.ceil(spec.n / 128)
    return (spec.batch == 1 and not spec.accumulate and tiles <= MAX_TILES
            and spec.k >= MIN_K)


def splits_for(k: int) -> tuple[int, ...]:
    return tuple(s for s in SPLITS if k // s >= MIN_K_PER_SPLIT)


def variants(lt, handle: int, p) -> np.ndarray:
    """Heuristic-result rows (p.heuristic's dtype) of split-K variants of p's usable
    candidates, each accepted by cuBLASLt's check for p; none repeats an algorithm already
    in p.heuristic."""
    cap, config = lt.MatmulAlgoCapAttribute, lt.MatmulAlgoConfigAttribute
    ordered = [lt.ReductionScheme.INPLACE, lt.ReductionScheme.COMPUTE_TYPE]
    offset = p.heuristic.dtype.fields["algo"][1]
    seen = {_algo_bytes(p.heuristic[i:i + 1]) for i in range(len(p.heuristic))}
    a_lay, b_lay, d_lay = p.layouts
    found = []
    for i in range(len(p.heuristic)):
        base = p.heuristic[i:i + 1].copy()
        if base["state"][0] != 0:
            continue
        address = base.ctypes.data + offset
        try:
            if not _get(lt.matmul_algo_cap_get_attribute,
                        lt.get_matmul_algo_cap_attribute_dtype, address, cap.SPLITK_SUPPORT):
                continue
            split_now = _get(lt.matmul_algo_config_get_attribute,
                             lt.get_matmul_algo_config_attribute_dtype, address,
                             config.SPLITK_NUM)
            scheme_now = _get(lt.matmul_algo_config_get_attribute,
                              lt.get_matmul_algo_config_attribute_dtype, address,
                              config.REDUCTION_SCHEME)
            mask = _get(lt.matmul_algo_cap_get_attribute,
                        lt.get_matmul_algo_cap_attribute_dtype, address,
                        cap.REDUCTION_SCHEME_MASK)
        except lt.cuBLASLtError:
            continue
        schemes = [scheme_now] if split_now > 1 and scheme_now else \
            [int(s) for s in ordered if mask & int(s)]
        for split in splits_for(p.spec.k):
            for scheme in schemes if split != split_now else ():
                row = base.copy()
                where = row.ctypes.data + offset
                check = np.zeros(1, dtype=p.heuristic.dtype)
                try:
                    _put(lt, where, config.SPLITK_NUM, split)
                    _put(lt, where, config.REDUCTION_SCHEME, scheme)
                    lt.matmul_algo_check(handle, p.desc, a_lay, b_lay, d_lay, d_lay, where,
                                         check.ctypes.data)
                except lt.cuBLASLtError:
                    continue                     # this split or scheme refused for p
                key = _algo_bytes(row)
                if key in seen:
                    continue
                seen.add(key)
                row["workspace_size"], row["state"] = check["workspace_size"], check["state"]
                found.append(row)
    return np.concatenate(found) if found else p.heuristic[:0].copy()


def _algo_bytes(row: np.ndarray) -> bytes:
    """The algorithm struct of a one-row heuristic-result array, as bytes."""
    offset = row.dtype.fields["algo"][1]
    size = row.dtype.fields["algo"][0].itemsize
    return row.view(np.uint8)[offset:offset + size].tobytes()


def _get(getter, dtype_of, algo: int, attr) -> int:
    buf = np.zeros(1, dtype=dtype_of(attr))
    written = np.zeros(1, np.uint64)
    getter(algo, attr, buf.ctypes.data, buf.itemsize, written.ctypes.data)
    return int(buf[0])


def _put(lt, algo: int, attr, value: int) -> None:
    buf = np.array(value, dtype=lt.get_matmul_algo_config_attribute_dtype(attr))
    lt.matmul_algo_config_set_attribute(algo, attr, buf.ctypes.data, buf.itemsize)
