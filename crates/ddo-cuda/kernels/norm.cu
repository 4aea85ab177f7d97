// Row-wise kernels of DDO's CUDA backend: layer and RMS normalisation, group normalisation
// (chunked statistics, then an element-wise apply), softmax over the last dim, reductions
// over one dim. Compiled by NVRTC with ops/kernels.rs's PRELUDE in front. Accumulation is
// f32 with block (tree) reductions and two-pass variances, so large rows stay accurate;
// sequential loops accumulate in f64.

// One block per row (grid-stride over rows) of `rows` rows of `d` elements:
//   layer norm (rms == 0): y = (x - mean) / sqrt(var + eps) * w + b  (biased variance),
//   RMS norm   (rms == 1): y = x / sqrt(mean(x^2) + eps) * w.
// w and b may be null (0): scale 1, shift 0.
extern "C" __global__ void ddo_row_norm(const void* x, int xdt, const void* w, int wdt,
                                        const void* b, int bdt, void* y, int ydt, i64 rows,
                                        i64 d, float eps, int rms) {
    __shared__ float scratch[32];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        i64 base = r * d;
        float mean = 0.0f;
        if (!rms) {
            float s = 0.0f;
            for (i64 j = threadIdx.x; j < d; j += blockDim.x) s += load_as_float(x, base + j, xdt);
            mean = block_sum(s, scratch) / (float)d;
        }
        float s2 = 0.0f;
        for (i64 j = threadIdx.x; j < d; j += blockDim.x) {
            float c = load_as_float(x, base + j, xdt) - mean;
            s2 += c * c;
        }
        float inv = rsqrtf(block_sum(s2, scratch) / (float)d + eps);
        for (i64 j = threadIdx.x; j < d; j += blockDim.x) {
            float v = (load_as_float(x, base + j, xdt) - mean) * inv;
            if (w) v *= load_as_float(w, j, wdt);
            if (b) v += load_as_float(b, j, bdt);
            store_from_float(y, base + j, ydt, v);
        }
    }
}

// The same norms with one warp per row, for rows of at most 32 * NORM_WARP_MAX elements
// (e.g. Flux's per-head q/k RMS norms, d = 128): the row is read once into registers.
#define NORM_WARP_MAX 16
extern "C" __global__ void ddo_row_norm_warp(const void* x, int xdt, const void* w, int wdt,
                                             const void* b, int bdt, void* y, int ydt,
                                             i64 rows, i64 d, float eps, int rms) {
    int lane = threadIdx.x & 31;
    i64 warp = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    i64 warps = ((i64)gridDim.x * blockDim.x) >> 5;
    for (i64 r = warp; r < rows; r += warps) {
        i64 base = r * d;
        float v[NORM_WARP_MAX];
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < NORM_WARP_MAX; ++k) {
            i64 j = lane + 32 * k;
            v[k] = j < d ? load_as_float(x, base + j, xdt) : 0.0f;
            s += v[k];
        }
        float mean = rms ? 0.0f : warp_sum(s) / (float)d;
        float s2 = 0.0f;
#pragma unroll
        for (int k = 0; k < NORM_WARP_MAX; ++k) {
            i64 j = lane + 32 * k;
            float c = v[k] - mean;
            if (j < d) s2 += c * c;
        }
        float inv = rsqrtf(warp_sum(s2) / (float)d + eps);
#pragma unroll
        for (int k = 0; k < NORM_WARP_MAX; ++k) {
            i64 j = lane + 32 * k;
            if (j < d) {
                float o = (v[k] - mean) * inv;
                if (w) o *= load_as_float(w, j, wdt);
                if (b) o += load_as_float(b, j, bdt);
                store_from_float(y, base + j, ydt, o);
            }
        }
    }
}

// Vectorised layer/RMS norm for 16-bit x and y (any 16-bit dtype each) with rows of d
// elements, d % 8 == 0, x and y 16-byte aligned: each thread holds 8 contiguous elements
// of a row in registers (one 16-byte load, one 16-byte store), so the row is read once.
// Same results as ddo_row_norm up to f32 summation order.
__device__ __forceinline__ void load8(const void* x, i64 i, int dt, float* v) {
    uint4 raw = *(const uint4*)((const u16*)x + i);
    const u16* h = (const u16*)&raw;
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = dt == DTYPE_F16 ? f16_to_float(h[k]) : bf16_to_float(h[k]);
}
__device__ __forceinline__ void store8(void* y, i64 i, int dt, const float* v) {
    uint4 raw;
    u16* h = (u16*)&raw;
#pragma unroll
    for (int k = 0; k < 8; ++k) h[k] = dt == DTYPE_F16 ? float_to_f16(v[k]) : float_to_bf16(v[k]);
    *(uint4*)((u16*)y + i) = raw;
}
__device__ __forceinline__ void norm8(float* v, float mean, float inv, const void* w, int wdt,
                                      const void* b, int bdt, i64 col) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        float o = (v[k] - mean) * inv;
        if (w) o *= load_as_float(w, col + k, wdt);
        if (b) o += load_as_float(b, col + k, bdt);
        v[k] = o;
    }
}

// Short rows: g = d / 8 lanes per row (a power of two up to 32), 32 / g rows per warp;
// grid-stride over groups of rows.
extern "C" __global__ void ddo_row_norm_vec_warp(const void* x, int xdt, const void* w, int wdt,
                                                 const void* b, int bdt, void* y, int ydt,
                                                 i64 rows, i64 d, float eps, int rms) {
    const int g = (int)(d / 8);
    const int lane = threadIdx.x & 31;
    const int sub = lane % g;
    const i64 per_warp = 32 / g;
    i64 warp = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    i64 warps = ((i64)gridDim.x * blockDim.x) >> 5;
    for (i64 r0 = warp * per_warp; r0 < rows; r0 += warps * per_warp) {
        i64 r = r0 + lane / g;
        bool live = r < rows;
        i64 col = (i64)sub * 8;
        float v[8];
        if (live) {
            load8(x, r * d + col, xdt, v);
        } else {
#pragma unroll
            for (int k = 0; k < 8; ++k) v[k] = 0.0f;
        }
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < 8; ++k) s += v[k];
        for (int o = g / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        float mean = rms ? 0.0f : s / (float)d;
        float s2 = 0.0f;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            float c = v[k] - mean;
            s2 += c * c;
        }
        for (int o = g / 2; o > 0; o >>= 1) s2 += __shfl_xor_sync(0xffffffffu, s2, o);
        float inv = rsqrtf(s2 / (float)d + eps);
        if (live) {
            norm8(v, mean, inv, w, wdt, b, bdt, col);
            store8(y, r * d + col, ydt, v);
        }
    }
}

// Long rows: one block of d / 8 threads (a multiple of 32, at most 1024) per row.
extern "C" __global__ void ddo_row_norm_vec_block(const void* x, int xdt, const void* w, int wdt,
                                                  const void* b, int bdt, void* y, int ydt,
                                                  i64 rows, i64 d, float eps, int rms) {
    __shared__ float scratch[32];
    const i64 col = (i64)threadIdx.x * 8;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        float v[8];
        load8(x, r * d + col, xdt, v);
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < 8; ++k) s += v[k];
        float mean = rms ? 0.0f : block_sum(s, scratch) / (float)d;
        float s2 = 0.0f;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            float c = v[k] - mean;
            s2 += c * c;
        }
        float inv = rsqrtf(block_sum(s2, scratch) / (float)d + eps);
        norm8(v, mean, inv, w, wdt, b, bdt, col);
        store8(y, r * d + col, ydt, v);
    }
}

// Group-norm statistics, pass 1: block (chunk c, group g) writes the count, mean and sum of
// squared deviations (M2) of elements [c * chunk, min((c + 1) * chunk, len)) of group g
// (groups are contiguous runs of `len` elements) to part[(g * chunks + c) * 3 + 0..3].
extern "C" __global__ void ddo_group_stats(const void* x, int xdt, float* part, i64 groups,
                                           i64 len, i64 chunk, i64 chunks) {
    __shared__ float scratch[32];
    for (i64 g = blockIdx.y; g < groups; g += gridDim.y) {
        for (i64 c = blockIdx.x; c < chunks; c += gridDim.x) {
            i64 start = g * len + c * chunk;
            i64 n = len - c * chunk;
            if (n > chunk) n = chunk;
            float s = 0.0f;
            for (i64 j = threadIdx.x; j < n; j += blockDim.x) s += load_as_float(x, start + j, xdt);
            float mean = block_sum(s, scratch) / (float)n;
            float s2 = 0.0f;
            for (i64 j = threadIdx.x; j < n; j += blockDim.x) {
                float v = load_as_float(x, start + j, xdt) - mean;
                s2 += v * v;
            }
            float m2 = block_sum(s2, scratch);
            if (threadIdx.x == 0) {
                float* p = part + (g * chunks + c) * 3;
                p[0] = (float)n;
                p[1] = mean;
                p[2] = m2;
            }
        }
    }
}

// Group-norm statistics, pass 2: one thread per group merges its chunks (Chan et al.,
// in f64) into stats[g * 2 + 0..2] = (mean, 1 / sqrt(var + eps)).
extern "C" __global__ void ddo_group_merge(const float* part, float* stats, i64 groups,
                                           i64 chunks, float eps) {
    i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 g = (i64)blockIdx.x * blockDim.x + threadIdx.x; g < groups; g += stride) {
        double n = 0.0, mean = 0.0, m2 = 0.0;
        for (i64 c = 0; c < chunks; ++c) {
            const float* p = part + (g * chunks + c) * 3;
            double nb = p[0], mb = p[1], m2b = p[2];
            double tot = n + nb;
            double delta = mb - mean;
            mean += delta * nb / tot;
            m2 += m2b + delta * delta * n * nb / tot;
            n = tot;
        }
        stats[g * 2] = (float)mean;
        stats[g * 2 + 1] = (float)(1.0 / sqrt(m2 / n + (double)eps));
    }
}

// Group-norm apply: element i of x [n, c, spatial...] is in group i / len and channel
// (i / spatial) % channels; y = (x - mean) * inv * w[ch] + b[ch] (w, b may be null).
extern "C" __global__ void ddo_group_apply(const void* x, int xdt, const float* stats,
                                           const void* w, int wdt, const void* b, int bdt,
                                           void* y, int ydt, i64 total, i64 len, i64 spatial,
                                           i64 channels) {
    i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        i64 g = i / len;
        i64 ch = (i / spatial) % channels;
        float v = (load_as_float(x, i, xdt) - stats[g * 2]) * stats[g * 2 + 1];
        if (w) v *= load_as_float(w, ch, wdt);
        if (b) v += load_as_float(b, ch, bdt);
        store_from_float(y, i, ydt, v);
    }
}

// Softmax over rows of d elements, one block per row: y = exp(x - max) * (1 / sum).
extern "C" __global__ void ddo_softmax(const void* x, int xdt, void* y, int ydt, i64 rows,
                                       i64 d) {
    __shared__ float scratch[32];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        i64 base = r * d;
        float m = -__int_as_float(0x7f800000);
        for (i64 j = threadIdx.x; j < d; j += blockDim.x) m = fmaxf(m, load_as_float(x, base + j, xdt));
        m = block_max(m, scratch);
        float s = 0.0f;
        for (i64 j = threadIdx.x; j < d; j += blockDim.x) s += expf(load_as_float(x, base + j, xdt) - m);
        float inv = 1.0f / block_sum(s, scratch);
        for (i64 j = threadIdx.x; j < d; j += blockDim.x) {
            store_from_float(y, base + j, ydt, expf(load_as_float(x, base + j, xdt) - m) * inv);
        }
    }
}

#define R_SUM 0
#define R_MEAN 1
#define R_MAX 2

// Reduction of contiguous rows (inner == 1): one block per output, out[r] = op(x[r, :]).
extern "C" __global__ void ddo_reduce_rows(const void* x, int xdt, void* y, int ydt, i64 rows,
                                           i64 len, int op) {
    __shared__ float scratch[32];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        i64 base = r * len;
        float v;
        if (op == R_MAX) {
            float m = -__int_as_float(0x7f800000);
            for (i64 j = threadIdx.x; j < len; j += blockDim.x) m = fmaxf(m, load_as_float(x, base + j, xdt));
            v = block_max(m, scratch);
        } else {
            // -0.0 starts the sum, as Rust's float `Sum` does on the host (an empty sum is -0).
            float s = -0.0f;
            for (i64 j = threadIdx.x; j < len; j += blockDim.x) s += load_as_float(x, base + j, xdt);
            v = block_sum(s, scratch);
            if (op == R_MEAN) v = v / (float)len;
        }
        if (threadIdx.x == 0) store_from_float(y, r, ydt, v);
    }
}

// Reduction over the middle dim of x [outer, len, inner] (inner > 1): one thread per output
// (o, i), reading down the column (coalesced across i); sums accumulate in f64.
extern "C" __global__ void ddo_reduce_cols(const void* x, int xdt, void* y, int ydt,
                                           i64 outer, i64 len, i64 inner, int op) {
    i64 n = outer * inner;
    i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += stride) {
        i64 o = k / inner, i = k - o * inner;
        i64 base = o * len * inner + i;
        float v;
        if (op == R_MAX) {
            float m = -__int_as_float(0x7f800000);
            for (i64 j = 0; j < len; ++j) m = fmaxf(m, load_as_float(x, base + j * inner, xdt));
            v = m;
        } else {
            double s = -0.0;  // as on the host: an empty sum is -0
            for (i64 j = 0; j < len; ++j) s += (double)load_as_float(x, base + j * inner, xdt);
            if (op == R_MEAN) s = s / (double)len;
            v = (float)s;
        }
        store_from_float(y, k, ydt, v);
    }
}
