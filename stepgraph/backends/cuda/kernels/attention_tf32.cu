// The attention kernels (attention.cuh) with TF32 tile products: precision="tf32" (float32
// operands) and "bf16" (bf16 operands, exact in TF32).
#include "attention.cuh"

SDPA_ALL_TILES(SDPA_TF32, float)
SDPA_ALL_TILES(SDPA_TF32, unsigned short)
