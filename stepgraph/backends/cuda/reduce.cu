// Reductions: reduce_sum (column sums = bias gradients, per-channel sums of NCHW = conv bias
// gradients, many short rows = the last axes of a contiguous array, any other axes through a
// strided fallback), the fused activation-gradient + bias-gradient act_bias_grad, and
// global_norm over many tensors. Deterministic: each sum has a fixed owner and a fixed
// combination order; partial sums are float64.
// reduce_sum and act_bias_grad are templates on the element storage T: float, or unsigned
// short for bfloat16 (bf16.cuh): inputs widened to float, sums in float64, each output
// rounded to float32 and then to bf16 once, when it is stored (the numpy emulation sums the
// float32 values and rounds the float32 sum: the two agree but for the order of the sum).
#include "launch_order.cuh"
#include "bf16.cuh"
#include "elementwise.cuh"
#include "reduce.cuh"

#define COLUMN_TILE 32   // columns per block (one warp wide: coalesced row segments)
#define COLUMN_ROWS 16   // row lanes per block (blockDim.y); launchers use (32, 16) blocks

// Column kernels split the rows into gridDim.y contiguous ranges (tall inputs: a few dozen
// column blocks alone cannot fill the GPU). This is the range of block row split y.
__device__ __forceinline__ void split_rows(int rows, int* begin, int* end) {
    const int per = (rows + gridDim.y - 1) / gridDim.y;
    *begin = blockIdx.y * per;
    *end = min(rows, *begin + per);
}

// Each column's threads combine their row partials in a fixed order (y = 0, 1, ...). One
// split writes out[col]; several write partial[split * total + batch * cols + col] (total =
// cols * batches: split-major, so that reduce_sum_splits_kernel's warps read adjacent
// doubles) for reduce_sum_splits_kernel to add in a fixed order. A thread may own VEC
// adjacent columns, col .. col + VEC - 1, its partials in acc[0 .. VEC - 1].
template <int VEC, typename T>
__device__ __forceinline__ void finish_columns(const double (&acc)[VEC], T* out,
                                               double* partial, int col, int cols) {
    __shared__ double part[COLUMN_ROWS][COLUMN_TILE * VEC + 1];
#pragma unroll
    for (int j = 0; j < VEC; ++j) part[threadIdx.y][threadIdx.x * VEC + j] = acc[j];
    __syncthreads();
    if (threadIdx.y != 0) return;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
        if (col + j >= cols) break;
        double s = 0.0;
        for (int k = 0; k < COLUMN_ROWS; ++k) s += part[k][threadIdx.x * VEC + j];
        if (gridDim.y == 1) store_from_float(out, col + j, (float)s);
        else partial[((long long)blockIdx.y * gridDim.z + blockIdx.z) * cols + col + j] = s;
    }
}

// y[c] = sum_r x[r, c] for x (rows, cols). Grid: ceil(cols / (32 VEC)) blocks of (32, 16)
// threads (x row splits), times gridDim.z batches: x (batches, rows, cols) -> y (batches,
// cols), e.g. a channels-last (N, H, W, C) summed over H and W, the partials of batch z after
// batch z - 1's. VEC 4: four adjacent columns a thread (cols % 4 == 0, rows aligned to four
// elements), one load each: a bf16 warp row of one column a thread is 64 bytes, which left
// gpt's bias gradients ((16384, 384) bf16) far from the memory bandwidth. Each column's sum
// keeps its order whatever VEC.
template <typename T, int VEC>
__global__ void __launch_bounds__(512)
reduce_sum_columns_kernel(const T* x, T* y, double* partial, int rows, int cols) {
    await_previous_kernel();
    x += (long long)blockIdx.z * rows * cols;
    y += (long long)blockIdx.z * cols;
    const int col = (blockIdx.x * COLUMN_TILE + threadIdx.x) * VEC;
    int r0, r1;
    split_rows(rows, &r0, &r1);
    double acc[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] = 0.0;
    if (col < cols)
        for (int r = r0 + threadIdx.y; r < r1; r += COLUMN_ROWS) {
            float v[VEC];
            loadv_as_float<VEC>(x, (long long)r * cols + col, v);
#pragma unroll
            for (int j = 0; j < VEC; ++j) acc[j] += v[j];
        }
    finish_columns<VEC>(acc, y, partial, col, cols);
}

// y[b] = sum over a, c of x[a, b, c] for x viewed as (outer, mid, inner): blocks (b, s) sum
// the outer rows a = s, s + gridDim.y, ... of plane b. With one split the block writes y[b];
// with several it writes partial[s * mid + b] and reduce_sum_splits_kernel adds them in a
// fixed order (few planes, e.g. a conv's channels, cannot fill the GPU one block each).
// Thread j walks the flat (a, c) index j, j + blockDim, ... with division-free increments.
template <typename T>
__global__ void reduce_sum_planes_kernel(const T* x, T* y, double* partial, int outer, int mid,
                                         int inner) {
    await_previous_kernel();
    __shared__ double smem[32];
    const int b = blockIdx.x, splits = gridDim.y;
    const int da = blockDim.x / inner * splits, dc = blockDim.x % inner;
    int a = threadIdx.x / inner * splits + blockIdx.y, c = threadIdx.x % inner;
    double acc = 0.0;
    while (a < outer) {
        acc += load_as_float(x, ((long long)a * mid + b) * inner + c);
        a += da;
        c += dc;
        if (c >= inner) {
            c -= inner;
            a += splits;
        }
    }
    acc = block_sum(acc, smem);
    if (threadIdx.x != 0) return;
    if (splits == 1) store_from_float(y, b, (float)acc);
    else partial[(long long)blockIdx.y * gridDim.x + b] = acc;
}

// y[r] = sum over c of x[r, c] for x (rows, cols): a warp per row (blockDim (32, rows per
// block)), rows strided over the grid, for many short rows (the last axes of a contiguous
// array, e.g. a channels-last mean over C), where the planes kernel would spend a block and its
// barriers on each row. Lane l adds columns l, l + 32, ... in float64 in that order, then the
// warp's butterfly sum (warp_sum): a fixed order whatever the grid. A row is one warp's, so
// warps leave the loop on their own (no block barrier inside).
template <typename T>
__global__ void reduce_sum_rows_kernel(const T* x, T* y, int rows, int cols) {
    await_previous_kernel();
    for (long long r = first_row_base() + threadIdx.y; r < rows; r += row_base_stride()) {
        const T* xr = x + r * cols;
        double acc = 0.0;
#pragma unroll 4  // several loads in flight a lane; the additions keep their order
        for (int c = threadIdx.x; c < cols; c += 32) acc += load_as_float(xr, c);
        acc = warp_sum(acc);
        if (threadIdx.x == 0) store_from_float(y, r, (float)acc);
    }
}

// y[b] = sum over s of partial[s * mid + b]. A block of (32, SPLIT_WARPS) threads per 32
// adjacent b: warp w adds s = w, w + SPLIT_WARPS, ... ascending (each load a row of 32
// adjacent doubles), then lane b's SPLIT_WARPS sums are added in warp order: a fixed order
// whatever the launch. One thread walking all of a column's splits had been a chain of
// dependent loads (512 splits: about 9.5 µs a launch on an H200, for 64 columns).
#define SPLIT_WARPS 16
template <typename T>
__global__ void __launch_bounds__(32 * SPLIT_WARPS)
reduce_sum_splits_kernel(const double* partial, T* y, int mid, int splits) {
    await_previous_kernel();
    __shared__ double part[SPLIT_WARPS][33];
    const int b = blockIdx.x * 32 + threadIdx.x;
    double acc = 0.0;
    if (b < mid) {
#pragma unroll 8
        for (int s = threadIdx.y; s < splits; s += SPLIT_WARPS)
            acc += partial[(long long)s * mid + b];
    }
    part[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y != 0 || b >= mid) return;
    double sum = 0.0;
    for (int w = 0; w < SPLIT_WARPS; ++w) sum += part[w][threadIdx.x];
    store_from_float(y, b, (float)sum);
}

// y = x.sum(axes) for any axes (the fallback when the kept axes are not one contiguous run,
// e.g. (A, B, C, D) summed over (0, 2)): a thread per output element, float64 accumulation over
// the reduced elements in row-major order (deterministic). The launcher collapses the kept axes
// into at most 4 dims k0..k3 (sizes kn*, input strides ks*) and the reduced ones into at most 4
// dims r0..r3 (rn*, rs*), outermost first, padded in front with size-1 dims.
template <typename T>
__global__ void reduce_sum_strided_kernel(const T* x, T* y, int n,
                                                     int kn0, int kn1, int kn2, int kn3,
                                                     int ks0, int ks1, int ks2, int ks3,
                                                     int rn0, int rn1, int rn2, int rn3,
                                                     int rs0, int rs1, int rs2, int rs3) {
    await_previous_kernel();
    for (int o = blockIdx.x * blockDim.x + threadIdx.x; o < n; o += gridDim.x * blockDim.x) {
        int q = o;
        const int i3 = q % kn3;
        q /= kn3;
        const int i2 = q % kn2;
        q /= kn2;
        const int i1 = q % kn1;
        const T* xo = x + ((long long)(q / kn1) * ks0 + (long long)i1 * ks1 +
                               (long long)i2 * ks2 + (long long)i3 * ks3);
        double acc = 0.0;
        for (int j0 = 0; j0 < rn0; ++j0)
            for (int j1 = 0; j1 < rn1; ++j1)
                for (int j2 = 0; j2 < rn2; ++j2) {
                    const T* xr = xo + ((long long)j0 * rs0 + (long long)j1 * rs1 +
                                            (long long)j2 * rs2);
                    for (int j3 = 0; j3 < rn3; ++j3)
                        acc += load_as_float(xr, (long long)j3 * rs3);
                }
        store_from_float(y, o, (float)acc);
    }
}

// Whether T is bf16's storage, whose results keep 8 bits of mantissa.
template <typename T> struct is_bf16 { static constexpr bool value = false; };
template <> struct is_bf16<unsigned short> { static constexpr bool value = true; };

// The rows of one act_bias_backward thread for activation KIND, known at compile time: the
// kernel switches on its kind once. A switch per element had put an indirect branch (a jump
// table read from constant memory) before each element's derivative and kept the four
// elements' arithmetic apart; the bf16 gelu_tanh row is now one block of 154 instructions
// with its four tanh interleaved (sm_90 SASS, nvdisasm).
template <int KIND, typename T, int VEC>
__device__ __forceinline__ void act_bias_rows(const T* dy, const T* saved, T* dz, int r0,
                                              int r1, int cols, int col, float slope,
                                              double (&acc)[VEC]) {
    for (int r = r0 + threadIdx.y; r < r1; r += COLUMN_ROWS) {
        const long long i = (long long)r * cols + col;
        float d[VEC], v[VEC];
        loadv_as_float<VEC>(dy, i, d);
        if constexpr (KIND == ACT_NONE) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) v[j] = d[j];
        } else {
            float x[VEC];
            loadv_as_float<VEC>(saved, i, x);
#pragma unroll
            for (int j = 0; j < VEC; ++j)
                v[j] = __fmul_rn(d[j], act_derivative<is_bf16<T>::value>(x[j], KIND, slope));
        }
        storev_from_float<VEC>(dz, i, v);
#pragma unroll
        for (int j = 0; j < VEC; ++j) acc[j] += v[j];
    }
}

// dz = dy * act'(saved) (kind ACT_NONE: dz = dy) and db = dz summed over rows, in one pass.
// The (32, 16) column layout of reduce_sum_columns_kernel, each thread owning VEC adjacent
// columns: VEC 4 moves 4 elements a load (cols % 4 == 0, arrays aligned to 4 elements), which a
// bf16 input needs to approach the memory bandwidth (a warp's row segment is 64 bytes with one
// element a thread). Each column's sum keeps its order whatever VEC. In bf16, db sums the float32
// dz before dz is rounded for its store (the numpy emulation's order: dz.sum(0) of the float32
// dz, both rounded when the node finishes). In bf16 gelu_tanh's tanh is the hardware's
// approximation (act_derivative<true>, an eighth of a bf16 ulp): with tanhf the gpt's (16384,
// 1536) call took 81 µs against 63 for relu's, its instructions and not its bytes the bound
// (H200). float16's 11 bits keep tanhf.
template <typename T, int VEC>
__global__ void __launch_bounds__(512)
act_bias_backward_kernel(const T* dy, const T* saved, T* dz, T* db, double* partial, int rows,
                         int cols, int kind, float slope) {
    await_previous_kernel();
    const int col = (blockIdx.x * COLUMN_TILE + threadIdx.x) * VEC;
    int r0, r1;
    split_rows(rows, &r0, &r1);
    double acc[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] = 0.0;
    if (col < cols) {
#define ACT_BIAS_ROWS(KIND) \
    case KIND: act_bias_rows<KIND>(dy, saved, dz, r0, r1, cols, col, slope, acc); break;
        switch (kind) {
            ACT_BIAS_ROWS(ACT_NONE) ACT_BIAS_ROWS(ACT_RELU) ACT_BIAS_ROWS(ACT_LEAKY_RELU)
            ACT_BIAS_ROWS(ACT_SIGMOID) ACT_BIAS_ROWS(ACT_TANH) ACT_BIAS_ROWS(ACT_GELU)
            ACT_BIAS_ROWS(ACT_GELU_TANH) ACT_BIAS_ROWS(ACT_SILU)
        }
#undef ACT_BIAS_ROWS
    }
    finish_columns<VEC>(acc, db, partial, col, cols);
}

// One row of the device table built once per node by launchers.global_norm_forward: a float32
// tensor, the bf16 bits of a gradient whose cast to float32 compile/fuse.py dropped
// (fuse_gradient_casts; widened exactly, so the norm is the same), or a float16 gradient
// (model.half()); `kind` is its storage code (bf16.cuh STORAGE_*).
struct NormEntry {
    const void* data;
    long long n;
    long long aligned;  // data is 16-byte aligned: one vector load of four elements
    long long kind;
};

// out = sqrt(sum over tensors of sum(g^2)), in float64 like the numpy reference. Block k sums
// chunk blocks[k] = (tensor, chunk index) into partials[k]; the last block to finish adds the
// partials in index order.
extern "C" __global__ void global_norm_forward_kernel(const NormEntry* entries,
                                                      const int2* blocks, double* partials,
                                                      unsigned int* counter, float* out,
                                                      int chunk) {
    await_previous_kernel();
    __shared__ double smem[32];
    __shared__ unsigned int last_flag;
    const int2 job = blocks[blockIdx.x];
    const NormEntry e = entries[job.x];
    const long long start = (long long)job.y * chunk;
    const long long end = min(start + chunk, e.n);
    double acc = 0.0;
    const long long stride = 4 * (long long)blockDim.x;
    for (long long i = start + 4 * (long long)threadIdx.x; i < end; i += stride) {
        if (e.aligned && i + 4 <= end) {
            float v[4];
            load4_either_as_float(e.data, (int)e.kind, i, v);
            acc += (double)v[0] * v[0] + (double)v[1] * v[1] + (double)v[2] * v[2] +
                   (double)v[3] * v[3];
        } else {
            for (long long j = i; j < i + 4 && j < end; ++j) {
                const double g = load_either_as_float(e.data, (int)e.kind, j);
                acc += g * g;
            }
        }
    }
    acc = block_sum(acc, smem);
    if (threadIdx.x == 0) partials[blockIdx.x] = acc;
    if (!arrive_last(counter, &last_flag)) return;
    acc = 0.0;
    for (int k = threadIdx.x; k < gridDim.x; k += blockDim.x) acc += __ldcg(partials + k);
    acc = block_sum(acc, smem);
    if (threadIdx.x == 0) *out = (float)sqrt(acc);
}
