// Grid-stride loops shared by the elementwise, broadcast and pooling kernels: each thread
// starts at its global index and strides by the whole grid, so any launch size covers n.
#pragma once

// i over [0, n), one index a thread per stride.
#define GRID_STRIDE_LOOP(i, n)                                                    \
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (n); \
         i += (long long)gridDim.x * blockDim.x)

// g over the groups of 4 elements of [0, n) (the last group may be partial).
#define GRID_STRIDE_GROUPS(g, n)                                                  \
    for (long long g = blockIdx.x * (long long)blockDim.x + threadIdx.x;          \
         g < (((n) + 3) >> 2); g += (long long)gridDim.x * blockDim.x)
