// torch.optim.RMSprop as ONE multi-tensor launch over every parameter (optim.py). Nothing a step
// needs is a host scalar: lr, step, the clipping norm and every parameter's hyperparameters (a
// float64 row of the state `optimizer.hyperparameters`, ops/optim.py HYPER_COLUMNS) are read from
// device memory, so a captured graph stays valid when they change. A guarded step's update writes
// nothing when guard_advance skipped it. The update also writes each parameter's weight copy (attrs
// copies: bf16 with precision="bf16", a channels-last step's transposed float32 conv weight) from
// the freshly updated float32 value, in the same pass (UpdateEntry.copy).
#include "launch_order.cuh"
#include "update.cuh"

struct RmspropScalars {
    float lr, coef, weight_decay, alpha, one_minus_alpha, eps, momentum;
    int has_weight_decay, centered, has_momentum, maximize, skip;
};

// torch.optim.RMSprop: sq = alpha sq + (1 - alpha) d^2; centered: ga = lerp(ga, d, 1 - alpha),
// avg = sqrt(sq - ga^2) + eps, else avg = sqrt(sq) + eps; momentum > 0: buf = momentum buf +
// d / avg, p -= lr buf; else p -= lr d / avg.
__device__ __forceinline__ void rmsprop_element(float& p, float g, float& sq, float& ga,
                                                float& buf, const RmspropScalars& s) {
    const float d = direction(g, p, s.coef, s.maximize, s.has_weight_decay, s.weight_decay);
    sq = __fadd_rn(__fmul_rn(sq, s.alpha), __fmul_rn(__fmul_rn(s.one_minus_alpha, d), d));
    float avg;
    if (s.centered) {
        ga = __fadd_rn(ga, __fmul_rn(__fsub_rn(d, ga), s.one_minus_alpha));
        avg = __fsqrt_rn(__fsub_rn(sq, __fmul_rn(ga, ga)));
    } else {
        avg = __fsqrt_rn(sq);
    }
    avg = __fadd_rn(avg, s.eps);
    if (s.has_momentum) {
        buf = __fadd_rn(__fmul_rn(buf, s.momentum), __fdiv_rn(d, avg));
        p = __fsub_rn(p, __fmul_rn(s.lr, buf));
    } else {
        p = __fsub_rn(p, __fmul_rn(s.lr, __fdiv_rn(d, avg)));
    }
}

// hyper row: lr, weight_decay, alpha, eps, momentum. Table slots: s0 square_avg, s1 grad_avg
// (centered), s2 momentum_buffer (has_buffer: the step was built with momentum).
template <bool SLICED>
__global__ void rmsprop_update_kernel(const UpdateEntry* entries, const int2* blocks,
                                      int chunk, const float* lr,
                                      const long long* step, const double* hyper,
                                      int width, const float* norm, int clip,
                                      double max_norm, const int* guard,
                                      int centered, int has_buffer, int maximize) {
    await_previous_kernel();
    __shared__ RmspropScalars s;
    if (threadIdx.x == 0) {
        const double* h = block_hyper(entries, blocks, hyper, width);
        s.skip = skipped(guard);
        s.lr = (float)((double)*lr * h[0]);
        s.coef = clip_coef(clip, norm, max_norm);
        s.weight_decay = (float)h[1];
        s.has_weight_decay = h[1] != 0.0;
        s.alpha = (float)h[2];
        s.one_minus_alpha = (float)(1.0 - h[2]);
        s.eps = (float)h[3];
        s.momentum = (float)h[4];
        s.has_momentum = has_buffer && h[4] > 0.0;
        s.centered = centered;
        s.maximize = maximize;
    }
    __syncthreads();
    if (s.skip) return;
    update_chunk<SLICED>(entries, blocks, chunk,
                         1 | (s.centered ? 2 : 0) | (s.has_momentum ? 4 : 0),
                         [&](float& p, float g, float& sq, float& ga, float& buf) {
                             rmsprop_element(p, g, sq, ga, buf, s);
                         });
}
