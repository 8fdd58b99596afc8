// Convolution as GEMM: the im2col / col2im layout kernels around the cuBLASLt GEMMs (conv.py),
// and the bias / ReLU epilogue of convolutions run elsewhere (cuDNN plans without fusion).
// x (N,C,H,W), w (O,C,kh,kw), y (N,O,Ho,Wo). A patch row is ck = (c*kh + i)*kw + j (w's own
// layout, so w is the row-major (O, C*kh*kw) matrix as it is); an output pixel is p = oh*Wo + ow.
// Every kernel handles one chunk of nb samples (pointers already offset to the chunk), is a
// grid-stride loop over 64-bit indices (col2im: 32-bit ones where they suffice), and writes
// each element it owns once: no atomics, so results are deterministic.
#include "launch_order.cuh"
#include "bf16.cuh"

struct Geometry {
    int C, H, W, kh, kw, sh, sw, ph, pw, Ho, Wo;
};

// Kernels take the geometry as plain ints (the launcher passes eleven int32 scalars).
#define GEOMETRY_PARAMS int C, int H, int W, int kh, int kw, int sh, int sw, int ph, int pw, \
                        int Ho, int Wo
#define GEOMETRY_INIT {C, H, W, kh, kw, sh, sw, ph, pw, Ho, Wo}

// x[b, c, oh*sh - ph + i, ow*sw - pw + j], zero outside the image.
template <typename T>
__device__ __forceinline__ T patch_value(const T* __restrict__ x, const Geometry& g, long long b,
                                         int ck, int p) {
    const int j = ck % g.kw;
    const int i = (ck / g.kw) % g.kh;
    const int c = ck / (g.kw * g.kh);
    const int h = (p / g.Wo) * g.sh - g.ph + i;
    const int w = (p % g.Wo) * g.sw - g.pw + j;
    if (h < 0 || h >= g.H || w < 0 || w >= g.W) return T(0);
    return x[((b * g.C + c) * g.H + h) * g.W + w];
}

// cols (nb, CK, P) = the patches of x; then, when n_bias > 0, y (nb, O, P) = b[o] broadcast
// (the forward GEMM accumulates onto it: y = w @ cols + b in two launches).
template <typename T>
__global__ void conv2d_im2col_kernel(const T* __restrict__ x, T* __restrict__ cols,
                                     const T* __restrict__ bias, T* __restrict__ y,
                                     long long n_cols, long long n_bias, int O,
                                     GEOMETRY_PARAMS) {
    await_previous_kernel();
    const Geometry g = GEOMETRY_INIT;
    const int P = g.Ho * g.Wo;
    const int CK = g.C * g.kh * g.kw;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n_cols + n_bias;
         e += stride) {
        if (e < n_cols) {
            const int p = (int)(e % P);
            const long long t = e / P;
            cols[e] = patch_value(x, g, t / CK, (int)(t % CK), p);
        } else {
            const long long f = e - n_cols;
            y[f] = bias[(f / P) % O];
        }
    }
}

// The operands of the weight gradient, batch folded into the GEMM's K dimension:
// cols_t (CK, nb*P) = patches of x, dy_t (O, nb*P) = dy with the sample axis moved inside,
// so dw (O, CK) = dy_t @ cols_t^T sums over the batch in one GEMM.
template <typename T>
__global__ void conv2d_grad_weight_gather_kernel(const T* __restrict__ x, const T* __restrict__ dy,
                                                 T* __restrict__ cols_t, T* __restrict__ dy_t,
                                                 int nb, int O, GEOMETRY_PARAMS) {
    await_previous_kernel();
    const Geometry g = GEOMETRY_INIT;
    const int P = g.Ho * g.Wo;
    const long long Q = (long long)nb * P;
    const long long n_cols = (long long)g.C * g.kh * g.kw * Q;
    const long long total = n_cols + O * Q;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += stride) {
        const long long f = e < n_cols ? e : e - n_cols;
        const long long q = f % Q;        // column: (sample b, pixel p)
        const long long row = f / Q;      // ck, or o
        const long long b = q / P;
        const int p = (int)(q % P);
        if (e < n_cols) {
            cols_t[f] = patch_value(x, g, b, (int)row, p);
        } else {
            dy_t[f] = dy[(b * O + row) * P + p];
        }
    }
}

// dx (nb, C, H, W) = col2im(dcols (nb, CK, P)): each input pixel gathers, in a fixed order, the
// patch entries that read it. Those are the taps i with h + ph - i a non-negative multiple of
// sh: from i0 = (h + ph) % sh up by sh, their output row oh = (h + ph - i) / sh falling by one
// each (the same along w). Two divisions an axis a pixel, where testing every tap took two a
// tap; and 32-bit indices below 2^31 elements, where 64-bit divisions (a long instruction
// sequence each) cost more than the memory traffic: on an H200 a U-Net's 2x2 stride-2
// transposed convolutions spent 27 µs a call in this kernel on 8 MB.
template <typename T, typename I>
__device__ __forceinline__ void col2im_pixels(const T* __restrict__ dcols, T* __restrict__ dx,
                                              I total, const Geometry& g) {
    const int P = g.Ho * g.Wo;
    const int HW = g.H * g.W;
    const int taps = g.kh * g.kw;
    const I stride = (I)gridDim.x * blockDim.x;
    for (I e = (I)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += stride) {
        const I plane = e / HW;                        // (sample, channel)
        const int pixel = (int)(e - plane * HW);
        const int hp = pixel / g.W + g.ph;
        const int wp = pixel % g.W + g.pw;
        const T* col = dcols + (long long)plane * taps * P;   // its channel's kh*kw rows
        T acc = T(0);
        for (int i = hp % g.sh, oh = hp / g.sh; i < g.kh && oh >= 0; i += g.sh, --oh) {
            if (oh >= g.Ho) continue;
            for (int j = wp % g.sw, ow = wp / g.sw; j < g.kw && ow >= 0; j += g.sw, --ow) {
                if (ow >= g.Wo) continue;
                acc += col[(long long)(i * g.kw + j) * P + oh * g.Wo + ow];
            }
        }
        dx[e] = acc;
    }
}

template <typename T>
__global__ void conv2d_col2im_kernel(const T* __restrict__ dcols, T* __restrict__ dx, int nb,
                                     GEOMETRY_PARAMS) {
    await_previous_kernel();
    const Geometry g = GEOMETRY_INIT;
    const long long total = (long long)nb * g.C * g.H * g.W;
    const long long stride = (long long)gridDim.x * blockDim.x;
    if (total + stride <= 0x7fffffffLL) {
        col2im_pixels<T, int>(dcols, dx, (int)total, g);
    } else {
        col2im_pixels<T, long long>(dcols, dx, total, g);
    }
}

// y (N, O, P) += bias[o] (has_bias), then max(y, 0) (relu), in place: the epilogue of a
// convolution computed without them (a cuDNN plan that fuses neither).
template <typename T>
__global__ void conv2d_bias_act_kernel(T* __restrict__ y, const T* __restrict__ bias,
                                       long long total, int O, int P, int has_bias, int relu) {
    await_previous_kernel();
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += stride) {
        T v = y[e];
        if (has_bias) v += bias[(e / P) % O];
        y[e] = relu && v < T(0) ? T(0) : v;
    }
}

// bfloat16 y and bias (raw bits, bf16.cuh): the sum in float, y rounded to nearest even once
// more on store (the convolution already rounded it: conv.py's module docstring says when).
template <>
__global__ void conv2d_bias_act_kernel<unsigned short>(unsigned short* __restrict__ y,
                                                       const unsigned short* __restrict__ bias,
                                                       long long total, int O, int P,
                                                       int has_bias, int relu) {
    await_previous_kernel();
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += stride) {
        float v = bf16_to_float(y[e]);
        if (has_bias) v += bf16_to_float(bias[(e / P) % O]);
        y[e] = bf16_from_float(relu && v < 0.f ? 0.f : v);
    }
}

// float16 y and bias (fp16.cuh): as the bfloat16 specialisation.
template <>
__global__ void conv2d_bias_act_kernel<fp16_bits>(fp16_bits* __restrict__ y,
                                                  const fp16_bits* __restrict__ bias,
                                                  long long total, int O, int P, int has_bias,
                                                  int relu) {
    await_previous_kernel();
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += stride) {
        float v = fp16_to_float(y[e]);
        if (has_bias) v += fp16_to_float(bias[(e / P) % O]);
        y[e] = fp16_from_float(relu && v < 0.f ? 0.f : v);
    }
}
