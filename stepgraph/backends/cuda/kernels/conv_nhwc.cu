// Channels-last convolutions with few input taps (a vision network's stem: 3 colour channels
// under a 3x3 window): y (N, Ho, Wo, O) from x (N, H, W, C) and w (O, kh, kw, C), CK = kh * kw
// * C <= SMALL_MAX_TAPS, O a multiple of 4 up to SMALL_MAX_OUT; groups 1, dilation 1. cuDNN's
// NHWC engines run such a problem as several launches (on an H200 the resnet stem's forward
// took 79 µs in three, its weight gradient 171 µs in seven, tf32); here the forward is one
// pass writing y and the weight gradient one pass reading dy plus a small sum.
// Float32 products with FMA accumulation, exact FP32 at every precision like the other own
// kernels; T is the storage (float, or bf16 bits: bf16.cuh), widened on load and rounded once
// on store. Every output has one owner summing in a fixed order: deterministic. Launchers
// keep sizes < 2^31 and pass 16-byte (float) or 8-byte (bf16) aligned arrays.
#include "bf16.cuh"

#define SMALL_MAX_TAPS 32        // CK
#define SMALL_MAX_OUT 256        // O
#define SMALL_TILE_FLOATS 8192   // dy values a weight-gradient block stages at a time (32 KB)
#define SMALL_PATCH_FLOATS 4096  // and patch values (16 KB)
#define SMALL_TAPS_PER_THREAD 8  // SMALL_MAX_TAPS / (256 threads / (SMALL_MAX_OUT / 4))

#define SMALL_SHAPE_ARGS                                                                     \
    int N, int H, int W, int C, int O, int Ho, int Wo, int kh, int kw, int sh, int sw, int ph, \
        int pw

// ---- forward -------------------------------------------------------------------------------

// A thread per output pixel and 4 output channels: y = sum over taps (r, s, c), in that
// order, of x * w, skipping taps in the zero padding. The block keeps w tap-major in shared
// memory (ws[t * O + o]), so a tap's 4 weights are one 16-byte load.
template <typename T>
__global__ void __launch_bounds__(256)
conv2d_nhwc_small_forward_kernel(const T* __restrict__ x, const T* __restrict__ w,
                                 T* __restrict__ y, SMALL_SHAPE_ARGS) {
    __shared__ __align__(16) float ws[SMALL_MAX_TAPS * SMALL_MAX_OUT];
    const int ck = kh * kw * C;
    for (int i = threadIdx.x; i < ck * O; i += blockDim.x) {
        const int o = i / ck;
        ws[(i - o * ck) * O + o] = load_as_float(w, i);
    }
    __syncthreads();
    const int groups = O >> 2;
    const int total = N * Ho * Wo * groups;
    for (int g = blockIdx.x * blockDim.x + threadIdx.x; g < total; g += gridDim.x * blockDim.x) {
        const int og = g % groups, pix = g / groups;
        const int wo = pix % Wo, q = pix / Wo;
        const int ho = q % Ho, n = q / Ho;
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        for (int r = 0; r < kh; ++r) {
            const int hi = ho * sh - ph + r;
            if (hi < 0 || hi >= H) continue;
            for (int s = 0; s < kw; ++s) {
                const int wi = wo * sw - pw + s;
                if (wi < 0 || wi >= W) continue;
                const T* px = x + ((long long)(n * H + hi) * W + wi) * C;
                const float* wt = ws + (r * kw + s) * C * O + og * 4;
                for (int c = 0; c < C; ++c) {
                    const float v = load_as_float(px, c);
                    const float4 k = *reinterpret_cast<const float4*>(wt + c * O);
                    acc[0] = fmaf(v, k.x, acc[0]);
                    acc[1] = fmaf(v, k.y, acc[1]);
                    acc[2] = fmaf(v, k.z, acc[2]);
                    acc[3] = fmaf(v, k.w, acc[3]);
                }
            }
        }
        store4_from_float(y, (long long)pix * O + og * 4, acc);
    }
}

// ---- weight gradient -----------------------------------------------------------------------

// partial[b, o * CK + t] = sum over block b's pixels [b * per, (b + 1) * per), ascending, of
// dy[pixel, o] * patch[pixel, t], the patch being x under the pixel's window (t = (r * kw + s)
// * C + c, w's own order; 0 in the padding). The block stages tiles of pixels' dy rows and
// patches in shared memory; thread (og = tid % (O / 4), slot = tid / (O / 4)) owns 4 output
// channels and the taps slot, slot + slots, ... (slots = 256 / (O / 4); threads past the last
// whole slot idle). 256 threads a block.
template <typename T>
__global__ void __launch_bounds__(256)
conv2d_nhwc_small_grad_weight_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                     float* __restrict__ partial, int per, SMALL_SHAPE_ARGS) {
    __shared__ __align__(16) float dys[SMALL_TILE_FLOATS];
    __shared__ float patches[SMALL_PATCH_FLOATS];
    const int ck = kh * kw * C, groups = O >> 2, slots = blockDim.x / groups;
    const int og = threadIdx.x % groups, slot = threadIdx.x / groups;
    const bool works = slot < slots;
    const int tile = min(SMALL_TILE_FLOATS / O, SMALL_PATCH_FLOATS / ck);
    const int pixels = N * Ho * Wo;
    const int begin = blockIdx.x * per, end = min(pixels, begin + per);
    float acc[SMALL_TAPS_PER_THREAD][4];
#pragma unroll
    for (int j = 0; j < SMALL_TAPS_PER_THREAD; ++j)
        acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    for (int base = begin; base < end; base += tile) {
        const int count = min(tile, end - base);
        __syncthreads();     // the previous tile is consumed
        for (int i = threadIdx.x; i < count * O; i += blockDim.x)
            dys[i] = load_as_float(dy, (long long)base * O + i);
        for (int i = threadIdx.x; i < count * ck; i += blockDim.x) {
            const int p = i / ck, t = i - p * ck;
            const int pix = base + p;
            const int wo = pix % Wo, q = pix / Wo;
            const int ho = q % Ho, n = q / Ho;
            const int c = t % C, rs = t / C;
            const int hi = ho * sh - ph + rs / kw, wi = wo * sw - pw + rs % kw;
            patches[i] = hi >= 0 && hi < H && wi >= 0 && wi < W
                             ? load_as_float(x, ((long long)(n * H + hi) * W + wi) * C + c)
                             : 0.f;
        }
        __syncthreads();
        for (int p = 0; works && p < count; ++p) {
            const float4 d = *reinterpret_cast<const float4*>(dys + p * O + og * 4);
#pragma unroll
            for (int j = 0; j < SMALL_TAPS_PER_THREAD; ++j) {
                const int t = slot + j * slots;
                if (t < ck) {
                    const float v = patches[p * ck + t];
                    acc[j][0] = fmaf(d.x, v, acc[j][0]);
                    acc[j][1] = fmaf(d.y, v, acc[j][1]);
                    acc[j][2] = fmaf(d.z, v, acc[j][2]);
                    acc[j][3] = fmaf(d.w, v, acc[j][3]);
                }
            }
        }
    }
    float* out = partial + (long long)blockIdx.x * O * ck;
#pragma unroll
    for (int j = 0; j < SMALL_TAPS_PER_THREAD; ++j) {
        const int t = slot + j * slots;
        if (works && t < ck)
            for (int k = 0; k < 4; ++k) out[(og * 4 + k) * ck + t] = acc[j][k];
    }
}

// dw[e] = sum over blocks b, ascending, of partial[b, e], rounded once to T.
template <typename T>
__global__ void conv2d_nhwc_small_grad_weight_sum_kernel(const float* __restrict__ partial,
                                                         T* __restrict__ dw, int elements,
                                                         int blocks) {
    const int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= elements) return;
    float sum = 0.f;
    for (int b = 0; b < blocks; ++b) sum += partial[(long long)b * elements + e];
    store_from_float(dw, e, sum);
}
