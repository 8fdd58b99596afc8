// Optimizer bookkeeping kernels: the step counter, the LR schedule and the loss history, and
// the permuted bf16 weight copies. Nothing a step needs is a host scalar: lr, step and the
// schedule are read from device memory, so a captured graph stays valid when they change.
// The updates themselves (SGD / Adam / AdamW / RMSprop / Adagrad, each ONE multi-tensor
// launch over every parameter) are in optim_<name>.cu, a file each (NVRTC compiles a file's
// plain kernels together: a plan waits only for its own optimizer's), sharing update.cuh.
// A guarded step (ops/guard.py) moves the counter in guard_advance (guard.cu) instead.
// model.half(): float16 parameters, gradients and state (update.cuh), and a float16 loss and
// its history (loss_kind: include/bf16.cuh STORAGE_*).
#include "bf16.cuh"
#include "step.cuh"
#include "update.cuh"

// step += 1 (int64 scalar state); one thread.
extern "C" __global__ void step_increment_kernel(long long* step) {
    if (blockIdx.x == 0 && threadIdx.x == 0) *step += 1;
}

extern "C" __global__ void record_loss_kernel(const void* loss, const long long* step,
                                              void* history_loss, long long* history_step,
                                              long long length, int loss_kind) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    record(loss, loss_kind, *step, history_loss, history_step, length);
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

// The bf16 weight copies whose element order differs from their parameter's (attrs copy_dims:
// a conv weight's channels-last copy), every one in one launch right after the update kernel
// (a gather by index: awkward inside the chunked, vectorised update loop): copy =
// bf16(p.transpose(dims)) in that transpose's row-major order. entries: a row of
// PERMUTE_ENTRY_WIDTH per copy: p, copy, n, the dims o1..o3 of the transposed shape
// (?, o1, o2, o3), padded in front with size 1, and s0..s3 their strides in p (elements);
// jobs: (copy, chunk) pairs, a block each, `chunk` elements a block. A skipped (guarded) step
// writes nothing, as the update.
#define PERMUTE_ENTRY_WIDTH 10
extern "C" __global__ void weight_copies_permute_kernel(const long long* entries,
                                                        const int* jobs, int chunk,
                                                        const int* guard) {
    if (skipped(guard)) return;
    const long long* e = entries + jobs[2 * blockIdx.x] * PERMUTE_ENTRY_WIDTH;
    const float* p = (const float*)e[0];
    unsigned short* copy = (unsigned short*)e[1];
    // 32-bit index arithmetic (a weight has fewer than 2^31 elements, launcher-checked): the
    // 64-bit divisions made this gather several times slower than its memory traffic
    const unsigned int n = (unsigned int)e[2], o1 = (unsigned int)e[3], o2 = (unsigned int)e[4],
                       o3 = (unsigned int)e[5];
    const unsigned int s0 = (unsigned int)e[6], s1 = (unsigned int)e[7],
                       s2 = (unsigned int)e[8], s3 = (unsigned int)e[9];
    const unsigned int begin = (unsigned int)jobs[2 * blockIdx.x + 1] * (unsigned int)chunk;
    const unsigned int end = min(n, begin + (unsigned int)chunk);
    for (unsigned int i = begin + threadIdx.x; i < end; i += blockDim.x) {
        unsigned int q = i;
        const unsigned int i3 = q % o3;
        q /= o3;
        const unsigned int i2 = q % o2;
        q /= o2;
        const unsigned int i1 = q % o1;
        const unsigned int i0 = q / o1;
        copy[i] = bf16_from_float(p[i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3]);
    }
}
