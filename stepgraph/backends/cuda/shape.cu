// Shape ops that move bytes: slice (a contiguous copy of x[..., start:stop:step, ...] along one
// dim) and its gradient (zeros with dy placed), and arange. x is viewed as (outer, D, inner)
// around the sliced dim, the slice as (outer, L, inner). Slices copy units U of 1, 2, 4, 8 or 16
// bytes, so every dtype is served; a step-1 slice is launched as a slice of whole runs (inner
// one unit, L, D and start counted in units: shape.py runs_in_units), so a last-axis slice of
// bf16 channels moves 16 bytes a thread too; zeros are all-zero bits (0.0 of every float type).

// y (outer, L, inner) = x[:, start:start + L * step:step, :] with x (outer, D, inner); inner
// in units.
#include "launch_order.cuh"
template <typename U>
__global__ void slice_forward_kernel(const U* x, U* y, long long total, int L, long long inner,
                                     int D, int start, int step) {
    await_previous_kernel();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long row = i / inner, in = i - row * inner;
        const long long o = row / L, l = row - o * L;
        y[i] = x[(o * D + start + l * step) * inner + in];
    }
}

// dx (outer, D, inner) = dy (outer, L, inner) at [:, start:start + L * step:step, :], zero
// elsewhere.
template <typename U>
__global__ void slice_backward_kernel(const U* dy, U* dx, long long total, int L,
                                      long long inner, int D, int start, int step) {
    await_previous_kernel();
    const U zero = U();   // value-initialised: all-zero bits, uint4 included
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long row = i / inner, in = i - row * inner;
        const long long o = row / D, d = row - o * D - start, l = d / step;
        dx[i] = (d >= 0 && d == l * step && l < L) ? dy[(o * L + l) * inner + in] : zero;
    }
}

// y[i] = i.
template <typename T>
__global__ void arange_forward_kernel(T* y, long long n) {
    await_previous_kernel();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        y[i] = (T)i;
}
