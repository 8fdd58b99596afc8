// Optimizer kernels: the step counter, the LR schedule, and SGD / Adam / AdamW / RMSprop /
// Adagrad as ONE multi-tensor launch over every parameter. Nothing a step needs is a host
// scalar: lr, step, the clipping norm and every parameter's hyperparameters (a float64 row of
// the state `optimizer.hyperparameters`, ops/optim.py HYPER_COLUMNS) are read from device
// memory, so a captured graph stays valid when they change. Formulas, operation order and
// rounding follow the numpy reference (PyTorch's); __f*_rn keep the compiler from fusing a
// product and a sum into one FMA.
// A guarded step (ops/guard.py) moves the counter and applies the update only when it passes.
// precision="bf16": the update also writes each parameter's bf16 weight copy (attrs copies)
// from the freshly updated float32 value, in the same pass (UpdateEntry.copy). model.half():
// float16 parameters, gradients and state, each element widened, updated in float32 and
// rounded once on store, as the NumPy backend's float16 update. A float16 model's loss and its
// history are float16 (loss_kind: include/bf16.cuh STORAGE_*).
#include "bf16.cuh"

// step += 1 (int64 scalar state); one thread.
extern "C" __global__ void step_increment_kernel(long long* step) {
    if (blockIdx.x == 0 && threadIdx.x == 0) *step += 1;
}

// history_loss[t % R] = loss; history_step[t % R] = t: the step's loss stays on the device,
// readable for R steps, without a copy issued from the host (compile/history.py).
__device__ __forceinline__ void record(const void* loss, int loss_kind, long long t,
                                       void* history_loss, long long* history_step,
                                       long long length) {
    const long long slot = t % length;
    store_either_from_float(history_loss, loss_kind, slot,
                            load_either_as_float(loss, loss_kind, 0));   // exact: one dtype
    history_step[slot] = t;
}

extern "C" __global__ void record_loss_kernel(const void* loss, const long long* step,
                                              void* history_loss, long long* history_step,
                                              long long length, int loss_kind) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    record(loss, loss_kind, *step, history_loss, history_step, length);
}

// The lr at step t from the (6,) float32 vector [base_lr, warmup_steps, total_steps, min_lr,
// step_size, gamma] (optim/schedules.py schedule_lr), in float64.
__device__ __forceinline__ double scheduled_lr(double base, double min_lr, const float* schedule,
                                               long long t) {
    const double warmup = schedule[1], total = schedule[2];
    const double step_size = schedule[4], gamma = schedule[5];
    double r = base;
    if (warmup > 0.0 && (double)t <= warmup) {
        r = base * (double)t / warmup;
    } else if (total > 0.0) {
        const double span = total - warmup;
        const double e = fmin(fmax((double)t - 1.0 - warmup, 0.0), span);
        r = min_lr + (base - min_lr) * (1.0 + cos(3.141592653589793 * e / span)) / 2.0;
    } else if (step_size > 0.0) {
        // Python's (t - 1) // int(step_size): floor division (t = 0 gives -1).
        const long long s = (long long)step_size, a = t - 1;
        const long long k = a >= 0 ? a / s : -((-a + s - 1) / s);
        r = base * pow(gamma, (double)k);
    }
    return r;
}

// The factor of every group's lr at step t (schedules.py schedule_factor): scheduled lr /
// base_lr in float64, cast once; 1.0 exactly for the constant schedule. base_lr 0: the
// schedule's shape for base 1 and min_lr 0.
__device__ __forceinline__ float scheduled_factor(const float* schedule, long long t) {
    const double base = schedule[0];
    if (base == 0.0) return (float)scheduled_lr(1.0, 0.0, schedule, t);
    return (float)(scheduled_lr(base, schedule[3], schedule, t) / base);
}

extern "C" __global__ void lr_schedule_kernel(const long long* step, const float* schedule,
                                              float* lr) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    *lr = scheduled_factor(schedule, *step);
}

// step_increment, lr_schedule and record_loss in one thread: the bookkeeping of a step.
extern "C" __global__ void advance_step_kernel(long long* step, const float* schedule,
                                               const void* loss, void* history_loss,
                                               long long* history_step, long long length,
                                               float* lr, int loss_kind) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const long long t = *step + 1;
    *step = t;
    *lr = scheduled_factor(schedule, t);
    record(loss, loss_kind, t, history_loss, history_step, length);
}

// A guarded step's bookkeeping (ops/guard.py, guard_advance): flags = [bits found by
// guard_check, skip], counters = [calls, skipped, first bad call, its bits]. The step counter
// moves only on a step that passes; with sticky ("raise"), every step after a bad one is
// skipped until the host has reported it (and cleared counters[2]). The first bad call's
// number is also posted to `mailbox` (mapped host memory, may be null) so the host sees it
// without a sync; nothing is posted on a good step.
extern "C" __global__ void guard_advance_kernel(int* flags, long long* counters, long long* step,
                                                const float* schedule, const void* loss,
                                                void* history_loss, long long* history_step,
                                                int* history_flag, long long length, int sticky,
                                                float* lr, long long* mailbox, int loss_kind) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const int bits = flags[0];
    flags[0] = 0;
    const long long calls = counters[0] + 1;
    counters[0] = calls;
    if (bits != 0 && counters[2] == 0) {
        counters[3] = bits;
        counters[2] = calls;
        if (mailbox) *(volatile long long*)mailbox = calls;
    }
    const int skip = bits != 0 || (sticky && counters[2] != 0);
    flags[1] = skip;
    long long t = *step;
    if (skip) {
        counters[1] += 1;
    } else {
        t += 1;
        *step = t;
    }
    *lr = scheduled_factor(schedule, t);
    record(loss, loss_kind, calls, history_loss, history_step, length);
    history_flag[calls % length] = bits | (skip && bits == 0 ? 8 : 0);  // 8: GUARD_HELD
}

// One row of the device table built once per update node by optim.py: the tensors of one
// parameter (slots unused by the optimizer are null), whether all of them are 16-byte aligned
// (float4 path), and `row`: the parameter's row of the hyperparameters (ops/optim.py
// hyper_rows), read at every launch, so that a write from the host between steps takes effect
// without a new table or capture. `kinds` holds storage codes (bf16.cuh STORAGE_*): bits 0-7
// the gradient's, float32 or bf16 bits (precision="bf16", where the update reads the bf16
// gradient of the weight's copy and widens it itself, exactly as the dropped cast would
// have: compile/fuse.py fuse_gradient_casts) or float16; bits 8-15 the parameter's and its
// state's, float32 or float16 (model.half()).
struct UpdateEntry {
    void* p;
    const void* g;
    void* s0;  // SGD momentum buffer / Adam exp_avg / RMSprop square_avg / Adagrad sum
    void* s1;  // Adam exp_avg_sq / RMSprop grad_avg
    void* s2;  // Adam max_exp_avg_sq / RMSprop momentum_buffer
    unsigned short* copy;  // bf16 weight copy of p, same element order (null: none)
    long long n;
    long long aligned;
    long long kinds;
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
    const bool u0 = slots & 1, u1 = slots & 2, u2 = slots & 4;
    const int gk = (int)(e.kinds & 0xff), pk = (int)((e.kinds >> 8) & 0xff);
    for (long long i = start + 4 * (long long)threadIdx.x; i < end; i += 4LL * blockDim.x) {
        if (e.aligned && i + 4 <= end) {
            float p[4], g[4], a[4] = {0.f, 0.f, 0.f, 0.f}, b[4] = {0.f, 0.f, 0.f, 0.f},
                                 c[4] = {0.f, 0.f, 0.f, 0.f};
            load4_either_as_float(e.p, pk, i, p);
            load4_either_as_float(e.g, gk, i, g);
            if (u0) load4_either_as_float(e.s0, pk, i, a);
            if (u1) load4_either_as_float(e.s1, pk, i, b);
            if (u2) load4_either_as_float(e.s2, pk, i, c);
            for (int k = 0; k < 4; ++k) element(p[k], g[k], a[k], b[k], c[k]);
            store4_either_from_float(e.p, pk, i, p);
            if (e.copy) store4_from_float(e.copy, i, p);
            if (u0) store4_either_from_float(e.s0, pk, i, a);
            if (u1) store4_either_from_float(e.s1, pk, i, b);
            if (u2) store4_either_from_float(e.s2, pk, i, c);
        } else {
            for (long long j = i; j < i + 4 && j < end; ++j) {
                float p = load_either_as_float(e.p, pk, j);
                float a = u0 ? load_either_as_float(e.s0, pk, j) : 0.f;
                float b = u1 ? load_either_as_float(e.s1, pk, j) : 0.f;
                float c = u2 ? load_either_as_float(e.s2, pk, j) : 0.f;
                element(p, load_either_as_float(e.g, gk, j), a, b, c);
                store_either_from_float(e.p, pk, j, p);
                if (e.copy) store_from_float(e.copy, j, p);
                if (u0) store_either_from_float(e.s0, pk, j, a);
                if (u1) store_either_from_float(e.s1, pk, j, b);
                if (u2) store_either_from_float(e.s2, pk, j, c);
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

// hyper row: lr, weight_decay, momentum, dampening. has_buffer: the step has momentum buffers;
// a row with momentum 0 then updates as plain SGD and leaves its buffer untouched.
extern "C" __global__ void sgd_update_kernel(const UpdateEntry* entries, const int2* blocks,
                                             int chunk, const float* lr, const long long* step,
                                             const double* hyper, int width, const float* norm,
                                             int clip, double max_norm, const int* guard,
                                             int has_buffer, int nesterov, int maximize) {
    __shared__ SgdScalars s;
    if (threadIdx.x == 0) {
        const double* h = block_hyper(entries, blocks, hyper, width);
        s.skip = skipped(guard);
        s.lr = (float)((double)*lr * h[0]);  // lr factor 1: the group's lr exactly
        s.coef = clip_coef(clip, norm, max_norm);
        s.first = *step == 1;  // PyTorch's momentum buffer starts as the first gradient
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
    update_chunk(entries, blocks, chunk, s.has_momentum ? 1 : 0,
                 [&](float& p, float g, float& buf, float&, float&) {
                     sgd_element(p, g, buf, s);
                 });
}

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

// hyper row: lr, weight_decay, beta1, beta2, eps.
extern "C" __global__ void adam_update_kernel(const UpdateEntry* entries, const int2* blocks,
                                              int chunk, const float* lr, const long long* step,
                                              const double* hyper, int width, const float* norm,
                                              int clip, double max_norm, const int* guard,
                                              int decoupled, int amsgrad, int maximize) {
    __shared__ AdamScalars s;
    if (threadIdx.x == 0) {
        // Bias corrections and the decoupled decay in float64 (Python floats in PyTorch).
        const double* h = block_hyper(entries, blocks, hyper, width);
        const double weight_decay = h[1], beta1 = h[2], beta2 = h[3];
        s.skip = skipped(guard);
        const double lr_d = (double)*lr * h[0], t = (double)*step;
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
    update_chunk(entries, blocks, chunk, s.amsgrad ? 7 : 3,
                 [&](float& p, float g, float& m, float& v, float& vmax) {
                     adam_element(p, g, m, v, vmax, s);
                 });
}

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
extern "C" __global__ void rmsprop_update_kernel(const UpdateEntry* entries, const int2* blocks,
                                                 int chunk, const float* lr,
                                                 const long long* step, const double* hyper,
                                                 int width, const float* norm, int clip,
                                                 double max_norm, const int* guard,
                                                 int centered, int has_buffer, int maximize) {
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
    update_chunk(entries, blocks, chunk, 1 | (s.centered ? 2 : 0) | (s.has_momentum ? 4 : 0),
                 [&](float& p, float g, float& sq, float& ga, float& buf) {
                     rmsprop_element(p, g, sq, ga, buf, s);
                 });
}

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

// hyper row: lr, weight_decay, lr_decay, eps.
extern "C" __global__ void adagrad_update_kernel(const UpdateEntry* entries, const int2* blocks,
                                                 int chunk, const float* lr,
                                                 const long long* step, const double* hyper,
                                                 int width, const float* norm, int clip,
                                                 double max_norm, const int* guard,
                                                 int maximize) {
    __shared__ AdagradScalars s;
    if (threadIdx.x == 0) {
        const double* h = block_hyper(entries, blocks, hyper, width);
        s.skip = skipped(guard);
        const double lr_d = (double)*lr * h[0], t = (double)*step;
        s.clr = (float)(lr_d / (1.0 + (t - 1.0) * h[2]));
        s.coef = clip_coef(clip, norm, max_norm);
        s.weight_decay = (float)h[1];
        s.has_weight_decay = h[1] != 0.0;
        s.eps = (float)h[3];
        s.maximize = maximize;
    }
    __syncthreads();
    if (s.skip) return;
    update_chunk(entries, blocks, chunk, 1,
                 [&](float& p, float g, float& sum, float&, float&) {
                     adagrad_element(p, g, sum, s);
                 });
}

// A bf16 weight copy whose element order differs from its parameter's (attrs copy_dims: a conv
// weight's channels-last copy): copy = bf16(p.transpose(dims)) in that transpose's row-major
// order, launched right after the update kernel (a gather by index: awkward inside the
// chunked, vectorised update loop). Dims of the transposed shape (?, o1, o2, o3), padded in
// front with size 1; s0..s3 their strides in p (elements). A skipped (guarded) step writes
// nothing, as the update.
extern "C" __global__ void weight_copy_permute_kernel(const float* p, unsigned short* copy,
                                                      long long n, int o1, int o2, int o3,
                                                      long long s0, long long s1, long long s2,
                                                      long long s3, const int* guard) {
    if (skipped(guard)) return;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        long long q = i;
        const long long i3 = q % o3;
        q /= o3;
        const long long i2 = q % o2;
        q /= o2;
        const long long i1 = q % o1;
        const long long i0 = q / o1;
        copy[i] = bf16_from_float(p[i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3]);
    }
}
