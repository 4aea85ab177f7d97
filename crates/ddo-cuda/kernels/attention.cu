// Scaled dot-product attention kernels of DDO's CUDA backend (compiled by NVRTC with the
// PRELUDE of ops/kernels.rs in front: dtype codes, load_as_float/store_from_float, warp and
// block reductions, struct Dims6). No header is included: NVRTC ships none here.
//
// Layout: q [b, h, lq, d], k [b, h, lk, d], v [b, h, lk, dv], out [b, h, lq, dv], all dense
// row-major; (batch, head) pairs are numbered bh = b * heads + h. The optional additive
// mask is read through element strides (mstr.v[0..4] for b, h, query, key; 0 where the
// mask broadcasts) in its own dtype. Scores are `q·k * scale + mask`; softmax runs online
// in f32 (running max and sum per query), so the lq x lk score matrix is never stored.
// A query row whose keys are all masked out (-inf) ends with sum 0 and yields NaN, as the
// host reference and softmax over -inf do.
//
// Three kernels:
// - ddo_attn_mma_{bf16,f16}_d64: FlashAttention-2 style, tensor cores (mma.sync.m16n8k16,
//   f32 accumulators) for 16-bit q/k/v of one dtype with d == dv. Block = 8 warps = 128
//   queries (16 per warp) of one (b, h), Q in registers; K and V tiles of 64 keys stream
//   through two stages of shared memory with cp.async (tile j + 1 loads while tile j is
//   computed; one barrier per tile); S and P stay in registers.
// - ddo_attn_mmaq_{bf16,f16}_d128: the same numerics in FlashAttention-2's layout: 4 warps
//   of 32 queries, Q in shared memory, K/V tiles of 32 keys.
// - ddo_attn_scalar_{1,4}: any dtypes (each operand its own), any d, dv (this launch covers
//   dv columns [dv0, dv0 + dvn), dvn <= 128 * NC), f32 CUDA-core math. Block = 4 warps x 4
//   queries; each lane scores one key of a 32-key tile against the warp's queries, then
//   the tile's V rows are accumulated into per-lane output columns.
// - ddo_attn_softmax_rows: the softmax of the chunked path (scores from cuBLAS, one block
//   per row): adds the mask, normalises, writes P in the compute dtype for the P·V GEMM.

#define NEG_INF (-__int_as_float(0x7f800000))
#define LOG2E 1.4426950408889634f

// ---------------------------------------------------------------------------------------
// Tensor-core path
// ---------------------------------------------------------------------------------------

__device__ __forceinline__ u32 smem_addr(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

// 16-byte asynchronous copy global -> shared; `bytes` (0 or 16) valid source bytes, the
// rest zero-filled.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::);
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(u32& r0, u32& r1, u32& r2, u32& r3, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32& r0, u32& r1, u32& r2, u32& r3,
                                                  const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(smem_addr(p)));
}

// D = A·B + D, m16n8k16, A row-major 16x16, B column-major 16x8, f32 accumulators.
template <bool BF16>
__device__ __forceinline__ void mma16816(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                         u32 b1) {
    if (BF16) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
}

// 2^x by the SFU (relative error ~2^-22; -inf -> 0): the tensor-core path's exponential.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// Two floats as a 16-bit pair: `lo` in the low half (the lower column index).
template <bool BF16>
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 r;
    if (BF16) {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    }
    return r;
}

// Loads rows [row0, row0 + R) of a [rows, D] 16-bit matrix into shared memory with row
// stride LD halves; rows past `rows` are zero-filled. All NT threads take part.
template <int D, int LD, int R, int NT>
__device__ __forceinline__ void load_tile(u16* smem, const u16* src, i64 row0, i64 rows) {
    constexpr int CHUNKS = D / 8;  // 16-byte chunks per row
    static_assert((R * CHUNKS) % NT == 0, "a tile is a whole number of rounds");
#pragma unroll
    for (int it = 0; it < R * CHUNKS / NT; ++it) {
        const int i = threadIdx.x + it * NT;
        int r = i / CHUNKS, c = (i % CHUNKS) * 8;
        i64 row = row0 + r;
        bool ok = row < rows;
        const u16* g = ok ? src + row * D + c : src;
        cp_async16(smem + r * LD + c, g, ok ? 16 : 0);
    }
}

template <int D, int NW, bool BF16>
__device__ __forceinline__ void attn_mma(const u16* __restrict__ q, const u16* __restrict__ k,
                                         const u16* __restrict__ v, u16* __restrict__ out,
                                         const void* __restrict__ mask, int mask_dtype,
                                         Dims6 mstr, Dims6 dims, float scale) {
    constexpr int BK = 64;
    constexpr int BQ = 16 * NW;  // queries per block
    constexpr int NT = 32 * NW;  // threads per block
    constexpr int LD = D + 8;  // padded rows: ldmatrix reads without bank conflicts
    constexpr int KS = D / 16; // k-steps of Q·Kᵀ
    constexpr int DN = D / 8;  // n-tiles of the output
    // Dynamic shared memory (attn_mma_smem_bytes(D)): two stages of a K tile and a V tile;
    // the Q tile (BQ rows) is staged through them at the start.
    extern __shared__ __align__(16) u16 smem[];
    static_assert(BQ <= 4 * BK, "the Q tile fits the staging area");

    const i64 lq = dims.v[0], lk = dims.v[1], heads = dims.v[2];
    const i64 bh = dims.v[3] + blockIdx.y;
    const i64 q0 = (i64)blockIdx.x * BQ;
    const i64 bidx = bh / heads, hidx = bh % heads;
    const u16* qh = q + bh * lq * D;
    const u16* kh = k + bh * lk * D;
    const u16* vh = v + bh * lk * D;
    u16* oh = out + bh * lq * D;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const float sl2 = scale * LOG2E;

    // Q tile through sK into registers (A fragments, one set per k-step).
    load_tile<D, LD, BQ, NT>(smem, qh, q0, lq);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    u32 qf[KS][4];
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
        const u16* p = smem + (warp * 16 + (lane & 15)) * LD + ks * 16 + (lane >> 4) * 8;
        ldmatrix_x4(qf[ks][0], qf[ks][1], qf[ks][2], qf[ks][3], p);
    }
    __syncthreads();

    float o[DN][4];
#pragma unroll
    for (int i = 0; i < DN; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m_a = NEG_INF, m_b = NEG_INF, l_a = 0.0f, l_b = 0.0f;  // rows g and g + 8
    const i64 qa = q0 + warp * 16 + g, qb = qa + 8;
    const i64 mbase = bidx * mstr.v[0] + hidx * mstr.v[1];

    // Tile kt lives in stage kt & 1: K at smem + stage * 2 * BK * LD, V right after it.
    // One barrier per tile: after tile kt has landed, which also proves every warp is done
    // with tile kt - 1, whose stage then receives tile kt + 1 while tile kt is computed.
    const i64 tiles = (lk + BK - 1) / BK;
    load_tile<D, LD, BK, NT>(smem, kh, 0, lk);
    load_tile<D, LD, BK, NT>(smem + BK * LD, vh, 0, lk);
    cp_async_commit();
    for (i64 kt = 0; kt < tiles; ++kt) {
        const i64 k0 = kt * BK;
        const u16* sK = smem + (kt & 1) * 2 * BK * LD;
        const u16* sV = sK + BK * LD;
        cp_async_wait<0>();  // tile kt has landed (the only group in flight)
        __syncthreads();
        if (kt + 1 < tiles) {
            u16* nK = smem + ((kt + 1) & 1) * 2 * BK * LD;
            load_tile<D, LD, BK, NT>(nK, kh, k0 + BK, lk);
            load_tile<D, LD, BK, NT>(nK + BK * LD, vh, k0 + BK, lk);
            cp_async_commit();
        }

        // S = Q·Kᵀ for 16 queries x 64 keys per warp.
        float s[BK / 8][4];
#pragma unroll
        for (int j = 0; j < BK / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
            for (int j = 0; j < BK / 8; j += 2) {
                u32 b0, b1, b2, b3;
                const u16* p = sK + (j * 8 + (lane & 7) + (lane >> 4) * 8) * LD + ks * 16 +
                               ((lane >> 3) & 1) * 8;
                ldmatrix_x4(b0, b1, b2, b3, p);
                mma16816<BF16>(s[j], qf[ks][0], qf[ks][1], qf[ks][2], qf[ks][3], b0, b1);
                mma16816<BF16>(s[j + 1], qf[ks][0], qf[ks][1], qf[ks][2], qf[ks][3], b2, b3);
            }
        }

        // Online softmax in the log2 domain: x = s * scale * log2(e) (+ mask * log2(e)).
        float tmax_a = NEG_INF, tmax_b = NEG_INF;
        // A full tile with no mask and a positive scale (so raw maxima scale to the maxima).
        const bool plain = mask == 0 && k0 + BK <= lk && sl2 > 0.0f;
        if (plain) {
#pragma unroll
            for (int j = 0; j < BK / 8; ++j) {
                tmax_a = fmaxf(tmax_a, fmaxf(s[j][0], s[j][1]));
                tmax_b = fmaxf(tmax_b, fmaxf(s[j][2], s[j][3]));
            }
            // Raw maxima: scaled below (sl2 > 0 keeps the order; a negative scale takes the
            // general branch's per-element path instead).
            tmax_a *= sl2;
            tmax_b *= sl2;
        } else {
#pragma unroll
            for (int j = 0; j < BK / 8; ++j) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const i64 key = k0 + j * 8 + 2 * t + (e & 1);
                    const i64 qi = e < 2 ? qa : qb;
                    float x = s[j][e] * sl2;
                    if (key >= lk) {
                        x = NEG_INF;
                    } else if (mask != 0 && qi < lq) {
                        x += LOG2E * load_as_float(
                                         mask, mbase + qi * mstr.v[2] + key * mstr.v[3], mask_dtype);
                    }
                    s[j][e] = x;
                }
                tmax_a = fmaxf(tmax_a, fmaxf(s[j][0], s[j][1]));
                tmax_b = fmaxf(tmax_b, fmaxf(s[j][2], s[j][3]));
            }
        }
        tmax_a = fmaxf(tmax_a, __shfl_xor_sync(0xffffffffu, tmax_a, 1));
        tmax_a = fmaxf(tmax_a, __shfl_xor_sync(0xffffffffu, tmax_a, 2));
        tmax_b = fmaxf(tmax_b, __shfl_xor_sync(0xffffffffu, tmax_b, 1));
        tmax_b = fmaxf(tmax_b, __shfl_xor_sync(0xffffffffu, tmax_b, 2));
        const float mn_a = fmaxf(m_a, tmax_a), mn_b = fmaxf(m_b, tmax_b);
        const float mu_a = mn_a == NEG_INF ? 0.0f : mn_a;
        const float mu_b = mn_b == NEG_INF ? 0.0f : mn_b;
        const float corr_a = fast_exp2(m_a - mu_a), corr_b = fast_exp2(m_b - mu_b);
        m_a = mn_a;
        m_b = mn_b;
        float sum_a = 0.0f, sum_b = 0.0f;
        const float f = plain ? sl2 : 1.0f;  // the plain tile is still unscaled
#pragma unroll
        for (int j = 0; j < BK / 8; ++j) {
            s[j][0] = fast_exp2(fmaf(s[j][0], f, -mu_a));
            s[j][1] = fast_exp2(fmaf(s[j][1], f, -mu_a));
            s[j][2] = fast_exp2(fmaf(s[j][2], f, -mu_b));
            s[j][3] = fast_exp2(fmaf(s[j][3], f, -mu_b));
            sum_a += s[j][0] + s[j][1];
            sum_b += s[j][2] + s[j][3];
        }
        l_a = l_a * corr_a + sum_a;  // per-lane partial sums; reduced over the quad at the end
        l_b = l_b * corr_b + sum_b;
#pragma unroll
        for (int i = 0; i < DN; ++i) {
            o[i][0] *= corr_a;
            o[i][1] *= corr_a;
            o[i][2] *= corr_b;
            o[i][3] *= corr_b;
        }


        // O += P·V: the S accumulators of two key tiles are the A fragment of 16 keys.
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            const u32 a0 = pack2<BF16>(s[2 * kk][0], s[2 * kk][1]);
            const u32 a1 = pack2<BF16>(s[2 * kk][2], s[2 * kk][3]);
            const u32 a2 = pack2<BF16>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            const u32 a3 = pack2<BF16>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int dn = 0; dn < DN; dn += 2) {
                u32 b0, b1, b2, b3;
                const u16* p = sV + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD +
                               dn * 8 + (lane >> 4) * 8;
                ldmatrix_x4_trans(b0, b1, b2, b3, p);
                mma16816<BF16>(o[dn], a0, a1, a2, a3, b0, b1);
                mma16816<BF16>(o[dn + 1], a0, a1, a2, a3, b2, b3);
            }
        }
    }

    l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
    const float inv_a = 1.0f / l_a, inv_b = 1.0f / l_b;
#pragma unroll
    for (int dn = 0; dn < DN; ++dn) {
        const int col = dn * 8 + 2 * t;
        if (qa < lq) {
            *(u32*)(oh + qa * D + col) = pack2<BF16>(o[dn][0] * inv_a, o[dn][1] * inv_a);
        }
        if (qb < lq) {
            *(u32*)(oh + qb * D + col) = pack2<BF16>(o[dn][2] * inv_b, o[dn][3] * inv_b);
        }
    }
}

// dims: {lq, lk, heads, bh0, 0, 0}; grid (ceil(lq / (16 * NW)), number of (b, h) pairs from
// bh0), 32 * NW threads (NW = 8: 128 queries per block), 4 * 64 * (D + 8) * 2 bytes of
// dynamic shared memory (36,864 for D = 64). q, k, v, out 16-byte aligned.
#define DDO_ATTN_MMA(NAME, D, BF16)                                                          \
    extern "C" __global__ void __launch_bounds__(256)                                        \
        NAME(const u16* q, const u16* k, const u16* v, u16* out, const void* mask,           \
             int mask_dtype, Dims6 mstr, Dims6 dims, float scale) {                          \
        attn_mma<D, 8, BF16>(q, k, v, out, mask, mask_dtype, mstr, dims, scale);             \
    }
DDO_ATTN_MMA(ddo_attn_mma_bf16_d64, 64, true)
DDO_ATTN_MMA(ddo_attn_mma_f16_d64, 64, false)

// FlashAttention-2's layout: NW warps of MT m-tiles (16 * MT query rows each), the Q tile
// kept in its own shared memory and read per k-step (so each K and V fragment loaded from
// shared memory feeds MT tensor-core ops, where the kernel above feeds one), K/V tiles of
// 64 keys in two cp.async stages as above. Same numerics as attn_mma.
template <int D, int NW, int MT, int BK, bool BF16>
__device__ __forceinline__ void attn_mma_q(const u16* __restrict__ q, const u16* __restrict__ k,
                                           const u16* __restrict__ v, u16* __restrict__ out,
                                           const void* __restrict__ mask, int mask_dtype,
                                           Dims6 mstr, Dims6 dims, float scale) {
    
    constexpr int WR = 16 * MT;  // query rows per warp
    constexpr int BQ = WR * NW;  // queries per block
    constexpr int NT = 32 * NW;  // threads per block
    constexpr int LD = D + 8;
    constexpr int KS = D / 16;
    constexpr int DN = D / 8;
    // Dynamic shared memory: the Q tile (BQ rows), then two stages of a K and a V tile.
    extern __shared__ __align__(16) u16 smem[];
    u16* sQ = smem;
    u16* stages = smem + BQ * LD;

    const i64 lq = dims.v[0], lk = dims.v[1], heads = dims.v[2];
    const i64 bh = dims.v[3] + blockIdx.y;
    const i64 q0 = (i64)blockIdx.x * BQ;
    const i64 bidx = bh / heads, hidx = bh % heads;
    const u16* qh = q + bh * lq * D;
    const u16* kh = k + bh * lk * D;
    const u16* vh = v + bh * lk * D;
    u16* oh = out + bh * lq * D;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const float sl2 = scale * LOG2E;

    float o[MT][DN][4];
    float m_a[MT], m_b[MT], l_a[MT], l_b[MT];
    i64 qa[MT], qb[MT];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int i = 0; i < DN; ++i) o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.0f;
        m_a[mt] = m_b[mt] = NEG_INF;
        l_a[mt] = l_b[mt] = 0.0f;
        qa[mt] = q0 + warp * WR + mt * 16 + g;
        qb[mt] = qa[mt] + 8;
    }
    const i64 mbase = bidx * mstr.v[0] + hidx * mstr.v[1];

    const i64 tiles = (lk + BK - 1) / BK;
    load_tile<D, LD, BQ, NT>(sQ, qh, q0, lq);
    load_tile<D, LD, BK, NT>(stages, kh, 0, lk);
    load_tile<D, LD, BK, NT>(stages + BK * LD, vh, 0, lk);
    cp_async_commit();
    for (i64 kt = 0; kt < tiles; ++kt) {
        const i64 k0 = kt * BK;
        const u16* sK = stages + (kt & 1) * 2 * BK * LD;
        const u16* sV = sK + BK * LD;
        cp_async_wait<0>();
        __syncthreads();
        if (kt + 1 < tiles) {
            u16* nK = stages + ((kt + 1) & 1) * 2 * BK * LD;
            load_tile<D, LD, BK, NT>(nK, kh, k0 + BK, lk);
            load_tile<D, LD, BK, NT>(nK + BK * LD, vh, k0 + BK, lk);
            cp_async_commit();
        }

        float s[MT][BK / 8][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int j = 0; j < BK / 8; ++j) s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
            u32 qf[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const u16* p = sQ + (warp * WR + mt * 16 + (lane & 15)) * LD + ks * 16 + (lane >> 4) * 8;
                ldmatrix_x4(qf[mt][0], qf[mt][1], qf[mt][2], qf[mt][3], p);
            }
#pragma unroll
            for (int j = 0; j < BK / 8; j += 2) {
                u32 b0, b1, b2, b3;
                const u16* p = sK + (j * 8 + (lane & 7) + (lane >> 4) * 8) * LD + ks * 16 +
                               ((lane >> 3) & 1) * 8;
                ldmatrix_x4(b0, b1, b2, b3, p);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma16816<BF16>(s[mt][j], qf[mt][0], qf[mt][1], qf[mt][2], qf[mt][3], b0, b1);
                    mma16816<BF16>(s[mt][j + 1], qf[mt][0], qf[mt][1], qf[mt][2], qf[mt][3], b2, b3);
                }
            }
        }

        const bool plain = mask == 0 && k0 + BK <= lk && sl2 > 0.0f;
        const float f = plain ? sl2 : 1.0f;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            float tmax_a = NEG_INF, tmax_b = NEG_INF;
            if (plain) {
#pragma unroll
                for (int j = 0; j < BK / 8; ++j) {
                    tmax_a = fmaxf(tmax_a, fmaxf(s[mt][j][0], s[mt][j][1]));
                    tmax_b = fmaxf(tmax_b, fmaxf(s[mt][j][2], s[mt][j][3]));
                }
                tmax_a *= sl2;
                tmax_b *= sl2;
            } else {
#pragma unroll
                for (int j = 0; j < BK / 8; ++j) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const i64 key = k0 + j * 8 + 2 * t + (e & 1);
                        const i64 qi = e < 2 ? qa[mt] : qb[mt];
                        float x = s[mt][j][e] * sl2;
                        if (key >= lk) {
                            x = NEG_INF;
                        } else if (mask != 0 && qi < lq) {
                            x += LOG2E * load_as_float(
                                             mask, mbase + qi * mstr.v[2] + key * mstr.v[3], mask_dtype);
                        }
                        s[mt][j][e] = x;
                    }
                    tmax_a = fmaxf(tmax_a, fmaxf(s[mt][j][0], s[mt][j][1]));
                    tmax_b = fmaxf(tmax_b, fmaxf(s[mt][j][2], s[mt][j][3]));
                }
            }
            tmax_a = fmaxf(tmax_a, __shfl_xor_sync(0xffffffffu, tmax_a, 1));
            tmax_a = fmaxf(tmax_a, __shfl_xor_sync(0xffffffffu, tmax_a, 2));
            tmax_b = fmaxf(tmax_b, __shfl_xor_sync(0xffffffffu, tmax_b, 1));
            tmax_b = fmaxf(tmax_b, __shfl_xor_sync(0xffffffffu, tmax_b, 2));
            const float mn_a = fmaxf(m_a[mt], tmax_a), mn_b = fmaxf(m_b[mt], tmax_b);
            const float mu_a = mn_a == NEG_INF ? 0.0f : mn_a;
            const float mu_b = mn_b == NEG_INF ? 0.0f : mn_b;
            const float corr_a = fast_exp2(m_a[mt] - mu_a), corr_b = fast_exp2(m_b[mt] - mu_b);
            m_a[mt] = mn_a;
            m_b[mt] = mn_b;
            float sum_a = 0.0f, sum_b = 0.0f;
#pragma unroll
            for (int j = 0; j < BK / 8; ++j) {
                s[mt][j][0] = fast_exp2(fmaf(s[mt][j][0], f, -mu_a));
                s[mt][j][1] = fast_exp2(fmaf(s[mt][j][1], f, -mu_a));
                s[mt][j][2] = fast_exp2(fmaf(s[mt][j][2], f, -mu_b));
                s[mt][j][3] = fast_exp2(fmaf(s[mt][j][3], f, -mu_b));
                sum_a += s[mt][j][0] + s[mt][j][1];
                sum_b += s[mt][j][2] + s[mt][j][3];
            }
            l_a[mt] = l_a[mt] * corr_a + sum_a;
            l_b[mt] = l_b[mt] * corr_b + sum_b;
#pragma unroll
            for (int i = 0; i < DN; ++i) {
                o[mt][i][0] *= corr_a;
                o[mt][i][1] *= corr_a;
                o[mt][i][2] *= corr_b;
                o[mt][i][3] *= corr_b;
            }
        }

#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            u32 a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                a[mt][0] = pack2<BF16>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                a[mt][1] = pack2<BF16>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                a[mt][2] = pack2<BF16>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                a[mt][3] = pack2<BF16>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
            }
#pragma unroll
            for (int dn = 0; dn < DN; dn += 2) {
                u32 b0, b1, b2, b3;
                const u16* p = sV + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD +
                               dn * 8 + (lane >> 4) * 8;
                ldmatrix_x4_trans(b0, b1, b2, b3, p);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma16816<BF16>(o[mt][dn], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b0, b1);
                    mma16816<BF16>(o[mt][dn + 1], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b2, b3);
                }
            }
        }
    }

#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        float la = l_a[mt], lb = l_b[mt];
        la += __shfl_xor_sync(0xffffffffu, la, 1);
        la += __shfl_xor_sync(0xffffffffu, la, 2);
        lb += __shfl_xor_sync(0xffffffffu, lb, 1);
        lb += __shfl_xor_sync(0xffffffffu, lb, 2);
        const float inv_a = 1.0f / la, inv_b = 1.0f / lb;
#pragma unroll
        for (int dn = 0; dn < DN; ++dn) {
            const int col = dn * 8 + 2 * t;
            if (qa[mt] < lq) {
                *(u32*)(oh + qa[mt] * D + col) = pack2<BF16>(o[mt][dn][0] * inv_a, o[mt][dn][1] * inv_a);
            }
            if (qb[mt] < lq) {
                *(u32*)(oh + qb[mt] * D + col) = pack2<BF16>(o[mt][dn][2] * inv_b, o[mt][dn][3] * inv_b);
            }
        }
    }
}

// dims as for ddo_attn_mma_*; grid (ceil(lq / 128), pairs), 128 threads (4 warps of 32
// queries), (128 + 4 * BK) * (D + 8) * 2 bytes of dynamic shared memory (69,632 for D = 128
// and BK = 32). Taken for D = 128, where it measured 1.00 ms a call against 1.07 for the
// kernel above (FLUX.1-dev, 4608 tokens, 24 heads, H200); at D = 64 (T5, 512 tokens) the
// kernel above was faster.
#define DDO_ATTN_MMA_Q(NAME, D, BK, BF16)                                                      \
    extern "C" __global__ void __launch_bounds__(128)                                        \
        NAME(const u16* q, const u16* k, const u16* v, u16* out, const void* mask,           \
             int mask_dtype, Dims6 mstr, Dims6 dims, float scale) {                          \
        attn_mma_q<D, 4, 2, BK, BF16>(q, k, v, out, mask, mask_dtype, mstr, dims, scale);    \
    }
DDO_ATTN_MMA_Q(ddo_attn_mmaq_bf16_d128, 128, 32, true)
DDO_ATTN_MMA_Q(ddo_attn_mmaq_f16_d128, 128, 32, false)

// ---------------------------------------------------------------------------------------
// CUDA-core path (any dtypes and head sizes)
// ---------------------------------------------------------------------------------------

#define SC_WARPS 4
#define SC_QW 4                    // queries per warp
#define SC_BQ (SC_WARPS * SC_QW)   // queries per block
#define SC_TK 32                   // keys per tile (one per lane)
#define SC_DC 128                  // head-dim chunk held in shared memory

// dtypes: {q, k, v, out, mask, 0}; dims: {lq, lk, d, dv, heads, bh0};
// cols: {dv0, dvn, 0, 0, 0, 0} (output columns of this launch; dvn <= 128 * NC).
// Grid (ceil(lq / 16), number of (b, h) pairs from bh0), 128 threads.
template <int NC>
__device__ __forceinline__ void attn_scalar(const void* __restrict__ q,
                                            const void* __restrict__ k,
                                            const void* __restrict__ v, void* __restrict__ out,
                                            const void* __restrict__ mask, Dims6 dtypes,
                                            Dims6 mstr, Dims6 dims, Dims6 cols, float scale) {
    __shared__ float sQ[SC_BQ][SC_DC];
    __shared__ float sK[SC_TK][SC_DC + 1];
    __shared__ float sV[SC_TK][SC_DC];
    const int qt = (int)dtypes.v[0], kt = (int)dtypes.v[1], vt = (int)dtypes.v[2];
    const int ot = (int)dtypes.v[3], mt = (int)dtypes.v[4];
    const i64 lq = dims.v[0], lk = dims.v[1], d = dims.v[2], dv = dims.v[3];
    const i64 heads = dims.v[4], bh = dims.v[5] + blockIdx.y;
    const i64 dv0 = cols.v[0];
    const int dvn = (int)cols.v[1];
    const i64 bidx = bh / heads, hidx = bh % heads;
    const i64 qbase = (i64)blockIdx.x * SC_BQ;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

    float m[SC_QW], l[SC_QW], acc[SC_QW][NC * 4];
#pragma unroll
    for (int i = 0; i < SC_QW; ++i) {
        m[i] = NEG_INF;
        l[i] = 0.0f;
#pragma unroll
        for (int e = 0; e < NC * 4; ++e) acc[i][e] = 0.0f;
    }
    const i64 mbase = bidx * mstr.v[0] + hidx * mstr.v[1];

    for (i64 k0 = 0; k0 < lk; k0 += SC_TK) {
        float s[SC_QW];
#pragma unroll
        for (int i = 0; i < SC_QW; ++i) s[i] = 0.0f;
        for (i64 dc = 0; dc < d; dc += SC_DC) {
            const int dn = (int)(d - dc < SC_DC ? d - dc : SC_DC);
            __syncthreads();
            for (int i = threadIdx.x; i < SC_TK * SC_DC; i += blockDim.x) {
                const int r = i / SC_DC, c = i % SC_DC;
                const i64 key = k0 + r;
                sK[r][c] = (key < lk && c < dn) ? load_as_float(k, (bh * lk + key) * d + dc + c, kt)
                                                : 0.0f;
            }
            for (int i = threadIdx.x; i < SC_BQ * SC_DC; i += blockDim.x) {
                const int r = i / SC_DC, c = i % SC_DC;
                const i64 qi = qbase + r;
                sQ[r][c] = (qi < lq && c < dn) ? load_as_float(q, (bh * lq + qi) * d + dc + c, qt)
                                               : 0.0f;
            }
            __syncthreads();
            for (int c = 0; c < dn; ++c) {
                const float kv = sK[lane][c];
#pragma unroll
                for (int i = 0; i < SC_QW; ++i) s[i] += sQ[warp * SC_QW + i][c] * kv;
            }
        }
        const i64 key = k0 + lane;
#pragma unroll
        for (int i = 0; i < SC_QW; ++i) {
            const i64 qi = qbase + warp * SC_QW + i;
            float x = s[i] * scale;
            if (key >= lk) {
                x = NEG_INF;
            } else if (mask != 0 && qi < lq) {
                x += load_as_float(mask, mbase + qi * mstr.v[2] + key * mstr.v[3], mt);
            }
            const float mn = fmaxf(m[i], warp_max(x));
            const float mu = mn == NEG_INF ? 0.0f : mn;
            const float corr = expf(m[i] - mu);
            const float p = expf(x - mu);
            l[i] = l[i] * corr + warp_sum(p);
            m[i] = mn;
            s[i] = p;
#pragma unroll
            for (int e = 0; e < NC * 4; ++e) acc[i][e] *= corr;
        }
#pragma unroll
        for (int vc = 0; vc < NC; ++vc) {
            if (vc * SC_DC < dvn) {
                const int vn = dvn - vc * SC_DC < SC_DC ? dvn - vc * SC_DC : SC_DC;
                __syncthreads();
                for (int i = threadIdx.x; i < SC_TK * SC_DC; i += blockDim.x) {
                    const int r = i / SC_DC, c = i % SC_DC;
                    const i64 kr = k0 + r;
                    sV[r][c] = (kr < lk && c < vn)
                                   ? load_as_float(v, (bh * lk + kr) * dv + dv0 + vc * SC_DC + c, vt)
                                   : 0.0f;
                }
                __syncthreads();
                for (int j = 0; j < SC_TK; ++j) {
#pragma unroll
                    for (int i = 0; i < SC_QW; ++i) {
                        const float pj = __shfl_sync(0xffffffffu, s[i], j);
#pragma unroll
                        for (int e = 0; e < 4; ++e) acc[i][vc * 4 + e] += pj * sV[j][lane + 32 * e];
                    }
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < SC_QW; ++i) {
        const i64 qi = qbase + warp * SC_QW + i;
        if (qi >= lq) continue;
        const float inv = 1.0f / l[i];
#pragma unroll
        for (int vc = 0; vc < NC; ++vc) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = vc * SC_DC + lane + 32 * e;
                if (col < dvn) {
                    store_from_float(out, (bh * lq + qi) * dv + dv0 + col, ot, acc[i][vc * 4 + e] * inv);
                }
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(128)
    ddo_attn_scalar_1(const void* q, const void* k, const void* v, void* out, const void* mask,
                      Dims6 dtypes, Dims6 mstr, Dims6 dims, Dims6 cols, float scale) {
    attn_scalar<1>(q, k, v, out, mask, dtypes, mstr, dims, cols, scale);
}
extern "C" __global__ void __launch_bounds__(128)
    ddo_attn_scalar_4(const void* q, const void* k, const void* v, void* out, const void* mask,
                      Dims6 dtypes, Dims6 mstr, Dims6 dims, Dims6 cols, float scale) {
    attn_scalar<4>(q, k, v, out, mask, dtypes, mstr, dims, cols, scale);
}

// ---------------------------------------------------------------------------------------
// Softmax of the chunked (cuBLAS) path
// ---------------------------------------------------------------------------------------

// s: f32 scores [rows, lk] (already scaled), rows = (b, h) pairs x qc queries from query q0;
// p: the probabilities [rows, lk] in dtype p_dtype. geo: {lk, qc, q0, heads, bh0, lq}.
// One block (256 threads) per row, grid-stride over rows.
extern "C" __global__ void __launch_bounds__(256)
    ddo_attn_softmax_rows(const float* __restrict__ s, void* __restrict__ p, int p_dtype,
                          const void* __restrict__ mask, int mask_dtype, Dims6 mstr, Dims6 geo,
                          i64 rows) {
    __shared__ float scratch[32];
    const i64 lk = geo.v[0], qc = geo.v[1], q0 = geo.v[2], heads = geo.v[3], bh0 = geo.v[4];
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const i64 bh = bh0 + row / qc, qi = q0 + row % qc;
        const i64 mrow = (bh / heads) * mstr.v[0] + (bh % heads) * mstr.v[1] + qi * mstr.v[2];
        const float* sr = s + row * lk;
        float mx = NEG_INF, sum = 0.0f;
        for (i64 j = threadIdx.x; j < lk; j += blockDim.x) {
            float x = sr[j];
            if (mask != 0) x += load_as_float(mask, mrow + j * mstr.v[3], mask_dtype);
            if (x > mx) {
                sum = sum * expf(mx - x) + 1.0f;
                mx = x;
            } else if (x != NEG_INF) {
                sum += expf(x - mx);
            }
        }
        const float bmax = block_max(mx, scratch);
        const float part = mx == NEG_INF ? 0.0f : sum * expf(mx - bmax);
        const float total = block_sum(part, scratch);
        const float inv = 1.0f / total;
        for (i64 j = threadIdx.x; j < lk; j += blockDim.x) {
            float x = sr[j];
            if (mask != 0) x += load_as_float(mask, mrow + j * mstr.v[3], mask_dtype);
            store_from_float(p, row * lk + j, p_dtype, expf(x - bmax) * inv);
        }
    }
}
