// The dropout seed of one cuDNN attention call (attention_cudnn.py): cuDNN draws its mask with
// its own Philox generator from a 64-bit seed and an offset read from device memory, so a
// captured graph draws a fresh mask each step only if that seed changes with the step counter.
// One thread derives it from the node's (seed, site) and the step, the way the dropout op keys
// its counters (philox.cuh), with the counter's first word all ones, which no element group
// of a dropout mask reaches below 2^32 groups; the offset stays 0.
#include "launch_order.cuh"
#include "philox.cuh"

extern "C" __global__ void sdpa_dropout_seed_kernel(const long long* step,
                                                    unsigned long long seed, unsigned int site,
                                                    long long* out) {
    await_previous_kernel();
    const uint4 w = dropout_words(0xFFFFFFFFull, site, *step, seed);
    out[0] = (long long)(((unsigned long long)w.y << 32) | w.x);
    out[1] = 0;
}
