// torch.optim.Adam / AdamW as ONE multi-tensor launch over every parameter (optim.py). Nothing a
// step needs is a host scalar: lr, step, the clipping norm and every parameter's hyperparameters (a
// float64 row of the state `optimizer.hyperparameters`, ops/optim.py HYPER_COLUMNS) are read from
// device memory, so a captured graph stays valid when they change. A guarded step's update writes
// nothing when guard_advance skipped it. The update also writes each parameter's weight copy (attrs
// copies: bf16 with precision="bf16", a channels-last step's transposed float32 conv weight) from
// the freshly updated float32 value, in the same pass (UpdateEntry.copy).
#include "launch_order.cuh"
#include "update.cuh"

struct AdamScalars {
    float coef, decay, weight_decay, one_minus_beta1, beta2, one_minus_beta2, eps;
    float step_size, bias2_sqrt;
    int has_weight_decay, decoupled, amsgrad, maximize, skip;
};

// torch.optim.Adam / AdamW: m = lerp(m, d, 1 - b1); v = b2 v + (1 - b2) d^2; amsgrad:
// vmax = max(vmax, v), read in place of v; p -= lr / (1 - b1^t) * m / (sqrt(v) /
// sqrt(1 - b2^t) + eps). Adam adds wd * p to d; AdamW first scales p by (1 - lr * wd).
__device__ __forceinline__ void adam_element(float& p, float g, float& m, float& v, float& vmax,
                                             const AdamScalars& s) {
    const int coupled = s.has_weight_decay && !s.decoupled;
    const float d = direction(g, p, s.coef, s.maximize, coupled, s.weight_decay);
    if (s.has_weight_decay && s.decoupled) p = __fmul_rn(p, s.decay);
    m = __fadd_rn(m, __fmul_rn(__fsub_rn(d, m), s.one_minus_beta1));
    v = __fmul_rn(v, s.beta2);
    v = __fadd_rn(v, __fmul_rn(__fmul_rn(s.one_minus_beta2, d), d));
    float second = v;
    if (s.amsgrad) {
        vmax = fmaxf(vmax, v);
        second = vmax;
    }
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(second), s.bias2_sqrt), s.eps);
    p = __fsub_rn(p, __fmul_rn(s.step_size, __fdiv_rn(m, denom)));
}

// hyper row: lr, weight_decay, beta1, beta2, eps, step_offset.
template <bool SLICED>
__global__ void adam_update_kernel(const UpdateEntry* entries, const int2* blocks,
                                   int chunk, const float* lr, const long long* step,
                                   const double* hyper, int width, const float* norm,
                                   int clip, double max_norm, const int* guard,
                                   int decoupled, int amsgrad, int maximize) {
    await_previous_kernel();
    __shared__ AdamScalars s;
    if (threadIdx.x == 0) {
        // Bias corrections and the decoupled decay in float64 (Python floats in PyTorch).
        const double* h = block_hyper(entries, blocks, hyper, width);
        const double weight_decay = h[1], beta1 = h[2], beta2 = h[3];
        s.skip = skipped(guard);
        // t: the parameter's own step count (the counter less its step_offset, h[5])
        const double lr_d = (double)*lr * h[0], t = (double)*step - h[5];
        s.coef = clip_coef(clip, norm, max_norm);
        s.step_size = (float)(lr_d / (1.0 - pow(beta1, t)));
        s.bias2_sqrt = (float)sqrt(1.0 - pow(beta2, t));
        s.decay = (float)(1.0 - lr_d * weight_decay);
        s.weight_decay = (float)weight_decay;
        s.one_minus_beta1 = (float)(1.0 - beta1);
        s.beta2 = (float)beta2;
        s.one_minus_beta2 = (float)(1.0 - beta2);
        s.eps = (float)h[4];
        s.has_weight_decay = weight_decay != 0.0;
        s.decoupled = decoupled;
        s.amsgrad = amsgrad;
        s.maximize = maximize;
    }
    __syncthreads();
    if (s.skip) return;
    update_chunk<SLICED>(entries, blocks, chunk, s.amsgrad ? 7 : 3,
                         [&](float& p, float g, float& m, float& v, float& vmax) {
                             adam_element(p, g, m, v, vmax, s);
                         });
}
