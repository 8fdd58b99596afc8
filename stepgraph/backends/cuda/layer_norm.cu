// LayerNorm over the last axis of x viewed as (rows, C): forward (y, mean, rstd) and backward
// (dx; dweight and dbias through per-block partial sums and a finalize kernel). Statistics in
// float32, two passes over registers (the mean, then the mean of squared deviations),
// rstd = 1 / sqrt(var + eps).
// Row groups: a row is handled by blockDim.x threads (a multiple of 32: one warp for rows up to
// 512 floats, so a row's sums are warp shuffles with no barrier), blockDim.y rows a block, rows
// strided over the grid; sums of a row group of several warps combine in a fixed order
// (reduce.cuh row_sum). Templates <VEC, K>: thread x of a row group owns the column groups
// x + k * blockDim.x, k < K, of VEC floats (float4 loads when VEC is 4), keeps them in registers
// between the passes; weight and bias are read (L1) where they are applied, and the backward
// loads every operand of a row (dy, x, ds, a dropout's keep bytes) before its row sums: the
// kernels are latency-bound at one warp a row, so registers (occupancy) and loads in flight
// decide their speed (docs/perf-notes.md, 2026-12-02 evening).
// Rows wider than K * blockDim.x * VEC columns take the *_loop kernels, which re-read x and dy
// from global memory (L1/L2) and keep the partial sums in global memory.
// Determinism: each block visits a fixed set of rows; the backward sums dy * xhat and dy of its
// rows per thread in registers, adds its row lanes in order through shared memory into the
// block's own row of partial_w / partial_b [blocks, C], and the finalize adds the blocks' rows
// in a fixed order, in float64: no atomics anywhere.
// A backward may also sum the columns of the dx copy it stores last (the half copy where there
// is one, else dx; partial_s, compile/norm_casts.py fuse_norm_grad_bias_sums: the bias gradient
// of the Linear that copy is the output gradient of). Those sums run in shared memory, one row
// per row lane (the launcher asks for them where the block's rows fit it: always with several
// rows a block), or in the loop kernels' partial rows, and reach the finalize as a third
// table: still a fixed order.
// precision="bf16" (compile/norm_casts.py fuse_layer_norm_casts): the forward may write y in bf16
// (Y, rounded once on store: what the cast to bf16 after it did) and the backward may read dy
// in bf16 (DY, widened exactly: what the cast to float32 before it did); x, the statistics,
// the parameters and dx stay float32, as autocast runs layer_norm. The backwards may also
// store dx rounded to H (dx_half, compile/norm_casts.py: the cast to bf16 of the GEMM that
// reads dx), beside the float32 dx or, dx null, in its place. layer_norm's kernels may read
// a bf16 x with float32 parameters (XI, widened as loaded: the cast to float32 that autocast
// put before the norm, compile/norm_casts.py).
// float16 (a model.half(), X = fp16_bits): x, the parameters, y, dx, dweight and dbias are
// float16, loaded as float and each rounded once on store; the statistics, the partial sums
// and all the arithmetic stay float32 (torch's CUDA layer_norm of a half tensor: float
// accumulation, float mean and rstd).
// Residual add + LayerNorm (add_layer_norm, compile/norm_rewrite.py): the forward reads a and
// b, writes s = a + b (rounded to X, as the add it replaces stores it) and normalises that
// rounded s: the same bits as add then layer_norm. The backward is layer_norm's with the
// residual gradient ds added to dx in float32 before the one store. B: b's storage, X's but
// for precision="bf16", where a float32 a and a bf16 / float16 b (the residual branch's GEMM
// output) are widened as loaded, exactly as the cast did. Each kind of kernel (forward,
// backward, their *_loop) is one __device__ body templated on ADD that the layer_norm_* and
// add_layer_norm_* kernels call, so the two normalise and differentiate with the same
// arithmetic. The bodies are RMSNorm's too (CENTER false: no mean taken away, no bias, no
// dbias): rms_norm and add_rms_norm (the residual add before an RMSNorm) are the same
// kernels' other instantiations.
// Dropout folded in (compile/norm_rewrite.py, compile/norm_casts.py): an add_* forward may drop
// b first as the dropout op did (BranchDropout: the same Philox keep mask at b's flat index,
// philox.cuh, written to mask, and b * keep * scale rounded to B); a backward may store its
// half dx copy through a dropout's gradient (HalfDropout: the copy rounded to H, then times
// keep and scale, rounded again: the dropout_grad kernel's arithmetic on the copy it read).
#include "launch_order.cuh"
#include "philox.cuh"
#include "reduce.cuh"

#define LAYER_NORM_MAX_THREADS 512   // threads of a block (layer_norm.py MAX_THREADS)
#define LAYER_NORM_BLOCK_ROWS_THREADS 256   // threads of a block of several rows at most
#define FINALIZE_LANES 32            // slot lanes of a finalize block (layer_norm.py)
// The backward holds dy, xhat and two sums per float of a thread: below 16 floats a thread
// (row groups of at most 256 threads, layer_norm.py row_layout) it is asked to fit 3 blocks of
// 256 threads on an SM (at most 80 registers), which keeps enough loads in flight.
#define LAYER_NORM_BWD_THREADS(F) ((F) < 16 ? LAYER_NORM_BLOCK_ROWS_THREADS : LAYER_NORM_MAX_THREADS)
#define LAYER_NORM_BWD_BLOCKS(F) ((F) < 16 ? 3 : 1)

__device__ __forceinline__ float inverse_std(float var, float eps) {
    return __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(var, eps)));
}

// The row group's sums of a and of b in one exchange (row_sum twice costs two): every thread
// of the block calls it; the result is returned to every thread of the row group.
__device__ __forceinline__ float2 row_sum2(float a, float b, float2* smem) {
    a = warp_sum(a);
    b = warp_sum(b);
    if (blockDim.x == 32) return make_float2(a, b);
    const int per_row = blockDim.x >> 5, first = threadIdx.y * per_row;
    __syncthreads();  // an earlier call may still be reading smem
    if ((threadIdx.x & 31) == 0) smem[first + (threadIdx.x >> 5)] = make_float2(a, b);
    __syncthreads();
    float2 r = smem[first];
    for (int k = 1; k < per_row; ++k) {
        r.x += smem[first + k].x;
        r.y += smem[first + k].y;
    }
    return r;
}

// The backward's row means (mean(g), mean(g * xhat)) of the sums sg and sgh; without CENTER
// (RMSNorm) only the second, mean(g) 0 (sg unused). Every thread of the block calls it.
template <bool CENTER>
__device__ __forceinline__ float2 row_means(float sg, float sgh, float2* sums, int C) {
    if constexpr (CENTER) {
        const float2 t = row_sum2(sg, sgh, sums);
        return make_float2(__fdiv_rn(t.x, (float)C), __fdiv_rn(t.y, (float)C));
    } else {
        return make_float2(0.f,
                           __fdiv_rn(row_sum(sgh, reinterpret_cast<float*>(sums)), (float)C));
    }
}

// v as a store to X then a load give it back: the rounding of a value stored in X.
template <typename X>
__device__ __forceinline__ float stored_as(float v) {
    X t;
    store_from_float(&t, 0, v);
    return load_as_float(&t, 0);
}

// An add_* forward's dropout of b (mask null: none); step is the counter's value.
struct BranchDropout {
    unsigned char* mask;
    long long step;
    unsigned long long seed;
    unsigned int site, threshold;
    float scale;
};

__device__ __forceinline__ BranchDropout branch_dropout(unsigned char* mask, const long long* step,
                                                        unsigned long long seed,
                                                        unsigned int site,
                                                        unsigned int threshold, float scale) {
    return BranchDropout{mask, mask ? *step : 0, seed, site, threshold, scale};
}

// The VEC values v of b at flat index i, dropped: one Philox call per group of four elements
// (i is a multiple of VEC, so a VEC of 4 is one group).
template <int VEC, typename B>
__device__ __forceinline__ void drop_branch(const BranchDropout& d, long long i, float* v) {
    uint4 w = dropout_words((unsigned long long)(i >> 2), d.site, d.step, d.seed);
    unsigned char keep[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
        const long long e = i + j;
        if (j > 0 && (e & 3) == 0)
            w = dropout_words((unsigned long long)(e >> 2), d.site, d.step, d.seed);
        keep[j] = dropout_keep(philox_word(w, (unsigned int)(e & 3)), d.threshold);
        v[j] = stored_as<B>(__fmul_rn(__fmul_rn(v[j], (float)keep[j]), d.scale));
    }
    if constexpr (VEC == 4) {      // i is a multiple of 4: one aligned 4-byte store
        *reinterpret_cast<uchar4*>(d.mask + i) = make_uchar4(keep[0], keep[1], keep[2], keep[3]);
    } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) d.mask[i + j] = keep[j];
    }
}

// A backward's dropout of its half dx copy (mask null: none).
struct HalfDropout {
    const unsigned char* mask;
    float scale;
};

// The keep bytes of VEC (at most 4) elements at i, byte j of the result element i + j's: read
// with the backward's other loads, before its row sums.
template <int VEC>
__device__ __forceinline__ unsigned int keep_bytes(const HalfDropout& drop, long long i) {
    if (!drop.mask) return 0u;
    if constexpr (VEC == 4) return *reinterpret_cast<const unsigned int*>(drop.mask + i);
    unsigned int bits = 0u;
#pragma unroll
    for (int j = 0; j < VEC; ++j) bits |= (unsigned int)drop.mask[i + j] << (8 * j);
    return bits;
}

// sum[0, VEC) += v as stored in T (sum 16-byte aligned for a VEC of 4).
template <int VEC, typename T>
__device__ __forceinline__ void add_stored(float* sum, const float* v) {
    if constexpr (VEC == 4) {
        float4 a = *reinterpret_cast<float4*>(sum);
        a.x += stored_as<T>(v[0]);
        a.y += stored_as<T>(v[1]);
        a.z += stored_as<T>(v[2]);
        a.w += stored_as<T>(v[3]);
        *reinterpret_cast<float4*>(sum) = a;
    } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) sum[j] += stored_as<T>(v[j]);
    }
}

// The half copy of VEC values v of dx through a dropout's gradient `drop`: v rounded to H,
// times keep (the keep bytes `keep`, keep_bytes) and scale; rounded to H again on store.
template <int VEC, typename H>
__device__ __forceinline__ void half_copy(const float* v, const HalfDropout& drop,
                                          unsigned int keep, float* t) {
#pragma unroll
    for (int j = 0; j < VEC; ++j)
        t[j] = __fmul_rn(__fmul_rn(stored_as<H>(v[j]), (float)((keep >> (8 * j)) & 0xFFu)),
                         drop.scale);
}

// A backward's VEC values v of dx at element i: into dx and into its half copy dx_half, each
// where given (either may be null: compile/norm_casts.py).
template <int VEC, typename X, typename H>
__device__ __forceinline__ void store_dx(X* dx, H* dx_half, long long i, const float* v,
                                         const HalfDropout& drop, unsigned int keep) {
    if (dx) storev_from_float<VEC>(dx, i, v);
    if (!dx_half) return;
    if (!drop.mask) {
        storev_from_float<VEC>(dx_half, i, v);
        return;
    }
    float t[VEC];
    half_copy<VEC, H>(v, drop, keep, t);
    storev_from_float<VEC>(dx_half, i, t);
}

// The copy store_dx stores last for v (dx_half's where `half`, else dx's), added as stored to
// the column sums `sum`.
template <int VEC, typename X, typename H>
__device__ __forceinline__ void add_stored_copy(float* sum, const float* v, bool half,
                                                const HalfDropout& drop, unsigned int keep) {
    if (!half || !drop.mask) {
        if (half) add_stored<VEC, H>(sum, v);
        else add_stored<VEC, X>(sum, v);
        return;
    }
    float t[VEC];
    half_copy<VEC, H>(v, drop, keep, t);
    add_stored<VEC, H>(sum, t);
}

// The running column sums of a backward's stored dx copy (partial_s given) in shared memory
// (red: one row of C per row lane; the launcher passes partial_s only where blockDim.y * C
// fits), zeroed. Every thread of the block calls it.
__device__ __forceinline__ void dx_sums_begin(float* red, int C) {
    for (int c = flat_thread(); c < (int)blockDim.y * C; c += blockDim.x * blockDim.y)
        red[c] = 0.f;
    __syncthreads();
}

// The block's row of partial_s: the row lanes' sums in `red` added in lane order. Every thread
// of the block calls it.
__device__ __forceinline__ void dx_sums_end(float* partial_s, const float* red, int C) {
    __syncthreads();
    float* out = partial_s + (long long)blockIdx.x * C;
    for (int c = flat_thread(); c < C; c += blockDim.x * blockDim.y) {
        float s = red[c];
        for (int r = 1; r < blockDim.y; ++r) s += red[r * C + c];
        out[c] = s;
    }
}

// y = (s - mean) * rstd [* weight] [+ bias]; mean and rstd (rows,) per row. s is x (ADD
// false: b and s_out unused; x stored as A) or a + b rounded to X, written to s_out (ADD true;
// b dropped first by `drop` where its mask is given).
// CENTER false (RMSNorm): mean 0, rstd = 1 / sqrt(mean(s^2) + eps), no bias, mean_out unused.
template <bool ADD, typename Y, int VEC, int K, typename X, typename B, typename A = X,
          bool CENTER = true>
__device__ __forceinline__ void layer_norm_forward_rows(const A* a, const B* b, const X* weight,
                                                        const X* bias, Y* y, X* s_out,
                                                        float* mean_out, float* rstd_out,
                                                        int rows, int C, float eps,
                                                        const BranchDropout& drop = {}) {
    __shared__ float smem[32];
    const int groups = C / VEC;
    for (long long base = first_row_base(); base < rows; base += row_base_stride()) {
        const long long row = base + threadIdx.y;
        const bool valid = row < rows;
        const long long r0 = row * C;
        float v[K][VEC];
        float s = 0.f;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int g = threadIdx.x + k * blockDim.x;
            if (valid && g < groups) {
                float t[VEC];
                loadv_as_float<VEC>(a, r0 + (long long)g * VEC, v[k]);
                if constexpr (ADD) {
                    loadv_as_float<VEC>(b, r0 + (long long)g * VEC, t);
                    if (drop.mask) drop_branch<VEC, B>(drop, r0 + (long long)g * VEC, t);
                }
#pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    if constexpr (ADD) v[k][j] = stored_as<X>(__fadd_rn(v[k][j], t[j]));
                    s += v[k][j];
                }
                if constexpr (ADD) storev_from_float<VEC>(s_out, r0 + (long long)g * VEC, v[k]);
            }
        }
        float mean = 0.f;
        if constexpr (CENTER) mean = __fdiv_rn(row_sum(s, smem), (float)C);
        float q = 0.f;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int g = threadIdx.x + k * blockDim.x;
            if (valid && g < groups) {
#pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    if constexpr (CENTER) v[k][j] = __fsub_rn(v[k][j], mean);
                    q = __fmaf_rn(v[k][j], v[k][j], q);
                }
            }
        }
        const float rstd = inverse_std(__fdiv_rn(row_sum(q, smem), (float)C), eps);
        if (!valid) continue;
        if (threadIdx.x == 0) {
            if constexpr (CENTER) mean_out[row] = mean;
            rstd_out[row] = rstd;
        }
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int g = threadIdx.x + k * blockDim.x;
            if (g >= groups) continue;
            // weight and bias from L1 where used: registers held over the row cost occupancy
            float w[VEC], bb[VEC];
            if (weight) loadv_as_float<VEC>(weight, (long long)g * VEC, w);
            if (CENTER && bias) loadv_as_float<VEC>(bias, (long long)g * VEC, bb);
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                float t = __fmul_rn(v[k][j], rstd);
                if (weight) t = __fmul_rn(t, w[j]);
                if (CENTER && bias) t = __fadd_rn(t, bb[j]);
                v[k][j] = t;
            }
            storev_from_float<VEC>(y, r0 + (long long)g * VEC, v[k]);
        }
    }
}

template <typename Y, int VEC, int K, typename X = float, typename XI = X>
__global__ void __launch_bounds__(LAYER_NORM_MAX_THREADS)
layer_norm_forward_kernel(const XI* x, const X* weight, const X* bias, Y* y,
                          float* mean_out, float* rstd_out, int rows, int C, float eps) {
    await_previous_kernel();
    layer_norm_forward_rows<false, Y, VEC, K, X, X, XI>(x, nullptr, weight, bias, y, nullptr,
                                                        mean_out, rstd_out, rows, C, eps);
}

template <typename Y, int VEC, int K, typename X = float, typename B = X>
__global__ void __launch_bounds__(LAYER_NORM_MAX_THREADS)
add_layer_norm_forward_kernel(const X* a, const B* b, const X* weight, const X* bias, Y* y,
                              X* s_out, float* mean_out, float* rstd_out, int rows, int C,
                              float eps, const long long* step, unsigned char* mask,
                              unsigned long long seed, unsigned int site,
                              unsigned int threshold, float scale) {
    await_previous_kernel();
    layer_norm_forward_rows<true, Y, VEC, K, X, B>(
        a, b, weight, bias, y, s_out, mean_out, rstd_out, rows, C, eps,
        branch_dropout(mask, step, seed, site, threshold, scale));
}

template <typename Y, int VEC, int K, typename X = float>
__global__ void __launch_bounds__(LAYER_NORM_MAX_THREADS)
rms_norm_forward_kernel(const X* x, const X* weight, Y* y, float* rstd_out, int rows, int C,
                        float eps) {
    await_previous_kernel();
    layer_norm_forward_rows<false, Y, VEC, K, X, X, X, false>(
        x, nullptr, weight, nullptr, y, nullptr, nullptr, rstd_out, rows, C, eps);
}

template <typename Y, int VEC, int K, typename X = float, typename B = X>
__global__ void __launch_bounds__(LAYER_NORM_MAX_THREADS)
add_rms_norm_forward_kernel(const X* a, const B* b, const X* weight, Y* y, X* s_out,
                            float* rstd_out, int rows, int C, float eps, const long long* step,
                            unsigned char* mask, unsigned long long seed, unsigned int site,
                            unsigned int threshold, float scale) {
    await_previous_kernel();
    layer_norm_forward_rows<true, Y, VEC, K, X, B, X, false>(
        a, b, weight, nullptr, y, s_out, nullptr, rstd_out, rows, C, eps,
        branch_dropout(mask, step, seed, site, threshold, scale));
}

// The block's row of partial [blocks, C]: acc (this thread's columns, summed over the rows of
// its row lane) added over the block's row lanes in lane order. red holds blockDim.y * C
// floats (a block of several rows has at most LAYER_NORM_BLOCK_ROWS_THREADS threads). Every
// thread of the block calls it.
template <int VEC, int K>
__device__ __forceinline__ void store_block_partial(const float (&acc)[K][VEC], float* partial,
                                                    float* red, int groups, int C) {
    if (!partial) return;
    float* out = partial + (long long)blockIdx.x * C;
    if (blockDim.y == 1) {
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int g = threadIdx.x + k * blockDim.x;
            if (g < groups) storev_from_float<VEC>(out, (long long)g * VEC, acc[k]);
        }
        return;
    }
    __syncthreads();  // an earlier call may still be reading red
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int g = threadIdx.x + k * blockDim.x;
        if (g < groups)
            storev_from_float<VEC>(red, (long long)threadIdx.y * C + g * VEC, acc[k]);
    }
    __syncthreads();
    for (int c = flat_thread(); c < C; c += blockDim.x * blockDim.y) {
        float s = red[c];
        for (int r = 1; r < blockDim.y; ++r) s += red[r * C + c];
        out[c] = s;
    }
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) [+ ds], g = dy [* weight], xhat = (x -
// mean) * rstd (x: add_layer_norm's s); ds (ADD true) added in float32 before the one store
// (the half copy, where given, through `drop`).
// Block b sums dy * xhat and dy over its rows into row b of partial_w / partial_b [gridDim.x,
// C], and (SUM) the stored dx copy into row b of partial_s (each null when not wanted). CENTER
// false (RMSNorm): xhat = x * rstd, no mean(g) term, no dbias (mean and partial_b unused).
template <bool ADD, typename DY, int VEC, int K, typename X, typename H, typename XI,
          bool CENTER, bool SUM>
__device__ __forceinline__ void backward_rows(const DY* dy, const XI* x, const X* weight,
                                              const float* mean, const float* rstd,
                                              const X* ds, X* dx, H* dx_half, float* partial_w,
                                              float* partial_b, float* partial_s, int rows,
                                              int C, const HalfDropout& drop, float2* sums,
                                              float* red) {
    const int groups = C / VEC;
    if constexpr (SUM) dx_sums_begin(red, C);
    float acc_w[K][VEC], acc_b[K][VEC];   // weight is re-read from L1: registers kept for sums
#pragma unroll
    for (int k = 0; k < K; ++k)
#pragma unroll
        for (int j = 0; j < VEC; ++j) acc_w[k][j] = acc_b[k][j] = 0.f;
    for (long long base = first_row_base(); base < rows; base += row_base_stride()) {
        const long long row = base + threadIdx.y;
        const bool valid = row < rows;
        const long long r0 = row * C;
        const float m = CENTER && valid ? mean[row] : 0.f, r = valid ? rstd[row] : 0.f;
        float d[K][VEC], h[K][VEC];   // dy, then g; x, then xhat
        // ds and the keep bytes, loaded with dy and x: no load waits after the row sums
        float e[ADD ? K : 1][VEC];
        unsigned int keep[K];
        float sg = 0.f, sgh = 0.f;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int g = threadIdx.x + k * blockDim.x;
            if (!valid || g >= groups) continue;
            loadv_as_float<VEC>(dy, r0 + (long long)g * VEC, d[k]);
            loadv_as_float<VEC>(x, r0 + (long long)g * VEC, h[k]);
            if constexpr (ADD) loadv_as_float<VEC>(ds, r0 + (long long)g * VEC, e[k]);
            keep[k] = keep_bytes<VEC>(drop, r0 + (long long)g * VEC);
        }
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int g = threadIdx.x + k * blockDim.x;
            if (!valid || g >= groups) continue;
            float w[VEC];
            if (weight) loadv_as_float<VEC>(weight, (long long)g * VEC, w);
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                h[k][j] = __fmul_rn(CENTER ? __fsub_rn(h[k][j], m) : h[k][j], r);
                acc_w[k][j] = __fmaf_rn(d[k][j], h[k][j], acc_w[k][j]);
                if constexpr (CENTER) acc_b[k][j] += d[k][j];
                if (weight) d[k][j] = __fmul_rn(d[k][j], w[j]);
                if constexpr (CENTER) sg += d[k][j];
                sgh = __fmaf_rn(d[k][j], h[k][j], sgh);
            }
        }
        const float2 means = row_means<CENTER>(sg, sgh, sums, C);
        const float mg = means.x, mgh = means.y;
        if (!valid) continue;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int g = threadIdx.x + k * blockDim.x;
            if (g >= groups) continue;
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                const float centred = CENTER ? __fsub_rn(d[k][j], mg) : d[k][j];
                float v = __fmul_rn(r, __fsub_rn(centred, __fmul_rn(h[k][j], mgh)));
                if constexpr (ADD) v = __fadd_rn(v, e[k][j]);
                d[k][j] = v;
            }
            store_dx<VEC>(dx, dx_half, r0 + (long long)g * VEC, d[k], drop, keep[k]);
        }
        if constexpr (!SUM) continue;
        // after the stores, when h and ds are no longer held: fewer registers at once
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int g = threadIdx.x + k * blockDim.x;
            if (g < groups)
                add_stored_copy<VEC, X, H>(red + threadIdx.y * C + g * VEC, d[k], dx_half,
                                           drop, keep[k]);
        }
    }
    if constexpr (SUM) dx_sums_end(partial_s, red, C);
    store_block_partial<VEC, K>(acc_w, partial_w, red, groups, C);
    if constexpr (CENTER) store_block_partial<VEC, K>(acc_b, partial_b, red, groups, C);
}

// backward_rows, its column sums compiled in only where partial_s is given: the body without
// them keeps the registers it has (the kernels sit at their 80-register bound).
template <bool ADD, typename DY, int VEC, int K, typename X, typename H, typename XI = X,
          bool CENTER = true>
__device__ __forceinline__ void layer_norm_backward_rows(const DY* dy, const XI* x,
                                                         const X* weight, const float* mean,
                                                         const float* rstd, const X* ds, X* dx,
                                                         H* dx_half, float* partial_w,
                                                         float* partial_b, float* partial_s,
                                                         int rows, int C,
                                                         const HalfDropout& drop) {
    __shared__ float2 sums[32];
    __shared__ __align__(16) float red[LAYER_NORM_BLOCK_ROWS_THREADS * K * VEC];
    if (partial_s)
        backward_rows<ADD, DY, VEC, K, X, H, XI, CENTER, true>(
            dy, x, weight, mean, rstd, ds, dx, dx_half, partial_w, partial_b, partial_s, rows,
            C, drop, sums, red);
    else
        backward_rows<ADD, DY, VEC, K, X, H, XI, CENTER, false>(
            dy, x, weight, mean, rstd, ds, dx, dx_half, partial_w, partial_b, nullptr, rows, C,
            drop, sums, red);
}

template <typename DY, int VEC, int K, typename X = float, typename H = X, typename XI = X>
__global__ void __launch_bounds__(LAYER_NORM_BWD_THREADS(K * VEC), LAYER_NORM_BWD_BLOCKS(K * VEC))
layer_norm_backward_kernel(const DY* dy, const XI* x, const X* weight,
                           const float* mean, const float* rstd, X* dx, H* dx_half,
                           float* partial_w, float* partial_b, float* partial_s, int rows,
                           int C, const unsigned char* half_mask, float half_scale) {
    await_previous_kernel();
    layer_norm_backward_rows<false, DY, VEC, K, X, H, XI>(dy, x, weight, mean, rstd, nullptr,
                                                          dx, dx_half, partial_w, partial_b,
                                                          partial_s, rows, C,
                                                          {half_mask, half_scale});
}

template <typename DY, int VEC, int K, typename X = float, typename H = X>
__global__ void __launch_bounds__(LAYER_NORM_BWD_THREADS(K * VEC), LAYER_NORM_BWD_BLOCKS(K * VEC))
add_layer_norm_backward_kernel(const DY* dy, const X* x, const X* weight, const float* mean,
                               const float* rstd, const X* ds, X* dx, H* dx_half,
                               float* partial_w, float* partial_b, float* partial_s, int rows,
                               int C, const unsigned char* half_mask, float half_scale) {
    await_previous_kernel();
    layer_norm_backward_rows<true, DY, VEC, K, X, H>(dy, x, weight, mean, rstd, ds, dx, dx_half,
                                                     partial_w, partial_b, partial_s, rows, C,
                                                     {half_mask, half_scale});
}

template <typename DY, int VEC, int K, typename X = float, typename H = X>
__global__ void __launch_bounds__(LAYER_NORM_BWD_THREADS(K * VEC), LAYER_NORM_BWD_BLOCKS(K * VEC))
rms_norm_backward_kernel(const DY* dy, const X* x, const X* weight, const float* rstd, X* dx,
                         H* dx_half, float* partial_w, float* partial_s, int rows, int C,
                         const unsigned char* half_mask, float half_scale) {
    await_previous_kernel();
    layer_norm_backward_rows<false, DY, VEC, K, X, H, X, false>(
        dy, x, weight, nullptr, rstd, nullptr, dx, dx_half, partial_w, nullptr, partial_s,
        rows, C, {half_mask, half_scale});
}

template <typename DY, int VEC, int K, typename X = float, typename H = X>
__global__ void __launch_bounds__(LAYER_NORM_BWD_THREADS(K * VEC), LAYER_NORM_BWD_BLOCKS(K * VEC))
add_rms_norm_backward_kernel(const DY* dy, const X* x, const X* weight, const float* rstd,
                             const X* ds, X* dx, H* dx_half, float* partial_w,
                             float* partial_s, int rows, int C,
                             const unsigned char* half_mask, float half_scale) {
    await_previous_kernel();
    layer_norm_backward_rows<true, DY, VEC, K, X, H, X, false>(
        dy, x, weight, nullptr, rstd, ds, dx, dx_half, partial_w, nullptr, partial_s, rows, C,
        {half_mask, half_scale});
}

// The forward for rows of any width: x re-read from global memory for each pass; with ADD,
// s written in the first pass, then re-read (L1/L2). CENTER as layer_norm_forward_rows's.
template <bool ADD, typename Y, typename X, typename B, typename A = X, bool CENTER = true>
__device__ __forceinline__ void layer_norm_forward_loop_rows(const A* a, const B* b,
                                                             const X* weight, const X* bias,
                                                             Y* y, X* s_out, float* mean_out,
                                                             float* rstd_out, int rows, int C,
                                                             float eps,
                                                             const BranchDropout& drop = {}) {
    __shared__ float smem[32];
    for (long long base = first_row_base(); base < rows; base += row_base_stride()) {
        const long long row = base + threadIdx.y;
        const int cols = row < rows ? C : 0;
        const long long r0 = row * C;
        // the row the later passes read: s (ADD) or x
        const auto xr = [&](int c) {
            if constexpr (ADD) return load_as_float(s_out, r0 + c);
            else return load_as_float(a, r0 + c);
        };
        // the x - mean of a column (x itself without CENTER)
        const auto centred = [&](int c, float mean) {
            if constexpr (CENTER) return __fsub_rn(xr(c), mean);
            else return xr(c);
        };
        float s = 0.f;
        if (ADD || CENTER) {
            for (int c = threadIdx.x; c < cols; c += blockDim.x) {
                float v;
                if constexpr (ADD) {
                    float t = load_as_float(b, r0 + c);
                    if (drop.mask) drop_branch<1, B>(drop, r0 + c, &t);
                    v = stored_as<X>(__fadd_rn(load_as_float(a, r0 + c), t));
                    store_from_float(s_out, r0 + c, v);
                } else {
                    v = xr(c);
                }
                s += v;
            }
        }
        // each thread re-reads only the columns of s_out it wrote: no barrier needed
        float mean = 0.f;
        if constexpr (CENTER) mean = __fdiv_rn(row_sum(s, smem), (float)C);
        float q = 0.f;
        for (int c = threadIdx.x; c < cols; c += blockDim.x) {
            const float t = centred(c, mean);
            q = __fmaf_rn(t, t, q);
        }
        const float rstd = inverse_std(__fdiv_rn(row_sum(q, smem), (float)C), eps);
        if (cols && threadIdx.x == 0) {
            if constexpr (CENTER) mean_out[row] = mean;
            rstd_out[row] = rstd;
        }
        for (int c = threadIdx.x; c < cols; c += blockDim.x) {
            float t = __fmul_rn(centred(c, mean), rstd);
            if (weight) t = __fmul_rn(t, load_as_float(weight, c));
            if (CENTER && bias) t = __fadd_rn(t, load_as_float(bias, c));
            store_from_float(y, r0 + c, t);
        }
    }
}

template <typename Y, typename X = float, typename XI = X>
__global__ void __launch_bounds__(1024)
layer_norm_forward_loop_kernel(const XI* x, const X* weight, const X* bias, Y* y,
                               float* mean_out, float* rstd_out, int rows, int C, float eps) {
    await_previous_kernel();
    layer_norm_forward_loop_rows<false, Y, X, X, XI>(x, nullptr, weight, bias, y, nullptr,
                                                     mean_out, rstd_out, rows, C, eps);
}

template <typename Y, typename X = float, typename B = X>
__global__ void __launch_bounds__(1024)
add_layer_norm_forward_loop_kernel(const X* a, const B* b, const X* weight, const X* bias,
                                   Y* y, X* s_out, float* mean_out, float* rstd_out, int rows,
                                   int C, float eps, const long long* step, unsigned char* mask,
                                   unsigned long long seed, unsigned int site,
                                   unsigned int threshold, float scale) {
    await_previous_kernel();
    layer_norm_forward_loop_rows<true, Y, X, B>(
        a, b, weight, bias, y, s_out, mean_out, rstd_out, rows, C, eps,
        branch_dropout(mask, step, seed, site, threshold, scale));
}

template <typename Y, typename X = float>
__global__ void __launch_bounds__(1024)
rms_norm_forward_loop_kernel(const X* x, const X* weight, Y* y, float* rstd_out, int rows,
                             int C, float eps) {
    await_previous_kernel();
    layer_norm_forward_loop_rows<false, Y, X, X, X, false>(x, nullptr, weight, nullptr, y,
                                                           nullptr, nullptr, rstd_out, rows,
                                                           C, eps);
}

template <typename Y, typename X = float, typename B = X>
__global__ void __launch_bounds__(1024)
add_rms_norm_forward_loop_kernel(const X* a, const B* b, const X* weight, Y* y, X* s_out,
                                 float* rstd_out, int rows, int C, float eps,
                                 const long long* step, unsigned char* mask,
                                 unsigned long long seed, unsigned int site,
                                 unsigned int threshold, float scale) {
    await_previous_kernel();
    layer_norm_forward_loop_rows<true, Y, X, B, X, false>(
        a, b, weight, nullptr, y, s_out, nullptr, rstd_out, rows, C, eps,
        branch_dropout(mask, step, seed, site, threshold, scale));
}

// The backward for rows of any width, one row a block (blockDim.y == 1): the block's partial
// sums accumulate in place in its row of partial_w / partial_b / partial_s (each element read
// and written by one thread only); ds added to dx and CENTER as layer_norm_backward_rows does.
template <bool ADD, typename DY, typename X, typename H, typename XI = X, bool CENTER = true>
__device__ __forceinline__ void layer_norm_backward_loop_rows(const DY* dy, const XI* x,
                                                              const X* weight, const float* mean,
                                                              const float* rstd, const X* ds,
                                                              X* dx, H* dx_half,
                                                              float* partial_w,
                                                              float* partial_b,
                                                              float* partial_s, int rows, int C,
                                                              const HalfDropout& drop) {
    __shared__ float2 sums[32];
    float* pw = partial_w ? partial_w + (long long)blockIdx.x * C : nullptr;
    float* pb = CENTER && partial_b ? partial_b + (long long)blockIdx.x * C : nullptr;
    float* ps = partial_s ? partial_s + (long long)blockIdx.x * C : nullptr;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        if (pw) pw[c] = 0.f;
        if (pb) pb[c] = 0.f;
        if (ps) ps[c] = 0.f;
    }
    for (long long base = first_row_base(); base < rows; base += row_base_stride()) {
        const long long row = base + threadIdx.y;
        const int cols = row < rows ? C : 0;
        const long long r0 = row * C;
        const float m = CENTER && cols ? mean[row] : 0.f, r = cols ? rstd[row] : 0.f;
        const auto xhat = [&](int c) {
            const float v = load_as_float(x, r0 + c);
            return __fmul_rn(CENTER ? __fsub_rn(v, m) : v, r);
        };
        float sg = 0.f, sgh = 0.f;
        for (int c = threadIdx.x; c < cols; c += blockDim.x) {
            const float h = xhat(c);
            const float d = load_as_float(dy, r0 + c);
            const float g = weight ? __fmul_rn(d, load_as_float(weight, c)) : d;
            if constexpr (CENTER) sg += g;
            sgh = __fmaf_rn(g, h, sgh);
            if (pw) pw[c] = __fmaf_rn(d, h, pw[c]);
            if (CENTER && pb) pb[c] += d;
        }
        const float2 means = row_means<CENTER>(sg, sgh, sums, C);
        const float mg = means.x, mgh = means.y;
        for (int c = threadIdx.x; c < cols; c += blockDim.x) {
            const float h = xhat(c);
            const float d = load_as_float(dy, r0 + c);
            const float g = weight ? __fmul_rn(d, load_as_float(weight, c)) : d;
            float v = __fmul_rn(r, __fsub_rn(CENTER ? __fsub_rn(g, mg) : g, __fmul_rn(h, mgh)));
            if constexpr (ADD) v = __fadd_rn(v, load_as_float(ds, r0 + c));
            const unsigned int keep = keep_bytes<1>(drop, r0 + c);
            store_dx<1>(dx, dx_half, r0 + c, &v, drop, keep);
            if (ps) add_stored_copy<1, X, H>(ps + c, &v, dx_half, drop, keep);
        }
    }
}

template <typename DY, typename X = float, typename H = X, typename XI = X>
__global__ void __launch_bounds__(1024)
layer_norm_backward_loop_kernel(const DY* dy, const XI* x, const X* weight,
                                const float* mean, const float* rstd, X* dx, H* dx_half,
                                float* partial_w, float* partial_b, float* partial_s, int rows,
                                int C, const unsigned char* half_mask, float half_scale) {
    await_previous_kernel();
    layer_norm_backward_loop_rows<false, DY, X, H, XI>(dy, x, weight, mean, rstd, nullptr, dx,
                                                       dx_half, partial_w, partial_b, partial_s,
                                                       rows, C, {half_mask, half_scale});
}

template <typename DY, typename X = float, typename H = X>
__global__ void __launch_bounds__(1024)
add_layer_norm_backward_loop_kernel(const DY* dy, const X* x, const X* weight,
                                    const float* mean, const float* rstd, const X* ds, X* dx,
                                    H* dx_half, float* partial_w, float* partial_b,
                                    float* partial_s, int rows, int C,
                                    const unsigned char* half_mask, float half_scale) {
    await_previous_kernel();
    layer_norm_backward_loop_rows<true, DY, X, H>(dy, x, weight, mean, rstd, ds, dx, dx_half,
                                                  partial_w, partial_b, partial_s, rows, C,
                                                  {half_mask, half_scale});
}

template <typename DY, typename X = float, typename H = X>
__global__ void __launch_bounds__(1024)
rms_norm_backward_loop_kernel(const DY* dy, const X* x, const X* weight, const float* rstd,
                              X* dx, H* dx_half, float* partial_w, float* partial_s, int rows,
                              int C, const unsigned char* half_mask, float half_scale) {
    await_previous_kernel();
    layer_norm_backward_loop_rows<false, DY, X, H, X, false>(dy, x, weight, nullptr, rstd,
                                                             nullptr, dx, dx_half, partial_w,
                                                             nullptr, partial_s, rows, C,
                                                             {half_mask, half_scale});
}

template <typename DY, typename X = float, typename H = X>
__global__ void __launch_bounds__(1024)
add_rms_norm_backward_loop_kernel(const DY* dy, const X* x, const X* weight, const float* rstd,
                                  const X* ds, X* dx, H* dx_half, float* partial_w,
                                  float* partial_s, int rows, int C,
                                  const unsigned char* half_mask, float half_scale) {
    await_previous_kernel();
    layer_norm_backward_loop_rows<true, DY, X, H, X, false>(dy, x, weight, nullptr, rstd, ds,
                                                            dx, dx_half, partial_w, nullptr,
                                                            partial_s, rows, C,
                                                            {half_mask, half_scale});
}

// dweight[c] = the sum over slots of partial_w[slot, c] (dbias from partial_b, dsum from
// partial_s alike), in float64 and a fixed order: lane l of FINALIZE_LANES adds slots l,
// l + lanes, ... in turn, then the lanes are added in order. Blocks of (32 columns,
// FINALIZE_LANES); blockIdx.y picks the table among those given, in the order dweight, dbias,
// dsum.
// T: dweight's and dbias's storage (float16 for a float16 x; the sum rounded once); S: dsum's
// (the stored dx copy's).
template <typename T, typename S = T>
__global__ void __launch_bounds__(32 * FINALIZE_LANES)
layer_norm_grad_finalize_kernel(const float* partial_w, const float* partial_b,
                                const float* partial_s, T* dweight, T* dbias, S* dsum,
                                int slots, int C) {
    await_previous_kernel();
    __shared__ double lanes[FINALIZE_LANES][32];
    const int w = partial_w != nullptr, b = partial_b != nullptr;
    const int table = blockIdx.y < w ? 0 : blockIdx.y < w + b ? 1 : 2;
    const float* partial = table == 0 ? partial_w : table == 1 ? partial_b : partial_s;
    const int c = blockIdx.x * 32 + threadIdx.x;
    double s = 0.0;
    if (c < C) {
#pragma unroll 4
        for (int k = threadIdx.y; k < slots; k += FINALIZE_LANES)
            s += (double)partial[(long long)k * C + c];
    }
    lanes[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && c < C) {
        double t = lanes[0][threadIdx.x];
        for (int l = 1; l < FINALIZE_LANES; ++l) t += lanes[l][threadIdx.x];
        if (table == 2) store_from_float(dsum, c, (float)t);
        else store_from_float(table == 0 ? dweight : dbias, c, (float)t);
    }
}
