// Philox4x32-10 (Salmon et al. 2011) for dropout masks, bit-identical to stepgraph/rng.py:
// element i of dropout site `site` at step `step` uses counter (i >> 2, site, step lo, step hi),
// key (seed lo, seed hi) and output word i & 3; it is kept when (word >> 8) >= threshold.
#pragma once

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u

__device__ __forceinline__ uint4 philox4x32_10(uint4 c, unsigned int k0, unsigned int k1) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        const unsigned int hi0 = __umulhi(PHILOX_M0, c.x), lo0 = PHILOX_M0 * c.x;
        const unsigned int hi1 = __umulhi(PHILOX_M1, c.z), lo1 = PHILOX_M1 * c.z;
        c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
        k0 += PHILOX_W0;  // the bump after the last round is never used
        k1 += PHILOX_W1;
    }
    return c;
}

// The four words of element group `group` (= element index >> 2): word k belongs to element
// 4 * group + k. The counter's first word is the group truncated to 32 bits, as in rng.py.
__device__ __forceinline__ uint4 dropout_words(unsigned long long group, unsigned int site,
                                               long long step, unsigned long long seed) {
    const unsigned long long s = (unsigned long long)step;
    const uint4 counter = make_uint4((unsigned int)group, site, (unsigned int)s,
                                     (unsigned int)(s >> 32));
    return philox4x32_10(counter, (unsigned int)seed, (unsigned int)(seed >> 32));
}

__device__ __forceinline__ unsigned int philox_word(uint4 w, unsigned int lane) {
    return lane == 0 ? w.x : lane == 1 ? w.y : lane == 2 ? w.z : w.w;
}

// Integer comparison on the top 24 bits: both backends agree bit for bit (rng.keep_threshold).
__device__ __forceinline__ bool dropout_keep(unsigned int word, unsigned int threshold) {
    return (word >> 8) >= threshold;
}
