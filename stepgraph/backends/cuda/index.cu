// Index family: concat (each input copied into its place along one axis), gather along one
// axis and its gradient, and the triangular masks of tril / triu.
// concat moves units U of 1, 2, 4, 8 or 16 bytes (as slice in shape.cu: whole runs, inner one
// unit) and triangle raw elements (U: an unsigned type of the element's size), so both serve
// every dtype. gather_backward gives each dx element one owner that adds its dy terms
// in index order: deterministic, no atomics.

// y (outer, D, inner)[:, offset:offset + L, :] = x (outer, L, inner); inner in units U.
#include "launch_order.cuh"
template <typename U>
__global__ void concat_forward_kernel(const U* x, U* y, long long total, int L, long long inner,
                                      int D, int offset) {
    await_previous_kernel();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long row = i / inner, in = i - row * inner;
        const long long o = row / L, l = row - o * L;
        y[(o * D + offset + l) * inner + in] = x[i];
    }
}

// y (outer, K, inner)[o, k, b] = x (outer, N, inner)[o, index[o, k, b], b]; 0 out of range.
template <typename T, typename I>
__global__ void gather_forward_kernel(const T* x, const I* index, T* y, long long total, int K,
                                      long long inner, int N) {
    await_previous_kernel();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long b = i % inner, o = i / inner / K;
        const long long n = (long long)index[i];
        y[i] = (n >= 0 && n < N) ? x[(o * N + n) * inner + b] : (T)0;
    }
}

// dx (outer, N, inner)[o, n, b] = sum over k with index[o, k, b] == n of dy[o, k, b].
template <typename T, typename I>
__global__ void gather_backward_kernel(const T* dy, const I* index, T* dx, long long total,
                                       int K, long long inner, int N) {
    await_previous_kernel();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long b = i % inner, row = i / inner, o = row / N, n = row - o * N;
        T acc = 0;
        for (int k = 0; k < K; ++k) {
            const long long at = (o * K + k) * inner + b;
            if ((long long)index[at] == n) acc += dy[at];
        }
        dx[i] = acc;
    }
}

// y = x over the last two axes (R, C) where c - r <= diagonal (lower) or >= (upper), else 0.
template <typename U>
__global__ void triangle_forward_kernel(const U* x, U* y, long long total, int R, int C,
                                        int diagonal, int upper) {
    await_previous_kernel();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long c = i % C, r = (i / C) % R, off = c - r;
        const bool keep = upper ? off >= diagonal : off <= diagonal;
        y[i] = keep ? x[i] : U();
    }
}
