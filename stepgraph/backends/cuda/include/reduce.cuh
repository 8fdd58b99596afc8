// Deterministic warp, row and block reductions (fixed combination order, no atomics on floats),
// shared by the kernel files. Every block size used with them is a multiple of 32.
#pragma once
#include "bf16.cuh"

#define FULL_MASK 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)

// Butterfly reductions: every lane ends with the same value (a + b == b + a exactly), so all
// lanes of a warp agree bit for bit.
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// The same butterflies over each aligned group of `width` lanes (a power of two, at most 32):
// the rows of a narrow row layout, several to a warp. For width 32 they are warp_sum and
// warp_max; for a row of at most width columns, each lane holding at most one, the lanes a
// wider butterfly would add hold the identity, so a narrower group gives the same value.
template <typename T>
__device__ __forceinline__ T lanes_sum(T v, int width) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        if (o < width) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float lanes_max(float v, int width) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        if (o < width) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

__device__ __forceinline__ int flat_thread() {
    return threadIdx.x + threadIdx.y * blockDim.x;
}

// Sum of v over the whole block; the result is valid in warp 0 (thread 0 writes it out).
// smem holds at least 32 values. Every thread of the block must call it.
template <typename T>
__device__ __forceinline__ T block_sum(T v, T* smem) {
    const int tid = flat_thread();
    const int warps = (blockDim.x * blockDim.y) >> 5;
    v = warp_sum(v);
    __syncthreads();  // an earlier call may still be reading smem
    if ((tid & 31) == 0) smem[tid >> 5] = v;
    __syncthreads();
    T total = T(0);
    if (tid < 32) total = warp_sum(tid < warps ? smem[tid] : T(0));
    return total;
}

// Rows handled by groups of blockDim.x threads (a multiple of 32, or a power of two below it:
// narrow rows, several a warp), blockDim.y rows per block. The result is returned to every
// thread of the row group. Every thread of the block must call these (a uniform branch on
// blockDim.x skips shared memory for rows of one warp or less). row_combine takes each warp's
// already reduced value and combines the row group's warps in order with op.
template <typename Op>
__device__ __forceinline__ float row_combine(float v, float* smem, Op op) {
    if (blockDim.x <= 32) return v;
    const int per_row = blockDim.x >> 5, first = threadIdx.y * per_row;
    __syncthreads();
    if ((threadIdx.x & 31) == 0) smem[first + (threadIdx.x >> 5)] = v;
    __syncthreads();
    float r = smem[first];
    for (int k = 1; k < per_row; ++k) r = op(r, smem[first + k]);
    return r;
}

__device__ __forceinline__ float row_max(float v, float* smem) {
    return row_combine(lanes_max(v, min(blockDim.x, 32u)), smem,
                       [](float a, float b) { return fmaxf(a, b); });
}

__device__ __forceinline__ float row_sum(float v, float* smem) {
    return row_combine(lanes_sum(v, min(blockDim.x, 32u)), smem,
                       [](float a, float b) { return a + b; });
}

// Row loops visit rows base by base: every thread of a block runs the same number of
// iterations (a row past N takes part with no columns), so row reductions may synchronise
// inside them.
__device__ __forceinline__ long long first_row_base() {
    return (long long)blockIdx.x * blockDim.y;
}
__device__ __forceinline__ long long row_base_stride() {
    return (long long)gridDim.x * blockDim.y;
}

// A row's maximum m over its cols values (-inf for cols = 0), and the sum of exp(xr[c] - m):
// the two reductions of a softmax or a logsumexp. Every thread of the block calls them.
// Rows of float or bf16 (bf16.cuh's load_as_float: widened exactly).
template <typename X>
__device__ __forceinline__ float row_max_of(const X* xr, int cols, float* smem) {
    float m = NEG_INF;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, load_as_float(xr, c));
    return row_max(m, smem);
}

template <typename X>
__device__ __forceinline__ float row_sum_exp(const X* xr, int cols, float m, float* smem) {
    float s = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) s += expf(load_as_float(xr, c) - m);
    return row_sum(s, smem);
}

// The "last block finishes" pattern: after each block has written its part, the block that
// arrives last at `counter` sees every other block's writes and does the final pass in a fixed
// order, so the result is deterministic whichever block is last. It resets the counter for the
// next launch (graph replays included): counter starts at 0. Returns true in every thread of
// the last block.
__device__ __forceinline__ bool arrive_last(unsigned int* counter, unsigned int* flag_smem) {
    if (gridDim.x == 1) return true;
    __threadfence();  // publish this thread's writes before the block signals arrival
    __syncthreads();
    if (flat_thread() == 0) *flag_smem = atomicAdd(counter, 1u) == gridDim.x - 1 ? 1u : 0u;
    __syncthreads();
    const bool last = *flag_smem != 0u;
    // Every block has arrived, so the counter can be reset now. Readers of the other blocks'
    // writes use __ldcg (L2), never a possibly stale L1 line.
    if (last && flat_thread() == 0) *counter = 0u;
    if (last) __threadfence();
    return last;
}
