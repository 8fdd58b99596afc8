// The multi-tensor permute gather of broadcast.cu's permute_group_kernel and optim.cu's
// weight_copies_permute_kernel: each tensor described by a row of PERMUTE_ENTRY_WIDTH (int64)
// entries: source, destination, n, the dims o1..o3 of the transposed shape (?, o1, o2, o3;
// padded in front with size 1), and s0..s3 their strides in the source (elements); a block
// walks `chunk` elements of one destination in row-major order. Index arithmetic in 32 bits (a
// tensor has fewer than 2^31 elements, launcher-checked): 64-bit divisions made the gather
// several times slower than its memory traffic.
#pragma once

#define PERMUTE_ENTRY_WIDTH 10

struct PermuteEntry {
    const void* source;
    void* destination;
    unsigned int n, o1, o2, o3, s0, s1, s2, s3;
};

__device__ __forceinline__ PermuteEntry permute_entry(const long long* e) {
    return {(const void*)e[0], (void*)e[1], (unsigned int)e[2], (unsigned int)e[3],
            (unsigned int)e[4], (unsigned int)e[5], (unsigned int)e[6], (unsigned int)e[7],
            (unsigned int)e[8], (unsigned int)e[9]};
}

// f(i, offset in the source of destination element i) for the block's chunk
template <typename F>
__device__ __forceinline__ void permute_chunk(const PermuteEntry& p, unsigned int begin,
                                              unsigned int chunk, F f) {
    const unsigned int end = min(p.n, begin + chunk);
    for (unsigned int i = begin + threadIdx.x; i < end; i += blockDim.x) {
        unsigned int q = i;
        const unsigned int i3 = q % p.o3;
        q /= p.o3;
        const unsigned int i2 = q % p.o2;
        q /= p.o2;
        const unsigned int i1 = q % p.o1;
        const unsigned int i0 = q / p.o1;
        f(i, i0 * p.s0 + i1 * p.s1 + i2 * p.s2 + i3 * p.s3);
    }
}
