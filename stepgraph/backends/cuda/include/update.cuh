// What every multi-tensor optimizer update shares (optim_sgd.cu, optim_adam.cu,
// optim_rmsprop.cu, optim_adagrad.cu; optim.cu's weight copies): the device table row of a
// parameter, the chunked loop over every parameter, the guard's skip, gradient clipping and
// the update direction. Formulas, operation order and rounding follow the numpy reference
// (PyTorch's); __f*_rn keep the compiler from fusing a product and a sum into one FMA.
#pragma once
#include "bf16.cuh"

// One row of the device table built once per update node by optim.py: the tensors of one
// parameter (slots unused by the optimizer are null; the copy in p's element order unless
// transposed, below), whether all of them are 16-byte aligned (float4 path), and `row`: the
// parameter's row of the hyperparameters (ops/optim.py hyper_rows), read at every launch, so
// that a write from the host between steps takes effect without a new table or capture.
// `kinds` holds storage codes (bf16.cuh STORAGE_*): bits 0-7 the gradient's, float32 or bf16
// bits (precision="bf16", where the update reads the bf16 gradient of the weight's copy and
// widens it itself, exactly as the dropped cast would have: compile/fuse.py
// fuse_gradient_casts) or float16; bits 8-15 the parameter's and its
// state's, float32 or float16 (model.half()); bit 16 GRAD_TRANSPOSED, bit 17 COPY_TRANSPOSED;
// bits 24-31 the weight copy's, bf16 (precision="bf16") or float32 (a channels-last step's
// transposed conv weight, compile/weight_permutes.py).
struct UpdateEntry {
    void* p;
    const void* g;
    void* s0;  // SGD momentum buffer / Adam exp_avg / RMSprop square_avg / Adagrad sum
    void* s1;  // Adam exp_avg_sq / RMSprop grad_avg
    void* s2;  // Adam max_exp_avg_sq / RMSprop momentum_buffer
    void* copy;  // weight copy of p (null: none)
    long long n;
    long long aligned;
    long long kinds;
    long long row;
    // A transposed entry (kinds GRAD_TRANSPOSED or COPY_TRANSPOSED): the gradient, or the copy,
    // holds each axis-0 slice of p, (cols, rest) in p, as (rest, cols): a conv weight's
    // channels-last order. Its blocks update `span` elements each, whole slices. Else 0.
    long long cols;
    long long rest;
    long long span;
};

#define GRAD_TRANSPOSED (1LL << 16)
#define COPY_TRANSPOSED (1LL << 17)

// The storage code (bf16.cuh STORAGE_*) of an entry's weight copy.
__device__ __forceinline__ int copy_kind(const UpdateEntry& e) {
    return (int)((e.kinds >> 24) & 0xff);
}

// The table row of the parameter block blockIdx.x updates.
__device__ __forceinline__ const UpdateEntry& block_entry(const UpdateEntry* entries,
                                                          const int2* blocks) {
    return entries[blocks[blockIdx.x].x];
}

// The block's hyperparameter row (width float64 columns, ops/optim.py HYPER_COLUMNS).
__device__ __forceinline__ const double* block_hyper(const UpdateEntry* entries,
                                                     const int2* blocks, const double* hyper,
                                                     int width) {
    return hyper + block_entry(entries, blocks).row * (long long)width;
}

// A transposed entry's block: elements [start, end), whole slices, moved through the tile,
// whose row k (row k % rest of slice k / rest) holds the slice's (rest, cols) row k at cols + 1
// floats a row (the pad spreads a column's reads over the banks). The transposed gradient is
// read in its own order into the tile; then every element is updated in p's order, reading its
// gradient from the tile and leaving its new value there for a transposed copy; then the copy
// is written in its own order. Each global access runs along memory, four elements a thread
// (float4 where e.aligned: the tensors 16-byte aligned and the span a multiple of 4), so that
// as many bytes are in flight as in the plain loop; a thread steps its tile positions from
// one division a group of four.
template <typename Element>
__device__ __forceinline__ void update_slices(const UpdateEntry& e, long long start,
                                              long long end, int slots, Element element) {
    extern __shared__ float tile[];
    const int cols = (int)e.cols, rest = (int)e.rest, pitch = cols + 1;
    const int count = (int)(end - start);
    const bool u0 = slots & 1, u1 = slots & 2, u2 = slots & 4;
    const bool gt = e.kinds & GRAD_TRANSPOSED, ct = e.kinds & COPY_TRANSPOSED;
    const int gk = (int)(e.kinds & 0xff), pk = (int)((e.kinds >> 8) & 0xff);
    const int ck = copy_kind(e);
    if (gt) {
        for (int j = 4 * threadIdx.x; j < count; j += 4 * blockDim.x) {
            const int m = min(4, count - j);
            float g[4];
            if (e.aligned && m == 4) load4_either_as_float(e.g, gk, start + j, g);
            else for (int k = 0; k < m; ++k) g[k] = load_either_as_float(e.g, gk, start + j + k);
            int row = j / cols, c = j - row * cols;
            for (int k = 0; k < m; ++k) {
                tile[row * pitch + c] = g[k];
                if (++c == cols) c = 0, ++row;
            }
        }
        __syncthreads();
    }
    for (int q = 4 * threadIdx.x; q < count; q += 4 * blockDim.x) {
        const int m = min(4, count - q);
        const long long i = start + q;
        int at[4];
        {   // q = ((s * cols) + c) * rest + r in p's order
            int sc = q / rest, r = q - sc * rest, s = sc / cols, c = sc - s * cols;
            for (int k = 0; k < 4; ++k) {
                at[k] = (s * rest + r) * pitch + c;
                if (++r == rest) {
                    r = 0;
                    if (++c == cols) c = 0, ++s;
                }
            }
        }
        float p[4], g[4], a[4] = {0.f, 0.f, 0.f, 0.f}, b[4] = {0.f, 0.f, 0.f, 0.f},
                          c[4] = {0.f, 0.f, 0.f, 0.f};
        if (e.aligned && m == 4) {
            load4_either_as_float(e.p, pk, i, p);
            if (!gt) load4_either_as_float(e.g, gk, i, g);
            if (u0) load4_either_as_float(e.s0, pk, i, a);
            if (u1) load4_either_as_float(e.s1, pk, i, b);
            if (u2) load4_either_as_float(e.s2, pk, i, c);
        } else {
            for (int k = 0; k < m; ++k) {
                p[k] = load_either_as_float(e.p, pk, i + k);
                if (!gt) g[k] = load_either_as_float(e.g, gk, i + k);
                if (u0) a[k] = load_either_as_float(e.s0, pk, i + k);
                if (u1) b[k] = load_either_as_float(e.s1, pk, i + k);
                if (u2) c[k] = load_either_as_float(e.s2, pk, i + k);
            }
        }
        for (int k = 0; k < m; ++k) {
            element(p[k], gt ? tile[at[k]] : g[k], a[k], b[k], c[k]);
            if (ct) tile[at[k]] = p[k];    // a slot this thread alone reads and writes
        }
        if (e.aligned && m == 4) {
            store4_either_from_float(e.p, pk, i, p);
            if (e.copy && !ct) store4_either_from_float(e.copy, ck, i, p);
            if (u0) store4_either_from_float(e.s0, pk, i, a);
            if (u1) store4_either_from_float(e.s1, pk, i, b);
            if (u2) store4_either_from_float(e.s2, pk, i, c);
        } else {
            for (int k = 0; k < m; ++k) {
                store_either_from_float(e.p, pk, i + k, p[k]);
                if (e.copy && !ct) store_either_from_float(e.copy, ck, i + k, p[k]);
                if (u0) store_either_from_float(e.s0, pk, i + k, a[k]);
                if (u1) store_either_from_float(e.s1, pk, i + k, b[k]);
                if (u2) store_either_from_float(e.s2, pk, i + k, c[k]);
            }
        }
    }
    if (ct) {
        __syncthreads();
        for (int j = 4 * threadIdx.x; j < count; j += 4 * blockDim.x) {
            const int m = min(4, count - j);
            float v[4];
            int row = j / cols, c = j - row * cols;
            for (int k = 0; k < m; ++k) {
                v[k] = tile[row * pitch + c];
                if (++c == cols) c = 0, ++row;
            }
            if (e.aligned && m == 4) store4_either_from_float(e.copy, ck, start + j, v);
            else
                for (int k = 0; k < m; ++k)
                    store_either_from_float(e.copy, ck, start + j + k, v[k]);
        }
    }
}

// The multi-tensor loop every optimizer shares. Block k updates chunk blocks[k] = (parameter,
// chunk index): elements [chunk * index, min(chunk * (index + 1), n)), four a thread (one
// float4 of each tensor where the parameter's tensors are aligned; chunk is a multiple of 4,
// so float4 groups never straddle a chunk); a transposed entry's block, its span instead,
// through update_slices. element(p, g, s0, s1, s2) updates one element in
// place; the state tensors whose bit is set in `slots` (1: s0, 2: s1, 4: s2) are read and
// written back, the others read as 0.
// SLICED: the launch's jobs are all transposed entries' (optim.py launches the plain and the
// sliced jobs apart). Each kernel compiles one path only: with both, Adam's update held 84
// registers a thread (two blocks of 256 an SM), the plain path alone 51 (four blocks), and on
// the gpt's 10.8M parameters (H200) took 118 µs against 182 at 1,024 elements a block.
template <bool SLICED, typename Element>
__device__ __forceinline__ void update_chunk(const UpdateEntry* entries, const int2* blocks,
                                             int chunk, int slots, Element element) {
    const int2 job = blocks[blockIdx.x];
    const UpdateEntry e = entries[job.x];
    if constexpr (SLICED) {
        const long long start = (long long)job.y * e.span;
        update_slices(e, start, min(start + e.span, e.n), slots, element);
        return;
    }
    const long long start = (long long)job.y * chunk, end = min(start + chunk, e.n);
    const bool u0 = slots & 1, u1 = slots & 2, u2 = slots & 4;
    const int gk = (int)(e.kinds & 0xff), pk = (int)((e.kinds >> 8) & 0xff), ck = copy_kind(e);
    for (long long i = start + 4 * (long long)threadIdx.x; i < end; i += 4LL * blockDim.x) {
        if (e.aligned && i + 4 <= end) {
            float p[4], g[4], a[4] = {0.f, 0.f, 0.f, 0.f}, b[4] = {0.f, 0.f, 0.f, 0.f},
                                 c[4] = {0.f, 0.f, 0.f, 0.f};
            load4_either_as_float(e.p, pk, i, p);
            load4_either_as_float(e.g, gk, i, g);
            if (u0) load4_either_as_float(e.s0, pk, i, a);
            if (u1) load4_either_as_float(e.s1, pk, i, b);
            if (u2) load4_either_as_float(e.s2, pk, i, c);
            for (int k = 0; k < 4; ++k) element(p[k], g[k], a[k], b[k], c[k]);
            store4_either_from_float(e.p, pk, i, p);
            if (e.copy) store4_either_from_float(e.copy, ck, i, p);
            if (u0) store4_either_from_float(e.s0, pk, i, a);
            if (u1) store4_either_from_float(e.s1, pk, i, b);
            if (u2) store4_either_from_float(e.s2, pk, i, c);
        } else {
            for (long long j = i; j < i + 4 && j < end; ++j) {
                float p = load_either_as_float(e.p, pk, j);
                float a = u0 ? load_either_as_float(e.s0, pk, j) : 0.f;
                float b = u1 ? load_either_as_float(e.s1, pk, j) : 0.f;
                float c = u2 ? load_either_as_float(e.s2, pk, j) : 0.f;
                element(p, load_either_as_float(e.g, gk, j), a, b, c);
                store_either_from_float(e.p, pk, j, p);
                if (e.copy) store_either_from_float(e.copy, ck, j, p);
                if (u0) store_either_from_float(e.s0, pk, j, a);
                if (u1) store_either_from_float(e.s1, pk, j, b);
                if (u2) store_either_from_float(e.s2, pk, j, c);
            }
        }
    }
}

// A guarded update (guard: the step's guard flags, else null) writes nothing when guard_advance
// marked the step skipped (flags[1]): the whole block returns before touching a tensor.
__device__ __forceinline__ int skipped(const int* guard) {
    return guard != nullptr && guard[1] != 0;
}

// Gradient clipping coefficient min(1, max_norm / (norm + 1e-6)) in float64, as the reference.
__device__ __forceinline__ float clip_coef(int clip, const float* norm, double max_norm) {
    return clip ? (float)fmin(1.0, max_norm / ((double)*norm + 1e-6)) : 1.f;
}

// What every update steps along (ops/optim.py _direction): the gradient clipped, negated for
// maximize, plus weight_decay * p (PyTorch's order).
__device__ __forceinline__ float direction(float g, float p, float coef, int maximize,
                                           int has_weight_decay, float weight_decay) {
    float d = coef != 1.f ? __fmul_rn(g, coef) : g;
    if (maximize) d = -d;
    if (has_weight_decay) d = __fadd_rn(d, __fmul_rn(weight_decay, p));
    return d;
}
