// The multi-tensor permute of broadcast.cu's permute_group_kernel and optim.cu's
// weight_copies_permute_kernel: each tensor described by a row of PERMUTE_ENTRY_WIDTH (int64)
// entries. Two kinds of row (broadcast.py permute_row):
// - a gather: source, destination, n, the dims o1..o3 of the transposed shape (?, o1, o2, o3;
//   padded in front with size 1), s0..s3 their strides in the source (elements), and the
//   (m, l) division pairs of o3, o2, o1 (divide.cuh); a block walks `chunk` elements of one
//   destination in row-major order;
// - a tile (entry 16 set): a batched transpose y (B, R2, R1) = x (B, R1, R2) of a contiguous
//   x (a conv weight to (O, kh, kw, C) and its gradient back are both), a T1 x T2 tile a block
//   through shared memory, so that both the reads and the writes run along memory. The gather
//   read such a source at a stride of kh * kw elements: on an H200 it moved 1.3-2.2 TB/s
//   where a copy moves about 3.5 (docs/perf-notes.md, 2026-12-01).
// Index arithmetic in 32 bits (a tensor has fewer than 2^31 elements, launcher-checked):
// 64-bit divisions made the gather several times slower than its memory traffic.
#pragma once

#include "divide.cuh"

#define PERMUTE_ENTRY_WIDTH 27
#define PERMUTE_TILE_CAPACITY 4096   // floats of a tile with its padding (T1 * (T2 | 1))

struct PermuteEntry {
    const void* source;
    void* destination;
    unsigned int n, o1, o2, o3, s0, s1, s2, s3, m3, l3, m2, l2, m1, l1;
};

__device__ __forceinline__ PermuteEntry permute_entry(const long long* e) {
    return {(const void*)e[0], (void*)e[1], (unsigned int)e[2], (unsigned int)e[3],
            (unsigned int)e[4], (unsigned int)e[5], (unsigned int)e[6], (unsigned int)e[7],
            (unsigned int)e[8], (unsigned int)e[9], (unsigned int)e[10], (unsigned int)e[11],
            (unsigned int)e[12], (unsigned int)e[13], (unsigned int)e[14],
            (unsigned int)e[15]};
}

// f(i, offset in the source of destination element i) for the block's chunk
template <typename F>
__device__ __forceinline__ void permute_chunk(const PermuteEntry& p, unsigned int begin,
                                              unsigned int chunk, F f) {
    const unsigned int end = min(p.n, begin + chunk);
    for (unsigned int i = begin + threadIdx.x; i < end; i += blockDim.x) {
        const unsigned int q3 = divide(i, p.m3, p.l3);
        const unsigned int q2 = divide(q3, p.m2, p.l2);
        const unsigned int i0 = divide(q2, p.m1, p.l1);
        f(i, i0 * p.s0 + (q2 - i0 * p.o1) * p.s1 + (q3 - q2 * p.o2) * p.s2 +
                 (i - q3 * p.o3) * p.s3);
    }
}

// A tile row's fields (entries 16..26): whether the row is one, R1, R2, the tile T1 x T2, the
// tiles along R1 and R2, and the division pairs of T2 and T1.
struct PermuteTile {
    unsigned int tiled, r1, r2, t1, t2, tiles1, tiles2, m2, l2, m1, l1;
};

__device__ __forceinline__ PermuteTile permute_tile_entry(const long long* e) {
    return {(unsigned int)e[16], (unsigned int)e[17], (unsigned int)e[18], (unsigned int)e[19],
            (unsigned int)e[20], (unsigned int)e[21], (unsigned int)e[22], (unsigned int)e[23],
            (unsigned int)e[24], (unsigned int)e[25], (unsigned int)e[26]};
}

// Tile `job` of a tile row: load(offset in x) of its T1 x T2 cells into `cells` (rows padded
// to an odd length: neither pass conflicts on banks), then store(offset in y, value) column
// by column, so consecutive threads read consecutive x and write consecutive y.
template <typename Load, typename Store>
__device__ __forceinline__ void permute_tile(const PermuteTile& t, unsigned int job,
                                             float* cells, Load load, Store store) {
    const unsigned int per_batch = t.tiles1 * t.tiles2;
    const unsigned int b = job / per_batch, rest = job - b * per_batch;
    const unsigned int i1 = rest / t.tiles2, i2 = rest - i1 * t.tiles2;
    const unsigned int row0 = i1 * t.t1, col0 = i2 * t.t2;
    const unsigned int h = min(t.t1, t.r1 - row0), w = min(t.t2, t.r2 - col0);
    const unsigned int base = b * t.r1 * t.r2, pitch = t.t2 | 1u, count = t.t1 * t.t2;
    for (unsigned int k = threadIdx.x; k < count; k += blockDim.x) {
        const unsigned int r = divide(k, t.m2, t.l2), c = k - r * t.t2;
        if (r < h && c < w) cells[r * pitch + c] = load(base + (row0 + r) * t.r2 + col0 + c);
    }
    __syncthreads();
    for (unsigned int k = threadIdx.x; k < count; k += blockDim.x) {
        const unsigned int c = divide(k, t.m1, t.l1), r = k - c * t.t1;
        if (r < h && c < w) store(base + (col0 + c) * t.r1 + row0 + r, cells[r * pitch + c]);
    }
}

// Block blockIdx.x's job of a permute table (jobs: (row, chunk or tile) pairs): load(offset in
// the source) -> float, store(offset in the destination, float).
template <typename Load, typename Store>
__device__ __forceinline__ void permute_job(const long long* entries, const int* jobs,
                                            unsigned int chunk, Load load, Store store) {
    __shared__ float cells[PERMUTE_TILE_CAPACITY];
    const long long* row = entries + jobs[2 * blockIdx.x] * PERMUTE_ENTRY_WIDTH;
    const unsigned int job = (unsigned int)jobs[2 * blockIdx.x + 1];
    const PermuteTile t = permute_tile_entry(row);
    if (t.tiled) {
        permute_tile(t, job, cells, load, store);
        return;
    }
    permute_chunk(permute_entry(row), job * chunk, chunk,
                  [&](unsigned int i, unsigned int at) { store(i, load(at)); });
}
