// Layout kernels of DDO's CUDA backend: a general strided copy (permute, narrow, concat;
// up to 6 dims per launch, converting dtypes when they differ), nearest 2x upsampling and
// embedding gathers. Compiled by NVRTC with ops/kernels.rs's PRELUDE in front. Same-dtype
// copies move raw bits (NaN payloads included), as the host backend's byte copies do.

__device__ __forceinline__ void copy_elem(const void* src, i64 si, int sdt, void* dst, i64 di,
                                          int ddt) {
    if (sdt == ddt) {
        if (sdt == DTYPE_F32) ((u32*)dst)[di] = ((const u32*)src)[si];
        else ((u16*)dst)[di] = ((const u16*)src)[si];
    } else {
        store_from_float(dst, di, ddt, load_as_float(src, si, sdt));
    }
}

// For each row-major index i < n of `shape` (rank <= 6):
//   dst[sum idx[d] * dstr[d]] = src[sum idx[d] * sstr[d]].
// I is the index type: u32 when source and destination have fewer than 2^31 elements
// (32-bit division is several times cheaper), else i64.
template <typename I>
__device__ __forceinline__ void copy_nd_body(const void* src, int sdt, void* dst, int ddt,
                                             i64 n, int rank, const Dims6& shape,
                                             const Dims6& sstr, const Dims6& dstr) {
    I stride = (I)gridDim.x * blockDim.x;
    for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < (I)n; i += stride) {
        I rest = i, so = 0, d_o = 0;
        if (rank == 1) {
            so = i * (I)sstr.v[0];
            d_o = i * (I)dstr.v[0];
        }
        // Unrolled with constant indices, so the dims stay in registers.
#pragma unroll
        for (int d = 5; d >= 0; --d) {
            if (d >= rank || rank == 1) continue;
            I s = (I)shape.v[d];
            I q = rest / s;
            I idx = rest - q * s;
            rest = q;
            so += idx * (I)sstr.v[d];
            d_o += idx * (I)dstr.v[d];
        }
        copy_elem(src, (i64)so, sdt, dst, (i64)d_o, ddt);
    }
}

extern "C" __global__ void ddo_copy_nd(const void* src, int sdt, void* dst, int ddt, i64 n,
                                       int rank, Dims6 shape, Dims6 sstr, Dims6 dstr) {
    copy_nd_body<i64>(src, sdt, dst, ddt, n, rank, shape, sstr, dstr);
}

extern "C" __global__ void ddo_copy_nd32(const void* src, int sdt, void* dst, int ddt, i64 n,
                                         int rank, Dims6 shape, Dims6 sstr, Dims6 dstr) {
    copy_nd_body<u32>(src, sdt, dst, ddt, n, rank, shape, sstr, dstr);
}

// y [rows * 2, 2w] from x [rows, w] (rows = n * c * h): y[r2, c2] = x[r2 / 2, c2 / 2].
extern "C" __global__ void ddo_upsample2x(const void* x, void* y, int dt, i64 total, i64 w) {
    i64 stride = (i64)gridDim.x * blockDim.x;
    i64 w2 = 2 * w;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        i64 r2 = i / w2;
        i64 c2 = i - r2 * w2;
        copy_elem(x, (r2 >> 1) * w + (c2 >> 1), dt, y, i, dt);
    }
}

// y [count, d] = table[ids[r], :] (ids checked against the table's rows on the host).
extern "C" __global__ void ddo_embedding(const void* table, const u32* ids, void* y, int dt,
                                         i64 count, i64 d) {
    i64 total = count * d;
    i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        i64 r = i / d;
        i64 j = i - r * d;
        copy_elem(table, (i64)ids[r] * d + j, dt, y, i, dt);
    }
}

// copy_nd on raw units of T (u32, uint2 or uint4): same dtype on both sides, shape and
// strides counted in units (ops/layout.rs folds the innermost contiguous dim into units of
// up to 16 bytes when sizes, strides and addresses allow). 32-bit offsets.
template <typename T>
__device__ __forceinline__ void copy_units_body(const T* src, T* dst, u32 n, int rank,
                                                const Dims6& shape, const Dims6& sstr,
                                                const Dims6& dstr) {
    u32 stride = gridDim.x * blockDim.x;
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        u32 rest = i, so = 0, d_o = 0;
#pragma unroll
        for (int d = 5; d >= 0; --d) {
            if (d >= rank) continue;
            u32 s = (u32)shape.v[d];
            u32 q = rest / s;
            u32 idx = rest - q * s;
            rest = q;
            so += idx * (u32)sstr.v[d];
            d_o += idx * (u32)dstr.v[d];
        }
        dst[d_o] = src[so];
    }
}

extern "C" __global__ void ddo_copy_units4(const u32* src, u32* dst, u32 n, int rank,
                                           Dims6 shape, Dims6 sstr, Dims6 dstr) {
    copy_units_body<u32>(src, dst, n, rank, shape, sstr, dstr);
}
extern "C" __global__ void ddo_copy_units8(const uint2* src, uint2* dst, u32 n, int rank,
                                           Dims6 shape, Dims6 sstr, Dims6 dstr) {
    copy_units_body<uint2>(src, dst, n, rank, shape, sstr, dstr);
}
extern "C" __global__ void ddo_copy_units16(const uint4* src, uint4* dst, u32 n, int rank,
                                            Dims6 shape, Dims6 sstr, Dims6 dstr) {
    copy_units_body<uint4>(src, dst, n, rank, shape, sstr, dstr);
}
