// The multi-tensor permute gather of broadcast.cu's permute_group_kernel and optim.cu's
// weight_copies_permute_kernel: each tensor described by a row of PERMUTE_ENTRY_WIDTH (int64)
// entries: source, destination, n, the dims o1..o3 of the transposed shape (?, o1, o2, o3;
// padded in front with size 1), s0..s3 their strides in the source (elements), and the
// (m, l) division pairs of o3, o2, o1 (divide.cuh); a block walks `chunk` elements of one
// destination in row-major order. Index arithmetic in 32 bits (a tensor has fewer than 2^31
// elements, launcher-checked): 64-bit divisions made the gather several times slower than its
// memory traffic, and 32-bit ones still left it bound by the arithmetic.
#pragma once

#include "divide.cuh"

#define PERMUTE_ENTRY_WIDTH 16

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
