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

template <typename T, int K>
struct alignas(sizeof(T) * K) Pack {
    T v[K];
};

__host__ __device__ constexpr int odd(int stride) { return stride | 1; }
__host__ __device__ constexpr int cdiv(int a, int b) { return (a + b - 1) / b; }

// Staging copies keep STAGE_LOADS global loads in flight per thread: a loop that stores each
// value before loading the next waits a full memory latency per element.
constexpr int STAGE_LOADS = 8;

// For e < TOTAL: dst[to(e)] = from(e) < 0 ? 0 : src[from(e)], loads issued in batches.
template <int TOTAL, typename T, typename From, typename To>
__device__ __forceinline__ void stage(T* dst, const T* __restrict__ src, From from, To to) {
    for (int base = threadIdx.x; base < TOTAL; base += STAGE_LOADS * blockDim.x) {
        T v[STAGE_LOADS];
#pragma unroll
        for (int u = 0; u < STAGE_LOADS; ++u) {
            const int e = base + u * blockDim.x;
            const int at = e < TOTAL ? from(e) : -1;
            v[u] = at < 0 ? T(0) : src[at];
        }
#pragma unroll
        for (int u = 0; u < STAGE_LOADS; ++u) {
            const int e = base + u * blockDim.x;
            if (e < TOTAL) dst[to(e)] = v[u];
        }
    }
}

// Stages dst[p][h][w] (row stride ROW, plane stride PLANE) = src[p][h0 + h - PH][w - PW] for
// P planes of HD x WD, zero outside the HS x WS source planes; reads run along source rows.
template <int P, int HS, int WS, int HD, int WD, int PH, int PW, int ROW, int PLANE, typename T>
__device__ __forceinline__ void stage_planes(T* dst, const T* __restrict__ src, int h0) {
    stage<P * HD * WD>(
        dst, src,
        [=](int e) {
            const int p = e / (HD * WD), r = e % (HD * WD);
            const int h = h0 + r / WD - PH, w = r % WD - PW;
            return (unsigned)h < (unsigned)HS && (unsigned)w < (unsigned)WS
                       ? (p * HS + h) * WS + w : -1;
        },
        [=](int e) {
            const int p = e / (HD * WD), r = e % (HD * WD);
            return p * PLANE + (r / WD) * ROW + r % WD;
        });
}

// out[n, oc, ho, wo] = bias[oc] + sum_{ic, i, j} in[n, ic, ho + i - PH, wo + j - PW] * k
// with k = w[oc, ic, i, j]                 (FLIP = false: the forward; in = x, out = y)
// or   k = w[ic, oc, KH-1-i, KW-1-j]       (FLIP = true: dx of a stride-1 conv; in = dy,
//                                           out = dx, PH/PW = kernel - 1 - conv padding).
// grid (N, cdiv(groups, GB)): block (n, s) computes the output-channel groups [s*GB, s*GB+GB)
// of OB channels; a thread item is (group, ho, PX neighbouring wo) with OB x PX accumulators.
// Sum order: bias, then ic, i, j ascending.
template <typename T, int CIN, int HIN, int WIN, int COUT, int KH, int KW, int PH, int PW,
          int OB, int PX, int GB, bool FLIP>
__global__ void __launch_bounds__(512)
conv2d_tiled_kernel(const T* __restrict__ in, const T* __restrict__ w,
                    const T* __restrict__ bias, T* __restrict__ out, int has_bias) {
    constexpr int KK = KH * KW;
    constexpr int HOUT = HIN + 2 * PH - KH + 1, WOUT = WIN + 2 * PW - KW + 1;
    constexpr int GROUPS = cdiv(COUT, OB), WG = cdiv(WOUT, PX);   // pixel groups per row
    constexpr int HP = HOUT + KH - 1, WP = WG * PX + KW - 1;      // staged plane: the last
    constexpr int ROW = odd(WP), PLANE = odd(HP * ROW);           // tile's overhang reads 0
    __shared__ Pack<T, OB> ws[GB * CIN * KK];
    __shared__ T xs[CIN * PLANE];

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

    for (int item = threadIdx.x; item < gn * HOUT * WG; item += blockDim.x) {
        const int g = item / (HOUT * WG), r = item % (HOUT * WG);
        const int ho = r / WG, wo0 = (r % WG) * PX;
        T acc[OB][PX];
#pragma unroll
        for (int ob = 0; ob < OB; ++ob) {
            const int oc = oc0 + g * OB + ob;
            const T b = has_bias && oc < COUT ? bias[oc] : T(0);
#pragma unroll
            for (int px = 0; px < PX; ++px) acc[ob][px] = b;
        }
        const Pack<T, OB>* wg = ws + g * CIN * KK;
        const T* x0 = xs + ho * ROW + wo0;
#pragma unroll 2
        for (int ic = 0; ic < CIN; ++ic) {
#pragma unroll
            for (int i = 0; i < KH; ++i) {
                const T* xr = x0 + ic * PLANE + i * ROW;
                T xv[PX + KW - 1];
#pragma unroll
                for (int u = 0; u < PX + KW - 1; ++u) xv[u] = xr[u];
#pragma unroll
                for (int j = 0; j < KW; ++j) {
                    const Pack<T, OB> wv = wg[ic * KK + i * KW + j];
#pragma unroll
                    for (int ob = 0; ob < OB; ++ob) {
#pragma unroll
                        for (int px = 0; px < PX; ++px) acc[ob][px] += xv[px + j] * wv.v[ob];
                    }
                }
            }
        }
#pragma unroll
        for (int ob = 0; ob < OB; ++ob) {
            const int oc = oc0 + g * OB + ob;
            if (oc >= COUT) continue;
            T* o = out + ((n * COUT + oc) * HOUT + ho) * WOUT + wo0;
#pragma unroll
            for (int px = 0; px < PX; ++px) {
                if (wo0 + px < WOUT) o[px] = acc[ob][px];
            }
        }
    }
}

// Partial weight (and bias) gradients of a stride-1 conv over RPB output rows of one sample:
// block (n, rb) takes rows [rb*RPB, rb*RPB + RPB) of dy[n] (RPB = cdiv(HO, RB)) and writes
//   partial[n*RB + rb][(o*C + c)*KK + i*KW + j] = sum over its rows and wo of
//                                   dy[n, o, ho, wo] * x[n, c, ho + i - PH, wo + j - PW]
//   partial[n*RB + rb][O*C*KK + o] = sum over its rows and wo of dy[n, o, ho, wo]   (BIAS)
// and conv2d_tiled_grad_weight_sum_kernel adds the N*RB partials in order.
// A thread item is (o, c, q): KH x KW accumulators over the block's rows q, q + R, ..., each
// row in tiles of WT pixels (dy rows are staged zero-padded to a multiple of WT). With R > 1
// the row groups' sums meet in shared memory and are added in q order. Sum order per
// weight: q, then ho, then wo ascending.
template <typename T, int C, int H, int W, int O, int KH, int KW, int PH, int PW, int RB,
          int R, int WT, bool BIAS>
__global__ void __launch_bounds__(512)
conv2d_tiled_grad_weight_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                T* __restrict__ partial) {
    constexpr int KK = KH * KW;
    constexpr int HO = H + 2 * PH - KH + 1, WO = W + 2 * PW - KW + 1;
    constexpr int RPB = cdiv(HO, RB), WD = cdiv(WO, WT) * WT;     // rows; padded dy row
    constexpr int HP = RPB + KH - 1, WP = WD + KW - 1;            // staged x plane
    constexpr int X_ROW = odd(WP), X_PLANE = odd(HP * X_ROW);
    constexpr int D_ROW = odd(WD), D_PLANE = odd(RPB * D_ROW);
    constexpr int OCK = O * C * KK, PER = OCK + (BIAS ? O : 0);
    __shared__ T xs[C * X_PLANE];
    __shared__ T ds[O * D_PLANE];
    __shared__ T sums[R > 1 ? R * PER : 1];

    const int n = blockIdx.x, rb = blockIdx.y, h0 = rb * RPB;
    // x rows h0 - PH ... (padded); dy rows h0 ... (zero past HO and WO).
    stage_planes<C, H, W, HP, WP, PH, PW, X_ROW, X_PLANE>(xs, x + n * C * H * W, h0);
    stage_planes<O, HO, WO, RPB, WD, 0, 0, D_ROW, D_PLANE>(ds, dy + n * O * HO * WO, h0);
    __syncthreads();

    T* dst = R > 1 ? sums : partial + (n * RB + rb) * PER;
    for (int item = threadIdx.x; item < O * C * R; item += blockDim.x) {
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
        T* out = dst + (R > 1 ? q * PER : 0);
#pragma unroll
        for (int i = 0; i < KH; ++i) {
#pragma unroll
            for (int j = 0; j < KW; ++j) out[(o * C + c) * KK + i * KW + j] = acc[i][j];
        }
        if (BIAS && c == 0) out[OCK + o] = bsum;
    }
    if (R > 1) {
        __syncthreads();
        for (int e = threadIdx.x; e < PER; e += blockDim.x) {
            T s = T(0);
#pragma unroll
            for (int q = 0; q < R; ++q) s += sums[q * PER + e];
            partial[(n * RB + rb) * PER + e] = s;
        }
    }
}

// dw[e] = sum_p partial[p][e] for e < weights, db[e - weights] = the same past them; p
// ascending in SLICES interleaved runs (thread (column, s) adds p = s, s + SLICES, ...), then
// the runs in s order: a block of 32 columns x SLICES keeps many loads in flight.
constexpr int SUM_SLICES = 8;

template <typename T>
__global__ void __launch_bounds__(32 * SUM_SLICES)
conv2d_tiled_grad_weight_sum_kernel(const T* __restrict__ partial, T* __restrict__ dw,
                                    T* __restrict__ db, int weights, int per, int parts) {
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
        if (e < weights) dw[e] = sum;
        else db[e - weights] = sum;
    }
}
