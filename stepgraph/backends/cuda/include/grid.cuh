// Grid-stride loops shared by the elementwise, broadcast and pooling kernels: each thread
// starts at its global index and strides by the whole grid, so any launch size covers n. And
// the elementwise maps over groups of 4 built on them (elementwise.cu, broadcast.cu).
#pragma once

#include "bf16.cuh"

// i over [0, n), one index a thread per stride.
#define GRID_STRIDE_LOOP(i, n)                                                    \
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (n); \
         i += (long long)gridDim.x * blockDim.x)

// g over the groups of 4 elements of [0, n) (the last group may be partial).
#define GRID_STRIDE_GROUPS(g, n)                                                  \
    for (long long g = blockIdx.x * (long long)blockDim.x + threadIdx.x;          \
         g < (((n) + 3) >> 2); g += (long long)gridDim.x * blockDim.x)

// y[j] = f(x[j]) over [0, n), T the storage (float, or unsigned short = bf16 bits) loaded as
// float and rounded once on store. A group of 4 is one vector access of T when the launcher
// says every pointer is 16-byte aligned (`vec`), else 4 scalar accesses; y may alias x.
template <typename T, typename F>
__device__ __forceinline__ void map_groups(const T* x, T* y, long long n, int vec, F f) {
    GRID_STRIDE_GROUPS(g, n) {
        const long long i = g << 2;
        if (vec && i + 4 <= n) {
            float v[4];
            load4_as_float(x, i, v);
            for (int k = 0; k < 4; ++k) v[k] = f(v[k]);
            store4_from_float(y, i, v);
        } else {
            for (long long j = i; j < i + 4 && j < n; ++j)
                store_from_float(y, j, f(load_as_float(x, j)));
        }
    }
}

// c[j] = f(a[j], b[j]) over [0, n), as map_groups; c may alias a or b.
template <typename T, typename F>
__device__ __forceinline__ void map2_groups(const T* a, const T* b, T* c, long long n, int vec,
                                            F f) {
    GRID_STRIDE_GROUPS(g, n) {
        const long long i = g << 2;
        if (vec && i + 4 <= n) {
            float u[4], v[4];
            load4_as_float(a, i, u);
            load4_as_float(b, i, v);
            for (int k = 0; k < 4; ++k) u[k] = f(u[k], v[k]);
            store4_from_float(c, i, u);
        } else {
            for (long long j = i; j < i + 4 && j < n; ++j)
                store_from_float(c, j, f(load_as_float(a, j), load_as_float(b, j)));
        }
    }
}
