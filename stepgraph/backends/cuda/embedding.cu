// Embedding lookup and its weight gradient, deterministic (no float atomics).
// forward: out[i, :] = weight[idx[i], :] for every position i of the flattened indices; an
// index outside [0, V) gives a row of NaN (a guarded step then skips its update).
// backward (dweight = the rows of dy summed per index), two ways chosen by the launcher:
// - scan (small vocabularies): a block per (vocabulary row, column chunk, position segment)
//   scans the segment's indices; its 8 warps take interleaved tiles of 32 positions, each warp
//   sums the rows of its matches in position order, and the warps' partial sums are added in
//   warp order; several segments (the launcher's: enough blocks for the GPU) each write their
//   sums to a partial table, which embedding_scan_sum_kernel adds in segment order.
// - sorted: a stable LSD radix sort of (index, position) pairs by index (8 bits a pass:
//   per-block digit histograms, one exclusive scan, a stable scatter; integer atomics count
//   in shared memory only, placement follows position order), then a warp per (vocabulary
//   row, column chunk) finds its run of sorted positions by binary search and sums their dy
//   rows in position order: the order of numpy's np.add.at. Rows no index hits get zeros.
// Indices are int or long long (templates); invalid ones sort into bucket V, which no
// vocabulary row reads.

// float16 (T = fp16_bits; a model.half()): the lookup moves the table's values, the gradient
// sums float16 dy rows in float32 in the same order and rounds each sum once on store.
#include "launch_order.cuh"
#include "bf16.cuh"

#define FULL_MASK 0xffffffffu
#define QUIET_NAN __int_as_float(0x7fc00000)
#define RADIX_BITS 8
#define RADIX 256                // digits of a pass; a scatter block has one thread per digit
#define SORT_TILE 1024           // positions per block of the histogram and scatter kernels
#define SORT_WARPS (RADIX / 32)
#define SCAN_WARPS 8             // warps of a scan-path block (blockDim (32, SCAN_WARPS))

template <typename L>
__device__ __forceinline__ int sort_key(const L* keys, long long i, int V) {
    const L k = keys[i];
    return (k >= 0 && k < (L)V) ? (int)k : V;
}

// out[i, c] = weight[idx[i], c]; vec 4: C % 4 == 0 and both pointers 16-byte aligned, each
// thread copying float4s. Elements are (row, group) pairs of the flattened output.
// T: the storage of weight and out, float or fp16_bits (float16: 4 elements are one 8-byte
// copy; a float16 value survives its widening to float and back exactly).
template <typename L, typename T = float>
__global__ void embedding_forward_kernel(const T* weight, const L* idx, T* out,
                                         long long n, int V, int C, int vec) {
    await_previous_kernel();
    const int groups = C / vec;
    const long long total = n * groups;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long row = i / groups;
        const int g = (int)(i - row * groups);
        const L k = idx[row];
        const bool valid = k >= 0 && k < (L)V;
        if (vec == 4) {
            float v[4] = {QUIET_NAN, QUIET_NAN, QUIET_NAN, QUIET_NAN};
            if (valid) loadv_as_float<4>(weight, ((long long)k * groups + g) * 4, v);
            storev_from_float<4>(out, i * 4, v);
        } else {
            store_from_float(out, i, valid ? load_as_float(weight, (long long)k * C + g)
                                           : QUIET_NAN);
        }
    }
}

__device__ __forceinline__ void add4(float4& a, const float4& b) {
    a.x += b.x;
    a.y += b.y;
    a.z += b.z;
    a.w += b.w;
}

// Adds the vec (1 or 4) dy values at element e to acc, widened to float.
template <typename T>
__device__ __forceinline__ void add_dy(float4& acc, const T* dy, long long e, int vec) {
    if (vec == 4) {
        float v[4];
        loadv_as_float<4>(dy, e, v);
        add4(acc, make_float4(v[0], v[1], v[2], v[3]));
    } else {
        acc.x += load_as_float(dy, e);
    }
}

// dweight's vec (1 or 4) values at element e, each rounded once to T.
template <typename T>
__device__ __forceinline__ void store_sum(T* dweight, long long e, const float4& acc, int vec) {
    const float v[4] = {acc.x, acc.y, acc.z, acc.w};
    if (vec == 4) storev_from_float<4>(dweight, e, v);
    else store_from_float(dweight, e, acc.x);
}

// Scan path. grid (V, column chunks, position segments), block (32, SCAN_WARPS). Lane l of a
// chunk owns columns [(chunk * 32 + l) * vec, + vec). Segment z covers positions [z * seg,
// (z + 1) * seg) (seg a multiple of 32 * SCAN_WARPS); its warp w visits the tiles of 32
// positions starting at z * seg + w * 32, + SCAN_WARPS * 32, ...; within a tile, the matches
// in position order. One segment: the sums go to dweight; several: to the segment's row of
// `sums` [segments, V * C] (float), for embedding_scan_sum_kernel.
template <typename L, typename T = float>
__global__ void __launch_bounds__(32 * SCAN_WARPS)
embedding_backward_scan_kernel(const T* dy, const L* idx, T* dweight, float* sums, int n,
                               int V, int C, int vec, int seg) {
    await_previous_kernel();
    __shared__ float4 partial[SCAN_WARPS][32];
    const int lane = threadIdx.x, warp = threadIdx.y;
    const int groups = C / vec;
    const int start = blockIdx.z * seg, end = min(n, start + seg);
    float* out = gridDim.z > 1 ? sums + (long long)blockIdx.z * V * C : nullptr;
    for (int v = blockIdx.x; v < V; v += gridDim.x) {
        for (int g0 = blockIdx.y * 32; g0 < groups; g0 += gridDim.y * 32) {
            const int g = g0 + lane;
            const bool mine = g < groups;
            float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
            for (int base = start + warp * 32; base < end; base += 32 * SCAN_WARPS) {
                const int i = base + lane;
                unsigned int hits = __ballot_sync(FULL_MASK, i < end && idx[i] == (L)v);
                while (hits) {
                    const long long p = base + __ffs(hits) - 1;
                    hits &= hits - 1;
                    if (!mine) continue;
                    add_dy(acc, dy, (p * groups + g) * vec, vec);
                }
            }
            partial[warp][lane] = acc;
            __syncthreads();
            if (warp == 0 && mine) {
                float4 total = partial[0][lane];
                for (int w = 1; w < SCAN_WARPS; ++w) add4(total, partial[w][lane]);
                const long long e = ((long long)v * groups + g) * vec;
                if (out) store_sum(out, e, total, vec);
                else store_sum(dweight, e, total, vec);
            }
            __syncthreads();  // partial is reused by the next chunk
        }
    }
}

// dweight[i] = the segments' sums[z * total + i] added in segment order, rounded once to T.
template <typename T>
__global__ void embedding_scan_sum_kernel(const float* sums, T* dweight, int total,
                                          int segments) {
    await_previous_kernel();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        float s = sums[i];
        for (int z = 1; z < segments; ++z) s += sums[(long long)z * total + i];
        store_from_float(dweight, i, s);
    }
}

// Sort pass, step 1: hist[d * gridDim.x + b] = how many keys of block b's tile have digit d
// (bits [shift, shift + 8) of the key). Shared-memory integer counts: order-free.
template <typename L>
__global__ void __launch_bounds__(RADIX)
embedding_sort_histogram_kernel(const L* keys, int* hist, int n, int V, int shift) {
    await_previous_kernel();
    __shared__ int counts[RADIX];
    counts[threadIdx.x] = 0;
    __syncthreads();
    const long long start = (long long)blockIdx.x * SORT_TILE;
    const long long end = min(start + SORT_TILE, (long long)n);
    for (long long i = start + threadIdx.x; i < end; i += RADIX)
        atomicAdd(&counts[(sort_key(keys, i, V) >> shift) & (RADIX - 1)], 1);
    __syncthreads();
    hist[threadIdx.x * gridDim.x + blockIdx.x] = counts[threadIdx.x];
}

// Sort pass, step 2: exclusive prefix sum of hist (m ints) in place; one block of 1024
// threads, each scanning a contiguous segment.
extern "C" __global__ void __launch_bounds__(1024)
embedding_sort_scan_kernel(int* hist, int m) {
    await_previous_kernel();
    __shared__ int warp_sums[32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int per = (m + blockDim.x - 1) / blockDim.x;
    const int lo = min(tid * per, m), hi = min(lo + per, m);
    int sum = 0;
    for (int i = lo; i < hi; ++i) sum += hist[i];
    int incl = sum;  // inclusive scan of the threads' sums: warps, then the warps' totals
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int t = __shfl_up_sync(FULL_MASK, incl, o);
        if (lane >= o) incl += t;
    }
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        int w = lane < (int)(blockDim.x >> 5) ? warp_sums[lane] : 0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int t = __shfl_up_sync(FULL_MASK, w, o);
            if (lane >= o) w += t;
        }
        warp_sums[lane] = w;
    }
    __syncthreads();
    int offset = incl - sum + (warp > 0 ? warp_sums[warp - 1] : 0);
    for (int i = lo; i < hi; ++i) {
        const int c = hist[i];
        hist[i] = offset;
        offset += c;
    }
}

// Sort pass, step 3: stable scatter. Block b walks its tile in rounds of RADIX positions, in
// order; a key's destination is its digit's running offset for the block (from the scan),
// plus the same-digit keys of earlier warps in the round (per-digit prefix over warps), plus
// those of lower lanes in its warp (__match_any_sync). vals_in null: the value is the
// position itself (first pass).
template <typename L>
__global__ void __launch_bounds__(RADIX)
embedding_sort_scatter_kernel(const L* keys_in, const int* vals_in, int* keys_out,
                              int* vals_out, const int* hist, int n, int V, int shift) {
    await_previous_kernel();
    __shared__ int base[RADIX];
    __shared__ int warp_counts[SORT_WARPS][RADIX];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    base[tid] = hist[tid * gridDim.x + blockIdx.x];
    const long long start = (long long)blockIdx.x * SORT_TILE;
    for (int round = 0; round < SORT_TILE; round += RADIX) {
        const long long i = start + round + tid;
        const bool valid = i < n;
        const int key = valid ? sort_key(keys_in, i, V) : 0;
        const int digit = valid ? (key >> shift) & (RADIX - 1) : RADIX;
        for (int d = lane; d < RADIX; d += 32) warp_counts[warp][d] = 0;
        __syncwarp();
        const unsigned int peers = __match_any_sync(FULL_MASK, digit);
        const int rank = __popc(peers & ((1u << lane) - 1u));
        if (valid && rank == 0) warp_counts[warp][digit] = __popc(peers);
        __syncthreads();
        int run = base[tid];  // thread tid: digit tid's offsets for each warp of the round
        for (int w = 0; w < SORT_WARPS; ++w) {
            const int c = warp_counts[w][tid];
            warp_counts[w][tid] = run;
            run += c;
        }
        base[tid] = run;
        __syncthreads();
        if (valid) {
            const int dst = warp_counts[warp][digit] + rank;
            keys_out[dst] = key;
            vals_out[dst] = vals_in ? vals_in[i] : (int)i;
        }
        __syncthreads();  // warp_counts is rewritten by the next round
    }
}

// First sorted position whose key is >= v (keys ascending, n of them).
__device__ __forceinline__ int lower_bound(const int* keys, int n, int v) {
    int lo = 0, hi = n;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (keys[mid] < v) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

// Sorted path, the sums. block (32, rows per block); grid (row groups, column chunks), both
// strided. Warp (row v, chunk): dweight[v, chunk] = sum over v's positions in sorted (= position)
// order of dy[position, chunk].
template <typename T>
__global__ void embedding_backward_sorted_kernel(const T* dy, const int* keys,
                                                 const int* positions, T* dweight, int n, int V,
                                                 int C, int vec) {
    await_previous_kernel();
    const int lane = threadIdx.x, groups = C / vec;
    for (int v = blockIdx.x * blockDim.y + threadIdx.y; v < V; v += gridDim.x * blockDim.y) {
        const int lo = lower_bound(keys, n, v), hi = lower_bound(keys, n, v + 1);
        for (int g = blockIdx.y * 32 + lane; g < groups; g += gridDim.y * 32) {
            float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
            for (int j = lo; j < hi; ++j)
                add_dy(acc, dy, ((long long)positions[j] * groups + g) * vec, vec);
            store_sum(dweight, ((long long)v * groups + g) * vec, acc, vec);
        }
    }
}
