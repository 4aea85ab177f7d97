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
