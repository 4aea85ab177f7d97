// `--compute fp8` (issue 39): an activation's per-tensor amax, then its E4M3 codes, for the
// cuBLASLt fp8 GEMM (`ops/fp8.rs`). The recipe is `ddo_core::fp8_compute`'s: scale =
// 448 / max(amax, 1e-12), codes = e4m3(clamp(x * scale, -448, 448)) rounded to nearest even,
// computed here in software so that the codes are the host reference's bit for bit on every
// architecture.
//
// state (u32[16], 64 bytes, zeroed before ddo_fp8_amax): [0] the amax's bits (non-negative
// floats order as their bits), [1] 1 when a value is NaN or infinite, [4] 1 / scale as a float
// (the GEMM's B scale, written by ddo_fp8_quantize), [8] the weight's scale as a float (the
// GEMM's A scale where it is read on the device, written by ddo_fp8_weight_scale before each
// GEMM: one activation's codes serve several weights). The two scales
// sit 16 bytes apart, on 16-byte boundaries: cuBLASLt 13.1 refuses an E4M3 matmul
// (CUBLAS_STATUS_NOT_SUPPORTED) whose scale pointers are only 4- or 8-byte aligned.

// |x| <= 448 or NaN, to E4M3 (fn: no infinities, 0x7f is NaN), nearest even.
__device__ __forceinline__ u32 float_to_e4m3(float v) {
    u32 sign = (__float_as_uint(v) >> 24) & 0x80u;
    float a = fabsf(v);
    if (a != a) return sign | 0x7fu;
    if (a < 0.015625f) {
        // Subnormals step by 2^-9; 8 steps is 2^-6, the smallest normal (code 0x08).
        return sign | __float2uint_rn(a * 512.0f);
    }
    u32 bits = __float_as_uint(a);
    bits += 0x7ffffu + ((bits >> 20) & 1u);  // round the mantissa to 3 bits, ties to even
    u32 e = (bits >> 23) - 120u;             // exponent - 127 + 7
    u32 code = (e << 3) | ((bits >> 20) & 7u);
    return sign | (code > 0x7eu ? 0x7eu : code);  // 448 at most
}

// A 16-bit element's bits to float (F16 or BF16).
__device__ __forceinline__ float bits16_to_float(u32 b, int dtype) {
    return dtype == DTYPE_F16 ? f16_to_float((u16)b) : bf16_to_float((u16)b);
}

// Where the 8-wide (16-byte) loop of a 16-bit x ends: x on a 16-byte boundary, else 0 (the
// element loop does all). Elements from there on go one at a time.
__device__ __forceinline__ i64 vector_end(const void* x, int dtype, i64 n) {
    if (dtype == DTYPE_F32 || ((unsigned long long)x & 15ull) != 0ull) return 0;
    return n / 8 * 8;
}

// The 8 16-bit elements of x's j-th 16-byte word, as floats, in order.
__device__ __forceinline__ void load8(const void* x, i64 j, int dtype, float v[8]) {
    const uint4 w = ((const uint4*)x)[j];
    const u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int k = 0; k < 4; k++) {
        v[2 * k] = bits16_to_float(words[k] & 0xffffu, dtype);
        v[2 * k + 1] = bits16_to_float(words[k] >> 16, dtype);
    }
}

__device__ __forceinline__ void amax_add(float v, float& m, u32& bad) {
    float a = fabsf(v);
    if (a <= 3.402823466e38f) {
        m = fmaxf(m, a);
    } else {
        bad = 1u;
    }
}

// Largest |x[i]| into state[0], and state[1] = 1 when some x[i] is not finite. Launched on a
// bounded grid (`ops/fp8.rs`): one atomic per block.
extern "C" __global__ void ddo_fp8_amax(const void* x, int dtype, i64 n, u32* state) {
    __shared__ float scratch[32];
    float m = 0.0f;
    u32 bad = 0u;
    const i64 tid = blockIdx.x * (i64)blockDim.x + threadIdx.x;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    const i64 vend = vector_end(x, dtype, n);
    for (i64 j = tid; j < vend / 8; j += stride) {
        float v[8];
        load8(x, j, dtype, v);
#pragma unroll
        for (int k = 0; k < 8; k++) amax_add(v[k], m, bad);
    }
    for (i64 i = vend + tid; i < n; i += stride) amax_add(load_as_float(x, i, dtype), m, bad);
    m = block_max(m, scratch);
    if (threadIdx.x == 0) atomicMax(&state[0], __float_as_uint(m));
    if (bad) atomicOr(&state[1], 1u);
}

// Where element i of a part `cols` wide goes in an activation `ld` wide, at column `off`:
// i itself for the whole activation (no division), else (i / cols) * ld + off + i % cols, in
// 32 bits where i fits (a 64-bit division is emulated: it had made the code kernel's work
// per 16-byte word several times its memory traffic's).
__device__ __forceinline__ i64 code_at(i64 i, i64 cols, i64 ld, i64 off, bool whole, bool narrow) {
    if (whole) return i;
    if (narrow) {
        const u32 row = (u32)i / (u32)cols;
        return (i64)row * ld + off + (i64)((u32)i - row * (u32)cols);
    }
    return (i / cols) * ld + off + i % cols;
}

// One element's code at `scale` (clamped to E4M3's range; NaN stays NaN).
__device__ __forceinline__ u32 quantize_one(float v, float scale) {
    float s = v * scale;
    if (s > 448.0f) {
        s = 448.0f;
    } else if (s < -448.0f) {
        s = -448.0f;
    }
    return float_to_e4m3(s);
}

// q[dst(i)] = e4m3(clamp(x[i] * scale, -448, 448)); state[4] = 1 / scale. x is a part of
// `cols` columns of an activation `ld` columns wide, at column `off` (the whole activation:
// cols = ld, off = 0): dst(i) = (i / cols) * ld + off + i % cols. With a non-finite value in
// x the scale is NaN: every code is NaN and so is the product (the step's finite check stops
// the run). 16-bit elements go 8 at a time where cols, ld and off are multiples of 8 (a
// 16-byte load, an 8-byte store: q is allocated on a 256-byte boundary), each to the code the
// element loop gives it.
extern "C" __global__ void ddo_fp8_quantize(const void* x, int dtype, i64 n, u32* state,
                                            unsigned char* q, i64 cols, i64 ld, i64 off) {
    float amax = __uint_as_float(state[0]);
    float scale = 448.0f / fmaxf(amax, 1e-12f);
    if (state[1] != 0u) scale = __int_as_float(0x7fc00000);
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        state[4] = __float_as_uint(1.0f / scale);
    }
    const i64 tid = blockIdx.x * (i64)blockDim.x + threadIdx.x;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    const bool in_eights = cols % 8 == 0 && ld % 8 == 0 && off % 8 == 0;
    const bool whole = cols == ld && off == 0;
    const bool narrow = n <= 0xffffffffll && cols <= 0xffffffffll;
    const i64 vend = in_eights ? vector_end(x, dtype, n) : 0;
    for (i64 j = tid; j < vend / 8; j += stride) {
        float v[8];
        load8(x, j, dtype, v);
        u32 packed[2] = {0u, 0u};
#pragma unroll
        for (int k = 0; k < 8; k++) packed[k / 4] |= quantize_one(v[k], scale) << (8 * (k % 4));
        ((uint2*)q)[code_at(j * 8, cols, ld, off, whole, narrow) / 8] =
            make_uint2(packed[0], packed[1]);
    }
    for (i64 i = vend + tid; i < n; i += stride) {
        q[code_at(i, cols, ld, off, whole, narrow)] =
            (unsigned char)quantize_one(load_as_float(x, i, dtype), scale);
    }
}

// state[8] = w_scale: the weight's scale where the next GEMM reads it. One thread.
extern "C" __global__ void ddo_fp8_weight_scale(u32* state, float w_scale) {
    if (blockIdx.x == 0 && threadIdx.x == 0) state[8] = __float_as_uint(w_scale);
}
