// Max pooling (floor mode, implicit -inf padding (ph, pw) of at most half the window, so every
// window holds a real element): the forward writes the max and the plane-local index h * W + w
// of the FIRST maximum in row-major window order (numpy argmax, PyTorch) among the window's
// real elements; the backward gathers, one thread per input element, so overlapping windows
// (stride < kernel) need no atomics and sum in a fixed order. Launchers keep sizes < 2^31.
// NCHW kernels and channels-last (_nhwc_, with C) ones: the same code (pool.cuh layouts); and
// channels-last ones taking 16 bytes of adjacent channels a thread (_nhwc_vec_, at the end).

// Templates over the element storage T: float, or unsigned short (bfloat16 bits, bf16.cuh):
// loaded as float, summed in float, rounded once on store (for max pooling the rounding is a
// no-op: every output is an input).

// With relu (the ReLU after the pool, fused) the forward stores relu(max) and the backward
// adds only where that output is > 0. Shapes and windows: pool.cuh.
#include "launch_order.cuh"
#include "bf16.cuh"
#include "grid.cuh"
#include "pool.cuh"

template <bool NHWC, typename T>
__device__ __forceinline__ void maxpool2d_forward(const T* x, T* y, int* idx, int relu,
                                                  int C, const PoolShape& s) {
    const long long total = (long long)s.planes * s.Ho * s.Wo;
    GRID_STRIDE_LOOP(g, total) {
        int p, ho, wo;
        element_of<NHWC>((int)g, s.Ho, s.Wo, C, p, ho, wo);
        const PlaneAt plane = plane_at<NHWC>(p, s.H, s.W, C);
        // The window clipped to the plane: padding is -inf, never a maximum over real values.
        const Window win = clipped_window(s, ho, wo);
        int best_at = win.h0 * s.W + win.w0;
        float best = load_as_float(x, plane.base + (long long)best_at * plane.step);
        for (int h = win.h0; h < win.h1; ++h) {
            for (int w = win.w0; w < win.w1; ++w) {
                const int at = h * s.W + w;
                const float v = load_as_float(x, plane.base + (long long)at * plane.step);
                // Strictly greater keeps the first maximum; the first NaN wins, as argmax.
                if (v > best || (v != v && best == best)) {
                    best = v;
                    best_at = at;
                }
            }
        }
        // NaN passes, as np.maximum
        store_from_float(y, g, relu && !(best > 0.f || best != best) ? 0.f : best);
        idx[g] = best_at;
    }
}

template <typename T>
__global__ void maxpool2d_forward_kernel(const T* x, T* y, int* idx, int relu,
                                         POOL_SHAPE_ARGS) {
    await_previous_kernel();
    maxpool2d_forward<false>(x, y, idx, relu, 1, POOL_SHAPE_INIT);
}

template <typename T>
__global__ void maxpool2d_forward_nhwc_kernel(const T* x, T* y, int* idx,
                                              int relu, int C, POOL_SHAPE_ARGS) {
    await_previous_kernel();
    maxpool2d_forward<true>(x, y, idx, relu, C, POOL_SHAPE_INIT);
}

// dx[p, h, w] = sum of dy over the windows containing (h, w) whose argmax is (h, w), taken in
// row-major window order: the order in which the numpy reference's np.add.at accumulates.
template <bool NHWC, typename T>
__device__ __forceinline__ void maxpool2d_backward(const T* dy, const int* idx,
                                                   const T* y, T* dx, int C,
                                                   const PoolShape& s) {
    const long long total = (long long)s.planes * s.H * s.W;
    GRID_STRIDE_LOOP(g, total) {
        int p, h, w;
        element_of<NHWC>((int)g, s.H, s.W, C, p, h, w);
        const WindowSpan span = windows_holding(s, h, w);
        const int here = h * s.W + w;
        const PlaneAt plane = plane_at<NHWC>(p, s.Ho, s.Wo, C);
        float acc = 0.f;
        for (int ho = span.ho_lo; ho <= span.ho_hi; ++ho) {
            for (int wo = span.wo_lo; wo <= span.wo_hi; ++wo) {
                const long long o = plane.base + (long long)(ho * s.Wo + wo) * plane.step;
                // Three independent loads, issued together (a short-circuit test would wait
                // for idx before loading y, then for y before loading dy).
                const int at = idx[o];
                const float grad = load_as_float(dy, o);
                const bool open = y == nullptr || load_as_float(y, o) > 0.f;
                if (at == here && open) acc += grad;
            }
        }
        store_from_float(dx, g, acc);
    }
}

template <typename T>
__global__ void maxpool2d_backward_kernel(const T* dy, const int* idx,
                                          const T* y, T* dx,
                                          POOL_SHAPE_ARGS) {
    await_previous_kernel();
    maxpool2d_backward<false>(dy, idx, y, dx, 1, POOL_SHAPE_INIT);
}

template <typename T>
__global__ void maxpool2d_backward_nhwc_kernel(const T* dy, const int* idx,
                                               const T* y, T* dx, int C,
                                               POOL_SHAPE_ARGS) {
    await_previous_kernel();
    maxpool2d_backward<true>(dy, idx, y, dx, C, POOL_SHAPE_INIT);
}

// The backward when the windows tile the input exactly (stride == kernel, no padding,
// H % kh == 0, W % kw == 0): every input pixel lies in one window, so a thread per pooled
// output writes its whole window, dy at the argmax (where the fused ReLU let it through) and
// zero elsewhere: a quarter of the threads of the gather above for 2x2 windows, and dy, idx,
// y read once.
// 0 + dy as the gather's sum would give (-0 becomes +0, like the reference's np.add.at).
template <bool NHWC, typename T>
__device__ __forceinline__ void maxpool2d_backward_tiling(const T* dy, const int* idx,
                                                          const T* y, T* dx, int C,
                                                          const PoolShape& s) {
    const long long total = (long long)s.planes * s.Ho * s.Wo;
    GRID_STRIDE_LOOP(g, total) {
        int p, ho, wo;
        element_of<NHWC>((int)g, s.Ho, s.Wo, C, p, ho, wo);
        const int at = idx[g];
        const float grad = __fadd_rn(0.f, load_as_float(dy, g));
        const bool open = y == nullptr || load_as_float(y, g) > 0.f;
        const PlaneAt plane = plane_at<NHWC>(p, s.H, s.W, C);
        for (int i = 0; i < s.kh; ++i) {
            for (int j = 0; j < s.kw; ++j) {
                const int here = (ho * s.kh + i) * s.W + wo * s.kw + j;
                store_from_float(dx, plane.base + (long long)here * plane.step,
                                 open && at == here ? grad : 0.f);
            }
        }
    }
}

template <typename T>
__global__ void maxpool2d_backward_tiling_kernel(const T* dy, const int* idx,
                                                 const T* y, T* dx,
                                                 POOL_SHAPE_ARGS) {
    await_previous_kernel();
    maxpool2d_backward_tiling<false>(dy, idx, y, dx, 1, POOL_SHAPE_INIT);
}

template <typename T>
__global__ void maxpool2d_backward_tiling_nhwc_kernel(const T* dy, const int* idx,
                                                      const T* y, T* dx,
                                                      int C, POOL_SHAPE_ARGS) {
    await_previous_kernel();
    maxpool2d_backward_tiling<true>(dy, idx, y, dx, C, POOL_SHAPE_INIT);
}

// ---- channels-last, PACK<T> adjacent channels a thread (pool.cuh) -------------------------
// The launchers take these when C % PACK<T> == 0 (4 floats, 8 16-bit values) and every pointer
// is 16-byte aligned: a thread walks one pixel's window (or its windows, in the gather) once
// for PACK<T> channels, each channel with the arithmetic, comparisons and order of the
// one-element kernels above, so the results are theirs bit for bit; x, y, dy, dx move 16 bytes
// at a time, idx 16 (float) or 32 (16-bit T) bytes as int4s.

template <typename T>
__device__ __forceinline__ void maxpool2d_forward_vec(const T* x, T* y, int* idx, int relu,
                                                      int C, const PoolShape& s) {
    constexpr int V = PACK<T>;
    const long long total = (long long)s.planes * s.Ho * s.Wo / V;
    GRID_STRIDE_LOOP(g, total) {
        int n, ho, wo, c;
        group_of<V>((int)g, s.Ho, s.Wo, C, n, ho, wo, c);
        const PlaneAt plane = nhwc_plane(n, c, s.H, s.W, C);
        const Window win = clipped_window(s, ho, wo);
        const int first = win.h0 * s.W + win.w0;
        float best[V];
        int best_at[V];
        load_pack(x, plane.base + (long long)first * C, best);
#pragma unroll
        for (int k = 0; k < V; ++k) best_at[k] = first;
        for (int h = win.h0; h < win.h1; ++h) {
            for (int w = win.w0; w < win.w1; ++w) {
                const int at = h * s.W + w;
                float v[V];
                load_pack(x, plane.base + (long long)at * C, v);
#pragma unroll
                for (int k = 0; k < V; ++k) {
                    // maxpool2d_forward's test: the first maximum, the first NaN
                    if (v[k] > best[k] || (v[k] != v[k] && best[k] == best[k])) {
                        best[k] = v[k];
                        best_at[k] = at;
                    }
                }
            }
        }
#pragma unroll
        for (int k = 0; k < V; ++k)
            best[k] = relu && !(best[k] > 0.f || best[k] != best[k]) ? 0.f : best[k];
        store_pack(y, g * V, best);
        store_ints<V>(idx, g * V, best_at);
    }
}

template <typename T>
__global__ void maxpool2d_forward_nhwc_vec_kernel(const T* x, T* y, int* idx, int relu, int C,
                                                  POOL_SHAPE_ARGS) {
    await_previous_kernel();
    maxpool2d_forward_vec(x, y, idx, relu, C, POOL_SHAPE_INIT);
}

// maxpool2d_backward's gather (the same windows, order and sums per channel).
template <typename T>
__device__ __forceinline__ void maxpool2d_backward_vec(const T* dy, const int* idx, const T* y,
                                                       T* dx, int C, const PoolShape& s) {
    constexpr int V = PACK<T>;
    const long long total = (long long)s.planes * s.H * s.W / V;
    GRID_STRIDE_LOOP(g, total) {
        int n, h, w, c;
        group_of<V>((int)g, s.H, s.W, C, n, h, w, c);
        const WindowSpan span = windows_holding(s, h, w);
        const int here = h * s.W + w;
        const PlaneAt plane = nhwc_plane(n, c, s.Ho, s.Wo, C);
        float acc[V];
#pragma unroll
        for (int k = 0; k < V; ++k) acc[k] = 0.f;
        for (int ho = span.ho_lo; ho <= span.ho_hi; ++ho) {
            for (int wo = span.wo_lo; wo <= span.wo_hi; ++wo) {
                const long long o = plane.base + (long long)(ho * s.Wo + wo) * C;
                int at[V];
                float grad[V], out[V];
                load_ints<V>(idx, o, at);
                load_pack(dy, o, grad);
                if (y != nullptr) load_pack(y, o, out);
#pragma unroll
                for (int k = 0; k < V; ++k)
                    if (at[k] == here && (y == nullptr || out[k] > 0.f)) acc[k] += grad[k];
            }
        }
        store_pack(dx, g * V, acc);
    }
}

template <typename T>
__global__ void maxpool2d_backward_nhwc_vec_kernel(const T* dy, const int* idx, const T* y,
                                                   T* dx, int C, POOL_SHAPE_ARGS) {
    await_previous_kernel();
    maxpool2d_backward_vec(dy, idx, y, dx, C, POOL_SHAPE_INIT);
}

// maxpool2d_backward_tiling's scatter: a thread per PACK<T> channels of a pooled pixel writes
// their whole window.
template <typename T>
__device__ __forceinline__ void maxpool2d_backward_tiling_vec(const T* dy, const int* idx,
                                                              const T* y, T* dx, int C,
                                                              const PoolShape& s) {
    constexpr int V = PACK<T>;
    const long long total = (long long)s.planes * s.Ho * s.Wo / V;
    GRID_STRIDE_LOOP(g, total) {
        int n, ho, wo, c;
        group_of<V>((int)g, s.Ho, s.Wo, C, n, ho, wo, c);
        int at[V];
        float grad[V], out[V];
        bool open[V];
        load_ints<V>(idx, g * V, at);
        load_pack(dy, g * V, grad);
        if (y != nullptr) load_pack(y, g * V, out);
#pragma unroll
        for (int k = 0; k < V; ++k) {
            grad[k] = __fadd_rn(0.f, grad[k]);
            open[k] = y == nullptr || out[k] > 0.f;
        }
        const PlaneAt plane = nhwc_plane(n, c, s.H, s.W, C);
        for (int i = 0; i < s.kh; ++i) {
            for (int j = 0; j < s.kw; ++j) {
                const int here = (ho * s.kh + i) * s.W + wo * s.kw + j;
                float v[V];
#pragma unroll
                for (int k = 0; k < V; ++k) v[k] = open[k] && at[k] == here ? grad[k] : 0.f;
                store_pack(dx, plane.base + (long long)here * C, v);
            }
        }
    }
}

template <typename T>
__global__ void maxpool2d_backward_tiling_nhwc_vec_kernel(const T* dy, const int* idx,
                                                          const T* y, T* dx, int C,
                                                          POOL_SHAPE_ARGS) {
    await_previous_kernel();
    maxpool2d_backward_tiling_vec(dy, idx, y, dx, C, POOL_SHAPE_INIT);
}
