// The random op: float32 draws from the step's Philox stream, bit-identical to stepgraph/rng.py.
// uniform: element i takes word i & 3 of counter (i >> 2, site, step lo, step hi), as dropout's
// masks do, and keeps its top 24 bits times 2^-24 (exact in float32): [0, 1).
// normal: element i takes words 2 (i & 1) and 2 (i & 1) + 1 of counter (i >> 1, ...), and
// Box-Muller in double (u1 in (0, 1], u2 in [0, 1)) rounded once to float, as rng.normal.
#include "launch_order.cuh"
#include "philox.cuh"
#include "grid.cuh"

// extern "C": launched by their plain names (CuPy looks a kernel up by its symbol).
extern "C" __global__ void random_uniform_kernel(const long long* step, float* y, long long n,
                                                 unsigned long long seed, unsigned int site) {
    await_previous_kernel();
    const long long t = *step;
    GRID_STRIDE_GROUPS(g, n) {
        const uint4 w = dropout_words((unsigned long long)g, site, t, seed);
        const unsigned int words[4] = {w.x, w.y, w.z, w.w};
        for (int k = 0; k < 4 && (g << 2) + k < n; ++k)
            y[(g << 2) + k] = (float)(words[k] >> 8) * 5.9604644775390625e-08f;  // 2^-24
    }
}

__device__ __forceinline__ float box_muller(unsigned int a, unsigned int b) {
    const double u1 = ((double)(a >> 8) + 1.0) * 5.9604644775390625e-08;
    const double u2 = (double)(b >> 8) * 5.9604644775390625e-08;
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

// One Philox call gives the two elements of a pair (counter word 0 = i >> 1).
extern "C" __global__ void random_normal_kernel(const long long* step, float* y, long long n,
                                                unsigned long long seed, unsigned int site) {
    await_previous_kernel();
    const long long t = *step;
    GRID_STRIDE_LOOP(pair, (n + 1) >> 1) {
        const uint4 w = dropout_words((unsigned long long)pair, site, t, seed);
        const long long i = pair << 1;
        y[i] = box_muller(w.x, w.y);
        if (i + 1 < n) y[i + 1] = box_muller(w.z, w.w);
    }
}
