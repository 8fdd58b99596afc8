// cast: y = x converted between float32, bfloat16 (raw bits, bf16.cuh) and float16 (fp16.cuh).
// float32 -> bf16 rounds to nearest even (NaN -> 0x7FC0), -> float16 to nearest even (overflow
// to inf); a 16-bit -> float32 cast is exact, and so is the widening between the two 16-bit
// types before their one rounding. vec 4 (the launcher checks
// n % 4 == 0 and 16-byte aligned pointers): four elements a thread, one 16-byte and one 8-byte
// access.
#include "launch_order.cuh"
#include "bf16.cuh"

template <typename S, typename D>
__global__ void cast_forward_kernel(const S* x, D* y, long long n, int vec) {
    await_previous_kernel();
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long groups = n / vec;
    for (long long g = blockIdx.x * (long long)blockDim.x + threadIdx.x; g < groups;
         g += stride) {
        const long long i = g * vec;
        if (vec == 4) {
            float v[4];
            load4_as_float(x, i, v);
            store4_from_float(y, i, v);
        } else {
            store_from_float(y, i, load_as_float(x, i));
        }
    }
}
