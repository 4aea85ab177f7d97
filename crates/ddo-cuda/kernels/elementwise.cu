// Element-wise kernels of DDO's CUDA backend: unary functions, affine, casts, binary ops
// with NumPy broadcasting (up to 6 coalesced dims per launch), rotary embedding.
// Compiled by NVRTC with ops/kernels.rs's PRELUDE in front (dtype codes, load_as_float,
// store_from_float, Dims6). Values are computed in f32, as the host backend does, and
// rounded once into the output dtype. Every loop is grid-stride with 64-bit indices.

// Unary op codes: the order of ddo_core::UnaryOp, then the extras used by ops/elementwise.rs.
#define U_SILU 0
#define U_GELU_TANH 1
#define U_GELU_ERF 2
#define U_QUICK_GELU 3
#define U_SIGMOID 4
#define U_TANH 5
#define U_RELU 6
#define U_EXP 7
#define U_NEG 8
#define U_SQUARE 9
#define U_SQRT 10
#define U_RECIP 11
#define U_AFFINE 12
#define U_COPY 13

// Binary op codes: the order of ddo_core::BinaryOp.
#define B_ADD 0
#define B_SUB 1
#define B_MUL 2
#define B_DIV 3
#define B_MAX 4
#define B_MIN 5

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

// Exact GELU, x * Phi(x) = x/2 * erfc(-x / sqrt 2), written (as the host does) so that
// neither tail cancels.
__device__ __forceinline__ float gelu_erf_(float x) {
    const float r = 0.70710678118654752440f;
    if (x >= 0.0f) return x * (1.0f - 0.5f * erfcf(x * r));
    return 0.5f * x * erfcf(-x * r);
}

__device__ __forceinline__ float gelu_tanh_(float x) {
    const float k = 0.7978846f;  // sqrt(2 / pi), as the host's 0.797_884_6
    return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
}

__device__ __forceinline__ float unary_(int op, float x, float mul, float add) {
    switch (op) {
        case U_SILU: return x * sigmoidf_(x);
        case U_GELU_TANH: return gelu_tanh_(x);
        case U_GELU_ERF: return gelu_erf_(x);
        case U_QUICK_GELU: return x * sigmoidf_(1.702f * x);
        case U_SIGMOID: return sigmoidf_(x);
        case U_TANH: return tanhf(x);
        case U_RELU: return fmaxf(x, 0.0f);
        case U_EXP: return expf(x);
        case U_NEG: return -x;
        case U_SQUARE: return x * x;
        case U_SQRT: return sqrtf(x);
        case U_RECIP: return 1.0f / x;
        case U_AFFINE: return x * mul + add;
        default: return x;  // U_COPY (a cast)
    }
}

// y[i] = f(x[i]) for i < n; x and y contiguous, any float dtypes.
extern "C" __global__ void ddo_unary(const void* x, int xdt, void* y, int ydt, i64 n, int op,
                                     float mul, float add) {
    i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        store_from_float(y, i, ydt, unary_(op, load_as_float(x, i, xdt), mul, add));
    }
}

__device__ __forceinline__ float binary_(int op, float a, float b) {
    switch (op) {
        case B_ADD: return a + b;
        case B_SUB: return a - b;
        case B_MUL: return a * b;
        case B_DIV: return a / b;
        case B_MAX: return fmaxf(a, b);
        default: return fminf(a, b);  // B_MIN
    }
}

// y[i] = a[off_a(i)] op b[off_b(i)] for the contiguous output index i < n of `shape`
// (rank <= 6 dims, row-major); off_x(i) = sum of idx[d] * sx[d] (stride 0 broadcasts).
// I is the index type: u32 when every operand has fewer than 2^31 elements (32-bit
// division is several times cheaper), else i64.
template <typename I>
__device__ __forceinline__ void binary_body(const void* a, int adt, const void* b, int bdt,
                                            void* y, int ydt, i64 n, int rank,
                                            const Dims6& shape, const Dims6& sa,
                                            const Dims6& sb, int op) {
    I stride = (I)gridDim.x * blockDim.x;
    for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < (I)n; i += stride) {
        I rest = i, oa = 0, ob = 0;
        if (rank == 1) {
            oa = i * (I)sa.v[0];
            ob = i * (I)sb.v[0];
        }
        // Unrolled with constant indices, so the dims stay in registers.
#pragma unroll
        for (int d = 5; d >= 0; --d) {
            if (d >= rank || rank == 1) continue;
            I s = (I)shape.v[d];
            I q = rest / s;
            I idx = rest - q * s;
            rest = q;
            oa += idx * (I)sa.v[d];
            ob += idx * (I)sb.v[d];
        }
        float r = binary_(op, load_as_float(a, (i64)oa, adt), load_as_float(b, (i64)ob, bdt));
        store_from_float(y, (i64)i, ydt, r);
    }
}

extern "C" __global__ void ddo_binary(const void* a, int adt, const void* b, int bdt, void* y,
                                      int ydt, i64 n, int rank, Dims6 shape, Dims6 sa,
                                      Dims6 sb, int op) {
    binary_body<i64>(a, adt, b, bdt, y, ydt, n, rank, shape, sa, sb, op);
}

extern "C" __global__ void ddo_binary32(const void* a, int adt, const void* b, int bdt,
                                        void* y, int ydt, i64 n, int rank, Dims6 shape,
                                        Dims6 sa, Dims6 sb, int op) {
    binary_body<u32>(a, adt, b, bdt, y, ydt, n, rank, shape, sa, sb, op);
}

// Rotary embedding on interleaved pairs: for pair p of x (elements 2p, 2p+1) and t = 2p mod
// table (table = l * d, the size of cos and sin):
//   y0 = x0 * cos[t] - x1 * sin[t],  y1 = x1 * cos[t+1] + x0 * sin[t+1].
extern "C" __global__ void ddo_rope(const void* x, int xdt, const void* c, int cdt,
                                    const void* s, int sdt, void* y, int ydt, i64 pairs,
                                    i64 table) {
    i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 p = (i64)blockIdx.x * blockDim.x + threadIdx.x; p < pairs; p += stride) {
        i64 i = 2 * p;
        i64 t = i % table;
        float x0 = load_as_float(x, i, xdt), x1 = load_as_float(x, i + 1, xdt);
        float c0 = load_as_float(c, t, cdt), c1 = load_as_float(c, t + 1, cdt);
        float s0 = load_as_float(s, t, sdt), s1 = load_as_float(s, t + 1, sdt);
        store_from_float(y, i, ydt, x0 * c0 - x1 * s0);
        store_from_float(y, i + 1, ydt, x1 * c1 + x0 * s1);
    }
}

// ---- Vectorised fast paths (16-byte accesses) ------------------------------------------
// Taken by ops/elementwise.rs when every operand has one dtype and is 16-byte aligned, and
// the innermost dim splits into whole vectors: W = 16 / element size lanes per vector
// (8 for f16/bf16, 4 for f32). Same values as the scalar kernels (each lane is computed in
// f32 and rounded once).

// Lane k of a vector of dtype dt, as f32.
__device__ __forceinline__ float lane_get(const uint4& v, int k, int dt) {
    if (dt == DTYPE_F32) return ((const float*)&v)[k];
    u16 h = ((const u16*)&v)[k];
    return dt == DTYPE_F16 ? f16_to_float(h) : bf16_to_float(h);
}
__device__ __forceinline__ void lane_set(uint4& v, int k, int dt, float f) {
    if (dt == DTYPE_F32) { ((float*)&v)[k] = f; return; }
    ((u16*)&v)[k] = dt == DTYPE_F16 ? float_to_f16(f) : float_to_bf16(f);
}

// y[i] = f(x[i]) over nvec whole vectors; x == y is allowed (in place).
// The vector kernels' bodies take their lane count as a template parameter (LANES = 4 for
// f32, 8 for the 16-bit dtypes, picked once per launch), so every lane loop
// unrolls with constant indices and a vector stays in registers: indexed at run time, it was
// kept in local memory (the PTX's ld.local/st.local on every lane).
template <int LANES>
__device__ __forceinline__ void unary_vec_body(const uint4* x, uint4* y, int dt, i64 nvec,
                                               int op, float mul, float add) {
    i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < nvec; i += stride) {
        uint4 v = x[i];
#pragma unroll
        for (int k = 0; k < LANES; ++k) lane_set(v, k, dt, unary_(op, lane_get(v, k, dt), mul, add));
        y[i] = v;
    }
}

extern "C" __global__ void ddo_unary_vec(const uint4* x, uint4* y, int dt, i64 nvec, int op,
                                         float mul, float add) {
    if (dt == DTYPE_F32) unary_vec_body<4>(x, y, dt, nvec, op, mul, add);
    else unary_vec_body<8>(x, y, dt, nvec, op, mul, add);
}

// y = a op b with broadcasting, a vector of W output elements per thread. `shape` is the
// coalesced output shape with its innermost dim counted in vectors; sa, sb are element
// strides (the innermost ones unused); a_vec / b_vec say whether that operand moves along
// the innermost dim (1: a whole vector is loaded) or is broadcast along it (0: one element
// is loaded and repeated). Offsets are 32-bit (the caller checks they fit).
template <int LANES>
__device__ __forceinline__ void binary_vec_body(const void* a, const void* b, uint4* y, int dt,
                                                u32 nvec, int rank, const Dims6& shape,
                                                const Dims6& sa, const Dims6& sb, int a_vec,
                                                int b_vec, int op) {
    const int lanes = LANES;
    u32 stride = gridDim.x * blockDim.x;
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < nvec; i += stride) {
        u32 rest = i, oa = 0, ob = 0;
#pragma unroll
        for (int d = 5; d >= 0; --d) {
            if (d >= rank) continue;
            u32 s = (u32)shape.v[d];
            u32 q = rest / s;
            u32 idx = rest - q * s;
            rest = q;
            if (d == rank - 1) idx *= (u32)lanes;
            oa += idx * (u32)sa.v[d];
            ob += idx * (u32)sb.v[d];
        }
        uint4 va, vb, r;
        float fa = 0.0f, fb = 0.0f;
        if (a_vec) va = *(const uint4*)((const char*)a + (u64)oa * (16 / lanes));
        else fa = load_as_float(a, (i64)oa, dt);
        if (b_vec) vb = *(const uint4*)((const char*)b + (u64)ob * (16 / lanes));
        else fb = load_as_float(b, (i64)ob, dt);
#pragma unroll
        for (int k = 0; k < LANES; ++k) {
            float x = a_vec ? lane_get(va, k, dt) : fa;
            float z = b_vec ? lane_get(vb, k, dt) : fb;
            lane_set(r, k, dt, binary_(op, x, z));
        }
        y[i] = r;
    }
}

extern "C" __global__ void ddo_binary_vec(const void* a, const void* b, uint4* y, int dt,
                                          u32 nvec, int rank, Dims6 shape, Dims6 sa,
                                          Dims6 sb, int a_vec, int b_vec, int op) {
    if (dt == DTYPE_F32) binary_vec_body<4>(a, b, y, dt, nvec, rank, shape, sa, sb, a_vec, b_vec, op);
    else binary_vec_body<8>(a, b, y, dt, nvec, rank, shape, sa, sb, a_vec, b_vec, op);
}

// Rotary embedding, four pairs (8 elements of a 16-bit dtype) per thread, for x of dtype dt
// laid out [b, h, l, d] and f32 tables [l, d] (table = l * d elements, a multiple of 8).
extern "C" __global__ void ddo_rope_vec(const uint4* x, const float4* c, const float4* s,
                                        uint4* y, int dt, i64 nvec, i64 table_vec) {
    i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < nvec; i += stride) {
        i64 t = (i % table_vec) * 2;
        uint4 v = x[i];
        float4 c0 = c[t], c1 = c[t + 1], s0 = s[t], s1 = s[t + 1];
        float cs[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
        float sn[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
        uint4 r;
#pragma unroll
        for (int k = 0; k < 8; k += 2) {
            float x0 = lane_get(v, k, dt), x1 = lane_get(v, k + 1, dt);
            lane_set(r, k, dt, x0 * cs[k] - x1 * sn[k]);
            lane_set(r, k + 1, dt, x1 * cs[k + 1] + x0 * sn[k + 1]);
        }
        y[i] = r;
    }
}

// ---- Gated residual (Ops::gated_add) ---------------------------------------------------
// o[r, c] = x[r, c] + g[(r / gg) * d + c] * y[r, c] over rows of d elements: g is one row
// per gg consecutive rows of x and y (a DiT block's [b, 1, d] gate over [b, t, d]). f32
// math, one rounding at the store. One block per row, grid-stride over rows.
extern "C" __global__ void ddo_gated_add(const void* x, int xdt, const void* g, int gdt,
                                         const void* y, int ydt, void* o, int odt, i64 rows,
                                         i64 d, i64 gg) {
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        i64 base = r * d, gb = (r / gg) * d;
        for (i64 c = threadIdx.x; c < d; c += blockDim.x) {
            float v = load_as_float(x, base + c, xdt) +
                      load_as_float(g, gb + c, gdt) * load_as_float(y, base + c, ydt);
            store_from_float(o, base + c, odt, v);
        }
    }
}

// The same with x, y and o of one dtype dt, 16-byte aligned, d a multiple of the vector's
// lanes (dvec = d / lanes vectors a row): 16-byte loads and stores. g is read a vector at a
// time where it has dt and is 16-byte aligned, else element by element (one row serves
// many rows of x: it stays in cache). Rows are counted in 32 bits where they fit (the
// caller says so with `small`): a 64-bit division is emulated in software.
template <int LANES, typename I>
__device__ __forceinline__ void gated_add_vec_body(const uint4* x, const void* g, int gdt,
                                                   const uint4* y, uint4* o, int dt, I rows,
                                                   I dvec, I gg) {
    const I d = dvec * LANES;
    const bool gvec = gdt == dt && ((unsigned long long)g & 15ull) == 0;
    for (I r = blockIdx.x; r < rows; r += gridDim.x) {
        i64 base = (i64)r * dvec, gb = (i64)(r / gg) * d;
        for (I c = threadIdx.x; c < dvec; c += blockDim.x) {
            uint4 vx = x[base + c], vy = y[base + c], vg, vo;
            i64 gc = gb + (i64)c * LANES;
            if (gvec) vg = *(const uint4*)((const char*)g + gc * (16 / LANES));
#pragma unroll
            for (int k = 0; k < LANES; ++k) {
                float gk = gvec ? lane_get(vg, k, dt) : load_as_float(g, gc + k, gdt);
                lane_set(vo, k, dt, lane_get(vx, k, dt) + gk * lane_get(vy, k, dt));
            }
            o[base + c] = vo;
        }
    }
}

extern "C" __global__ void ddo_gated_add_vec(const uint4* x, const void* g, int gdt,
                                             const uint4* y, uint4* o, int dt, i64 rows,
                                             i64 dvec, i64 gg, int small) {
    if (small && dt == DTYPE_F32)
        gated_add_vec_body<4, u32>(x, g, gdt, y, o, dt, (u32)rows, (u32)dvec, (u32)gg);
    else if (small)
        gated_add_vec_body<8, u32>(x, g, gdt, y, o, dt, (u32)rows, (u32)dvec, (u32)gg);
    else if (dt == DTYPE_F32)
        gated_add_vec_body<4, i64>(x, g, gdt, y, o, dt, rows, dvec, gg);
    else
        gated_add_vec_body<8, i64>(x, g, gdt, y, o, dt, rows, dvec, gg);
}

// float8_e4m3fn -> float, exactly: 4 exponent bits (bias 7), 3 mantissa bits, no
// infinities, S.1111.111 is NaN.
__device__ __forceinline__ float e4m3_to_float(u32 v) {
    u32 e = (v >> 3) & 15u, m = v & 7u;
    float r;
    if (e == 15u && m == 7u) {
        r = __int_as_float(0x7fc00000);
    } else if (e == 0u) {
        r = (float)m * 0.001953125f;  // m / 8 * 2^-6
    } else {
        r = __uint_as_float(((e + 120u) << 23) | (m << 20));  // exponent e - 7 + 127
    }
    return (v & 128u) ? -r : r;
}

// out[i] = x[i] * scale for 8-bit float x (e5m2 != 0: float8_e5m2, the top byte of an f16;
// else float8_e4m3fn) into a float dtype. The decode is exact (every fp8 value is an f16,
// bf16 and f32 value); a scaled fp8 tensor's per-tensor scale multiplies in f32 before the
// store rounds (scale 1 for an unscaled one: exact).
extern "C" __global__ void ddo_fp8_upcast(const unsigned char* x, int e5m2, float scale,
                                          void* out, int out_dtype, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n;
         i += (i64)gridDim.x * blockDim.x) {
        u32 b = x[i];
        float v = e5m2 ? f16_to_float((u16)(b << 8)) : e4m3_to_float(b);
        store_from_float(out, i, out_dtype, v * scale);
    }
}

// ddo_fp8_upcast into a 16-bit dtype (out_dtype DTYPE_F16 or DTYPE_BF16), eight codes per
// thread: one 8-byte load and one 16-byte store (x 8-byte and out 16-byte aligned, checked
// by the caller); the last n % 8 codes one at a time. Same values as ddo_fp8_upcast.
extern "C" __global__ void ddo_fp8_upcast_x8(const unsigned char* x, int e5m2, float scale,
                                             void* out, int out_dtype, i64 n) {
    const i64 vecs = n >> 3;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    const bool f16 = out_dtype == DTYPE_F16;
    for (i64 v = blockIdx.x * (i64)blockDim.x + threadIdx.x; v < vecs; v += stride) {
        uint2 in = ((const uint2*)x)[v];
        u32 w[4];
#pragma unroll
        for (int h = 0; h < 4; h++) {
            u32 word = h < 2 ? in.x : in.y;
            u32 shift = (h & 1) * 16;
            u32 lo = (word >> shift) & 255u, hi = (word >> (shift + 8)) & 255u;
            float a = e5m2 ? f16_to_float((u16)(lo << 8)) : e4m3_to_float(lo);
            float b = e5m2 ? f16_to_float((u16)(hi << 8)) : e4m3_to_float(hi);
            a *= scale;
            b *= scale;
            u32 ca = f16 ? float_to_f16(a) : float_to_bf16(a);
            u32 cb = f16 ? float_to_f16(b) : float_to_bf16(b);
            w[h] = ca | (cb << 16);
        }
        ((uint4*)out)[v] = make_uint4(w[0], w[1], w[2], w[3]);
    }
    for (i64 i = (vecs << 3) + blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += stride) {
        u32 b = x[i];
        float v = e5m2 ? f16_to_float((u16)(b << 8)) : e4m3_to_float(b);
        store_from_float(out, i, out_dtype, v * scale);
    }
}
