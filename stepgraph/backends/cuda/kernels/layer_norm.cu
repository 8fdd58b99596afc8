// LayerNorm over the last axis of x viewed as (rows, C): forward (y, mean, rstd) and backward
// (dx; dweight and dbias through per-slot partial sums and a finalize kernel). Statistics in
// float32, two passes (mean, then the mean of squared deviations), rstd = 1 / sqrt(var + eps).
// A row is handled by a group of blockDim.x threads (a multiple of 32), blockDim.y rows per
// block, rows strided over the grid; row sums combine in a fixed order (reduce.cuh row_sum).
// Templates <VEC, K>: thread x of a row group owns the column groups x + k * blockDim.x,
// k < K, of VEC floats (float4 loads when VEC is 4) and keeps them in registers between the
// passes. Rows wider than K * blockDim.x * VEC columns take the *_loop kernels, which re-read
// x and dy from global memory (L1/L2) and keep the partial sums in global memory.
// Determinism: each (block, row lane) is a "slot" that visits rows slot, slot + slots, ...;
// its dweight/dbias partial sums are its own, and the finalize adds the slots in order, in
// float64: no atomics anywhere.
#include "reduce.cuh"

template <int VEC>
__device__ __forceinline__ void load_vec(const float* p, long long i, float* v) {
    if (VEC == 4) {
        const float4 t = *reinterpret_cast<const float4*>(p + i);
        v[0] = t.x;
        v[1] = t.y;
        v[2] = t.z;
        v[3] = t.w;
    } else {
        v[0] = p[i];
    }
}

template <int VEC>
__device__ __forceinline__ void store_vec(float* p, long long i, const float* v) {
    if (VEC == 4) *reinterpret_cast<float4*>(p + i) = make_float4(v[0], v[1], v[2], v[3]);
    else p[i] = v[0];
}

__device__ __forceinline__ float inverse_std(float var, float eps) {
    return __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(var, eps)));
}

// y = (x - mean) * rstd [* weight] [+ bias]; mean and rstd (rows,) per row.
template <int VEC, int K>
__global__ void __launch_bounds__(256)
layer_norm_forward_kernel(const float* x, const float* weight, const float* bias, float* y,
                          float* mean_out, float* rstd_out, int rows, int C, float eps) {
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
                load_vec<VEC>(x, r0 + (long long)g * VEC, v[k]);
#pragma unroll
                for (int j = 0; j < VEC; ++j) s += v[k][j];
            }
        }
        const float mean = __fdiv_rn(row_sum(s, smem), (float)C);
        float q = 0.f;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int g = threadIdx.x + k * blockDim.x;
            if (valid && g < groups) {
#pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    v[k][j] = __fsub_rn(v[k][j], mean);
                    q = __fmaf_rn(v[k][j], v[k][j], q);
                }
            }
        }
        const float rstd = inverse_std(__fdiv_rn(row_sum(q, smem), (float)C), eps);
        if (!valid) continue;
        if (threadIdx.x == 0) {
            mean_out[row] = mean;
            rstd_out[row] = rstd;
        }
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int g = threadIdx.x + k * blockDim.x;
            if (g >= groups) continue;
            float w[VEC], b[VEC];
            if (weight) load_vec<VEC>(weight, (long long)g * VEC, w);
            if (bias) load_vec<VEC>(bias, (long long)g * VEC, b);
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                float t = __fmul_rn(v[k][j], rstd);
                if (weight) t = __fmul_rn(t, w[j]);
                if (bias) t = __fadd_rn(t, b[j]);
                v[k][j] = t;
            }
            store_vec<VEC>(y, r0 + (long long)g * VEC, v[k]);
        }
    }
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy [* weight], xhat = (x - mean) *
// rstd; slot (blockIdx.x * blockDim.y + threadIdx.y) sums dy * xhat and dy over its rows into
// partial_w / partial_b [slot, C] (either null when not wanted).
template <int VEC, int K>
__global__ void __launch_bounds__(256)
layer_norm_backward_kernel(const float* dy, const float* x, const float* weight,
                           const float* mean, const float* rstd, float* dx, float* partial_w,
                           float* partial_b, int rows, int C) {
    __shared__ float smem[32];
    const int groups = C / VEC;
    float acc_w[K][VEC], acc_b[K][VEC];
#pragma unroll
    for (int k = 0; k < K; ++k)
#pragma unroll
        for (int j = 0; j < VEC; ++j) acc_w[k][j] = acc_b[k][j] = 0.f;
    for (long long base = first_row_base(); base < rows; base += row_base_stride()) {
        const long long row = base + threadIdx.y;
        const bool valid = row < rows;
        const long long r0 = row * C;
        const float m = valid ? mean[row] : 0.f, r = valid ? rstd[row] : 0.f;
        float d[K][VEC], h[K][VEC];   // dy, then xhat
        float sg = 0.f, sgh = 0.f;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int g = threadIdx.x + k * blockDim.x;
            if (!valid || g >= groups) continue;
            float w[VEC];
            load_vec<VEC>(dy, r0 + (long long)g * VEC, d[k]);
            load_vec<VEC>(x, r0 + (long long)g * VEC, h[k]);
            if (weight) load_vec<VEC>(weight, (long long)g * VEC, w);
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                h[k][j] = __fmul_rn(__fsub_rn(h[k][j], m), r);
                const float gj = weight ? __fmul_rn(d[k][j], w[j]) : d[k][j];
                sg += gj;
                sgh = __fmaf_rn(gj, h[k][j], sgh);
                acc_w[k][j] = __fmaf_rn(d[k][j], h[k][j], acc_w[k][j]);
                acc_b[k][j] += d[k][j];
            }
        }
        const float mg = __fdiv_rn(row_sum(sg, smem), (float)C);
        const float mgh = __fdiv_rn(row_sum(sgh, smem), (float)C);
        if (!valid) continue;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int g = threadIdx.x + k * blockDim.x;
            if (g >= groups) continue;
            float w[VEC];
            if (weight) load_vec<VEC>(weight, (long long)g * VEC, w);
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                const float gj = weight ? __fmul_rn(d[k][j], w[j]) : d[k][j];
                d[k][j] = __fmul_rn(r, __fsub_rn(__fsub_rn(gj, mg), __fmul_rn(h[k][j], mgh)));
            }
            store_vec<VEC>(dx, r0 + (long long)g * VEC, d[k]);
        }
    }
    const long long slot = (long long)blockIdx.x * blockDim.y + threadIdx.y;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int g = threadIdx.x + k * blockDim.x;
        if (g >= groups) continue;
        if (partial_w) store_vec<VEC>(partial_w, slot * C + (long long)g * VEC, acc_w[k]);
        if (partial_b) store_vec<VEC>(partial_b, slot * C + (long long)g * VEC, acc_b[k]);
    }
}

// The forward for rows of any width: x re-read from global memory for each pass.
extern "C" __global__ void __launch_bounds__(1024)
layer_norm_forward_loop_kernel(const float* x, const float* weight, const float* bias, float* y,
                               float* mean_out, float* rstd_out, int rows, int C, float eps) {
    __shared__ float smem[32];
    for (long long base = first_row_base(); base < rows; base += row_base_stride()) {
        const long long row = base + threadIdx.y;
        const int cols = row < rows ? C : 0;
        const float* xr = x + row * C;
        float s = 0.f;
        for (int c = threadIdx.x; c < cols; c += blockDim.x) s += xr[c];
        const float mean = __fdiv_rn(row_sum(s, smem), (float)C);
        float q = 0.f;
        for (int c = threadIdx.x; c < cols; c += blockDim.x) {
            const float t = __fsub_rn(xr[c], mean);
            q = __fmaf_rn(t, t, q);
        }
        const float rstd = inverse_std(__fdiv_rn(row_sum(q, smem), (float)C), eps);
        if (cols && threadIdx.x == 0) {
            mean_out[row] = mean;
            rstd_out[row] = rstd;
        }
        for (int c = threadIdx.x; c < cols; c += blockDim.x) {
            float t = __fmul_rn(__fsub_rn(xr[c], mean), rstd);
            if (weight) t = __fmul_rn(t, weight[c]);
            if (bias) t = __fadd_rn(t, bias[c]);
            y[row * C + c] = t;
        }
    }
}

// The backward for rows of any width: the slot's partial sums accumulate in place in
// partial_w / partial_b (each element read and written by one thread only).
extern "C" __global__ void __launch_bounds__(1024)
layer_norm_backward_loop_kernel(const float* dy, const float* x, const float* weight,
                                const float* mean, const float* rstd, float* dx,
                                float* partial_w, float* partial_b, int rows, int C) {
    __shared__ float smem[32];
    const long long slot = (long long)blockIdx.x * blockDim.y + threadIdx.y;
    float* pw = partial_w ? partial_w + slot * C : nullptr;
    float* pb = partial_b ? partial_b + slot * C : nullptr;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        if (pw) pw[c] = 0.f;
        if (pb) pb[c] = 0.f;
    }
    for (long long base = first_row_base(); base < rows; base += row_base_stride()) {
        const long long row = base + threadIdx.y;
        const int cols = row < rows ? C : 0;
        const long long r0 = row * C;
        const float m = cols ? mean[row] : 0.f, r = cols ? rstd[row] : 0.f;
        float sg = 0.f, sgh = 0.f;
        for (int c = threadIdx.x; c < cols; c += blockDim.x) {
            const float h = __fmul_rn(__fsub_rn(x[r0 + c], m), r), d = dy[r0 + c];
            const float g = weight ? __fmul_rn(d, weight[c]) : d;
            sg += g;
            sgh = __fmaf_rn(g, h, sgh);
            if (pw) pw[c] = __fmaf_rn(d, h, pw[c]);
            if (pb) pb[c] += d;
        }
        const float mg = __fdiv_rn(row_sum(sg, smem), (float)C);
        const float mgh = __fdiv_rn(row_sum(sgh, smem), (float)C);
        for (int c = threadIdx.x; c < cols; c += blockDim.x) {
            const float h = __fmul_rn(__fsub_rn(x[r0 + c], m), r), d = dy[r0 + c];
            const float g = weight ? __fmul_rn(d, weight[c]) : d;
            dx[r0 + c] = __fmul_rn(r, __fsub_rn(__fsub_rn(g, mg), __fmul_rn(h, mgh)));
        }
    }
}

// Column c of partial [slots, C] summed over the slots, in slot order, in float64.
__device__ __forceinline__ float slot_sum(const float* partial, int slots, int C, int c) {
    double s = 0.0;
    for (int k = 0; k < slots; ++k) s += (double)partial[(long long)k * C + c];
    return (float)s;
}

// dweight[c] = sum over slots of partial_w[slot, c] (dbias alike); either output may be null.
extern "C" __global__ void layer_norm_grad_finalize_kernel(const float* partial_w,
                                                           const float* partial_b,
                                                           float* dweight, float* dbias,
                                                           int slots, int C) {
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < C; c += gridDim.x * blockDim.x) {
        if (dweight) dweight[c] = slot_sum(partial_w, slots, C, c);
        if (dbias) dbias[c] = slot_sum(partial_b, slots, C, c);
    }
}

#define LAYER_NORM_INSTANTIATIONS(VEC, K)                                                    \
    template __global__ void layer_norm_forward_kernel<VEC, K>(                              \
        const float*, const float*, const float*, float*, float*, float*, int, int, float);  \
    template __global__ void layer_norm_backward_kernel<VEC, K>(                             \
        const float*, const float*, const float*, const float*, const float*, float*, float*, \
        float*, int, int);

// Explicit instantiations: compiled by the NVRTC CI test without name_expressions.
LAYER_NORM_INSTANTIATIONS(1, 1)
LAYER_NORM_INSTANTIATIONS(1, 2)
LAYER_NORM_INSTANTIATIONS(1, 4)
LAYER_NORM_INSTANTIATIONS(1, 8)
LAYER_NORM_INSTANTIATIONS(4, 1)
LAYER_NORM_INSTANTIATIONS(4, 2)
LAYER_NORM_INSTANTIATIONS(4, 4)
LAYER_NORM_INSTANTIATIONS(4, 8)
