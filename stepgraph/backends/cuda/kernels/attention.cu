// Scaled dot-product attention (sdpa, sdpa_grad) with FlashAttention-2's scheme in fp32 on CUDA
// cores: the (L, S) scores never exist in memory. The forward walks the key tiles of a tile of
// queries with an online softmax and saves each row's logsumexp; the backward recomputes the
// probabilities from it, in two kernels without atomics (deterministic): dq per query tile
// (which also sums D = rowsum(dout * out) for the other), then dk and dv per key tile.
// Dropout regenerates the dropout op's Philox mask of the (bh, L, S) probabilities from the
// element's flat index (philox.cuh) in every kernel.
//
// Blocks of 128 threads: 16 row groups rg of 8 lanes cg (a row group inside one warp, so row
// reductions are three shuffles). In a (rows x cols) tile a thread owns rows rg + 16 i and
// columns 4 cg + 32 j + e (e < 4: four consecutive keys, one Philox draw for four elements).
// Operands are read with explicit batch / head / row strides (columns contiguous): bh = b *
// heads + h. Tiles in shared memory: "rows" [R][HD + 4] (a row's columns contiguous) and
// "transposed" [HD][R + 4]; the pads make the tiles' accesses conflict-free.
// Templates <HD, BQ, BK>: head dims up to HD (32, 64, 128), BQ queries x BK keys per tile.
#include "philox.cuh"

#define SDPA_THREADS 128
#define SDPA_LOG2E 1.4426950408889634f
#define SDPA_LN2 0.6931471805599453f
#define SDPA_NEG_INF __int_as_float(0xff800000)

struct SdpaThread {
    int rg, cg;
    __device__ SdpaThread() {
        const int lane = threadIdx.x & 31;
        cg = lane & 7;
        rg = (threadIdx.x >> 5) * 4 + (lane >> 3);
    }
};

struct SdpaDropout {
    int on;
    long long step;
    unsigned long long seed;
    unsigned int site, threshold;
    float scale;
};

__device__ __forceinline__ long long head_offset(int bh, int heads, long long sb, long long sh) {
    return (long long)(bh / heads) * sb + (long long)(bh % heads) * sh;
}

__device__ __forceinline__ float row_max8(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
}

__device__ __forceinline__ float row_sum8(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    x += __shfl_xor_sync(0xffffffffu, x, 2);
    return x + __shfl_xor_sync(0xffffffffu, x, 4);
}

// Bit e (e < 4) is set when element idx + e of the dropout op's tensor is kept.
__device__ __forceinline__ unsigned int keep_bits(const SdpaDropout& d, long long idx) {
    const unsigned long long group = (unsigned long long)idx >> 2;
    const unsigned int shift = (unsigned int)idx & 3u;
    const uint4 w = dropout_words(group, d.site, d.step, d.seed);
    unsigned int bits = (dropout_keep(w.x, d.threshold) ? 1u : 0u) |
                        (dropout_keep(w.y, d.threshold) ? 2u : 0u) |
                        (dropout_keep(w.z, d.threshold) ? 4u : 0u) |
                        (dropout_keep(w.w, d.threshold) ? 8u : 0u);
    if (shift) {    // the four elements straddle two Philox groups
        const uint4 n = dropout_words(group + 1, d.site, d.step, d.seed);
        bits |= (dropout_keep(n.x, d.threshold) ? 16u : 0u) |
                (dropout_keep(n.y, d.threshold) ? 32u : 0u) |
                (dropout_keep(n.z, d.threshold) ? 64u : 0u) |
                (dropout_keep(n.w, d.threshold) ? 128u : 0u);
    }
    return bits >> shift;
}

__device__ __forceinline__ bool visible(int r, int c, int S, int off, int causal) {
    return c < S && (!causal || c <= r + off);
}

// ---- tiles: global -> shared ---------------------------------------------------------------

// Rows row0 .. row0 + R - 1 of one head (g at its row 0, row stride sr) into s[r][HD + 4];
// rows >= nrows and columns >= dim read as 0.
template <int R, int HD>
__device__ __forceinline__ void load_rows(float* s, const float* g, long long sr, int row0,
                                          int nrows, int dim, int vec) {
    constexpr int LD = HD + 4;
    if (vec) {
        constexpr int C4 = HD / 4;
        for (int t = threadIdx.x; t < R * C4; t += SDPA_THREADS) {
            const int r = t / C4, d = (t % C4) * 4;
            float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
            if (row0 + r < nrows && d < dim)
                x = *reinterpret_cast<const float4*>(g + (long long)(row0 + r) * sr + d);
            *reinterpret_cast<float4*>(s + r * LD + d) = x;
        }
    } else {
        for (int t = threadIdx.x; t < R * HD; t += SDPA_THREADS) {
            const int r = t / HD, d = t % HD;
            s[r * LD + d] = row0 + r < nrows && d < dim ? g[(long long)(row0 + r) * sr + d] : 0.f;
        }
    }
}

// The same rows transposed, into s[d][R + 4]. With float4 loads a warp reads 16 rows x 2
// float4 columns (whole 32-byte sectors) and its stores hit 32 banks (R + 4 = 4 mod 32).
template <int R, int HD>
__device__ __forceinline__ void load_rows_transposed(float* s, const float* g, long long sr,
                                                     int row0, int nrows, int dim, int vec) {
    constexpr int LD = R + 4;
    if (vec) {
        constexpr int ROW_UNITS = R / 16;
        for (int t = threadIdx.x; t < R * HD / 4; t += SDPA_THREADS) {
            const int lane = t & 31, unit = t >> 5;
            const int r = (unit % ROW_UNITS) * 16 + (lane & 15);
            const int d = ((unit / ROW_UNITS) * 2 + (lane >> 4)) * 4;
            float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
            if (row0 + r < nrows && d < dim)
                x = *reinterpret_cast<const float4*>(g + (long long)(row0 + r) * sr + d);
            s[d * LD + r] = x.x;
            s[(d + 1) * LD + r] = x.y;
            s[(d + 2) * LD + r] = x.z;
            s[(d + 3) * LD + r] = x.w;
        }
    } else {
        for (int t = threadIdx.x; t < R * HD; t += SDPA_THREADS) {
            const int r = t % R, d = t / R;
            s[d * LD + r] = row0 + r < nrows && d < dim ? g[(long long)(row0 + r) * sr + d] : 0.f;
        }
    }
}

// ---- tile products in shared memory: acc[i][j] += sum over k < KD -------------------------

__device__ __forceinline__ float lane_of(const float4& v, int k) {
    return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w;
}

// acc[i][j] += sum_k A[rg + 16 i][k] * B[k][4 cg + 32 (j / 4) + j % 4]: A rows of LA floats
// (k contiguous), B rows of LB floats indexed by k.
template <int TR, int TC, int KD, int LA, int LB>
__device__ __forceinline__ void mma_rows(float (&acc)[TR][TC], const float* a, const float* b,
                                         const SdpaThread& th) {
#pragma unroll 2
    for (int k = 0; k < KD; k += 4) {
        float4 av[TR];
#pragma unroll
        for (int i = 0; i < TR; ++i)
            av[i] = *reinterpret_cast<const float4*>(a + (th.rg + 16 * i) * LA + k);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            float bv[TC];
#pragma unroll
            for (int j = 0; j < TC / 4; ++j) {
                const float4 t =
                    *reinterpret_cast<const float4*>(b + (k + kk) * LB + 4 * th.cg + 32 * j);
                bv[4 * j] = t.x;
                bv[4 * j + 1] = t.y;
                bv[4 * j + 2] = t.z;
                bv[4 * j + 3] = t.w;
            }
#pragma unroll
            for (int i = 0; i < TR; ++i) {
                const float x = lane_of(av[i], kk);
#pragma unroll
                for (int j = 0; j < TC; ++j) acc[i][j] = fmaf(x, bv[j], acc[i][j]);
            }
        }
    }
}

// acc[i][j] += sum_k A[k][rg + 16 i] * B[k][4 cg + 32 (j / 4) + j % 4]: A indexed by k too
// (rows of LA floats), one float per row and k.
template <int TR, int TC, int KD, int LA, int LB>
__device__ __forceinline__ void mma_cols(float (&acc)[TR][TC], const float* a, const float* b,
                                         const SdpaThread& th) {
#pragma unroll 4
    for (int k = 0; k < KD; ++k) {
        float av[TR], bv[TC];
#pragma unroll
        for (int i = 0; i < TR; ++i) av[i] = a[k * LA + th.rg + 16 * i];
#pragma unroll
        for (int j = 0; j < TC / 4; ++j) {
            const float4 t = *reinterpret_cast<const float4*>(b + k * LB + 4 * th.cg + 32 * j);
            bv[4 * j] = t.x;
            bv[4 * j + 1] = t.y;
            bv[4 * j + 2] = t.z;
            bv[4 * j + 3] = t.w;
        }
#pragma unroll
        for (int i = 0; i < TR; ++i)
#pragma unroll
            for (int j = 0; j < TC; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
    }
}

template <int TR, int TC>
__device__ __forceinline__ void zero(float (&acc)[TR][TC]) {
#pragma unroll
    for (int i = 0; i < TR; ++i)
#pragma unroll
        for (int j = 0; j < TC; ++j) acc[i][j] = 0.f;
}

// Row i of a thread's tile values (columns 4 cg + 32 j + e) into s[rg + 16 i][LD].
template <int TC, int LD>
__device__ __forceinline__ void store_row(float* s, const float (&v)[TC], int row,
                                          const SdpaThread& th) {
#pragma unroll
    for (int j = 0; j < TC / 4; ++j)
        *reinterpret_cast<float4*>(s + row * LD + 4 * th.cg + 32 * j) =
            make_float4(v[4 * j], v[4 * j + 1], v[4 * j + 2], v[4 * j + 3]);
}

// Row i of a thread's (rows x HD) result, times `mul`, into global row r (columns < dim).
template <int TC>
__device__ __forceinline__ void write_row(float* g, const float (&v)[TC], float mul, int dim,
                                          int vec, const SdpaThread& th) {
#pragma unroll
    for (int j = 0; j < TC / 4; ++j) {
        const int d = 4 * th.cg + 32 * j;
        if (vec) {
            if (d < dim)
                *reinterpret_cast<float4*>(g + d) =
                    make_float4(v[4 * j] * mul, v[4 * j + 1] * mul, v[4 * j + 2] * mul,
                                v[4 * j + 3] * mul);
        } else {
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (d + e < dim) g[d + e] = v[4 * j + e] * mul;
        }
    }
}

// Dynamic shared memory of at least `floats` floats, or a trap (a launcher bug).
__device__ __forceinline__ void check_shared(int floats) {
    unsigned int bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
    if (bytes < floats * sizeof(float)) __trap();
}

// The first key tile the queries of tiles at q0 never see: keys <= r + off are visible.
__device__ __forceinline__ int key_end(int q0, int BQ, int L, int S, int off, int causal) {
    return causal ? min(S, min(q0 + BQ, L) + off) : S;
}

// ---- forward -------------------------------------------------------------------------------

// out = dropout(softmax(scale q k^T + M)) v and lse per row, for query tile q0 of head bh;
// blocks of the longest causal tiles first. scale_log2 = scale * log2(e).
template <int HD, int BQ, int BK>
__global__ void __launch_bounds__(SDPA_THREADS)
sdpa_forward_kernel(const float* q, const float* k, const float* v, float* out, float* lse,
                    const long long* step, int heads, int bh_count, int L, int S, int E, int Ev,
                    long long q_sb, long long q_sh, long long q_sr, long long k_sb,
                    long long k_sh, long long k_sr, long long v_sb, long long v_sh,
                    long long v_sr, long long o_sb, long long o_sh, long long o_sr,
                    float scale_log2, int causal, unsigned long long seed, unsigned int site,
                    unsigned int threshold, float drop_scale, int dropout, int vec) {
    constexpr int TR = BQ / 16, TS = BK / 8, TO = HD / 8;
    constexpr int LQ = HD + 4, LT = BK + 4;
    extern __shared__ __align__(16) float smem[];
    float* qs = smem;                  // [BQ][LQ]
    float* kt = qs + BQ * LQ;          // [HD][LT]
    float* vs = kt + HD * LT;          // [BK][LQ]
    float* ps = vs + BK * LQ;          // [BQ][LT]
    check_shared(BQ * LQ + HD * LT + BK * LQ + BQ * LT);

    const SdpaThread th;
    const int tiles = (L + BQ - 1) / BQ;
    const int bh = blockIdx.x % bh_count;
    const int q0 = (tiles - 1 - (int)(blockIdx.x / bh_count)) * BQ;
    const int off = S - L;
    const SdpaDropout drop{dropout, dropout ? *step : 0, seed, site, threshold, drop_scale};
    const float* kh = k + head_offset(bh, heads, k_sb, k_sh);
    const float* vh = v + head_offset(bh, heads, v_sb, v_sh);
    load_rows<BQ, HD>(qs, q + head_offset(bh, heads, q_sb, q_sh), q_sr, q0, L, E, vec);

    float m[TR], l[TR], o[TR][TO];
#pragma unroll
    for (int i = 0; i < TR; ++i) m[i] = SDPA_NEG_INF, l[i] = 0.f;
    zero(o);
    const int end = key_end(q0, BQ, L, S, off, causal);
    for (int c0 = 0; c0 < end; c0 += BK) {
        __syncthreads();     // the previous tile's readers are done with kt, vs and ps
        load_rows_transposed<BK, HD>(kt, kh, k_sr, c0, S, E, vec);
        load_rows<BK, HD>(vs, vh, v_sr, c0, S, Ev, vec);
        __syncthreads();
        float s[TR][TS];
        zero(s);
        mma_rows<TR, TS, HD, LQ, LT>(s, qs, kt, th);
        const bool edge = c0 + BK > S || (causal && c0 + BK - 1 > q0 + off);
#pragma unroll
        for (int i = 0; i < TR; ++i) {
            const int r = q0 + th.rg + 16 * i;
            float mx = SDPA_NEG_INF;
#pragma unroll
            for (int j = 0; j < TS; ++j) {
                const int c = c0 + 4 * th.cg + 32 * (j / 4) + j % 4;
                s[i][j] = edge && !visible(r, c, S, off, causal) ? SDPA_NEG_INF
                                                                 : s[i][j] * scale_log2;
                mx = fmaxf(mx, s[i][j]);
            }
            const float m_new = fmaxf(m[i], row_max8(mx));
            const float base = m_new == SDPA_NEG_INF ? 0.f : m_new;    // rows masked so far
            const float alpha = exp2f(m[i] - base);
            m[i] = m_new;
            l[i] *= alpha;
#pragma unroll
            for (int d = 0; d < TO; ++d) o[i][d] *= alpha;
#pragma unroll
            for (int j = 0; j < TS; ++j) {
                s[i][j] = exp2f(s[i][j] - base);
                l[i] += s[i][j];
            }
            if (drop.on) {
#pragma unroll
                for (int j = 0; j < TS / 4; ++j) {
                    const long long idx =
                        ((long long)bh * L + r) * S + c0 + 4 * th.cg + 32 * j;
                    const unsigned int bits = keep_bits(drop, idx);
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        s[i][4 * j + e] = (bits >> e) & 1u ? s[i][4 * j + e] * drop.scale : 0.f;
                }
            }
            store_row<TS, LT>(ps, s[i], th.rg + 16 * i, th);
        }
        __syncthreads();
        mma_rows<TR, TO, BK, LT, LQ>(o, ps, vs, th);
    }
    float* oh = out + head_offset(bh, heads, o_sb, o_sh);
#pragma unroll
    for (int i = 0; i < TR; ++i) {
        const int r = q0 + th.rg + 16 * i;
        const float total = row_sum8(l[i]);
        if (r < L) {
            write_row<TO>(oh + (long long)r * o_sr, o[i], 1.f / total, Ev, vec, th);
            if (th.cg == 0) lse[(long long)bh * L + r] = (m[i] + log2f(total)) * SDPA_LN2;
        }
    }
}

// ---- backward ------------------------------------------------------------------------------

// P (dropped: kept * scale or 0) and dS = P * (dP * keep * scale - D) of one tile, in place
// of s (scores q k^T) and dp (dout v^T); rows outside [0, L) and masked keys give 0.
template <int TR, int TS>
__device__ __forceinline__ void probabilities_and_grads(
    float (&s)[TR][TS], float (&dp)[TR][TS], const float (&lse2)[TR], const float (&delta)[TR],
    int bh, int q0, int c0, int L, int S, int off, int causal, float scale_log2,
    const SdpaDropout& drop, const SdpaThread& th) {
#pragma unroll
    for (int i = 0; i < TR; ++i) {
        const int r = q0 + th.rg + 16 * i;
#pragma unroll
        for (int j = 0; j < TS / 4; ++j) {
            const int cb = c0 + 4 * th.cg + 32 * j;
            const unsigned int bits =
                drop.on ? keep_bits(drop, ((long long)bh * L + r) * S + cb) : 0xfu;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int jj = 4 * j + e;
                const float p = r < L && visible(r, cb + e, S, off, causal)
                                    ? exp2f(s[i][jj] * scale_log2 - lse2[i]) : 0.f;
                float g = dp[i][jj];
                float kept = p;
                if (drop.on) {
                    const bool keep = (bits >> e) & 1u;
                    g = keep ? g * drop.scale : 0.f;
                    kept = keep ? p * drop.scale : 0.f;
                }
                dp[i][jj] = p * (g - delta[i]);
                s[i][jj] = kept;
            }
        }
    }
}

// dq for query tile q0 of head bh, looping over its visible key tiles; first D = rowsum(dout
// * out) of its rows, written to delta (bh_count x L) for the dk/dv kernel that follows.
template <int HD, int BQ, int BK>
__global__ void __launch_bounds__(SDPA_THREADS)
sdpa_backward_dq_kernel(const float* q, const float* k, const float* v, const float* out,
                        const float* dout, const float* lse, const long long* step, float* dq,
                        float* delta, int heads, int bh_count, int L, int S, int E, int Ev,
                        long long q_sb, long long q_sh, long long q_sr, long long k_sb,
                        long long k_sh, long long k_sr, long long v_sb, long long v_sh,
                        long long v_sr, long long o_sb, long long o_sh, long long o_sr,
                        long long do_sb, long long do_sh, long long do_sr, long long dq_sb,
                        long long dq_sh, long long dq_sr, float scale_log2, float scale,
                        int causal, unsigned long long seed, unsigned int site,
                        unsigned int threshold, float drop_scale, int dropout, int vec) {
    constexpr int TR = BQ / 16, TS = BK / 8, TO = HD / 8;
    constexpr int LQ = HD + 4, LT = BK + 4;
    extern __shared__ __align__(16) float smem[];
    float* qs = smem;                  // [BQ][LQ]
    float* dos = qs + BQ * LQ;         // [BQ][LQ]
    float* kt = dos + BQ * LQ;         // [HD][LT]
    float* vt = kt + HD * LT;          // [HD][LT]
    float* ks = vt + HD * LT;          // [BK][LQ]
    float* dss = ks + BK * LQ;         // [BQ][LT]
    check_shared(2 * BQ * LQ + 2 * HD * LT + BK * LQ + BQ * LT);

    const SdpaThread th;
    const int tiles = (L + BQ - 1) / BQ;
    const int bh = blockIdx.x % bh_count;
    const int q0 = (tiles - 1 - (int)(blockIdx.x / bh_count)) * BQ;
    const int off = S - L;
    const SdpaDropout drop{dropout, dropout ? *step : 0, seed, site, threshold, drop_scale};
    const float* kh = k + head_offset(bh, heads, k_sb, k_sh);
    const float* vh = v + head_offset(bh, heads, v_sb, v_sh);
    const float* oh = out + head_offset(bh, heads, o_sb, o_sh);
    load_rows<BQ, HD>(qs, q + head_offset(bh, heads, q_sb, q_sh), q_sr, q0, L, E, vec);
    load_rows<BQ, HD>(dos, dout + head_offset(bh, heads, do_sb, do_sh), do_sr, q0, L, Ev, vec);
    __syncthreads();

    float lse2[TR], dl[TR];
#pragma unroll
    for (int i = 0; i < TR; ++i) {
        const int r = q0 + th.rg + 16 * i;
        float part = 0.f;
        if (r < L) {
            const float* orow = oh + (long long)r * o_sr;
#pragma unroll
            for (int j = 0; j < TO / 4; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int d = 4 * th.cg + 32 * j + e;
                    if (d < Ev) part = fmaf(dos[(th.rg + 16 * i) * LQ + d], orow[d], part);
                }
        }
        dl[i] = row_sum8(part);
        lse2[i] = r < L ? lse[(long long)bh * L + r] * SDPA_LOG2E : 0.f;
        if (r < L && th.cg == 0) delta[(long long)bh * L + r] = dl[i];
    }

    float acc[TR][TO];
    zero(acc);
    const int end = key_end(q0, BQ, L, S, off, causal);
    for (int c0 = 0; c0 < end; c0 += BK) {
        __syncthreads();     // the previous tile's readers are done with kt, vt, ks and dss
        load_rows_transposed<BK, HD>(kt, kh, k_sr, c0, S, E, vec);
        load_rows_transposed<BK, HD>(vt, vh, v_sr, c0, S, Ev, vec);
        load_rows<BK, HD>(ks, kh, k_sr, c0, S, E, vec);
        __syncthreads();
        float s[TR][TS], dp[TR][TS];
        zero(s);
        zero(dp);
        mma_rows<TR, TS, HD, LQ, LT>(s, qs, kt, th);
        mma_rows<TR, TS, HD, LQ, LT>(dp, dos, vt, th);
        probabilities_and_grads<TR, TS>(s, dp, lse2, dl, bh, q0, c0, L, S, off, causal,
                                        scale_log2, drop, th);
#pragma unroll
        for (int i = 0; i < TR; ++i) store_row<TS, LT>(dss, dp[i], th.rg + 16 * i, th);
        __syncthreads();
        mma_rows<TR, TO, BK, LT, LQ>(acc, dss, ks, th);
    }
    float* dqh = dq + head_offset(bh, heads, dq_sb, dq_sh);
#pragma unroll
    for (int i = 0; i < TR; ++i) {
        const int r = q0 + th.rg + 16 * i;
        if (r < L) write_row<TO>(dqh + (long long)r * dq_sr, acc[i], scale, E, vec, th);
    }
}

// dk and dv for key tile c0 of head bh, looping over the query tiles that see it; reads the
// delta rows the dq kernel wrote. Blocks of the first key tiles (most causal work) first.
template <int HD, int BQ, int BK>
__global__ void __launch_bounds__(SDPA_THREADS)
sdpa_backward_dkdv_kernel(const float* q, const float* k, const float* v, const float* dout,
                          const float* lse, const float* delta, const long long* step,
                          float* dk, float* dv, int heads, int bh_count, int L, int S, int E,
                          int Ev, long long q_sb, long long q_sh, long long q_sr,
                          long long k_sb, long long k_sh, long long k_sr, long long v_sb,
                          long long v_sh, long long v_sr, long long do_sb, long long do_sh,
                          long long do_sr, long long dk_sb, long long dk_sh, long long dk_sr,
                          long long dv_sb, long long dv_sh, long long dv_sr, float scale_log2,
                          float scale, int causal, unsigned long long seed, unsigned int site,
                          unsigned int threshold, float drop_scale, int dropout, int vec) {
    constexpr int TQ = BQ / 16, TK = BK / 16, TS = BK / 8, TO = HD / 8;
    constexpr int LQ = HD + 4, LT = BK + 4;
    extern __shared__ __align__(16) float smem[];
    float* kt = smem;                  // [HD][LT]
    float* vt = kt + HD * LT;          // [HD][LT]
    float* qs = vt + HD * LT;          // [BQ][LQ]
    float* dos = qs + BQ * LQ;         // [BQ][LQ]
    float* ps = dos + BQ * LQ;         // [BQ][LT]
    float* dss = ps + BQ * LT;         // [BQ][LT]
    check_shared(2 * HD * LT + 2 * BQ * LQ + 2 * BQ * LT);

    const SdpaThread th;
    const int bh = blockIdx.x % bh_count;
    const int c0 = (int)(blockIdx.x / bh_count) * BK;
    const int off = S - L;
    const SdpaDropout drop{dropout, dropout ? *step : 0, seed, site, threshold, drop_scale};
    const float* qh = q + head_offset(bh, heads, q_sb, q_sh);
    const float* doh = dout + head_offset(bh, heads, do_sb, do_sh);
    load_rows_transposed<BK, HD>(kt, k + head_offset(bh, heads, k_sb, k_sh), k_sr, c0, S, E,
                                 vec);
    load_rows_transposed<BK, HD>(vt, v + head_offset(bh, heads, v_sb, v_sh), v_sr, c0, S, Ev,
                                 vec);

    float gk[TK][TO], gv[TK][TO];
    zero(gk);
    zero(gv);
    // Queries r see key c0 when c0 <= r + off: start at the tile holding r = c0 - off.
    const int first = causal ? max(0, c0 - off) / BQ * BQ : 0;
    for (int q0 = first; q0 < L; q0 += BQ) {
        __syncthreads();     // the previous tile's readers are done with qs, dos, ps and dss
        load_rows<BQ, HD>(qs, qh, q_sr, q0, L, E, vec);
        load_rows<BQ, HD>(dos, doh, do_sr, q0, L, Ev, vec);
        float lse2[TQ], dl[TQ];
#pragma unroll
        for (int i = 0; i < TQ; ++i) {
            const int r = q0 + th.rg + 16 * i;
            lse2[i] = r < L ? lse[(long long)bh * L + r] * SDPA_LOG2E : 0.f;
            dl[i] = r < L ? delta[(long long)bh * L + r] : 0.f;
        }
        __syncthreads();
        float s[TQ][TS], dp[TQ][TS];
        zero(s);
        zero(dp);
        mma_rows<TQ, TS, HD, LQ, LT>(s, qs, kt, th);
        mma_rows<TQ, TS, HD, LQ, LT>(dp, dos, vt, th);
        probabilities_and_grads<TQ, TS>(s, dp, lse2, dl, bh, q0, c0, L, S, off, causal,
                                        scale_log2, drop, th);
#pragma unroll
        for (int i = 0; i < TQ; ++i) {
            store_row<TS, LT>(ps, s[i], th.rg + 16 * i, th);
            store_row<TS, LT>(dss, dp[i], th.rg + 16 * i, th);
        }
        __syncthreads();
        mma_cols<TK, TO, BQ, LT, LQ>(gv, ps, dos, th);     // dv[c] += sum_r P[r][c] dout[r]
        mma_cols<TK, TO, BQ, LT, LQ>(gk, dss, qs, th);     // dk[c] += sum_r dS[r][c] q[r]
    }
    float* dkh = dk + head_offset(bh, heads, dk_sb, dk_sh);
    float* dvh = dv + head_offset(bh, heads, dv_sb, dv_sh);
#pragma unroll
    for (int i = 0; i < TK; ++i) {
        const int c = c0 + th.rg + 16 * i;
        if (c < S) {
            write_row<TO>(dkh + (long long)c * dk_sr, gk[i], scale, E, vec, th);
            write_row<TO>(dvh + (long long)c * dv_sr, gv[i], 1.f, Ev, vec, th);
        }
    }
}

#define SDPA_INSTANTIATIONS(HD, BQ, BK)                                                        \
    template __global__ void sdpa_forward_kernel<HD, BQ, BK>(                                  \
        const float*, const float*, const float*, float*, float*, const long long*, int, int, \
        int, int, int, int, long long, long long, long long, long long, long long, long long,  \
        long long, long long, long long, long long, long long, long long, float, int,          \
        unsigned long long, unsigned int, unsigned int, float, int, int);

#define SDPA_BACKWARD_INSTANTIATIONS(HD, BQ, BK)                                               \
    template __global__ void sdpa_backward_dq_kernel<HD, BQ, BK>(                              \
        const float*, const float*, const float*, const float*, const float*, const float*,    \
        const long long*, float*, float*, int, int, int, int, int, int, long long, long long,  \
        long long, long long, long long, long long, long long, long long, long long,           \
        long long, long long, long long, long long, long long, long long, long long,           \
        long long, long long, float, float, int, unsigned long long, unsigned int,             \
        unsigned int, float, int, int);                                                        \
    template __global__ void sdpa_backward_dkdv_kernel<HD, BQ, BK>(                            \
        const float*, const float*, const float*, const float*, const float*, const float*,    \
        const long long*, float*, float*, int, int, int, int, int, int, long long, long long,   \
        long long, long long, long long, long long, long long, long long, long long,           \
        long long, long long, long long, long long, long long, long long, long long,           \
        long long, long long, float, float, int, unsigned long long, unsigned int,             \
        unsigned int, float, int, int);

// Explicit instantiations (the tiles backends/cuda/attention.py launches): compiled by the
// NVRTC CI test without name_expressions.
SDPA_INSTANTIATIONS(32, 64, 64)
SDPA_INSTANTIATIONS(64, 64, 64)
SDPA_INSTANTIATIONS(128, 64, 32)
SDPA_BACKWARD_INSTANTIATIONS(32, 64, 64)
SDPA_BACKWARD_INSTANTIATIONS(64, 64, 64)
SDPA_BACKWARD_INSTANTIATIONS(128, 32, 32)
