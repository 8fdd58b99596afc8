// What every multi-tensor optimizer update shares (optim_sgd.cu, optim_adam.cu,
// optim_rmsprop.cu, optim_adagrad.cu; optim.cu's weight copies): the device table row of a
// parameter, the chunked loop over every parameter, the guard's skip, gradient clipping and
// the update direction. Formulas, operation order and rounding follow the numpy reference
// (PyTorch's); __f*_rn keep the compiler from fusing a product and a sum into one FMA.
#pragma once
#include "bf16.cuh"

// One row of the device table built once per update node by optim.py: the tensors of one
// parameter (slots unused by the optimizer are null), whether all of them are 16-byte aligned
// (float4 path), and `row`: the parameter's row of the hyperparameters (ops/optim.py
// hyper_rows), read at every launch, so that a write from the host between steps takes effect
// without a new table or capture. The gradient is float32, or bf16 bits (grad_bf16:
// precision="bf16", where the update reads the bf16 gradient of the weight's copy and widens
// it itself, exactly as the dropped cast would have: compile/fuse.py fuse_gradient_casts).
struct UpdateEntry {
    float* p;
    const void* g;
    float* s0;  // SGD momentum buffer / Adam exp_avg / RMSprop square_avg / Adagrad sum
    float* s1;  // Adam exp_avg_sq / RMSprop grad_avg
    float* s2;  // Adam max_exp_avg_sq / RMSprop momentum_buffer
    unsigned short* copy;  // bf16 weight copy of p, same element order (null: none)
    long long n;
    long long aligned;
    long long grad_bf16;
    long long row;
};

// The table row of the parameter block blockIdx.x updates.
__device__ __forceinline__ const UpdateEntry& block_entry(const UpdateEntry* entries,
                                                          const int2* blocks) {
    return entries[blocks[blockIdx.x].x];
}

// The block's hyperparameter row (width float64 columns, ops/optim.py HYPER_COLUMNS).
__device__ __forceinline__ const double* block_hyper(const UpdateEntry* entries,
                                                     const int2* blocks, const double* hyper,
                                                     int width) {
    return hyper + block_entry(entries, blocks).row * (long long)width;
}

// The multi-tensor loop every optimizer shares. Block k updates chunk blocks[k] = (parameter,
// chunk index): elements [chunk * index, min(chunk * (index + 1), n)), four a thread (one
// float4 of each tensor where the parameter's tensors are aligned; chunk is a multiple of 4,
// so float4 groups never straddle a chunk). element(p, g, s0, s1, s2) updates one element in
// place; the state tensors whose bit is set in `slots` (1: s0, 2: s1, 4: s2) are read and
// written back, the others read as 0.
template <typename Element>
__device__ __forceinline__ void update_chunk(const UpdateEntry* entries, const int2* blocks,
                                             int chunk, int slots, Element element) {
    const int2 job = blocks[blockIdx.x];
    const UpdateEntry e = entries[job.x];
    const long long start = (long long)job.y * chunk, end = min(start + chunk, e.n);
    const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
    const bool u0 = slots & 1, u1 = slots & 2, u2 = slots & 4;
    for (long long i = start + 4 * (long long)threadIdx.x; i < end; i += 4LL * blockDim.x) {
        if (e.aligned && i + 4 <= end) {
            float4 p = *reinterpret_cast<float4*>(e.p + i);
            float w[4];
            load4_either_as_float(e.g, e.grad_bf16, i, w);
            const float4 g = make_float4(w[0], w[1], w[2], w[3]);
            float4 a = u0 ? *reinterpret_cast<float4*>(e.s0 + i) : zero;
            float4 b = u1 ? *reinterpret_cast<float4*>(e.s1 + i) : zero;
            float4 c = u2 ? *reinterpret_cast<float4*>(e.s2 + i) : zero;
            element(p.x, g.x, a.x, b.x, c.x);
            element(p.y, g.y, a.y, b.y, c.y);
            element(p.z, g.z, a.z, b.z, c.z);
            element(p.w, g.w, a.w, b.w, c.w);
            *reinterpret_cast<float4*>(e.p + i) = p;
            if (e.copy) {
                const float q[4] = {p.x, p.y, p.z, p.w};
                store4_from_float(e.copy, i, q);
            }
            if (u0) *reinterpret_cast<float4*>(e.s0 + i) = a;
            if (u1) *reinterpret_cast<float4*>(e.s1 + i) = b;
            if (u2) *reinterpret_cast<float4*>(e.s2 + i) = c;
        } else {
            for (long long j = i; j < i + 4 && j < end; ++j) {
                float a = u0 ? e.s0[j] : 0.f, b = u1 ? e.s1[j] : 0.f, c = u2 ? e.s2[j] : 0.f;
                element(e.p[j], load_either_as_float(e.g, e.grad_bf16, j), a, b, c);
                if (e.copy) store_from_float(e.copy, j, e.p[j]);
                if (u0) e.s0[j] = a;
                if (u1) e.s1[j] = b;
                if (u2) e.s2[j] = c;
            }
        }
    }
}

// A guarded update (guard: the step's guard flags, else null) writes nothing when guard_advance
// marked the step skipped (flags[1]): the whole block returns before touching a tensor.
__device__ __forceinline__ int skipped(const int* guard) {
    return guard != nullptr && guard[1] != 0;
}

// Gradient clipping coefficient min(1, max_norm / (norm + 1e-6)) in float64, as the reference.
__device__ __forceinline__ float clip_coef(int clip, const float* norm, double max_norm) {
    return clip ? (float)fmin(1.0, max_norm / ((double)*norm + 1e-6)) : 1.f;
}

// What every update steps along (ops/optim.py _direction): the gradient clipped, negated for
// maximize, plus weight_decay * p (PyTorch's order).
__device__ __forceinline__ float direction(float g, float p, float coef, int maximize,
                                           int has_weight_decay, float weight_decay) {
    float d = coef != 1.f ? __fmul_rn(g, coef) : g;
    if (maximize) d = -d;
    if (has_weight_decay) d = __fadd_rn(d, __fmul_rn(weight_decay, p));
    return d;
}
