// Gradient buckets of a data-parallel step (ops/collective.py): a bucket's gradients are
// copied into one flat float buffer before its NCCL all-reduce and back out of it afterwards,
// so one all-reduce covers many tensors. bf16 gradients (the _bf16 kernels) are widened on
// the way in and rounded to nearest even on the way out, so NCCL sums them in float32.
// Multi-tensor launches: one block per (tensor, chunk) job, as the optimizer kernels; entries
// hold (pointer, elements, offset in the flat buffer).
#include "launch_order.cuh"
#include "bf16.cuh"

// flat[offset_t + i] = tensor_t[i] for every tensor t of the bucket.
template <typename T>
__device__ void bucket_pack(const long long* entries, const int* jobs, float* flat, int chunk) {
    const int t = jobs[2 * blockIdx.x], c = jobs[2 * blockIdx.x + 1];
    const T* src = reinterpret_cast<const T*>(entries[3 * t]);
    const long long n = entries[3 * t + 1], offset = entries[3 * t + 2];
    const long long start = (long long)c * chunk;
    const long long end = min(start + (long long)chunk, n);
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x)
        flat[offset + i] = load_as_float(src, i);
}

// tensor_t[i] = flat[offset_t + i] for every tensor t of the bucket.
template <typename T>
__device__ void bucket_unpack(const long long* entries, const int* jobs, const float* flat,
                              int chunk) {
    const int t = jobs[2 * blockIdx.x], c = jobs[2 * blockIdx.x + 1];
    T* dst = reinterpret_cast<T*>(entries[3 * t]);
    const long long n = entries[3 * t + 1], offset = entries[3 * t + 2];
    const long long start = (long long)c * chunk;
    const long long end = min(start + (long long)chunk, n);
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x)
        store_from_float(dst, i, flat[offset + i]);
}

extern "C" __global__ void bucket_pack_kernel(const long long* entries, const int* jobs,
                                              float* flat, int chunk) {
    await_previous_kernel();
    bucket_pack<float>(entries, jobs, flat, chunk);
}

extern "C" __global__ void bucket_unpack_kernel(const long long* entries, const int* jobs,
                                                const float* flat, int chunk) {
    await_previous_kernel();
    bucket_unpack<float>(entries, jobs, flat, chunk);
}

extern "C" __global__ void bucket_pack_bf16_kernel(const long long* entries, const int* jobs,
                                                   float* flat, int chunk) {
    await_previous_kernel();
    bucket_pack<unsigned short>(entries, jobs, flat, chunk);
}

extern "C" __global__ void bucket_unpack_bf16_kernel(const long long* entries, const int* jobs,
                                                     const float* flat, int chunk) {
    await_previous_kernel();
    bucket_unpack<unsigned short>(entries, jobs, flat, chunk);
}
