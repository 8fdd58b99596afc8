// SyncBatchNorm's running statistics (ops/sync_batch_norm.py running_stats_update): the
// momentum update from the global batch's mean and biased variance, count elements per channel
// over every rank, in double as batch_norm_finalize_kernel's. One block: every thread reads
// num_batches_tracked (a cumulative average's 1/(tracked + 1)) before thread 0 writes it back.
#include "launch_order.cuh"
extern "C" __global__ void running_stats_update_kernel(float* running_mean, float* running_var,
                                                       long long* tracked, const float* mean,
                                                       const float* var, const float* total,
                                                       double momentum, int cumulative, int C) {
    await_previous_kernel();
    const long long batches = *tracked + 1;
    const double m = cumulative ? 1.0 / (double)batches : momentum;
    const double count = (double)total[0];
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        running_mean[c] = (float)((1.0 - m) * (double)running_mean[c] + m * (double)mean[c]);
        running_var[c] = (float)((1.0 - m) * (double)running_var[c] +
                                 m * (double)var[c] * count / (count - 1.0));
    }
    __syncthreads();
    if (threadIdx.x == 0) *tracked = batches;
}
