// GEMMs too small to fill the GPU: C (m, n) = op(A) @ op(B) [+ addend] [+ bias along n]
// [activation].
// cuBLASLt spends 5-10 µs on a 128x10x512 product (a grid of one or two tiles plus split-K
// kernels); here every output element has one owner that runs its whole dot product, so one
// launch does it in a few µs and the sum order is fixed (deterministic).
// Operands are addressed through strides, so transposed operands need no copy:
// A(i, k) = a[i * a_i + k * a_k], B(k, j) = b[k * b_k + j * b_j], C row-major.
// The small kernels are templates on the operands' storage S and the outputs' D (float, or
// bf16 as unsigned short bits; bias, addend, c and z share D): they compute in float32
// whatever the storage, so a bf16 linear rounds y and z once each as it stores them, from
// registers, with no float32 scratch (linear.py's cuBLASLt path needs one where its epilogues
// fall short).
#include "launch_order.cuh"
#include "matmul_epilogue.cuh"
#include "reduce.cuh"

// Short dot products (k up to a few dozen): one thread per output. Index math in 32 bits
// (small_matmul.py launches m * n < 2^31 outputs). The loads of TAPS consecutive k issue
// together; the FMAs still run in k order, so the sum order is the plain loop's. A product of
// two bf16 values is exact in float32, so each fmaf rounds only the sum, as numpy's float32
// multiply then add does.
constexpr int TAPS = 8;

template <typename S, typename D>
__global__ void small_matmul_thread_kernel(
        const S* a, const S* b, const D* bias, const D* addend, D* c, D* z, int m, int n, int k,
        long long a_i, long long a_k, long long b_k, long long b_j, int act, float slope) {
    await_previous_kernel();
    const int total = m * n;
    for (int idx = blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += gridDim.x * blockDim.x) {
        const int i = idx / n, j = idx % n;
        const S* ap = a + i * a_i;
        const S* bp = b + j * b_j;
        float acc = 0.f;
        int kk = 0;
        for (; kk + TAPS <= k; kk += TAPS) {
            float av[TAPS], bv[TAPS];
#pragma unroll
            for (int u = 0; u < TAPS; ++u) {
                av[u] = load_as_float(ap, (kk + u) * a_k);
                bv[u] = load_as_float(bp, (kk + u) * b_k);
            }
#pragma unroll
            for (int u = 0; u < TAPS; ++u) acc = fmaf(av[u], bv[u], acc);
        }
        for (; kk < k; ++kk)
            acc = fmaf(load_as_float(ap, kk * a_k), load_as_float(bp, kk * b_k), acc);
        finish_output(acc, idx, j, bias, addend, c, z, act, slope);
    }
}

// Long dot products: one warp per output, lanes stride over k, then a fixed shuffle tree.
template <typename S, typename D>
__global__ void small_matmul_warp_kernel(
        const S* a, const S* b, const D* bias, const D* addend, D* c, D* z, int m, int n, int k,
        long long a_i, long long a_k, long long b_k, long long b_j, int act, float slope) {
    await_previous_kernel();
    const long long total = (long long)m * n;
    const int lane = threadIdx.x & 31;
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    for (long long idx = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5; idx < total;
         idx += warps) {
        const int i = (int)(idx / n), j = (int)(idx % n);
        const S* ap = a + i * a_i;
        const S* bp = b + j * b_j;
        float acc = 0.f;
        for (int kk = lane; kk < k; kk += 32)
            acc = fmaf(load_as_float(ap, kk * a_k), load_as_float(bp, kk * b_k), acc);
        acc = warp_sum(acc);
        if (lane == 0) finish_output(acc, idx, j, bias, addend, c, z, act, slope);
    }
}
