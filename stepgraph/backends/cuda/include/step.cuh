// The step bookkeeping's device functions: the loss history and the LR schedule, shared by
// optim.cu (step_increment, lr_schedule, record_loss, advance_step) and guard.cu
// (guard_advance, a guarded step's bookkeeping).
#pragma once
#include "bf16.cuh"

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
