// bfloat16 held as its raw bits (unsigned short): the storage of IR dtype "bfloat16". Kernels
// widen to float on load and round to nearest even on store, so a bf16 value is rounded once,
// by the kernel that writes it. The rule is backends/numpy/bf16.py's, bit for bit (and
// PyTorch's c10::BFloat16): add 0x7FFF plus the lowest kept bit, keep the upper half; every
// NaN becomes 0x7FC0. No cuda_bf16.h: the bit arithmetic needs no header and pins the NaN.
#pragma once

#include "fp16.cuh"      // float16's storage and its overloads of the loads and stores below

__device__ __forceinline__ unsigned short bf16_from_float(float f) {
    const unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)0x7fc0u;
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ float bf16_to_float(unsigned short b) {
    return __uint_as_float((unsigned int)b << 16);
}

// f rounded to the nearest bf16 value, as a float: what a store then a load of bf16 give (the
// generated pointwise kernels round each bf16 instruction so, backends/cuda/pointwise.py).
__device__ __forceinline__ float bf16_round(float f) { return bf16_to_float(bf16_from_float(f)); }

// Loads and stores of float or bf16 elements as float, for kernels templated on the type.
__device__ __forceinline__ float load_as_float(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float load_as_float(const unsigned short* p, long long i) {
    return bf16_to_float(p[i]);
}
__device__ __forceinline__ void store_from_float(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void store_from_float(unsigned short* p, long long i, float v) {
    p[i] = bf16_from_float(v);
}

// Four adjacent elements from p + i as float (i % 4 == 0, p 16-byte aligned): one vector access.
__device__ __forceinline__ void load4_as_float(const float* p, long long i, float v[4]) {
    const float4 a = *reinterpret_cast<const float4*>(p + i);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
}
__device__ __forceinline__ void load4_as_float(const unsigned short* p, long long i,
                                               float v[4]) {
    const ushort4 a = *reinterpret_cast<const ushort4*>(p + i);
    v[0] = bf16_to_float(a.x); v[1] = bf16_to_float(a.y);
    v[2] = bf16_to_float(a.z); v[3] = bf16_to_float(a.w);
}
// V adjacent elements (V = 1, 2 or 4) from p + i as float, and back: one access of V elements
// (i % V == 0, p aligned to V elements).
template <int V>
__device__ __forceinline__ void loadv_as_float(const float* p, long long i, float* v) {
    if constexpr (V == 1) {
        v[0] = p[i];
    } else if constexpr (V == 2) {
        const float2 a = *reinterpret_cast<const float2*>(p + i);
        v[0] = a.x; v[1] = a.y;
    } else {
        load4_as_float(p, i, v);
    }
}
template <int V>
__device__ __forceinline__ void loadv_as_float(const unsigned short* p, long long i, float* v) {
    if constexpr (V == 1) {
        v[0] = bf16_to_float(p[i]);
    } else if constexpr (V == 2) {
        const ushort2 a = *reinterpret_cast<const ushort2*>(p + i);
        v[0] = bf16_to_float(a.x); v[1] = bf16_to_float(a.y);
    } else {
        load4_as_float(p, i, v);
    }
}
__device__ __forceinline__ void store4_from_float(float* p, long long i, const float v[4]) {
    *reinterpret_cast<float4*>(p + i) = make_float4(v[0], v[1], v[2], v[3]);
}
__device__ __forceinline__ void store4_from_float(unsigned short* p, long long i,
                                                  const float v[4]) {
    *reinterpret_cast<ushort4*>(p + i) = make_ushort4(bf16_from_float(v[0]),
                                                      bf16_from_float(v[1]),
                                                      bf16_from_float(v[2]),
                                                      bf16_from_float(v[3]));
}
template <int V>
__device__ __forceinline__ void storev_from_float(float* p, long long i, const float* v) {
    if constexpr (V == 1) p[i] = v[0];
    else if constexpr (V == 2) *reinterpret_cast<float2*>(p + i) = make_float2(v[0], v[1]);
    else store4_from_float(p, i, v);
}
template <int V>
__device__ __forceinline__ void storev_from_float(unsigned short* p, long long i, const float* v) {
    if constexpr (V == 1)
        p[i] = bf16_from_float(v[0]);
    else if constexpr (V == 2)
        *reinterpret_cast<ushort2*>(p + i) = make_ushort2(bf16_from_float(v[0]),
                                                          bf16_from_float(v[1]));
    else
        store4_from_float(p, i, v);
}

// Loads and stores as above, from a tensor of multi-tensor tables (the updates, global_norm,
// guard_check) whose storage is a runtime `kind` (FLOAT_KINDS of runtime/launch.py: 0
// float32, 1 bf16 bits, 2 float16): a bf16 gradient whose cast to float32 was dropped
// (compile/fuse.py fuse_gradient_casts) reads as its exact widening, and so does a float16
// one (model.half()).
#define STORAGE_F32 0
#define STORAGE_BF16 1
#define STORAGE_FP16 2
__device__ __forceinline__ float load_either_as_float(const void* p, int kind, long long i) {
    if (kind == STORAGE_BF16) return load_as_float(static_cast<const unsigned short*>(p), i);
    if (kind == STORAGE_FP16) return load_as_float(static_cast<const fp16_bits*>(p), i);
    return static_cast<const float*>(p)[i];
}
__device__ __forceinline__ void load4_either_as_float(const void* p, int kind, long long i,
                                                      float v[4]) {
    if (kind == STORAGE_BF16) load4_as_float(static_cast<const unsigned short*>(p), i, v);
    else if (kind == STORAGE_FP16) load4_as_float(static_cast<const fp16_bits*>(p), i, v);
    else load4_as_float(static_cast<const float*>(p), i, v);
}
__device__ __forceinline__ void store_either_from_float(void* p, int kind, long long i,
                                                        float v) {
    if (kind == STORAGE_BF16) store_from_float(static_cast<unsigned short*>(p), i, v);
    else if (kind == STORAGE_FP16) store_from_float(static_cast<fp16_bits*>(p), i, v);
    else static_cast<float*>(p)[i] = v;
}
__device__ __forceinline__ void store4_either_from_float(void* p, int kind, long long i,
                                                         const float v[4]) {
    if (kind == STORAGE_BF16) store4_from_float(static_cast<unsigned short*>(p), i, v);
    else if (kind == STORAGE_FP16) store4_from_float(static_cast<fp16_bits*>(p), i, v);
    else store4_from_float(static_cast<float*>(p), i, v);
}
