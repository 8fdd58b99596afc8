// Direct convolution for small conv2d layers (conv.py picks it when the work is small): one
// launch per op, no patch matrix, no GEMM. x (N,C,H,W), w (O,C,kh,kw), y (N,O,Ho,Wo), all NCHW
// contiguous; a tap is ck = (c*kh + i)*kw + j, w's own layout.
// Every output element has one owner that sums in a fixed order (a thread for y and dx, a block
// with a fixed reduction tree for dw): no atomics, so results are identical run to run.
// Offsets are 32-bit ints: conv.py only launches these kernels on tensors of <= 2^30
// elements (room for a last block's overshoot and for window offsets left of the image).

// The geometry as plain ints, in the order of conv.cu's GEOMETRY_PARAMS (Geometry.kernel_args).
#include "launch_order.cuh"
#define GEOMETRY_PARAMS int C, int H, int W, int kh, int kw, int sh, int sw, int ph, int pw, \
                        int Ho, int Wo

// A block stages its slice of w in shared memory: at most MAX_TAPS packs of K channels
// (conv.py's DIRECT_MAX_TAPS; 16 KiB for float and K = 4).
constexpr int MAX_TAPS = 1024;

// K values of K consecutive channels: one vector load from shared memory.
template <typename T, int K>
struct alignas(sizeof(T) * K) Pack {
    T v[K];
};

// y[n, o, ho, wo] = b[o] + sum_{c,i,j} x[n, c, ho*sh - ph + i, wo*sw - pw + j] * w[o, c, i, j].
// grid (ceil(N*Ho*Wo / blockDim), ceil(O / OB)): a thread owns one output pixel of one sample
// and OB output channels (one x load feeds OB FMAs); the block stages w[o0 : o0+OB] as
// ws[ck].v[ob], zero past O. Sum order: bias, then c, i, j ascending, taps inside the image only.
// flags: 1 adds the bias, 2 stores max(sum, 0) (a fused ReLU, as conv.cu's epilogue).
template <typename T, int OB>
__global__ void __launch_bounds__(256)
conv2d_direct_forward_kernel(const T* __restrict__ x, const T* __restrict__ w,
                             const T* __restrict__ bias, T* __restrict__ y, int flags,
                             int N, int O, GEOMETRY_PARAMS) {
    await_previous_kernel();
    __shared__ Pack<T, OB> ws[MAX_TAPS];
    const int CK = C * kh * kw;
    const int o0 = blockIdx.y * OB;
    for (int e = threadIdx.x; e < OB * CK; e += blockDim.x) {
        const int ob = e / CK, ck = e % CK;          // reads w[o0*CK + e]: coalesced
        ws[ck].v[ob] = o0 + ob < O ? w[(o0 + ob) * CK + ck] : T(0);
    }
    __syncthreads();

    const int P = Ho * Wo;
    const int q = blockIdx.x * blockDim.x + threadIdx.x;
    if (q >= N * P) return;
    const int n = q / P, p = q % P;
    const int hb = (p / Wo) * sh - ph, wb = (p % Wo) * sw - pw;   // the window's top-left
    const int i0 = max(0, -hb), i1 = min(kh, H - hb);             // taps inside the image
    const int j0 = max(0, -wb), j1 = min(kw, W - wb);
    T acc[OB];
#pragma unroll
    for (int ob = 0; ob < OB; ++ob) acc[ob] = (flags & 1) && o0 + ob < O ? bias[o0 + ob] : T(0);
    for (int c = 0; c < C; ++c) {
#pragma unroll 5
        for (int i = i0; i < i1; ++i) {
            const int row = ((n * C + c) * H + hb + i) * W + wb;  // + j: inside the image
            const Pack<T, OB>* wr = ws + (c * kh + i) * kw;
            // Unrolled: a row's loads issue together instead of one dependent load per tap.
#pragma unroll 5
            for (int j = j0; j < j1; ++j) {
                const T xv = x[row + j];
                const Pack<T, OB> wv = wr[j];
#pragma unroll
                for (int ob = 0; ob < OB; ++ob) acc[ob] += xv * wv.v[ob];
            }
        }
    }
#pragma unroll
    for (int ob = 0; ob < OB; ++ob) {
        if (o0 + ob < O) y[(n * O + o0 + ob) * P + p] = (flags & 2) && acc[ob] < T(0) ? T(0)
                                                                              : acc[ob];
    }
}

// dx[n, c, h, w] = sum_{o,i,j} dy[n, o, ho, wo] * w[o, c, i, j] over the taps with
// ho*sh = h + ph - i and wo*sw = w + pw - j, 0 <= ho < Ho, 0 <= wo < Wo (a gather).
// grid (ceil(N*H*W / blockDim), ceil(C / CB)): a thread owns one input pixel of one sample and
// CB input channels; the block stages w[:, c0 : c0+CB] as ws[(o*kh + i)*kw + j].v[cb], zero past
// C (O*kh*kw <= MAX_TAPS). Sum order: o, i, j ascending.
// The taps that hit a pixel: i = h + ph - ho*sh, so i runs over the residue (h + ph) mod sh
// in steps of sh (ho falling by one each step), from the first i with ho <= Ho - 1 to the last
// with ho >= 0; h + ph - (Ho-1)*sh has that residue too, so the start is a max of the two.
template <typename T, int CB>
__global__ void __launch_bounds__(256)
conv2d_direct_grad_input_kernel(const T* __restrict__ dy, const T* __restrict__ w,
                                T* __restrict__ dx, int N, int O, GEOMETRY_PARAMS) {
    await_previous_kernel();
    __shared__ Pack<T, CB> ws[MAX_TAPS];
    const int KK = kh * kw;
    const int c0 = blockIdx.y * CB;
    for (int e = threadIdx.x; e < O * CB * KK; e += blockDim.x) {
        const int k = e % KK, t = e / KK;            // t = o*CB + cb: runs of CB*KK in w
        const int cb = t % CB, o = t / CB;
        ws[o * KK + k].v[cb] = c0 + cb < C ? w[(o * C + c0 + cb) * KK + k] : T(0);
    }
    __syncthreads();

    const int HW = H * W;
    const int q = blockIdx.x * blockDim.x + threadIdx.x;
    if (q >= N * HW) return;
    const int n = q / HW, r = q % HW;
    const int hp = r / W + ph, wp = r % W + pw;                   // >= 0
    const int i0 = max(hp % sh, hp - (Ho - 1) * sh), i1 = min(kh - 1, hp);
    const int j0 = max(wp % sw, wp - (Wo - 1) * sw), j1 = min(kw - 1, wp);
    T acc[CB];
#pragma unroll
    for (int cb = 0; cb < CB; ++cb) acc[cb] = T(0);
    for (int o = 0; o < O; ++o) {
        const Pack<T, CB>* taps_o = ws + o * KK;         // w[o, c0 : c0+CB, :, :]
#pragma unroll 5
        for (int i = i0, ho = (hp - i0) / sh; i <= i1; i += sh, --ho) {
            const int row = ((n * O + o) * Ho + ho) * Wo;
            const Pack<T, CB>* wr = taps_o + i * kw;
#pragma unroll 5
            for (int j = j0, wo = (wp - j0) / sw; j <= j1; j += sw, --wo) {
                const T g = dy[row + wo];
                const Pack<T, CB> wv = wr[j];
#pragma unroll
                for (int cb = 0; cb < CB; ++cb) acc[cb] += g * wv.v[cb];
            }
        }
    }
#pragma unroll
    for (int cb = 0; cb < CB; ++cb) {
        if (c0 + cb < C) dx[(n * C + c0 + cb) * HW + r] = acc[cb];
    }
}

// dw[o, c, i, j] = sum_{n,ho,wo} dy[n, o, ho, wo] * x[n, c, ho*sh - ph + i, wo*sw - pw + j].
// grid (ceil(CK / TB), ceil(O / OB)): a block owns a tile of OB output channels x TB taps (tap
// and channel indices past the end are clamped to the last one, computed and not stored).
// Block (bx, by) with bx*by a multiple of 32: thread (tx, ty) sums the output pixels
// p = tx, tx + bx, ... and, inside, the samples n = ty, ty + by, ... (fixed order, a tap's
// bounds check once per p), then the block reduces each of the OB*TB sums in a fixed tree:
// a warp butterfly, then warp 0, 1, ... in order.
template <typename T, int OB, int TB>
__global__ void __launch_bounds__(256)
conv2d_direct_grad_weight_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                 T* __restrict__ dw, int N, int O, GEOMETRY_PARAMS) {
    await_previous_kernel();
    // blockIdx.z takes the samples [z * per_split, (z + 1) * per_split): with gridDim.z > 1
    // the block writes its partial sums to dw + z * O * CK, and the sum kernel below adds the
    // splits in order (a few hundred blocks cannot fill the GPU with one long sum each).
    const int per_split = (N + gridDim.z - 1) / gridDim.z;
    const int n_begin = blockIdx.z * per_split, n_end = min(N, n_begin + per_split);
    __shared__ T partial[32][OB * TB];               // one row per warp
    const int KK = kh * kw, CK = C * KK, P = Ho * Wo, HW = H * W;
    const int t0 = blockIdx.x * TB, o0 = blockIdx.y * OB;
    int tap_h[TB], tap_w[TB], tap_off[TB];           // i - ph, j - pw, x offset of (c, i-ph, j-pw)
#pragma unroll
    for (int t = 0; t < TB; ++t) {
        const int ck = min(t0 + t, CK - 1);
        const int c = ck / KK, k = ck % KK;
        tap_h[t] = k / kw - ph;
        tap_w[t] = k % kw - pw;
        tap_off[t] = c * HW + tap_h[t] * W + tap_w[t];
    }
    int o_off[OB];
#pragma unroll
    for (int ob = 0; ob < OB; ++ob) o_off[ob] = min(o0 + ob, O - 1) * P;
    T acc[OB][TB];
#pragma unroll
    for (int ob = 0; ob < OB; ++ob) {
#pragma unroll
        for (int t = 0; t < TB; ++t) acc[ob][t] = T(0);
    }

    for (int p = threadIdx.x; p < P; p += blockDim.x) {
        const int hs = (p / Wo) * sh, ws = (p % Wo) * sw;
        bool inside[TB];
        int x_at[TB];
#pragma unroll
        for (int t = 0; t < TB; ++t) {
            inside[t] = (unsigned)(hs + tap_h[t]) < (unsigned)H &&
                        (unsigned)(ws + tap_w[t]) < (unsigned)W;
            x_at[t] = tap_off[t] + hs * W + ws;
        }
        for (int n = n_begin + threadIdx.y; n < n_end; n += blockDim.y) {
            const int dy_n = n * O * P + p, x_n = n * C * HW;
            T g[OB];
#pragma unroll
            for (int ob = 0; ob < OB; ++ob) g[ob] = dy[dy_n + o_off[ob]];
#pragma unroll
            for (int t = 0; t < TB; ++t) {
                const T xv = inside[t] ? x[x_n + x_at[t]] : T(0);
#pragma unroll
                for (int ob = 0; ob < OB; ++ob) acc[ob][t] += g[ob] * xv;
            }
        }
    }

    const int tid = threadIdx.y * blockDim.x + threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
#pragma unroll
    for (int ob = 0; ob < OB; ++ob) {
#pragma unroll
        for (int t = 0; t < TB; ++t) {
            T v = acc[ob][t];
#pragma unroll
            for (int s = 16; s > 0; s >>= 1) v += __shfl_xor_sync(0xffffffffu, v, s);
            if (lane == 0) partial[warp][ob * TB + t] = v;
        }
    }
    __syncthreads();
    if (tid < OB * TB) {
        const int ob = tid / TB, t = tid % TB;
        const int warps = (blockDim.x * blockDim.y) >> 5;
        T sum = T(0);
        for (int k = 0; k < warps; ++k) sum += partial[k][tid];
        if (o0 + ob < O && t0 + t < CK)
            dw[(long long)blockIdx.z * O * CK + (o0 + ob) * CK + t0 + t] = sum;
    }
}

// dw[e] = sum over s of partial[s, e], s ascending: the splits of the kernel above.
template <typename T>
__global__ void conv2d_direct_grad_weight_sum_kernel(const T* __restrict__ partial,
                                                     T* __restrict__ dw, int elements,
                                                     int splits) {
    await_previous_kernel();
    const int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= elements) return;
    T sum = T(0);
    for (int s = 0; s < splits; ++s) sum += partial[(long long)s * elements + e];
    dw[e] = sum;
}
