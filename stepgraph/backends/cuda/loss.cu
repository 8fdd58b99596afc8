// Softmax and losses over (N, C) rows: log_softmax and its gradient, cross-entropy (forward,
// gradient and the fused train kernel: loss and dlogits in one launch), nll_loss, mse.
// Row kernels: a row is handled by a group of blockDim.x threads (a multiple of 32, usually one
// warp; log_softmax's rows of at most 16 columns a power of two of lanes below it), blockDim.y
// rows per block, rows strided over the grid. Scalar losses are means:
// float64 partial sums in a fixed order (one block), or, over several blocks, per-row values
// summed in index order by the last block to finish (reduce.cuh arrive_last): deterministic.
// Labels are int or long long (templates); a label outside [0, C) gives a NaN loss.
// Label smoothing eps (PyTorch's): loss_i = hit * (lse_i - x[i, y_i]) + eps * (lse_i - mean_j
// x[i, j]) and dlogits = (softmax - hit * onehot - off) * scale, with hit = float32(1 - eps)
// and off = float32(eps / C) from the launcher. eps == 0 (hit 1, off 0) takes the unsmoothed
// arithmetic: the same bits as without smoothing.
// ignore_index (PyTorch's, default -100): rows whose label equals it add nothing to the loss
// and get zero gradients; the mean is over the kept rows, counted on the device (no row
// ignored: the count is N and the arithmetic that of a plain mean, the same bits). Kernels
// whose gradients need the count up front read it from `count` (cross_entropy_count_kernel,
// launcher scratch) or, given null, count the labels in each block.
#include "launch_order.cuh"
#include "reduce.cuh"

#define QUIET_NAN __int_as_float(0x7fc00000)

// Every thread of the block calls this (row reductions synchronise); rows past N pass cols = 0.
template <typename X>
__device__ __forceinline__ float row_logsumexp(const X* xr, int cols, float* smem) {
    const float m = row_max_of(xr, cols, smem);
    return m + logf(row_sum_exp(xr, cols, m, smem));
}

// The label's logit of a row whose classes lie `stride` elements apart (classes-first: N).
template <typename X, typename L>
__device__ __forceinline__ float picked_logit(const X* xr, L label, int C, long long stride = 1) {
    return (label >= 0 && label < C) ? load_as_float(xr, (long long)label * stride) : QUIET_NAN;
}

// One row's smoothed loss from lse l, the picked logit p and the row's mean logit.
__device__ __forceinline__ float smoothed_loss(float l, float p, float mean, float eps,
                                               float hit) {
    return __fadd_rn(__fmul_rn(hit, l - p), __fmul_rn(eps, l - mean));
}

// d loss_i / d x[i, c] before scaling: softmax - hit * onehot - off, in the reference's order.
// With eps == 0 (hit 1, off 0) this is exp(x - l), minus 1 at the label: bit for bit the
// unsmoothed gradient (g - 0 == g).
__device__ __forceinline__ float smoothed_grad(float x, float l, bool at_label, float off,
                                               float hit) {
    float g = expf(x - l);
    if (at_label) g -= hit;
    return g - off;
}

// The mean logit of a row (row reduction: every thread of the block calls it, rows past N
// pass cols = 0).
template <typename X>
__device__ __forceinline__ float row_mean(const X* xr, int cols, int C, float* smem) {
    float s = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) s += load_as_float(xr, c);
    return row_sum(s, smem) / (float)C;
}

// Whether row's label is ignore_index.
template <typename L>
__device__ __forceinline__ bool ignored(const L* labels, int row, long long ignore_index) {
    return (long long)labels[row] == ignore_index;
}

// How many of the N labels are not ignore_index, in every thread of the block (every thread
// calls it). ismem holds 32 ints, total one.
template <typename L>
__device__ __forceinline__ int count_kept(const L* labels, int N, long long ignore_index,
                                          int* ismem, int* total) {
    int k = 0;
    for (int i = flat_thread(); i < N; i += blockDim.x * blockDim.y)
        k += !ignored(labels, i, ignore_index);
    k = block_sum(k, ismem);
    if (flat_thread() == 0) *total = k;
    __syncthreads();
    return *total;
}

// The kept rows' count for the gradient kernels: *count, or counted by this block (null).
template <typename L>
__device__ __forceinline__ int kept_rows(const int* count, const L* labels, int N,
                                         long long ignore_index) {
    __shared__ int ismem[32];
    __shared__ int total;
    return count ? *count : count_kept(labels, N, ignore_index, ismem, &total);
}

// *count = how many labels are not ignore_index: one block.
template <typename L>
__global__ void __launch_bounds__(1024)
cross_entropy_count_kernel(const L* labels, int N, long long ignore_index, int* count) {
    await_previous_kernel();
    __shared__ int ismem[32];
    __shared__ int total;
    const int k = count_kept(labels, N, ignore_index, ismem, &total);
    if (flat_thread() == 0) *count = k;
}

// T: float, or the 16-bit storages (bf16 bits, float16), widened on load, rounded once on store.
template <typename T>
__global__ void log_softmax_forward_kernel(const T* x, T* y, int N, int C) {
    await_previous_kernel();
    __shared__ float smem[32];
    for (long long base = first_row_base(); base < N; base += row_base_stride()) {
        const int row = (int)base + threadIdx.y;
        const bool valid = row < N;
        const T* xr = x + (long long)row * C;
        const float lse = row_logsumexp(xr, valid ? C : 0, smem);
        if (valid)
            for (int c = threadIdx.x; c < C; c += blockDim.x)
                store_from_float(y, (long long)row * C + c, load_as_float(xr, c) - lse);
    }
}

// dx = dy - exp(y) * sum(dy) per row.
template <typename T>
__global__ void log_softmax_backward_kernel(const T* dy, const T* y, T* dx, int N, int C) {
    await_previous_kernel();
    __shared__ float smem[32];
    for (long long base = first_row_base(); base < N; base += row_base_stride()) {
        const int row = (int)base + threadIdx.y;
        const bool valid = row < N;
        const long long r0 = (long long)row * C;
        const int cols = valid ? C : 0;
        float s = 0.f;
        for (int c = threadIdx.x; c < cols; c += blockDim.x) s += load_as_float(dy, r0 + c);
        s = row_sum(s, smem);
        for (int c = threadIdx.x; c < cols; c += blockDim.x)
            store_from_float(dx, r0 + c, load_as_float(dy, r0 + c) -
                                             __fmul_rn(expf(load_as_float(y, r0 + c)), s));
    }
}

// loss = mean(lse - logits[i, label_i]) (smoothed: see the top); lse (N,). With one block the
// row groups' leaders accumulate their rows and the block sums them; with several, the last
// block re-reads lse (eps == 0) or the rows' smoothed losses parked in rowloss (N floats).
template <typename L>
__global__ void __launch_bounds__(1024)
cross_entropy_forward_kernel(const float* x, const L* labels, float* loss, float* lse,
                             float* rowloss, unsigned int* counter, int N, int C, float eps,
                             float hit, long long ignore_index) {
    await_previous_kernel();
    __shared__ float smem[32];
    __shared__ double dsmem[32];
    __shared__ int ismem[32];
    __shared__ unsigned int last_flag;
    double acc = 0.0;
    int kept = 0;
    for (long long base = first_row_base(); base < N; base += row_base_stride()) {
        const int row = (int)base + threadIdx.y;
        const bool valid = row < N;
        const float* xr = x + (long long)row * C;
        const float l = row_logsumexp(xr, valid ? C : 0, smem);
        const float mean = eps != 0.f ? row_mean(xr, valid ? C : 0, C, smem) : 0.f;
        if (valid && threadIdx.x == 0) {
            lse[row] = l;
            const bool skip = ignored(labels, row, ignore_index);
            kept += !skip;
            if (skip) {
                if (eps != 0.f && gridDim.x > 1) rowloss[row] = 0.f;
            } else if (eps == 0.f) {
                acc += (double)(l - picked_logit(xr, labels[row], C));
            } else {
                const float rl = smoothed_loss(l, picked_logit(xr, labels[row], C), mean, eps,
                                               hit);
                if (gridDim.x > 1) rowloss[row] = rl;
                else acc += (double)rl;
            }
        }
    }
    if (gridDim.x > 1) {
        if (!arrive_last(counter, &last_flag)) return;
        acc = 0.0;
        kept = 0;
        for (int i = flat_thread(); i < N; i += blockDim.x * blockDim.y) {
            if (ignored(labels, i, ignore_index)) continue;
            ++kept;
            acc += eps != 0.f ? (double)__ldcg(rowloss + i)
                              : (double)(__ldcg(lse + i) -
                                         picked_logit(x + (long long)i * C, labels[i], C));
        }
    }
    acc = block_sum(acc, dsmem);
    kept = block_sum(kept, ismem);
    if (flat_thread() == 0) *loss = (float)(acc / kept);
}

// dlogits = (exp(logits - lse) - hit * onehot - off) * (dloss / kept), one thread per element;
// ignored rows 0.
template <typename L>
__global__ void cross_entropy_backward_kernel(const float* dloss, const float* x,
                                              const float* lse, const L* labels, float* dx,
                                              const int* count, int N, int C, float off,
                                              float hit, long long ignore_index) {
    await_previous_kernel();
    const float scale = *dloss / (float)kept_rows(count, labels, N, ignore_index);
    const long long total = (long long)N * C;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int row = (int)(i / C), c = (int)(i - (long long)row * C);
        if (ignored(labels, row, ignore_index)) {
            dx[i] = 0.f;
            continue;
        }
        const float g = smoothed_grad(x[i], lse[row], (long long)labels[row] == c, off, hit);
        dx[i] = __fmul_rn(g, scale);
    }
}

// The gradients' scale float32(1 / kept) (float64 division, rounded once: the reference's
// float32(1 / N) when no row is ignored).
__device__ __forceinline__ float mean_scale(int kept) {
    return (float)(1.0 / (double)kept);
}

// The train kernels' loss, mean over the kept rows of each block's float64 sum acc: several
// blocks park their sums in partials (gridDim.x doubles, launcher scratch), which the block
// that arrives last adds in block order. Every thread of the block calls it.
__device__ __forceinline__ void store_train_loss(double acc, double* partials,
                                                 unsigned int* counter, int kept, void* loss,
                                                 int loss_kind) {
    __shared__ double dsmem[32];
    __shared__ unsigned int last_flag;
    acc = block_sum(acc, dsmem);
    if (gridDim.x > 1) {
        if (flat_thread() == 0) partials[blockIdx.x] = acc;
        if (!arrive_last(counter, &last_flag)) return;
        acc = 0.0;
        for (int b = flat_thread(); b < gridDim.x; b += blockDim.x * blockDim.y)
            acc += __ldcg(partials + b);
        acc = block_sum(acc, dsmem);
    }
    if (flat_thread() == 0) store_either_from_float(loss, loss_kind, 0, (float)(acc / kept));
}

// Fused forward and backward with dloss = 1 (scale = float32(1 / kept)): loss and dlogits in
// one launch. Each block sums its rows' losses in float64 (a fixed set of rows, a fixed
// order; store_train_loss), and several blocks read the kept rows' count from `count`; a
// single block may count itself (count null). X, D: float, or bf16 logits (widened as loaded)
// and dlogits (rounded once as stored) where the casts around the loss were dropped
// (compile/fuse.py fuse_loss_casts): the same values as the float32 kernel between the casts;
// or float16 logits and dlogits of a float16 model, whose loss is float16 too (loss_kind:
// bf16.cuh STORAGE_*, the loss rounded once from float32 as stored).
template <typename X, typename D, typename L>
__global__ void __launch_bounds__(1024)
cross_entropy_train_kernel(const X* x, const L* labels, void* loss, D* dx, double* partials,
                           unsigned int* counter, const int* count, int N, int C, float eps,
                           float hit, float off, long long ignore_index, int loss_kind) {
    await_previous_kernel();
    __shared__ float smem[32];
    const int kept = kept_rows(count, labels, N, ignore_index);
    const float scale = mean_scale(kept);
    double acc = 0.0;
    for (long long base = first_row_base(); base < N; base += row_base_stride()) {
        const int row = (int)base + threadIdx.y;
        const bool valid = row < N;
        const long long r0 = (long long)row * C;
        const float l = row_logsumexp(x + r0, valid ? C : 0, smem);
        const float mean = eps != 0.f ? row_mean(x + r0, valid ? C : 0, C, smem) : 0.f;
        if (valid && ignored(labels, row, ignore_index)) {
            for (int c = threadIdx.x; c < C; c += blockDim.x) store_from_float(dx, r0 + c, 0.f);
        } else if (valid) {
            const L label = labels[row];
            for (int c = threadIdx.x; c < C; c += blockDim.x) {
                const float g = smoothed_grad(load_as_float(x, r0 + c), l, (long long)label == c,
                                              off, hit);
                store_from_float(dx, r0 + c, __fmul_rn(g, scale));
            }
            if (threadIdx.x == 0) {
                const float p = picked_logit(x + r0, label, C);
                acc += (double)(eps != 0.f ? smoothed_loss(l, p, mean, eps, hit) : l - p);
            }
        }
    }
    store_train_loss(acc, partials, counter, kept, loss, loss_kind);
}

// Combines the blockDim.y lanes' values of each sample column (threadIdx.x) in lane order
// with op, in every thread of the block (every thread calls it); share holds 32 x 32 floats.
template <typename Op>
__device__ __forceinline__ float lanes_combine(float v, float (*share)[32], Op op) {
    __syncthreads();  // an earlier call may still be reading share
    share[threadIdx.y][threadIdx.x] = v;
    __syncthreads();
    float r = share[0][threadIdx.x];
    for (int k = 1; k < blockDim.y; ++k) r = op(r, share[k][threadIdx.x]);
    return r;
}

// cross_entropy_train_kernel over logits and dlogits stored classes-first, (C, N)
// (compile/logits_layout.py: the GEMMs around them then run aligned). A block takes 32
// samples at a time, one a threadIdx.x, so a warp loads 32 neighbouring values of a class;
// its blockDim.y lanes take the classes threadIdx.y, threadIdx.y + blockDim.y, ... and their
// maxima and sums are combined in lane order. Loss, count, scale, partials and dtypes as
// cross_entropy_train_kernel's.
template <typename X, typename D, typename L>
__global__ void __launch_bounds__(256)
cross_entropy_train_columns_kernel(const X* x, const L* labels, void* loss, D* dx,
                                   double* partials, unsigned int* counter, const int* count,
                                   int N, int C, float eps, float hit, float off,
                                   long long ignore_index, int loss_kind) {
    await_previous_kernel();
    __shared__ float share[32][32];
    const auto max_op = [](float a, float b) { return fmaxf(a, b); };
    const auto sum_op = [](float a, float b) { return a + b; };
    const int kept = kept_rows(count, labels, N, ignore_index);
    const float scale = mean_scale(kept);
    double acc = 0.0;
    for (long long base = (long long)blockIdx.x * blockDim.x; base < N;
         base += (long long)gridDim.x * blockDim.x) {
        const int row = (int)base + threadIdx.x;
        const int classes = row < N ? C : 0;      // a sample past N takes part in the combines
        float m = NEG_INF;
#pragma unroll 4
        for (int c = threadIdx.y; c < classes; c += blockDim.y)
            m = fmaxf(m, load_as_float(x, (long long)c * N + row));
        m = lanes_combine(m, share, max_op);
        float s = 0.f;
#pragma unroll 4
        for (int c = threadIdx.y; c < classes; c += blockDim.y)
            s += expf(load_as_float(x, (long long)c * N + row) - m);
        const float l = m + logf(lanes_combine(s, share, sum_op));
        float mean = 0.f;
        if (eps != 0.f) {
            float t = 0.f;
            for (int c = threadIdx.y; c < classes; c += blockDim.y)
                t += load_as_float(x, (long long)c * N + row);
            mean = lanes_combine(t, share, sum_op) / (float)C;
        }
        if (classes == 0) continue;
        if (ignored(labels, row, ignore_index)) {
            for (int c = threadIdx.y; c < C; c += blockDim.y)
                store_from_float(dx, (long long)c * N + row, 0.f);
            continue;
        }
        const L label = labels[row];
#pragma unroll 4
        for (int c = threadIdx.y; c < C; c += blockDim.y) {
            const long long i = (long long)c * N + row;
            const float g = smoothed_grad(load_as_float(x, i), l, (long long)label == c, off,
                                          hit);
            store_from_float(dx, i, __fmul_rn(g, scale));
        }
        if (threadIdx.y == 0) {
            const float p = picked_logit(x + row, label, C, N);
            acc += (double)(eps != 0.f ? smoothed_loss(l, p, mean, eps, hit) : l - p);
        }
    }
    store_train_loss(acc, partials, counter, kept, loss, loss_kind);
}

// cross_entropy_train_kernel for short rows (C <= 32) in one block: a thread per row. A warp
// per row left most lanes idle on 10 classes and needed N / 32 passes, each a chain of loads
// and shuffles; here the block covers up to 1024 rows at once. Loss: the block's float64 sum
// of the rows' losses (fixed tree).
template <typename X, typename D, typename L>
__global__ void __launch_bounds__(1024)
cross_entropy_train_short_kernel(const X* x, const L* labels, void* loss, D* dx, int N, int C,
                                 float eps, float hit, float off, long long ignore_index,
                                 int loss_kind) {
    await_previous_kernel();
    __shared__ double dsmem[32];
    const int kept = kept_rows((const int*)nullptr, labels, N, ignore_index);
    const float scale = mean_scale(kept);
    double acc = 0.0;
    for (int row = threadIdx.x; row < N; row += blockDim.x) {
        const X* xr = x + (long long)row * C;
        if (ignored(labels, row, ignore_index)) {
            for (int c = 0; c < C; ++c) store_from_float(dx, (long long)row * C + c, 0.f);
            continue;
        }
        float m = NEG_INF;
        for (int c = 0; c < C; ++c) m = fmaxf(m, load_as_float(xr, c));
        float s = 0.f;
        for (int c = 0; c < C; ++c) s += expf(load_as_float(xr, c) - m);
        const float l = m + logf(s);
        const L label = labels[row];
        for (int c = 0; c < C; ++c) {
            const float g = smoothed_grad(load_as_float(xr, c), l, (long long)label == c, off, hit);
            store_from_float(dx, (long long)row * C + c, __fmul_rn(g, scale));
        }
        const float p = picked_logit(xr, label, C);
        if (eps == 0.f) {
            acc += (double)(l - p);
        } else {
            float sum = 0.f;
            for (int c = 0; c < C; ++c) sum += load_as_float(xr, c);
            acc += (double)smoothed_loss(l, p, sum / (float)C, eps, hit);
        }
    }
    acc = block_sum(acc, dsmem);
    if (threadIdx.x == 0) store_either_from_float(loss, loss_kind, 0, (float)(acc / kept));
}

// loss = -mean(logp[i, label_i]): one block (N gathers).
template <typename L>
__global__ void __launch_bounds__(1024)
nll_loss_forward_kernel(const float* logp, const L* labels, float* loss, int N, int C) {
    await_previous_kernel();
    __shared__ double dsmem[32];
    double acc = 0.0;
    for (int i = threadIdx.x; i < N; i += blockDim.x)
        acc += (double)picked_logit(logp + (long long)i * C, labels[i], C);
    acc = block_sum(acc, dsmem);
    if (threadIdx.x == 0) *loss = -(float)(acc / N);
}

// dlogp = -dloss / N at (i, label_i), zero elsewhere.
template <typename L>
__global__ void nll_loss_backward_kernel(const float* dloss, const L* labels, float* dx, int N,
                                         int C) {
    await_previous_kernel();
    const float g = -*dloss / (float)N;
    const long long total = (long long)N * C;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int row = (int)(i / C), c = (int)(i - (long long)row * C);
        dx[i] = (long long)labels[row] == c ? g : 0.f;
    }
}

// loss = mean((pred - target)^2): float64 partial sums of the float32 squares, a block's
// elements strided over the block. With several blocks each parks its sum in partials and the
// last to arrive adds them in block order (reduce.cuh arrive_last): deterministic for a grid.
extern "C" __global__ void __launch_bounds__(1024)
mse_forward_kernel(const float* pred, const float* target, float* loss, long long n,
                   double* partials, unsigned int* counter) {
    await_previous_kernel();
    __shared__ double dsmem[32];
    __shared__ unsigned int last_flag;
    double acc = 0.0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float d = pred[i] - target[i];
        acc += (double)__fmul_rn(d, d);
    }
    acc = block_sum(acc, dsmem);
    if (gridDim.x > 1) {
        if (threadIdx.x == 0) partials[blockIdx.x] = acc;
        if (!arrive_last(counter, &last_flag)) return;
        acc = 0.0;
        for (int b = threadIdx.x; b < gridDim.x; b += blockDim.x) acc += __ldcg(partials + b);
        acc = block_sum(acc, dsmem);
    }
    if (threadIdx.x == 0) *loss = (float)(acc / (double)n);
}

// dpred = dloss * 2 * (pred - target) / n, in the numpy reference's order.
extern "C" __global__ void mse_backward_kernel(const float* dloss, const float* pred,
                                               const float* target, float* dx, long long n) {
    await_previous_kernel();
    const float two_dloss = *dloss * 2.f;
    const float count = (float)n;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        dx[i] = __fdiv_rn(__fmul_rn(two_dloss, pred[i] - target[i]), count);
}
