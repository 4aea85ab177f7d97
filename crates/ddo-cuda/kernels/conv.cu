// Kernels of the GEMM-based ops of DDO's CUDA backend (compiled by NVRTC with the PRELUDE of
// ops/kernels.rs in front): the bias broadcast that seeds a GEMM's output (cuBLAS then adds
// the product with beta = 1, so the result is rounded once), im2col, and the implicit-GEMM
// 3x3 convolution on tensor cores.

// Seeds a GEMM output [rows, cols] (out_dtype) with a bias (bias_dtype), no division per
// element: per_row == 0 (linear): out[r][c] = bias[c]; per_row != 0 (convolution, rows =
// images x channels, cols = oh * ow): out[r][c] = bias[r % channels]. Grid: x over
// columns, y over rows, both grid-strided; sized so each thread writes many elements.
template <typename T>
__device__ __forceinline__ void fill_bias_t(T* __restrict__ out, const void* __restrict__ bias,
                                            int bias_dtype, i64 rows, i64 cols, i64 channels,
                                            int per_row, int out_dtype) {
    auto enc = [&](float v) -> T {
        if (sizeof(T) == 4) return __float_as_uint(v);
        return out_dtype == DTYPE_F16 ? float_to_f16(v) : float_to_bf16(v);
    };
    const i64 cstart = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const i64 cstride = (i64)gridDim.x * blockDim.x;
    if (per_row) {
        for (i64 r = blockIdx.y; r < rows; r += gridDim.y) {
            const T v = enc(load_as_float(bias, r % channels, bias_dtype));
            T* row = out + r * cols;
            for (i64 c = cstart; c < cols; c += cstride) row[c] = v;
        }
    } else {
        for (i64 c = cstart; c < cols; c += cstride) {
            const T v = enc(load_as_float(bias, c, bias_dtype));
            for (i64 r = blockIdx.y; r < rows; r += gridDim.y) out[r * cols + c] = v;
        }
    }
}

extern "C" __global__ void ddo_fill_bias(void* __restrict__ out, int out_dtype,
                                         const void* __restrict__ bias, int bias_dtype,
                                         i64 rows, i64 cols, i64 channels, int per_row) {
    if (out_dtype == DTYPE_F32) {
        fill_bias_t<u32>((u32*)out, bias, bias_dtype, rows, cols, channels, per_row, out_dtype);
    } else {
        fill_bias_t<u16>((u16*)out, bias, bias_dtype, rows, cols, channels, per_row, out_dtype);
    }
}

// im2col of `images` NCHW images (element type T: 2 or 4 bytes, copied bit for bit; zero
// padding is all-zero bits in every float dtype) for output rows [r0, r0 + rows):
// cols[img][(c * kh + ky) * kw + kx][(oy - r0) * ow + ox] = x[img][c][iy][ix] with
// iy = oy * sh - ph + ky, ix = ox * sw - pw + kx (0 outside the image).
// geo: {c, h, w, kh, kw, ow}; win: {sh, sw, ph, pw, r0, rows}. Grid: x over the columns
// of one row (rows * ow < 2^31), y over kernel rows (c * kh * kw), z over images; each
// dimension grid-strided, so any grid size is correct.
template <typename T>
__device__ __forceinline__ void im2col(const T* __restrict__ x, T* __restrict__ cols, Dims6 geo,
                                       Dims6 win, int images) {
    const int c = (int)geo.v[0], h = (int)geo.v[1], w = (int)geo.v[2];
    const int kh = (int)geo.v[3], kw = (int)geo.v[4], ow = (int)geo.v[5];
    const int sh = (int)win.v[0], sw = (int)win.v[1], ph = (int)win.v[2], pw = (int)win.v[3];
    const int r0 = (int)win.v[4], rows = (int)win.v[5];
    const int ncol = rows * ow;
    const int kdim = c * kh * kw;
    for (int img = blockIdx.z; img < images; img += gridDim.z) {
        for (int r = blockIdx.y; r < kdim; r += gridDim.y) {
            const int kx = r % kw, ky = (r / kw) % kh, ch = r / (kw * kh);
            const T* src = x + ((i64)img * c + ch) * h * w;
            T* dst = cols + ((i64)img * kdim + r) * ncol;
            for (int col = blockIdx.x * blockDim.x + threadIdx.x; col < ncol;
                 col += gridDim.x * blockDim.x) {
                const int oy = r0 + col / ow, ox = col % ow;
                const int iy = oy * sh - ph + ky, ix = ox * sw - pw + kx;
                T v = (T)0;
                if (iy >= 0 && iy < h && ix >= 0 && ix < w) v = src[(i64)iy * w + ix];
                dst[col] = v;
            }
        }
    }
}

extern "C" __global__ void ddo_im2col_b16(const u16* x, u16* cols, Dims6 geo, Dims6 win,
                                          int images) {
    im2col<u16>(x, cols, geo, win, images);
}

extern "C" __global__ void ddo_im2col_b32(const u32* x, u32* cols, Dims6 geo, Dims6 win,
                                          int images) {
    im2col<u32>(x, cols, geo, win, images);
}

// ---------------------------------------------------------------------------------------
// Implicit-GEMM convolution on tensor cores (f16/bf16, NCHW, any kernel size, stride and
// padding)
// ---------------------------------------------------------------------------------------
//
// Per image: out[o][p] = bias[o] + sum_k wp[o][k] * X[k][p] with the reduction index
// k = tap * cp + c (tap = ky * kw + kx, c < cp = c rounded up to 32) and p = (oy, ox);
// X[k][p] = x[c][oy * sh - ph + ky][ox * sw - pw + kx] (0 outside the image or for
// c >= channels) is gathered straight from x — no im2col buffer. `wp` is the weight
// permuted tap-major and zero-padded by ddo_conv_pack_weights, so every K step of 32 is one
// tap and 32 channels: the bounds of a pixel are checked once per step, and each element
// costs one address add and one load. Block tile 128 output channels x 128 pixels x 32,
// 8 warps (2 x 4) of 64 x 32, mma.sync m16n8k16 with f32 accumulators; weights by cp.async,
// the X tile through registers (loaded for the next step while the current one is
// multiplied), both double-buffered in shared memory. The bias is added in the epilogue
// and the result rounded once. Requires c * h * w < 2^31 and oh * ow < 2^31.
// g1: {c, h, w, o, oh, ow}; g2: {sh, sw, ph, pw, img0, 0}; g3: {kh, kw, cp, 0, 0, 0}.
// Grid (ceil(P / 128), ceil(o / 128), images), 256 threads.

// wp[o][tap][c'] = c' < c ? w[o][c'][tap] : 0 for c' < cp (16-bit values copied as bits).
// dims: {o, c, taps, cp, 0, 0}.
extern "C" __global__ void ddo_conv_pack_weights(const u16* __restrict__ w, u16* __restrict__ wp,
                                                 Dims6 dims) {
    const i64 o = dims.v[0], c = dims.v[1], taps = dims.v[2], cp = dims.v[3];
    const i64 total = o * taps * cp;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (i64)gridDim.x * blockDim.x) {
        const i64 cc = i % cp, rest = i / cp;
        const i64 tap = rest % taps, oo = rest / taps;
        wp[i] = cc < c ? w[(oo * c + cc) * taps + tap] : (u16)0;
    }
}

#define CV_BM 128
#define CV_BN 128
#define CV_BK 32
#define CV_LDA (CV_BK + 8)
#define CV_LDB (CV_BN + 8)

__device__ __forceinline__ u32 cv_smem_addr(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void cv_cp_async16(void* dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(cv_smem_addr(dst)), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cv_ldmatrix_x4(u32* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(cv_smem_addr(p)));
}
__device__ __forceinline__ void cv_ldmatrix_x4_trans(u32* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(cv_smem_addr(p)));
}
template <bool BF16>
__device__ __forceinline__ void cv_mma(float* d, const u32* a, u32 b0, u32 b1) {
    if (BF16) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

template <bool BF16, bool FULL_C>
__device__ __forceinline__ void conv_igemm(const u16* __restrict__ x, const u16* __restrict__ wp,
                                           u16* __restrict__ out, const void* __restrict__ bias,
                                           int bias_dtype, Dims6 g1, Dims6 g2, Dims6 g3) {
    __shared__ __align__(16) u16 sA[2][CV_BM * CV_LDA];
    __shared__ __align__(16) u16 sB[2][CV_BK * CV_LDB];
    const int C = (int)g1.v[0], H = (int)g1.v[1], W = (int)g1.v[2], O = (int)g1.v[3];
    const int OH = (int)g1.v[4], OW = (int)g1.v[5];
    const int SH = (int)g2.v[0], SW = (int)g2.v[1], PH = (int)g2.v[2], PW = (int)g2.v[3];
    const i64 img = g2.v[4] + blockIdx.z;
    const int KW = (int)g3.v[1], CP = (int)g3.v[2];
    const int taps = (int)g3.v[0] * KW;
    const int K = taps * CP, P = OH * OW, HW = H * W;
    const int csteps = CP / CV_BK;
    const int m0 = blockIdx.y * CV_BM, n0 = blockIdx.x * CV_BN;
    const u16* xi = x + img * (i64)C * HW;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int wm = warp >> 2, wn = warp & 3;

    // X loader: this thread fills pixels n0 + 2 * np, +1 of rows (channels) rg + 4 j, j < 8.
    const int np = tid & 63, rg = tid >> 6;
    int iy0[2], ix0[2];
    bool pv[2];
#pragma unroll
    for (int q = 0; q < 2; ++q) {
        const int p = n0 + 2 * np + q;
        pv[q] = p < P;
        const int oy = pv[q] ? p / OW : 0, ox = pv[q] ? p - oy * OW : 0;
        iy0[q] = oy * SH - PH;
        ix0[q] = ox * SW - PW;
    }
    // Raw values, packed (and masked) only when stored: a use right after the loads would
    // stall the warp before the multiply that is meant to hide their latency.
    u16 blo[8], bhi[8];
    u32 keep = 0;  // per-pixel mask of this step's values (0 outside the image)
    // The K step the next load_b fills: channel step cs of tap (ky, kx); advanced by each
    // call (steps are loaded in order), so no division per step.
    int cs = 0, ky = 0, kx = 0;
    auto load_b = [&]() {
        const int c0 = cs * CV_BK;
        const int iya = iy0[0] + ky, ixa = ix0[0] + kx, iyb = iy0[1] + ky, ixb = ix0[1] + kx;
        const bool oka = pv[0] && (unsigned)iya < (unsigned)H && (unsigned)ixa < (unsigned)W;
        const bool okb = pv[1] && (unsigned)iyb < (unsigned)H && (unsigned)ixb < (unsigned)W;
        keep = (oka ? 0xffffu : 0u) | (okb ? 0xffff0000u : 0u);
        // Branch-free: every load reads a valid address (pixel 0 outside the image, channel
        // 0 for padding channels), masked afterwards. 32-bit offsets (c * h * w < 2^31).
        const u16* pa = xi + (oka ? iya * W + ixa : 0);
        const u16* pb = xi + (okb ? iyb * W + ixb : 0);
        int off = (c0 + rg) * HW;
        if (FULL_C) {  // c % 32 == 0: every channel of every step exists
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                blo[j] = pa[off];
                bhi[j] = pb[off];
                off += 4 * HW;
            }
        } else {
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const bool cok = c0 + rg + 4 * j < C;
                const int o = cok ? off : 0;
                const u16 va = pa[o], vb = pb[o];
                blo[j] = cok ? va : (u16)0;
                bhi[j] = cok ? vb : (u16)0;
                off += 4 * HW;
            }
        }
        if (++cs == csteps) {
            cs = 0;
            if (++kx == KW) {
                kx = 0;
                ++ky;
            }
        }
    };
    auto store_b = [&](int stage) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            *(u32*)&sB[stage][(rg + 4 * j) * CV_LDB + 2 * np] =
                ((u32)blo[j] | ((u32)bhi[j] << 16)) & keep;
        }
    };
    auto load_a = [&](int stage, int kt) {
        const int k0 = kt * CV_BK;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int id = tid + 256 * i;
            const int row = id >> 2, col = (id & 3) * 8;
            const int o = m0 + row;
            const bool ok = o < O;
            cv_cp_async16(&sA[stage][row * CV_LDA + col], ok ? wp + (i64)o * K + k0 + col : wp,
                          ok ? 16 : 0);
        }
    };

    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;

    const int ktiles = K / CV_BK;
    load_a(0, 0);
    asm volatile("cp.async.commit_group;\n" ::);
    load_b();
    store_b(0);
    asm volatile("cp.async.wait_group 0;\n" ::);
    __syncthreads();
    for (int kt = 0; kt < ktiles; ++kt) {
        const int cur = kt & 1, nxt = cur ^ 1;
        const bool more = kt + 1 < ktiles;
        if (more) {
            load_a(nxt, kt + 1);
            asm volatile("cp.async.commit_group;\n" ::);
            load_b();
        }
#pragma unroll
        for (int ks = 0; ks < CV_BK / 16; ++ks) {
            u32 a[4][4], b[4][2];
#pragma unroll
            for (int mi = 0; mi < 4; ++mi) {
                cv_ldmatrix_x4(a[mi], &sA[cur][(wm * 64 + mi * 16 + (lane & 15)) * CV_LDA +
                                               ks * 16 + (lane >> 4) * 8]);
            }
#pragma unroll
            for (int nj = 0; nj < 4; nj += 2) {
                u32 r[4];
                cv_ldmatrix_x4_trans(
                    r, &sB[cur][(ks * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * CV_LDB +
                                wn * 32 + nj * 8 + (lane >> 4) * 8]);
                b[nj][0] = r[0];
                b[nj][1] = r[1];
                b[nj + 1][0] = r[2];
                b[nj + 1][1] = r[3];
            }
#pragma unroll
            for (int mi = 0; mi < 4; ++mi)
#pragma unroll
                for (int nj = 0; nj < 4; ++nj) cv_mma<BF16>(acc[mi][nj], a[mi], b[nj][0], b[nj][1]);
        }
        if (more) {
            store_b(nxt);
            asm volatile("cp.async.wait_group 0;\n" ::);
        }
        __syncthreads();
    }

    const int g = lane >> 2, t = lane & 3;
    u16* oi = out + img * (i64)O * P;
#pragma unroll
    for (int mi = 0; mi < 4; ++mi) {
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
            const int o = m0 + wm * 64 + mi * 16 + g + 8 * h2;
            if (o >= O) continue;
            const float bv = bias != 0 ? load_as_float(bias, o, bias_dtype) : 0.0f;
            u16* orow = oi + (i64)o * P;
#pragma unroll
            for (int nj = 0; nj < 4; ++nj) {
                const int p = n0 + wn * 32 + nj * 8 + 2 * t;
                const float v0 = acc[mi][nj][2 * h2] + bv, v1 = acc[mi][nj][2 * h2 + 1] + bv;
                if (p < P) orow[p] = BF16 ? float_to_bf16(v0) : float_to_f16(v0);
                if (p + 1 < P) orow[p + 1] = BF16 ? float_to_bf16(v1) : float_to_f16(v1);
            }
        }
    }
}

// Used for c % 8 != 0 (channel counts a multiple of 8 take the channels-last kernel below);
// FULL_C (c % 32 == 0, no padding channel in any step) is kept for reuse.
#define DDO_CONV_IGEMM(NAME, BF16, FULL_C)                                                   \
    extern "C" __global__ void __launch_bounds__(256, 2)                                     \
        NAME(const u16* x, const u16* wp, u16* out, const void* bias, int bias_dtype,        \
             Dims6 g1, Dims6 g2, Dims6 g3) {                                                 \
        conv_igemm<BF16, FULL_C>(x, wp, out, bias, bias_dtype, g1, g2, g3);                  \
    }
DDO_CONV_IGEMM(ddo_conv_igemm_bf16, true, false)
DDO_CONV_IGEMM(ddo_conv_igemm_f16, false, false)

// ---------------------------------------------------------------------------------------
// Implicit GEMM on a channels-last copy of the input (f16/bf16, c % 8 == 0): every operand
// tile arrives by cp.async, three stages deep
// ---------------------------------------------------------------------------------------
//
// The input is first transposed to NHWC (ddo_nchw_to_nhwc_b16), so one 16-byte chunk is 8
// consecutive channels of one pixel and the gathered X tile needs no register staging: the
// tile is [128 pixels][32 channels] (k contiguous; ldmatrix without .trans gives the B
// fragments), a pixel outside the image is a zero-filled chunk. Reduction order and the
// packed weights are those of conv_igemm (k = tap * cp + c); the block tile, warp layout and
// epilogue too. Dynamic shared memory: 3 stages x (128 x 40 + 128 x 40) halves = 61,440 B.
// g1: {c, h, w, o, oh, ow}; g2: {sh, sw, ph, pw, img0, 0}; g3: {kh, kw, cp, 0, 0, 0}.
// Grid (ceil(P / 128), ceil(o / 128), images), 256 threads.

#define CN_STAGES 3
#define CN_LD (CV_BK + 8)  // 40 halves (80 bytes) per row: conflict-free ldmatrix
#define CN_TILE (128 * CN_LD)

// y[img][p][c] = x[img][c][p] for p < hw, c < c: 32 x 32 tiles through shared memory.
// Grid (ceil(hw / 32), ceil(c / 32), images), block (32, 8).
extern "C" __global__ void ddo_nchw_to_nhwc_b16(const u16* __restrict__ x, u16* __restrict__ y,
                                                i64 channels, i64 hw, i64 images) {
    __shared__ u16 tile[32][33];
    for (i64 img = blockIdx.z; img < images; img += gridDim.z) {
        const u16* xi = x + img * channels * hw;
        u16* yi = y + img * channels * hw;
        const i64 p0 = (i64)blockIdx.x * 32, c0 = (i64)blockIdx.y * 32;
        for (int r = threadIdx.y; r < 32; r += 8) {
            const i64 c = c0 + r, p = p0 + threadIdx.x;
            if (c < channels && p < hw) tile[r][threadIdx.x] = xi[c * hw + p];
        }
        __syncthreads();
        for (int r = threadIdx.y; r < 32; r += 8) {
            const i64 p = p0 + r, c = c0 + threadIdx.x;
            if (c < channels && p < hw) yi[p * channels + c] = tile[threadIdx.x][r];
        }
        __syncthreads();
    }
}

template <bool BF16>
__device__ __forceinline__ void conv_nhwc_igemm(const u16* __restrict__ xt,
                                                const u16* __restrict__ wp,
                                                u16* __restrict__ out,
                                                const void* __restrict__ bias, int bias_dtype,
                                                Dims6 g1, Dims6 g2, Dims6 g3) {
    extern __shared__ __align__(16) u16 cn_smem[];  // [stage][A tile, B tile]
    const int C = (int)g1.v[0], H = (int)g1.v[1], W = (int)g1.v[2], O = (int)g1.v[3];
    const int OH = (int)g1.v[4], OW = (int)g1.v[5];
    const int SH = (int)g2.v[0], SW = (int)g2.v[1], PH = (int)g2.v[2], PW = (int)g2.v[3];
    const i64 img = g2.v[4] + blockIdx.z;
    const int KW = (int)g3.v[1], CP = (int)g3.v[2];
    const int K = (int)g3.v[0] * KW * CP, P = OH * OW;
    const int csteps = CP / CV_BK;
    const int m0 = blockIdx.y * CV_BM, n0 = blockIdx.x * CV_BN;
    const u16* xi = xt + img * (i64)H * W * C;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int wm = warp >> 2, wn = warp & 3;

    // Loader: chunks tid and tid + 256 of each tile: row id >> 2 (an output channel of A, a
    // pixel of B), 8 columns from (id & 3) * 8.
    const int col = (tid & 3) * 8;
    int iy0[2], ix0[2];
    bool pv[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int p = n0 + ((tid + 256 * i) >> 2);
        pv[i] = p < P;
        const int oy = pv[i] ? p / OW : 0, ox = pv[i] ? p - oy * OW : 0;
        iy0[i] = oy * SH - PH;
        ix0[i] = ox * SW - PW;
    }
    int cs = 0, ky = 0, kx = 0;  // the step the next load fills (steps load in order)
    auto load = [&](int stage, int kt) {
        u16* sA = cn_smem + stage * 2 * CN_TILE;
        u16* sB = sA + CN_TILE;
        const int k0 = kt * CV_BK, c = cs * CV_BK + col;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int row = (tid + 256 * i) >> 2;
            const int o = m0 + row;
            const bool oka = o < O;
            cv_cp_async16(&sA[row * CN_LD + col], oka ? wp + (i64)o * K + k0 + col : wp,
                          oka ? 16 : 0);
            const int iy = iy0[i] + ky, ix = ix0[i] + kx;
            const bool okb = pv[i] && (unsigned)iy < (unsigned)H && (unsigned)ix < (unsigned)W &&
                             c < C;
            cv_cp_async16(&sB[row * CN_LD + col],
                          okb ? xi + ((i64)iy * W + ix) * C + c : xi, okb ? 16 : 0);
        }
        if (++cs == csteps) {
            cs = 0;
            if (++kx == KW) {
                kx = 0;
                ++ky;
            }
        }
    };

    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;

    const int ktiles = K / CV_BK;
    // Prologue: stages 0 .. CN_STAGES - 2 in flight (one commit group per step, empty past
    // the end so the group count stays uniform).
#pragma unroll
    for (int s = 0; s < CN_STAGES - 1; ++s) {
        if (s < ktiles) load(s, s);
        asm volatile("cp.async.commit_group;\n" ::);
    }
    for (int kt = 0; kt < ktiles; ++kt) {
        // Step kt has landed once at most CN_STAGES - 2 newer groups are pending.
        asm volatile("cp.async.wait_group %0;\n" :: "n"(CN_STAGES - 2));
        __syncthreads();  // ... for everyone; and everyone is done with step kt - 1's stage
        const int nk = kt + CN_STAGES - 1;
        if (nk < ktiles) load(nk % CN_STAGES, nk);
        asm volatile("cp.async.commit_group;\n" ::);
        const u16* sA = cn_smem + (kt % CN_STAGES) * 2 * CN_TILE;
        const u16* sB = sA + CN_TILE;
#pragma unroll
        for (int ks = 0; ks < CV_BK / 16; ++ks) {
            u32 a[4][4], b[4][2];
#pragma unroll
            for (int mi = 0; mi < 4; ++mi) {
                cv_ldmatrix_x4(a[mi], &sA[(wm * 64 + mi * 16 + (lane & 15)) * CN_LD + ks * 16 +
                                          (lane >> 4) * 8]);
            }
#pragma unroll
            for (int nj = 0; nj < 4; nj += 2) {
                u32 r[4];
                cv_ldmatrix_x4(r, &sB[(wn * 32 + nj * 8 + (lane & 7) + (lane >> 4) * 8) * CN_LD +
                                      ks * 16 + ((lane >> 3) & 1) * 8]);
                b[nj][0] = r[0];
                b[nj][1] = r[1];
                b[nj + 1][0] = r[2];
                b[nj + 1][1] = r[3];
            }
#pragma unroll
            for (int mi = 0; mi < 4; ++mi)
#pragma unroll
                for (int nj = 0; nj < 4; ++nj) cv_mma<BF16>(acc[mi][nj], a[mi], b[nj][0], b[nj][1]);
        }
    }
    asm volatile("cp.async.wait_group 0;\n" ::);

    const int g = lane >> 2, t = lane & 3;
    u16* oi = out + img * (i64)O * P;
#pragma unroll
    for (int mi = 0; mi < 4; ++mi) {
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
            const int o = m0 + wm * 64 + mi * 16 + g + 8 * h2;
            if (o >= O) continue;
            const float bv = bias != 0 ? load_as_float(bias, o, bias_dtype) : 0.0f;
            u16* orow = oi + (i64)o * P;
#pragma unroll
            for (int nj = 0; nj < 4; ++nj) {
                const int p = n0 + wn * 32 + nj * 8 + 2 * t;
                const float v0 = acc[mi][nj][2 * h2] + bv, v1 = acc[mi][nj][2 * h2 + 1] + bv;
                if (p < P) orow[p] = BF16 ? float_to_bf16(v0) : float_to_f16(v0);
                if (p + 1 < P) orow[p + 1] = BF16 ? float_to_bf16(v1) : float_to_f16(v1);
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(256, 2)
    ddo_conv_nhwc_igemm_bf16(const u16* xt, const u16* wp, u16* out, const void* bias,
                             int bias_dtype, Dims6 g1, Dims6 g2, Dims6 g3) {
    conv_nhwc_igemm<true>(xt, wp, out, bias, bias_dtype, g1, g2, g3);
}
extern "C" __global__ void __launch_bounds__(256, 2)
    ddo_conv_nhwc_igemm_f16(const u16* xt, const u16* wp, u16* out, const void* bias,
                            int bias_dtype, Dims6 g1, Dims6 g2, Dims6 g3) {
    conv_nhwc_igemm<false>(xt, wp, out, bias, bias_dtype, g1, g2, g3);
}
