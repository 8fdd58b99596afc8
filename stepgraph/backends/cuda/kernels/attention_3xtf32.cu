// The attention kernels (attention.cuh) with 3xTF32 tile products (float32-level
// accuracy): precision="fp32".
#include "attention.cuh"

SDPA_ALL_TILES(SDPA_3XTF32, float)
