// Guard kernels (ops/guard.py): one multi-tensor pass that flags a step whose labels lie
// outside [0, classes) or whose loss or gradients hold a NaN or Inf. It only reads, and
// writes the step's guard flags with an atomicOr from the blocks that found something, so a
// good step costs one read of every gradient and no write. guard_advance (optim.cu) then
// decides, and the update kernels skip a flagged step.

#define KIND_FLOAT32 0
#define KIND_INT32 1
#define KIND_INT64 2
#define KIND_BF16 3   // raw bits: a bf16 gradient the update widens itself (fuse_gradient_casts)

// One row of the device table built once per guard_check node by guards.py (32 bytes):
// a tensor, what it holds, the flag bit it sets, and whether it is 16-byte aligned.
struct GuardEntry {
    const void* p;
    long long n;
    int kind;
    int bit;
    int aligned;
    int pad;
};

__device__ __forceinline__ bool not_finite4(const float4 v) {
    return !isfinite(v.x) || !isfinite(v.y) || !isfinite(v.z) || !isfinite(v.w);
}

// A bf16 value is NaN or Inf exactly when its exponent bits are all ones (as its float32 widening).
__device__ __forceinline__ bool bf16_not_finite(unsigned short b) {
    return (b & 0x7f80u) == 0x7f80u;
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

// Block k checks chunk blocks[k] = (tensor, chunk index) of the table: elements
// [chunk * index, min(chunk * (index + 1), n)), float tensors four a thread (float4 where
// aligned; chunk is a multiple of 4).
extern "C" __global__ void guard_check_kernel(const GuardEntry* entries, const int2* blocks,
                                              int chunk, long long classes,
                                              long long ignore_index, int has_ignore,
                                              int* flags) {
    const int2 job = blocks[blockIdx.x];
    const GuardEntry e = entries[job.x];
    const long long start = (long long)job.y * chunk, end = min(start + chunk, e.n);
    bool bad = false;
    if (e.kind == KIND_FLOAT32) {
        const float* p = static_cast<const float*>(e.p);
        for (long long i = start + 4 * (long long)threadIdx.x; i < end; i += 4LL * blockDim.x) {
            if (e.aligned && i + 4 <= end) {
                bad |= not_finite4(*reinterpret_cast<const float4*>(p + i));
            } else {
                for (long long j = i; j < i + 4 && j < end; ++j) bad |= !isfinite(p[j]);
            }
        }
    } else if (e.kind == KIND_BF16) {
        const unsigned short* p = static_cast<const unsigned short*>(e.p);
        for (long long i = start + 4 * (long long)threadIdx.x; i < end; i += 4LL * blockDim.x) {
            if (e.aligned && i + 4 <= end) {
                const ushort4 v = *reinterpret_cast<const ushort4*>(p + i);
                bad |= bf16_not_finite(v.x) || bf16_not_finite(v.y) || bf16_not_finite(v.z) ||
                       bf16_not_finite(v.w);
            } else {
                for (long long j = i; j < i + 4 && j < end; ++j) bad |= bf16_not_finite(p[j]);
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
