// The weight gradient of channels-last convolutions with few input taps (a vision network's
// stem: 3 colour channels under a 3x3 window): dw (O, kh, kw, C) from dy (N, Ho, Wo, O) and
// x (N, H, W, C), CK = kh * kw * C <= SMALL_MAX_TAPS, O a multiple of 4 up to SMALL_MAX_OUT;
// groups 1, dilation 1. It is a sum over every output pixel of an O x CK outer product, a
// GEMM with a 524288-long reduction and a tiny result for the resnet stem: cuDNN's NHWC plans
// took 169 µs for it in tf32 on an H200 (seven launches); this is one pass over dy plus a
// small sum.
// Float32 products with FMA accumulation, exact FP32 at every precision like the other own
// kernels; T is the storage (float, or bf16 bits: bf16.cuh), widened on load and rounded once
// on store. Every output has one owner summing in a fixed order: deterministic. Launchers
// keep sizes < 2^31 and pass 16-byte aligned arrays.
#include "bf16.cuh"

#define SMALL_MAX_TAPS 32        // CK
#define SMALL_MAX_OUT 256        // O
#define SMALL_TILE_FLOATS 8192   // dy values a block stages at a time (32 KB)
#define SMALL_PATCH_FLOATS 4096  // and patch values (16 KB)
#define SMALL_TAPS 8             // taps a thread owns (a tap group)

#define SMALL_SHAPE_ARGS                                                                     \
    int N, int H, int W, int C, int O, int Ho, int Wo, int kh, int kw, int sh, int sw, int ph, \
        int pw

// ---- weight gradient -----------------------------------------------------------------------

// partial[b, o * CK + t] = sum over block b's pixels [b * per, (b + 1) * per) of dy[pixel, o] *
// patch[pixel, t], the patch being x under the pixel's window (t = (r * kw + s) * C + c, w's
// own order; 0 in the padding). The block stages tiles of pixels' dy rows and patches (rows
// padded to PK = CK rounded up to 8, zeros past CK) in shared memory. Thread (lane, tap group
// g, og) owns output channels og * 4 .. + 3 and taps g * 8 .. + 7 and adds up the tile's
// pixels lane, lane + lanes, ... (lanes = 256 / (O / 4 * PK / 8)); at the end the lanes'
// sums are added in lane order. 256 threads a block.
template <typename T>
__global__ void __launch_bounds__(256)
conv2d_nhwc_small_grad_weight_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                     float* __restrict__ partial, int per, SMALL_SHAPE_ARGS) {
    __shared__ __align__(16) float dys[SMALL_TILE_FLOATS];
    __shared__ __align__(16) float patches[SMALL_PATCH_FLOATS];
    const int ck = kh * kw * C, pk = (ck + SMALL_TAPS - 1) / SMALL_TAPS * SMALL_TAPS;
    const int groups = O >> 2, per_lane = groups * (pk / SMALL_TAPS);
    const int lanes = blockDim.x / per_lane;
    const int lane = threadIdx.x / per_lane, in_lane = threadIdx.x - lane * per_lane;
    const int og = in_lane % groups, t0 = in_lane / groups * SMALL_TAPS;
    const bool works = lane < lanes;
    const int tile = min(SMALL_TILE_FLOATS / O, SMALL_PATCH_FLOATS / pk);
    const int pixels = N * Ho * Wo;
    const int begin = blockIdx.x * per, end = min(pixels, begin + per);
    float acc[SMALL_TAPS][4];
#pragma unroll
    for (int j = 0; j < SMALL_TAPS; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    for (int base = begin; base < end; base += tile) {
        const int count = min(tile, end - base);
        __syncthreads();     // the previous tile is consumed
        for (int i = threadIdx.x; i < count * O; i += blockDim.x)
            dys[i] = load_as_float(dy, (long long)base * O + i);
        for (int p = threadIdx.x; p < count; p += blockDim.x) {   // a thread per pixel
            const int pix = base + p;
            const int wo = pix % Wo, q = pix / Wo;
            const int ho = q % Ho, n = q / Ho;
            float* row = patches + p * pk;
            int t = 0;
            for (int r = 0; r < kh; ++r) {
                const int hi = ho * sh - ph + r;
                for (int s = 0; s < kw; ++s) {
                    const int wi = wo * sw - pw + s;
                    const bool inside = hi >= 0 && hi < H && wi >= 0 && wi < W;
                    const long long at = ((long long)(n * H + hi) * W + wi) * C;
                    for (int c = 0; c < C; ++c, ++t)
                        row[t] = inside ? load_as_float(x, at + c) : 0.f;
                }
            }
            for (; t < pk; ++t) row[t] = 0.f;
        }
        __syncthreads();
        for (int p = lane; works && p < count; p += lanes) {
            const float4 d = *reinterpret_cast<const float4*>(dys + p * O + og * 4);
            const float4 v0 = *reinterpret_cast<const float4*>(patches + p * pk + t0);
            const float4 v1 = *reinterpret_cast<const float4*>(patches + p * pk + t0 + 4);
            const float v[SMALL_TAPS] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
#pragma unroll
            for (int j = 0; j < SMALL_TAPS; ++j) {
                acc[j][0] = fmaf(d.x, v[j], acc[j][0]);
                acc[j][1] = fmaf(d.y, v[j], acc[j][1]);
                acc[j][2] = fmaf(d.z, v[j], acc[j][2]);
                acc[j][3] = fmaf(d.w, v[j], acc[j][3]);
            }
        }
    }
    // the lanes' sums, added in lane order: lane L's (o, t) at dys[(L * O + o) * pk + t]
    // (lanes * O * pk = 256 * 4 * 8 = SMALL_TILE_FLOATS floats at most)
    __syncthreads();
    if (works) {
#pragma unroll
        for (int j = 0; j < SMALL_TAPS; ++j)
            for (int k = 0; k < 4; ++k) dys[(lane * O + og * 4 + k) * pk + t0 + j] = acc[j][k];
    }
    __syncthreads();
    float* out = partial + (long long)blockIdx.x * O * ck;
    for (int e = threadIdx.x; e < O * ck; e += blockDim.x) {
        const int o = e / ck, t = e - o * ck;
        float sum = 0.f;
        for (int l = 0; l < lanes; ++l) sum += dys[(l * O + o) * pk + t];
        out[e] = sum;
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
