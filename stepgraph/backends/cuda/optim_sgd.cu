// torch.optim.SGD as ONE multi-tensor launch over every parameter (optim.py). Nothing a step needs
// is a host scalar: lr, step, the clipping norm and every parameter's hyperparameters (a float64
// row of the state `optimizer.hyperparameters`, ops/optim.py HYPER_COLUMNS) are read from device
// memory, so a captured graph stays valid when they change. A guarded step's update writes nothing
// when guard_advance skipped it. The update also writes each parameter's weight copy (attrs copies:
// bf16 with precision="bf16", a channels-last step's transposed float32 conv weight) from the
// freshly updated float32 value, in the same pass (UpdateEntry.copy).
#include "launch_order.cuh"
#include "update.cuh"

struct SgdScalars {
    float lr, coef, momentum, one_minus_dampening, weight_decay;
    int first, has_momentum, has_weight_decay, nesterov, maximize, skip;
};

// torch.optim.SGD: d = direction(g); buf = d at step 1 else momentum * buf +
// (1 - dampening) * d; d = d + momentum * buf (nesterov) or buf; p -= lr * d.
__device__ __forceinline__ void sgd_element(float& p, float g, float& buf, const SgdScalars& s) {
    float d = direction(g, p, s.coef, s.maximize, s.has_weight_decay, s.weight_decay);
    if (s.has_momentum) {
        buf = s.first ? d
                      : __fadd_rn(__fmul_rn(buf, s.momentum), __fmul_rn(s.one_minus_dampening, d));
        d = s.nesterov ? __fadd_rn(d, __fmul_rn(s.momentum, buf)) : buf;
    }
    p = __fsub_rn(p, __fmul_rn(s.lr, d));
}

// hyper row: lr, weight_decay, momentum, dampening, step_offset. has_buffer: the step has momentum buffers;
// a row with momentum 0 then updates as plain SGD and leaves its buffer untouched.
template <bool SLICED>
__global__ void sgd_update_kernel(const UpdateEntry* entries, const int2* blocks,
                                  int chunk, const float* lr, const long long* step,
                                  const double* hyper, int width, const float* norm,
                                  int clip, double max_norm, const int* guard,
                                  int has_buffer, int nesterov, int maximize) {
    await_previous_kernel();
    __shared__ SgdScalars s;
    if (threadIdx.x == 0) {
        const double* h = block_hyper(entries, blocks, hyper, width);
        s.skip = skipped(guard);
        s.lr = (float)((double)*lr * h[0]);  // lr factor 1: the group's lr exactly
        s.coef = clip_coef(clip, norm, max_norm);
        // PyTorch's momentum buffer starts as the first gradient (the parameter's own first
        // step: the counter less its step_offset, h[4])
        s.first = (double)*step - h[4] == 1.0;
        s.momentum = (float)h[2];
        s.one_minus_dampening = (float)(1.0 - h[3]);
        s.weight_decay = (float)h[1];
        s.has_momentum = has_buffer && h[2] != 0.0;
        s.has_weight_decay = h[1] != 0.0;
        s.nesterov = nesterov;
        s.maximize = maximize;
    }
    __syncthreads();
    if (s.skip) return;
    update_chunk<SLICED>(entries, blocks, chunk, s.has_momentum ? 1 : 0,
                         [&](float& p, float g, float& buf, float&, float&) {
                             sgd_element(p, g, buf, s);
                         });
}
