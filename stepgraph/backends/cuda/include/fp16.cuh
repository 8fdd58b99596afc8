// float16 (IR dtype "float16", torch.half) held as its 16 bits in `fp16_bits`: a type of its
// own, so the kernels templated on their storage (float, unsigned short = bf16 bits) take a
// third instantiation whose loads and stores overload on it. Kernels widen to float on load
// and round on store, so a float16 value is rounded once, by the kernel that writes it, as
// the NumPy backend's astype(float16): to nearest even, overflow to +-inf (what a GradScaler
// detects), subnormals kept. The conversions are the hardware's (cvt.rn.f16.f32, exact
// cvt.f32.f16) through inline PTX: NVRTC ships no cuda_fp16.h here, and PTX needs no header.
// Included by bf16.cuh, which holds the overloads of every storage.
#pragma once

struct __align__(2) fp16_bits {
    unsigned short bits;
};

__device__ __forceinline__ fp16_bits fp16_from_float(float f) {
    fp16_bits h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
    return h;
}

__device__ __forceinline__ float fp16_to_float(fp16_bits h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.bits));
    return f;
}

// f rounded to the nearest float16 value, as a float: a store then a load of float16 (the
// generated pointwise kernels round each float16 instruction so, backends/cuda/pointwise.py).
__device__ __forceinline__ float fp16_round(float f) { return fp16_to_float(fp16_from_float(f)); }

// Loads and stores of float16 elements as float (the overloads of bf16.cuh's for float and
// bf16 storage, for the kernels templated on the storage).
__device__ __forceinline__ float load_as_float(const fp16_bits* p, long long i) {
    return fp16_to_float(p[i]);
}
__device__ __forceinline__ void store_from_float(fp16_bits* p, long long i, float v) {
    p[i] = fp16_from_float(v);
}
// Four adjacent elements from p + i (i % 4 == 0, p 8-byte aligned): one 8-byte access.
__device__ __forceinline__ void load4_as_float(const fp16_bits* p, long long i, float v[4]) {
    const ushort4 a = *reinterpret_cast<const ushort4*>(p + i);
    v[0] = fp16_to_float(fp16_bits{a.x}); v[1] = fp16_to_float(fp16_bits{a.y});
    v[2] = fp16_to_float(fp16_bits{a.z}); v[3] = fp16_to_float(fp16_bits{a.w});
}
__device__ __forceinline__ void store4_from_float(fp16_bits* p, long long i, const float v[4]) {
    *reinterpret_cast<ushort4*>(p + i) = make_ushort4(
        fp16_from_float(v[0]).bits, fp16_from_float(v[1]).bits, fp16_from_float(v[2]).bits,
        fp16_from_float(v[3]).bits);
}
template <int V>
__device__ __forceinline__ void loadv_as_float(const fp16_bits* p, long long i, float* v) {
    if constexpr (V == 1) {
        v[0] = fp16_to_float(p[i]);
    } else if constexpr (V == 2) {
        const ushort2 a = *reinterpret_cast<const ushort2*>(p + i);
        v[0] = fp16_to_float(fp16_bits{a.x}); v[1] = fp16_to_float(fp16_bits{a.y});
    } else {
        load4_as_float(p, i, v);
    }
}
template <int V>
__device__ __forceinline__ void storev_from_float(fp16_bits* p, long long i, const float* v) {
    if constexpr (V == 1)
        p[i] = fp16_from_float(v[0]);
    else if constexpr (V == 2)
        *reinterpret_cast<ushort2*>(p + i) = make_ushort2(fp16_from_float(v[0]).bits,
                                                          fp16_from_float(v[1]).bits);
    else
        store4_from_float(p, i, v);
}
