// Max pooling over NCHW planes (floor mode, implicit -inf padding (ph, pw) of at most half the
// window, so every window holds a real element): the forward writes the max and the
// plane-local index h * W + w of the FIRST maximum in row-major window order (numpy argmax,
// PyTorch) among the window's real elements; the backward gathers, one thread per input
// element, so overlapping windows (stride < kernel) need no atomics and sum in a fixed order.
// Launchers keep sizes < 2^31.

// With relu (the ReLU after the pool, fused) the forward stores relu(max) and the backward
// adds only where that output is > 0. Shapes and windows: pool.cuh.
#include "pool.cuh"

extern "C" __global__ void maxpool2d_forward_kernel(const float* x, float* y, int* idx, int relu,
                                                    POOL_SHAPE_ARGS) {
    const PoolShape s = POOL_SHAPE_INIT;
    const long long total = (long long)planes * Ho * Wo;
    for (long long g = blockIdx.x * (long long)blockDim.x + threadIdx.x; g < total;
         g += (long long)gridDim.x * blockDim.x) {
        const int o = (int)g;
        const int wo = o % Wo, t = o / Wo;
        const int ho = t % Ho, p = t / Ho;
        const float* plane = x + (long long)p * H * W;
        // The window clipped to the plane: padding is -inf, never a maximum over real values.
        const Window win = clipped_window(s, ho, wo);
        int best_at = win.h0 * W + win.w0;
        float best = plane[best_at];
        for (int h = win.h0; h < win.h1; ++h) {
            for (int w = win.w0; w < win.w1; ++w) {
                const int at = h * W + w;
                const float v = plane[at];
                // Strictly greater keeps the first maximum; the first NaN wins, as argmax.
                if (v > best || (v != v && best == best)) {
                    best = v;
                    best_at = at;
                }
            }
        }
        y[o] = relu && !(best > 0.f || best != best) ? 0.f : best;   // NaN passes, as np.maximum
        idx[o] = best_at;
    }
}

// dx[p, h, w] = sum of dy over the windows containing (h, w) whose argmax is (h, w), taken in
// row-major window order: the order in which the numpy reference's np.add.at accumulates.
extern "C" __global__ void maxpool2d_backward_kernel(const float* dy, const int* idx,
                                                     const float* y, float* dx,
                                                     POOL_SHAPE_ARGS) {
    const PoolShape s = POOL_SHAPE_INIT;
    const long long total = (long long)planes * H * W;
    for (long long g = blockIdx.x * (long long)blockDim.x + threadIdx.x; g < total;
         g += (long long)gridDim.x * blockDim.x) {
        const int i = (int)g;
        const int w = i % W, t = i / W;
        const int h = t % H, p = t / H;
        const WindowSpan span = windows_holding(s, h, w);
        const int here = h * W + w;
        const long long base = (long long)p * Ho * Wo;
        float acc = 0.f;
        for (int ho = span.ho_lo; ho <= span.ho_hi; ++ho) {
            for (int wo = span.wo_lo; wo <= span.wo_hi; ++wo) {
                const long long o = base + (long long)ho * Wo + wo;
                // Three independent loads, issued together (a short-circuit test would wait
                // for idx before loading y, then for y before loading dy).
                const int at = idx[o];
                const float g = dy[o];
                const bool open = y == nullptr || y[o] > 0.f;
                if (at == here && open) acc += g;
            }
        }
        dx[i] = acc;
    }
}

// The backward when the windows tile the input exactly (stride == kernel, no padding,
// H % kh == 0, W % kw == 0): every input pixel lies in one window, so a thread per pooled
// output writes its whole window, dy at the argmax (where the fused ReLU let it through) and
// zero elsewhere: a quarter of the threads of the gather above for 2x2 windows, and dy, idx,
// y read once.
// 0 + dy as the gather's sum would give (-0 becomes +0, like the reference's np.add.at).
extern "C" __global__ void maxpool2d_backward_tiling_kernel(const float* dy, const int* idx,
                                                            const float* y, float* dx,
                                                            POOL_SHAPE_ARGS) {
    const long long total = (long long)planes * Ho * Wo;
    for (long long g = blockIdx.x * (long long)blockDim.x + threadIdx.x; g < total;
         g += (long long)gridDim.x * blockDim.x) {
        const int o = (int)g;
        const int wo = o % Wo, t = o / Wo;
        const int ho = t % Ho, p = t / Ho;
        const int at = idx[o];
        const float grad = __fadd_rn(0.f, dy[o]);
        const bool open = y == nullptr || y[o] > 0.f;
        float* plane = dx + (long long)p * H * W;
        for (int i = 0; i < kh; ++i) {
            for (int j = 0; j < kw; ++j) {
                const int here = (ho * kh + i) * W + wo * kw + j;
                plane[here] = open && at == here ? grad : 0.f;
            }
        }
    }
}
