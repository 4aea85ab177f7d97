// Row-wise kernels of DDO's CUDA backend: layer and RMS normalisation, group normalisation
// (chunked statistics, then an element-wise apply), softmax over the last dim, reductions
// over one dim, the count of non-finite elements. Compiled by NVRTC with ops/kernels.rs's PRELUDE in front. Accumulation is
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
// Eight elements of a row vector (a norm's weight, a modulation's scale or shift) from
// element i, as f32: 16-byte loads where the vector sits on a 16-byte boundary there, else
// element by element (the values are the same).
__device__ __forceinline__ void load8_row(const void* p, i64 i, int dt, float* v) {
    const u64 at = (u64)p + (u64)i * (dt == DTYPE_F32 ? 4ull : 2ull);
    if ((at & 15ull) == 0) {
        if (dt != DTYPE_F32) {
            load8(p, i, dt, v);
            return;
        }
        const float4 a = *(const float4*)at, b = *((const float4*)at + 1);
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
        v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
        return;
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = load_as_float(p, i + k, dt);
}

// n / m for n >= 0, m > 0, in 32 bits where both fit: a 64-bit division is emulated in
// software, dozens of instructions for each 8 elements a thread moves.
__device__ __forceinline__ i64 div_idx(i64 n, i64 m) {
    if (((n | m) >> 32) == 0) return (i64)((u32)n / (u32)m);
    return n / m;
}

__device__ __forceinline__ void norm8(float* v, float mean, float inv, const void* w, int wdt,
                                      const void* b, int bdt, i64 col) {
    float wv[8], bv[8];
    if (w) load8_row(w, col, wdt, wv);
    if (b) load8_row(b, col, bdt, bv);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        float o = (v[k] - mean) * inv;
        if (w) o *= wv[k];
        if (b) o += bv[k];
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

// Ops::attention_input, fused, for 16-bit x and y of one dtype dt: x rows [b, l, h, d]
// (row r = (bi * l + t) * h + hi) written to y [b, h, total, d] at row start + t of head hi.
// Lanes as ddo_row_norm_vec_warp (g = d / 8 lanes a row, a power of two up to 32; 32 / g rows
// a warp). With `norm`, that kernel's RMS norm (the same sums in the same order) times w,
// rounded to dt as it stores it; with tables c, s (f32 [total, d]), ddo_rope_vec's pairs at
// the row's position. Each stage rounds where the op it replaces does, so the bytes are
// those of rms_norm, permute and rope in a row.
__device__ __forceinline__ float round16(int dt, float v) {
    return dt == DTYPE_F16 ? f16_to_float(float_to_f16(v)) : bf16_to_float(float_to_bf16(v));
}
extern "C" __global__ void ddo_attention_input_vec(const void* x, const void* w, int wdt,
                                                   const float* c, const float* s, void* y,
                                                   int dt, i64 rows, i64 l, i64 h, i64 d,
                                                   i64 start, i64 total, float eps, int norm) {
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
            load8(x, r * d + col, dt, v);
        } else {
#pragma unroll
            for (int k = 0; k < 8; ++k) v[k] = 0.0f;
        }
        if (norm) {
            const float mean = 0.0f;
            float s2 = 0.0f;
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                float cc = v[k] - mean;
                s2 += cc * cc;
            }
            for (int o = g / 2; o > 0; o >>= 1) s2 += __shfl_xor_sync(0xffffffffu, s2, o);
            float inv = rsqrtf(s2 / (float)d + eps);
            norm8(v, mean, inv, w, wdt, 0, DTYPE_F32, col);
#pragma unroll
            for (int k = 0; k < 8; ++k) v[k] = round16(dt, v[k]);
        }
        if (!live) continue;
        i64 bt = div_idx(r, h), hi = r - bt * h;
        i64 bi = div_idx(bt, l), t = bt - bi * l;
        i64 pos = start + t;
        if (c) {
            float cr[8], sr[8];
            load8_row(c, pos * d + col, DTYPE_F32, cr);
            load8_row(s, pos * d + col, DTYPE_F32, sr);
#pragma unroll
            for (int k = 0; k < 8; k += 2) {
                float x0 = v[k], x1 = v[k + 1];
                v[k] = x0 * cr[k] - x1 * sr[k];
                v[k + 1] = x1 * cr[k + 1] + x0 * sr[k + 1];
            }
        }
        store8(y, ((bi * h + hi) * total + pos) * d + col, dt, v);
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

// ---- Group normalisation ------------------------------------------------------------------
// x [n, c, spatial...] in groups of cg = c / groups channels: group g (of n * groups) is the
// contiguous run of len = cg * spatial elements at g * len, and channel plane p (of n * c) the
// run of `spatial` elements at p * spatial, in group p / cg, channel p % c. Three launches
// (ops/norm.rs):
//   1. statistics per chunk of a group (count, mean, sum of squared deviations M2), two passes
//      over the chunk: held in registers (ddo_group_stats_vec_*) or read twice (ddo_group_stats);
//   2. ddo_group_merge: one warp per group merges its chunks (Chan et al., in f64) into
//      (mean, 1 / sqrt(var + eps));
//   3. apply, one channel plane per block row (no division per element):
//      y = (x - mean) * (inv * w[ch]) + b[ch], then SiLU for the fused op, rounded once into
//      y's dtype (ddo_group_apply_vec_* / ddo_group_silu_vec_*, else ddo_group_apply).

// Word i (0..3) of a 16-byte vector (i is a constant after unrolling: no local memory).
__device__ __forceinline__ u32 gn_word(const uint4& v, int i) {
    return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

// Lane k of a 16-byte vector of dtype DT (4 f32 lanes, or 8 of f16/bf16; lane 2i is the low
// half of word i), as f32.
template <int DT>
__device__ __forceinline__ float gn_lane(const uint4& v, int k) {
    if constexpr (DT == DTYPE_F32) {
        return __uint_as_float(gn_word(v, k));
    } else {
        u32 w = gn_word(v, k >> 1);
        if constexpr (DT == DTYPE_BF16) {
            return __uint_as_float((k & 1) ? (w & 0xffff0000u) : (w << 16));
        } else {
            return f16_to_float((u16)((k & 1) ? (w >> 16) : (w & 0xffffu)));
        }
    }
}

// Two f32 values rounded (to nearest even) into the 16-bit pair of one word, `lo` in the low
// half. From sm_80 one cvt per pair (a NaN becomes the canonical NaN); before, the prelude's
// scalar conversions.
template <int DT>
__device__ __forceinline__ u32 gn_pack2(float lo, float hi) {
#if __CUDA_ARCH__ >= 800
    u32 r;
    if constexpr (DT == DTYPE_BF16) {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    }
    return r;
#else
    if constexpr (DT == DTYPE_BF16) {
        return (u32)float_to_bf16(lo) | ((u32)float_to_bf16(hi) << 16);
    } else {
        return (u32)float_to_f16(lo) | ((u32)float_to_f16(hi) << 16);
    }
#endif
}

// W = 16 / element size f32 values as one 16-byte vector of dtype DT.
template <int DT>
__device__ __forceinline__ uint4 gn_pack(const float* f) {
    uint4 r;
    if constexpr (DT == DTYPE_F32) {
        r.x = __float_as_uint(f[0]);
        r.y = __float_as_uint(f[1]);
        r.z = __float_as_uint(f[2]);
        r.w = __float_as_uint(f[3]);
    } else {
        r.x = gn_pack2<DT>(f[0], f[1]);
        r.y = gn_pack2<DT>(f[2], f[3]);
        r.z = gn_pack2<DT>(f[4], f[5]);
        r.w = gn_pack2<DT>(f[6], f[7]);
    }
    return r;
}

// SiLU of the fused op, x * sigmoid(x) = x / (1 + e^-x) in f32 with the fast exponential and
// division (a few ulp, far below a 16-bit rounding): x -> -inf gives -0 (NaN at -inf, as
// -inf * 0), +inf stays +inf, NaN stays NaN.
__device__ __forceinline__ float gn_silu(float x) { return __fdividef(x, 1.0f + __expf(-x)); }

// Group-norm statistics, scalar pass 1 (any dtype, any length, any alignment): block (chunk c,
// group g) writes the count, mean and M2 of elements [c * chunk, min((c + 1) * chunk, len)) of
// group g to part[(g * chunks + c) * 3 + 0..3], reading the chunk twice. The mean is summed
// about the chunk's first element, so a mean far from 0 (against the spread) stays accurate.
extern "C" __global__ void ddo_group_stats(const void* x, int xdt, float* part, i64 groups,
                                           i64 len, i64 chunk, i64 chunks) {
    __shared__ float scratch[32];
    for (i64 g = blockIdx.y; g < groups; g += gridDim.y) {
        for (i64 c = blockIdx.x; c < chunks; c += gridDim.x) {
            i64 start = g * len + c * chunk;
            i64 n = len - c * chunk;
            if (n > chunk) n = chunk;
            const float shift = load_as_float(x, start, xdt);
            float s = 0.0f;
            for (i64 j = threadIdx.x; j < n; j += blockDim.x) {
                s += load_as_float(x, start + j, xdt) - shift;
            }
            float mean = shift + block_sum(s, scratch) / (float)n;
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

// Group-norm statistics, vectorised pass 1 (ops/norm.rs: GROUP_STATS_VPT): groups of len_vec
// whole 16-byte vectors (x 16-byte aligned, len a multiple of W), chunks of chunk_vec <=
// blockDim.x * GN_STATS_VPT vectors. Each thread loads its (at most) GN_STATS_VPT vectors of
// the chunk into registers once; the mean (summed about the chunk's first element) and then
// M2 are taken from the registers. Same output as ddo_group_stats.
#define GN_STATS_VPT 8
template <int DT>
__device__ __forceinline__ void gn_stats_vec(const uint4* x, float* part, i64 groups,
                                             i64 len_vec, i64 chunk_vec, i64 chunks) {
    constexpr int W = DT == DTYPE_F32 ? 4 : 8;
    __shared__ float scratch[32];
    for (i64 g = blockIdx.y; g < groups; g += gridDim.y) {
        for (i64 c = blockIdx.x; c < chunks; c += gridDim.x) {
            const uint4* src = x + g * len_vec + c * chunk_vec;
            i64 nv = len_vec - c * chunk_vec;
            if (nv > chunk_vec) nv = chunk_vec;
            uint4 r[GN_STATS_VPT];
#pragma unroll
            for (int k = 0; k < GN_STATS_VPT; ++k) {
                i64 j = (i64)k * blockDim.x + threadIdx.x;
                r[k] = j < nv ? src[j] : make_uint4(0u, 0u, 0u, 0u);
            }
            // One address for the whole block: a broadcast, from L1 after the first warp.
            const float shift = gn_lane<DT>(src[0], 0);
            float s = 0.0f;
#pragma unroll
            for (int k = 0; k < GN_STATS_VPT; ++k) {
                if ((i64)k * blockDim.x + threadIdx.x < nv) {
                    float sk = 0.0f;
#pragma unroll
                    for (int l = 0; l < W; ++l) sk += gn_lane<DT>(r[k], l) - shift;
                    s += sk;
                }
            }
            const float n = (float)(nv * W);
            const float mean = shift + block_sum(s, scratch) / n;
            float s2 = 0.0f;
#pragma unroll
            for (int k = 0; k < GN_STATS_VPT; ++k) {
                if ((i64)k * blockDim.x + threadIdx.x < nv) {
#pragma unroll
                    for (int l = 0; l < W; ++l) {
                        float d = gn_lane<DT>(r[k], l) - mean;
                        s2 = fmaf(d, d, s2);
                    }
                }
            }
            float m2 = block_sum(s2, scratch);
            if (threadIdx.x == 0) {
                float* p = part + (g * chunks + c) * 3;
                p[0] = n;
                p[1] = mean;
                p[2] = m2;
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(256)
    ddo_group_stats_vec_f32(const uint4* x, float* part, i64 groups, i64 len_vec,
                            i64 chunk_vec, i64 chunks) {
    gn_stats_vec<DTYPE_F32>(x, part, groups, len_vec, chunk_vec, chunks);
}
extern "C" __global__ void __launch_bounds__(256)
    ddo_group_stats_vec_f16(const uint4* x, float* part, i64 groups, i64 len_vec,
                            i64 chunk_vec, i64 chunks) {
    gn_stats_vec<DTYPE_F16>(x, part, groups, len_vec, chunk_vec, chunks);
}
extern "C" __global__ void __launch_bounds__(256)
    ddo_group_stats_vec_bf16(const uint4* x, float* part, i64 groups, i64 len_vec,
                             i64 chunk_vec, i64 chunks) {
    gn_stats_vec<DTYPE_BF16>(x, part, groups, len_vec, chunk_vec, chunks);
}

// Chan et al.'s merge of (nb, mb, m2b) into (n, mean, m2); an empty side changes nothing.
__device__ __forceinline__ void gn_chan(double& n, double& mean, double& m2, double nb,
                                        double mb, double m2b) {
    double tot = n + nb;
    if (tot > 0.0) {
        double delta = mb - mean;
        double f = nb / tot;
        mean += delta * f;
        m2 += m2b + delta * delta * n * f;
        n = tot;
    }
}

// Group-norm statistics, pass 2: one warp per group (blockDim a multiple of 32; grid-stride
// over groups) merges its chunks' partials, lane-strided and then across the warp, into
// stats[g * 2 + 0..2] = (mean, 1 / sqrt(var + eps)) (biased variance).
extern "C" __global__ void ddo_group_merge(const float* part, float* stats, i64 groups,
                                           i64 chunks, float eps) {
    const int lane = threadIdx.x & 31;
    i64 warp = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    i64 warps = ((i64)gridDim.x * blockDim.x) >> 5;
    for (i64 g = warp; g < groups; g += warps) {
        double n = 0.0, mean = 0.0, m2 = 0.0;
        for (i64 c = lane; c < chunks; c += 32) {
            const float* p = part + (g * chunks + c) * 3;
            gn_chan(n, mean, m2, p[0], p[1], p[2]);
        }
        for (int o = 16; o > 0; o >>= 1) {
            double nb = __shfl_xor_sync(0xffffffffu, n, o);
            double mb = __shfl_xor_sync(0xffffffffu, mean, o);
            double m2b = __shfl_xor_sync(0xffffffffu, m2, o);
            gn_chan(n, mean, m2, nb, mb, m2b);
        }
        if (lane == 0) {
            stats[g * 2] = (float)mean;
            stats[g * 2 + 1] = (float)(1.0 / sqrt(m2 / n + (double)eps));
        }
    }
}

// The affine of channel plane p: y = (x - mean) * a + shift with a = inv * w[ch] and
// shift = b[ch] (w, b may be null: 1 and 0).
__device__ __forceinline__ void gn_plane(i64 p, const float* stats, const void* w, int wdt,
                                         const void* b, int bdt, i64 channels, i64 cg,
                                         float& mean, float& a, float& shift) {
    i64 ch = p % channels;
    i64 g = p / cg;
    mean = stats[g * 2];
    a = stats[g * 2 + 1];
    if (w) a *= load_as_float(w, ch, wdt);
    shift = b ? load_as_float(b, ch, bdt) : 0.0f;
}

// Group-norm apply, scalar (any dtypes, any plane size, any alignment): block row blockIdx.y
// (grid-stride over the `planes` planes) walks plane p's `spatial` elements grid-stride along x.
extern "C" __global__ void ddo_group_apply(const void* x, int xdt, const float* stats,
                                           const void* w, int wdt, const void* b, int bdt,
                                           void* y, int ydt, i64 planes, i64 spatial,
                                           i64 channels, i64 cg, int silu) {
    for (i64 p = blockIdx.y; p < planes; p += gridDim.y) {
        float mean, a, shift;
        gn_plane(p, stats, w, wdt, b, bdt, channels, cg, mean, a, shift);
        const i64 base = p * spatial;
        for (i64 j = (i64)blockIdx.x * blockDim.x + threadIdx.x; j < spatial;
             j += (i64)gridDim.x * blockDim.x) {
            float v = (load_as_float(x, base + j, xdt) - mean) * a + shift;
            if (silu) v = gn_silu(v);
            store_from_float(y, base + j, ydt, v);
        }
    }
}

// Group-norm apply, vectorised (ops/norm.rs: GROUP_APPLY_VPT): planes of plane_vec whole
// 16-byte vectors (spatial a multiple of W, x and y 16-byte aligned), x and y of dtype DT.
// Block row blockIdx.y (grid-stride over planes) takes tiles of blockDim.x * GN_APPLY_VPT
// vectors of its plane (grid-stride along x); each thread loads its GN_APPLY_VPT vectors of a
// tile, then normalises (and for SILU activates) and stores them: one read, one write.
#define GN_APPLY_VPT 4
template <int DT, bool SILU>
__device__ __forceinline__ void gn_apply_vec(const uint4* x, const float* stats, const void* w,
                                             int wdt, const void* b, int bdt, uint4* y,
                                             i64 planes, i64 plane_vec, i64 channels, i64 cg) {
    constexpr int W = DT == DTYPE_F32 ? 4 : 8;
    const i64 tile = (i64)blockDim.x * GN_APPLY_VPT;
    for (i64 p = blockIdx.y; p < planes; p += gridDim.y) {
        float mean, a, shift;
        gn_plane(p, stats, w, wdt, b, bdt, channels, cg, mean, a, shift);
        const uint4* src = x + p * plane_vec;
        uint4* dst = y + p * plane_vec;
        for (i64 t = (i64)blockIdx.x * tile; t < plane_vec; t += (i64)gridDim.x * tile) {
            uint4 r[GN_APPLY_VPT];
#pragma unroll
            for (int k = 0; k < GN_APPLY_VPT; ++k) {
                i64 j = t + (i64)k * blockDim.x + threadIdx.x;
                r[k] = j < plane_vec ? src[j] : make_uint4(0u, 0u, 0u, 0u);
            }
#pragma unroll
            for (int k = 0; k < GN_APPLY_VPT; ++k) {
                i64 j = t + (i64)k * blockDim.x + threadIdx.x;
                if (j < plane_vec) {
                    float f[W];
#pragma unroll
                    for (int l = 0; l < W; ++l) {
                        float v = (gn_lane<DT>(r[k], l) - mean) * a + shift;
                        f[l] = SILU ? gn_silu(v) : v;
                    }
                    dst[j] = gn_pack<DT>(f);
                }
            }
        }
    }
}

#define GN_APPLY_ARGS                                                                        \
    const uint4 *x, const float *stats, const void *w, int wdt, const void *b, int bdt,      \
        uint4 *y, i64 planes, i64 plane_vec, i64 channels, i64 cg
#define GN_APPLY_PASS x, stats, w, wdt, b, bdt, y, planes, plane_vec, channels, cg
extern "C" __global__ void __launch_bounds__(256) ddo_group_apply_vec_f32(GN_APPLY_ARGS) {
    gn_apply_vec<DTYPE_F32, false>(GN_APPLY_PASS);
}
extern "C" __global__ void __launch_bounds__(256) ddo_group_apply_vec_f16(GN_APPLY_ARGS) {
    gn_apply_vec<DTYPE_F16, false>(GN_APPLY_PASS);
}
extern "C" __global__ void __launch_bounds__(256) ddo_group_apply_vec_bf16(GN_APPLY_ARGS) {
    gn_apply_vec<DTYPE_BF16, false>(GN_APPLY_PASS);
}
extern "C" __global__ void __launch_bounds__(256) ddo_group_silu_vec_f32(GN_APPLY_ARGS) {
    gn_apply_vec<DTYPE_F32, true>(GN_APPLY_PASS);
}
extern "C" __global__ void __launch_bounds__(256) ddo_group_silu_vec_f16(GN_APPLY_ARGS) {
    gn_apply_vec<DTYPE_F16, true>(GN_APPLY_PASS);
}
extern "C" __global__ void __launch_bounds__(256) ddo_group_silu_vec_bf16(GN_APPLY_ARGS) {
    gn_apply_vec<DTYPE_BF16, true>(GN_APPLY_PASS);
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

// ---- Layer norm + AdaLN modulation (Ops::layer_norm_modulate) ---------------------------
// y = (x - mean) / sqrt(var + eps) * (1 + s[r / gs]) + h[r / gh] per row r of d elements
// (biased variance, no affine): s and h are [rows / gs, d] and [rows / gh, d] (one row of
// each serves gs, gh consecutive rows of x). Everything in f32, one rounding at the store.
__device__ __forceinline__ float modulate_(float n, const void* s, int sdt, i64 so,
                                           const void* h, int hdt, i64 ho) {
    return n * (1.0f + load_as_float(s, so, sdt)) + load_as_float(h, ho, hdt);
}

// modulate_ on 8 normalised elements (v - mean) * inv, scale and shift read from sb and hb.
__device__ __forceinline__ void modulate8(float* v, float mean, float inv, const void* s,
                                          int sdt, i64 sb, const void* h, int hdt, i64 hb) {
    float sv[8], hv[8];
    load8_row(s, sb, sdt, sv);
    load8_row(h, hb, hdt, hv);
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = (v[k] - mean) * inv * (1.0f + sv[k]) + hv[k];
}

// Any dtypes, any d: one block per row (grid-stride over rows), x read from memory per pass.
extern "C" __global__ void ddo_ln_modulate(const void* x, int xdt, const void* s, int sdt,
                                           const void* h, int hdt, void* y, int ydt, i64 rows,
                                           i64 d, float eps, i64 gs, i64 gh) {
    __shared__ float scratch[32];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        i64 base = r * d, sb = (r / gs) * d, hb = (r / gh) * d;
        float sum = 0.0f;
        for (i64 j = threadIdx.x; j < d; j += blockDim.x) sum += load_as_float(x, base + j, xdt);
        float mean = block_sum(sum, scratch) / (float)d;
        float s2 = 0.0f;
        for (i64 j = threadIdx.x; j < d; j += blockDim.x) {
            float c = load_as_float(x, base + j, xdt) - mean;
            s2 += c * c;
        }
        float inv = rsqrtf(block_sum(s2, scratch) / (float)d + eps);
        for (i64 j = threadIdx.x; j < d; j += blockDim.x) {
            float n = (load_as_float(x, base + j, xdt) - mean) * inv;
            store_from_float(y, base + j, ydt, modulate_(n, s, sdt, sb + j, h, hdt, hb + j));
        }
    }
}

// The modulated layer norm of 16-bit rows, the row in registers, 8 elements a thread (as
// ddo_row_norm_vec_*): `row8(r, col, v)` gives a thread its 8 elements of row r from col (a
// load, or the gated residual's), d % 8 == 0, y 16-byte aligned. Short rows: g = d / 8 lanes
// per row (a power of two up to 32), 32 / g rows per warp.
template <typename Row8>
__device__ __forceinline__ void ln_modulate_warp_rows(Row8 row8, const void* s, int sdt,
                                                      const void* h, int hdt, void* y, int ydt,
                                                      i64 rows, i64 d, float eps, i64 gs,
                                                      i64 gh) {
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
            row8(r, col, v);
        } else {
#pragma unroll
            for (int k = 0; k < 8; ++k) v[k] = 0.0f;
        }
        float sum = 0.0f;
#pragma unroll
        for (int k = 0; k < 8; ++k) sum += v[k];
        for (int o = g / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        float mean = sum / (float)d;
        float s2 = 0.0f;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            float c = v[k] - mean;
            s2 += c * c;
        }
        for (int o = g / 2; o > 0; o >>= 1) s2 += __shfl_xor_sync(0xffffffffu, s2, o);
        float inv = rsqrtf(s2 / (float)d + eps);
        if (live) {
            modulate8(v, mean, inv, s, sdt, div_idx(r, gs) * d + col, h, hdt,
                      div_idx(r, gh) * d + col);
            store8(y, r * d + col, ydt, v);
        }
    }
}

// Long rows: one block of d / 8 threads (a multiple of 32, at most 1024) per row.
template <typename Row8>
__device__ __forceinline__ void ln_modulate_block_rows(Row8 row8, const void* s, int sdt,
                                                       const void* h, int hdt, void* y, int ydt,
                                                       i64 rows, i64 d, float eps, i64 gs,
                                                       i64 gh) {
    __shared__ float scratch[32];
    const i64 col = (i64)threadIdx.x * 8;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        float v[8];
        row8(r, col, v);
        float sum = 0.0f;
#pragma unroll
        for (int k = 0; k < 8; ++k) sum += v[k];
        float mean = block_sum(sum, scratch) / (float)d;
        float s2 = 0.0f;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            float c = v[k] - mean;
            s2 += c * c;
        }
        float inv = rsqrtf(block_sum(s2, scratch) / (float)d + eps);
        modulate8(v, mean, inv, s, sdt, div_idx(r, gs) * d + col, h, hdt,
                  div_idx(r, gh) * d + col);
        store8(y, r * d + col, ydt, v);
    }
}

// 16-bit x and y, x 16-byte aligned too: short rows.
extern "C" __global__ void ddo_ln_modulate_vec_warp(const void* x, int xdt, const void* s,
                                                    int sdt, const void* h, int hdt, void* y,
                                                    int ydt, i64 rows, i64 d, float eps,
                                                    i64 gs, i64 gh) {
    ln_modulate_warp_rows([&](i64 r, i64 col, float* v) { load8(x, r * d + col, xdt, v); }, s,
                          sdt, h, hdt, y, ydt, rows, d, eps, gs, gh);
}

// Long rows.
extern "C" __global__ void ddo_ln_modulate_vec_block(const void* x, int xdt, const void* s,
                                                     int sdt, const void* h, int hdt, void* y,
                                                     int ydt, i64 rows, i64 d, float eps,
                                                     i64 gs, i64 gh) {
    ln_modulate_block_rows([&](i64 r, i64 col, float* v) { load8(x, r * d + col, xdt, v); }, s,
                           sdt, h, hdt, y, ydt, rows, d, eps, gs, gh);
}

// ---- Gated residual + modulated layer norm (Ops::gated_add_layer_norm_modulate) ----------
// r = x + g * y (as ddo_gated_add_vec: f32 math, one rounding into dt), stored, then the
// layer norm and modulation of r as stored (as ddo_ln_modulate_vec_*: the same sums in the
// same order), so both outputs have the bytes of the two ops; r is not read back. x, y, r and
// o of one 16-bit dtype dt, 16-byte aligned, d % 8 == 0; g, s and h one row per gg, gs, gh
// rows, of any dtype.

// The 8 elements of row r from col: x + g * y rounded into dt, stored into rr; returned as f32.
__device__ __forceinline__ void gated8(const void* x, const void* g, int gdt, const void* y,
                                       void* rr, int dt, i64 r, i64 d, i64 col, i64 gg,
                                       float* v) {
    float xv[8], yv[8], gv[8];
    load8(x, r * d + col, dt, xv);
    load8(y, r * d + col, dt, yv);
    load8_row(g, div_idx(r, gg) * d + col, gdt, gv);
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = round16(dt, xv[k] + gv[k] * yv[k]);
    store8(rr, r * d + col, dt, v);
}

// Short rows, as ddo_ln_modulate_vec_warp.
extern "C" __global__ void ddo_gated_ln_modulate_vec_warp(
    const void* x, const void* g, int gdt, const void* y, void* rr, const void* s, int sdt,
    const void* h, int hdt, void* o, int dt, i64 rows, i64 d, float eps, i64 gg, i64 gs,
    i64 gh) {
    ln_modulate_warp_rows(
        [&](i64 r, i64 col, float* v) { gated8(x, g, gdt, y, rr, dt, r, d, col, gg, v); }, s,
        sdt, h, hdt, o, dt, rows, d, eps, gs, gh);
}

// Long rows, as ddo_ln_modulate_vec_block: one block of d / 8 threads per row.
extern "C" __global__ void ddo_gated_ln_modulate_vec_block(
    const void* x, const void* g, int gdt, const void* y, void* rr, const void* s, int sdt,
    const void* h, int hdt, void* o, int dt, i64 rows, i64 d, float eps, i64 gg, i64 gs,
    i64 gh) {
    ln_modulate_block_rows(
        [&](i64 r, i64 col, float* v) { gated8(x, g, gdt, y, rr, dt, r, d, col, gg, v); }, s,
        sdt, h, hdt, o, dt, rows, d, eps, gs, gh);
}

// Sum of a u64 over the block (every thread calls it; `scratch` is __shared__ u64[32]);
// thread 0 gets the result.
__device__ __forceinline__ u64 block_sum_u64(u64 v, u64* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int warps = (blockDim.x + 31) >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    u64 r = lane < warps ? scratch[lane] : 0ull;
    for (int o = 16; o > 0; o >>= 1) r += __shfl_xor_sync(0xffffffffu, r, o);
    __syncthreads();
    return r;
}

// First pass of the non-finite count: each block counts the NaN and +-Inf elements (exponent
// bits all ones, tested on the stored bits: no conversion) of its grid-stride share of the
// n elements of x and writes the count to partial[blockIdx.x].
extern "C" __global__ void ddo_count_non_finite(const void* x, int xdt, i64 n, u64* partial) {
    __shared__ u64 scratch[32];
    u64 c = 0;
    i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        bool bad;
        if (xdt == DTYPE_F32) {
            bad = (((const u32*)x)[i] & 0x7f800000u) == 0x7f800000u;
        } else if (xdt == DTYPE_F16) {
            bad = (((const u16*)x)[i] & 0x7c00u) == 0x7c00u;
        } else {
            bad = (((const u16*)x)[i] & 0x7f80u) == 0x7f80u;
        }
        c += bad ? 1ull : 0ull;
    }
    c = block_sum_u64(c, scratch);
    if (threadIdx.x == 0) partial[blockIdx.x] = c;
}

// Second pass: one block sums the `blocks` partial counts into *out.
extern "C" __global__ void ddo_sum_counts(const u64* partial, i64 blocks, u64* out) {
    __shared__ u64 scratch[32];
    u64 c = 0;
    for (i64 i = threadIdx.x; i < blocks; i += blockDim.x) c += partial[i];
    c = block_sum_u64(c, scratch);
    if (threadIdx.x == 0) *out = c;
}
