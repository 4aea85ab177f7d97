// GGUF dequantization kernels of DDO's CUDA backend (issue 37): llama.cpp's block formats
// (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) and the plain F32, F16, BF16
// tensors of a GGUF file into f32, f16 or bf16 (out_dtype: a DTYPE_* code of the PRELUDE).
// Compiled by NVRTC with ops/kernels.rs's PRELUDE in front.
//
// Bit-exact against ddo_core::gguf::dequantize (itself bit-exact against gguf-py): the same
// f32 expressions in the same order, f16 scales widened exactly, and every product and sum
// written with __fmul_rn / __fadd_rn / __fsub_rn so no multiply-add is contracted into an
// FMA. An f16/bf16 output rounds that f32 value once (round to nearest even).
//
// Layout of the block kernels: one thread per 8 consecutive output elements (8 divides the
// 32- and 256-element blocks), grid-stride over `n8 = elements / 8` items with 64-bit
// indices. A thread reads its block's scales and the 8 (or fewer) bytes of quants its
// elements need, computes 8 f32 values and stores them with 16-byte stores (one for a
// 16-bit output, two for f32) when `vec` says the output is 16-byte aligned. Adjacent
// threads write adjacent 16 or 32 bytes, so the stores of a warp are coalesced.
//
// Blocks sit at any byte offset (Q8_0 blocks are 34 bytes: 2-byte aligned at best): `al` is
// the alignment of the input's first byte (1, 2, 4, 8 or 16); each load uses the widest
// access that the field's offset, the block size and `al` allow (bytes when `al` is 1).

typedef unsigned char u8;

// The alignment guaranteed for offset `off` of every block of `stride` bytes whose first
// block starts at an `al`-aligned address: the lowest set bit of stride | off, at most al.
__device__ __forceinline__ int al_at(int al, int stride, int off) {
    int s = stride | off;
    int low = s & -s;
    return al < low ? al : low;
}

// Little-endian u16 / u32 at p (aligned to `al` bytes).
__device__ __forceinline__ u32 ld_u16(const u8* p, int al) {
    if (al >= 2) return *(const u16*)p;
    return (u32)p[0] | ((u32)p[1] << 8);
}
__device__ __forceinline__ u32 ld_u32(const u8* p, int al) {
    if (al >= 4) return *(const u32*)p;
    if (al >= 2) return (u32)((const u16*)p)[0] | ((u32)((const u16*)p)[1] << 16);
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}
// The 8 bytes at p as two little-endian words.
__device__ __forceinline__ void ld_8(const u8* p, int al, u32* w) {
    if (al >= 8) {
        uint2 x = *(const uint2*)p;
        w[0] = x.x;
        w[1] = x.y;
        return;
    }
    w[0] = ld_u32(p, al);
    w[1] = ld_u32(p + 4, al);
}
// Byte j (0..8) of the words of ld_8.
__device__ __forceinline__ u32 byte_of(const u32* w, int j) {
    return (w[j >> 2] >> ((j & 3) * 8)) & 255u;
}
// The f16 at p, widened exactly.
__device__ __forceinline__ float ld_f16(const u8* p, int al) {
    return f16_to_float((u16)ld_u16(p, al));
}

// Stores v[0..8] as elements e0..e0+8 of out (out_dtype); `vec`: out is 16-byte aligned
// (e0 is a multiple of 8, so every store is aligned too).
__device__ __forceinline__ void store8(void* out, i64 e0, int out_dtype, const float* v,
                                       int vec) {
    if (out_dtype == DTYPE_F32) {
        float* o = (float*)out + e0;
        if (vec) {
            ((float4*)o)[0] = make_float4(v[0], v[1], v[2], v[3]);
            ((float4*)o)[1] = make_float4(v[4], v[5], v[6], v[7]);
        } else {
#pragma unroll
            for (int j = 0; j < 8; j++) o[j] = v[j];
        }
        return;
    }
    const bool f16 = out_dtype == DTYPE_F16;
    u32 w[4];
#pragma unroll
    for (int h = 0; h < 4; h++) {
        u32 a = f16 ? float_to_f16(v[2 * h]) : float_to_bf16(v[2 * h]);
        u32 b = f16 ? float_to_f16(v[2 * h + 1]) : float_to_bf16(v[2 * h + 1]);
        w[h] = a | (b << 16);
    }
    u16* o = (u16*)out + e0;
    if (vec) {
        *(uint4*)o = make_uint4(w[0], w[1], w[2], w[3]);
    } else {
#pragma unroll
        for (int h = 0; h < 4; h++) {
            o[2 * h] = (u16)(w[h] & 0xffffu);
            o[2 * h + 1] = (u16)(w[h] >> 16);
        }
    }
}

// ---- The block formats. Each `deq(b, p, al, v)` writes elements 8p..8p+8 of the block at
// b (aligned as `al` says for the first block) into v. Offsets as in ddo-core's quant.rs.

// Q4_0, 18 bytes: d f16, 16 bytes of nibbles (low nibbles elements 0..16, high 16..32);
// d * (q - 8).
struct BQ4_0 {
    static constexpr int BYTES = 18, PARTS = 4;
    static __device__ __forceinline__ void deq(const u8* b, int p, int al, float* v) {
        const float d = ld_f16(b, al_at(al, BYTES, 0));
        u32 w[2];
        ld_8(b + 2 + 8 * (p & 1), al_at(al, BYTES, 2), w);
        const int shift = 4 * (p >> 1);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            int q = (int)((byte_of(w, j) >> shift) & 15u) - 8;
            v[j] = __fmul_rn(d, (float)q);
        }
    }
};

// Q4_1, 20 bytes: d, m f16, 16 bytes of nibbles; d * q + m.
struct BQ4_1 {
    static constexpr int BYTES = 20, PARTS = 4;
    static __device__ __forceinline__ void deq(const u8* b, int p, int al, float* v) {
        const float d = ld_f16(b, al_at(al, BYTES, 0));
        const float m = ld_f16(b + 2, al_at(al, BYTES, 2));
        u32 w[2];
        ld_8(b + 4 + 8 * (p & 1), al_at(al, BYTES, 4), w);
        const int shift = 4 * (p >> 1);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            u32 q = (byte_of(w, j) >> shift) & 15u;
            v[j] = __fadd_rn(__fmul_rn(d, (float)q), m);
        }
    }
};

// Q5_0, 22 bytes: d f16, qh u32 (bit j: element j's fifth bit), 16 bytes of nibbles;
// d * (q - 16).
struct BQ5_0 {
    static constexpr int BYTES = 22, PARTS = 4;
    static __device__ __forceinline__ void deq(const u8* b, int p, int al, float* v) {
        const float d = ld_f16(b, al_at(al, BYTES, 0));
        const u32 qh = ld_u32(b + 2, al_at(al, BYTES, 2));
        u32 w[2];
        ld_8(b + 6 + 8 * (p & 1), al_at(al, BYTES, 6), w);
        const int shift = 4 * (p >> 1);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int e = 8 * p + j;
            u32 q = ((byte_of(w, j) >> shift) & 15u) | (((qh >> e) & 1u) << 4);
            v[j] = __fmul_rn(d, (float)((int)q - 16));
        }
    }
};

// Q5_1, 24 bytes: d, m f16, qh u32, 16 bytes of nibbles; d * q + m.
struct BQ5_1 {
    static constexpr int BYTES = 24, PARTS = 4;
    static __device__ __forceinline__ void deq(const u8* b, int p, int al, float* v) {
        const float d = ld_f16(b, al_at(al, BYTES, 0));
        const float m = ld_f16(b + 2, al_at(al, BYTES, 2));
        const u32 qh = ld_u32(b + 4, al_at(al, BYTES, 4));
        u32 w[2];
        ld_8(b + 8 + 8 * (p & 1), al_at(al, BYTES, 8), w);
        const int shift = 4 * (p >> 1);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int e = 8 * p + j;
            u32 q = ((byte_of(w, j) >> shift) & 15u) | (((qh >> e) & 1u) << 4);
            v[j] = __fadd_rn(__fmul_rn(d, (float)q), m);
        }
    }
};

// Q8_0, 34 bytes: d f16, 32 i8; q * d.
struct BQ8_0 {
    static constexpr int BYTES = 34, PARTS = 4;
    static __device__ __forceinline__ void deq(const u8* b, int p, int al, float* v) {
        const float d = ld_f16(b, al_at(al, BYTES, 0));
        u32 w[2];
        ld_8(b + 2 + 8 * p, al_at(al, BYTES, 2), w);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            v[j] = __fmul_rn((float)(signed char)byte_of(w, j), d);
        }
    }
};

// Q2_K, 84 bytes: 16 bytes of scales (low nibble scale, high nibble min, one per 16
// elements), 64 bytes of 2-bit quants, d, dmin f16; (d * sc) * q - dmin * m. Each half of
// the block (128 elements) reads its 32 bytes of quants four times, shifting by 0, 2, 4, 6.
struct BQ2_K {
    static constexpr int BYTES = 84, PARTS = 32;
    static __device__ __forceinline__ void deq(const u8* b, int p, int al, float* v) {
        const float d = ld_f16(b + 80, al_at(al, BYTES, 80));
        const float dmin = ld_f16(b + 82, al_at(al, BYTES, 82));
        const u32 sc = b[p >> 1];
        const float dl = __fmul_rn(d, (float)(sc & 15u));
        const float ml = __fmul_rn(dmin, (float)(sc >> 4));
        u32 w[2];
        ld_8(b + 16 + 32 * (p >> 4) + 8 * (p & 3), al_at(al, BYTES, 8), w);
        const int shift = 2 * ((p & 15) >> 2);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            u32 q = (byte_of(w, j) >> shift) & 3u;
            v[j] = __fsub_rn(__fmul_rn(dl, (float)q), ml);
        }
    }
};

// Q3_K, 110 bytes: 32 bytes of high-bit mask, 64 bytes of 2-bit quants, 12 bytes of 6-bit
// scales, d f16; (d * (sc - 32)) * (q - 4 * !mask).
struct BQ3_K {
    static constexpr int BYTES = 110, PARTS = 32;
    static __device__ __forceinline__ void deq(const u8* b, int p, int al, float* v) {
        const float d = ld_f16(b + 108, al_at(al, BYTES, 108));
        const int g = p >> 1;
        const u32 low = ((u32)b[96 + (g & 7)] >> (4 * (g >> 3))) & 15u;
        const u32 high = ((u32)b[104 + (g & 3)] >> (2 * (g >> 2))) & 3u;
        const float dl = __fmul_rn(d, (float)((int)(low | (high << 4)) - 32));
        u32 hm[2], qs[2];
        ld_8(b + 8 * (p & 3), al_at(al, BYTES, 8), hm);
        ld_8(b + 32 + 32 * (p >> 4) + 8 * (p & 3), al_at(al, BYTES, 8), qs);
        const int hshift = p >> 2;
        const int qshift = 2 * ((p & 15) >> 2);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            // A set mask bit means no offset; a clear one subtracts 4.
            int h = (int)(((byte_of(hm, j) >> hshift) & 1u) ^ 1u);
            int q = (int)((byte_of(qs, j) >> qshift) & 3u) - (h << 2);
            v[j] = __fmul_rn(dl, (float)q);
        }
    }
};

// Q4_K's and Q5_K's 6-bit scale and minimum of sub-block j (0..8) from the 12 bytes at s.
__device__ __forceinline__ void scale_min_k4(const u8* s, int j, u32* sc, u32* m) {
    if (j < 4) {
        *sc = s[j] & 63u;
        *m = s[j + 4] & 63u;
    } else {
        const u32 m_d = s[j + 4];
        *sc = (m_d & 15u) | (((u32)s[j - 4] >> 2) & 48u);
        *m = (m_d >> 4) | (((u32)s[j] >> 2) & 48u);
    }
}

// Q4_K, 144 bytes: d, dmin f16, 12 bytes of 6-bit scales and mins (one each per 32
// elements), 128 bytes of nibbles (each 64 elements read 32 bytes twice, low nibbles then
// high); (d * sc) * q - dmin * m.
struct BQ4_K {
    static constexpr int BYTES = 144, PARTS = 32;
    static __device__ __forceinline__ void deq(const u8* b, int p, int al, float* v) {
        const float d = ld_f16(b, al_at(al, BYTES, 0));
        const float dmin = ld_f16(b + 2, al_at(al, BYTES, 2));
        const int sub = p >> 2;
        u32 sc, m;
        scale_min_k4(b + 4, sub, &sc, &m);
        const float ds = __fmul_rn(d, (float)sc);
        const float dm = __fmul_rn(dmin, (float)m);
        u32 w[2];
        ld_8(b + 16 + 32 * (sub >> 1) + 8 * (p & 3), al_at(al, BYTES, 8), w);
        const int shift = 4 * (sub & 1);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            u32 q = (byte_of(w, j) >> shift) & 15u;
            v[j] = __fsub_rn(__fmul_rn(ds, (float)q), dm);
        }
    }
};

// Q5_K, 176 bytes: d, dmin f16, 12 bytes of scales and mins, 32 bytes of fifth bits (bit
// `sub` of byte i: element 32 * sub + i), 128 bytes of nibbles as Q4_K's.
struct BQ5_K {
    static constexpr int BYTES = 176, PARTS = 32;
    static __device__ __forceinline__ void deq(const u8* b, int p, int al, float* v) {
        const float d = ld_f16(b, al_at(al, BYTES, 0));
        const float dmin = ld_f16(b + 2, al_at(al, BYTES, 2));
        const int sub = p >> 2;
        u32 sc, m;
        scale_min_k4(b + 4, sub, &sc, &m);
        const float ds = __fmul_rn(d, (float)sc);
        const float dm = __fmul_rn(dmin, (float)m);
        u32 qh[2], qs[2];
        ld_8(b + 16 + 8 * (p & 3), al_at(al, BYTES, 8), qh);
        ld_8(b + 48 + 32 * (sub >> 1) + 8 * (p & 3), al_at(al, BYTES, 8), qs);
        const int shift = 4 * (sub & 1);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            u32 q = ((byte_of(qs, j) >> shift) & 15u) | (((byte_of(qh, j) >> sub) & 1u) << 4);
            v[j] = __fsub_rn(__fmul_rn(ds, (float)q), dm);
        }
    }
};

// Q6_K, 210 bytes: 128 bytes of low nibbles, 64 bytes of 2-bit high parts, 16 i8 scales
// (one per 16 elements), d f16; (d * sc) * (q - 32).
struct BQ6_K {
    static constexpr int BYTES = 210, PARTS = 32;
    static __device__ __forceinline__ void deq(const u8* b, int p, int al, float* v) {
        const float d = ld_f16(b + 208, al_at(al, BYTES, 208));
        const float ds = __fmul_rn(d, (float)(signed char)b[192 + (p >> 1)]);
        const int hf = p >> 4;
        u32 ql[2], qh[2];
        ld_8(b + 64 * hf + 8 * (p & 7), al_at(al, BYTES, 8), ql);
        ld_8(b + 128 + 32 * hf + 8 * (p & 3), al_at(al, BYTES, 8), qh);
        const int lshift = 4 * ((p & 15) >> 3);
        const int hshift = 2 * ((p & 15) >> 2);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            u32 low = (byte_of(ql, j) >> lshift) & 15u;
            u32 high = (byte_of(qh, j) >> hshift) & 3u;
            v[j] = __fmul_rn(ds, (float)((int)(low | (high << 4)) - 32));
        }
    }
};

// The grid-stride loop of a block format B over n8 items of 8 elements.
template <class B>
__device__ __forceinline__ void deq_blocks(const u8* __restrict__ x, int al, void* out,
                                           int out_dtype, i64 n8, int vec) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 t = blockIdx.x * (i64)blockDim.x + threadIdx.x; t < n8; t += stride) {
        const i64 blk = t / B::PARTS;
        const int p = (int)(t - blk * B::PARTS);
        float v[8];
        B::deq(x + blk * B::BYTES, p, al, v);
        store8(out, t * 8, out_dtype, v, vec);
    }
}

// One kernel per format: x the blocks (first byte `al`-aligned), out `n8 * 8` elements of
// out_dtype (16-byte aligned when `vec`).
extern "C" __global__ void __launch_bounds__(256)
    ddo_gguf_q4_0(const u8* x, int al, void* out, int out_dtype, i64 n8, int vec) {
    deq_blocks<BQ4_0>(x, al, out, out_dtype, n8, vec);
}
extern "C" __global__ void __launch_bounds__(256)
    ddo_gguf_q4_1(const u8* x, int al, void* out, int out_dtype, i64 n8, int vec) {
    deq_blocks<BQ4_1>(x, al, out, out_dtype, n8, vec);
}
extern "C" __global__ void __launch_bounds__(256)
    ddo_gguf_q5_0(const u8* x, int al, void* out, int out_dtype, i64 n8, int vec) {
    deq_blocks<BQ5_0>(x, al, out, out_dtype, n8, vec);
}
extern "C" __global__ void __launch_bounds__(256)
    ddo_gguf_q5_1(const u8* x, int al, void* out, int out_dtype, i64 n8, int vec) {
    deq_blocks<BQ5_1>(x, al, out, out_dtype, n8, vec);
}
extern "C" __global__ void __launch_bounds__(256)
    ddo_gguf_q8_0(const u8* x, int al, void* out, int out_dtype, i64 n8, int vec) {
    deq_blocks<BQ8_0>(x, al, out, out_dtype, n8, vec);
}
extern "C" __global__ void __launch_bounds__(256)
    ddo_gguf_q2_k(const u8* x, int al, void* out, int out_dtype, i64 n8, int vec) {
    deq_blocks<BQ2_K>(x, al, out, out_dtype, n8, vec);
}
extern "C" __global__ void __launch_bounds__(256)
    ddo_gguf_q3_k(const u8* x, int al, void* out, int out_dtype, i64 n8, int vec) {
    deq_blocks<BQ3_K>(x, al, out, out_dtype, n8, vec);
}
extern "C" __global__ void __launch_bounds__(256)
    ddo_gguf_q4_k(const u8* x, int al, void* out, int out_dtype, i64 n8, int vec) {
    deq_blocks<BQ4_K>(x, al, out, out_dtype, n8, vec);
}
extern "C" __global__ void __launch_bounds__(256)
    ddo_gguf_q5_k(const u8* x, int al, void* out, int out_dtype, i64 n8, int vec) {
    deq_blocks<BQ5_K>(x, al, out, out_dtype, n8, vec);
}
extern "C" __global__ void __launch_bounds__(256)
    ddo_gguf_q6_k(const u8* x, int al, void* out, int out_dtype, i64 n8, int vec) {
    deq_blocks<BQ6_K>(x, al, out, out_dtype, n8, vec);
}

// The plain formats: n elements of src (DTYPE_F32, DTYPE_F16 or DTYPE_BF16, little-endian,
// first byte `al`-aligned) into out_dtype, one element per thread and iteration. The same
// dtype in and out copies the bits; F32 into f32 keeps every bit (NaN payloads too).
extern "C" __global__ void __launch_bounds__(256)
    ddo_gguf_float(const u8* x, int src, int al, void* out, int out_dtype, i64 n) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += stride) {
        if (src == DTYPE_F32) {
            const u32 bits = ld_u32(x + 4 * i, al_at(al, 4, 0));
            if (out_dtype == DTYPE_F32) {
                ((u32*)out)[i] = bits;
            } else {
                store_from_float(out, i, out_dtype, __uint_as_float(bits));
            }
        } else {
            const u16 h = (u16)ld_u16(x + 2 * i, al_at(al, 2, 0));
            if (out_dtype == src) {
                ((u16*)out)[i] = h;
            } else {
                const float f = src == DTYPE_F16 ? f16_to_float(h) : bf16_to_float(h);
                store_from_float(out, i, out_dtype, f);
            }
        }
    }
}
