// torch.optim.Adagrad as ONE multi-tensor launch over every parameter (optim.py). Nothing a step
// needs is a host scalar: lr, step, the clipping norm and every parameter's hyperparameters (a
// float64 row of the state `optimizer.hyperparameters`, ops/optim.py HYPER_COLUMNS) are read from
// device memory, so a captured graph stays valid when they change. A guarded step's update writes
// nothing when guard_advance skipped it. The update also writes each parameter's weight copy (attrs
// copies: bf16 with precision="bf16", a channels-last step's transposed float32 conv weight) from
// the freshly updated float32 value, in the same pass (UpdateEntry.copy).
#include "launch_order.cuh"
#include "update.cuh"

struct AdagradScalars {
    float clr, coef, weight_decay, eps;
    int has_weight_decay, maximize, skip;
};

// torch.optim.Adagrad: sum += d^2; p -= clr * d / (sqrt(sum) + eps), clr = lr / (1 + (t - 1)
// lr_decay) in float64.
__device__ __forceinline__ void adagrad_element(float& p, float g, float& sum,
                                                const AdagradScalars& s) {
    const float d = direction(g, p, s.coef, s.maximize, s.has_weight_decay, s.weight_decay);
    sum = __fadd_rn(sum, __fmul_rn(d, d));
    const float std = __fadd_rn(__fsqrt_rn(sum), s.eps);
    p = __fsub_rn(p, __fmul_rn(s.clr, __fdiv_rn(d, std)));
}

// hyper row: lr, weight_decay, lr_decay, eps, step_offset.
template <bool SLICED>
__global__ void adagrad_update_kernel(const UpdateEntry* entries, const int2* blocks,
                                      int chunk, const float* lr,
                                      const long long* step, const double* hyper,
                                      int width, const float* norm, int clip,
                                      double max_norm, const int* guard,
                                      int maximize) {
    await_previous_kernel();
    __shared__ AdagradScalars s;
    if (threadIdx.x == 0) {
        const double* h = block_hyper(entries, blocks, hyper, width);
        s.skip = skipped(guard);
        const double lr_d = (double)*lr * h[0], t = (double)*step - h[4];   // own step
        s.clr = (float)(lr_d / (1.0 + (t - 1.0) * h[2]));
        s.coef = clip_coef(clip, norm, max_norm);
        s.weight_decay = (float)h[1];
        s.has_weight_decay = h[1] != 0.0;
        s.eps = (float)h[3];
        s.maximize = maximize;
    }
    __syncthreads();
    if (s.skip) return;
    update_chunk<SLICED>(entries, blocks, chunk, 1,
                         [&](float& p, float g, float& sum, float&, float&) {
                             adagrad_element(p, g, sum, s);
                         });
}
