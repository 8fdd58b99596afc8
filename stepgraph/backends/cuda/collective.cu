// Gradient buckets of a data-parallel step (ops/collective.py): a bucket's gradients are
// copied into one flat buffer before its NCCL all-reduce and back out of it afterwards, so
// one all-reduce covers many tensors. Multi-tensor launches: one block per (tensor, chunk)
// job, as the optimizer kernels; entries hold (pointer, elements, offset in the flat buffer).

// flat[offset_t + i] = tensor_t[i] for every tensor t of the bucket.
extern "C" __global__ void bucket_pack_kernel(const long long* entries, const int* jobs,
                                              float* flat, int chunk) {
    const int t = jobs[2 * blockIdx.x], c = jobs[2 * blockIdx.x + 1];
    const float* src = reinterpret_cast<const float*>(entries[3 * t]);
    const long long n = entries[3 * t + 1], offset = entries[3 * t + 2];
    const long long start = (long long)c * chunk;
    const long long end = min(start + (long long)chunk, n);
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) flat[offset + i] = src[i];
}

// tensor_t[i] = flat[offset_t + i] for every tensor t of the bucket.
extern "C" __global__ void bucket_unpack_kernel(const long long* entries, const int* jobs,
                                                const float* flat, int chunk) {
    const int t = jobs[2 * blockIdx.x], c = jobs[2 * blockIdx.x + 1];
    float* dst = reinterpret_cast<float*>(entries[3 * t]);
    const long long n = entries[3 * t + 1], offset = entries[3 * t + 2];
    const long long start = (long long)c * chunk;
    const long long end = min(start + (long long)chunk, n);
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) dst[i] = flat[offset + i];
}
