// Pooling windows over (N, C) planes, shared by pool.cu (max) and avgpool.cu (average).
// Shapes: `planes` = N * C planes of (H, W) in, (Ho, Wo) out; window (kh, kw), stride (sh, sw),
// padding (ph, pw): window (ho, wo) starts at (ho * sh - ph, wo * sw - pw). Floor mode and
// padding of at most half the window keep a real element in every window.
// Layouts: NCHW (plane p = n * C + c contiguous) or NHWC (channels-last: element (n, h, w, c)
// at ((n * H + h) * W + w) * C + c); kernels are templates over NHWC, both walking elements in
// storage order (consecutive threads, consecutive addresses).
#pragma once

#include "bf16.cuh"

struct PoolShape {
    int planes, H, W, Ho, Wo, kh, kw, sh, sw, ph, pw;
};

// Kernels take the shape as plain ints (the launchers' _pool_args: eleven int32 scalars).
#define POOL_SHAPE_ARGS int planes, int H, int W, int Ho, int Wo, int kh, int kw, int sh, int sw, \
                        int ph, int pw
#define POOL_SHAPE_INIT {planes, H, W, Ho, Wo, kh, kw, sh, sw, ph, pw}

// Window (ho, wo) clipped to the plane: rows [h0, h1), columns [w0, w1). Without padding the
// clip changes nothing (floor mode keeps windows inside).
struct Window {
    int h0, h1, w0, w1;
};

__device__ __forceinline__ Window clipped_window(const PoolShape& s, int ho, int wo) {
    return {max(ho * s.sh - s.ph, 0), min(ho * s.sh - s.ph + s.kh, s.H),
            max(wo * s.sw - s.pw, 0), min(wo * s.sw - s.pw + s.kw, s.W)};
}

// The windows holding input element (h, w): ho in [ho_lo, ho_hi] and wo in [wo_lo, wo_hi],
// those with ho * sh <= h + ph <= ho * sh + kh - 1 (and likewise along w).
struct WindowSpan {
    int ho_lo, ho_hi, wo_lo, wo_hi;
};

__device__ __forceinline__ WindowSpan windows_holding(const PoolShape& s, int h, int w) {
    const int hp = h + s.ph, wp = w + s.pw;
    return {hp < s.kh ? 0 : (hp - s.kh) / s.sh + 1, min(hp / s.sh, s.Ho - 1),
            wp < s.kw ? 0 : (wp - s.kw) / s.sw + 1, min(wp / s.sw, s.Wo - 1)};
}

// Element (r, q) of plane p (= n * C + c) of a (planes, R, Q) tensor: where a plane's pixels
// are (base + (r * Q + q) * step) in either layout.
struct PlaneAt {
    long long base;
    int step;
};

// Channel c of image n of a channels-last (N, R, Q, C) tensor.
__device__ __forceinline__ PlaneAt nhwc_plane(int n, int c, int R, int Q, int C) {
    return {(long long)n * R * Q * C + c, C};
}

template <bool NHWC>
__device__ __forceinline__ PlaneAt plane_at(int p, int R, int Q, int C) {
    if (NHWC) {
        const int n = p / C;
        return nhwc_plane(n, p - n * C, R, Q, C);
    }
    return {(long long)p * R * Q, 1};
}

// The plane p and (r, q) of the element stored at g in a (planes, R, Q) tensor. 32-bit
// arithmetic (the launchers keep sizes < 2^31): 64-bit divisions cost tens of instructions
// each, and these index maps ran slower than the memory traffic they serve.
template <bool NHWC>
__device__ __forceinline__ void element_of(int g, int R, int Q, int C, int& p, int& r,
                                           int& q) {
    if (NHWC) {
        const int c = g % C;
        const int t = g / C;
        q = t % Q;
        const int u = t / Q;
        r = u % R;
        p = (u / R) * C + c;
    } else {
        q = g % Q;
        const int t = g / Q;
        r = t % R;
        p = t / R;
    }
}

// ---- channels-last, PACK<T> adjacent channels a thread (the _nhwc_vec_ kernels) ------------
// A pixel's window and index arithmetic then serves 16 bytes of channels: 4 floats or 8
// 16-bit values, moved as one uint4 (the launchers check C % PACK<T> == 0 and 16-byte aligned
// pointers, so every group starts on a 16-byte boundary).
template <typename T>
constexpr int PACK = 16 / (int)sizeof(T);

template <typename T>
union Pack16 {
    uint4 raw;
    T v[PACK<T>];
};

// p[i .. i + PACK<T>) as float (i % PACK<T> == 0).
template <typename T>
__device__ __forceinline__ void load_pack(const T* p, long long i, float* v) {
    Pack16<T> a;
    a.raw = *reinterpret_cast<const uint4*>(p + i);
#pragma unroll
    for (int k = 0; k < PACK<T>; ++k) v[k] = load_as_float(a.v, k);
}

// p[i .. i + PACK<T>) = v, each rounded once as store_from_float does.
template <typename T>
__device__ __forceinline__ void store_pack(T* p, long long i, const float* v) {
    Pack16<T> a;
#pragma unroll
    for (int k = 0; k < PACK<T>; ++k) store_from_float(a.v, k, v[k]);
    *reinterpret_cast<uint4*>(p + i) = a.raw;
}

// int32 p[i .. i + V) (V % 4 == 0, i % 4 == 0, p 16-byte aligned): V / 4 int4 accesses.
template <int V>
__device__ __forceinline__ void load_ints(const int* p, long long i, int* v) {
#pragma unroll
    for (int k = 0; k < V; k += 4) {
        const int4 a = *reinterpret_cast<const int4*>(p + i + k);
        v[k] = a.x; v[k + 1] = a.y; v[k + 2] = a.z; v[k + 3] = a.w;
    }
}

template <int V>
__device__ __forceinline__ void store_ints(int* p, long long i, const int* v) {
#pragma unroll
    for (int k = 0; k < V; k += 4)
        *reinterpret_cast<int4*>(p + i + k) = make_int4(v[k], v[k + 1], v[k + 2], v[k + 3]);
}

// Group g of a channels-last (N, R, Q, C) tensor walked V adjacent channels at a time (C % V
// == 0; group g holds elements g * V .. g * V + V - 1, in storage order): its image n, pixel
// (r, q) and first channel c. element_of's three divisions (with their remainders), once per
// V elements.
template <int V>
__device__ __forceinline__ void group_of(int g, int R, int Q, int C, int& n, int& r, int& q,
                                         int& c) {
    const int groups = C / V;
    const int t = g / groups;
    c = (g - t * groups) * V;
    q = t % Q;
    const int u = t / Q;
    r = u % R;
    n = u / R;
}
