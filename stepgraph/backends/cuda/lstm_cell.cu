// LSTM cell family (ops/lstm_cell.py): one time step's gates after its two products, and its
// gradient. Gate pre-activations are (B, 4H) rows of the blocks i, f, g, o (torch's order);
// one thread per (b, j), j < H, reads column j of each block, in float32 throughout (expf,
// tanhf: the accurate functions, not the __ intrinsics). Grid-stride loops over B * H.

#include "launch_order.cuh"
__device__ __forceinline__ float lstm_sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

// pre = xg [+ hg]; gates = (sigmoid(i), sigmoid(f), tanh(g), sigmoid(o));
// c_out = f * c + i * g; h_out = o * tanh(c_out). hg may be null (one addend).
extern "C" __global__ void lstm_cell_forward_kernel(const float* xg, const float* hg,
                                                    const float* c, float* h_out,
                                                    float* c_out, float* gates, int batch,
                                                    int hidden) {
    await_previous_kernel();
    const long long n = (long long)batch * hidden;
    for (long long k = blockIdx.x * (long long)blockDim.x + threadIdx.x; k < n;
         k += (long long)gridDim.x * blockDim.x) {
        const long long b = k / hidden, j = k - b * hidden;
        const long long row = b * 4 * hidden + j;     // column j of block i in row b
        float pre[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            pre[q] = xg[row + q * hidden];
            if (hg) pre[q] += hg[row + q * hidden];
        }
        const float i = lstm_sigmoid(pre[0]), f = lstm_sigmoid(pre[1]);
        const float g = tanhf(pre[2]), o = lstm_sigmoid(pre[3]);
        const float c_new = f * c[k] + i * g;
        c_out[k] = c_new;
        h_out[k] = o * tanhf(c_new);
        gates[row] = i;
        gates[row + hidden] = f;
        gates[row + 2 * hidden] = g;
        gates[row + 3 * hidden] = o;
    }
}

// dh = dh1 + dh2 (each may be null: zero); tc = tanh(c_new); dcc = dc + dh * o * (1 - tc^2)
// (dc null: zero);
// dpre = (dcc * g * i(1 - i), dcc * c * f(1 - f), dcc * i * (1 - g^2), dh * tc * o(1 - o));
// dc_prev = dcc * f.
extern "C" __global__ void lstm_cell_backward_kernel(const float* dh1, const float* dh2,
                                                     const float* dc,
                                                     const float* gates, const float* c,
                                                     const float* c_new, float* dpre,
                                                     float* dc_prev, int batch, int hidden) {
    await_previous_kernel();
    const long long n = (long long)batch * hidden;
    for (long long k = blockIdx.x * (long long)blockDim.x + threadIdx.x; k < n;
         k += (long long)gridDim.x * blockDim.x) {
        const long long b = k / hidden, j = k - b * hidden;
        const long long row = b * 4 * hidden + j;
        const float i = gates[row], f = gates[row + hidden];
        const float g = gates[row + 2 * hidden], o = gates[row + 3 * hidden];
        const float tc = tanhf(c_new[k]);
        const float dhk = (dh1 ? dh1[k] : 0.f) + (dh2 ? dh2[k] : 0.f);
        const float dcc = (dc ? dc[k] : 0.f) + dhk * o * (1.f - tc * tc);
        dpre[row] = dcc * g * i * (1.f - i);
        dpre[row + hidden] = dcc * c[k] * f * (1.f - f);
        dpre[row + 2 * hidden] = dcc * i * (1.f - g * g);
        dpre[row + 3 * hidden] = dhk * tc * o * (1.f - o);
        dc_prev[k] = dcc * f;
    }
}
