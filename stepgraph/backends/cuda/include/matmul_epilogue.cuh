// The epilogue of the small and tiled GEMM kernels (matmul/small_matmul.cu,
// matmul/tile_matmul.cu): linear's bias and activation, in float32 (elementwise.cuh).
#pragma once
#include "bf16.cuh"
#include "elementwise.cuh"

// Bias, saved pre-activation and activation of one output, as linear's epilogue defines them:
// in float32, each output rounded once as it is stored (a no-op for float D). `addend` (matmul's
// add_c, never with a bias or activation) is added as an output of the same index: for float
// D the add of the stored product, as the add node it replaces computed it.
template <typename D>
__device__ __forceinline__ void finish_output(float acc, long long idx, int j, const D* bias,
                                              const D* addend, D* c, D* z, int act,
                                              float slope) {
    if (addend) acc += load_as_float(addend, idx);
    if (bias) acc += load_as_float(bias, j);
    if (z) store_from_float(z, idx, acc);
    store_from_float(c, idx, act == ACT_NONE ? acc : act_value(acc, act, slope));
}
