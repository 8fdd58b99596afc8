// Stride-1 convolutions of small images, a kernel per conv shape: every size is a template
// parameter (conv.py instantiates the node's geometry), so index arithmetic divides by
// constants, shared arrays are static and the tap loops unroll. A block stages what it reads
// (zero-padded input planes, weights) in shared memory once; each thread then computes a
// register tile, so one value read from shared memory feeds several FMAs.
// (The first version took sizes as runtime ints: its staging loops spent more instructions
// on integer division than the convolution spent on FMAs.)
// NCHW contiguous; w (O, C, KH, KW). Each output has one owner summing in a fixed order (a
// thread, then for dw a fixed in-block order and the in-order split sum): deterministic.
// Shared rows and planes have odd strides, so threads on neighbouring rows or planes read
// different banks. Offsets are 32-bit ints (conv.py checks the tensor sizes).
// Each kernel is templated on S, the storage of its tensors, and T, the type it computes in:
// T = S for float and double; bfloat16 (S = unsigned short, raw bits) computes in float, like
// the NumPy emulation. Staging widens S to T once (the shared arrays hold T); an output is
// rounded to S once, when stored after its whole sum (dw, db: the partial sums stay T and the
// sum kernel rounds), so bf16 results differ from the emulation's only by the sum order.
#include "launch_order.cuh"
#include "bf16.cuh"

template <typename T, int K>
struct alignas(sizeof(T) * K) Pack {
    T v[K];
};

// S -> T and T -> S: the identity for float and double; bf16 and float16 bits widen exactly and
// round to nearest even on store (bf16.cuh, fp16.cuh: the NumPy emulation's rule).
__device__ __forceinline__ float widen(float v) { return v; }
__device__ __forceinline__ double widen(double v) { return v; }
__device__ __forceinline__ float widen(unsigned short v) { return bf16_to_float(v); }
__device__ __forceinline__ float widen(fp16_bits v) { return fp16_to_float(v); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(double* p, double v) { *p = v; }
__device__ __forceinline__ void store(unsigned short* p, float v) { *p = bf16_from_float(v); }
__device__ __forceinline__ void store(fp16_bits* p, float v) { *p = fp16_from_float(v); }

__host__ __device__ constexpr int odd(int stride) { return stride | 1; }
__host__ __device__ constexpr int cdiv(int a, int b) { return (a + b - 1) / b; }

// Staging copies issue STAGE_LOADS global loads per thread before storing any of them, so a
// thread's loads overlap instead of each waiting for the store of the one before.
constexpr int STAGE_LOADS = 8;

// For e < TOTAL: dst[to(e)] = from(e) < 0 ? 0 : src[from(e)] widened, loads in batches.
template <int TOTAL, typename T, typename S, typename From, typename To>
__device__ __forceinline__ void stage(T* dst, const S* __restrict__ src, From from, To to) {
    for (int base = threadIdx.x; base < TOTAL; base += STAGE_LOADS * blockDim.x) {
        T v[STAGE_LOADS];
#pragma unroll
        for (int u = 0; u < STAGE_LOADS; ++u) {
            const int e = base + u * blockDim.x;
            const int at = e < TOTAL ? from(e) : -1;
            v[u] = at < 0 ? T(0) : widen(src[at]);
        }
#pragma unroll
        for (int u = 0; u < STAGE_LOADS; ++u) {
            const int e = base + u * blockDim.x;
            if (e < TOTAL) dst[to(e)] = v[u];
        }
    }
}

// Stages dst[p][h][w] (row stride ROW, plane stride PLANE) = src[p][h0 + h - PH][w - PW] for
// P planes of HD x WD, zero outside the HS x WS source planes and for p >= planes (the source
// has only that many); reads run along source rows.
template <int P, int HS, int WS, int HD, int WD, int PH, int PW, int ROW, int PLANE, typename T,
          typename S>
__device__ __forceinline__ void stage_planes(T* dst, const S* __restrict__ src, int h0,
                                             int planes = P) {
    stage<P * HD * WD>(
        dst, src,
        [=](int e) {
            const int p = e / (HD * WD), r = e % (HD * WD);
            const int h = h0 + r / WD - PH, w = r % WD - PW;
            return p < planes && (unsigned)h < (unsigned)HS && (unsigned)w < (unsigned)WS
                       ? (p * HS + h) * WS + w : -1;
        },
        [=](int e) {
            const int p = e / (HD * WD), r = e % (HD * WD);
            return p * PLANE + (r / WD) * ROW + r % WD;
        });
}

// acc[ob][px] += the taps of input channels [ic0, ic1) for one thread item: x0 points at
// the item's window in the staged planes, wg at its channel group's weight packs.
template <int KH, int KW, int ROW, int PLANE, int OB, int PX, typename T>
__device__ __forceinline__ void accumulate_taps(T (&acc)[OB][PX], const T* x0,
                                                const Pack<T, OB>* wg, int ic0, int ic1) {
#pragma unroll 2
    for (int ic = ic0; ic < ic1; ++ic) {
#pragma unroll
        for (int i = 0; i < KH; ++i) {
            const T* xr = x0 + ic * PLANE + i * ROW;
            T xv[PX + KW - 1];
#pragma unroll
            for (int u = 0; u < PX + KW - 1; ++u) xv[u] = xr[u];
#pragma unroll
            for (int j = 0; j < KW; ++j) {
                const Pack<T, OB> wv = wg[(ic * KH + i) * KW + j];
#pragma unroll
                for (int ob = 0; ob < OB; ++ob) {
#pragma unroll
                    for (int px = 0; px < PX; ++px) acc[ob][px] += xv[px + j] * wv.v[ob];
                }
            }
        }
    }
}

// out[n, oc, ho, wo] = bias[oc] + sum_{ic, i, j} in[n, ic, ho + i - PH, wo + j - PW] * k
// with k = w[oc, ic, i, j]                 (FLIP = false: the forward; in = x, out = y)
// or   k = w[ic, oc, KH-1-i, KW-1-j]       (FLIP = true: dx of a stride-1 conv; in = dy,
//                                           out = dx, PH/PW = kernel - 1 - conv padding).
// grid (N, cdiv(groups, GB)): block (n, s) computes the output-channel groups [s*GB, s*GB+GB)
// of OB channels; a thread item is (group, ho, PX neighbouring wo) with OB x PX accumulators.
// KS > 1 splits the input channels of an item over KS threads (more warps to hide latency;
// conv.py makes KS * GB * HOUT * cdiv(WOUT, PX) <= blockDim, one pass): splits 1.. hand their
// sums to split 0 through shared memory. Sum order: bias, split 0's channels (ic, i, j
// ascending), then each later split's sum in split order. flags: 1 adds the bias, 2 stores
// max(sum, 0) (a fused ReLU: negatives become +0, as conv.cu's epilogue makes them).
template <typename S, typename T, int CIN, int HIN, int WIN, int COUT, int KH, int KW, int PH,
          int PW, int OB, int PX, int GB, int KS, bool FLIP>
__global__ void __launch_bounds__(512)
conv2d_tiled_kernel(const S* __restrict__ in, const S* __restrict__ w,
                    const S* __restrict__ bias, S* __restrict__ out, int flags) {
    await_previous_kernel();
    constexpr int KK = KH * KW;
    constexpr int HOUT = HIN + 2 * PH - KH + 1, WOUT = WIN + 2 * PW - KW + 1;
    constexpr int GROUPS = cdiv(COUT, OB), WG = cdiv(WOUT, PX);   // pixel groups per row
    constexpr int HP = HOUT + KH - 1, WP = WG * PX + KW - 1;      // staged plane: the last
    constexpr int ROW = odd(WP), PLANE = odd(HP * ROW);           // tile's overhang reads 0
    constexpr int SLOTS = GB * HOUT * WG, CPS = cdiv(CIN, KS);    // items; channels a split
    __shared__ Pack<T, OB> ws[GB * CIN * KK];
    __shared__ T xs[CIN * PLANE];
    __shared__ T handed[KS > 1 ? (KS - 1) * SLOTS * OB * PX : 1];

    const int n = blockIdx.x;
    const int g0 = blockIdx.y * GB, gn = min(GB, GROUPS - g0);
    const int oc0 = g0 * OB;
    // Weights as packs: channel oc0 + t goes to lane t % OB of pack (t / OB, ic, tap); zero
    // past COUT. Reads run along w's rows either way.
    T* lanes = reinterpret_cast<T*>(ws);
    if (!FLIP) {
        // w[oc0 + t][ic][k]: contiguous in e.
        stage<GB * OB * CIN * KK>(
            lanes, w,
            [=](int e) { return oc0 + e / (CIN * KK) < COUT ? oc0 * CIN * KK + e : -1; },
            [=](int e) {
                const int t = e / (CIN * KK);
                return ((t / OB) * CIN * KK + e % (CIN * KK)) * OB + t % OB;
            });
    } else {
        // w[ic][oc0 + t][k], flipped to tap KK-1-k: runs of GB*OB*KK values per ic.
        constexpr int RUN = GB * OB * KK;
        stage<CIN * RUN>(
            lanes, w,
            [=](int e) {
                const int ic = e / RUN, t = (e % RUN) / KK;
                return oc0 + t < COUT ? (ic * COUT + oc0 + t) * KK + e % KK : -1;
            },
            [=](int e) {
                const int ic = e / RUN, t = (e % RUN) / KK;
                return (((t / OB) * CIN + ic) * KK + KK - 1 - e % KK) * OB + t % OB;
            });
    }
    stage_planes<CIN, HIN, WIN, HP, WP, PH, PW, ROW, PLANE>(xs, in + n * CIN * HIN * WIN, 0);
    __syncthreads();

    // Item (g, ho, wo0): its bias-initialised (split 0) or zero accumulators, its window, its
    // weights, and where its outputs go.
    auto item_start = [&](int item, bool with_bias, T (&acc)[OB][PX], const T*& x0,
                          const Pack<T, OB>*& wg) {
        const int g = item / (HOUT * WG), r = item % (HOUT * WG);
#pragma unroll
        for (int ob = 0; ob < OB; ++ob) {
            const int oc = oc0 + g * OB + ob;
            const T b = with_bias && (flags & 1) && oc < COUT ? widen(bias[oc]) : T(0);
#pragma unroll
            for (int px = 0; px < PX; ++px) acc[ob][px] = b;
        }
        x0 = xs + (r / WG) * ROW + (r % WG) * PX;
        wg = ws + g * CIN * KK;
    };
    auto item_store = [&](int item, const T (&acc)[OB][PX]) {
        const int g = item / (HOUT * WG), r = item % (HOUT * WG);
        const int ho = r / WG, wo0 = (r % WG) * PX;
#pragma unroll
        for (int ob = 0; ob < OB; ++ob) {
            const int oc = oc0 + g * OB + ob;
            if (oc >= COUT) continue;
            S* o = out + ((n * COUT + oc) * HOUT + ho) * WOUT + wo0;
#pragma unroll
            for (int px = 0; px < PX; ++px) {
                if (wo0 + px < WOUT) store(o + px, (flags & 2) && acc[ob][px] < T(0) ? T(0)
                                                                           : acc[ob][px]);
            }
        }
    };

    T acc[OB][PX];
    const T* x0;
    const Pack<T, OB>* wg;
    if constexpr (KS == 1) {
        for (int item = threadIdx.x; item < gn * HOUT * WG; item += blockDim.x) {
            item_start(item, true, acc, x0, wg);
            accumulate_taps<KH, KW, ROW, PLANE>(acc, x0, wg, 0, CIN);
            item_store(item, acc);
        }
    } else {
        const int ks = threadIdx.x / SLOTS, item = threadIdx.x % SLOTS;
        const bool active = ks < KS && item < gn * HOUT * WG;
        if (active) {
            item_start(item, ks == 0, acc, x0, wg);
            accumulate_taps<KH, KW, ROW, PLANE>(acc, x0, wg, ks * CPS, min(CIN, ks * CPS + CPS));
            if (ks > 0) {
                T* h = handed + ((ks - 1) * SLOTS + item) * OB * PX;
#pragma unroll
                for (int k = 0; k < OB * PX; ++k) h[k] = acc[k / PX][k % PX];
            }
        }
        __syncthreads();
        if (active && ks == 0) {
#pragma unroll
            for (int s = 1; s < KS; ++s) {
                const T* h = handed + ((s - 1) * SLOTS + item) * OB * PX;
#pragma unroll
                for (int k = 0; k < OB * PX; ++k) acc[k / PX][k % PX] += h[k];
            }
            item_store(item, acc);
        }
    }
}

// Partial weight (and bias) gradients of a stride-1 conv over RPB output rows of one sample:
// block (n, rb, os) takes rows [rb*RPB, rb*RPB + RPB) of dy[n] (RPB = cdiv(HO, RB)) and the
// output channels [os*OPB, os*OPB + OPB) (OPB = cdiv(O, OS)), and writes, for those o,
//   partial[n*RB + rb][(o*C + c)*KK + i*KW + j] = sum over its rows and wo of
//                                   dy[n, o, ho, wo] * x[n, c, ho + i - PH, wo + j - PW]
//   partial[n*RB + rb][O*C*KK + o] = sum over its rows and wo of dy[n, o, ho, wo]   (BIAS)
// and conv2d_tiled_grad_weight_sum_kernel adds the N*RB partials in a fixed order.
// A thread item is (o, c, q): KH x KW accumulators over the block's rows q, q + R, ..., each
// row in tiles of WT pixels (dy rows are staged zero-padded to a multiple of WT). With R > 1
// the row groups' sums meet in shared memory and are added in q order. Sum order per
// weight: q, then ho, then wo ascending.
template <typename S, typename T, int C, int H, int W, int O, int KH, int KW, int PH, int PW,
          int RB, int OS, int R, int WT, bool BIAS>
__global__ void __launch_bounds__(512)
conv2d_tiled_grad_weight_kernel(const S* __restrict__ dy, const S* __restrict__ x,
                                T* __restrict__ partial) {
    await_previous_kernel();
    constexpr int KK = KH * KW;
    constexpr int HO = H + 2 * PH - KH + 1, WO = W + 2 * PW - KW + 1;
    constexpr int RPB = cdiv(HO, RB), WD = cdiv(WO, WT) * WT;     // rows; padded dy row
    constexpr int OPB = cdiv(O, OS);                              // output channels
    constexpr int HP = RPB + KH - 1, WP = WD + KW - 1;            // staged x plane
    constexpr int X_ROW = odd(WP), X_PLANE = odd(HP * X_ROW);
    constexpr int D_ROW = odd(WD), D_PLANE = odd(RPB * D_ROW);
    constexpr int OCK = O * C * KK, PER = OCK + (BIAS ? O : 0);   // a partial's length
    constexpr int MINE = OPB * C * KK + (BIAS ? OPB : 0);         // this block's share
    __shared__ T xs[C * X_PLANE];
    __shared__ T ds[OPB * D_PLANE];
    __shared__ T sums[R > 1 ? R * MINE : 1];

    const int n = blockIdx.x, rb = blockIdx.y, h0 = rb * RPB;
    const int o0 = blockIdx.z * OPB, on = min(OPB, O - o0);
    // x rows h0 - PH ... (padded); dy rows h0 ... of channels o0 ... (zero past HO and WO).
    stage_planes<C, H, W, HP, WP, PH, PW, X_ROW, X_PLANE>(xs, x + n * C * H * W, h0);
    stage_planes<OPB, HO, WO, RPB, WD, 0, 0, D_ROW, D_PLANE>(ds, dy + (n * O + o0) * HO * WO,
                                                              h0, on);
    __syncthreads();

    T* part = partial + (n * RB + rb) * PER;
    // Where item (o, c)'s sums go: straight into the partial (R = 1) or row group q's slot.
    auto weight_at = [&](int o, int c, int q) {
        return R > 1 ? sums + q * MINE + (o * C + c) * KK : part + ((o0 + o) * C + c) * KK;
    };
    auto bias_at = [&](int o, int q) {
        return R > 1 ? sums + q * MINE + OPB * C * KK + o : part + OCK + o0 + o;
    };
    for (int item = threadIdx.x; item < on * C * R; item += blockDim.x) {
        const int c = item % C, q = (item / C) % R, o = item / (C * R);
        T acc[KH][KW], bsum = T(0);
#pragma unroll
        for (int i = 0; i < KH; ++i) {
#pragma unroll
            for (int j = 0; j < KW; ++j) acc[i][j] = T(0);
        }
        for (int hr = q; hr < RPB; hr += R) {
            const T* dr = ds + o * D_PLANE + hr * D_ROW;
            const T* xr0 = xs + c * X_PLANE + hr * X_ROW;
#pragma unroll
            for (int wo0 = 0; wo0 < WD; wo0 += WT) {
                T d[WT];
#pragma unroll
                for (int t = 0; t < WT; ++t) {
                    d[t] = dr[wo0 + t];
                    bsum += d[t];
                }
#pragma unroll
                for (int i = 0; i < KH; ++i) {
                    T xv[WT + KW - 1];
#pragma unroll
                    for (int u = 0; u < WT + KW - 1; ++u) xv[u] = xr0[i * X_ROW + wo0 + u];
#pragma unroll
                    for (int j = 0; j < KW; ++j) {
#pragma unroll
                        for (int t = 0; t < WT; ++t) acc[i][j] += d[t] * xv[t + j];
                    }
                }
            }
        }
        T* out = weight_at(o, c, q);
#pragma unroll
        for (int i = 0; i < KH; ++i) {
#pragma unroll
            for (int j = 0; j < KW; ++j) out[i * KW + j] = acc[i][j];
        }
        if (BIAS && c == 0) *bias_at(o, q) = bsum;
    }
    if (R > 1) {
        __syncthreads();
        for (int e = threadIdx.x; e < MINE; e += blockDim.x) {
            const bool is_weight = e < OPB * C * KK;
            if ((is_weight ? e / (C * KK) : e - OPB * C * KK) >= on) continue;
            T s = T(0);
#pragma unroll
            for (int q = 0; q < R; ++q) s += sums[q * MINE + e];
            part[is_weight ? o0 * C * KK + e : OCK + o0 + e - OPB * C * KK] = s;
        }
    }
}

// dw[e] = sum_p partial[p][e] for e < weights, db[e - weights] = the same past them; p
// ascending in SLICES interleaved runs (thread (column, s) adds p = s, s + SLICES, ...), then
// the runs in s order: a block of 32 columns x SLICES keeps many loads in flight. The partials
// are T; dw and db are rounded to S here, once.
constexpr int SUM_SLICES = 8;

template <typename S, typename T>
__global__ void __launch_bounds__(32 * SUM_SLICES)
conv2d_tiled_grad_weight_sum_kernel(const T* __restrict__ partial, S* __restrict__ dw,
                                    S* __restrict__ db, int weights, int per, int parts) {
    await_previous_kernel();
    __shared__ T runs[SUM_SLICES][32];
    const int col = threadIdx.x % 32, s = threadIdx.x / 32;
    const int e = blockIdx.x * 32 + col;
    T sum = T(0);
    if (e < per) {
        for (int p0 = s; p0 < parts; p0 += STAGE_LOADS * SUM_SLICES) {
            T v[STAGE_LOADS];
#pragma unroll
            for (int u = 0; u < STAGE_LOADS; ++u) {
                const int p = p0 + u * SUM_SLICES;
                v[u] = p < parts ? partial[p * per + e] : T(0);
            }
#pragma unroll
            for (int u = 0; u < STAGE_LOADS; ++u) sum += v[u];
        }
    }
    runs[s][col] = sum;
    __syncthreads();
    if (s == 0 && e < per) {
#pragma unroll
        for (int k = 1; k < SUM_SLICES; ++k) sum += runs[k][col];
        if (e < weights) store(dw + e, sum);
        else store(db + e - weights, sum);
    }
}
