// Optimizer bookkeeping kernels: the step counter, the LR schedule and the loss history, and
// the permuted bf16 weight copies. Nothing a step needs is a host scalar: lr, step and the
// schedule are read from device memory, so a captured graph stays valid when they change.
// The updates themselves (SGD / Adam / AdamW / RMSprop / Adagrad, each ONE multi-tensor
// launch over every parameter) are in optim_<name>.cu, a file each (NVRTC compiles a file's
// plain kernels together: a plan waits only for its own optimizer's), sharing update.cuh.
// A guarded step (ops/guard.py) moves the counter in guard_advance (guard.cu) instead.
// model.half(): float16 parameters, gradients and state (update.cuh), and a float16 loss and
// its history (loss_kind: include/bf16.cuh STORAGE_*).
#include "launch_order.cuh"
#include "bf16.cuh"
#include "permute.cuh"
#include "step.cuh"
#include "update.cuh"

// step += 1 (int64 scalar state); one thread.
extern "C" __global__ void step_increment_kernel(long long* step) {
    await_previous_kernel();
    if (blockIdx.x == 0 && threadIdx.x == 0) *step += 1;
}

extern "C" __global__ void record_loss_kernel(const void* loss, const long long* step,
                                              void* history_loss, long long* history_step,
                                              long long length, int loss_kind) {
    await_previous_kernel();
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    record(loss, loss_kind, *step, history_loss, history_step, length);
}

extern "C" __global__ void lr_schedule_kernel(const long long* step, const float* schedule,
                                              float* lr) {
    await_previous_kernel();
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    *lr = scheduled_factor(schedule, *step);
}

// step_increment, lr_schedule and record_loss in one thread: the bookkeeping of a step.
extern "C" __global__ void advance_step_kernel(long long* step, const float* schedule,
                                               const void* loss, void* history_loss,
                                               long long* history_step, long long length,
                                               float* lr, int loss_kind) {
    await_previous_kernel();
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const long long t = *step + 1;
    *step = t;
    *lr = scheduled_factor(schedule, t);
    record(loss, loss_kind, t, history_loss, history_step, length);
}

// The bf16 weight copies whose element order differs from their parameter's (attrs copy_dims:
// a conv weight's channels-last copy), every one in one launch right after the update kernel
// (a gather by index: awkward inside the chunked, vectorised update loop): copy =
// bf16(p.transpose(dims)) in that transpose's row-major order. entries: permute.cuh's rows
// (p, copy, ...); jobs: (copy, chunk) pairs, a block each, `chunk` elements a block. A skipped
// (guarded) step writes nothing, as the update.
extern "C" __global__ void weight_copies_permute_kernel(const long long* entries,
                                                        const int* jobs, int chunk,
                                                        const int* guard) {
    await_previous_kernel();
    if (skipped(guard)) return;
    const PermuteEntry e = permute_entry(entries + jobs[2 * blockIdx.x] * PERMUTE_ENTRY_WIDTH);
    const float* p = (const float*)e.source;
    unsigned short* copy = (unsigned short*)e.destination;
    permute_chunk(e, (unsigned int)jobs[2 * blockIdx.x + 1] * (unsigned int)chunk,
                  (unsigned int)chunk,
                  [&](unsigned int i, unsigned int at) { copy[i] = bf16_from_float(p[at]); });
}
