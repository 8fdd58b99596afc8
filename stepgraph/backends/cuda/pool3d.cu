// 3-D max and average pooling over (N, C) volumes of NCDHW tensors, torch's max_pool3d and
// avg_pool3d with every argument: window (od, oh, ow) starts at o * stride - padding along each
// axis, tap t reads start + t * dilation; ceil_mode windows may reach past the padding (the
// launcher's output sizes say how many windows there are). Padding is at most half the kernel,
// so every window holds a real element.
//   max: y = the first maximum of the window's real elements in row-major tap order (numpy
//        argmax, torch), the first NaN winning; idx (int32) = (d * H + h) * W + w of it in its
//        volume.
//   avg: y = sum of the real elements / divisor: divisor_override when > 0, else with
//        count_include_pad the window's size clipped to the padded input, else its count of
//        real elements (torch's, a product over the three axes).
// The backwards gather, one thread per input element, over the windows holding it in
// row-major window order (the order of the reference's np.add.at): no atomics, a fixed order.
// Templates over the element storage T: float, or unsigned short (bfloat16 bits, bf16.cuh):
// loaded as float, summed in float, each output rounded once on store. Launchers keep sizes
// < 2^31 (32-bit index arithmetic).
#include "launch_order.cuh"
#include "bf16.cuh"
#include "grid.cuh"

struct Pool3dShape {
    int planes, D, H, W, Do, Ho, Wo, kd, kh, kw, sd, sh, sw, pd, ph, pw, dd, dh, dw;
};

// Kernels take the shape as plain ints (the launcher's _shape_args: nineteen int32 scalars).
#define POOL3D_SHAPE_ARGS int planes, int D, int H, int W, int Do, int Ho, int Wo, int kd, \
                          int kh, int kw, int sd, int sh, int sw, int pd, int ph, int pw,  \
                          int dd, int dh, int dw
#define POOL3D_SHAPE_INIT {planes, D, H, W, Do, Ho, Wo, kd, kh, kw, sd, sh, sw, pd, ph, pw, \
                           dd, dh, dw}

// The window of output o along one axis covers [start, start + k) before dilation; `size`
// counts it clipped to the padded input (n + p), `real` clipped to the input (avg_pool3d).
struct AxisWindow {
    int size, real;
};

__device__ __forceinline__ AxisWindow axis_window(int o, int n, int k, int s, int p) {
    const int start = o * s - p;
    const int end = min(start + k, n + p);
    return {end - start, min(end, n) - max(start, 0)};
}

// The window along one axis whose tap t reads input position i, or -1: o * s - p + t * d = i.
__device__ __forceinline__ int window_of_tap(int i, int t, int out, int s, int p, int d) {
    const int q = i + p - t * d;
    if (q < 0 || q % s != 0) return -1;
    const int o = q / s;
    return o < out ? o : -1;
}

// The output (p, od, oh, ow) stored at g; likewise for inputs.
__device__ __forceinline__ void split5(int g, int D, int H, int W, int& p, int& d, int& h,
                                       int& w) {
    w = g % W;
    int t = g / W;
    h = t % H;
    t /= H;
    d = t % D;
    p = t / D;
}

template <typename T>
__global__ void maxpool3d_forward_kernel(const T* x, T* y, int* idx, POOL3D_SHAPE_ARGS) {
    await_previous_kernel();
    const Pool3dShape s = POOL3D_SHAPE_INIT;
    const long long total = (long long)s.planes * s.Do * s.Ho * s.Wo;
    GRID_STRIDE_LOOP(g, total) {
        int p, od, oh, ow;
        split5((int)g, s.Do, s.Ho, s.Wo, p, od, oh, ow);
        const long long base = (long long)p * s.D * s.H * s.W;
        float best = 0.f;      // read only once best_at names a real element
        int best_at = -1;
        for (int i = 0; i < s.kd; ++i) {
            const int d = od * s.sd - s.pd + i * s.dd;
            if (d < 0 || d >= s.D) continue;
            for (int j = 0; j < s.kh; ++j) {
                const int h = oh * s.sh - s.ph + j * s.dh;
                if (h < 0 || h >= s.H) continue;
                for (int k = 0; k < s.kw; ++k) {
                    const int w = ow * s.sw - s.pw + k * s.dw;
                    if (w < 0 || w >= s.W) continue;
                    const int at = (d * s.H + h) * s.W + w;
                    const float v = load_as_float(x, base + at);
                    // Strictly greater keeps the first maximum; the first NaN wins, as argmax.
                    if (best_at < 0 || v > best || (v != v && best == best)) {
                        best = v;
                        best_at = at;
                    }
                }
            }
        }
        store_from_float(y, g, best);
        idx[g] = best_at;
    }
}

// dx[p, d, h, w] = sum of dy over the windows holding (d, h, w) whose argmax it is. Taps in
// descending order give the windows in ascending (row-major) order.
template <typename T>
__global__ void maxpool3d_backward_kernel(const T* dy, const int* idx, T* dx,
                                          POOL3D_SHAPE_ARGS) {
    await_previous_kernel();
    const Pool3dShape s = POOL3D_SHAPE_INIT;
    const long long total = (long long)s.planes * s.D * s.H * s.W;
    GRID_STRIDE_LOOP(g, total) {
        int p, d, h, w;
        split5((int)g, s.D, s.H, s.W, p, d, h, w);
        const int here = (d * s.H + h) * s.W + w;
        const long long base = (long long)p * s.Do * s.Ho * s.Wo;
        float acc = 0.f;
        for (int i = s.kd - 1; i >= 0; --i) {
            const int od = window_of_tap(d, i, s.Do, s.sd, s.pd, s.dd);
            if (od < 0) continue;
            for (int j = s.kh - 1; j >= 0; --j) {
                const int oh = window_of_tap(h, j, s.Ho, s.sh, s.ph, s.dh);
                if (oh < 0) continue;
                for (int k = s.kw - 1; k >= 0; --k) {
                    const int ow = window_of_tap(w, k, s.Wo, s.sw, s.pw, s.dw);
                    if (ow < 0) continue;
                    const long long o = base + (long long)(od * s.Ho + oh) * s.Wo + ow;
                    if (idx[o] == here) acc += load_as_float(dy, o);
                }
            }
        }
        store_from_float(dx, g, acc);
    }
}

// The divisor of window (od, oh, ow) (file comment).
__device__ __forceinline__ float avg_divisor(const Pool3dShape& s, int od, int oh, int ow,
                                             int count_include_pad, int divisor_override) {
    if (divisor_override > 0) return (float)divisor_override;
    const AxisWindow a = axis_window(od, s.D, s.kd, s.sd, s.pd);
    const AxisWindow b = axis_window(oh, s.H, s.kh, s.sh, s.ph);
    const AxisWindow c = axis_window(ow, s.W, s.kw, s.sw, s.pw);
    return count_include_pad ? (float)(a.size * b.size * c.size)
                             : (float)(a.real * b.real * c.real);
}

template <typename T>
__global__ void avgpool3d_forward_kernel(const T* x, T* y, int count_include_pad,
                                         int divisor_override, POOL3D_SHAPE_ARGS) {
    await_previous_kernel();
    const Pool3dShape s = POOL3D_SHAPE_INIT;
    const long long total = (long long)s.planes * s.Do * s.Ho * s.Wo;
    GRID_STRIDE_LOOP(g, total) {
        int p, od, oh, ow;
        split5((int)g, s.Do, s.Ho, s.Wo, p, od, oh, ow);
        const long long base = (long long)p * s.D * s.H * s.W;
        float acc = 0.f;
        for (int d = max(od * s.sd - s.pd, 0); d < min(od * s.sd - s.pd + s.kd, s.D); ++d)
            for (int h = max(oh * s.sh - s.ph, 0); h < min(oh * s.sh - s.ph + s.kh, s.H); ++h)
                for (int w = max(ow * s.sw - s.pw, 0); w < min(ow * s.sw - s.pw + s.kw, s.W);
                     ++w)
                    acc += load_as_float(x, base + (d * s.H + h) * s.W + w);
        store_from_float(y, g, acc / avg_divisor(s, od, oh, ow, count_include_pad,
                                                  divisor_override));
    }
}

// dx[p, d, h, w] = sum of dy[o] / divisor(o) over the windows o holding (d, h, w).
template <typename T>
__global__ void avgpool3d_backward_kernel(const T* dy, T* dx, int count_include_pad,
                                          int divisor_override, POOL3D_SHAPE_ARGS) {
    await_previous_kernel();
    const Pool3dShape s = POOL3D_SHAPE_INIT;
    const long long total = (long long)s.planes * s.D * s.H * s.W;
    GRID_STRIDE_LOOP(g, total) {
        int p, d, h, w;
        split5((int)g, s.D, s.H, s.W, p, d, h, w);
        const long long base = (long long)p * s.Do * s.Ho * s.Wo;
        float acc = 0.f;
        for (int i = s.kd - 1; i >= 0; --i) {
            const int od = window_of_tap(d, i, s.Do, s.sd, s.pd, 1);
            if (od < 0) continue;
            for (int j = s.kh - 1; j >= 0; --j) {
                const int oh = window_of_tap(h, j, s.Ho, s.sh, s.ph, 1);
                if (oh < 0) continue;
                for (int k = s.kw - 1; k >= 0; --k) {
                    const int ow = window_of_tap(w, k, s.Wo, s.sw, s.pw, 1);
                    if (ow < 0) continue;
                    const long long o = base + (long long)(od * s.Ho + oh) * s.Wo + ow;
                    acc += load_as_float(dy, o) /
                           avg_divisor(s, od, oh, ow, count_include_pad, divisor_override);
                }
            }
        }
        store_from_float(dx, g, acc);
    }
}
