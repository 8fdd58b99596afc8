// softmax and its gradient over the last axis of any rank, viewed as (rows, cols) rows. The
// layout of loss.cu's log_softmax kernels: a row is handled by a group of blockDim.x threads
// (a warp up to 1024 columns, more for longer rows, fewer lanes for rows of at most 16),
// blockDim.y rows per block, rows strided over the grid. Row sums and maxima combine in a
// fixed order (reduce.cuh): deterministic.
// The scaled kernels add attrs scale and causal (softmax(scale * x + mask)): the softmax and
// softmax_grad kernels above them stay the plain ones, so attr-less nodes keep their bits.
// Templates on the storage T of x, y, dy and dx (one storage a launch): float, or fp16_bits
// (float16, a model.half()), widened on load, computed in float32 as the float kernels do, and
// each output rounded once on store.
#include "launch_order.cuh"
#include "reduce.cuh"

// y = exp(x - max) / sum(exp(x - max)) per row (the division IEEE-rounded, as numpy's).
template <typename T>
__global__ void softmax_forward_kernel(const T* x, T* y, int N, int C) {
    await_previous_kernel();
    __shared__ float smem[32];
    for (long long base = first_row_base(); base < N; base += row_base_stride()) {
        const int row = (int)base + threadIdx.y;
        const int cols = row < N ? C : 0;
        const T* xr = x + (long long)row * C;
        const float m = row_max_of(xr, cols, smem);
        const float s = row_sum_exp(xr, cols, m, smem);
        for (int c = threadIdx.x; c < cols; c += blockDim.x)
            store_from_float(y, (long long)row * C + c,
                             __fdiv_rn(expf(load_as_float(xr, c) - m), s));
    }
}

// dx = y * (dy - sum(dy * y)) per row.
template <typename T>
__global__ void softmax_backward_kernel(const T* dy, const T* y, T* dx, int N, int C) {
    await_previous_kernel();
    __shared__ float smem[32];
    for (long long base = first_row_base(); base < N; base += row_base_stride()) {
        const int row = (int)base + threadIdx.y;
        const int cols = row < N ? C : 0;
        const long long r0 = (long long)row * C;
        float s = 0.f;
        for (int c = threadIdx.x; c < cols; c += blockDim.x)
            s += __fmul_rn(load_as_float(dy, r0 + c), load_as_float(y, r0 + c));
        s = row_sum(s, smem);
        for (int c = threadIdx.x; c < cols; c += blockDim.x)
            store_from_float(dx, r0 + c, __fmul_rn(load_as_float(y, r0 + c),
                                                   load_as_float(dy, r0 + c) - s));
    }
}

// Columns a row sees: all C, or under the causal mask (rows of the last two dims, R of them)
// row r's columns c <= r + (C - R) (PyTorch's is_causal: tril of ones(R, C) aligned to the
// bottom right). 0 for rows past N. The launcher keeps R <= C, so no row is fully masked.
__device__ __forceinline__ int visible_columns(int row, int N, int C, int R, int causal) {
    if (row >= N) return 0;
    if (!causal) return C;
    return min(C, row % R + (C - R) + 1);
}

// y = softmax(scale * x) over the visible columns (z = scale * x rounded to float32 first, as
// numpy's float32 product); masked columns are written 0 exactly.
template <typename T>
__global__ void softmax_scaled_forward_kernel(const T* x, T* y, int N, int C, int R,
                                              float scale, int causal) {
    await_previous_kernel();
    __shared__ float smem[32];
    for (long long base = first_row_base(); base < N; base += row_base_stride()) {
        const int row = (int)base + threadIdx.y;
        const int cols = row < N ? C : 0;
        const int limit = visible_columns(row, N, C, R, causal);
        const T* xr = x + (long long)row * C;
        float m = NEG_INF;
        for (int c = threadIdx.x; c < limit; c += blockDim.x)
            m = fmaxf(m, __fmul_rn(scale, load_as_float(xr, c)));
        m = row_max(m, smem);
        float s = 0.f;
        for (int c = threadIdx.x; c < limit; c += blockDim.x)
            s += expf(__fmul_rn(scale, load_as_float(xr, c)) - m);
        s = row_sum(s, smem);
        for (int c = threadIdx.x; c < cols; c += blockDim.x) {
            const float e = c < limit ? expf(__fmul_rn(scale, load_as_float(xr, c)) - m) : 0.f;
            store_from_float(y, (long long)row * C + c, c < limit ? __fdiv_rn(e, s) : 0.f);
        }
    }
}

// dx = scale * (y * (dy - sum(dy * y))) over the visible columns, 0 at masked ones.
template <typename T>
__global__ void softmax_scaled_backward_kernel(const T* dy, const T* y, T* dx, int N, int C,
                                               int R, float scale, int causal) {
    await_previous_kernel();
    __shared__ float smem[32];
    for (long long base = first_row_base(); base < N; base += row_base_stride()) {
        const int row = (int)base + threadIdx.y;
        const int cols = row < N ? C : 0;
        const int limit = visible_columns(row, N, C, R, causal);
        const long long r0 = (long long)row * C;
        float s = 0.f;
        for (int c = threadIdx.x; c < limit; c += blockDim.x)
            s += __fmul_rn(load_as_float(dy, r0 + c), load_as_float(y, r0 + c));
        s = row_sum(s, smem);
        for (int c = threadIdx.x; c < cols; c += blockDim.x) {
            const float d = load_as_float(dy, r0 + c), v = load_as_float(y, r0 + c);
            store_from_float(dx, r0 + c, c < limit ? __fmul_rn(scale, __fmul_rn(v, d - s)) : 0.f);
        }
    }
}
