// Elementwise ops: activations and their gradients, add, fill, dropout (elementwise and
// per-channel, Philox4x32-10 masks identical to the numpy backend's). float32, and for the
// act, act_grad, add and dropout kernels also bfloat16 (T = unsigned short, raw bits:
// bf16.cuh): loaded as float, computed in float32, rounded to nearest even once on store, as
// the numpy emulation does.
// Grid-stride loops over groups of 4 elements: a group is one vector access when the launcher
// says every pointer is 16-byte aligned (`vec`), else 4 scalar accesses; y may alias x.
#include "launch_order.cuh"
#include "bf16.cuh"
#include "grid.cuh"
#include "elementwise.cuh"
#include "philox.cuh"

// act, act_grad and add: templates on the storage T (float, or unsigned short = bf16 bits);
// a group of 4 is one vector access of T when the launcher says every pointer is 16-byte
// aligned. act of bf16 is exact for relu (a selection); the others round act(z) once.
template <typename T>
__global__ void act_forward_kernel(const T* x, T* y, long long n, int kind, float slope,
                                   int vec) {
    await_previous_kernel();
    map_groups(x, y, n, vec, [=](float z) { return act_value(z, kind, slope); });
}

// dx = dy * act'(saved) (numpy: the derivative first, then the product), in float32.
template <typename T>
__global__ void act_backward_kernel(const T* dy, const T* saved, T* dx, long long n, int kind,
                                    float slope, int vec) {
    await_previous_kernel();
    map2_groups(dy, saved, dx, n, vec, [=](float d, float s) {
        return __fmul_rn(d, act_derivative(s, kind, slope));
    });
}

template <typename T>
__global__ void add_forward_kernel(const T* a, const T* b, T* c, long long n, int vec) {
    await_previous_kernel();
    map2_groups(a, b, c, n, vec, [](float u, float v) { return __fadd_rn(u, v); });
}

template <typename T>
__global__ void fill_forward_kernel(T* y, long long n, T value) {
    await_previous_kernel();
    GRID_STRIDE_LOOP(i, n)
        y[i] = value;
}

// One Philox call gives the words of the 4 elements of a group (counter word 0 = i >> 2), so a
// thread handles exactly one group. y = x * mask * scale with scale = float32(1 / (1 - p)).
template <typename T>
__global__ void dropout_forward_kernel(const T* x, const long long* step, T* y,
                                       unsigned char* mask, long long n,
                                       unsigned long long seed, unsigned int site,
                                       unsigned int threshold, float scale, int vec) {
    await_previous_kernel();
    const long long t = *step;
    GRID_STRIDE_GROUPS(g, n) {
        const long long i = g << 2;
        const uint4 w = dropout_words((unsigned long long)g, site, t, seed);
        const float keep[4] = {dropout_keep(w.x, threshold) ? 1.f : 0.f,
                               dropout_keep(w.y, threshold) ? 1.f : 0.f,
                               dropout_keep(w.z, threshold) ? 1.f : 0.f,
                               dropout_keep(w.w, threshold) ? 1.f : 0.f};
        if (vec && i + 4 <= n) {
            float v[4];
            load4_as_float(x, i, v);
            for (int k = 0; k < 4; ++k) v[k] = __fmul_rn(__fmul_rn(v[k], keep[k]), scale);
            store4_from_float(y, i, v);
            reinterpret_cast<uchar4*>(mask)[g] = make_uchar4(
                (unsigned char)keep[0], (unsigned char)keep[1], (unsigned char)keep[2],
                (unsigned char)keep[3]);
        } else {
            for (int k = 0; k < 4 && i + k < n; ++k) {
                store_from_float(y, i + k,
                                 __fmul_rn(__fmul_rn(load_as_float(x, i + k), keep[k]), scale));
                mask[i + k] = (unsigned char)keep[k];
            }
        }
    }
}

template <typename T>
__global__ void dropout_backward_kernel(const T* dy, const unsigned char* mask, T* dx,
                                        long long n, float scale, int vec) {
    await_previous_kernel();
    GRID_STRIDE_GROUPS(g, n) {
        const long long i = g << 2;
        if (vec && i + 4 <= n) {
            float d[4];
            load4_as_float(dy, i, d);
            const uchar4 m = reinterpret_cast<const uchar4*>(mask)[g];
            const float keep[4] = {(float)m.x, (float)m.y, (float)m.z, (float)m.w};
            for (int k = 0; k < 4; ++k) d[k] = __fmul_rn(__fmul_rn(d[k], keep[k]), scale);
            store4_from_float(dx, i, d);
        } else {
            for (long long j = i; j < i + 4 && j < n; ++j)
                store_from_float(dx, j, __fmul_rn(__fmul_rn(load_as_float(dy, j),
                                                            (float)mask[j]), scale));
        }
    }
}

// Dropout2d: one mask element per (n, c) plane of `plane` elements; mask element m draws
// Philox word m & 3 of group m >> 2. Each thread evaluates its element's plane decision, and
// the thread of a plane's first element writes the mask. Launchers keep n below 2^31.
template <typename T>
__global__ void dropout_channel_forward_kernel(const T* x, const long long* step, T* y,
                                               unsigned char* mask, int n, int plane,
                                               unsigned long long seed, unsigned int site,
                                               unsigned int threshold, float scale) {
    await_previous_kernel();
    const long long t = *step;
    GRID_STRIDE_LOOP(i, n) {
        const unsigned int m = (unsigned int)i / (unsigned int)plane;
        const uint4 w = dropout_words(m >> 2, site, t, seed);
        const float keep = dropout_keep(philox_word(w, m & 3u), threshold) ? 1.f : 0.f;
        store_from_float(y, i, __fmul_rn(__fmul_rn(load_as_float(x, i), keep), scale));
        if ((unsigned int)i == m * (unsigned int)plane) mask[m] = (unsigned char)keep;
    }
}

template <typename T>
__global__ void dropout_channel_backward_kernel(const T* dy, const unsigned char* mask, T* dx,
                                                int n, int plane, float scale) {
    await_previous_kernel();
    GRID_STRIDE_LOOP(i, n) {
        const float keep = (float)mask[(unsigned int)i / (unsigned int)plane];
        store_from_float(dx, i, __fmul_rn(__fmul_rn(load_as_float(dy, i), keep), scale));
    }
}

// The bf16 linear's epilogue when cuBLASLt has none for its activation (exact gelu, ...):
// acc (rows, cols) is the float32 GEMM result; z = acc + bias[col] in float32 (numpy: z =
// x @ w.T, then z += b), y = act(z); y and, when z is not null, z are each rounded once from
// those float32 values (rounding z first and taking act of that would round y twice).
template <typename T>
__global__ void linear_bias_act_kernel(const float* acc, const T* bias, T* y, T* z,
                                       long long n, int cols, int kind, float slope) {
    await_previous_kernel();
    GRID_STRIDE_LOOP(i, n) {
        float v = acc[i];
        if (bias) v = __fadd_rn(v, load_as_float(bias, i % cols));
        if (z) store_from_float(z, i, v);
        store_from_float(y, i, act_value(v, kind, slope));
    }
}
