// Average pooling (PyTorch avg_pool2d, floor mode, zero padding (ph, pw) of at most half the
// window): y = window sum / divisor, divisor = kh * kw with count_include_pad, else the number
// of real (unpadded) elements in the window. Floor mode keeps every window inside the padded
// plane, so kh * kw is PyTorch's divisor too. The backward gathers, one thread per input
// element (dy / divisor over the windows holding it, row-major window order): no atomics, a
// fixed order; windows that tile the input exactly (global pooling among them) take the
// tiling backward instead, a thread per window writing its elements. NCHW kernels and
// channels-last (_nhwc_, with C) ones: the same code (pool.cuh layouts). Launchers keep sizes
// < 2^31. Shapes and windows: pool.cuh.
// Templates over the element storage T: float, or unsigned short (bfloat16 bits, bf16.cuh):
// loaded as float, summed and divided in float, rounded once on store.
#include "launch_order.cuh"
#include "bf16.cuh"
#include "grid.cuh"
#include "pool.cuh"
#include "reduce.cuh"

// The divisor of a clipped window: the whole window, or only its real elements.
__device__ __forceinline__ int window_divisor(const PoolShape& s, const Window& win,
                                              int count_include_pad) {
    return count_include_pad ? s.kh * s.kw : (win.h1 - win.h0) * (win.w1 - win.w0);
}

// A thread per output: the window summed in row-major order. Channels-last outputs of
// consecutive threads are consecutive channels: their loads coalesce, also for global pooling.
template <bool NHWC, typename T>
__device__ __forceinline__ void avgpool2d_forward(const T* x, T* y,
                                                  int count_include_pad, int C,
                                                  const PoolShape& s) {
    const long long total = (long long)s.planes * s.Ho * s.Wo;
    GRID_STRIDE_LOOP(g, total) {
        int p, ho, wo;
        element_of<NHWC>((int)g, s.Ho, s.Wo, C, p, ho, wo);
        const PlaneAt plane = plane_at<NHWC>(p, s.H, s.W, C);
        const Window win = clipped_window(s, ho, wo);
        float acc = 0.f;
        for (int h = win.h0; h < win.h1; ++h)
            for (int w = win.w0; w < win.w1; ++w)
                acc += load_as_float(x, plane.base + (long long)(h * s.W + w) * plane.step);
        store_from_float(y, g, acc / (float)window_divisor(s, win, count_include_pad));
    }
}

template <typename T>
__global__ void avgpool2d_forward_kernel(const T* x, T* y,
                                         int count_include_pad, POOL_SHAPE_ARGS) {
    await_previous_kernel();
    avgpool2d_forward<false>(x, y, count_include_pad, 1, POOL_SHAPE_INIT);
}

template <typename T>
__global__ void avgpool2d_forward_nhwc_kernel(const T* x, T* y,
                                              int count_include_pad, int C,
                                              POOL_SHAPE_ARGS) {
    await_previous_kernel();
    avgpool2d_forward<true>(x, y, count_include_pad, C, POOL_SHAPE_INIT);
}

// A warp per output, for large windows over NCHW planes (global average pooling: one 7x7 or
// 8x8 window per plane): the lanes read the window's rows together (coalesced) instead of one
// thread walking it, and combine their float sums with a fixed butterfly.
template <typename T>
__global__ void avgpool2d_forward_warp_kernel(const T* x, T* y,
                                              int count_include_pad,
                                              POOL_SHAPE_ARGS) {
    await_previous_kernel();
    const PoolShape s = POOL_SHAPE_INIT;
    const long long total = (long long)planes * Ho * Wo;
    const int lane = threadIdx.x & 31;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    for (long long g = blockIdx.x * (long long)(blockDim.x >> 5) + (threadIdx.x >> 5);
         g < total; g += warps) {
        const int o = (int)g;
        const int wo = o % Wo, t = o / Wo;
        const int ho = t % Ho, p = t / Ho;
        const T* plane = x + (long long)p * H * W;
        const Window win = clipped_window(s, ho, wo);
        const int width = win.w1 - win.w0, count = (win.h1 - win.h0) * width;
        float acc = 0.f;
        for (int e = lane; e < count; e += 32) {
            const int r = e / width;
            acc += load_as_float(plane, (win.h0 + r) * W + win.w0 + (e - r * width));
        }
        acc = warp_sum(acc);
        if (lane == 0)
            store_from_float(y, o, acc / (float)window_divisor(s, win, count_include_pad));
    }
}

// Global average pooling of channels-last maps (one window, the whole H x W image, no
// padding): blocks of (32 channels, GLOBAL_SLICES pixel slices) per 32 channels and sample.
// Lane x of slice y adds pixels y, y + GLOBAL_SLICES, ... of its channel (the 32 lanes read 32
// adjacent channels: coalesced), then slice 0 adds the slices' sums in order and divides. A
// thread per output walked its H * W pixels alone: (N * C) threads too few to hide the loads.
#define GLOBAL_SLICES 8
template <typename T>
__global__ void __launch_bounds__(32 * GLOBAL_SLICES)
avgpool2d_forward_global_nhwc_kernel(const T* x, T* y, int pixels, int C) {
    await_previous_kernel();
    __shared__ float part[GLOBAL_SLICES][33];
    const int c = blockIdx.x * 32 + threadIdx.x;
    const long long n = blockIdx.y;
    float acc = 0.f;
    if (c < C)
        for (int q = threadIdx.y; q < pixels; q += GLOBAL_SLICES)
            acc += load_as_float(x, (n * pixels + q) * C + c);
    part[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y != 0 || c >= C) return;
    float sum = 0.f;
    for (int k = 0; k < GLOBAL_SLICES; ++k) sum += part[k][threadIdx.x];
    store_from_float(y, n * C + c, sum / (float)pixels);
}

// dx[p, h, w] = sum of dy[o] / divisor(o) over the windows o holding (h, w), row-major.
template <bool NHWC, typename T>
__device__ __forceinline__ void avgpool2d_backward(const T* dy, T* dx,
                                                   int count_include_pad, int C,
                                                   const PoolShape& s) {
    const long long total = (long long)s.planes * s.H * s.W;
    GRID_STRIDE_LOOP(g, total) {
        int p, h, w;
        element_of<NHWC>((int)g, s.H, s.W, C, p, h, w);
        const WindowSpan span = windows_holding(s, h, w);
        const PlaneAt plane = plane_at<NHWC>(p, s.Ho, s.Wo, C);
        float acc = 0.f;
        for (int ho = span.ho_lo; ho <= span.ho_hi; ++ho) {
            for (int wo = span.wo_lo; wo <= span.wo_hi; ++wo) {
                const int divisor = window_divisor(s, clipped_window(s, ho, wo),
                                                   count_include_pad);
                acc += load_as_float(dy, plane.base + (long long)(ho * s.Wo + wo) * plane.step) /
                       (float)divisor;
            }
        }
        store_from_float(dx, g, acc);
    }
}

template <typename T>
__global__ void avgpool2d_backward_kernel(const T* dy, T* dx,
                                          int count_include_pad, POOL_SHAPE_ARGS) {
    await_previous_kernel();
    avgpool2d_backward<false>(dy, dx, count_include_pad, 1, POOL_SHAPE_INIT);
}

template <typename T>
__global__ void avgpool2d_backward_nhwc_kernel(const T* dy, T* dx,
                                               int count_include_pad, int C,
                                               POOL_SHAPE_ARGS) {
    await_previous_kernel();
    avgpool2d_backward<true>(dy, dx, count_include_pad, C, POOL_SHAPE_INIT);
}

// Windows that tile the input exactly (stride == kernel, no padding, H % kh == W % kw == 0):
// every input element lies in one window, so a thread per window writes 0 + dy / (kh * kw)
// (the gather's sum of one term, -0 included) to each of its elements. The gather kernel
// spends its time on index arithmetic (window spans, divisors) per element: the resnet's global
// pool backward took 83 µs for 33 MB.
template <bool NHWC, typename T>
__device__ __forceinline__ void avgpool2d_backward_tiling(const T* dy, T* dx, int C,
                                                          const PoolShape& s) {
    const long long total = (long long)s.planes * s.Ho * s.Wo;
    const float divisor = (float)(s.kh * s.kw);
    GRID_STRIDE_LOOP(g, total) {
        int p, ho, wo;
        element_of<NHWC>((int)g, s.Ho, s.Wo, C, p, ho, wo);
        const PlaneAt plane = plane_at<NHWC>(p, s.H, s.W, C);
        const float v = 0.f + load_as_float(dy, g) / divisor;
        for (int h = ho * s.kh; h < (ho + 1) * s.kh; ++h)
            for (int w = wo * s.kw; w < (wo + 1) * s.kw; ++w)
                store_from_float(dx, plane.base + (long long)(h * s.W + w) * plane.step, v);
    }
}

template <typename T>
__global__ void avgpool2d_backward_tiling_kernel(const T* dy, T* dx, POOL_SHAPE_ARGS) {
    await_previous_kernel();
    avgpool2d_backward_tiling<false>(dy, dx, 1, POOL_SHAPE_INIT);
}

template <typename T>
__global__ void avgpool2d_backward_tiling_nhwc_kernel(const T* dy, T* dx, int C,
                                                      POOL_SHAPE_ARGS) {
    await_previous_kernel();
    avgpool2d_backward_tiling<true>(dy, dx, C, POOL_SHAPE_INIT);
}
