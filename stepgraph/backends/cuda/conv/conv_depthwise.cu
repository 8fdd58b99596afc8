// Depthwise convolutions (groups == C == O: each channel convolved with its own kh x kw filter,
// MobileNet's and ConvNeXt's): memory-bound work that cuDNN's grouped kernels ran 3-5x slower
// than the traffic allows. One launch per op (grad_weight: one, or two with batch splits), sizes
// as runtime ints, any stride, padding and dilation.
// Layouts: NCHW x (N, C, H, W), y (N, C, Ho, Wo); NHWC ("_nhwc" kernels) x (N, H, W, C),
// y (N, Ho, Wo, C). w is (C, 1, kh, kw) or (C, kh, kw, 1): the same bytes, w[c*kh*kw + i*kw + j].
// Coalescing: NCHW threads run along W (a flat index over the outputs in storage order, the
// filter's loads a broadcast within a warp); NHWC threads run along C (32 channels a block row),
// the block's filters staged in shared memory (a warp would otherwise read 32 filters apart).
// Storage S: float, unsigned short (bfloat16 bits) or fp16_bits (float16), loaded as float
// (bf16.cuh's load_as_float); every sum is float32 with FMAs (the bias first), and each output
// is rounded to S once, on store, as the NumPy emulation and the tiled kernels do.
// Every output element has one owner summing in a fixed order (taps i then j ascending; for dw
// and db a fixed per-thread order, a fixed reduction tree, then the splits in order): no
// atomics, results identical run to run. Offsets are 32-bit ints: conv_depthwise.py launches
// these only on tensors of at most 2^30 elements.
#include "launch_order.cuh"
#include "bf16.cuh"

// The geometry, in the order of conv_depthwise.py's _geometry_args.
#define DEPTHWISE_PARAMS int N, int C, int H, int W, int kh, int kw, int sh, int sw, int ph, \
                         int pw, int dil_h, int dil_w, int Ho, int Wo

constexpr int LANES = 32;        // channels of an NHWC block row (conv_depthwise.py LANES)
constexpr int ROWS = 8;          // pixel rows of an NHWC block (conv_depthwise.py ROWS)
constexpr int MAX_TAPS = 64;     // NHWC: kh*kw of a staged filter (conv_depthwise.py MAX_TAPS)
// grad_weight: a block sums TB taps (and db), TB a template argument (the launcher's
// tap_block): 4 where a filter has so few (a 1 x 3 or 2 x 2 one), else 16. Each thread sets
// up and reduces all TB of them, which for a few taps over many rows was most of its work.
constexpr int MAX_WARPS = 8;     // grad_weight NCHW: 256 threads a block

// The first tap t with 0 <= base + t*step, and one past the last with base + t*step < size
// (at most k): the window's taps inside the image along one axis. Dilation 1 (nearly every
// model's) skips the integer divisions, which a thread would otherwise pay per output.
__device__ __forceinline__ int first_tap(int base, int step) {
    if (step == 1) return max(0, -base);
    return base < 0 ? (-base + step - 1) / step : 0;
}
__device__ __forceinline__ int end_tap(int base, int size, int k, int step) {
    if (step == 1) return max(0, min(k, size - base));
    return base < size ? min(k, (size - base + step - 1) / step) : 0;
}

// acc + sum over the window's taps inside the image, i then j ascending, of
// src[(hb + i*dil_h)*row + (wb + j*dil_w)*col] * weight(i*kw + j). src: one channel's plane.
template <typename S, typename Weight>
__device__ __forceinline__ float window_sum(float acc, const S* __restrict__ src, int row,
                                            int col, int hb, int wb, int H, int W, int kh,
                                            int kw, int dil_h, int dil_w, Weight weight) {
    const int i0 = first_tap(hb, dil_h), i1 = end_tap(hb, H, kh, dil_h);
    const int j0 = first_tap(wb, dil_w), j1 = end_tap(wb, W, kw, dil_w);
    for (int i = i0; i < i1; ++i) {
        const int at = (hb + i * dil_h) * row;
#pragma unroll 7
        for (int j = j0; j < j1; ++j)
            acc = fmaf(load_as_float(src, at + (wb + j * dil_w) * col), weight(i * kw + j), acc);
    }
    return acc;
}

// The output index hit by tap k of an input position: o*s = pos + pad - k*dil, or -1 where no
// output is (not a multiple of the stride, or past the end). Stride 1 skips the division.
__device__ __forceinline__ int source_of(int t, int s, int out) {
    if (s != 1) {
        if (t % s) return -1;
        t /= s;
    }
    return t < out ? t : -1;
}

// acc + sum over the taps (i, j) whose window covers input pixel (h, w), i then j ascending,
// of src[ho*row + wo*col] * weight(i*kw + j), with ho*sh = h + ph - i*dil_h (likewise wo):
// dx's gather over dy. src: one channel's plane of dy.
template <typename S, typename Weight>
__device__ __forceinline__ float gather_sum(float acc, const S* __restrict__ src, int row,
                                            int col, int h, int w, int kh, int kw, int sh,
                                            int sw, int ph, int pw, int dil_h, int dil_w,
                                            int Ho, int Wo, Weight weight) {
    for (int i = 0; i < kh; ++i) {
        const int th = h + ph - i * dil_h;
        if (th < 0) break;                       // falls with i: no later tap either
        const int ho = source_of(th, sh, Ho);
        if (ho < 0) continue;
        for (int j = 0; j < kw; ++j) {
            const int tw = w + pw - j * dil_w;
            if (tw < 0) break;
            const int wo = source_of(tw, sw, Wo);
            if (wo < 0) continue;
            acc = fmaf(load_as_float(src, ho * row + wo * col), weight(i * kw + j), acc);
        }
    }
    return acc;
}

// ws[t][lane] = w[c, t] (c = the block's first channel + lane; 0 past C): an NHWC block's
// filters, one row of taps per lane, so a warp reads consecutive words.
template <typename S>
__device__ __forceinline__ void stage_filters(float (*ws)[LANES], const S* __restrict__ w,
                                              int c, int C, int taps) {
    for (int t = threadIdx.y; t < taps; t += blockDim.y)
        ws[t][threadIdx.x] = c < C ? load_as_float(w, c * taps + t) : 0.f;
}

// y = conv(x, w) + bias (has_bias), then max(y, 0) where relu (the epilogue kernel's rule: a
// NaN stays): a thread per output, flat over y in storage order (grid-stride).
template <typename S>
__global__ void __launch_bounds__(256)
conv2d_depthwise_forward_kernel(const S* __restrict__ x, const S* __restrict__ w,
                                const S* __restrict__ bias, S* __restrict__ y, int has_bias,
                                int relu, DEPTHWISE_PARAMS) {
    await_previous_kernel();
    const int P = Ho * Wo, taps = kh * kw, total = N * C * P;
    for (int q = blockIdx.x * blockDim.x + threadIdx.x; q < total; q += gridDim.x * blockDim.x) {
        const int plane = q / P, p = q - plane * P;          // plane = n*C + c
        const int c = plane % C, ho = p / Wo, wo = p - ho * Wo;
        const S* wc = w + c * taps;
        float acc = has_bias ? load_as_float(bias, c) : 0.f;
        acc = window_sum(acc, x + plane * H * W, W, 1, ho * sh - ph, wo * sw - pw, H, W, kh, kw,
                         dil_h, dil_w, [=](int t) { return load_as_float(wc, t); });
        store_from_float(y, q, relu && acc < 0.f ? 0.f : acc);
    }
}

// The same, channels-last: block (LANES, ROWS) over (channels, output pixels); grid
// (ceil(C / LANES), pixel blocks), a block row striding over the N*Ho*Wo pixels.
template <typename S>
__global__ void __launch_bounds__(256)
conv2d_depthwise_forward_nhwc_kernel(const S* __restrict__ x, const S* __restrict__ w,
                                     const S* __restrict__ bias, S* __restrict__ y,
                                     int has_bias, int relu, DEPTHWISE_PARAMS) {
    await_previous_kernel();
    __shared__ float ws[MAX_TAPS][LANES];
    const int c = blockIdx.x * LANES + threadIdx.x, lane = threadIdx.x;
    stage_filters(ws, w, c, C, kh * kw);
    __syncthreads();
    if (c >= C) return;
    const int P = Ho * Wo, rows = N * P;
    const float b = has_bias ? load_as_float(bias, c) : 0.f;
    for (int r = blockIdx.y * ROWS + threadIdx.y; r < rows; r += gridDim.y * ROWS) {
        const int n = r / P, p = r - n * P, ho = p / Wo, wo = p - ho * Wo;
        const float acc = window_sum(b, x + n * H * W * C + c, W * C, C, ho * sh - ph,
                                     wo * sw - pw, H, W, kh, kw, dil_h, dil_w,
                                     [&](int t) { return ws[t][lane]; });
        store_from_float(y, r * C + c, relu && acc < 0.f ? 0.f : acc);
    }
}

// dx of the forward: a thread per input element (flat over dx in storage order) gathers the
// dy of every window that read it.
template <typename S>
__global__ void __launch_bounds__(256)
conv2d_depthwise_grad_input_kernel(const S* __restrict__ dy, const S* __restrict__ w,
                                   S* __restrict__ dx, DEPTHWISE_PARAMS) {
    await_previous_kernel();
    const int HW = H * W, taps = kh * kw, total = N * C * HW;
    for (int q = blockIdx.x * blockDim.x + threadIdx.x; q < total; q += gridDim.x * blockDim.x) {
        const int plane = q / HW, r = q - plane * HW;
        const int c = plane % C, h = r / W, wi = r - h * W;
        const S* wc = w + c * taps;
        const float acc = gather_sum(0.f, dy + plane * Ho * Wo, Wo, 1, h, wi, kh, kw, sh, sw,
                                     ph, pw, dil_h, dil_w, Ho, Wo,
                                     [=](int t) { return load_as_float(wc, t); });
        store_from_float(dx, q, acc);
    }
}

// The same, channels-last: blocks as the NHWC forward's, over the N*H*W input pixels.
template <typename S>
__global__ void __launch_bounds__(256)
conv2d_depthwise_grad_input_nhwc_kernel(const S* __restrict__ dy, const S* __restrict__ w,
                                        S* __restrict__ dx, DEPTHWISE_PARAMS) {
    await_previous_kernel();
    __shared__ float ws[MAX_TAPS][LANES];
    const int c = blockIdx.x * LANES + threadIdx.x, lane = threadIdx.x;
    stage_filters(ws, w, c, C, kh * kw);
    __syncthreads();
    if (c >= C) return;
    const int HW = H * W, rows = N * HW;
    for (int r = blockIdx.y * ROWS + threadIdx.y; r < rows; r += gridDim.y * ROWS) {
        const int n = r / HW, s = r - n * HW, h = s / W, wi = s - h * W;
        const float acc = gather_sum(0.f, dy + n * Ho * Wo * C + c, Wo * C, C, h, wi, kh, kw,
                                     sh, sw, ph, pw, dil_h, dil_w, Ho, Wo,
                                     [&](int t) { return ws[t][lane]; });
        store_from_float(dx, r * C + c, acc);
    }
}

// ---- grad_weight: dw[c, i, j] = sum_{n,ho,wo} dy[n,c,ho,wo] * x[n,c,ho*sh-ph+i*dil_h, ...],
// and db[c] = sum dy[n,c,:,:] as one more tap (index kh*kw, the x value 1).
// A block sums TB taps (blockIdx.y's) of its channels over its split of the N*Ho*Wo
// output pixels ("rows", blockIdx.z's: [z*per, (z+1)*per)); taps past `taps` are skipped.
// With one split it stores dw and db (rounded once); with several, float32 partial sums
// partial[(z*C + c)*taps + k], which the sum kernel adds in split order.

// Tap k of a block: its offsets from a window's top-left (i*dil_h - ph, j*dil_w - pw), whether
// it exists (k < taps) and whether it is db's (k == kh*kw: x's value taken as 1; else x's value
// at the offset, 0 outside the image).
struct Tap {
    int dh, dw;
    bool live, bias;
};

__device__ __forceinline__ Tap tap_of(int k, int taps, int kh, int kw, int ph, int pw,
                                      int dil_h, int dil_w) {
    const int kk = kh * kw, kc = min(k, kk - 1);
    return Tap{(kc / kw) * dil_h - ph, (kc % kw) * dil_w - pw, k < taps, k == kk};
}

// A block's taps k0 .. k0 + TB - 1 (tap_of), their sums zeroed.
template <int TB>
__device__ __forceinline__ void start_taps(Tap (&tap)[TB], float (&acc)[TB], int k0, int taps,
                                           int kh, int kw, int ph, int pw, int dil_h,
                                           int dil_w) {
#pragma unroll
    for (int t = 0; t < TB; ++t) {
        tap[t] = tap_of(k0 + t, taps, kh, kw, ph, pw, dil_h, dil_w);
        acc[t] = 0.f;
    }
}

template <typename S>
__device__ __forceinline__ void store_tap(S* dw, S* db, int c, int k, int kk, float v) {
    if (k < kk)
        store_from_float(dw, c * kk + k, v);
    else
        store_from_float(db, c, v);
}

// One split's sum of tap k, stored (one split) or written to the partial sums.
template <typename S>
__device__ __forceinline__ void finish_tap(S* dw, S* db, float* partial, int c, int k,
                                           int taps, int kk, int C, float v) {
    if (gridDim.z == 1)
        store_tap(dw, db, c, k, kk, v);
    else
        partial[((long long)blockIdx.z * C + c) * taps + k] = v;
}

// The rows [r0, r1) of blockIdx.z's split.
__device__ __forceinline__ void split_rows(int rows, int& r0, int& r1) {
    const int per = (rows + gridDim.z - 1) / gridDim.z;
    r0 = blockIdx.z * per;
    r1 = min(rows, r0 + per);
}

// acc[t] += g * (tap t's x at output pixel (hs, ws) = (ho*sh, wo*sw)) for the live taps.
template <typename S, int TB>
__device__ __forceinline__ void add_row(float (&acc)[TB], const Tap (&tap)[TB], float g,
                                        const S* __restrict__ xp, int row, int col, int hs,
                                        int ws, int H, int W) {
#pragma unroll
    for (int t = 0; t < TB; ++t) {
        if (!tap[t].live) continue;            // uniform over the block
        const int h = hs + tap[t].dh, w = ws + tap[t].dw;
        const float v = tap[t].bias ? 1.f
            : (unsigned)h < (unsigned)H && (unsigned)w < (unsigned)W
                ? load_as_float(xp, h * row + w * col) : 0.f;
        acc[t] = fmaf(g, v, acc[t]);
    }
}

// NCHW: grid (C, ceil(taps / TB), splits), 256 threads along the rows (wo fastest: dy
// and x read along W). Thread j sums rows r0 + j, r0 + j + 256, ...; then a warp butterfly,
// then warps 0, 1, ... in order.
template <typename S, int TB>
__global__ void __launch_bounds__(256)
conv2d_depthwise_grad_weight_kernel(const S* __restrict__ dy, const S* __restrict__ x,
                                    S* __restrict__ dw, S* __restrict__ db,
                                    float* __restrict__ partial, int taps, DEPTHWISE_PARAMS) {
    await_previous_kernel();
    __shared__ float warp_sums[MAX_WARPS][TB];
    const int c = blockIdx.x, k0 = blockIdx.y * TB, kk = kh * kw, P = Ho * Wo;
    Tap tap[TB];
    float acc[TB];
    start_taps(tap, acc, k0, taps, kh, kw, ph, pw, dil_h, dil_w);
    int r0, r1;
    split_rows(N * P, r0, r1);
    for (int r = r0 + threadIdx.x; r < r1; r += blockDim.x) {
        const int n = r / P, p = r - n * P, ho = p / Wo, wo = p - ho * Wo;
        const int plane = n * C + c;
        add_row(acc, tap, load_as_float(dy, plane * P + p), x + plane * H * W, W, 1, ho * sh,
                wo * sw, H, W);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int t = 0; t < TB; ++t) {
        if (!tap[t].live) continue;
        float v = acc[t];
#pragma unroll
        for (int s = 16; s > 0; s >>= 1) v += __shfl_xor_sync(0xffffffffu, v, s);
        if (lane == 0) warp_sums[warp][t] = v;
    }
    __syncthreads();
    const int t = threadIdx.x;
    if (t < TB && k0 + t < taps) {
        float v = 0.f;
        for (int k = 0; k < (int)(blockDim.x >> 5); ++k) v += warp_sums[k][t];
        finish_tap(dw, db, partial, c, k0 + t, taps, kk, C, v);
    }
}

// NHWC: grid (ceil(C / LANES), ceil(taps / TB), splits), block (LANES, ROWS): a lane
// per channel (dy and x read along C), block row y summing rows r0 + y, r0 + y + ROWS, ...;
// then rows 0, 1, ... added in order.
template <typename S, int TB>
__global__ void __launch_bounds__(256)
conv2d_depthwise_grad_weight_nhwc_kernel(const S* __restrict__ dy, const S* __restrict__ x,
                                         S* __restrict__ dw, S* __restrict__ db,
                                         float* __restrict__ partial, int taps,
                                         DEPTHWISE_PARAMS) {
    await_previous_kernel();
    __shared__ float row_sums[ROWS][TB][LANES];
    const int c = blockIdx.x * LANES + threadIdx.x, cc = min(c, C - 1);  // cc: loads only
    const int k0 = blockIdx.y * TB, kk = kh * kw, P = Ho * Wo;
    Tap tap[TB];
    float acc[TB];
    start_taps(tap, acc, k0, taps, kh, kw, ph, pw, dil_h, dil_w);
    int r0, r1;
    split_rows(N * P, r0, r1);
    for (int r = r0 + threadIdx.y; r < r1; r += ROWS) {
        const int n = r / P, p = r - n * P, ho = p / Wo, wo = p - ho * Wo;
        add_row(acc, tap, load_as_float(dy, r * C + cc), x + n * H * W * C + cc, W * C, C,
                ho * sh, wo * sw, H, W);
    }
#pragma unroll
    for (int t = 0; t < TB; ++t) row_sums[threadIdx.y][t][threadIdx.x] = acc[t];
    __syncthreads();
    if (threadIdx.y != 0 || c >= C) return;
#pragma unroll
    for (int t = 0; t < TB; ++t) {
        if (!tap[t].live) continue;
        float v = 0.f;
        for (int y = 0; y < ROWS; ++y) v += row_sums[y][t][threadIdx.x];
        finish_tap(dw, db, partial, c, k0 + t, taps, kk, C, v);
    }
}

// dw and db from the splits' partial sums: element e = c*taps + k adds partial[s*C*taps + e]
// over s ascending, rounded once on store.
template <typename S>
__global__ void conv2d_depthwise_grad_weight_sum_kernel(const float* __restrict__ partial,
                                                        S* __restrict__ dw, S* __restrict__ db,
                                                        int C, int taps, int kk, int splits) {
    await_previous_kernel();
    const int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= C * taps) return;
    float v = 0.f;
    for (int s = 0; s < splits; ++s) v += partial[(long long)s * C * taps + e];
    store_tap(dw, db, e / taps, e % taps, kk, v);
}

// ---- plane kernels: NCHW, stride 1, dilation 1 (the common depthwise convolution) -----------
// A block owns whole planes (one sample's channel): it stages the plane's padded window and the
// channel's filter in shared memory once (coalesced rows, zeros for the padding), then every
// output reads its taps from there, with no index arithmetic per tap: the flat kernels above
// paid integer divisions and a bounds test per output and tap (10.3 us for the pencil conv's
// forward on an H200, where the traffic takes about 3).
// Forward: y[ho, wo] = bias + sum_{i, j} xp[ho + i, wo + j] * w[i, j], xp the input padded
// by (ph, pw) (i then j ascending; a padded tap adds 0 * w). grad_input is the same kernel
// over dy padded by (kh - 1 - ph, kw - 1 - pw) with the filter flipped (flip = 1): dx[h, w] =
// sum dy[h + ph - i, w + pw - j] * w[i, j]. Block (bx, by) strides over the plane's columns and
// rows; grid-stride over the planes. (dw stays with the flat kernel: a block per channel
// staging each sample's planes, a warp per tap, lost to it on 8 of 9 problems on an H200.)
template <typename S>
__global__ void __launch_bounds__(256)
conv2d_depthwise_plane_kernel(const S* __restrict__ x, const S* __restrict__ w,
                              const S* __restrict__ bias, S* __restrict__ y, int has_bias,
                              int relu, int flip, int planes, int C, int H, int W, int kh,
                              int kw, int ph, int pw, int Ho, int Wo) {
    await_previous_kernel();
    extern __shared__ float smem[];
    const int taps = kh * kw, Hp = Ho + kh - 1, Wp = Wo + kw - 1;
    float* ws = smem;
    float* xs = smem + ((taps + 3) & ~3);
    for (int plane = blockIdx.x; plane < planes; plane += gridDim.x) {
        const int c = plane % C;
        __syncthreads();                         // the previous plane's reads are done
        for (int t = threadIdx.y * blockDim.x + threadIdx.x; t < taps;
             t += blockDim.x * blockDim.y)
            ws[t] = load_as_float(w, c * taps + (flip ? taps - 1 - t : t));
        const S* xp = x + (long long)plane * H * W;
        for (int r = threadIdx.y; r < Hp; r += blockDim.y) {
            const int h = r - ph;
            for (int s = threadIdx.x; s < Wp; s += blockDim.x) {
                const int wi = s - pw;
                xs[r * Wp + s] = (unsigned)h < (unsigned)H && (unsigned)wi < (unsigned)W
                    ? load_as_float(xp, h * W + wi) : 0.f;
            }
        }
        __syncthreads();
        const float b = has_bias ? load_as_float(bias, c) : 0.f;
        S* yp = y + (long long)plane * Ho * Wo;
        for (int ho = threadIdx.y; ho < Ho; ho += blockDim.y) {
            for (int wo = threadIdx.x; wo < Wo; wo += blockDim.x) {
                float acc = b;
                const float* row = xs + ho * Wp + wo;
                for (int i = 0; i < kh; ++i) {
#pragma unroll 7
                    for (int j = 0; j < kw; ++j) acc = fmaf(row[i * Wp + j], ws[i * kw + j], acc);
                }
                store_from_float(yp, ho * Wo + wo, relu && acc < 0.f ? 0.f : acc);
            }
        }
    }
}
