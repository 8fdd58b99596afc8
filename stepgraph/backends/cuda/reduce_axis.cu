// Reduce family: max / min along one axis and its gradient, topk, cumsum. x is viewed as
// (outer, N, inner) around the axis; one thread owns each line (o, b) and walks its N
// elements, which keeps every result deterministic (cumsum adds in float64, in order). Along
// the last axis (inner = 1) a thread per line would read strided memory, so max / min and
// the top 1 (max / argmax with a dim) run a warp per row there, reading it coalesced.
// topk selects by a total order, value first and then the lower index, so ties come out in
// index order as the NumPy reference's stable sort gives them.

// y[o, b] = max (MAX) or min of x[o, :, b].
#include "launch_order.cuh"
template <typename T, bool MAX>
__global__ void reduce_max_forward_kernel(const T* x, T* y, long long lines, int N,
                                          long long inner) {
    await_previous_kernel();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < lines;
         i += (long long)gridDim.x * blockDim.x) {
        const T* line = x + (i / inner) * N * inner + i % inner;
        T best = line[0];
        for (int n = 1; n < N; ++n) {
            const T v = line[(long long)n * inner];
            best = MAX ? (v > best ? v : best) : (v < best ? v : best);
        }
        y[i] = best;
    }
}

// dx[o, n, b] = dy[o, b] / count where x[o, n, b] == y[o, b], else 0; count = the matches.
template <typename T>
__global__ void reduce_max_backward_kernel(const T* dy, const T* x, const T* y, T* dx,
                                           long long lines, int N, long long inner) {
    await_previous_kernel();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < lines;
         i += (long long)gridDim.x * blockDim.x) {
        const long long base = (i / inner) * N * inner + i % inner;
        const T target = y[i];
        int count = 0;
        for (int n = 0; n < N; ++n) count += x[base + (long long)n * inner] == target;
        const T share = dy[i] / (T)count;
        for (int n = 0; n < N; ++n) {
            const long long at = base + (long long)n * inner;
            dx[at] = x[at] == target ? share : (T)0;
        }
    }
}

#define FULL_MASK 0xffffffffu

// y[r] = max (MAX) or min of the row x[r, :] (N >= 1); a warp per row.
template <typename T, bool MAX>
__global__ void reduce_max_rows_kernel(const T* x, T* y, long long rows, int N) {
    await_previous_kernel();
    const int lane = threadIdx.x & 31;
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    for (long long r = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5; r < rows;
         r += warps) {
        const T* line = x + r * N;
        T best = line[lane < N ? lane : 0];
        for (int n = lane + 32; n < N; n += 32) {
            const T v = line[n];
            best = MAX ? (v > best ? v : best) : (v < best ? v : best);
        }
        for (int offset = 16; offset > 0; offset >>= 1) {
            const T v = __shfl_down_sync(FULL_MASK, best, offset);
            best = MAX ? (v > best ? v : best) : (v < best ? v : best);
        }
        if (lane == 0) y[r] = best;
    }
}

// Whether (a, ia) comes before (b, ib): the larger (or smaller) value first, then the lower
// index.
template <typename T>
__device__ __forceinline__ bool before(T a, int ia, T b, int ib, bool largest) {
    if (a != b) return largest ? a > b : a < b;
    return ia < ib;
}

// values / indices (outer, K, inner): the first K elements of each line x[o, :, b] in that
// order, found by K passes that each take the first element after the previous pick.
template <typename T>
__global__ void topk_forward_kernel(const T* x, T* values, long long* indices, long long lines,
                                    int N, long long inner, int K, int largest) {
    await_previous_kernel();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < lines;
         i += (long long)gridDim.x * blockDim.x) {
        const long long o = i / inner, b = i % inner;
        const T* line = x + o * N * inner + b;
        T last = 0;
        int last_index = -1;
        for (int k = 0; k < K; ++k) {
            int pick = -1;
            T best = 0;
            for (int n = 0; n < N; ++n) {
                const T v = line[(long long)n * inner];
                if (last_index >= 0 && !before(last, last_index, v, n, largest)) continue;
                if (pick < 0 || before(v, n, best, pick, largest)) { pick = n; best = v; }
            }
            const long long at = (o * K + k) * inner + b;
            values[at] = best;
            indices[at] = pick;
            last = best;
            last_index = pick;
        }
    }
}

// values[r], indices[r] = the first element of row x[r, :] in topk's order (N >= 1); a warp
// per row, each lane's best of its elements combined by shuffles.
template <typename T>
__global__ void top1_rows_kernel(const T* x, T* values, long long* indices, long long rows,
                                 int N, int largest) {
    await_previous_kernel();
    const int lane = threadIdx.x & 31;
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    for (long long r = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5; r < rows;
         r += warps) {
        const T* line = x + r * N;
        int pick = lane < N ? lane : 0;
        T best = line[pick];
        for (int n = lane + 32; n < N; n += 32)
            if (before(line[n], n, best, pick, largest)) { best = line[n]; pick = n; }
        for (int offset = 16; offset > 0; offset >>= 1) {
            const T v = __shfl_down_sync(FULL_MASK, best, offset);
            const int i = __shfl_down_sync(FULL_MASK, pick, offset);
            if (before(v, i, best, pick, largest)) { best = v; pick = i; }
        }
        if (lane == 0) {
            values[r] = best;
            indices[r] = pick;
        }
    }
}

// y[o, n, b] = sum of x[o, m, b] over m <= n (reverse: m >= n), accumulated in float64.
template <typename T>
__global__ void cumsum_forward_kernel(const T* x, T* y, long long lines, int N, long long inner,
                                      int reverse) {
    await_previous_kernel();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < lines;
         i += (long long)gridDim.x * blockDim.x) {
        const long long base = (i / inner) * N * inner + i % inner;
        double acc = 0.0;
        for (int s = 0; s < N; ++s) {
            const long long at = base + (long long)(reverse ? N - 1 - s : s) * inner;
            acc += (double)x[at];
            y[at] = (T)acc;
        }
    }
}
