// Broadcasting elementwise ops and materialising copies: binary (add/sub/mul/div with NumPy
// broadcasting), scalar (x op value), and the strided copy behind expand (broadcast strides 0)
// and permute (permuted strides), with a tiled transpose for permutes that swap the last two
// dims. Every result is one IEEE-rounded operation, as numpy's: __fadd_rn and friends keep the
// compiler from fusing or approximating (division is __fdiv_rn, never the fast reciprocal), so
// float32 results match numpy's bit for bit (up to -ftz denormals).
//
// binary, scalar and the strided copy are templates on the element storage T: float, unsigned short
// (bfloat16 raw bits, bf16.cuh) or fp16_bits (float16, fp16.cuh), loaded as float, computed in
// float32 and rounded once on store, as the numpy emulation (backends/numpy/bf16.py) rounds a
// 16-bit node's output. The strided copy goes through float too, so a bf16 NaN is stored as 0x7FC0
// as the emulation's rounding stores it; every other value copies exactly (the transpose too).
//
// Strided kernels take their layout as scalar arguments: up to MAX_DIMS dims (outermost first,
// the launcher collapses dims that every operand walks contiguously and drops size-1 dims),
// one size, its division pair (divide.cuh: multiplier, shift) and one stride (elements) per
// operand and dim. The output is C-contiguous. NDIM is a template parameter so the index
// arithmetic unrolls into registers. Indices are 32-bit: the launchers keep every size below
// 2^31.

#define MAX_DIMS 6
#define DIM_PARAMS(p) int p##0, int p##1, int p##2, int p##3, int p##4, int p##5
#define DIVISION_PARAMS(p)                                                                     \
    unsigned int p##_m0, unsigned int p##_m1, unsigned int p##_m2, unsigned int p##_m3,        \
        unsigned int p##_m4, unsigned int p##_m5, unsigned int p##_l0, unsigned int p##_l1,    \
        unsigned int p##_l2, unsigned int p##_l3, unsigned int p##_l4, unsigned int p##_l5
#define DIM_ARRAY(p) {p##0, p##1, p##2, p##3, p##4, p##5}
#define DIVISION_ARRAYS(p)                                                                     \
    const unsigned int p##_m[MAX_DIMS] = {p##_m0, p##_m1, p##_m2, p##_m3, p##_m4, p##_m5};     \
    const unsigned int p##_l[MAX_DIMS] = {p##_l0, p##_l1, p##_l2, p##_l3, p##_l4, p##_l5}

// binary kinds (broadcast.py BINARY_CODES); scalar kinds extend them (SCALAR_CODES).
#define BINARY_ADD 0
#define BINARY_SUB 1
#define BINARY_MUL 2
#define BINARY_DIV 3
#define SCALAR_RSUB 4
#define SCALAR_RDIV 5
#define SCALAR_POW 6

#include "launch_order.cuh"
#include "bf16.cuh"
#include "divide.cuh"
#include "grid.cuh"
#include "permute.cuh"

__device__ __forceinline__ float binary_value(float a, float b, int kind) {
    switch (kind) {
    case BINARY_ADD:
        return __fadd_rn(a, b);
    case BINARY_SUB:
        return __fsub_rn(a, b);
    case BINARY_MUL:
        return __fmul_rn(a, b);
    default:
        return __fdiv_rn(a, b);
    }
}

// x op v. pow evaluates in double and rounds once: the correctly rounded float32 power
// (numpy's powf is within an ulp of it; exponents 2, 0.5 and -1 give numpy's square, sqrt and
// reciprocal exactly, double rounding being innocuous for those).
__device__ __forceinline__ float scalar_value(float x, int kind, float v) {
    switch (kind) {
    case SCALAR_RSUB:
        return __fsub_rn(v, x);
    case SCALAR_RDIV:
        return __fdiv_rn(v, x);
    case SCALAR_POW:
        return (float)pow((double)x, (double)v);
    default:
        return binary_value(x, v, kind);
    }
}

// Flat element index i of the output -> the offsets of two operands (b may be unused); m, l:
// the sizes' division pairs.
template <int NDIM>
__device__ __forceinline__ void strided_offsets(unsigned int i, const int* size,
                                                const unsigned int* m, const unsigned int* l,
                                                const int* sa, const int* sb, int* oa, int* ob) {
    int a = 0, b = 0;
#pragma unroll
    for (int d = NDIM - 1; d > 0; --d) {
        const unsigned int q = divide(i, m[d], l[d]);
        const int k = (int)(i - q * (unsigned int)size[d]);
        a += k * sa[d];
        b += k * sb[d];
        i = q;
    }
    *oa = a + (int)i * sa[0];
    *ob = b + (int)i * sb[0];
}

// Four consecutive elements of an operand along its innermost dim, of stride s (0: one value
// broadcast; 1: one vector access where aligned: float4 16 bytes, ushort4 8 bytes), as float.
__device__ __forceinline__ void load_group(const float* p, int off, int s, float v[4]) {
    if (s == 0) {
        v[0] = v[1] = v[2] = v[3] = p[off];
    } else if (s == 1 && (reinterpret_cast<unsigned long long>(p + off) & 15ull) == 0ull) {
        load4_as_float(p, off, v);
    } else {
        for (int k = 0; k < 4; ++k) v[k] = p[off + k * s];
    }
}

// The 16-bit storages (bf16 bits, float16): one 8-byte access where aligned.
template <typename T>
__device__ __forceinline__ void load_group(const T* p, int off, int s, float v[4]) {
    if (s == 0) {
        v[0] = v[1] = v[2] = v[3] = load_as_float(p, off);
    } else if (s == 1 && (reinterpret_cast<unsigned long long>(p + off) & 7ull) == 0ull) {
        load4_as_float(p, off, v);
    } else {
        for (int k = 0; k < 4; ++k) v[k] = load_as_float(p, off + k * s);
    }
}

// c = a op b, same shapes. Groups of 4; one vector access per operand when every pointer is
// 16-byte aligned.
template <typename T>
__global__ void binary_forward_kernel(const T* a, const T* b, T* c, long long n, int kind,
                                      int vec) {
    await_previous_kernel();
    map2_groups(a, b, c, n, vec, [=](float u, float v) { return binary_value(u, v, kind); });
}

// c = a op b with broadcasting: a thread per output element, or (vec: the innermost size is a
// multiple of 4 and c is 16-byte aligned) per group of 4 elements along the innermost dim.
template <typename T, int NDIM>
__global__ void binary_broadcast_kernel(const T* a, const T* b, T* c, int n, int kind, int vec,
                                        DIM_PARAMS(size), DIVISION_PARAMS(size), DIM_PARAMS(sa),
                                        DIM_PARAMS(sb)) {
    await_previous_kernel();
    const int size[MAX_DIMS] = DIM_ARRAY(size);
    DIVISION_ARRAYS(size);
    const int stride_a[MAX_DIMS] = DIM_ARRAY(sa);
    const int stride_b[MAX_DIMS] = DIM_ARRAY(sb);
    const int width = vec ? 4 : 1;
    const unsigned int units = (unsigned int)n / width;
    for (unsigned int u = blockIdx.x * blockDim.x + threadIdx.x; u < units;
         u += gridDim.x * blockDim.x) {
        const unsigned int i = u * width;
        int oa, ob;
        strided_offsets<NDIM>(i, size, size_m, size_l, stride_a, stride_b, &oa, &ob);
        if (vec) {
            float x[4], y[4];
            load_group(a, oa, stride_a[NDIM - 1], x);
            load_group(b, ob, stride_b[NDIM - 1], y);
            for (int k = 0; k < 4; ++k) x[k] = binary_value(x[k], y[k], kind);
            store4_from_float(c, i, x);
        } else {
            store_from_float(c, i, binary_value(load_as_float(a, oa), load_as_float(b, ob),
                                                kind));
        }
    }
}

// y = x op value (the reversed kinds: value op x); y may alias x.
template <typename T>
__global__ void scalar_forward_kernel(const T* x, T* y, long long n, int kind, float value,
                                      int vec) {
    await_previous_kernel();
    map_groups(x, y, n, vec, [=](float u) { return scalar_value(u, kind, value); });
}

// y (contiguous, the collapsed sizes) = x read at strides sx: expand (strides 0 on broadcast
// dims) and permute (the input's strides in output order). vec as binary_broadcast_kernel.
template <typename T, int NDIM>
__global__ void strided_copy_kernel(const T* x, T* y, int n, int vec, DIM_PARAMS(size),
                                    DIVISION_PARAMS(size), DIM_PARAMS(sx)) {
    await_previous_kernel();
    const int size[MAX_DIMS] = DIM_ARRAY(size);
    DIVISION_ARRAYS(size);
    const int stride_x[MAX_DIMS] = DIM_ARRAY(sx);
    const int width = vec ? 4 : 1;
    const unsigned int units = (unsigned int)n / width;
    for (unsigned int u = blockIdx.x * blockDim.x + threadIdx.x; u < units;
         u += gridDim.x * blockDim.x) {
        const unsigned int i = u * width;
        int ox, unused;
        strided_offsets<NDIM>(i, size, size_m, size_l, stride_x, stride_x, &ox, &unused);
        if (vec) {
            float v[4];
            load_group(x, ox, stride_x[NDIM - 1], v);
            store4_from_float(y, i, v);
        } else {
            store_from_float(y, i, load_as_float(x, ox));
        }
    }
}

// y at strides sy = x at strides sx, over the collapsed sizes, both offsets given by the
// pointers: one input of a layout_concat read through its view and written at its range of
// the output. One element a thread: the ranges are rarely 16-byte aligned.
template <typename T, int NDIM>
__global__ void strided_copy_to_kernel(const T* x, T* y, int n, DIM_PARAMS(size),
                                       DIVISION_PARAMS(size), DIM_PARAMS(sx), DIM_PARAMS(sy)) {
    await_previous_kernel();
    const int size[MAX_DIMS] = DIM_ARRAY(size);
    DIVISION_ARRAYS(size);
    const int stride_x[MAX_DIMS] = DIM_ARRAY(sx);
    const int stride_y[MAX_DIMS] = DIM_ARRAY(sy);
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < (unsigned int)n;
         i += gridDim.x * blockDim.x) {
        int ox, oy;
        strided_offsets<NDIM>(i, size, size_m, size_l, stride_x, stride_y, &ox, &oy);
        store_from_float(y, oy, load_as_float(x, ox));
    }
}

#define TILE 32
#define TILE_ROWS 8

// y (batch, cols, rows) = x (batch, rows, cols) transposed per batch: 32 x 32 tiles through
// shared memory (one padding column: no bank conflicts), so reads and writes both coalesce.
// Blocks (32, 8); grid (ceil(cols / 32), ceil(rows / 32), batches strided over gridDim.z).
// T as the strided copy's: float, or bf16 bits held in the tile as float.
template <typename T>
__global__ void __launch_bounds__(TILE * TILE_ROWS)
transpose_forward_kernel(const T* x, T* y, int batch, int rows, int cols) {
    await_previous_kernel();
    __shared__ float tile[TILE][TILE + 1];
    const int c0 = blockIdx.x * TILE, r0 = blockIdx.y * TILE;
    const long long plane = (long long)rows * cols;
    for (int z = blockIdx.z; z < batch; z += gridDim.z) {
        const T* xb = x + z * plane;
        T* yb = y + z * plane;
        for (int k = threadIdx.y; k < TILE; k += TILE_ROWS) {
            const int r = r0 + k, c = c0 + threadIdx.x;
            if (r < rows && c < cols)
                tile[k][threadIdx.x] = load_as_float(xb, (long long)r * cols + c);
        }
        __syncthreads();
        for (int k = threadIdx.y; k < TILE; k += TILE_ROWS) {
            const int c = c0 + k, r = r0 + threadIdx.x;
            if (c < cols && r < rows)
                store_from_float(yb, (long long)c * rows + r, tile[threadIdx.x][k]);
        }
        __syncthreads();   // the tile is refilled for the next batch
    }
}

// permute_group: y_i = x_i.transpose(dims_i) for every tensor of the group in one launch, a
// gather in each y's row-major order (permute.cuh: entries (x, y, ...), jobs (tensor, chunk)).
// Through float as the strided copy, so the group stores what its permutes would.
template <typename T>
__global__ void permute_group_kernel(const long long* entries, const int* jobs, int chunk) {
    await_previous_kernel();
    const PermuteEntry e = permute_entry(entries + jobs[2 * blockIdx.x] * PERMUTE_ENTRY_WIDTH);
    const T* x = (const T*)e.source;
    T* y = (T*)e.destination;
    permute_chunk(e, (unsigned int)jobs[2 * blockIdx.x + 1] * (unsigned int)chunk,
                  (unsigned int)chunk, [&](unsigned int i, unsigned int at) {
                      store_from_float(y, i, load_as_float(x, at));
                  });
}
