// Division of a 32-bit index by a divisor fixed for the launch, without the division
// instruction sequence (tens of instructions: index arithmetic that divides per element turns
// a gather ALU-bound): the host computes (m, l) for divisor d (broadcast.py division_magic:
// l = ceil(log2 d), m = floor(2^32 (2^l - d) / d) + 1) and n / d is one multiply-high, an add
// and a shift, exact for every n < 2^31 (the launchers' index bound; t + n then stays below
// 2^32).
#pragma once

__device__ __forceinline__ unsigned int divide(unsigned int n, unsigned int m, unsigned int l) {
    return (__umulhi(n, m) + n) >> l;
}
