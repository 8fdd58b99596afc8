// Batch normalisation in training mode over x viewed as (N, C, inner), M = N * inner elements
// per channel: batch_norm_train (statistics, running-stat update, normalise + affine + ReLU,
// the fused residual; batch_norm_stats: the first two alone)
// and batch_norm_grad (the two channel sums, dweight/dbias, dx; the incoming gradient dy, or
// dy + dy2 with the fused gradient sum (load_grad); with the fused ReLU, masked where the
// recomputed pre-activation is not positive: relu_masked). Deterministic: every sum is
// float64, has a fixed owner and a fixed combination order (no float atomics):
//   1. a stats pass: block (channel, split) writes its float64 partial sums to
//      partial[(c * splits + split) * 2 + {0, 1}] (launcher scratch made once per node);
//   2. a finalize kernel adds each channel's splits in a fixed order (a warp per channel);
//   3. an elementwise pass over x with the channel's finished values.
// Two layouts: "planes" (a block per channel and split of its N * inner elements, threads
// along inner; float4 packs when inner % 4 == 0 and the pointers are 16-byte aligned) and
// "columns" (inner == 1, x (N, C): threadIdx.x along C, V adjacent channels a thread in one
// access, up to 32 lanes a block, coalesced).
// Launchers keep sizes < 2^31.
// The kernels are templates over the storage T of x, y, dy and dx: float, unsigned short (bfloat16
// bits, bf16.cuh) or fp16_bits (float16, fp16.cuh), widened on load and rounded to nearest even
// once on store; the statistics, the per-channel values (mean, invstd, weight, bias, coef, running
// statistics, dweight, dbias) and all arithmetic stay float32 / float64, as the NumPy emulation has
// them.
#include "launch_order.cuh"
#include "bf16.cuh"
#include "reduce.cuh"

#define COLUMN_TILE 32   // most lanes along C of a columns block (blockDim.x)
#define STATS_ROWS 16    // row lanes of a columns stats block (blockDim.y)
// Resident blocks an SM must fit, for the stats passes' launch bounds: they cap registers
// (65536 / (512 * blocks) a thread). With a bound of one block the compiler takes up to 128
// for the vector walks' accumulators, and one or two blocks an SM leave too few loads in
// flight (H200, resnet's 9 bf16 statistics passes: 248 µs a step at 60 registers, 120 at 32).
#define STATS_MIN_BLOCKS 4
// the gradient's sums keep more values live: at most 64 registers
#define GRAD_STATS_MIN_BLOCKS 2

// ---- packs and walks -----------------------------------------------------------------------

template <int V>
struct Pack {
    float v[V];
};

// Pack `at` (of V elements) of p, as float.
template <int V, typename T>
__device__ __forceinline__ Pack<V> load_pack(const T* p, long long at) {
    Pack<V> r;
    if constexpr (V == 4)
        load4_as_float(p, at * 4, r.v);
    else
        r.v[0] = load_as_float(p, at);
    return r;
}

template <int V, typename T>
__device__ __forceinline__ void store_pack(T* p, long long at, const Pack<V>& r) {
    if constexpr (V == 4)
        store4_from_float(p, at * 4, r.v);
    else
        store_from_float(p, at, r.v[0]);
}

// Planes layout: calls f(at) for the packs of channel blockIdx.x in split blockIdx.y. The
// channel's packs are j = n * inner + i (inner counted in packs), total of them; split s takes
// j in [s * per, (s + 1) * per) and thread t the j = begin + t, t + blockDim.x, ... at pack
// offset (n * C + c) * inner + i, walked with division-free increments. No early return:
// callers reduce over the block afterwards.
template <typename F>
__device__ __forceinline__ void walk_channel(int C, int inner, int total, int per, F f) {
    const int c = blockIdx.x;
    const long long begin = (long long)blockIdx.y * per;
    const long long end = min((long long)total, begin + per);
    long long j = begin + threadIdx.x;
    int n = (int)(j / inner), i = (int)(j - (long long)n * inner);
    const int dn = blockDim.x / inner, di = blockDim.x - dn * inner;
    for (; j < end; j += blockDim.x) {
        f(((long long)n * C + c) * inner + i);
        n += dn;
        i += di;
        if (i >= inner) {
            i -= inner;
            ++n;
        }
    }
}

// Columns layout: calls f(at) for the rows of a thread's V channels c = (blockIdx.x *
// blockDim.x + threadIdx.x) * V, ..., + V - 1 (if they exist; C % V == 0), at = r * C + c, in
// split blockIdx.y: rows [s * per, (s + 1) * per), thread row lanes threadIdx.y, + blockDim.y,
// ..., in that order, R rows a round so that a thread has R accesses in flight (the kernels'
// pointers are __restrict__, so that loads may go ahead of earlier stores). One 4-byte (or
// 2-byte) load in flight a thread keeps too few bytes moving to fill the memory pipe: V and R
// per pass and storage type are the launcher's (norm.py COLUMN_WALKS, measured).
template <int V, int R, typename F>
__device__ __forceinline__ void walk_column(int N, int C, int per, F f) {
    const int c = (blockIdx.x * blockDim.x + threadIdx.x) * V;
    if (c >= C) return;
    const long long r0 = (long long)blockIdx.y * per;
    const long long r1 = min((long long)N, r0 + per);
    const long long step = blockDim.y;
    long long r = r0 + threadIdx.y;
    for (; r + (R - 1) * step < r1; r += R * step) {
#pragma unroll
        for (int j = 0; j < R; ++j) f((r + j * step) * C + c);
    }
    for (; r < r1; r += step) f(r * C + c);
}

// The first of the thread's V channels in the columns layout, clamped so that the per-channel
// loads of a thread past C stay in range (it walks nothing).
template <int V>
__device__ __forceinline__ int column_channel(int C) {
    return min((int)(blockIdx.x * blockDim.x + threadIdx.x) * V, C - V);
}

// partial[(c * splits + split) * 2 + {0, 1}] = (a, b) summed over the block, planes layout.
__device__ __forceinline__ void write_plane_partials(double a, double b, double* partial) {
    __shared__ double smem[32];
    a = block_sum(a, smem);
    b = block_sum(b, smem);
    if (threadIdx.x == 0) {
        const long long at = ((long long)blockIdx.x * gridDim.y + blockIdx.y) * 2;
        partial[at] = a;
        partial[at + 1] = b;
    }
}

// The same for the columns layout, V channels a thread: each channel's row lanes combined in
// order y = 0, 1, ... (blockDim.y == STATS_ROWS).
template <int V>
__device__ __forceinline__ void write_column_partials(const double (&a)[V], const double (&b)[V],
                                                      double* partial, int C) {
    __shared__ double part[2][STATS_ROWS][COLUMN_TILE * V + 1];
#pragma unroll
    for (int k = 0; k < V; ++k) {
        part[0][threadIdx.y][threadIdx.x * V + k] = a[k];
        part[1][threadIdx.y][threadIdx.x * V + k] = b[k];
    }
    __syncthreads();
    const int c = (blockIdx.x * blockDim.x + threadIdx.x) * V;
    if (threadIdx.y != 0 || c >= C) return;
#pragma unroll
    for (int k = 0; k < V; ++k) {
        double sa = 0.0, sb = 0.0;
        for (int y = 0; y < STATS_ROWS; ++y) {
            sa += part[0][y][threadIdx.x * V + k];
            sb += part[1][y][threadIdx.x * V + k];
        }
        const long long at = ((long long)(c + k) * gridDim.y + blockIdx.y) * 2;
        partial[at] = sa;
        partial[at + 1] = sb;
    }
}

// Channel c's two sums: its splits' partials (write_*_partials) added by one warp, lane k
// taking splits k, k + 32, ... in order, the lanes combined by the fixed butterfly (every lane
// gets the same bits). Hundreds of splits cost a few dependent loads per lane, not hundreds.
__device__ __forceinline__ double2 channel_sums(const double* partial, int splits, int c) {
    double a = 0.0, b = 0.0;
    for (int k = threadIdx.x & 31; k < splits; k += 32) {
        a += partial[((long long)c * splits + k) * 2];
        b += partial[((long long)c * splits + k) * 2 + 1];
    }
    return make_double2(warp_sum(a), warp_sum(b));
}

// ---- per-element arithmetic ----------------------------------------------------------------
// Separate roundings (no FMA contraction), in the reference's order.

__device__ __forceinline__ float normalised(float v, float mean, float invstd) {
    return __fmul_rn(v - mean, invstd);
}

// y = xhat * w + b (affine) and the fused ReLU (NaN passes, as np.maximum).
__device__ __forceinline__ float bn_output(float v, float mean, float invstd, bool affine,
                                           float w, float b, int relu) {
    float z = normalised(v, mean, invstd);
    if (affine) z = __fadd_rn(__fmul_rn(z, w), b);
    return relu && !(z > 0.f || z != z) ? 0.f : z;
}

// The fused ReLU's mask in the gradient: g, or 0 where the forward's output was not positive.
// The pre-activation is recomputed from x with the forward's own arithmetic (bn_output), so
// the mask is the forward's bit for bit (a NaN masks, as y = NaN > 0 is false) and the
// gradient never reads y: one pass over the activation fewer in each of its two passes.
__device__ __forceinline__ float relu_masked(float g, float v, float mean, float invstd,
                                             bool affine, float w, float b, int relu) {
    return relu && !(bn_output(v, mean, invstd, affine, w, b, 0) > 0.f) ? 0.f : g;
}

// As stored in T: float as is, bf16 and float16 rounded to nearest even (a store then a
// load).
__device__ __forceinline__ float as_stored(float v, const float*) { return v; }
__device__ __forceinline__ float as_stored(float v, const unsigned short*) {
    return bf16_round(v);
}
__device__ __forceinline__ float as_stored(float v, const fp16_bits*) { return fp16_round(v); }

// The incoming gradient at a pack (planes) or V channels (columns): dy, or with the fused
// gradient sum (SUM) dy + dy2 rounded as the unfused add stores it. A compile-time choice: a
// runtime one slowed every gradient pass, the sums' too (more live registers).
template <int V, bool SUM, typename T>
__device__ __forceinline__ Pack<V> load_grad_pack(const T* dy, const T* dy2, long long at) {
    Pack<V> g = load_pack<V>(dy, at);
    if constexpr (SUM) {
        const Pack<V> h = load_pack<V>(dy2, at);
#pragma unroll
        for (int k = 0; k < V; ++k) g.v[k] = as_stored(__fadd_rn(g.v[k], h.v[k]), dy);
    }
    return g;
}

template <int V, bool SUM, typename T>
__device__ __forceinline__ void load_grad(const T* dy, const T* dy2, long long at, float* g) {
    loadv_as_float<V>(dy, at, g);
    if constexpr (SUM) {
        float h[V];
        loadv_as_float<V>(dy2, at, h);
#pragma unroll
        for (int k = 0; k < V; ++k) g[k] = as_stored(__fadd_rn(g[k], h[k]), dy);
    }
}

// The forward's output: bn_output, or with a residual (the fused residual add, r != nullptr,
// its element rv) act(stored(bn) + rv), rounded as the unfused BatchNorm and add store them;
// the fused ReLU after the sum then.
template <typename T>
__device__ __forceinline__ float bn_residual_output(float v, float mean, float invstd,
                                                    bool affine, float w, float b, int relu,
                                                    const T* r, float rv) {
    if (r == nullptr) return bn_output(v, mean, invstd, affine, w, b, relu);
    const float z = __fadd_rn(as_stored(bn_output(v, mean, invstd, affine, w, b, 0), r), rv);
    return relu && !(z > 0.f || z != z) ? 0.f : z;
}

// dx = k * (g - mean_dy - xhat * mean_dy_xhat), coef = (k = w * invstd, mean_dy, mean_dy_xhat).
__device__ __forceinline__ float bn_grad(float g, float xhat, float k, float a, float b) {
    return __fmul_rn(k, __fsub_rn(g - a, __fmul_rn(xhat, b)));
}

// A columns thread's per-channel values for its V channels from c: mean, invstd, and weight,
// bias (1, 0 without affine: weight == nullptr).
template <int V>
struct ColumnChannels {
    float mean[V], invstd[V], w[V], b[V];
    bool affine;

    __device__ __forceinline__ ColumnChannels() : affine(false) {   // none: zeros, unread
#pragma unroll
        for (int k = 0; k < V; ++k) mean[k] = invstd[k] = w[k] = b[k] = 0.f;
    }

    __device__ __forceinline__ ColumnChannels(int c, const float* mean_, const float* invstd_,
                                              const float* weight, const float* bias)
        : affine(weight != nullptr) {
#pragma unroll
        for (int k = 0; k < V; ++k) {
            mean[k] = mean_[c + k];
            invstd[k] = invstd_[c + k];
            w[k] = affine ? weight[c + k] : 1.f;
            b[k] = affine ? bias[c + k] : 0.f;
        }
    }
};

// ---- batch_norm_train ----------------------------------------------------------------------

// Partial (sum x, sum x^2) per channel and split.
template <int V, typename T>
__device__ __forceinline__ void stats_planes(const T* x, double* partial, int C, int inner,
                                             int total, int per) {
    double s = 0.0, q = 0.0;
    walk_channel(C, inner, total, per, [&](long long at) {
        const Pack<V> p = load_pack<V>(x, at);
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const double v = p.v[k];
            s += v;
            q += v * v;
        }
    });
    write_plane_partials(s, q, partial);
}

template <typename T>
__global__ void batch_norm_stats_planes_kernel(const T* x, double* partial,
                                               int C, int inner, int total, int per) {
    await_previous_kernel();
    stats_planes<1>(x, partial, C, inner, total, per);
}

template <typename T>
__global__ void batch_norm_stats_planes_vec4_kernel(const T* x, double* partial,
                                                    int C, int inner, int total,
                                                    int per) {
    await_previous_kernel();
    stats_planes<4>(x, partial, C, inner, total, per);
}

// Grid (ceil(C / (V * lanes)), splits) of (lanes <= 32, STATS_ROWS) threads.
template <typename T, int V, int R>
__global__ void __launch_bounds__(COLUMN_TILE * STATS_ROWS, STATS_MIN_BLOCKS)
batch_norm_stats_columns_kernel(const T* __restrict__ x, double* partial, int N, int C,
                                int per) {
    await_previous_kernel();
    double s[V] = {}, q[V] = {};
    walk_column<V, R>(N, C, per, [&](long long at) {
        float v[V];
        loadv_as_float<V>(x, at, v);
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const double d = v[k];
            s[k] += d;
            q[k] += d * d;
        }
    });
    write_column_partials<V>(s, q, partial, C);
}

// A warp per channel: each channel's splits added (channel_sums); mean, biased var = E[x^2] -
// mean^2 (float64 sums of float32 values: no cancellation at float32 precision), save_mean,
// save_invstd = 1 / sqrt(var + eps). With running stats (running_mean != nullptr): tracked
// += 1, m = momentum or, when cumulative, 1 / tracked (after the increment); running_mean =
// (1 - m) running_mean + m mean, running_var = (1 - m) running_var + m var M / (M - 1).
// Thread 0 of block 0 writes tracked back; only a cumulative average reads it in every thread,
// and the launcher then gives the kernel one block, so all reads precede the write. (One
// block for every channel had cost the resnet step ~70 µs: 8 channels a warp one after
// another at 256 channels.)
extern "C" __global__ void batch_norm_finalize_kernel(const double* partial, int splits, int C,
                                                      double count, double eps,
                                                      float* save_mean, float* save_invstd,
                                                      float* running_mean, float* running_var,
                                                      long long* tracked, double momentum,
                                                      int cumulative) {
    await_previous_kernel();
    const bool track = running_mean != nullptr;
    double m = momentum;
    if (track && cumulative) m = 1.0 / (double)(*tracked + 1);
    const int warps = (gridDim.x * blockDim.x) >> 5;
    for (int c = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; c < C; c += warps) {
        const double2 sums = channel_sums(partial, splits, c);   // (sum x, sum x^2)
        if ((threadIdx.x & 31) != 0) continue;
        const double mean = sums.x / count;
        double var = sums.y / count - mean * mean;
        if (var < 0.0) var = 0.0;      // rounding only; a NaN passes
        save_mean[c] = (float)mean;
        save_invstd[c] = (float)(1.0 / sqrt(var + eps));
        if (track) {
            running_mean[c] = (float)((1.0 - m) * (double)running_mean[c] + m * mean);
            running_var[c] = (float)((1.0 - m) * (double)running_var[c] +
                                     m * var * count / (count - 1.0));
        }
    }
    if (!track || blockIdx.x != 0) return;
    __syncthreads();
    if (threadIdx.x == 0) *tracked += 1;
}

// The residual's value as the sum reads it: r as loaded, or with the shortcut's BatchNorm
// fused (NORM_R: r is its raw input) that BatchNorm's output as its own node stores it.
template <bool NORM_R, typename T>
__device__ __forceinline__ float shortcut_value(float r, float mean, float invstd, bool affine,
                                                float w, float b, const T* stored_as) {
    if constexpr (NORM_R)
        return as_stored(bn_output(r, mean, invstd, affine, w, b, 0), stored_as);
    else
        return r;
}

// y = normalised x (weight == nullptr: no affine), + residual (nullptr: none; with NORM_R
// normalised by r_mean, r_invstd[, r_weight, r_bias]), ReLU when relu.
template <int V, bool NORM_R, typename T>
__device__ __forceinline__ void forward_planes(const T* x, const T* residual, T* y,
                                               const float* mean, const float* invstd,
                                               const float* weight, const float* bias, int relu,
                                               const float* r_mean, const float* r_invstd,
                                               const float* r_weight, const float* r_bias,
                                               int C, int inner, int total, int per) {
    const int c = blockIdx.x;
    const float mu = mean[c], is = invstd[c];
    const bool affine = weight != nullptr;
    const float w = affine ? weight[c] : 1.f, b = affine ? bias[c] : 0.f;
    const bool r_affine = NORM_R && r_weight != nullptr;
    const float rmu = NORM_R ? r_mean[c] : 0.f, ris = NORM_R ? r_invstd[c] : 1.f;
    const float rw = r_affine ? r_weight[c] : 1.f, rb = r_affine ? r_bias[c] : 0.f;
    walk_channel(C, inner, total, per, [&](long long at) {
        Pack<V> p = load_pack<V>(x, at);
        Pack<V> r{};
        if (residual != nullptr) r = load_pack<V>(residual, at);
#pragma unroll
        for (int k = 0; k < V; ++k)
            p.v[k] = bn_residual_output(
                p.v[k], mu, is, affine, w, b, relu, residual,
                shortcut_value<NORM_R>(r.v[k], rmu, ris, r_affine, rw, rb, residual));
        store_pack<V>(y, at, p);
    });
}

#define FORWARD_PLANES_ARGS                                                                  \
    const T *x, const T *residual, T *y, const float *mean, const float *invstd,             \
        const float *weight, const float *bias, int relu, const float *r_mean,               \
        const float *r_invstd, const float *r_weight, const float *r_bias, int C, int inner,  \
        int total, int per
#define FORWARD_PLANES_PASS                                                                  \
    x, residual, y, mean, invstd, weight, bias, relu, r_mean, r_invstd, r_weight, r_bias, C,  \
        inner, total, per

template <typename T, bool NORM_R>
__global__ void batch_norm_forward_planes_kernel(FORWARD_PLANES_ARGS) {
    await_previous_kernel();
    forward_planes<1, NORM_R>(FORWARD_PLANES_PASS);
}

template <typename T, bool NORM_R>
__global__ void batch_norm_forward_planes_vec4_kernel(FORWARD_PLANES_ARGS) {
    await_previous_kernel();
    forward_planes<4, NORM_R>(FORWARD_PLANES_PASS);
}

// Grid (ceil(C / (V * lanes)), splits) of (lanes <= 32, rows) threads.
template <typename T, int V, int R, bool NORM_R>
__global__ void batch_norm_forward_columns_kernel(
    const T* __restrict__ x, const T* __restrict__ residual, T* __restrict__ y,
    const float* mean, const float* invstd, const float* weight, const float* bias, int relu,
    const float* r_mean, const float* r_invstd, const float* r_weight, const float* r_bias,
    int N, int C, int per) {
    await_previous_kernel();
    const int c = column_channel<V>(C);
    const ColumnChannels<V> ch(c, mean, invstd, weight, bias);
    const ColumnChannels<V> rch = NORM_R ? ColumnChannels<V>(c, r_mean, r_invstd, r_weight,
                                                             r_bias)
                                         : ColumnChannels<V>();
    walk_column<V, R>(N, C, per, [&](long long at) {
        float v[V], r[V] = {};
        loadv_as_float<V>(x, at, v);
        if (residual != nullptr) loadv_as_float<V>(residual, at, r);
#pragma unroll
        for (int k = 0; k < V; ++k)
            v[k] = bn_residual_output(
                v[k], ch.mean[k], ch.invstd[k], ch.affine, ch.w[k], ch.b[k], relu, residual,
                shortcut_value<NORM_R>(r[k], rch.mean[k], rch.invstd[k], rch.affine, rch.w[k],
                                       rch.b[k], residual));
        storev_from_float<V>(y, at, v);
    });
}

// ---- batch_norm_grad -----------------------------------------------------------------------

// A columns thread's gradient g at its V channels of row `at` (load_grad) and x there (v), g
// masked by the fused ReLU (relu_masked): what both gradient passes start from.
template <int V, bool SUM, typename T>
__device__ __forceinline__ void load_masked_grad(const T* dy, const T* dy2, const T* x,
                                                 long long at, const ColumnChannels<V>& ch,
                                                 int relu, float* g, float* v) {
    load_grad<V, SUM>(dy, dy2, at, g);
    loadv_as_float<V>(x, at, v);
#pragma unroll
    for (int k = 0; k < V; ++k)
        g[k] = relu_masked(g[k], v[k], ch.mean[k], ch.invstd[k], ch.affine, ch.w[k], ch.b[k],
                           relu);
}

// Partial (sum g, sum g * xhat) per channel and split, g = dy masked by the fused ReLU (relu).
// weight, bias: for the mask only; both nullptr without affine or without the ReLU.
template <int V, bool SUM, typename T>
__device__ __forceinline__ void grad_stats_planes(const T* dy, const T* dy2, const T* x,
                                                  const float* weight,
                                                  const float* bias, int relu,
                                                  const float* mean, const float* invstd,
                                                  double* partial, int C, int inner, int total,
                                                  int per) {
    const int c = blockIdx.x;
    const float mu = mean[c], is = invstd[c];
    const bool affine = weight != nullptr;
    const float w = affine ? weight[c] : 1.f, b = affine ? bias[c] : 0.f;
    double s = 0.0, sx = 0.0;
    walk_channel(C, inner, total, per, [&](long long at) {
        const Pack<V> g = load_grad_pack<V, SUM>(dy, dy2, at);
        const Pack<V> v = load_pack<V>(x, at);
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const double m = relu_masked(g.v[k], v.v[k], mu, is, affine, w, b, relu);
            s += m;
            sx += m * (double)normalised(v.v[k], mu, is);
        }
    });
    write_plane_partials(s, sx, partial);
}

#define GRAD_STATS_PLANES_ARGS                                                               \
    const T *dy, const T *dy2, const T *x, const float *weight, const float *bias, int relu, \
        const float *mean, const float *invstd, double *partial, int C, int inner, int total,  \
        int per

template <typename T, bool SUM>
__global__ void batch_norm_grad_stats_planes_kernel(GRAD_STATS_PLANES_ARGS) {
    await_previous_kernel();
    grad_stats_planes<1, SUM>(dy, dy2, x, weight, bias, relu, mean, invstd, partial, C, inner,
                              total, per);
}

template <typename T, bool SUM>
__global__ void batch_norm_grad_stats_planes_vec4_kernel(GRAD_STATS_PLANES_ARGS) {
    await_previous_kernel();
    grad_stats_planes<4, SUM>(dy, dy2, x, weight, bias, relu, mean, invstd, partial, C, inner,
                              total, per);
}

template <typename T, int V, int R, bool SUM>
__global__ void __launch_bounds__(COLUMN_TILE * STATS_ROWS, GRAD_STATS_MIN_BLOCKS)
batch_norm_grad_stats_columns_kernel(const T* __restrict__ dy, const T* __restrict__ dy2,
                                     const T* __restrict__ x,
                                     const float* weight, const float* bias, int relu,
                                     const float* mean, const float* invstd, double* partial,
                                     int N, int C, int per) {
    await_previous_kernel();
    const ColumnChannels<V> ch(column_channel<V>(C), mean, invstd, weight, bias);
    double s[V] = {}, sx[V] = {};
    walk_column<V, R>(N, C, per, [&](long long at) {
        float g[V], v[V];
        load_masked_grad<V, SUM>(dy, dy2, x, at, ch, relu, g, v);
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const double m = g[k];
            s[k] += m;
            sx[k] += m * (double)normalised(v[k], ch.mean[k], ch.invstd[k]);
        }
    });
    write_column_partials<V>(s, sx, partial, C);
}

// A warp per channel: its splits added (channel_sums); dweight = sum g * xhat, dbias = sum g
// (dweight == nullptr: no affine), and coef[3c..3c+2] = (w * invstd, sum g / M, sum g * xhat
// / M) for the dx pass (w = 1 without affine).
extern "C" __global__ void batch_norm_grad_finalize_kernel(const double* partial, int splits,
                                                           int C, double count,
                                                           const float* weight,
                                                           const float* invstd, float* coef,
                                                           float* dweight, float* dbias) {
    await_previous_kernel();
    const int c = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (c >= C) return;                // whole warps leave: blockDim.x % 32 == 0
    const double2 sums = channel_sums(partial, splits, c);
    if ((threadIdx.x & 31) != 0) return;
    const double s = sums.x, sx = sums.y;   // sum g, sum g * xhat
    if (dweight != nullptr) {
        dweight[c] = (float)sx;
        dbias[c] = (float)s;
    }
    const double w = weight != nullptr ? (double)weight[c] : 1.0;
    coef[3 * c] = (float)(w * (double)invstd[c]);
    coef[3 * c + 1] = (float)(s / count);
    coef[3 * c + 2] = (float)(sx / count);
}

template <int V, bool SUM, typename T>
__device__ __forceinline__ void backward_planes(const T* dy, const T* dy2, const T* x,
                                                const float* weight,
                                                const float* bias, int relu, const float* mean,
                                                const float* invstd, const float* coef, T* dx,
                                                int C, int inner, int total, int per) {
    const int c = blockIdx.x;
    const float mu = mean[c], is = invstd[c];
    const bool affine = weight != nullptr;
    const float w = affine ? weight[c] : 1.f, b = affine ? bias[c] : 0.f;
    const float k = coef[3 * c], a = coef[3 * c + 1], bb = coef[3 * c + 2];
    walk_channel(C, inner, total, per, [&](long long at) {
        Pack<V> g = load_grad_pack<V, SUM>(dy, dy2, at);
        const Pack<V> v = load_pack<V>(x, at);
#pragma unroll
        for (int e = 0; e < V; ++e) {
            const float m = relu_masked(g.v[e], v.v[e], mu, is, affine, w, b, relu);
            g.v[e] = bn_grad(m, normalised(v.v[e], mu, is), k, a, bb);
        }
        store_pack<V>(dx, at, g);
    });
}

#define BACKWARD_PLANES_ARGS                                                                 \
    const T *dy, const T *dy2, const T *x, const float *weight, const float *bias, int relu, \
        const float *mean, const float *invstd, const float *coef, T *dx, int C, int inner,    \
        int total, int per

template <typename T, bool SUM>
__global__ void batch_norm_backward_planes_kernel(BACKWARD_PLANES_ARGS) {
    await_previous_kernel();
    backward_planes<1, SUM>(dy, dy2, x, weight, bias, relu, mean, invstd, coef, dx, C, inner,
                            total, per);
}

template <typename T, bool SUM>
__global__ void batch_norm_backward_planes_vec4_kernel(BACKWARD_PLANES_ARGS) {
    await_previous_kernel();
    backward_planes<4, SUM>(dy, dy2, x, weight, bias, relu, mean, invstd, coef, dx, C, inner,
                            total, per);
}

template <typename T, int V, int R, bool SUM>
__global__ void batch_norm_backward_columns_kernel(
    const T* __restrict__ dy, const T* __restrict__ dy2, const T* __restrict__ x,
    const float* weight, const float* bias, int relu, const float* mean, const float* invstd,
    const float* coef, T* __restrict__ dx,
    int N, int C, int per) {
    await_previous_kernel();
    const int c = column_channel<V>(C);
    const ColumnChannels<V> ch(c, mean, invstd, weight, bias);
    float k[V], a[V], bb[V];
#pragma unroll
    for (int e = 0; e < V; ++e) {
        k[e] = coef[3 * (c + e)];
        a[e] = coef[3 * (c + e) + 1];
        bb[e] = coef[3 * (c + e) + 2];
    }
    walk_column<V, R>(N, C, per, [&](long long at) {
        float g[V], v[V];
        load_masked_grad<V, SUM>(dy, dy2, x, at, ch, relu, g, v);
#pragma unroll
        for (int e = 0; e < V; ++e)
            g[e] = bn_grad(g[e], normalised(v[e], ch.mean[e], ch.invstd[e]), k[e], a[e], bb[e]);
        storev_from_float<V>(dx, at, g);
    });
}
