// The attention kernels (attention.cuh) with TF32 tile products: precision="tf32".
#include "attention.cuh"

SDPA_ALL_TILES(SDPA_TF32)
