"""cuBLASLt's configurations beyond its heuristic's, for deep GEMMs with a small result.

A weight gradient of a convolution or linear layer over a large batch is such a product: D is
(out, in) and K runs over every pixel or token of the batch (ConvNeXt's 384 x 96 result over
K = 32768). Its few output tiles leave most SMs idle unless K is split over more thread blocks
and the parts added in a second step. cuBLASLt's heuristic does split such products, but its
few candidates are not the fastest. On an H200, fp32:
- its best for that product took 134 µs (K in 11 parts); its candidates with the other split
  counts were no faster;
- timing every configuration cuBLASLt's check accepts (each algorithm id, tile, stage count
  and split count, scripts/gemm-algos), the best took 92.5 µs (32 parts); 192 x 768 x 8192
  went from 97 to 76 µs.

So for such products in float32 (fp32 and tf32) the autotuner times those configurations too,
those with K in 4 to 32 parts (`candidates`): ConvNeXt's fp32 step went from 14,750 to
14,341 µs, for about 5 s more setup while 1 and 2 parts were searched as well.
Not in bf16 at those sizes: there the same search made ConvNeXt's step 6% slower (4,568 ->
4,850 µs, the GEMMs' choices timed faster alone than they ran in the step) and its setup 5 s
longer. In 16 bits it runs for the narrowest results alone (at most HALF_MAX_TILES tiles),
with the parts added in float32 (the compute-type scheme; configurations that would add them
in D's 16 bits are skipped, as gemm.py's heuristic preference skips them): the tied LM head
of the bundled gpt, dw (65, 384) over K = 16384 tokens, took 308 µs unsplit on an H200 once
its in-place (bf16) split was refused, and 23 µs split here (its sums included); ConvNeXt's
bf16 step, with both changes, went from 4,466 to 4,285 µs.

Each configuration is accepted by cublasLtMatmulAlgoCheck first, and a split one adds its parts
in a fixed order (in the compute type in the workspace, or, for a float32 D, in place in D
where that is the only scheme), so it is as deterministic as the heuristic's candidates.
"""
from __future__ import annotations

import math
from typing import Iterator

import numpy as np

# Split counts searched. Fewer parts are the heuristic's own candidates already, and they are
# the slowest configurations to time for these products: an unsplit one took 1,896 µs for
# ConvNeXt's 384 x 96 x 32768, where 16 and 32 parts won (103 and 92.5 µs).
SPLITS = (4, 8, 16, 32)
MIN_K_PER_SPLIT = 256      # a part shorter than this costs more in the reduction than it saves
MAX_TILES = 64             # D's 128 x 128 tiles below which the GPU's 132 SMs sit mostly idle
MIN_K = 2048
HALF_MAX_TILES = 4         # bf16 / float16: results of at most this many tiles
MAX_CANDIDATES = 160       # configurations timed per problem at most (the setup it costs)


def wanted(spec) -> bool:
    """Whether `spec` is a GEMM deep and narrow enough for its other configurations to be
    worth timing: float32 up to MAX_TILES tiles, 16-bit operands up to HALF_MAX_TILES.
    Accumulating GEMMs are never autotuned (repeated calls would change D)."""
    tiles = math.ceil(spec.m / 128) * math.ceil(spec.n / 128)
    limit = {"float32": MAX_TILES, "bfloat16": HALF_MAX_TILES,
             "float16": HALF_MAX_TILES}.get(spec.dtype, 0)
    return (spec.batch == 1 and not spec.accumulate and tiles <= limit
            and spec.k >= MIN_K)


def splits_for(k: int) -> tuple[int, ...]:
    return tuple(s for s in SPLITS if k // s >= MIN_K_PER_SPLIT)


def configurations(lt, handle: int, p, types: tuple[int, int, int, int],
                   splits: tuple[int, ...]) -> Iterator[tuple[str, np.ndarray]]:
    """(description, heuristic-result row of p.heuristic's dtype) of every configuration
    cuBLASLt accepts for the planned GEMM p: each algorithm id for `types` (compute, scale,
    A/B and D data types), each tile and stage count its capabilities list, each of `splits`
    where it can split K."""
    compute, scale, ab_type, d_type = types
    cap, config = lt.MatmulAlgoCapAttribute, lt.MatmulAlgoConfigAttribute
    in_compute, in_place = int(lt.ReductionScheme.COMPUTE_TYPE), int(lt.ReductionScheme.INPLACE)
    a_lay, b_lay, d_lay = p.layouts
    offset = p.heuristic.dtype.fields["algo"][1]
    ids = lt.matmul_algo_get_ids(handle, compute, scale, ab_type, ab_type, d_type, d_type, 256)
    for algo_id in ids:
        algo = np.zeros(1, lt.matmul_algo_dtype)
        try:
            lt.matmul_algo_init(handle, compute, scale, ab_type, ab_type, d_type, d_type,
                                int(algo_id), algo.ctypes.data)
            tiles = _cap(lt, algo, cap.TILE_IDS, np.uint32)
            stages = _cap(lt, algo, cap.STAGES_IDS, np.uint32)
            can_split = _cap(lt, algo, cap.SPLITK_SUPPORT, np.int32)
            schemes = _cap(lt, algo, cap.REDUCTION_SCHEME_MASK, np.uint32)
        except lt.cuBLASLtError:
            continue
        scheme = in_compute if len(schemes) and schemes[0] & in_compute else in_place
        if scheme == in_place and p.spec.out_dtype != "float32":
            split_counts = (1,)       # 16-bit D: no parts added in 16 bits (gemm.py)
        else:
            split_counts = splits if len(can_split) and can_split[0] else (1,)
        for tile in (tiles if len(tiles) else [0]):
            for stage in (stages if len(stages) else [0]):
                for split in split_counts:
                    row = np.zeros(1, dtype=p.heuristic.dtype)
                    row.view(np.uint8)[offset:offset + algo.nbytes] = algo.view(np.uint8)
                    where = row.ctypes.data + offset
                    check = np.zeros(1, dtype=p.heuristic.dtype)
                    try:
                        for attr, value in ((config.TILE_ID, tile), (config.STAGES_ID, stage),
                                            (config.SPLITK_NUM, split),
                                            (config.REDUCTION_SCHEME,
                                             scheme if split > 1 else 0)):
                            _put(lt, where, attr, int(value))
                        lt.matmul_algo_check(handle, p.desc, a_lay, b_lay, d_lay, d_lay, where,
                                             check.ctypes.data)
                    except lt.cuBLASLtError:
                        continue                 # this configuration refused for p
                    row["workspace_size"], row["state"] = check["workspace_size"], check["state"]
                    yield (f"id {int(algo_id)} tile {int(tile)} stages {int(stage)} "
                           f"split {split}"), row


def candidates(lt, handle: int, p, types: tuple[int, int, int, int]) -> np.ndarray:
    """Rows of p.heuristic's dtype: the first MAX_CANDIDATES configurations of p that the
    heuristic did not offer."""
    seen = {offered["algo"].tobytes() for offered in p.heuristic}
    found = []
    for _, row in configurations(lt, handle, p, types, splits_for(p.spec.k)):
        key = row["algo"].tobytes()
        if key not in seen:
            seen.add(key)
            found.append(row)
            if len(found) == MAX_CANDIDATES:
                break
    return np.concatenate(found) if found else p.heuristic[:0].copy()


def _cap(lt, algo: np.ndarray, attr, dtype) -> np.ndarray:
    """A capability of an initialised algorithm, as an array of `dtype` (its length asked
    first)."""
    written = np.zeros(1, np.uint64)
    lt.matmul_algo_cap_get_attribute(algo.ctypes.data, attr, 0, 0, written.ctypes.data)
    count = int(written[0]) // np.dtype(dtype).itemsize
    buf = np.zeros(max(1, count), dtype)
    lt.matmul_algo_cap_get_attribute(algo.ctypes.data, attr, buf.ctypes.data, buf.nbytes,
                                     written.ctypes.data)
    return buf[:count]


def _put(lt, algo: int, attr, value: int) -> None:
    buf = np.array(value, dtype=lt.get_matmul_algo_config_attribute_dtype(attr))
    lt.matmul_algo_config_set_attribute(algo, attr, buf.ctypes.data, buf.itemsize)
