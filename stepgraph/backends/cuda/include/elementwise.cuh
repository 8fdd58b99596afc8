// Activation functions and their derivatives, shared by elementwise.cu (act, act_grad) and
// reduce.cu (act_bias_grad). Operation order and rounding follow the numpy reference
// (the NumPy references of stepgraph/ops/); __fmul_rn/__fadd_rn stop the compiler from contracting a
// product and a sum into one FMA, which would round differently from numpy.
#pragma once

// Codes passed by runtime/launch.py (ACT_CODES); ACT_NONE is act_bias_grad's identity.
#define ACT_NONE -1
#define ACT_RELU 0
#define ACT_LEAKY_RELU 1
#define ACT_SIGMOID 2
#define ACT_TANH 3
#define ACT_GELU 4
#define ACT_GELU_TANH 5
#define ACT_SILU 6

#define SQRT_2_OVER_PI 0.7978845608028654
#define SQRT_2PI 2.5066282746310002
#define GELU_TANH_C 0.044715f

__device__ __forceinline__ float act_value(float z, int kind, float slope) {
    switch (kind) {
    case ACT_RELU:
        return (z > 0.f || z != z) ? z : 0.f;  // NaN propagates, as np.maximum
    case ACT_LEAKY_RELU:
        return z > 0.f ? z : __fmul_rn(z, slope);
    case ACT_SIGMOID:
        return 1.f / (1.f + expf(-z));
    case ACT_TANH:
        return tanhf(z);
    case ACT_GELU:
        // z * Phi(z) in float32: normcdff avoids 1 + erf's cancellation for z << 0. The
        // reference evaluates in float64; this stays within an ulp or two of it, and float64
        // erf here cost several times the GEMM epilogue on large layers.
        return z * normcdff(z);
    case ACT_GELU_TANH: {
        const float c = (float)SQRT_2_OVER_PI;
        const float z3 = __fmul_rn(__fmul_rn(z, z), z);
        const float inner = __fmul_rn(c, __fadd_rn(z, __fmul_rn(GELU_TANH_C, z3)));
        return __fmul_rn(0.5f * z, 1.f + tanhf(inner));
    }
    case ACT_SILU:  // z * sigmoid(z), as the reference: z / (1 + exp(-z))
        return __fdiv_rn(z, 1.f + expf(-z));
    default:
        return z;
    }
}

// tanh(x) from the hardware's approximation (one MUFU.TANH; relative error below 2^-10.9, an
// eighth of a bf16 ulp), for kernels whose results are rounded to bf16 anyway.
__device__ __forceinline__ float tanh_approx(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// d act / d z from `saved`: the output y for relu/sigmoid/tanh, the input z for the others.
// FAST_TANH: gelu_tanh's tanh by tanh_approx (act_bias_grad's bf16 kernel, whose GELU
// gradient was bound by the instructions of tanhf: reduce.cu).
template <bool FAST_TANH = false>
__device__ __forceinline__ float act_derivative(float s, int kind, float slope) {
    switch (kind) {
    case ACT_RELU:
        return s > 0.f ? 1.f : 0.f;
    case ACT_LEAKY_RELU:
        return s > 0.f ? 1.f : slope;
    case ACT_SIGMOID:
        return __fmul_rn(s, 1.f - s);
    case ACT_TANH:
        return 1.f - __fmul_rn(s, s);
    case ACT_GELU:
        // Phi(z) + z * phi(z) in float32 (the reference: float64, cast once; see act_value).
        return normcdff(s) + s * (expf(-0.5f * s * s) * (float)(1.0 / SQRT_2PI));
    case ACT_GELU_TANH: {
        const float c = (float)SQRT_2_OVER_PI;
        const float z3 = __fmul_rn(__fmul_rn(s, s), s);
        const float u = __fmul_rn(c, __fadd_rn(s, __fmul_rn(GELU_TANH_C, z3)));
        const float t = FAST_TANH ? tanh_approx(u) : tanhf(u);
        const float left = __fmul_rn(0.5f, 1.f + t);
        const float slope_t = __fmul_rn(__fmul_rn(__fmul_rn(0.5f, s), 1.f - __fmul_rn(t, t)), c);
        // numpy: 3 * 0.044715 folds in float64 first, then ((c3 * z) * z).
        const float poly = __fadd_rn(1.f, __fmul_rn(__fmul_rn(0.134145f, s), s));
        return __fadd_rn(left, __fmul_rn(slope_t, poly));
    }
    case ACT_SILU: {  // s * (1 + z * (1 - s)), s = sigmoid(z), in the reference's order
        const float sig = 1.f / (1.f + expf(-s));
        return __fmul_rn(sig, __fadd_rn(1.f, __fmul_rn(s, 1.f - sig)));
    }
    default:
        return 1.f;
    }
}
