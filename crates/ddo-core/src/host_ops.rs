//! The host backend's compute plane: [`Ops`] for [`HostDevice`].
//!
//! Every op checks that its inputs are device tensors of this device, checks shapes (a
//! mismatch is [`CoreError::Shape`], never a panic), then fences the compute stream
//! ([`HostDevice::host_compute_fence`]) so it reads inputs only after the work queued
//! before it (copies ordered by `wait_event`), computes in f32 on the calling thread, and
//! writes its result into a fresh allocation made with [`Device::alloc`], so outputs count
//! in the device's memory accounting. f16/bf16 results are rounded once, when written.
//!
//! Matrix products (linear, matmul, the im2col convolution, attention blocks) run on
//! `matrixmultiply`'s sgemm, which threads large products itself. Normalisations
//! accumulate in f64. Attention is computed per (batch, head) in blocks of queries and
//! keys with an online softmax, so no full score matrix is ever held; heads run on scoped
//! threads when there is enough work.

use half::{bf16, f16};

use crate::device::{Device, DeviceBuffer};
use crate::dtype::DType;
use crate::error::{CoreError, Result};
use crate::host_backend::{HostAllocation, HostDevice};
use crate::ops::{BinaryOp, Conv2dParams, Ops, ReduceOp, UnaryOp};
use crate::shape::{broadcast_shape, broadcast_strides, coalesce, contiguous_strides};
use crate::tensor::{Tensor, TensorStorage, byte_len, numel};

/// Queries per attention block.
const ATTN_BLOCK_Q: usize = 64;
/// Keys per attention block.
const ATTN_BLOCK_K: usize = 256;
/// Largest im2col scratch of a convolution, in f32 elements (16 MiB).
const IM2COL_CHUNK: usize = 1 << 22;

fn shape_err(what: &str, message: impl Into<String>) -> CoreError {
    CoreError::Shape {
        what: what.to_string(),
        message: message.into(),
    }
}

fn product(dims: &[usize]) -> usize {
    dims.iter().product()
}

/// An input operand: a byte range of an allocation of this device.
struct Input<'a> {
    alloc: &'a HostAllocation,
    range: std::ops::Range<usize>,
    dtype: DType,
}

impl Input<'_> {
    /// The values as f32 (a copy).
    fn f32(&self) -> Result<Vec<f32>> {
        self.alloc
            .with_bytes(|b| self.dtype.decode_f32(&b[self.range.clone()]))
    }

    /// Runs `f` over the raw bytes.
    fn bytes<R>(&self, f: impl FnOnce(&[u8]) -> R) -> R {
        self.alloc.with_bytes(|b| f(&b[self.range.clone()]))
    }

    /// Runs `f` over the values as f32, in place when the bytes already are aligned
    /// little-endian f32 (no copy of large weights). Holds the allocation's read lock
    /// while `f` runs: never call it while holding another input's lock.
    fn with_f32<R>(&self, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
        self.alloc.with_bytes(|b| {
            let bytes = &b[self.range.clone()];
            if self.dtype == DType::F32
                && cfg!(target_endian = "little")
                && let Ok(values) = bytemuck::try_cast_slice::<u8, f32>(bytes)
            {
                return Ok(f(values));
            }
            let values = self.dtype.decode_f32(bytes)?;
            Ok(f(&values))
        })
    }
}

/// Encodes `values` into `out` (exactly `values.len()` elements of `dtype`).
fn encode_into(dtype: DType, values: &[f32], out: &mut [u8]) {
    match dtype {
        DType::F32 => {
            for (c, v) in out.chunks_exact_mut(4).zip(values) {
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        DType::F16 => {
            for (c, v) in out.chunks_exact_mut(2).zip(values) {
                c.copy_from_slice(&f16::from_f32(*v).to_le_bytes());
            }
        }
        DType::BF16 => {
            for (c, v) in out.chunks_exact_mut(2).zip(values) {
                c.copy_from_slice(&bf16::from_f32(*v).to_le_bytes());
            }
        }
        // Refused by `float_dtype` before anything is allocated.
        DType::Quantized => {}
    }
}

fn float_dtype(op: &str, dtype: DType) -> Result<()> {
    if dtype.is_quantized() {
        Err(shape_err(
            op,
            "quantized storage has no element values to compute on; dequantize it first",
        ))
    } else {
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// GEMM
// ---------------------------------------------------------------------------------------

/// A strided read-only matrix view.
#[derive(Clone, Copy)]
struct Mat<'a> {
    data: &'a [f32],
    rs: usize,
    cs: usize,
}

impl<'a> Mat<'a> {
    fn new(data: &'a [f32], rs: usize, cs: usize) -> Self {
        Self { data, rs, cs }
    }
}

/// Elements spanned by a `rows × cols` view with strides `rs`, `cs` (one past the last).
fn span(rows: usize, cols: usize, rs: usize, cs: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * rs + (cols - 1) * cs + 1
    }
}

/// `C ← alpha · A B + beta · C` with `A [m, k]`, `B [k, n]` and a row-major `C [m, n]`
/// of row stride `rsc`. With `beta == 0`, `C` is overwritten.
#[allow(clippy::too_many_arguments)]
fn gemm(
    m: usize,
    k: usize,
    n: usize,
    alpha: f32,
    a: Mat<'_>,
    b: Mat<'_>,
    beta: f32,
    c: &mut [f32],
    rsc: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        rsc >= n && span(m, n, rsc, 1) <= c.len(),
        "gemm: output view out of bounds"
    );
    if k == 0 {
        for row in c.chunks_mut(rsc).take(m) {
            for v in &mut row[..n] {
                *v = if beta == 0.0 { 0.0 } else { *v * beta };
            }
        }
        return;
    }
    assert!(
        span(m, k, a.rs, a.cs) <= a.data.len() && span(k, n, b.rs, b.cs) <= b.data.len(),
        "gemm: input view out of bounds"
    );
    // SAFETY: the asserts above keep every element sgemm touches inside `a.data`,
    // `b.data` and `c`; `c` is a unique borrow, so it aliases neither input, and its
    // strides (`rsc >= n`, 1) address distinct elements. Strides fit in isize because
    // they index within slices.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            alpha,
            a.data.as_ptr(),
            a.rs as isize,
            a.cs as isize,
            b.data.as_ptr(),
            b.rs as isize,
            b.cs as isize,
            beta,
            c.as_mut_ptr(),
            rsc as isize,
            1,
        );
    }
}

// ---------------------------------------------------------------------------------------
// Broadcasting and strided walks
// ---------------------------------------------------------------------------------------

/// Calls `f` with the operands' offsets for every index of `shape`, row-major.
fn walk<const K: usize>(shape: &[usize], strides: [&[usize]; K], mut f: impl FnMut([usize; K])) {
    if shape.contains(&0) {
        return;
    }
    let r = shape.len();
    let mut idx = vec![0usize; r];
    let mut off = [0usize; K];
    loop {
        f(off);
        let mut d = r;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            for o in 0..K {
                off[o] += strides[o][d];
            }
            if idx[d] < shape[d] {
                break;
            }
            for o in 0..K {
                off[o] -= strides[o][d] * shape[d];
            }
            idx[d] = 0;
        }
    }
}

fn binary_kernel(
    a: &[f32],
    b: &[f32],
    shape: &[usize],
    sa: &[usize],
    sb: &[usize],
    f: impl Fn(f32, f32) -> f32,
) -> Vec<f32> {
    let (cs, [sa, sb]) = coalesce(shape, [sa, sb]);
    let r = cs.len();
    let (inner, ia, ib) = (cs[r - 1], sa[r - 1], sb[r - 1]);
    let mut out = Vec::with_capacity(product(&cs));
    walk(
        &cs[..r - 1],
        [&sa[..r - 1], &sb[..r - 1]],
        |[oa, ob]| match (ia, ib) {
            (1, 1) => out.extend(
                a[oa..oa + inner]
                    .iter()
                    .zip(&b[ob..ob + inner])
                    .map(|(&x, &y)| f(x, y)),
            ),
            (1, 0) => {
                let y = b[ob];
                out.extend(a[oa..oa + inner].iter().map(|&x| f(x, y)));
            }
            (0, 1) => {
                let x = a[oa];
                out.extend(b[ob..ob + inner].iter().map(|&y| f(x, y)));
            }
            _ => out.extend((0..inner).map(|j| f(a[oa + j * ia], b[ob + j * ib]))),
        },
    );
    out
}

// ---------------------------------------------------------------------------------------
// Scalar functions
// ---------------------------------------------------------------------------------------

/// Chebyshev coefficients of `ln(erfc(z) · e^{z²} / t)` in `u = 2t - 1`, `t = 2 / (2 + z)`
/// (fitted for this crate by Chebyshev interpolation at 20 nodes; relative error of
/// `erfc` below 1e-12 on `[0, 26]`).
const ERFC_CHEB: [f64; 20] = [
    -0.651326859890854,
    0.6419697923564892,
    0.019476473204186065,
    -0.009561514786808091,
    -0.0009465953444832254,
    0.0003668394978536771,
    4.252332480629839e-05,
    -2.0278578113686054e-05,
    -1.6242900031437914e-06,
    1.3036558339063476e-06,
    1.5626442007032894e-08,
    -8.523809569283003e-08,
    6.529053964143827e-09,
    5.05934455441448e-09,
    -9.913651233262045e-10,
    -2.27366819816055e-10,
    9.647033172299757e-11,
    2.3866075782308373e-12,
    -6.886960446372826e-12,
    1.0072831457819121e-12,
];

/// The complementary error function for `z >= 0`, with small relative error everywhere
/// (so tails such as GELU at large negative inputs stay precise).
fn erfc_nonneg(z: f64) -> f64 {
    let t = 2.0 / (2.0 + z);
    let u = 2.0 * t - 1.0;
    let (mut b1, mut b2) = (0.0f64, 0.0f64);
    for &c in ERFC_CHEB[1..].iter().rev() {
        (b1, b2) = (2.0 * u * b1 - b2 + c, b1);
    }
    let p = u * b1 - b2 + ERFC_CHEB[0];
    t * (-z * z + p).exp()
}

/// Exact GELU, `x Φ(x) = ½ x erfc(-x / √2)`, evaluated without cancellation.
fn gelu_erf(x: f32) -> f32 {
    let x = f64::from(x);
    let z = x * std::f64::consts::FRAC_1_SQRT_2;
    let y = if x >= 0.0 {
        x * (1.0 - 0.5 * erfc_nonneg(z))
    } else {
        0.5 * x * erfc_nonneg(-z)
    };
    y as f32
}

fn gelu_tanh(x: f32) -> f32 {
    const K: f32 = 0.797_884_6; // √(2/π)
    0.5 * x * (1.0 + (K * (x + 0.044_715 * x * x * x)).tanh())
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

fn map_in_place(values: &mut [f32], f: impl Fn(f32) -> f32) {
    for v in values {
        *v = f(*v);
    }
}

fn apply_unary(values: &mut [f32], op: UnaryOp) {
    match op {
        UnaryOp::Silu => map_in_place(values, |x| x * sigmoid(x)),
        UnaryOp::GeluTanh => map_in_place(values, gelu_tanh),
        UnaryOp::GeluErf => map_in_place(values, gelu_erf),
        UnaryOp::QuickGelu => map_in_place(values, |x| x * sigmoid(1.702 * x)),
        UnaryOp::Sigmoid => map_in_place(values, sigmoid),
        UnaryOp::Tanh => map_in_place(values, f32::tanh),
        UnaryOp::Relu => map_in_place(values, |x| x.max(0.0)),
        UnaryOp::Exp => map_in_place(values, f32::exp),
        UnaryOp::Neg => map_in_place(values, |x| -x),
        UnaryOp::Square => map_in_place(values, |x| x * x),
        UnaryOp::Sqrt => map_in_place(values, f32::sqrt),
        UnaryOp::Recip => map_in_place(values, |x| 1.0 / x),
    }
}

// ---------------------------------------------------------------------------------------
// Attention
// ---------------------------------------------------------------------------------------

/// The mask operand of one (batch, head): values, base offset and strides along
/// queries and keys.
#[derive(Clone, Copy)]
struct HeadMask<'a> {
    values: &'a [f32],
    base: usize,
    sq: usize,
    sk: usize,
}

#[derive(Clone, Copy)]
struct AttnDims {
    lq: usize,
    lk: usize,
    d: usize,
    dv: usize,
    scale: f32,
}

/// Attention of one (batch, head) with an online softmax over blocks of keys.
fn attend_head(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: Option<HeadMask<'_>>,
    dims: AttnDims,
    out: &mut [f32],
) {
    let AttnDims {
        lq,
        lk,
        d,
        dv,
        scale,
    } = dims;
    let mut scores = vec![0.0f32; ATTN_BLOCK_Q * ATTN_BLOCK_K];
    let mut row_max = vec![f32::NEG_INFINITY; ATTN_BLOCK_Q];
    let mut row_sum = vec![0.0f32; ATTN_BLOCK_Q];
    for q0 in (0..lq).step_by(ATTN_BLOCK_Q) {
        let bq = ATTN_BLOCK_Q.min(lq - q0);
        let o_blk = &mut out[q0 * dv..(q0 + bq) * dv];
        o_blk.fill(0.0);
        row_max[..bq].fill(f32::NEG_INFINITY);
        row_sum[..bq].fill(0.0);
        for k0 in (0..lk).step_by(ATTN_BLOCK_K) {
            let bk = ATTN_BLOCK_K.min(lk - k0);
            let s = &mut scores[..bq * bk];
            // S = scale · Q_blk · K_blkᵀ (K read transposed through its strides).
            gemm(
                bq,
                d,
                bk,
                scale,
                Mat::new(&q[q0 * d..], d, 1),
                Mat::new(&k[k0 * d..], 1, d),
                0.0,
                s,
                bk,
            );
            for (i, row) in s.chunks_exact_mut(bk).enumerate() {
                if let Some(m) = mask {
                    let base = m.base + (q0 + i) * m.sq + k0 * m.sk;
                    for (j, x) in row.iter_mut().enumerate() {
                        *x += m.values[base + j * m.sk];
                    }
                }
                let blk_max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let new_max = row_max[i].max(blk_max);
                if new_max == f32::NEG_INFINITY {
                    // Everything so far is masked out: nothing to accumulate.
                    row.fill(0.0);
                    continue;
                }
                let correction = (row_max[i] - new_max).exp();
                let mut sum = 0.0f32;
                for x in row.iter_mut() {
                    *x = (*x - new_max).exp();
                    sum += *x;
                }
                row_sum[i] = row_sum[i] * correction + sum;
                row_max[i] = new_max;
                if correction != 1.0 {
                    for o in &mut o_blk[i * dv..(i + 1) * dv] {
                        *o *= correction;
                    }
                }
            }
            // O_blk += P · V_blk.
            gemm(
                bq,
                bk,
                dv,
                1.0,
                Mat::new(s, bk, 1),
                Mat::new(&v[k0 * dv..], dv, 1),
                1.0,
                o_blk,
                dv,
            );
        }
        // A row with no unmasked key has sum 0 and gives NaN, as softmax over -inf does.
        for (i, row) in o_blk.chunks_exact_mut(dv.max(1)).enumerate().take(bq) {
            let inv = 1.0 / row_sum[i];
            for o in row {
                *o *= inv;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// The device's ops
// ---------------------------------------------------------------------------------------

impl HostDevice {
    /// Checks that `t` is a float tensor in this device's memory.
    fn input<'a>(&self, op: &str, t: &'a Tensor) -> Result<Input<'a>> {
        let slice = match t.storage() {
            TensorStorage::Device(s) => s,
            TensorStorage::Host(_) => {
                return Err(CoreError::WrongDevice {
                    what: "tensor",
                    expected: self.id().to_string(),
                    found: "host memory".into(),
                });
            }
        };
        let alloc = self.allocation(slice.buffer())?;
        float_dtype(op, t.dtype())?;
        Ok(Input {
            alloc,
            range: slice.offset()..slice.offset() + slice.len(),
            dtype: t.dtype(),
        })
    }

    /// Orders this op after the work queued on the compute stream so far.
    fn fence(&self) -> Result<()> {
        self.host_compute_fence(&self.compute_stream())
    }

    /// Allocates an op's output up front, before any host scratch is made, so a result
    /// too large for the device is a typed out-of-memory error.
    fn new_output(&self, op: &str, shape: Vec<usize>, dtype: DType) -> Result<Output<'_>> {
        float_dtype(op, dtype)?;
        let buffer = self.alloc(byte_len(&shape, dtype)?)?;
        Ok(Output {
            device: self,
            buffer,
            shape,
            dtype,
        })
    }

    /// Checks an optional per-feature vector (`[len]`) operand.
    fn optional_vector<'a>(
        &self,
        op: &str,
        what: &str,
        t: Option<&'a Tensor>,
        len: usize,
    ) -> Result<Option<Input<'a>>> {
        let Some(t) = t else { return Ok(None) };
        if t.shape() != [len] {
            return Err(shape_err(
                op,
                format!("{what} has shape {:?}, expected [{len}]", t.shape()),
            ));
        }
        Ok(Some(self.input(op, t)?))
    }

    /// `linear(concat(xs, last dim), w, bias)`: the parts' rows are joined in host scratch,
    /// never in device memory.
    fn linear_parts(
        &self,
        xs: &[&Tensor],
        w: &Tensor,
        bias: Option<&Tensor>,
        op: &str,
    ) -> Result<Tensor> {
        let shapes: Vec<&[usize]> = xs.iter().map(|x| x.shape()).collect();
        let g = crate::shape::linear_geometry(op, &shapes, w.shape())?;
        let (out_f, in_f, m) = (g.out_features, g.in_features, g.rows);
        let inputs = xs
            .iter()
            .map(|x| self.input(op, x))
            .collect::<Result<Vec<_>>>()?;
        let wi = self.input(op, w)?;
        let bi = self.optional_vector(op, "bias", bias, out_f)?;
        let shape = g.out_shape.clone();
        let output = self.new_output(op, shape, xs[0].dtype())?;
        self.fence()?;
        let xv = if let [one] = inputs.as_slice() {
            one.f32()?
        } else {
            let mut joined = vec![0.0f32; m * in_f];
            let mut col = 0;
            for (xi, &width) in inputs.iter().zip(&g.widths) {
                let part = xi.f32()?;
                for (row, src) in joined
                    .chunks_exact_mut(in_f.max(1))
                    .zip(part.chunks_exact(width.max(1)))
                {
                    row[col..col + width].copy_from_slice(src);
                }
                col += width;
            }
            joined
        };
        let (mut out, beta) = match read_opt(bi.as_ref())? {
            Some(b) => (b.repeat(m), 1.0),
            None => (vec![0.0; m * out_f], 0.0),
        };
        wi.with_f32(|wv| {
            gemm(
                m,
                in_f,
                out_f,
                1.0,
                Mat::new(&xv, in_f, 1),
                // B[i][o] = w[o][i]: w read transposed through its strides.
                Mat::new(wv, 1, in_f),
                beta,
                &mut out,
                out_f,
            );
        })?;
        output.write_f32(&out)
    }
}

/// An op's output: its device allocation, written once the values are computed.
struct Output<'d> {
    device: &'d HostDevice,
    buffer: DeviceBuffer,
    shape: Vec<usize>,
    dtype: DType,
}

impl Output<'_> {
    /// Writes raw bytes (exactly the output's size) and returns the tensor.
    fn write_bytes(self, fill: impl FnOnce(&mut [u8])) -> Result<Tensor> {
        self.device.allocation(&self.buffer)?.with_bytes_mut(fill);
        Tensor::new(
            self.shape,
            self.dtype,
            TensorStorage::Device(self.buffer.slice_all()),
        )
    }

    /// Encodes `values` into the output and returns the tensor.
    fn write_f32(self, values: &[f32]) -> Result<Tensor> {
        if numel(&self.shape) != Some(values.len()) {
            return Err(shape_err(
                "host op output",
                format!("{} values do not fill shape {:?}", values.len(), self.shape),
            ));
        }
        let dtype = self.dtype;
        self.write_bytes(|b| encode_into(dtype, values, b))
    }
}

/// The f32 values of an optional input (read after the fence).
fn read_opt(input: Option<&Input<'_>>) -> Result<Option<Vec<f32>>> {
    input.map(Input::f32).transpose()
}

impl Ops for HostDevice {
    fn tensor_from_f32(&self, shape: &[usize], dtype: DType, values: &[f32]) -> Result<Tensor> {
        const OP: &str = "tensor_from_f32";
        if numel(shape) != Some(values.len()) {
            return Err(shape_err(
                OP,
                format!("{} values for shape {shape:?}", values.len()),
            ));
        }
        self.new_output(OP, shape.to_vec(), dtype)?
            .write_f32(values)
    }

    fn to_f32_vec(&self, x: &Tensor) -> Result<Vec<f32>> {
        let xi = self.input("to_f32_vec", x)?;
        self.fence()?;
        xi.f32()
    }

    fn linear(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        self.linear_parts(&[x], w, bias, "linear")
    }

    /// Exactly `linear(concat(xs), w, bias)` of this backend (the concatenation is exact
    /// when the parts share a dtype), without a device buffer for the concatenation.
    fn linear_concat(&self, xs: &[&Tensor], w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        let same_dtype = xs.iter().all(|t| t.dtype() == xs[0].dtype());
        if xs.len() < 2 || !same_dtype {
            return crate::ops::linear_concat_by_concat(self, xs, w, bias);
        }
        self.linear_parts(xs, w, bias, "linear_concat")
    }

    fn matmul(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        const OP: &str = "matmul";
        let (as_, bs) = (a.shape(), b.shape());
        if as_.len() < 2 || bs.len() < 2 || as_[as_.len() - 1] != bs[bs.len() - 2] {
            return Err(shape_err(
                OP,
                format!("a {as_:?} and b {bs:?}: expected a [..., m, k] and b [..., k, n]"),
            ));
        }
        let (ab, bb) = (&as_[..as_.len() - 2], &bs[..bs.len() - 2]);
        let batch = broadcast_shape(OP, ab, bb)?;
        let (m, k, n) = (as_[as_.len() - 2], as_[as_.len() - 1], bs[bs.len() - 1]);
        let ai = self.input(OP, a)?;
        let bi = self.input(OP, b)?;
        let mut shape = batch.clone();
        shape.extend([m, n]);
        let output = self.new_output(OP, shape, a.dtype())?;
        self.fence()?;
        let av = ai.f32()?;
        let bv = bi.f32()?;
        let nb = product(&batch);
        let mut out = vec![0.0f32; nb * m * n];
        if product(bb) == 1 {
            // One shared right-hand matrix: fold a's batch into its rows.
            gemm(
                nb * m,
                k,
                n,
                1.0,
                Mat::new(&av, k, 1),
                Mat::new(&bv, n, 1),
                0.0,
                &mut out,
                n,
            );
        } else {
            let sa: Vec<usize> = broadcast_strides(ab, &batch)
                .iter()
                .map(|s| s * m * k)
                .collect();
            let sb: Vec<usize> = broadcast_strides(bb, &batch)
                .iter()
                .map(|s| s * k * n)
                .collect();
            let mut chunks = out.chunks_mut((m * n).max(1));
            walk(&batch, [&sa, &sb], |[oa, ob]| {
                if let Some(c) = chunks.next() {
                    gemm(
                        m,
                        k,
                        n,
                        1.0,
                        Mat::new(&av[oa..], k, 1),
                        Mat::new(&bv[ob..], n, 1),
                        0.0,
                        c,
                        n,
                    );
                }
            });
        }
        output.write_f32(&out)
    }

    fn conv2d(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
        params: Conv2dParams,
    ) -> Result<Tensor> {
        const OP: &str = "conv2d";
        let Conv2dParams {
            stride: (sh, sw),
            padding: (ph, pw),
        } = params;
        let crate::shape::Conv2dGeometry {
            n,
            c,
            h,
            w: wd,
            o,
            kh,
            kw,
            oh,
            ow,
        } = crate::shape::conv2d_geometry(OP, x.shape(), w.shape(), params)?;
        let xi = self.input(OP, x)?;
        let wi = self.input(OP, w)?;
        let bi = self.optional_vector(OP, "bias", bias, o)?;
        let output = self.new_output(OP, vec![n, o, oh, ow], x.dtype())?;
        self.fence()?;
        let xv = xi.f32()?;
        let bv = read_opt(bi.as_ref())?;
        let kdim = c * kh * kw;
        let plane = oh * ow;
        let mut out = vec![0.0f32; n * o * plane];
        if let Some(b) = &bv {
            for img in out.chunks_mut((o * plane).max(1)) {
                for (ch, &bias) in img.chunks_mut(plane.max(1)).zip(b) {
                    ch.fill(bias);
                }
            }
        }
        let beta = if bv.is_some() { 1.0 } else { 0.0 };
        let direct = kh == 1 && kw == 1 && sh == 1 && sw == 1 && ph == 0 && pw == 0;
        let rows_per_chunk = (IM2COL_CHUNK / (kdim * ow).max(1)).clamp(1, oh.max(1));
        let mut cols = if direct {
            Vec::new()
        } else {
            vec![0.0f32; kdim * rows_per_chunk * ow]
        };
        wi.with_f32(|wv| {
            let wm = Mat::new(wv, kdim, 1);
            for img in 0..n {
                let xin = &xv[img * c * h * wd..(img + 1) * c * h * wd];
                let oimg = &mut out[img * o * plane..(img + 1) * o * plane];
                if direct {
                    let b = Mat::new(xin, h * wd, 1);
                    gemm(o, kdim, plane, 1.0, wm, b, beta, oimg, plane);
                    continue;
                }
                for r0 in (0..oh).step_by(rows_per_chunk) {
                    let rows = rows_per_chunk.min(oh - r0);
                    let ncol = rows * ow;
                    im2col(
                        xin,
                        (c, h, wd),
                        (kh, kw),
                        params,
                        (r0, rows, ow),
                        &mut cols[..kdim * ncol],
                    );
                    let b = Mat::new(&cols[..kdim * ncol], ncol, 1);
                    gemm(o, kdim, ncol, 1.0, wm, b, beta, &mut oimg[r0 * ow..], plane);
                }
            }
        })?;
        output.write_f32(&out)
    }

    fn group_norm(
        &self,
        x: &Tensor,
        groups: usize,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f32,
    ) -> Result<Tensor> {
        const OP: &str = "group_norm";
        let xs = x.shape();
        if xs.len() < 2 || groups == 0 || !xs[1].is_multiple_of(groups) {
            return Err(shape_err(
                OP,
                format!(
                    "x {xs:?} with {groups} groups: expected x [n, c, ...] with c divisible by \
                     groups"
                ),
            ));
        }
        let (n, c) = (xs[0], xs[1]);
        let spatial = product(&xs[2..]);
        let xi = self.input(OP, x)?;
        let wi = self.optional_vector(OP, "weight", weight, c)?;
        let bi = self.optional_vector(OP, "bias", bias, c)?;
        let output = self.new_output(OP, xs.to_vec(), x.dtype())?;
        self.fence()?;
        let xv = xi.f32()?;
        let wv = read_opt(wi.as_ref())?;
        let bv = read_opt(bi.as_ref())?;
        let cg = c / groups;
        let group_len = cg * spatial;
        let mut out = vec![0.0f32; xv.len()];
        for ni in 0..n {
            for g in 0..groups {
                let start = (ni * c + g * cg) * spatial;
                let src = &xv[start..start + group_len];
                let (mean, inv) = mean_inv_std(src, eps);
                for cc in 0..cg {
                    let ch = g * cg + cc;
                    let scale = wv.as_ref().map_or(1.0, |w| f64::from(w[ch]));
                    let shift = bv.as_ref().map_or(0.0, |b| f64::from(b[ch]));
                    let range = start + cc * spatial..start + (cc + 1) * spatial;
                    for (o, &v) in out[range.clone()].iter_mut().zip(&xv[range]) {
                        *o = ((f64::from(v) - mean) * inv * scale + shift) as f32;
                    }
                }
            }
        }
        output.write_f32(&out)
    }

    fn layer_norm(
        &self,
        x: &Tensor,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f32,
    ) -> Result<Tensor> {
        const OP: &str = "layer_norm";
        let xs = x.shape();
        let Some(&d) = xs.last() else {
            return Err(shape_err(OP, "x is a scalar; expected x [..., d]"));
        };
        let xi = self.input(OP, x)?;
        let wi = self.optional_vector(OP, "weight", weight, d)?;
        let bi = self.optional_vector(OP, "bias", bias, d)?;
        let output = self.new_output(OP, xs.to_vec(), x.dtype())?;
        self.fence()?;
        let xv = xi.f32()?;
        let wv = read_opt(wi.as_ref())?;
        let bv = read_opt(bi.as_ref())?;
        let mut out = vec![0.0f32; xv.len()];
        for (orow, row) in out
            .chunks_exact_mut(d.max(1))
            .zip(xv.chunks_exact(d.max(1)))
        {
            let (mean, inv) = mean_inv_std(row, eps);
            for (j, (o, &v)) in orow.iter_mut().zip(row).enumerate() {
                let scale = wv.as_ref().map_or(1.0, |w| f64::from(w[j]));
                let shift = bv.as_ref().map_or(0.0, |b| f64::from(b[j]));
                *o = ((f64::from(v) - mean) * inv * scale + shift) as f32;
            }
        }
        output.write_f32(&out)
    }

    fn rms_norm(&self, x: &Tensor, weight: Option<&Tensor>, eps: f32) -> Result<Tensor> {
        const OP: &str = "rms_norm";
        let xs = x.shape();
        let Some(&d) = xs.last() else {
            return Err(shape_err(OP, "x is a scalar; expected x [..., d]"));
        };
        let xi = self.input(OP, x)?;
        let wi = self.optional_vector(OP, "weight", weight, d)?;
        let output = self.new_output(OP, xs.to_vec(), x.dtype())?;
        self.fence()?;
        let xv = xi.f32()?;
        let wv = read_opt(wi.as_ref())?;
        let mut out = vec![0.0f32; xv.len()];
        for (orow, row) in out
            .chunks_exact_mut(d.max(1))
            .zip(xv.chunks_exact(d.max(1)))
        {
            let ms = row
                .iter()
                .map(|&v| f64::from(v) * f64::from(v))
                .sum::<f64>()
                / d as f64;
            let inv = 1.0 / (ms + f64::from(eps)).sqrt();
            for (j, (o, &v)) in orow.iter_mut().zip(row).enumerate() {
                let scale = wv.as_ref().map_or(1.0, |w| f64::from(w[j]));
                *o = (f64::from(v) * inv * scale) as f32;
            }
        }
        output.write_f32(&out)
    }

    fn unary(&self, x: &Tensor, op: UnaryOp) -> Result<Tensor> {
        let xi = self.input("unary", x)?;
        let output = self.new_output("unary", x.shape().to_vec(), x.dtype())?;
        self.fence()?;
        let mut v = xi.f32()?;
        apply_unary(&mut v, op);
        output.write_f32(&v)
    }

    /// Reads `x`, lets it go, then allocates the output: when nothing else holds `x` its
    /// bytes are free again first, so the device's peak is that of an in-place op.
    fn unary_owned(&self, x: Tensor, op: UnaryOp) -> Result<Tensor> {
        let (shape, dtype) = (x.shape().to_vec(), x.dtype());
        let mut v = {
            let xi = self.input("unary", &x)?;
            self.fence()?;
            xi.f32()?
        };
        drop(x);
        let output = self.new_output("unary", shape, dtype)?;
        apply_unary(&mut v, op);
        output.write_f32(&v)
    }

    fn binary(&self, a: &Tensor, b: &Tensor, op: BinaryOp) -> Result<Tensor> {
        const OP: &str = "binary";
        let shape = broadcast_shape(OP, a.shape(), b.shape())?;
        let ai = self.input(OP, a)?;
        let bi = self.input(OP, b)?;
        let output = self.new_output(OP, shape.clone(), a.dtype())?;
        self.fence()?;
        let av = ai.f32()?;
        let bv = bi.f32()?;
        let sa = broadcast_strides(a.shape(), &shape);
        let sb = broadcast_strides(b.shape(), &shape);
        let out = match op {
            BinaryOp::Add => binary_kernel(&av, &bv, &shape, &sa, &sb, |x, y| x + y),
            BinaryOp::Sub => binary_kernel(&av, &bv, &shape, &sa, &sb, |x, y| x - y),
            BinaryOp::Mul => binary_kernel(&av, &bv, &shape, &sa, &sb, |x, y| x * y),
            BinaryOp::Div => binary_kernel(&av, &bv, &shape, &sa, &sb, |x, y| x / y),
            BinaryOp::Max => binary_kernel(&av, &bv, &shape, &sa, &sb, f32::max),
            BinaryOp::Min => binary_kernel(&av, &bv, &shape, &sa, &sb, f32::min),
        };
        output.write_f32(&out)
    }

    fn affine(&self, x: &Tensor, mul: f32, add: f32) -> Result<Tensor> {
        let xi = self.input("affine", x)?;
        let output = self.new_output("affine", x.shape().to_vec(), x.dtype())?;
        self.fence()?;
        let mut v = xi.f32()?;
        for e in &mut v {
            *e = *e * mul + add;
        }
        output.write_f32(&v)
    }

    fn softmax(&self, x: &Tensor) -> Result<Tensor> {
        const OP: &str = "softmax";
        let Some(&d) = x.shape().last() else {
            return Err(shape_err(OP, "x is a scalar; expected x [..., d]"));
        };
        let xi = self.input(OP, x)?;
        let output = self.new_output(OP, x.shape().to_vec(), x.dtype())?;
        self.fence()?;
        let mut v = xi.f32()?;
        for row in v.chunks_exact_mut(d.max(1)) {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0f64;
            for e in row.iter_mut() {
                *e = (*e - max).exp();
                sum += f64::from(*e);
            }
            let inv = (1.0 / sum) as f32;
            for e in row.iter_mut() {
                *e *= inv;
            }
        }
        output.write_f32(&v)
    }

    fn reduce(&self, x: &Tensor, dim: usize, op: ReduceOp) -> Result<Tensor> {
        const OP: &str = "reduce";
        let xs = x.shape();
        if dim >= xs.len() {
            return Err(shape_err(
                OP,
                format!("dim {dim} out of range for shape {xs:?}"),
            ));
        }
        let (outer, len, inner) = (product(&xs[..dim]), xs[dim], product(&xs[dim + 1..]));
        if len == 0 && op == ReduceOp::Max {
            return Err(shape_err(
                OP,
                format!("max over the empty dim {dim} of shape {xs:?}"),
            ));
        }
        let xi = self.input(OP, x)?;
        let mut shape = xs.to_vec();
        shape[dim] = 1;
        let output = self.new_output(OP, shape, x.dtype())?;
        self.fence()?;
        let xv = xi.f32()?;
        let mut out = vec![0.0f32; outer * inner];
        for oi in 0..outer {
            for ii in 0..inner {
                let at = |j: usize| xv[(oi * len + j) * inner + ii];
                out[oi * inner + ii] = match op {
                    ReduceOp::Sum => (0..len).map(|j| f64::from(at(j))).sum::<f64>() as f32,
                    ReduceOp::Mean => {
                        ((0..len).map(|j| f64::from(at(j))).sum::<f64>() / len as f64) as f32
                    }
                    ReduceOp::Max => (0..len).map(at).fold(f32::NEG_INFINITY, f32::max),
                };
            }
        }
        output.write_f32(&out)
    }

    fn upsample_nearest2x(&self, x: &Tensor) -> Result<Tensor> {
        const OP: &str = "upsample_nearest2x";
        let xs = x.shape();
        if xs.len() != 4 {
            return Err(shape_err(OP, format!("x {xs:?}: expected [n, c, h, w]")));
        }
        let (h, w) = (xs[2], xs[3]);
        let (Some(h2), Some(w2)) = (h.checked_mul(2), w.checked_mul(2)) else {
            return Err(shape_err(OP, format!("x {xs:?} is too large to upsample")));
        };
        let xi = self.input(OP, x)?;
        let output = self.new_output(OP, vec![xs[0], xs[1], h2, w2], x.dtype())?;
        self.fence()?;
        let xv = xi.f32()?;
        let mut out = Vec::with_capacity(xv.len() * 4);
        for row in xv.chunks_exact(w.max(1)) {
            let start = out.len();
            out.extend(row.iter().flat_map(|&v| [v, v]));
            out.extend_from_within(start..);
        }
        output.write_f32(&out)
    }

    fn attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&Tensor>,
        scale: f32,
    ) -> Result<Tensor> {
        const OP: &str = "attention";
        let crate::shape::AttentionGeometry {
            b,
            h,
            lq,
            lk,
            d,
            dv,
            mask_strides,
        } = crate::shape::attention_geometry(
            OP,
            q.shape(),
            k.shape(),
            v.shape(),
            mask.map(Tensor::shape),
        )?;
        let qi = self.input(OP, q)?;
        let ki = self.input(OP, k)?;
        let vi = self.input(OP, v)?;
        let mi = mask.map(|m| self.input(OP, m)).transpose()?;
        let output = self.new_output(OP, vec![b, h, lq, dv], q.dtype())?;
        self.fence()?;
        let qv = qi.f32()?;
        let kv = ki.f32()?;
        let vv = vi.f32()?;
        let mv = read_opt(mi.as_ref())?;
        let dims = AttnDims {
            lq,
            lk,
            d,
            dv,
            scale,
        };
        let heads = b * h;
        let mut out = vec![0.0f32; heads * lq * dv];
        // Work units: one block of queries of one (batch, head), each with its own rows of
        // the output, so a single long head spreads over threads too.
        let run = |head: usize, q0: usize, o: &mut [f32]| {
            let bq = ATTN_BLOCK_Q.min(lq - q0);
            let head_mask = match (&mv, &mask_strides) {
                (Some(values), Some(s)) => Some(HeadMask {
                    values,
                    base: (head / h) * s[0] + (head % h) * s[1] + q0 * s[2],
                    sq: s[2],
                    sk: s[3],
                }),
                _ => None,
            };
            let rows = head * lq + q0;
            attend_head(
                &qv[rows * d..(rows + bq) * d],
                &kv[head * lk * d..(head + 1) * lk * d],
                &vv[head * lk * dv..(head + 1) * lk * dv],
                head_mask,
                AttnDims { lq: bq, ..dims },
                o,
            );
        };
        let mut units: Vec<(usize, usize, &mut [f32])> = Vec::new();
        if dv > 0 {
            for (head, o) in out.chunks_mut(lq * dv).enumerate() {
                for (i, blk) in o.chunks_mut(ATTN_BLOCK_Q * dv).enumerate() {
                    units.push((head, i * ATTN_BLOCK_Q, blk));
                }
            }
        }
        let work = [heads, lq, lk, d + dv]
            .iter()
            .fold(1usize, |acc, &n| acc.saturating_mul(n));
        let threads = std::thread::available_parallelism()
            .map_or(1, usize::from)
            .min(units.len());
        if threads <= 1 || work < (1 << 22) {
            for (head, q0, o) in units {
                run(head, q0, o);
            }
        } else {
            let mut parts: Vec<Vec<_>> = (0..threads).map(|_| Vec::new()).collect();
            for (i, unit) in units.into_iter().enumerate() {
                parts[i % threads].push(unit);
            }
            std::thread::scope(|scope| {
                for part in parts {
                    let run = &run;
                    scope.spawn(move || {
                        for (head, q0, o) in part {
                            run(head, q0, o);
                        }
                    });
                }
            });
        }
        output.write_f32(&out)
    }

    fn rope(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        const OP: &str = "rope";
        let xs = x.shape();
        let ok = xs.len() >= 2
            && cos.shape() == &xs[xs.len() - 2..]
            && sin.shape() == cos.shape()
            && xs[xs.len() - 1].is_multiple_of(2);
        if !ok {
            return Err(shape_err(
                OP,
                format!(
                    "x {xs:?}, cos {:?}, sin {:?}: expected x [b, h, l, d] with d even and \
                     cos, sin [l, d]",
                    cos.shape(),
                    sin.shape()
                ),
            ));
        }
        let xi = self.input(OP, x)?;
        let ci = self.input(OP, cos)?;
        let si = self.input(OP, sin)?;
        let output = self.new_output(OP, xs.to_vec(), x.dtype())?;
        self.fence()?;
        let xv = xi.f32()?;
        let cv = ci.f32()?;
        let sv = si.f32()?;
        let table = cv.len().max(1);
        let mut out = vec![0.0f32; xv.len()];
        for (orows, xrows) in out.chunks_exact_mut(table).zip(xv.chunks_exact(table)) {
            for (((o, xp), c), s) in orows
                .chunks_exact_mut(2)
                .zip(xrows.chunks_exact(2))
                .zip(cv.chunks_exact(2))
                .zip(sv.chunks_exact(2))
            {
                o[0] = xp[0] * c[0] - xp[1] * s[0];
                o[1] = xp[1] * c[1] + xp[0] * s[1];
            }
        }
        output.write_f32(&out)
    }

    fn concat(&self, xs: &[&Tensor], dim: usize) -> Result<Tensor> {
        const OP: &str = "concat";
        let shapes: Vec<&[usize]> = xs.iter().map(|t| t.shape()).collect();
        let shape = crate::shape::concat_shape(OP, &shapes, dim)?;
        let total = shape[dim];
        let first = xs[0];
        let fs = first.shape();
        let dtype = first.dtype();
        let es = dtype.size_in_bytes();
        let inner = product(&fs[dim + 1..]);
        let inputs = xs
            .iter()
            .map(|t| self.input(OP, t))
            .collect::<Result<Vec<_>>>()?;
        let output = self.new_output(OP, shape, dtype)?;
        self.fence()?;
        // Inputs of another dtype are re-encoded into the output's first.
        let converted = inputs
            .iter()
            .map(|input| {
                (input.dtype != dtype)
                    .then(|| {
                        let values = input.f32()?;
                        let mut encoded = vec![0u8; values.len() * es];
                        encode_into(dtype, &values, &mut encoded);
                        Ok(encoded)
                    })
                    .transpose()
            })
            .collect::<Result<Vec<_>>>()?;
        let out_row = total * inner * es;
        output.write_bytes(|out| {
            let mut col = 0;
            for ((input, s), conv) in inputs.iter().zip(&shapes).zip(&converted) {
                let row = s[dim] * inner * es;
                let mut place = |src: &[u8]| {
                    if row > 0 {
                        for (o, chunk) in out.chunks_exact_mut(out_row).zip(src.chunks_exact(row)) {
                            o[col..col + row].copy_from_slice(chunk);
                        }
                    }
                };
                match conv {
                    Some(bytes) => place(bytes),
                    None => input.bytes(place),
                }
                col += row;
            }
        })
    }

    fn narrow(&self, x: &Tensor, dim: usize, start: usize, len: usize) -> Result<Tensor> {
        const OP: &str = "narrow";
        let xs = x.shape();
        let fits = dim < xs.len() && start.checked_add(len).is_some_and(|end| end <= xs[dim]);
        if !fits {
            return Err(shape_err(
                OP,
                format!("range {start}..{start}+{len} along dim {dim} is outside shape {xs:?}"),
            ));
        }
        let xi = self.input(OP, x)?;
        let es = x.dtype().size_in_bytes();
        let inner = product(&xs[dim + 1..]);
        let (src_row, dst_row) = (xs[dim] * inner * es, len * inner * es);
        let skip = start * inner * es;
        let mut shape = xs.to_vec();
        shape[dim] = len;
        let output = self.new_output(OP, shape, x.dtype())?;
        self.fence()?;
        output.write_bytes(|out| {
            if dst_row > 0 {
                xi.bytes(|b| {
                    for (o, src) in out.chunks_exact_mut(dst_row).zip(b.chunks_exact(src_row)) {
                        o.copy_from_slice(&src[skip..skip + dst_row]);
                    }
                });
            }
        })
    }

    fn permute(&self, x: &Tensor, dims: &[usize]) -> Result<Tensor> {
        const OP: &str = "permute";
        let xs = x.shape();
        let mut seen = vec![false; xs.len()];
        let valid = dims.len() == xs.len()
            && dims
                .iter()
                .all(|&d| d < xs.len() && !std::mem::replace(&mut seen[d], true));
        if !valid {
            return Err(shape_err(
                OP,
                format!("{dims:?} is not a permutation of the dims of shape {xs:?}"),
            ));
        }
        let xi = self.input(OP, x)?;
        let es = x.dtype().size_in_bytes();
        let shape: Vec<usize> = dims.iter().map(|&d| xs[d]).collect();
        let src = contiguous_strides(xs);
        let strides: Vec<usize> = dims.iter().map(|&d| src[d]).collect();
        let (cs, [ss]) = coalesce(&shape, [&strides]);
        let r = cs.len();
        let (inner, is) = (cs[r - 1], ss[r - 1]);
        let output = self.new_output(OP, shape, x.dtype())?;
        self.fence()?;
        output.write_bytes(|out| {
            xi.bytes(|b| {
                let mut at = 0;
                walk(&cs[..r - 1], [&ss[..r - 1]], |[o]| {
                    let dst = &mut out[at..at + inner * es];
                    if is == 1 {
                        dst.copy_from_slice(&b[o * es..(o + inner) * es]);
                    } else {
                        for (j, e) in dst.chunks_exact_mut(es).enumerate() {
                            let from = (o + j * is) * es;
                            e.copy_from_slice(&b[from..from + es]);
                        }
                    }
                    at += inner * es;
                });
            });
        })
    }

    fn cast(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        const OP: &str = "cast";
        let xi = self.input(OP, x)?;
        let output = self.new_output(OP, x.shape().to_vec(), dtype)?;
        self.fence()?;
        if dtype == x.dtype() {
            return output.write_bytes(|out| xi.bytes(|b| out.copy_from_slice(b)));
        }
        let v = xi.f32()?;
        output.write_f32(&v)
    }

    fn embedding(&self, table: &Tensor, ids: &[u32]) -> Result<Tensor> {
        const OP: &str = "embedding";
        let ts = table.shape();
        if ts.len() != 2 {
            return Err(shape_err(OP, format!("table {ts:?}: expected [rows, d]")));
        }
        let (rows, d) = (ts[0], ts[1]);
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= rows) {
            return Err(shape_err(
                OP,
                format!("id {bad} is out of range for a table of {rows} rows"),
            ));
        }
        let ti = self.input(OP, table)?;
        let row = d * table.dtype().size_in_bytes();
        let output = self.new_output(OP, vec![ids.len(), d], table.dtype())?;
        self.fence()?;
        output.write_bytes(|out| {
            if row > 0 {
                ti.bytes(|b| {
                    for (o, &id) in out.chunks_exact_mut(row).zip(ids) {
                        let at = id as usize * row;
                        o.copy_from_slice(&b[at..at + row]);
                    }
                });
            }
        })
    }
}

/// Mean and `1 / sqrt(var + eps)` (biased variance) of `values`, two-pass in f64.
fn mean_inv_std(values: &[f32], eps: f32) -> (f64, f64) {
    let n = values.len().max(1) as f64;
    let mean = values.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
    let var = values
        .iter()
        .map(|&v| {
            let c = f64::from(v) - mean;
            c * c
        })
        .sum::<f64>()
        / n;
    (mean, 1.0 / (var + f64::from(eps)).sqrt())
}

/// Fills `cols [c·kh·kw, rows·ow]` with the patches of output rows `r0..r0 + rows` of one
/// image `x [c, h, w]` (zeros where the kernel reads padding).
fn im2col(
    x: &[f32],
    (c, h, w): (usize, usize, usize),
    (kh, kw): (usize, usize),
    params: Conv2dParams,
    (r0, rows, ow): (usize, usize, usize),
    cols: &mut [f32],
) {
    let Conv2dParams {
        stride: (sh, sw),
        padding: (ph, pw),
    } = params;
    let ncol = rows * ow;
    // Output columns whose input column `ox·sw + kj - pw` lies inside `0..w`.
    let valid_cols = |kj: usize| {
        let lo = pw.saturating_sub(kj).div_ceil(sw);
        let hi = if w + pw > kj {
            ((w + pw - kj - 1) / sw + 1).min(ow)
        } else {
            0
        };
        (lo.min(hi), hi)
    };
    let mut chunks = cols.chunks_exact_mut(ncol.max(1));
    for ci in 0..c {
        let plane = &x[ci * h * w..(ci + 1) * h * w];
        for ki in 0..kh {
            for kj in 0..kw {
                let Some(dst) = chunks.next() else { return };
                let (lo, hi) = valid_cols(kj);
                for (r, drow) in dst.chunks_exact_mut(ow.max(1)).enumerate() {
                    let iy = (r0 + r) * sh + ki;
                    if iy < ph || iy - ph >= h {
                        drow.fill(0.0);
                        continue;
                    }
                    let src = &plane[(iy - ph) * w..(iy - ph + 1) * w];
                    drow[..lo].fill(0.0);
                    drow[hi..].fill(0.0);
                    if sw == 1 {
                        let ix0 = lo + kj - pw;
                        drow[lo..hi].copy_from_slice(&src[ix0..ix0 + (hi - lo)]);
                    } else {
                        for (ox, d) in drow[lo..hi].iter_mut().enumerate() {
                            *d = src[(lo + ox) * sw + kj - pw];
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::device::ops_of;
    use crate::host_backend::HostDeviceConfig;
    use crate::reference::SplitMix64;

    fn dev() -> Arc<HostDevice> {
        HostDevice::with_capacity(1 << 28).unwrap()
    }

    fn random(rng: &mut SplitMix64, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.next_signed()).collect()
    }

    fn put(d: &HostDevice, shape: &[usize], dtype: DType, values: &[f32]) -> Tensor {
        d.tensor_from_f32(shape, dtype, values).unwrap()
    }

    fn get(d: &HostDevice, t: &Tensor) -> Vec<f32> {
        d.to_f32_vec(t).unwrap()
    }

    fn f64s(v: &[f32]) -> Vec<f64> {
        v.iter().map(|&x| f64::from(x)).collect()
    }

    /// Relative L2 error of `got` against `want`.
    fn rel_l2(got: &[f32], want: &[f64]) -> f64 {
        assert_eq!(got.len(), want.len(), "length");
        let (mut num, mut den) = (0.0f64, 0.0f64);
        for (&g, &w) in got.iter().zip(want) {
            num += (f64::from(g) - w).powi(2);
            den += w * w;
        }
        if den == 0.0 {
            num.sqrt()
        } else {
            (num / den).sqrt()
        }
    }

    #[track_caller]
    fn assert_close(what: &str, got: &[f32], want: &[f64], tol: f64) {
        let e = rel_l2(got, want);
        assert!(e <= tol, "{what}: relative L2 error {e:e} > {tol:e}");
    }

    const F32_TOL: f64 = 1e-5;
    const BF16_TOL: f64 = 1e-2;

    /// Row-major multi-index of flat index `i` in `shape`.
    fn unravel(mut i: usize, shape: &[usize]) -> Vec<usize> {
        let mut idx = vec![0; shape.len()];
        for d in (0..shape.len()).rev() {
            idx[d] = i % shape[d];
            i /= shape[d];
        }
        idx
    }

    /// Flat index in a tensor of `shape` of the (right-aligned, broadcast) index `idx`.
    fn ravel_broadcast(idx: &[usize], shape: &[usize]) -> usize {
        let off = idx.len() - shape.len();
        shape.iter().enumerate().fold(0, |acc, (d, &n)| {
            acc * n + if n == 1 { 0 } else { idx[off + d] }
        })
    }

    // ---- references (f64) -----------------------------------------------------------

    fn ref_linear(x: &[f32], w: &[f32], b: Option<&[f32]>, inp: usize, out: usize) -> Vec<f64> {
        let m = x.len() / inp;
        let mut y = vec![0.0; m * out];
        for i in 0..m {
            for o in 0..out {
                let mut s = b.map_or(0.0, |b| f64::from(b[o]));
                for k in 0..inp {
                    s += f64::from(x[i * inp + k]) * f64::from(w[o * inp + k]);
                }
                y[i * out + o] = s;
            }
        }
        y
    }

    fn ref_matmul(a: &[f32], ash: &[usize], b: &[f32], bsh: &[usize], osh: &[usize]) -> Vec<f64> {
        let r = osh.len();
        let (m, k, n) = (osh[r - 2], ash[ash.len() - 1], osh[r - 1]);
        let (ab, bb) = (&ash[..ash.len() - 2], &bsh[..bsh.len() - 2]);
        let nb: usize = osh[..r - 2].iter().product();
        let mut y = vec![0.0; nb * m * n];
        for bi in 0..nb {
            let idx = unravel(bi, &osh[..r - 2]);
            let (ao, bo) = (ravel_broadcast(&idx, ab), ravel_broadcast(&idx, bb));
            for i in 0..m {
                for j in 0..n {
                    y[(bi * m + i) * n + j] = (0..k)
                        .map(|t| {
                            f64::from(a[(ao * m + i) * k + t]) * f64::from(b[(bo * k + t) * n + j])
                        })
                        .sum();
                }
            }
        }
        y
    }

    #[allow(clippy::too_many_arguments)]
    fn ref_conv(
        x: &[f32],
        [n, c, h, w]: [usize; 4],
        wt: &[f32],
        [o, kh, kw]: [usize; 3],
        b: Option<&[f32]>,
        (s, p): (usize, usize),
    ) -> (Vec<f64>, [usize; 4]) {
        let oh = (h + 2 * p - kh) / s + 1;
        let ow = (w + 2 * p - kw) / s + 1;
        let mut y = vec![0.0; n * o * oh * ow];
        for ni in 0..n {
            for oi in 0..o {
                for yi in 0..oh {
                    for xi in 0..ow {
                        let mut acc = b.map_or(0.0, |b| f64::from(b[oi]));
                        for ci in 0..c {
                            for ki in 0..kh {
                                for kj in 0..kw {
                                    let iy = (yi * s + ki) as isize - p as isize;
                                    let ix = (xi * s + kj) as isize - p as isize;
                                    if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize {
                                        continue;
                                    }
                                    let xv = x[((ni * c + ci) * h + iy as usize) * w + ix as usize];
                                    let wv = wt[((oi * c + ci) * kh + ki) * kw + kj];
                                    acc += f64::from(xv) * f64::from(wv);
                                }
                            }
                        }
                        y[((ni * o + oi) * oh + yi) * ow + xi] = acc;
                    }
                }
            }
        }
        (y, [n, o, oh, ow])
    }

    /// `erfc(z)` for `z >= 0`: positive-term series of erf below 3, continued fraction above.
    fn ref_erfc(z: f64) -> f64 {
        let sqrt_pi = std::f64::consts::PI.sqrt();
        if z < 3.0 {
            // erf z = 2/√π e^{-z²} Σ 2ⁿ z^{2n+1} / (1·3·…·(2n+1)), all terms positive.
            let (mut term, mut sum) = (z, z);
            for n in 1..200 {
                term *= 2.0 * z * z / (2 * n + 1) as f64;
                sum += term;
            }
            1.0 - 2.0 / sqrt_pi * (-z * z).exp() * sum
        } else {
            let mut f = z;
            for n in (1..300).rev() {
                f = z + (n as f64 / 2.0) / f;
            }
            (-z * z).exp() / (sqrt_pi * f)
        }
    }

    fn ref_gelu_erf(x: f64) -> f64 {
        let z = x / std::f64::consts::SQRT_2;
        if x >= 0.0 {
            x * (1.0 - 0.5 * ref_erfc(z))
        } else {
            0.5 * x * ref_erfc(-z)
        }
    }

    fn ref_unary(x: f64, op: UnaryOp) -> f64 {
        let sig = |v: f64| 1.0 / (1.0 + (-v).exp());
        match op {
            UnaryOp::Silu => x * sig(x),
            UnaryOp::GeluTanh => {
                let k = (2.0 / std::f64::consts::PI).sqrt();
                0.5 * x * (1.0 + (k * (x + 0.044715 * x * x * x)).tanh())
            }
            UnaryOp::GeluErf => ref_gelu_erf(x),
            UnaryOp::QuickGelu => x * sig(1.702 * x),
            UnaryOp::Sigmoid => sig(x),
            UnaryOp::Tanh => x.tanh(),
            UnaryOp::Relu => x.max(0.0),
            UnaryOp::Exp => x.exp(),
            UnaryOp::Neg => -x,
            UnaryOp::Square => x * x,
            UnaryOp::Sqrt => x.sqrt(),
            UnaryOp::Recip => 1.0 / x,
        }
    }

    fn ref_norm_rows(x: &[f32], d: usize, eps: f64, rms: bool) -> Vec<f64> {
        let mut y = Vec::with_capacity(x.len());
        for row in x.chunks(d) {
            let r = f64s(row);
            let n = d as f64;
            if rms {
                let ms = r.iter().map(|v| v * v).sum::<f64>() / n;
                y.extend(r.iter().map(|v| v / (ms + eps).sqrt()));
            } else {
                let mean = r.iter().sum::<f64>() / n;
                let var = r.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
                y.extend(r.iter().map(|v| (v - mean) / (var + eps).sqrt()));
            }
        }
        y
    }

    #[allow(clippy::too_many_arguments)]
    fn ref_attention(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        mask: Option<(&[f32], &[usize])>,
        [b, h, lq, lk, d, dv]: [usize; 6],
        scale: f64,
    ) -> Vec<f64> {
        let mut out = vec![0.0; b * h * lq * dv];
        for bi in 0..b {
            for hi in 0..h {
                let head = bi * h + hi;
                for i in 0..lq {
                    let mut s: Vec<f64> = (0..lk)
                        .map(|j| {
                            let dot: f64 = (0..d)
                                .map(|t| {
                                    f64::from(q[(head * lq + i) * d + t])
                                        * f64::from(k[(head * lk + j) * d + t])
                                })
                                .sum();
                            let m = mask.map_or(0.0, |(mv, ms)| {
                                f64::from(mv[ravel_broadcast(&[bi, hi, i, j], ms)])
                            });
                            dot * scale + m
                        })
                        .collect();
                    let mx = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    s.iter_mut().for_each(|x| *x = (*x - mx).exp());
                    let sum: f64 = s.iter().sum();
                    for t in 0..dv {
                        out[(head * lq + i) * dv + t] = (0..lk)
                            .map(|j| s[j] / sum * f64::from(v[(head * lk + j) * dv + t]))
                            .sum();
                    }
                }
            }
        }
        out
    }

    // ---- tests ----------------------------------------------------------------------

    #[test]
    fn host_device_exposes_its_ops() {
        let d = dev();
        let ops = ops_of(&*d).unwrap();
        let t = ops.tensor_from_f32(&[2], DType::F32, &[1.0, 2.0]).unwrap();
        assert!(t.is_on_device());
        assert_eq!(ops.to_f32_vec(&t).unwrap(), vec![1.0, 2.0]);
    }

    #[test]
    fn linear_matches_reference_with_and_without_bias() {
        let d = dev();
        let mut rng = SplitMix64::new(1);
        let (inp, out) = (19, 7);
        let x = random(&mut rng, 2 * 3 * inp);
        let w = random(&mut rng, out * inp);
        let b = random(&mut rng, out);
        let (xt, wt, bt) = (
            put(&d, &[2, 3, inp], DType::F32, &x),
            put(&d, &[out, inp], DType::F32, &w),
            put(&d, &[out], DType::F32, &b),
        );
        let y = d.linear(&xt, &wt, Some(&bt)).unwrap();
        assert_eq!(y.shape(), &[2, 3, out]);
        assert_close(
            "linear+bias",
            &get(&d, &y),
            &ref_linear(&x, &w, Some(&b), inp, out),
            F32_TOL,
        );
        let y = d.linear(&xt, &wt, None).unwrap();
        assert_close(
            "linear",
            &get(&d, &y),
            &ref_linear(&x, &w, None, inp, out),
            F32_TOL,
        );
    }

    #[test]
    fn bf16_inputs_stay_within_bf16_tolerance() {
        let d = dev();
        let mut rng = SplitMix64::new(2);
        let (inp, out) = (32, 16);
        let x = random(&mut rng, 4 * inp);
        let w = random(&mut rng, out * inp);
        let (xt, wt) = (
            put(&d, &[4, inp], DType::BF16, &x),
            put(&d, &[out, inp], DType::BF16, &w),
        );
        // The reference sees the bf16-rounded inputs; the output is rounded once.
        let (xr, wr) = (get(&d, &xt), get(&d, &wt));
        let y = d.linear(&xt, &wt, None).unwrap();
        assert_eq!(y.dtype(), DType::BF16);
        assert_close(
            "bf16 linear",
            &get(&d, &y),
            &ref_linear(&xr, &wr, None, inp, out),
            BF16_TOL,
        );
        let s = d.binary(&xt, &xt, BinaryOp::Mul).unwrap();
        let want: Vec<f64> = xr.iter().map(|&v| f64::from(v) * f64::from(v)).collect();
        assert_close("bf16 mul", &get(&d, &s), &want, BF16_TOL);
        let g = d.unary(&xt, UnaryOp::GeluErf).unwrap();
        let want: Vec<f64> = xr.iter().map(|&v| ref_gelu_erf(f64::from(v))).collect();
        assert_close("bf16 gelu", &get(&d, &g), &want, BF16_TOL);
    }

    #[test]
    fn matmul_broadcasts_batch_dims() {
        let d = dev();
        let mut rng = SplitMix64::new(3);
        let cases: [(&[usize], &[usize], &[usize]); 4] = [
            (&[2, 3, 4, 5], &[2, 3, 5, 6], &[2, 3, 4, 6]),
            (&[1, 3, 4, 5], &[2, 1, 5, 6], &[2, 3, 4, 6]),
            (&[2, 3, 4, 5], &[5, 6], &[2, 3, 4, 6]),
            (&[4, 5], &[3, 5, 2], &[3, 4, 2]),
        ];
        for (ash, bsh, osh) in cases {
            let a = random(&mut rng, ash.iter().product());
            let b = random(&mut rng, bsh.iter().product());
            let y = d
                .matmul(&put(&d, ash, DType::F32, &a), &put(&d, bsh, DType::F32, &b))
                .unwrap();
            assert_eq!(y.shape(), osh);
            let want = ref_matmul(&a, ash, &b, bsh, osh);
            assert_close(
                &format!("matmul {ash:?}x{bsh:?}"),
                &get(&d, &y),
                &want,
                F32_TOL,
            );
        }
    }

    #[test]
    fn conv2d_matches_reference_with_stride_and_padding() {
        let d = dev();
        let mut rng = SplitMix64::new(4);
        // (x shape, (o, kh, kw), (stride, padding), bias)
        let cases = [
            ([2, 3, 9, 8], [4, 3, 3], (2, 1), true),
            ([1, 3, 7, 7], [5, 3, 3], (1, 1), false),
            ([2, 4, 5, 6], [3, 1, 1], (1, 0), true),
            ([1, 2, 6, 9], [2, 2, 3], (2, 0), true),
            ([1, 2, 4, 4], [2, 4, 4], (3, 2), false),
        ];
        for (xs, [o, kh, kw], (s, p), with_bias) in cases {
            let x = random(&mut rng, xs.iter().product());
            let w = random(&mut rng, o * xs[1] * kh * kw);
            let b = random(&mut rng, o);
            let bt = put(&d, &[o], DType::F32, &b);
            let y = d
                .conv2d(
                    &put(&d, &xs, DType::F32, &x),
                    &put(&d, &[o, xs[1], kh, kw], DType::F32, &w),
                    with_bias.then_some(&bt),
                    Conv2dParams::new(s, p),
                )
                .unwrap();
            let (want, wshape) =
                ref_conv(&x, xs, &w, [o, kh, kw], with_bias.then_some(&b[..]), (s, p));
            assert_eq!(y.shape(), &wshape);
            assert_close(
                &format!("conv {xs:?} k{kh}x{kw} s{s} p{p}"),
                &get(&d, &y),
                &want,
                F32_TOL,
            );
        }
    }

    #[test]
    fn normalisations_match_f64_references() {
        let d = dev();
        let mut rng = SplitMix64::new(5);
        let eps = 1e-5f32;
        // An offset mean checks that statistics are accurate, not just roughly right.
        let x: Vec<f32> = random(&mut rng, 2 * 6 * 5 * 3)
            .iter()
            .map(|v| v + 50.0)
            .collect();
        let xt = put(&d, &[2, 6, 5, 3], DType::F32, &x);
        let w = random(&mut rng, 6);
        let b = random(&mut rng, 6);
        let (wt, bt) = (put(&d, &[6], DType::F32, &w), put(&d, &[6], DType::F32, &b));
        let y = d.group_norm(&xt, 3, Some(&wt), Some(&bt), eps).unwrap();
        // Group norm over [n, groups, 2·15] is a row norm, then a per-channel affine.
        let mut want = ref_norm_rows(&x, 2 * 15, f64::from(eps), false);
        for (i, v) in want.iter_mut().enumerate() {
            let ch = (i / 15) % 6;
            *v = *v * f64::from(w[ch]) + f64::from(b[ch]);
        }
        assert_close("group_norm", &get(&d, &y), &want, F32_TOL);
        let y = d.group_norm(&xt, 6, None, None, eps).unwrap();
        assert_close(
            "group_norm plain",
            &get(&d, &y),
            &ref_norm_rows(&x, 15, 1e-5, false),
            F32_TOL,
        );

        let x = random(&mut rng, 4 * 10);
        let xt = put(&d, &[4, 10], DType::F32, &x);
        let w = random(&mut rng, 10);
        let b = random(&mut rng, 10);
        let (wt, bt) = (
            put(&d, &[10], DType::F32, &w),
            put(&d, &[10], DType::F32, &b),
        );
        let y = d.layer_norm(&xt, Some(&wt), Some(&bt), eps).unwrap();
        let mut want = ref_norm_rows(&x, 10, f64::from(eps), false);
        for (i, v) in want.iter_mut().enumerate() {
            *v = *v * f64::from(w[i % 10]) + f64::from(b[i % 10]);
        }
        assert_close("layer_norm", &get(&d, &y), &want, F32_TOL);
        let y = d.rms_norm(&xt, Some(&wt), eps).unwrap();
        let mut want = ref_norm_rows(&x, 10, f64::from(eps), true);
        for (i, v) in want.iter_mut().enumerate() {
            *v *= f64::from(w[i % 10]);
        }
        assert_close("rms_norm", &get(&d, &y), &want, F32_TOL);
    }

    #[test]
    fn unary_ops_match_f64_references() {
        let d = dev();
        let mut rng = SplitMix64::new(6);
        let x: Vec<f32> = random(&mut rng, 257).iter().map(|v| v * 4.0).collect();
        let positive: Vec<f32> = x.iter().map(|v| v.abs() + 0.1).collect();
        let ops = [
            UnaryOp::Silu,
            UnaryOp::GeluTanh,
            UnaryOp::GeluErf,
            UnaryOp::QuickGelu,
            UnaryOp::Sigmoid,
            UnaryOp::Tanh,
            UnaryOp::Relu,
            UnaryOp::Exp,
            UnaryOp::Neg,
            UnaryOp::Square,
            UnaryOp::Sqrt,
            UnaryOp::Recip,
        ];
        for op in ops {
            let input = if matches!(op, UnaryOp::Sqrt | UnaryOp::Recip) {
                &positive
            } else {
                &x
            };
            let y = d
                .unary(&put(&d, &[input.len()], DType::F32, input), op)
                .unwrap();
            let want: Vec<f64> = input.iter().map(|&v| ref_unary(f64::from(v), op)).collect();
            assert_close(&format!("{op:?}"), &get(&d, &y), &want, F32_TOL);
        }
    }

    #[test]
    fn gelu_erf_is_precise_elementwise_including_tails() {
        for i in 0..=2600 {
            let z = f64::from(i) * 0.01;
            let (got, want) = (erfc_nonneg(z), ref_erfc(z));
            assert!(
                ((got - want) / want).abs() < 1e-10,
                "erfc({z}): {got} vs {want}"
            );
        }
        for i in -1200..=1200 {
            let x = i as f32 * 0.01;
            let want = ref_gelu_erf(f64::from(x));
            let got = f64::from(gelu_erf(x));
            let err = if want == 0.0 {
                got.abs()
            } else {
                ((got - want) / want).abs()
            };
            assert!(err <= 1e-6, "gelu_erf({x}): {got} vs {want}");
        }
    }

    #[test]
    fn binary_ops_broadcast_like_numpy() {
        let d = dev();
        let mut rng = SplitMix64::new(7);
        let cases: [(&[usize], &[usize]); 6] = [
            (&[2, 3, 4], &[2, 3, 4]),
            (&[2, 3, 4], &[1]),
            (&[2, 3, 4], &[3, 1]),
            (&[2, 1, 4], &[1, 3, 1]),
            (&[4], &[2, 3, 4]),
            (&[2, 5, 3, 3], &[5, 1, 1]),
        ];
        let ops = [
            BinaryOp::Add,
            BinaryOp::Sub,
            BinaryOp::Mul,
            BinaryOp::Div,
            BinaryOp::Max,
            BinaryOp::Min,
        ];
        for (ash, bsh) in cases {
            let a = random(&mut rng, ash.iter().product());
            let b: Vec<f32> = random(&mut rng, bsh.iter().product())
                .iter()
                .map(|v| v + 2.0)
                .collect();
            let (at, bt) = (put(&d, ash, DType::F32, &a), put(&d, bsh, DType::F32, &b));
            let osh = broadcast_shape("test", ash, bsh).unwrap();
            for op in ops {
                let y = d.binary(&at, &bt, op).unwrap();
                assert_eq!(y.shape(), &osh[..]);
                let want: Vec<f64> = (0..osh.iter().product())
                    .map(|i| {
                        let idx = unravel(i, &osh);
                        let x = f64::from(a[ravel_broadcast(&idx, ash)]);
                        let z = f64::from(b[ravel_broadcast(&idx, bsh)]);
                        match op {
                            BinaryOp::Add => x + z,
                            BinaryOp::Sub => x - z,
                            BinaryOp::Mul => x * z,
                            BinaryOp::Div => x / z,
                            BinaryOp::Max => x.max(z),
                            BinaryOp::Min => x.min(z),
                        }
                    })
                    .collect();
                assert_close(
                    &format!("{op:?} {ash:?} {bsh:?}"),
                    &get(&d, &y),
                    &want,
                    F32_TOL,
                );
            }
        }
    }

    #[test]
    fn affine_softmax_reduce_and_upsample() {
        let d = dev();
        let mut rng = SplitMix64::new(8);
        let x: Vec<f32> = random(&mut rng, 2 * 3 * 4)
            .iter()
            .map(|v| v * 8.0)
            .collect();
        let xt = put(&d, &[2, 3, 4], DType::F32, &x);

        let y = d.affine(&xt, 1.5, -0.25).unwrap();
        let want: Vec<f64> = x.iter().map(|&v| f64::from(v) * 1.5 - 0.25).collect();
        assert_close("affine", &get(&d, &y), &want, F32_TOL);

        let y = d.softmax(&xt).unwrap();
        let mut want = Vec::new();
        for row in x.chunks(4) {
            let e: Vec<f64> = row.iter().map(|&v| f64::from(v).exp()).collect();
            let s: f64 = e.iter().sum();
            want.extend(e.iter().map(|v| v / s));
        }
        assert_close("softmax", &get(&d, &y), &want, F32_TOL);

        let shape = [2, 3, 4];
        for dim in 0..3 {
            for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max] {
                let y = d.reduce(&xt, dim, op).unwrap();
                let mut osh = shape;
                osh[dim] = 1;
                assert_eq!(y.shape(), &osh);
                let want: Vec<f64> = (0..osh.iter().product())
                    .map(|i| {
                        let mut idx = unravel(i, &osh);
                        let vals: Vec<f64> = (0..shape[dim])
                            .map(|j| {
                                idx[dim] = j;
                                f64::from(x[ravel_broadcast(&idx, &shape)])
                            })
                            .collect();
                        match op {
                            ReduceOp::Sum => vals.iter().sum(),
                            ReduceOp::Mean => vals.iter().sum::<f64>() / vals.len() as f64,
                            ReduceOp::Max => vals.iter().copied().fold(f64::NEG_INFINITY, f64::max),
                        }
                    })
                    .collect();
                assert_close(
                    &format!("reduce {op:?} dim {dim}"),
                    &get(&d, &y),
                    &want,
                    F32_TOL,
                );
            }
        }

        let x = random(&mut rng, 2 * 2 * 3 * 5);
        let y = d
            .upsample_nearest2x(&put(&d, &[2, 2, 3, 5], DType::F32, &x))
            .unwrap();
        assert_eq!(y.shape(), &[2, 2, 6, 10]);
        let got = get(&d, &y);
        for (i, &g) in got.iter().enumerate() {
            let [n, c, yy, xx] = unravel(i, &[2, 2, 6, 10])[..] else {
                unreachable!()
            };
            assert_eq!(g, x[((n * 2 + c) * 3 + yy / 2) * 5 + xx / 2]);
        }
    }

    fn check_attention(
        d: &HostDevice,
        rng: &mut SplitMix64,
        dims @ [b, h, lq, lk, hd, dv]: [usize; 6],
        mask_shape: Option<&[usize]>,
    ) {
        let q = random(rng, b * h * lq * hd);
        let k = random(rng, b * h * lk * hd);
        let v = random(rng, b * h * lk * dv);
        let mask = mask_shape.map(|ms| {
            let mut m: Vec<f32> = random(rng, ms.iter().product())
                .iter()
                .map(|x| x * 2.0)
                .collect();
            // Mask a few keys out entirely (never a whole row).
            for (i, x) in m.iter_mut().enumerate() {
                if i % 7 == 3 {
                    *x = f32::NEG_INFINITY;
                }
            }
            m
        });
        let mt = mask
            .as_ref()
            .map(|m| put(d, mask_shape.unwrap_or(&[]), DType::F32, m));
        let scale = 1.0 / (hd as f32).sqrt();
        let y = d
            .attention(
                &put(d, &[b, h, lq, hd], DType::F32, &q),
                &put(d, &[b, h, lk, hd], DType::F32, &k),
                &put(d, &[b, h, lk, dv], DType::F32, &v),
                mt.as_ref(),
                scale,
            )
            .unwrap();
        assert_eq!(y.shape(), &[b, h, lq, dv]);
        let want = ref_attention(
            &q,
            &k,
            &v,
            mask.as_deref().zip(mask_shape),
            dims,
            f64::from(scale),
        );
        assert_close(
            &format!("attention {dims:?} mask {mask_shape:?}"),
            &get(d, &y),
            &want,
            F32_TOL,
        );
    }

    #[test]
    fn attention_matches_naive_softmax_with_masks_and_unequal_lengths() {
        let d = dev();
        let mut rng = SplitMix64::new(9);
        check_attention(&d, &mut rng, [2, 3, 5, 7, 8, 8], None);
        check_attention(&d, &mut rng, [2, 3, 5, 7, 8, 6], Some(&[2, 1, 5, 7]));
        check_attention(&d, &mut rng, [1, 2, 4, 9, 4, 4], Some(&[9]));
        // Several query and key blocks, with a key tail.
        check_attention(&d, &mut rng, [1, 2, 300, 300, 16, 16], Some(&[300, 300]));
        check_attention(&d, &mut rng, [1, 1, 70, 520, 8, 8], Some(&[1, 1, 1, 520]));
    }

    #[test]
    fn rope_matches_a_naive_loop() {
        let d = dev();
        let mut rng = SplitMix64::new(10);
        let (b, h, l, hd) = (2, 3, 5, 8);
        let x = random(&mut rng, b * h * l * hd);
        let cos = random(&mut rng, l * hd);
        let sin = random(&mut rng, l * hd);
        let y = d
            .rope(
                &put(&d, &[b, h, l, hd], DType::F32, &x),
                &put(&d, &[l, hd], DType::F32, &cos),
                &put(&d, &[l, hd], DType::F32, &sin),
            )
            .unwrap();
        let mut want = vec![0.0; x.len()];
        for row in 0..b * h * l {
            let pos = row % l;
            for i in 0..hd / 2 {
                let (x0, x1) = (
                    f64::from(x[row * hd + 2 * i]),
                    f64::from(x[row * hd + 2 * i + 1]),
                );
                let at = |t: &[f32], j: usize| f64::from(t[pos * hd + j]);
                want[row * hd + 2 * i] = x0 * at(&cos, 2 * i) - x1 * at(&sin, 2 * i);
                want[row * hd + 2 * i + 1] = x1 * at(&cos, 2 * i + 1) + x0 * at(&sin, 2 * i + 1);
            }
        }
        assert_close("rope", &get(&d, &y), &want, F32_TOL);
    }

    #[test]
    fn layout_ops_cast_and_embedding() {
        let d = dev();
        let mut rng = SplitMix64::new(11);
        let a = random(&mut rng, 2 * 3 * 4);
        let b = random(&mut rng, 2 * 2 * 4);
        let (at, bt) = (
            put(&d, &[2, 3, 4], DType::F32, &a),
            put(&d, &[2, 2, 4], DType::F32, &b),
        );

        let c = d.concat(&[&at, &bt], 1).unwrap();
        assert_eq!(c.shape(), &[2, 5, 4]);
        let got = get(&d, &c);
        for (i, &g) in got.iter().enumerate() {
            let [n, r, k] = unravel(i, &[2, 5, 4])[..] else {
                unreachable!()
            };
            let want = if r < 3 {
                a[(n * 3 + r) * 4 + k]
            } else {
                b[(n * 2 + r - 3) * 4 + k]
            };
            assert_eq!(g, want);
        }
        // A bf16 input is converted to the first input's dtype.
        let bh = put(&d, &[2, 2, 4], DType::BF16, &b);
        let c = d.concat(&[&at, &bh], 1).unwrap();
        assert_eq!(c.dtype(), DType::F32);
        let cd = d.concat(&[&at, &at], 2).unwrap();
        assert_eq!(cd.shape(), &[2, 3, 8]);
        assert_eq!(get(&d, &cd)[4..8], a[0..4]);

        let nw = d.narrow(&at, 1, 1, 2).unwrap();
        assert_eq!(nw.shape(), &[2, 2, 4]);
        let got = get(&d, &nw);
        for (i, &g) in got.iter().enumerate() {
            let [n, r, k] = unravel(i, &[2, 2, 4])[..] else {
                unreachable!()
            };
            assert_eq!(g, a[(n * 3 + r + 1) * 4 + k]);
        }

        let x = random(&mut rng, 2 * 3 * 4 * 5);
        let xt = put(&d, &[2, 3, 4, 5], DType::F32, &x);
        for dims in [[0, 2, 1, 3], [3, 2, 1, 0], [0, 1, 2, 3], [1, 0, 3, 2]] {
            let p = d.permute(&xt, &dims).unwrap();
            let osh: Vec<usize> = dims.iter().map(|&i| [2, 3, 4, 5][i]).collect();
            assert_eq!(p.shape(), &osh[..]);
            let got = get(&d, &p);
            for (i, &g) in got.iter().enumerate() {
                let oi = unravel(i, &osh);
                let mut si = [0; 4];
                for (o, &src) in dims.iter().enumerate() {
                    si[src] = oi[o];
                }
                assert_eq!(
                    g,
                    x[((si[0] * 3 + si[1]) * 4 + si[2]) * 5 + si[3]],
                    "{dims:?}"
                );
            }
        }

        let h = d.cast(&at, DType::BF16).unwrap();
        assert_eq!(h.dtype(), DType::BF16);
        let want: Vec<f32> = a.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
        assert_eq!(get(&d, &h), want);
        assert_eq!(get(&d, &d.cast(&at, DType::F32).unwrap()), a);
        let f = d.cast(&h, DType::F16).unwrap();
        assert_close("cast chain", &get(&d, &f), &f64s(&want), 1e-3);

        let table = random(&mut rng, 5 * 3);
        let e = d
            .embedding(&put(&d, &[5, 3], DType::F32, &table), &[4, 0, 4, 2])
            .unwrap();
        assert_eq!(e.shape(), &[4, 3]);
        let want: Vec<f32> = [4, 0, 4, 2]
            .iter()
            .flat_map(|&r| table[r * 3..r * 3 + 3].to_vec())
            .collect();
        assert_eq!(get(&d, &e), want);
    }

    #[test]
    fn bad_shapes_wrong_devices_and_ids_are_typed_errors() {
        let d = dev();
        let t = |shape: &[usize]| put(&d, shape, DType::F32, &vec![0.5; shape.iter().product()]);
        let is_shape = |r: Result<Tensor>| matches!(r, Err(CoreError::Shape { .. }));
        assert!(is_shape(d.linear(&t(&[2, 3]), &t(&[4, 5]), None)));
        assert!(is_shape(d.linear(&t(&[2, 3]), &t(&[4, 3]), Some(&t(&[3])))));
        assert!(is_shape(d.matmul(&t(&[2, 3]), &t(&[4, 5]))));
        assert!(is_shape(d.matmul(&t(&[2, 2, 3]), &t(&[3, 3, 5]))));
        assert!(is_shape(d.matmul(&t(&[3]), &t(&[3, 5]))));
        assert!(is_shape(d.conv2d(
            &t(&[1, 2, 4, 4]),
            &t(&[3, 4, 3, 3]),
            None,
            Conv2dParams::new(1, 1)
        )));
        assert!(is_shape(d.conv2d(
            &t(&[1, 2, 2, 2]),
            &t(&[3, 2, 5, 5]),
            None,
            Conv2dParams::new(1, 0)
        )));
        assert!(is_shape(d.conv2d(
            &t(&[1, 2, 4, 4]),
            &t(&[3, 2, 3, 3]),
            None,
            Conv2dParams::new(0, 1)
        )));
        assert!(is_shape(d.group_norm(&t(&[1, 6, 2]), 4, None, None, 1e-5)));
        assert!(is_shape(d.layer_norm(
            &t(&[2, 3]),
            Some(&t(&[2])),
            None,
            1e-5
        )));
        assert!(is_shape(d.rms_norm(&t(&[]), None, 1e-5)));
        assert!(is_shape(d.binary(&t(&[2, 3]), &t(&[4]), BinaryOp::Add)));
        assert!(is_shape(d.reduce(&t(&[2, 3]), 2, ReduceOp::Sum)));
        assert!(is_shape(d.upsample_nearest2x(&t(&[2, 3]))));
        let (q, k) = (t(&[1, 2, 3, 4]), t(&[1, 2, 5, 4]));
        assert!(is_shape(d.attention(&q, &t(&[1, 2, 5, 3]), &k, None, 1.0)));
        assert!(is_shape(d.attention(&q, &k, &t(&[1, 2, 4, 4]), None, 1.0)));
        assert!(is_shape(d.attention(&q, &k, &k, Some(&t(&[3, 4])), 1.0)));
        assert!(is_shape(d.attention(
            &q,
            &k,
            &k,
            Some(&t(&[2, 2, 3, 5])),
            1.0
        )));
        assert!(is_shape(d.rope(
            &t(&[1, 1, 2, 3]),
            &t(&[2, 3]),
            &t(&[2, 3])
        )));
        assert!(is_shape(d.rope(
            &t(&[1, 1, 2, 4]),
            &t(&[3, 4]),
            &t(&[3, 4])
        )));
        assert!(is_shape(d.concat(&[&t(&[2, 3]), &t(&[3, 3])], 1)));
        assert!(is_shape(d.concat(&[], 0)));
        assert!(is_shape(d.narrow(&t(&[2, 3]), 1, 2, 2)));
        assert!(is_shape(d.narrow(&t(&[2, 3]), 1, usize::MAX, 2)));
        assert!(is_shape(d.permute(&t(&[2, 3]), &[0, 0])));
        assert!(is_shape(d.permute(&t(&[2, 3]), &[0, 1, 2])));
        assert!(is_shape(d.tensor_from_f32(&[2, 2], DType::F32, &[1.0; 3])));
        assert!(is_shape(d.cast(&t(&[2]), DType::Quantized)));
        // Absurd padding: an overflow is a shape error, a huge output a typed out-of-memory
        // (before any host scratch of that size is made).
        let (x, w) = (t(&[1, 2, 4, 4]), t(&[3, 2, 3, 3]));
        assert!(is_shape(d.conv2d(
            &x,
            &w,
            None,
            Conv2dParams::new(1, usize::MAX / 2)
        )));
        let err = d
            .conv2d(&x, &w, None, Conv2dParams::new(1, 1 << 20))
            .unwrap_err();
        assert!(matches!(err, CoreError::OutOfMemory { .. }), "{err}");
        // An id out of range.
        let err = d.embedding(&t(&[4, 2]), &[1, 4]).unwrap_err();
        assert!(
            matches!(&err, CoreError::Shape { message, .. } if message.contains("id 4")),
            "{err}"
        );

        // A tensor of another device, and a host tensor.
        let other = dev();
        let foreign = other
            .tensor_from_f32(&[2], DType::F32, &[1.0, 2.0])
            .unwrap();
        let err = d.unary(&foreign, UnaryOp::Relu).unwrap_err();
        assert!(matches!(err, CoreError::WrongDevice { .. }), "{err}");
        let err = d.binary(&t(&[2]), &foreign, BinaryOp::Add).unwrap_err();
        assert!(matches!(err, CoreError::WrongDevice { .. }), "{err}");
        let host = Tensor::from_f32(vec![2], DType::F32, &[1.0, 2.0]).unwrap();
        let err = d.affine(&host, 1.0, 0.0).unwrap_err();
        assert!(matches!(err, CoreError::WrongDevice { .. }), "{err}");
        assert!(d.to_f32_vec(&host).is_err());
    }

    #[test]
    fn outputs_are_accounted_and_freed() {
        let d = dev();
        let mut rng = SplitMix64::new(12);
        let x = put(&d, &[1, 2, 6, 6], DType::F32, &random(&mut rng, 72));
        let w = put(&d, &[3, 2, 3, 3], DType::F32, &random(&mut rng, 54));
        let before = d.memory_info().allocated;
        let y = d.conv2d(&x, &w, None, Conv2dParams::new(1, 1)).unwrap();
        assert_eq!(d.memory_info().allocated, before + y.nbytes() as u64);
        let outs = vec![
            d.upsample_nearest2x(&y).unwrap(),
            d.group_norm(&y, 3, None, None, 1e-6).unwrap(),
            d.unary(&y, UnaryOp::Silu).unwrap(),
            d.binary(&y, &x.reshape(&[2, 1, 6, 6]).unwrap(), BinaryOp::Add)
                .unwrap(),
            d.permute(&y, &[0, 2, 3, 1]).unwrap(),
            d.cast(&y, DType::BF16).unwrap(),
        ];
        assert!(d.memory_info().allocated > before);
        drop(outs);
        drop(y);
        assert_eq!(d.memory_info().allocated, before);
        // An op that fails for lack of memory leaves the accounting as it was.
        let tiny = HostDevice::with_capacity(64).unwrap();
        let t = tiny.tensor_from_f32(&[8], DType::F32, &[1.0; 8]).unwrap();
        let err = tiny
            .upsample_nearest2x(&t.reshape(&[1, 1, 2, 4]).unwrap())
            .unwrap_err();
        assert!(matches!(err, CoreError::OutOfMemory { .. }), "{err}");
        assert_eq!(tiny.memory_info().allocated, 32);
    }

    #[test]
    fn ops_run_after_copies_ordered_on_the_compute_stream() {
        let d = HostDevice::new(HostDeviceConfig {
            link_bytes_per_sec: Some(2_000.0), // 64 B take 32 ms
            ..HostDeviceConfig::default()
        })
        .unwrap();
        let copy = d.create_stream().unwrap();
        let src = d.alloc_pinned(64).unwrap();
        let values: Vec<f32> = (0..16).map(|i| i as f32).collect();
        let bytes = DType::F32.encode_f32(&values).unwrap();
        src.with_bytes_mut(|b| b.copy_from_slice(&bytes)).unwrap();
        let dst = d.alloc(64).unwrap();
        d.copy_h2d(&src.slice_all(), &dst.slice_all(), &copy)
            .unwrap();
        let done = d.record_event(&copy).unwrap();
        d.wait_event(&d.compute_stream(), &done).unwrap();
        let t = Tensor::new(vec![16], DType::F32, TensorStorage::Device(dst.slice_all())).unwrap();
        let y = d.affine(&t, 2.0, 1.0).unwrap();
        let want: Vec<f32> = values.iter().map(|v| v * 2.0 + 1.0).collect();
        assert_eq!(get(&d, &y), want);
    }

    // ---- linear_concat, unary_owned, exclusive device buffers -------------------------

    /// A tensor's encoded bytes (for bit-for-bit comparisons).
    fn bytes(d: &HostDevice, t: &Tensor) -> Vec<u8> {
        t.to_host_bytes(d, &d.compute_stream()).unwrap()
    }

    #[test]
    fn linear_concat_equals_linear_of_the_concatenation_bit_for_bit() {
        let d = dev();
        let mut rng = SplitMix64::new(13);
        let out = 11;
        for dtype in [DType::F32, DType::BF16] {
            for widths in [&[5usize, 8][..], &[3, 16, 7], &[0, 9], &[4, 0, 4]] {
                let inp: usize = widths.iter().sum();
                let parts: Vec<Tensor> = widths
                    .iter()
                    .map(|&wd| put(&d, &[2, 3, wd], dtype, &random(&mut rng, 6 * wd)))
                    .collect();
                let refs: Vec<&Tensor> = parts.iter().collect();
                let w = put(&d, &[out, inp], dtype, &random(&mut rng, out * inp));
                let b = put(&d, &[out], dtype, &random(&mut rng, out));
                let joined = d.concat(&refs, 2).unwrap();
                for bias in [None, Some(&b)] {
                    let what = format!("{dtype} widths {widths:?} bias {}", bias.is_some());
                    let got = d.linear_concat(&refs, &w, bias).unwrap();
                    let want = d.linear(&joined, &w, bias).unwrap();
                    assert_eq!(got.shape(), &[2, 3, out], "{what}");
                    assert_eq!(got.dtype(), dtype, "{what}");
                    assert_eq!(bytes(&d, &got), bytes(&d, &want), "{what}");
                }
            }
            // One part is linear itself.
            let x = put(&d, &[4, 6], dtype, &random(&mut rng, 24));
            let w = put(&d, &[out, 6], dtype, &random(&mut rng, out * 6));
            let b = put(&d, &[out], dtype, &random(&mut rng, out));
            for bias in [None, Some(&b)] {
                assert_eq!(
                    bytes(&d, &d.linear_concat(&[&x], &w, bias).unwrap()),
                    bytes(&d, &d.linear(&x, &w, bias).unwrap()),
                    "{dtype} one part"
                );
            }
        }
        // Parts of different dtypes: the concatenation converts into the first's dtype.
        let xa = put(&d, &[3, 4], DType::F32, &random(&mut rng, 12));
        let xb = put(&d, &[3, 5], DType::BF16, &random(&mut rng, 15));
        let w = put(&d, &[out, 9], DType::F32, &random(&mut rng, out * 9));
        let got = d.linear_concat(&[&xa, &xb], &w, None).unwrap();
        assert_eq!(got.dtype(), DType::F32);
        let joined = d.concat(&[&xa, &xb], 1).unwrap();
        assert_eq!(
            bytes(&d, &got),
            bytes(&d, &d.linear(&joined, &w, None).unwrap())
        );
    }

    #[test]
    fn linear_concat_refuses_bad_shapes() {
        let d = dev();
        let t = |shape: &[usize]| put(&d, shape, DType::F32, &vec![0.5; shape.iter().product()]);
        let refused = |xs: &[&Tensor], w: &Tensor, b: Option<&Tensor>| {
            matches!(d.linear_concat(xs, w, b), Err(CoreError::Shape { .. }))
        };
        let w = t(&[4, 7]);
        // Leading dims that differ, or ranks that differ.
        assert!(refused(&[&t(&[2, 3]), &t(&[3, 4])], &w, None));
        assert!(refused(&[&t(&[2, 2, 3]), &t(&[2, 3, 4])], &w, None));
        assert!(refused(&[&t(&[2, 3]), &t(&[1, 2, 4])], &w, None));
        // Widths not summing to `in` (short and long).
        assert!(refused(&[&t(&[2, 3]), &t(&[2, 3])], &w, None));
        assert!(refused(&[&t(&[2, 3]), &t(&[2, 5])], &w, None));
        assert!(refused(&[&t(&[2, 3]), &t(&[2, 2]), &t(&[2, 3])], &w, None));
        // A weight that is not a matrix, a bias of the wrong length, scalar parts.
        assert!(refused(&[&t(&[2, 3]), &t(&[2, 4])], &t(&[28]), None));
        assert!(refused(&[&t(&[2, 3]), &t(&[2, 4])], &w, Some(&t(&[7]))));
        assert!(refused(&[&t(&[]), &t(&[])], &w, None));
        // No parts at all.
        assert!(refused(&[], &w, None));
        // A good call still works, and the refusals leaked nothing.
        let before = d.memory_info().allocated;
        let y = d
            .linear_concat(&[&t(&[2, 3]), &t(&[2, 4])], &w, Some(&t(&[4])))
            .unwrap();
        assert_eq!(y.shape(), &[2, 4]);
        drop(y);
        assert_eq!(d.memory_info().allocated, before);
    }

    #[test]
    fn unary_owned_matches_unary_without_a_second_buffer() {
        let d = dev();
        let mut rng = SplitMix64::new(14);
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for op in [
                UnaryOp::Silu,
                UnaryOp::GeluTanh,
                UnaryOp::Neg,
                UnaryOp::Square,
            ] {
                let v = random(&mut rng, 3 * 1000);
                let x = put(&d, &[3, 1000], dtype, &v);
                let want = get(&d, &d.unary(&x, op).unwrap());
                // Exclusively held: the op's peak is the live bytes before the call.
                let live = d.memory_info().allocated;
                d.reset_peak();
                let y = d.unary_owned(x, op).unwrap();
                let m = d.memory_info();
                assert!(
                    m.peak_allocated <= live,
                    "{op:?} {dtype}: peak {} > live {live}",
                    m.peak_allocated
                );
                assert_eq!(m.allocated, live, "{op:?} {dtype}");
                assert_eq!((y.shape(), y.dtype()), (&[3, 1000][..], dtype));
                assert_eq!(get(&d, &y), want, "{op:?} {dtype}");
                drop(y);

                // With a clone held: a second buffer, the same values, the clone unchanged.
                let x = put(&d, &[3, 1000], dtype, &v);
                let original = get(&d, &x);
                let keep = x.clone();
                let live = d.memory_info().allocated;
                d.reset_peak();
                let y = d.unary_owned(x, op).unwrap();
                assert_eq!(
                    d.memory_info().peak_allocated,
                    live + y.nbytes() as u64,
                    "{op:?} {dtype}: a shared x needs an output of its own"
                );
                assert_eq!(get(&d, &y), want, "{op:?} {dtype} (clone held)");
                assert_eq!(
                    get(&d, &keep),
                    original,
                    "{op:?} {dtype}: the clone changed"
                );
            }
        }
        // Errors are those of unary.
        let host = Tensor::from_f32(vec![2], DType::F32, &[1.0, 2.0]).unwrap();
        let err = d.unary_owned(host, UnaryOp::Relu).unwrap_err();
        assert!(matches!(err, CoreError::WrongDevice { .. }), "{err}");
        assert_eq!(d.memory_info().allocated, 0);
    }

    #[test]
    fn exclusive_device_buffers_are_detected() {
        let d = dev();
        let mut x = put(&d, &[2, 4], DType::F32, &[1.0; 8]);
        assert!(x.has_exclusive_device_buffer(), "a fresh upload");
        let mut y = d.unary(&x, UnaryOp::Exp).unwrap();
        assert!(y.has_exclusive_device_buffer(), "a fresh op output");

        let mut c = y.clone();
        assert!(!y.has_exclusive_device_buffer(), "the original of a clone");
        assert!(!c.has_exclusive_device_buffer(), "a clone");
        drop(c);
        assert!(y.has_exclusive_device_buffer(), "after the clone is gone");

        let mut v = x.reshape(&[8]).unwrap();
        assert!(!x.has_exclusive_device_buffer(), "viewed by a reshape");
        assert!(!v.has_exclusive_device_buffer(), "a reshape view");
        drop(x);
        assert!(v.has_exclusive_device_buffer(), "the view alone");

        // A view of part of a buffer, even as its only handle.
        let buffer = d.alloc(64).unwrap();
        let mut part = Tensor::new(
            vec![4],
            DType::F32,
            TensorStorage::Device(buffer.slice(16, 16).unwrap()),
        )
        .unwrap();
        drop(buffer);
        assert!(!part.has_exclusive_device_buffer(), "part of a buffer");
        let buffer = d.alloc(16).unwrap();
        let mut whole = Tensor::new(
            vec![4],
            DType::F32,
            TensorStorage::Device(buffer.slice_all()),
        )
        .unwrap();
        assert!(
            !whole.has_exclusive_device_buffer(),
            "the buffer is still held"
        );
        drop(buffer);
        assert!(
            whole.has_exclusive_device_buffer(),
            "all of a buffer, alone"
        );

        let mut host = Tensor::from_f32(vec![2], DType::F32, &[1.0, 2.0]).unwrap();
        assert!(!host.has_exclusive_device_buffer(), "a host tensor");
    }
}
