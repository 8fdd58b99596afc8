// Mid-size float32 GEMMs with few rows, through 64 x 64 tiles with the k range split over
// blocks (small_matmul.py tile_matmul_forward; linear.py times them against cuBLASLt). A file
// apart from small_matmul.cu's templates: these two kernels alone take ~0.5 s to compile, and
// every module of a file compiles its plain kernels.
#include "launch_order.cuh"
#include "matmul_epilogue.cuh"

// Mid-size GEMMs with few rows (a batch of 128): cuBLASLt's fp32 kernels tile 128 x 128 or
// larger, so a 128 x 512 output keeps 4 SMs busy, and its split-K variants add kernels. Here
// a block computes a TILE_M x TILE_N tile over one range of k (blockIdx.z: the split); its
// 256 threads keep 4 x 4 register tiles, k advances TILE_K at a time through shared memory,
// and the next step's global loads are issued before the current step's FMAs. One split:
// the block applies the epilogue. Several: each writes its partial tile, and
// tile_matmul_finish_kernel adds the splits in order before the epilogue. Sum order of an
// output: k ascending within a split, then the splits in order. Index math in 32 bits
// (small_matmul.py checks the sizes). float32 only: linear.py times it against cuBLASLt's
// fp32 kernels; bf16 products of this size run on cuBLASLt's tensor cores.
constexpr int TILE_M = 64, TILE_N = 64, TILE_K = 16, TILE_THREADS = 256;
constexpr int TILE_PAD = 4;   // keeps float4 rows aligned and spreads the staging stores

extern "C" __global__ void __launch_bounds__(TILE_THREADS)
tile_matmul_kernel(const float* a, const float* b, const float* bias, const float* addend,
                   float* c, float* z, float* partial, int m, int n, int k, int k_split,
                   long long a_i, long long a_k, long long b_k, long long b_j, int act,
                   float slope) {
    await_previous_kernel();
    __shared__ __align__(16) float as[TILE_K][TILE_M + TILE_PAD];   // as[kk][i]
    __shared__ __align__(16) float bs[TILE_K][TILE_N + TILE_PAD];   // bs[kk][j]
    constexpr int PER_THREAD = TILE_K * TILE_M / TILE_THREADS;     // staged values (4)
    const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;      // rows ty*4.., cols tx*4..
    const int i0 = blockIdx.y * TILE_M, j0 = blockIdx.x * TILE_N;
    const int k_begin = blockIdx.z * k_split, k_end = min(k, k_begin + k_split);
    // Consecutive threads stage along the operand's contiguous direction (k for a row-major
    // A, i for a transposed one; likewise j or k for B), so the global loads coalesce. Each
    // thread's staging slots are fixed: their offsets are computed once, outside the k loop.
    const bool a_along_k = a_k == 1, b_along_j = b_j == 1;
    long long a_at[PER_THREAD], b_at[PER_THREAD];     // global offsets at k = 0
    int a_kk[PER_THREAD], b_kk[PER_THREAD];           // the slot's k within a step
    int a_st[PER_THREAD], b_st[PER_THREAD];           // shared-memory offsets
#pragma unroll
    for (int u = 0; u < PER_THREAD; ++u) {
        const int e = tid + u * TILE_THREADS;
        const int kk = a_along_k ? e % TILE_K : e / TILE_M;
        const int ii = a_along_k ? e / TILE_K : e % TILE_M;
        a_kk[u] = i0 + ii < m ? kk : TILE_K + k;      // past k_end: a row outside reads 0
        a_at[u] = (i0 + ii) * a_i + kk * a_k;
        a_st[u] = kk * (TILE_M + TILE_PAD) + ii;
        const int kb = b_along_j ? e / TILE_N : e % TILE_K;
        const int jj = b_along_j ? e % TILE_N : e / TILE_K;
        b_kk[u] = j0 + jj < n ? kb : TILE_K + k;
        b_at[u] = kb * b_k + (j0 + jj) * b_j;
        b_st[u] = kb * (TILE_N + TILE_PAD) + jj;
    }
    float ra[PER_THREAD], rb[PER_THREAD];
    auto load = [&](int k0) {
#pragma unroll
        for (int u = 0; u < PER_THREAD; ++u) {
            ra[u] = k0 + a_kk[u] < k_end ? a[a_at[u] + k0 * a_k] : 0.f;
            rb[u] = k0 + b_kk[u] < k_end ? b[b_at[u] + k0 * b_k] : 0.f;
        }
    };
    auto store = [&]() {
#pragma unroll
        for (int u = 0; u < PER_THREAD; ++u) {
            (&as[0][0])[a_st[u]] = ra[u];
            (&bs[0][0])[b_st[u]] = rb[u];
        }
    };

    float acc[4][4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
#pragma unroll
        for (int s = 0; s < 4; ++s) acc[r][s] = 0.f;
    }
    if (k_begin < k_end) load(k_begin);
    for (int k0 = k_begin; k0 < k_end; k0 += TILE_K) {
        store();
        __syncthreads();
        if (k0 + TILE_K < k_end) load(k0 + TILE_K);   // in flight during the FMAs below
        // Step kk + 1's shared-memory reads are issued before step kk's FMAs.
        float4 av = *reinterpret_cast<const float4*>(&as[0][ty * 4]);
        float4 bv = *reinterpret_cast<const float4*>(&bs[0][tx * 4]);
#pragma unroll
        for (int kk = 0; kk < TILE_K; ++kk) {
            float4 an = av, bn = bv;
            if (kk + 1 < TILE_K) {
                an = *reinterpret_cast<const float4*>(&as[kk + 1][ty * 4]);
                bn = *reinterpret_cast<const float4*>(&bs[kk + 1][tx * 4]);
            }
            const float ar[4] = {av.x, av.y, av.z, av.w}, br[4] = {bv.x, bv.y, bv.z, bv.w};
#pragma unroll
            for (int r = 0; r < 4; ++r) {
#pragma unroll
                for (int s = 0; s < 4; ++s) acc[r][s] = fmaf(ar[r], br[s], acc[r][s]);
            }
            av = an;
            bv = bn;
        }
        __syncthreads();
    }

#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const int i = i0 + ty * 4 + r;
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            const int j = j0 + tx * 4 + s;
            if (i >= m || j >= n) continue;
            if (gridDim.z == 1)
                finish_output(acc[r][s], i * n + j, j, bias, addend, c, z, act, slope);
            else partial[(blockIdx.z * m + i) * n + j] = acc[r][s];
        }
    }
}

// c = epilogue(sum over splits s ascending of partial[s]) for tile_matmul_kernel's splits.
extern "C" __global__ void tile_matmul_finish_kernel(const float* partial, int splits,
                                                     const float* bias, const float* addend,
                                                     float* c, float* z, int m, int n, int act,
                                                     float slope) {
    await_previous_kernel();
    const int total = m * n;
    for (int idx = blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += gridDim.x * blockDim.x) {
        float acc = 0.f;
        for (int s = 0; s < splits; ++s) acc += partial[s * total + idx];
        finish_output(acc, idx, idx % n, bias, addend, c, z, act, slope);
    }
}
