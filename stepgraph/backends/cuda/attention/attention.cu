// Scaled dot-product attention (sdpa, sdpa_grad) with FlashAttention-2's scheme on tensor
// cores: the (L, S) scores never exist in memory. The forward walks the key tiles of a tile of
// queries with an online softmax and saves each row's logsumexp; the backward recomputes the
// probabilities from it, in two kernels without atomics (deterministic): dq per query tile
// (which also sums D = rowsum(dout * out) for the other), then dk and dv per key tile.
// Dropout regenerates the dropout op's Philox mask of the (bh, L, S) probabilities from the
// element's flat index (philox.cuh) in every kernel.
//
// Blocks of 128 threads. The tile products run warp-wide on tensor cores (mma.sync m16n8k8)
// over tiles in shared memory and leave their results there; the softmax, masks and dropout
// then run per thread: 16 row groups rg of 8 lanes cg (a row group inside one warp, so row
// reductions are three shuffles), a thread owning rows rg + 16 i and columns 4 cg + 32 j + e
// of a (rows x cols) tile (e < 4: four consecutive keys, one Philox draw for four elements).
// Operands are read with explicit batch / head / row strides (columns contiguous): bh = b *
// heads + h. Grouped heads (k, v of heads / group heads): query head h reads kv head h / group
// (kv_offset), and the dk/dv kernel sums a kv head's group of query heads in one block. An
// optional additive mask (the op's mask input, of T) is read through four strides, 0 along
// the dims it broadcasts over (no (bh, L, S) copy); a row it blocks wholly gives out 0, lse
// -inf and no gradient (torch's safe softmax). Tiles in shared memory: "rows" [R][HD + 4] (a
// row's columns contiguous) and scores [BQ][BK + 4]; the pads keep the per-thread accesses
// free of bank conflicts.
// Templates <HD, BQ, BK, MATH, T>: head dims up to HD (32, 64, 96, 128: a thread's columns
// step by 32, so HD is a multiple of 32; other head dims run zero padded), BQ queries x BK
// keys per tile (multiples of 32: the 2 x 2 warps' fragments of 16 rows, a thread's columns
// stepping by 32; BK <= BQ for dk/dv; the launcher times a few per problem), T the storage of q, k, v, out and their gradients (float, or unsigned short:
// bf16 bits, or fp16_bits: float16, widened on load, rounded once on store; lse and D are
// float32 either way), and the products' arithmetic:
//   SDPA_TF32   inputs rounded to TF32 (precision="tf32", as the GEMMs; and "bf16" and
//               "fp16", whose q, k, v are exact in TF32, only the probabilities and dS are
//               rounded);
//   SDPA_3XTF32 each input split into a TF32 part and a TF32 remainder, three products per
//               step (a_lo b_hi + a_hi b_lo + a_hi b_hi): float32-level accuracy
//               (precision="fp32"; the scheme cuBLAS and CUTLASS call 3xTF32).
// No explicit instantiations: each kernel a problem needs is compiled on its own
// (compiler.PER_SHAPE_SOURCES), so a step compiles the few it launches or times, not all.
#include "launch_order.cuh"
#include "bf16.cuh"
#include "philox.cuh"

#define SDPA_THREADS 128
#define SDPA_LOG2E 1.4426950408889634f
#define SDPA_LN2 0.6931471805599453f
#define SDPA_NEG_INF __int_as_float(0xff800000)
#define SDPA_TF32 1
#define SDPA_3XTF32 2

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

// The kv head that query head bh reads: heads / group kv heads, each shared by `group` query
// heads (group 1: bh's own head).
__device__ __forceinline__ long long kv_offset(int bh, int heads, int group, long long sb,
                                               long long sh) {
    return (long long)(bh / heads) * sb + (long long)((bh % heads) / group) * sh;
}

// One head's additive mask: element (r, c) at p[r sr + c sc] (strides 0 where it broadcasts);
// p null: no mask.
template <typename T>
struct SdpaMask {
    const T* p;
    long long sr, sc;
    __device__ __forceinline__ float at(int r, int c) const {
        return load_as_float(p, (long long)r * sr + (long long)c * sc);
    }
};

template <typename T>
__device__ __forceinline__ SdpaMask<T> mask_of(const T* mask, int bh, int heads, long long sb,
                                               long long sh, long long sr, long long sc) {
    return SdpaMask<T>{mask ? mask + head_offset(bh, heads, sb, sh) : nullptr, sr, sc};
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
// rows >= nrows and columns >= dim read as 0. vec: four elements a load (one 16-byte float4 or
// 8-byte bf16 access).
template <int R, int HD, typename T>
__device__ __forceinline__ void load_rows(float* s, const T* g, long long sr, int row0,
                                          int nrows, int dim, int vec) {
    constexpr int LD = HD + 4;
    if (vec) {
        constexpr int C4 = HD / 4;
        for (int t = threadIdx.x; t < R * C4; t += SDPA_THREADS) {
            const int r = t / C4, d = (t % C4) * 4;
            float x[4] = {0.f, 0.f, 0.f, 0.f};
            if (row0 + r < nrows && d < dim) load4_as_float(g, (long long)(row0 + r) * sr + d, x);
            *reinterpret_cast<float4*>(s + r * LD + d) = make_float4(x[0], x[1], x[2], x[3]);
        }
    } else {
        for (int t = threadIdx.x; t < R * HD; t += SDPA_THREADS) {
            const int r = t / HD, d = t % HD;
            s[r * LD + d] = row0 + r < nrows && d < dim
                                ? load_as_float(g, (long long)(row0 + r) * sr + d) : 0.f;
        }
    }
}

// ---- per-thread rows of a tile -----------------------------------------------------------

// A thread's values of tile row `row` (columns 4 cg + 32 j + e) into s[row][LD].
template <int TC, int LD>
__device__ __forceinline__ void store_row(float* s, const float (&v)[TC], int row,
                                          const SdpaThread& th) {
#pragma unroll
    for (int j = 0; j < TC / 4; ++j)
        *reinterpret_cast<float4*>(s + row * LD + 4 * th.cg + 32 * j) =
            make_float4(v[4 * j], v[4 * j + 1], v[4 * j + 2], v[4 * j + 3]);
}

// The same out of s[row][LD].
template <int TC, int LD>
__device__ __forceinline__ void load_row(float (&v)[TC], const float* s, int row,
                                         const SdpaThread& th) {
#pragma unroll
    for (int j = 0; j < TC / 4; ++j) {
        const float4 t = *reinterpret_cast<const float4*>(s + row * LD + 4 * th.cg + 32 * j);
        v[4 * j] = t.x;
        v[4 * j + 1] = t.y;
        v[4 * j + 2] = t.z;
        v[4 * j + 3] = t.w;
    }
}

// Row i of a thread's (rows x HD) result, times `mul`, into global row g (columns < dim).
template <int TC, typename T>
__device__ __forceinline__ void write_row(T* g, const float (&v)[TC], float mul, int dim,
                                          int vec, const SdpaThread& th) {
#pragma unroll
    for (int j = 0; j < TC / 4; ++j) {
        const int d = 4 * th.cg + 32 * j;
        const float x[4] = {v[4 * j] * mul, v[4 * j + 1] * mul, v[4 * j + 2] * mul,
                            v[4 * j + 3] * mul};
        if (vec) {
            if (d < dim) store4_from_float(g, d, x);
        } else {
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (d + e < dim) store_from_float(g, d + e, x[e]);
        }
    }
}

// ---- tensor-core tile products: mma.sync m16n8k8, TF32 in, float32 accumulate --------------
// The 4 warps of a block tile an M x N result 2 x 2: warp (wm, wn) owns rows wm M/2 + [0, M/2)
// and columns wn N/2 + [0, N/2), as FM x FN fragments of 16 x 8. In a fragment lane (g =
// lane / 4, t = lane % 4) holds A (g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4); B (t, g),
// (t + 4, g); C (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1) (the PTX ISA's layouts).

template <int M, int N>
struct TcTile {
    static constexpr int FM = M / 32, FN = N / 16;
    static_assert(M % 32 == 0 && N % 16 == 0, "tile must split into 2 x 2 warps of 16 x 8");
    float c[FM][FN][4];
};

struct TcLane {
    int g, t, wm, wn;
    __device__ TcLane() {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
        g = lane >> 2;
        t = lane & 3;
        wm = warp >> 1;
        wn = warp & 1;
    }
};

__device__ __forceinline__ unsigned int to_tf32(float x) {
    unsigned int r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ void mma_tf32(float (&d)[4], const unsigned int (&a)[4],
                                         const unsigned int (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// x as hi (TF32) and, for SDPA_3XTF32, lo = TF32(x - hi).
template <int MATH, int R>
__device__ __forceinline__ void split_tf32(const float (&x)[R], unsigned int (&hi)[R],
                                           unsigned int (&lo)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) {
        hi[i] = to_tf32(x[i]);
        if (MATH == SDPA_3XTF32) lo[i] = to_tf32(x[i] - __uint_as_float(hi[i]));
    }
}

template <int M, int N>
__device__ __forceinline__ void zero(TcTile<M, N>& acc) {
#pragma unroll
    for (int i = 0; i < TcTile<M, N>::FM; ++i)
#pragma unroll
        for (int j = 0; j < TcTile<M, N>::FN; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc.c[i][j][e] = 0.f;
}

// acc (M x N) += A (M x K) B (K x N), operands in shared memory: A(m, k) = a[m LA + k], or
// a[k LA + m] when AT; B(k, n) = b[k LB + n], or b[n LB + k] when BT.
template <int MATH, int M, int N, int K, int LA, bool AT, int LB, bool BT>
__device__ __forceinline__ void mma_tc(TcTile<M, N>& acc, const float* a, const float* b) {
    using Tile = TcTile<M, N>;
    const TcLane ln;
    const int m0 = ln.wm * (M / 2), n0 = ln.wn * (N / 2);
#pragma unroll 2
    for (int k = 0; k < K; k += 8) {
        unsigned int ah[Tile::FM][4], al[Tile::FM][4], bh[Tile::FN][2], bl[Tile::FN][2];
#pragma unroll
        for (int i = 0; i < Tile::FM; ++i) {
            float x[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int m = m0 + 16 * i + ln.g + 8 * (e & 1), kk = k + ln.t + 4 * (e >> 1);
                x[e] = AT ? a[kk * LA + m] : a[m * LA + kk];
            }
            split_tf32<MATH>(x, ah[i], al[i]);
        }
#pragma unroll
        for (int j = 0; j < Tile::FN; ++j) {
            float x[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int n = n0 + 8 * j + ln.g, kk = k + ln.t + 4 * e;
                x[e] = BT ? b[n * LB + kk] : b[kk * LB + n];
            }
            split_tf32<MATH>(x, bh[j], bl[j]);
        }
#pragma unroll
        for (int i = 0; i < Tile::FM; ++i)
#pragma unroll
            for (int j = 0; j < Tile::FN; ++j) {
                if (MATH == SDPA_3XTF32) {       // the small terms first
                    mma_tf32(acc.c[i][j], al[i], bh[j]);
                    mma_tf32(acc.c[i][j], ah[i], bl[j]);
                }
                mma_tf32(acc.c[i][j], ah[i], bh[j]);
            }
    }
}

// The fragments into shared memory c[m LC + n].
template <int M, int N, int LC>
__device__ __forceinline__ void store_tc(float* c, const TcTile<M, N>& acc) {
    const TcLane ln;
#pragma unroll
    for (int i = 0; i < TcTile<M, N>::FM; ++i)
#pragma unroll
        for (int j = 0; j < TcTile<M, N>::FN; ++j) {
            const int m = ln.wm * (M / 2) + 16 * i + ln.g, n = ln.wn * (N / 2) + 8 * j + 2 * ln.t;
            *reinterpret_cast<float2*>(c + m * LC + n) = make_float2(acc.c[i][j][0],
                                                                     acc.c[i][j][1]);
            *reinterpret_cast<float2*>(c + (m + 8) * LC + n) = make_float2(acc.c[i][j][2],
                                                                           acc.c[i][j][3]);
        }
}

// Row m of the fragments times mul[m] (the forward's online-softmax rescale).
template <int M, int N>
__device__ __forceinline__ void scale_rows(TcTile<M, N>& acc, const float* mul) {
    const TcLane ln;
#pragma unroll
    for (int i = 0; i < TcTile<M, N>::FM; ++i) {
        const int m = ln.wm * (M / 2) + 16 * i + ln.g;
        const float top = mul[m], bottom = mul[m + 8];
#pragma unroll
        for (int j = 0; j < TcTile<M, N>::FN; ++j) {
            acc.c[i][j][0] *= top;
            acc.c[i][j][1] *= top;
            acc.c[i][j][2] *= bottom;
            acc.c[i][j][3] *= bottom;
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
// blocks of the longest causal tiles first. scale_log2 = scale * log2(e). The output rows
// stay in tensor-core fragments, rescaled per row through `rescale` in shared memory.
template <int HD, int BQ, int BK, int MATH, typename T>
__global__ void __launch_bounds__(SDPA_THREADS)
sdpa_forward_kernel(const T* q, const T* k, const T* v, T* out, float* lse,
                    const long long* step, int heads, int bh_count, int L, int S, int E, int Ev,
                    long long q_sb, long long q_sh, long long q_sr, long long k_sb,
                    long long k_sh, long long k_sr, long long v_sb, long long v_sh,
                    long long v_sr, long long o_sb, long long o_sh, long long o_sr,
                    float scale_log2, int causal, unsigned long long seed, unsigned int site,
                    unsigned int threshold, float drop_scale, int dropout, int vec, int group,
                    const T* mask, long long m_sb, long long m_sh, long long m_sr,
                    long long m_sc) {
    await_previous_kernel();
    constexpr int TR = BQ / 16, TS = BK / 8, TO = HD / 8;
    constexpr int LQ = HD + 4, LT = BK + 4;
    static_assert(BQ % 32 == 0 && BK % 32 == 0, "tiles of whole 32-row, 32-column steps");
    extern __shared__ __align__(16) float smem[];
    float* qs = smem;                  // [BQ][LQ]
    float* ks = qs + BQ * LQ;          // [BK][LQ]
    float* vs = ks + BK * LQ;          // [BK][LQ]
    float* ps = vs + BK * LQ;          // [BQ][LT]: scores, then probabilities
    float* rescale = ps + BQ * LT;     // [BQ]
    check_shared(BQ * LQ + 2 * BK * LQ + BQ * LT + BQ);

    const SdpaThread th;
    const int tiles = (L + BQ - 1) / BQ;
    const int bh = blockIdx.x % bh_count;
    const int q0 = (tiles - 1 - (int)(blockIdx.x / bh_count)) * BQ;
    const int off = S - L;
    const SdpaDropout drop{dropout, dropout ? *step : 0, seed, site, threshold, drop_scale};
    const T* kh = k + kv_offset(bh, heads, group, k_sb, k_sh);
    const T* vh = v + kv_offset(bh, heads, group, v_sb, v_sh);
    const SdpaMask<T> mk = mask_of(mask, bh, heads, m_sb, m_sh, m_sr, m_sc);
    load_rows<BQ, HD>(qs, q + head_offset(bh, heads, q_sb, q_sh), q_sr, q0, L, E, vec);

    float m[TR], l[TR];
    TcTile<BQ, HD> o;
#pragma unroll
    for (int i = 0; i < TR; ++i) m[i] = SDPA_NEG_INF, l[i] = 0.f;
    zero(o);
    const int end = key_end(q0, BQ, L, S, off, causal);
    for (int c0 = 0; c0 < end; c0 += BK) {
        __syncthreads();     // the previous tile's readers are done with ks, vs, ps, rescale
        load_rows<BK, HD>(ks, kh, k_sr, c0, S, E, vec);
        load_rows<BK, HD>(vs, vh, v_sr, c0, S, Ev, vec);
        __syncthreads();
        TcTile<BQ, BK> scores;
        zero(scores);
        mma_tc<MATH, BQ, BK, HD, LQ, false, LQ, true>(scores, qs, ks);
        store_tc<BQ, BK, LT>(ps, scores);
        __syncthreads();
        const bool edge = mk.p || c0 + BK > S || (causal && c0 + BK - 1 > q0 + off);
#pragma unroll
        for (int i = 0; i < TR; ++i) {
            const int r = q0 + th.rg + 16 * i;
            float s[TS];
            load_row<TS, LT>(s, ps, th.rg + 16 * i, th);
            float mx = SDPA_NEG_INF;
#pragma unroll
            for (int j = 0; j < TS; ++j) {
                const int c = c0 + 4 * th.cg + 32 * (j / 4) + j % 4;
                s[j] = edge && !visible(r, c, S, off, causal) ? SDPA_NEG_INF : s[j] * scale_log2;
                if (mk.p && r < L && visible(r, c, S, off, causal))
                    s[j] += mk.at(r, c) * SDPA_LOG2E;
                mx = fmaxf(mx, s[j]);
            }
            const float m_new = fmaxf(m[i], row_max8(mx));
            const float base = m_new == SDPA_NEG_INF ? 0.f : m_new;    // rows masked so far
            const float alpha = exp2f(m[i] - base);
            m[i] = m_new;
            l[i] *= alpha;
            if (th.cg == 0) rescale[th.rg + 16 * i] = alpha;
#pragma unroll
            for (int j = 0; j < TS; ++j) {
                s[j] = exp2f(s[j] - base);
                l[i] += s[j];
            }
            if (drop.on) {
#pragma unroll
                for (int j = 0; j < TS / 4; ++j) {
                    const long long idx =
                        ((long long)bh * L + r) * S + c0 + 4 * th.cg + 32 * j;
                    const unsigned int bits = keep_bits(drop, idx);
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        s[4 * j + e] = (bits >> e) & 1u ? s[4 * j + e] * drop.scale : 0.f;
                }
            }
            store_row<TS, LT>(ps, s, th.rg + 16 * i, th);
        }
        __syncthreads();
        scale_rows(o, rescale);
        mma_tc<MATH, BQ, HD, BK, LT, false, LQ, false>(o, ps, vs);
    }
    // The fragments out through qs (read last before the loop's last barrier).
    store_tc<BQ, HD, LQ>(qs, o);
    __syncthreads();
    T* oh = out + head_offset(bh, heads, o_sb, o_sh);
#pragma unroll
    for (int i = 0; i < TR; ++i) {
        const int r = q0 + th.rg + 16 * i;
        const float total = row_sum8(l[i]);
        if (r < L) {
            float row[TO];
            load_row<TO, LQ>(row, qs, th.rg + 16 * i, th);
            // total is 0 only in a row the mask blocks wholly: out 0 there, lse -inf
            write_row<TO>(oh + (long long)r * o_sr, row, total > 0.f ? 1.f / total : 0.f, Ev,
                          vec, th);
            if (th.cg == 0) lse[(long long)bh * L + r] = (m[i] + log2f(total)) * SDPA_LN2;
        }
    }
}

// ---- backward ------------------------------------------------------------------------------

// P (dropped: kept * scale or 0) and dS = P * (dP * keep * scale - D) of one tile, in place
// of s (scores q k^T) and dp (dout v^T); rows outside [0, L) and masked keys give 0.
template <int TR, int TS, typename T>
__device__ __forceinline__ void probabilities_and_grads(
    float (&s)[TR][TS], float (&dp)[TR][TS], const float (&lse2)[TR], const float (&delta)[TR],
    int bh, int q0, int c0, int L, int S, int off, int causal, float scale_log2,
    const SdpaDropout& drop, const SdpaMask<T>& mk, const SdpaThread& th) {
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
                // lse -inf: a row the mask blocks wholly, which has no gradient
                float p = 0.f;
                if (r < L && lse2[i] != SDPA_NEG_INF && visible(r, cb + e, S, off, causal)) {
                    float x = s[i][jj] * scale_log2;
                    if (mk.p) x += mk.at(r, cb + e) * SDPA_LOG2E;
                    p = exp2f(x - lse2[i]);
                }
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

// The scores s = q k^T and dp = dout v^T of one tile, each into a [R][LT] tile in shared
// memory, then each thread's rows of both out of them.
template <int MATH, int HD, int R, int BK, int TR>
__device__ __forceinline__ void scores_and_grads(float (&s)[TR][BK / 8], float (&dp)[TR][BK / 8],
                                                 float* s_tile, float* dp_tile, const float* qs,
                                                 const float* dos, const float* ks,
                                                 const float* vs, const SdpaThread& th) {
    constexpr int LQ = HD + 4, LT = BK + 4;
    TcTile<R, BK> sc, dpc;
    zero(sc);
    zero(dpc);
    mma_tc<MATH, R, BK, HD, LQ, false, LQ, true>(sc, qs, ks);
    mma_tc<MATH, R, BK, HD, LQ, false, LQ, true>(dpc, dos, vs);
    store_tc<R, BK, LT>(s_tile, sc);
    store_tc<R, BK, LT>(dp_tile, dpc);
    __syncthreads();
#pragma unroll
    for (int i = 0; i < TR; ++i) {
        load_row<BK / 8, LT>(s[i], s_tile, th.rg + 16 * i, th);
        load_row<BK / 8, LT>(dp[i], dp_tile, th.rg + 16 * i, th);
    }
}

// dq for query tile q0 of head bh, looping over its visible key tiles; first D = rowsum(dout
// * out) of its rows, written to delta (bh_count x L) for the dk/dv kernel that follows.
template <int HD, int BQ, int BK, int MATH, typename T>
__global__ void __launch_bounds__(SDPA_THREADS)
sdpa_backward_dq_kernel(const T* q, const T* k, const T* v, const T* out, const T* dout,
                        const float* lse, const long long* step, T* dq,
                        float* delta, int heads, int bh_count, int L, int S, int E, int Ev,
                        long long q_sb, long long q_sh, long long q_sr, long long k_sb,
                        long long k_sh, long long k_sr, long long v_sb, long long v_sh,
                        long long v_sr, long long o_sb, long long o_sh, long long o_sr,
                        long long do_sb, long long do_sh, long long do_sr, long long dq_sb,
                        long long dq_sh, long long dq_sr, float scale_log2, float scale,
                        int causal, unsigned long long seed, unsigned int site,
                        unsigned int threshold, float drop_scale, int dropout, int vec,
                        int group, const T* mask, long long m_sb, long long m_sh,
                        long long m_sr, long long m_sc) {
    await_previous_kernel();
    constexpr int TR = BQ / 16, TS = BK / 8, TO = HD / 8;
    constexpr int LQ = HD + 4, LT = BK + 4;
    static_assert(BQ % 32 == 0 && BK % 32 == 0, "tiles of whole 32-row, 32-column steps");
    extern __shared__ __align__(16) float smem[];
    float* qs = smem;                  // [BQ][LQ]
    float* dos = qs + BQ * LQ;         // [BQ][LQ]
    float* ks = dos + BQ * LQ;         // [BK][LQ]
    float* vs = ks + BK * LQ;          // [BK][LQ]
    float* ss = vs + BK * LQ;          // [BQ][LT]
    float* dss = ss + BQ * LT;         // [BQ][LT]: dp, then dS
    check_shared(2 * BQ * LQ + 2 * BK * LQ + 2 * BQ * LT);

    const SdpaThread th;
    const int tiles = (L + BQ - 1) / BQ;
    const int bh = blockIdx.x % bh_count;
    const int q0 = (tiles - 1 - (int)(blockIdx.x / bh_count)) * BQ;
    const int off = S - L;
    const SdpaDropout drop{dropout, dropout ? *step : 0, seed, site, threshold, drop_scale};
    const T* kh = k + kv_offset(bh, heads, group, k_sb, k_sh);
    const T* vh = v + kv_offset(bh, heads, group, v_sb, v_sh);
    const T* oh = out + head_offset(bh, heads, o_sb, o_sh);
    const SdpaMask<T> mk = mask_of(mask, bh, heads, m_sb, m_sh, m_sr, m_sc);
    load_rows<BQ, HD>(qs, q + head_offset(bh, heads, q_sb, q_sh), q_sr, q0, L, E, vec);
    load_rows<BQ, HD>(dos, dout + head_offset(bh, heads, do_sb, do_sh), do_sr, q0, L, Ev, vec);
    __syncthreads();

    float lse2[TR], dl[TR];
#pragma unroll
    for (int i = 0; i < TR; ++i) {
        const int r = q0 + th.rg + 16 * i;
        float part = 0.f;
        if (r < L) {
            const T* orow = oh + (long long)r * o_sr;
#pragma unroll
            for (int j = 0; j < TO / 4; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int d = 4 * th.cg + 32 * j + e;
                    if (d < Ev)
                        part = fmaf(dos[(th.rg + 16 * i) * LQ + d], load_as_float(orow, d), part);
                }
        }
        dl[i] = row_sum8(part);
        lse2[i] = r < L ? lse[(long long)bh * L + r] * SDPA_LOG2E : 0.f;
        if (r < L && th.cg == 0) delta[(long long)bh * L + r] = dl[i];
    }

    TcTile<BQ, HD> acc;
    zero(acc);
    const int end = key_end(q0, BQ, L, S, off, causal);
    for (int c0 = 0; c0 < end; c0 += BK) {
        __syncthreads();     // the previous tile's readers are done with ks, vs, ss and dss
        load_rows<BK, HD>(ks, kh, k_sr, c0, S, E, vec);
        load_rows<BK, HD>(vs, vh, v_sr, c0, S, Ev, vec);
        __syncthreads();
        float s[TR][TS], dp[TR][TS];
        scores_and_grads<MATH, HD, BQ, BK>(s, dp, ss, dss, qs, dos, ks, vs, th);
        probabilities_and_grads<TR, TS>(s, dp, lse2, dl, bh, q0, c0, L, S, off, causal,
                                        scale_log2, drop, mk, th);
#pragma unroll
        for (int i = 0; i < TR; ++i) store_row<TS, LT>(dss, dp[i], th.rg + 16 * i, th);
        __syncthreads();
        mma_tc<MATH, BQ, HD, BK, LT, false, LQ, false>(acc, dss, ks);     // dq += dS k
    }
    // The fragments out through qs (read last before the loop's last barrier).
    store_tc<BQ, HD, LQ>(qs, acc);
    __syncthreads();
    T* dqh = dq + head_offset(bh, heads, dq_sb, dq_sh);
#pragma unroll
    for (int i = 0; i < TR; ++i) {
        const int r = q0 + th.rg + 16 * i;
        if (r < L) {
            float row[TO];
            load_row<TO, LQ>(row, qs, th.rg + 16 * i, th);
            write_row<TO>(dqh + (long long)r * dq_sr, row, scale, E, vec, th);
        }
    }
}

// dk and dv for key tile c0 of kv head bkv (b * kv heads + kv head), looping over the `group`
// query heads sharing it and, for each, the query tiles that see the tile (no atomics: the
// group's sum stays in the block); reads the delta rows the dq kernel wrote. Blocks of the
// first key tiles (most causal work) first.
template <int HD, int BQ, int BK, int MATH, typename T>
__global__ void __launch_bounds__(SDPA_THREADS)
sdpa_backward_dkdv_kernel(const T* q, const T* k, const T* v, const T* dout,
                          const float* lse, const float* delta, const long long* step, T* dk,
                          T* dv, int heads, int bh_count, int L, int S, int E,
                          int Ev, long long q_sb, long long q_sh, long long q_sr,
                          long long k_sb, long long k_sh, long long k_sr, long long v_sb,
                          long long v_sh, long long v_sr, long long do_sb, long long do_sh,
                          long long do_sr, long long dk_sb, long long dk_sh, long long dk_sr,
                          long long dv_sb, long long dv_sh, long long dv_sr, float scale_log2,
                          float scale, int causal, unsigned long long seed, unsigned int site,
                          unsigned int threshold, float drop_scale, int dropout, int vec,
                          int group, const T* mask, long long m_sb, long long m_sh,
                          long long m_sr, long long m_sc) {
    await_previous_kernel();
    constexpr int TQ = BQ / 16, TK = BK / 16, TS = BK / 8, TO = HD / 8;
    constexpr int LQ = HD + 4, LT = BK + 4;
    static_assert(BK <= BQ, "dk and dv leave through the q and dout tiles");
    static_assert(BQ % 32 == 0 && BK % 32 == 0, "tiles of whole 32-row, 32-column steps");
    extern __shared__ __align__(16) float smem[];
    float* ks = smem;                  // [BK][LQ]
    float* vs = ks + BK * LQ;          // [BK][LQ]
    float* qs = vs + BK * LQ;          // [BQ][LQ]
    float* dos = qs + BQ * LQ;         // [BQ][LQ]
    float* ps = dos + BQ * LQ;         // [BQ][LT]: scores, then probabilities
    float* dss = ps + BQ * LT;         // [BQ][LT]: dp, then dS
    check_shared(2 * BK * LQ + 2 * BQ * LQ + 2 * BQ * LT);

    const SdpaThread th;
    const int kv_heads = heads / group, kv_count = bh_count / group;
    const int bkv = blockIdx.x % kv_count;
    const int c0 = (int)(blockIdx.x / kv_count) * BK;
    const long long b = bkv / kv_heads, hk = bkv % kv_heads;
    const int off = S - L;
    const SdpaDropout drop{dropout, dropout ? *step : 0, seed, site, threshold, drop_scale};
    load_rows<BK, HD>(ks, k + b * k_sb + hk * k_sh, k_sr, c0, S, E, vec);
    load_rows<BK, HD>(vs, v + b * v_sb + hk * v_sh, v_sr, c0, S, Ev, vec);

    TcTile<BK, HD> gk, gv;
    zero(gk);
    zero(gv);
    // Queries r see key c0 when c0 <= r + off: start at the tile holding r = c0 - off.
    const int first = causal ? max(0, c0 - off) / BQ * BQ : 0;
    for (int g = 0; g < group; ++g) {
        const int bh = (int)(b * heads + hk * group + g);       // query head g of the group
        const T* qh = q + head_offset(bh, heads, q_sb, q_sh);
        const T* doh = dout + head_offset(bh, heads, do_sb, do_sh);
        const SdpaMask<T> mk = mask_of(mask, bh, heads, m_sb, m_sh, m_sr, m_sc);
        for (int q0 = first; q0 < L; q0 += BQ) {
            __syncthreads();     // the previous tile's readers are done with qs, dos, ps, dss
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
            scores_and_grads<MATH, HD, BQ, BK>(s, dp, ps, dss, qs, dos, ks, vs, th);
            probabilities_and_grads<TQ, TS>(s, dp, lse2, dl, bh, q0, c0, L, S, off, causal,
                                            scale_log2, drop, mk, th);
#pragma unroll
            for (int i = 0; i < TQ; ++i) {
                store_row<TS, LT>(ps, s[i], th.rg + 16 * i, th);
                store_row<TS, LT>(dss, dp[i], th.rg + 16 * i, th);
            }
            __syncthreads();
            mma_tc<MATH, BK, HD, BQ, LT, true, LQ, false>(gv, ps, dos);   // dv += P^T dout
            mma_tc<MATH, BK, HD, BQ, LT, true, LQ, false>(gk, dss, qs);   // dk += dS^T q
        }
    }
    __syncthreads();         // every warp's last products are done with qs and dos
    store_tc<BK, HD, LQ>(qs, gk);
    store_tc<BK, HD, LQ>(dos, gv);
    __syncthreads();
    T* dkh = dk + b * dk_sb + hk * dk_sh;
    T* dvh = dv + b * dv_sb + hk * dv_sh;
#pragma unroll
    for (int i = 0; i < TK; ++i) {
        const int c = c0 + th.rg + 16 * i;
        if (c < S) {
            float row[TO];
            load_row<TO, LQ>(row, qs, th.rg + 16 * i, th);
            write_row<TO>(dkh + (long long)c * dk_sr, row, scale, E, vec, th);
            load_row<TO, LQ>(row, dos, th.rg + 16 * i, th);
            write_row<TO>(dvh + (long long)c * dv_sr, row, 1.f, Ev, vec, th);
        }
    }
}

// ---- composed path: the scores in memory, between cuBLASLt GEMMs (attention_composed.py) ----
// Where the fused kernels waste work (65 keys take three 32-key tiles) the launcher may run a
// problem as GEMMs over a (bh, L, S) float32 scores buffer with these two row kernels between
// them, one warp a row. Same semantics as the fused kernels: scale, causal pattern, additive
// mask, the dropout op's Philox mask at the same flat index (bh L + r) S + c, and a row
// blocked wholly giving probabilities 0, lse -inf and no gradient. A row's scores start every
// `ld` floats (S rounded up to a multiple of 4, the GEMMs' row stride), so each lane moves
// four consecutive keys in one 16-byte access, the four of one Philox draw.

#define SDPA_ROWS_PER_BLOCK (SDPA_THREADS / 32)

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int o = 16; o; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// Scores c0 .. c0 + 3 of a row (c0 a multiple of 4, the row 16-byte aligned), scaled and
// masked, in log2 units; -inf where not visible (keys past S included).
template <typename T>
__device__ __forceinline__ void row_logits2(float (&x)[4], const float* srow,
                                            const SdpaMask<T>& mk, int r, int c0, int S,
                                            int off, int causal, float scale_log2) {
    const float4 v = *reinterpret_cast<const float4*>(srow + c0);
    const float raw[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        x[e] = SDPA_NEG_INF;
        if (visible(r, c0 + e, S, off, causal)) {
            x[e] = raw[e] * scale_log2;
            if (mk.p) x[e] += mk.at(r, c0 + e) * SDPA_LOG2E;
        }
    }
}

// Scores q k^T of one row -> dropout(softmax) in place, and the row's lse (natural log).
template <typename T>
__global__ void __launch_bounds__(SDPA_THREADS)
sdpa_rows_forward_kernel(float* scores, float* lse, const long long* step, int heads,
                         int bh_count, int L, int S, int ld, float scale_log2, int causal,
                         unsigned long long seed, unsigned int site, unsigned int threshold,
                         float drop_scale, int dropout, const T* mask, long long m_sb,
                         long long m_sh, long long m_sr, long long m_sc) {
    await_previous_kernel();
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * SDPA_ROWS_PER_BLOCK + (threadIdx.x >> 5);
    if (row >= (long long)bh_count * L) return;
    const int bh = (int)(row / L), r = (int)(row % L), off = S - L;
    float* srow = scores + row * ld;
    const SdpaMask<T> mk = mask_of(mask, bh, heads, m_sb, m_sh, m_sr, m_sc);
    const SdpaDropout drop{dropout, dropout ? *step : 0, seed, site, threshold, drop_scale};
    float x[4], m = SDPA_NEG_INF;
    for (int c0 = 4 * lane; c0 < S; c0 += 128) {
        row_logits2(x, srow, mk, r, c0, S, off, causal, scale_log2);
#pragma unroll
        for (int e = 0; e < 4; ++e) m = fmaxf(m, x[e]);
    }
    m = warp_max(m);
    float total = 0.f;
    if (m != SDPA_NEG_INF)
        for (int c0 = 4 * lane; c0 < S; c0 += 128) {
            row_logits2(x, srow, mk, r, c0, S, off, causal, scale_log2);
#pragma unroll
            for (int e = 0; e < 4; ++e) total += exp2f(x[e] - m);
        }
    total = warp_sum(total);
    // total 0: a row blocked wholly (probabilities 0)
    const float inv = total > 0.f ? 1.f / total : 0.f, base = total > 0.f ? m : 0.f;
    for (int c0 = 4 * lane; c0 < S; c0 += 128) {
        row_logits2(x, srow, mk, r, c0, S, off, causal, scale_log2);
        const unsigned int bits = drop.on ? keep_bits(drop, row * S + c0) : 0xfu;
        float p[4];
#pragma unroll
        for (int e = 0; e < 4; ++e)
            p[e] = (bits >> e) & 1u ? exp2f(x[e] - base) * inv * (drop.on ? drop.scale : 1.f)
                                    : 0.f;
        *reinterpret_cast<float4*>(srow + c0) = make_float4(p[0], p[1], p[2], p[3]);
    }
    if (lane == 0) lse[row] = total > 0.f ? (m + log2f(total)) * SDPA_LN2 : SDPA_NEG_INF;
}

// One row of the gradient: scores q k^T -> the dropped probabilities P (for dv = P^T dout),
// dscores dout v^T -> scale * P * (dP - D) (for dq = dS k, dk = dS^T q), both in place, with D =
// rowsum(dout * out) from the row's out and dout (read through their head strides).
template <typename T>
__global__ void __launch_bounds__(SDPA_THREADS)
sdpa_rows_backward_kernel(float* scores, float* dscores, const float* lse, const T* out,
                          const T* dout, const long long* step, int heads, int bh_count, int L,
                          int S, int ld, int Ev, long long o_sb, long long o_sh, long long o_sr,
                          long long d_sb, long long d_sh, long long d_sr, float scale_log2,
                          float scale, int causal, unsigned long long seed, unsigned int site,
                          unsigned int threshold, float drop_scale, int dropout, const T* mask,
                          long long m_sb, long long m_sh, long long m_sr, long long m_sc) {
    await_previous_kernel();
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * SDPA_ROWS_PER_BLOCK + (threadIdx.x >> 5);
    if (row >= (long long)bh_count * L) return;
    const int bh = (int)(row / L), r = (int)(row % L), off = S - L;
    float* srow = scores + row * ld;
    float* dsrow = dscores + row * ld;
    const SdpaMask<T> mk = mask_of(mask, bh, heads, m_sb, m_sh, m_sr, m_sc);
    const SdpaDropout drop{dropout, dropout ? *step : 0, seed, site, threshold, drop_scale};
    const T* orow = out + head_offset(bh, heads, o_sb, o_sh) + (long long)r * o_sr;
    const T* drow = dout + head_offset(bh, heads, d_sb, d_sh) + (long long)r * d_sr;
    float delta = 0.f;
    for (int e = lane; e < Ev; e += 32) delta += load_as_float(orow, e) * load_as_float(drow, e);
    delta = warp_sum(delta);
    const float lse2 = lse[row] * SDPA_LOG2E;              // -inf: a row blocked wholly
    for (int c0 = 4 * lane; c0 < S; c0 += 128) {
        float x[4];
        row_logits2(x, srow, mk, r, c0, S, off, causal, scale_log2);
        const float4 g4 = *reinterpret_cast<const float4*>(dsrow + c0);
        const float g[4] = {g4.x, g4.y, g4.z, g4.w};
        const unsigned int bits = drop.on ? keep_bits(drop, row * S + c0) : 0xfu;
        float kept[4], ds[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float p = lse2 != SDPA_NEG_INF ? exp2f(x[e] - lse2) : 0.f;
            const float mul = drop.on ? ((bits >> e) & 1u ? drop.scale : 0.f) : 1.f;
            ds[e] = p * (g[e] * mul - delta) * scale;
            kept[e] = p * mul;
        }
        *reinterpret_cast<float4*>(dsrow + c0) = make_float4(ds[0], ds[1], ds[2], ds[3]);
        *reinterpret_cast<float4*>(srow + c0) = make_float4(kept[0], kept[1], kept[2], kept[3]);
    }
}
