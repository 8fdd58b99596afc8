// Guard kernels (ops/guard.py): one multi-tensor pass that flags a step whose labels lie
// outside [0, classes) or whose loss or gradients hold a NaN or Inf (gradients: or a value
// whose square overflows, which Adam's exp_avg_sq would keep as Inf). It only reads, and
// writes the step's guard flags with an atomicOr from the blocks that found something, so a
// good step costs one read of every gradient and no write. guard_advance then
// decides (the bookkeeping of a guarded step), and the update kernels skip a flagged step.

#include "launch_order.cuh"
#include "bf16.cuh"
#include "step.cuh"

#define KIND_FLOAT32 0
#define KIND_INT32 1
#define KIND_INT64 2
#define KIND_BF16 3   // raw bits: a bf16 gradient the update widens itself (fuse_gradient_casts)
#define KIND_FP16 4   // float16 bits: a model.half() gradient or loss

// One row of the device table built once per guard_check node by guards.py (32 bytes):
// a tensor, what it holds, the flag bit it sets, whether it is 16-byte aligned, and whether
// its squares are checked (gradients) rather than its values (the loss).
struct GuardEntry {
    const void* p;
    long long n;
    int kind;
    int bit;
    int aligned;
    int square;
};

// v * v is not finite for NaN, Inf and |v| > sqrt(FLT_MAX) alike.
__device__ __forceinline__ bool not_finite(const float v, const int square) {
    return !isfinite(square ? v * v : v);
}

__device__ __forceinline__ bool not_finite4(const float4 v, const int square) {
    return not_finite(v.x, square) || not_finite(v.y, square) || not_finite(v.z, square) ||
           not_finite(v.w, square);
}

// A label outside [0, classes) that is not the loss's ignore_index (when it has one).
template <typename L>
__device__ __forceinline__ bool bad_labels(const L* labels, long long start, long long end,
                                           long long classes, long long ignore_index,
                                           int has_ignore) {
    bool bad = false;
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) {
        const long long label = (long long)labels[i];
        bad |= (label < 0 || label >= classes) && !(has_ignore && label == ignore_index);
    }
    return bad;
}

// 16 bytes of a float tensor, 16-byte aligned: four float32 or eight 16-bit values (bits
// widened exactly, so Inf and NaN stay).
__device__ __forceinline__ bool not_finite16(const void* p, int storage, long long i,
                                             int square) {
    if (storage == STORAGE_F32)
        return not_finite4(*reinterpret_cast<const float4*>(static_cast<const float*>(p) + i),
                           square);
    const uint4 raw = *reinterpret_cast<const uint4*>(static_cast<const unsigned short*>(p) + i);
    const unsigned int words[4] = {raw.x, raw.y, raw.z, raw.w};
    bool bad = false;
    for (int k = 0; k < 8; ++k) {
        const unsigned short bits = (unsigned short)(words[k / 2] >> (16 * (k % 2)));
        bad |= not_finite(storage == STORAGE_BF16 ? bf16_to_float(bits)
                                                  : fp16_to_float(fp16_bits{bits}),
                          square);
    }
    return bad;
}

// Block k checks chunk blocks[k] = (tensor, chunk index) of the table: elements
// [chunk * index, min(chunk * (index + 1), n)), float tensors 16 bytes a thread at a time
// where aligned (chunk is a multiple of 8). Chunks of several loads a thread: a block of one
// load a thread spent as long starting as reading (guards.py GUARD_CHUNK).
extern "C" __global__ void guard_check_kernel(const GuardEntry* entries, const int2* blocks,
                                              int chunk, long long classes,
                                              long long ignore_index, int has_ignore,
                                              int* flags) {
    await_previous_kernel();
    const int2 job = blocks[blockIdx.x];
    const GuardEntry e = entries[job.x];
    const long long start = (long long)job.y * chunk, end = min(start + chunk, e.n);
    bool bad = false;
    if (e.kind == KIND_FLOAT32 || e.kind == KIND_BF16 || e.kind == KIND_FP16) {
        const int storage = e.kind == KIND_BF16   ? STORAGE_BF16
                            : e.kind == KIND_FP16 ? STORAGE_FP16
                                                  : STORAGE_F32;
        const int width = storage == STORAGE_F32 ? 4 : 8;   // elements in 16 bytes
        for (long long i = start + width * (long long)threadIdx.x; i < end;
             i += (long long)width * blockDim.x) {
            if (e.aligned && i + width <= end) {
                bad |= not_finite16(e.p, storage, i, e.square);
            } else {
                for (long long j = i; j < i + width && j < end; ++j)
                    bad |= not_finite(load_either_as_float(e.p, storage, j), e.square);
            }
        }
    } else if (e.kind == KIND_INT64) {
        bad = bad_labels(static_cast<const long long*>(e.p), start, end, classes, ignore_index,
                         has_ignore);
    } else {
        bad = bad_labels(static_cast<const int*>(e.p), start, end, classes, ignore_index,
                         has_ignore);
    }
    if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(flags, e.bit);
}

// One row of guard_copy_kernel's table (32 bytes): copy n bytes src -> dst, 16 at a time
// where vec (both pointers and n multiples of 16).
struct CopyEntry {
    const unsigned char* src;
    unsigned char* dst;
    long long n;
    long long vec;
};

// guard_save (flags null: always) and guard_restore (only when flags[1], the skip flag, is
// set): the state the forward pass updates in place, copied to or from one scratch buffer.
// Block k copies chunk blocks[k] = (entry, chunk index) of `chunk` bytes (a multiple of 16).
extern "C" __global__ void guard_copy_kernel(const CopyEntry* entries, const int2* blocks,
                                             int chunk, const int* flags) {
    await_previous_kernel();
    if (flags != nullptr && flags[1] == 0) return;
    const int2 job = blocks[blockIdx.x];
    const CopyEntry e = entries[job.x];
    const long long start = (long long)job.y * chunk, end = min(start + chunk, e.n);
    if (e.vec) {
        for (long long i = start + 16 * (long long)threadIdx.x; i < end; i += 16LL * blockDim.x)
            *reinterpret_cast<uint4*>(e.dst + i) = *reinterpret_cast<const uint4*>(e.src + i);
    } else {
        for (long long i = start + threadIdx.x; i < end; i += blockDim.x) e.dst[i] = e.src[i];
    }
}

// GradScaler.update on the device (ops/guard.py loss_scale_update), after guard_advance wrote
// flags[1], the skip flag: back off on a skipped step, grow after growth_interval good ones.
extern "C" __global__ void loss_scale_update_kernel(const int* flags, float* scale,
                                                    int* growth_tracker, float growth_factor,
                                                    float backoff_factor, int growth_interval) {
    await_previous_kernel();
    if (flags[1] != 0) {
        *scale = *scale * backoff_factor;
        *growth_tracker = 0;
        return;
    }
    const int good = *growth_tracker + 1;
    if (good == growth_interval) {
        const float grown = *scale * growth_factor;
        if (isfinite(grown)) *scale = grown;
        *growth_tracker = 0;
    } else {
        *growth_tracker = good;
    }
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
    await_previous_kernel();
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
