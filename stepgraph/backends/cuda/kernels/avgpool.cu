// Average pooling over NCHW planes (PyTorch avg_pool2d, floor mode, zero padding (ph, pw) of at
// most half the window): y = window sum / divisor, divisor = kh * kw with count_include_pad,
// else the number of real (unpadded) elements in the window. Floor mode keeps every window
// inside the padded plane, so kh * kw is PyTorch's divisor too. The backward gathers, one
// thread per input element (dy / divisor over the windows holding it, row-major window
// order): no atomics, a fixed order. Launchers keep sizes < 2^31.
#include "reduce.cuh"

// As pool.cu: `planes` = N * C planes of (H, W) in, (Ho, Wo) out; window (kh, kw), stride
// (sh, sw), padding (ph, pw): window (ho, wo) starts at (ho * sh - ph, wo * sw - pw).
#define POOL_SHAPE_ARGS int planes, int H, int W, int Ho, int Wo, int kh, int kw, int sh, int sw, \
                        int ph, int pw

// Window (ho, wo) clipped to the plane: rows [h0, h1), columns [w0, w1); returns the divisor.
__device__ __forceinline__ int clipped_window(int ho, int wo, int H, int W, int kh, int kw,
                                              int sh, int sw, int ph, int pw,
                                              int count_include_pad, int* h0, int* h1, int* w0,
                                              int* w1) {
    *h0 = max(ho * sh - ph, 0);
    *h1 = min(ho * sh - ph + kh, H);
    *w0 = max(wo * sw - pw, 0);
    *w1 = min(wo * sw - pw + kw, W);
    return count_include_pad ? kh * kw : (*h1 - *h0) * (*w1 - *w0);
}

// A thread per output: the window summed in row-major order.
extern "C" __global__ void avgpool2d_forward_kernel(const float* x, float* y,
                                                    int count_include_pad, POOL_SHAPE_ARGS) {
    const long long total = (long long)planes * Ho * Wo;
    for (long long g = blockIdx.x * (long long)blockDim.x + threadIdx.x; g < total;
         g += (long long)gridDim.x * blockDim.x) {
        const int o = (int)g;
        const int wo = o % Wo, t = o / Wo;
        const int ho = t % Ho, p = t / Ho;
        const float* plane = x + (long long)p * H * W;
        int h0, h1, w0, w1;
        const int divisor = clipped_window(ho, wo, H, W, kh, kw, sh, sw, ph, pw,
                                           count_include_pad, &h0, &h1, &w0, &w1);
        float acc = 0.f;
        for (int h = h0; h < h1; ++h)
            for (int w = w0; w < w1; ++w) acc += plane[h * W + w];
        y[o] = acc / (float)divisor;
    }
}

// A warp per output, for large windows (global average pooling: one 7x7 or 8x8 window per
// plane): the lanes read the window's rows together (coalesced) instead of one thread
// walking it, and combine their float sums with a fixed butterfly.
extern "C" __global__ void avgpool2d_forward_warp_kernel(const float* x, float* y,
                                                         int count_include_pad,
                                                         POOL_SHAPE_ARGS) {
    const long long total = (long long)planes * Ho * Wo;
    const int lane = threadIdx.x & 31;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    for (long long g = blockIdx.x * (long long)(blockDim.x >> 5) + (threadIdx.x >> 5);
         g < total; g += warps) {
        const int o = (int)g;
        const int wo = o % Wo, t = o / Wo;
        const int ho = t % Ho, p = t / Ho;
        const float* plane = x + (long long)p * H * W;
        int h0, h1, w0, w1;
        const int divisor = clipped_window(ho, wo, H, W, kh, kw, sh, sw, ph, pw,
                                           count_include_pad, &h0, &h1, &w0, &w1);
        const int width = w1 - w0, count = (h1 - h0) * width;
        float acc = 0.f;
        for (int e = lane; e < count; e += 32) {
            const int r = e / width;
            acc += plane[(h0 + r) * W + w0 + (e - r * width)];
        }
        acc = warp_sum(acc);
        if (lane == 0) y[o] = acc / (float)divisor;
    }
}

// dx[p, h, w] = sum of dy[o] / divisor(o) over the windows o holding (h, w), row-major.
extern "C" __global__ void avgpool2d_backward_kernel(const float* dy, float* dx,
                                                     int count_include_pad, POOL_SHAPE_ARGS) {
    const long long total = (long long)planes * H * W;
    for (long long g = blockIdx.x * (long long)blockDim.x + threadIdx.x; g < total;
         g += (long long)gridDim.x * blockDim.x) {
        const int i = (int)g;
        const int w = i % W, t = i / W;
        const int h = t % H, p = t / H;
        // Windows ho with ho * sh <= h + ph <= ho * sh + kh - 1 (and likewise along w).
        const int hp = h + ph, wp = w + pw;
        const int ho_lo = hp < kh ? 0 : (hp - kh) / sh + 1;
        const int ho_hi = min(hp / sh, Ho - 1);
        const int wo_lo = wp < kw ? 0 : (wp - kw) / sw + 1;
        const int wo_hi = min(wp / sw, Wo - 1);
        const float* dyp = dy + (long long)p * Ho * Wo;
        float acc = 0.f;
        for (int ho = ho_lo; ho <= ho_hi; ++ho) {
            for (int wo = wo_lo; wo <= wo_hi; ++wo) {
                int h0, h1, w0, w1;
                const int divisor = clipped_window(ho, wo, H, W, kh, kw, sh, sw, ph, pw,
                                                   count_include_pad, &h0, &h1, &w0, &w1);
                acc += dyp[ho * Wo + wo] / (float)divisor;
            }
        }
        dx[i] = acc;
    }
}
