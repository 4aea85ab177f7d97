//! GPU tests of GGUF dequantization (issue 37, `CudaDevice::dequantize_gguf`): every type of
//! `fixtures/gguf/types.gguf` (gguf-py's blocks) and larger random valid blocks of every type,
//! uploaded as stored bytes, give on the device exactly the host reference
//! `ddo_core::gguf::dequantize` (bit-exact against gguf-py): bit for bit in f32 (signed
//! zeros included), and that f32 rounded by `DType::encode_f32` in f16 and bf16; inputs at
//! every byte alignment inside a buffer; a tensor past 2^31 elements; the typed refusals.
//! With `DDO_BENCH=1`, a benchmark of 256M-element Q8_0 and Q4_K tensors into bf16 (GB/s
//! written; no timing assertion). Without a driver or a device each test prints
//! "skipped: no CUDA device" and passes (unless `DDO_REQUIRE_GPU=1`), like `tests/gpu.rs`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use ddo_core::gguf::{GgmlType, GgufFile, dequantize};
use ddo_core::rng::SplitMix64;
use ddo_core::{CoreError, DType, Device, HostBuffer, Ops, Tensor, TensorStorage};
use ddo_cuda::CudaDevice;

mod common;

/// Device 0, or `None` (after saying so) when there is no driver library or no device;
/// with `DDO_REQUIRE_GPU=1` a missing device fails the test instead.
fn gpu() -> Option<Arc<CudaDevice>> {
    common::open_gpu(false)
}

const OUT_DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// The committed fixtures: `DDO_FIXTURES` where the checkout moved (the GPU machine runs a
/// copy), else the workspace's own `fixtures/`.
fn types_gguf() -> Option<PathBuf> {
    let dir = std::env::var_os("DDO_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures"));
    let file = dir.join("gguf/types.gguf");
    if file.is_file() {
        Some(file)
    } else {
        common::missing(
            &format!("no GGUF fixture at {}", file.display()),
            "set DDO_FIXTURES to the checkout's fixtures/ folder",
        )
    }
}

/// `bytes` on `gpu`, `offset` bytes into a larger buffer, as a tensor of `dtype` and
/// `shape` (a quantized tensor is `[bytes.len()]`).
fn upload(gpu: &CudaDevice, bytes: &[u8], offset: usize, dtype: DType, shape: &[usize]) -> Tensor {
    let buffer = gpu.alloc(offset + bytes.len() + 16).unwrap();
    let slice = buffer.slice(offset, bytes.len()).unwrap();
    if !bytes.is_empty() {
        gpu.copy_h2d(
            &HostBuffer::pageable_from(bytes).slice_all(),
            &slice,
            &gpu.compute_stream(),
        )
        .unwrap();
    }
    Tensor::new(shape.to_vec(), dtype, TensorStorage::Device(slice)).unwrap()
}

/// Stored blocks as a quantized byte tensor at `offset` in its buffer.
fn upload_blocks(gpu: &CudaDevice, bytes: &[u8], offset: usize) -> Tensor {
    upload(gpu, bytes, offset, DType::Quantized, &[bytes.len()])
}

fn download(gpu: &CudaDevice, t: &Tensor) -> Vec<u8> {
    t.to_host_bytes(gpu, &gpu.compute_stream()).unwrap()
}

/// Fails with the first differing element (as bits) and the number that differ.
fn assert_same_bits(what: &str, dtype: DType, got: &[u8], want: &[u8]) {
    assert_eq!(got.len(), want.len(), "{what} {dtype}: byte length");
    if got == want {
        return;
    }
    let size = dtype.size_in_bytes();
    let bits = |b: &[u8]| {
        b.iter()
            .rev()
            .fold(0u64, |acc, &x| (acc << 8) | u64::from(x))
    };
    let differing: Vec<usize> = (0..got.len() / size)
        .filter(|&i| got[i * size..(i + 1) * size] != want[i * size..(i + 1) * size])
        .collect();
    let i = differing[0];
    let (g, w) = (
        bits(&got[i * size..(i + 1) * size]),
        bits(&want[i * size..(i + 1) * size]),
    );
    let values = dtype
        .decode_f32(&got[i * size..(i + 1) * size])
        .unwrap()
        .into_iter()
        .chain(dtype.decode_f32(&want[i * size..(i + 1) * size]).unwrap())
        .collect::<Vec<f32>>();
    panic!(
        "{what} into {dtype}: {} of {} elements differ; first at {i}: got {g:#x} ({}), want \
         {w:#x} ({})",
        differing.len(),
        got.len() / size,
        values[0],
        values[1]
    );
}

/// Dequantizes `blocks` (stored at `offset` in a device buffer) into every float dtype and
/// checks each result against the host reference, bit for bit.
fn check_all_dtypes(
    gpu: &CudaDevice,
    what: &str,
    ty: GgmlType,
    blocks: &[u8],
    shape: &[usize],
    offset: usize,
) {
    let elements: usize = shape.iter().product();
    let host = dequantize(ty, blocks, elements).unwrap();
    let x = upload_blocks(gpu, blocks, offset);
    for dtype in OUT_DTYPES {
        let out = gpu.dequantize_gguf(&x, ty, shape, dtype).unwrap();
        assert_eq!(out.shape(), shape, "{what}");
        assert_eq!(out.dtype(), dtype, "{what}");
        assert_same_bits(
            &format!("{what} ({ty}, offset {offset})"),
            dtype,
            &download(gpu, &out),
            &dtype.encode_f32(&host).unwrap(),
        );
    }
}

fn assert_clean(gpu: &CudaDevice) {
    gpu.synchronize().unwrap();
    assert_eq!(
        gpu.memory_info().allocated,
        0,
        "{:?}",
        gpu.allocator_stats()
    );
}

/// Byte offsets of the f16 scale fields in one block (tools/gen_gguf_fixtures.py's
/// `SCALE_FIELDS`; none for the plain types).
fn scale_fields(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::Q6_K => &[208],
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => &[],
    }
}

/// A random finite f16 (every exponent but the all-ones one: subnormals, and values up to
/// 65504); every 8th call gives +0.0 or -0.0.
fn finite_f16(rng: &mut SplitMix64, k: usize) -> u16 {
    let r = rng.next_u64();
    if k % 8 == 7 {
        return if r & 1 == 0 { 0 } else { 0x8000 };
    }
    let sign = ((r >> 8) & 1) as u16;
    let exponent = ((r >> 16) % 31) as u16;
    let mantissa = ((r >> 32) & 0x3ff) as u16;
    (sign << 15) | (exponent << 10) | mantissa
}

/// Makes every element or scale of `bytes` (whole blocks of `ty`) finite: each f16 scale
/// field a random finite f16 (see [`finite_f16`]); a plain type's NaN and infinity
/// patterns moved to finite values. Every other bit stays as it is.
fn make_valid(ty: GgmlType, bytes: &mut [u8], rng: &mut SplitMix64) {
    match ty {
        GgmlType::F32 => {
            for e in bytes.chunks_exact_mut(4) {
                // Exponent all ones: clear its lowest bit.
                if e[3] & 0x7f == 0x7f && e[2] & 0x80 != 0 {
                    e[2] &= 0x7f;
                }
            }
        }
        GgmlType::F16 => {
            for e in bytes.chunks_exact_mut(2) {
                if e[1] & 0x7c == 0x7c {
                    e[1] &= !0x04;
                }
            }
        }
        GgmlType::BF16 => {
            for e in bytes.chunks_exact_mut(2) {
                if e[1] & 0x7f == 0x7f && e[0] & 0x80 != 0 {
                    e[0] &= 0x7f;
                }
            }
        }
        _ => {
            for (k, block) in bytes.chunks_exact_mut(ty.block_bytes()).enumerate() {
                for &at in scale_fields(ty) {
                    let s = finite_f16(rng, k);
                    block[at..at + 2].copy_from_slice(&s.to_le_bytes());
                }
            }
        }
    }
}

/// `elements` elements of `ty` as random valid stored bytes.
fn random_blocks(ty: GgmlType, elements: usize, seed: u64) -> Vec<u8> {
    let mut rng = SplitMix64::new(seed);
    let mut bytes: Vec<u8> = (0..ty.bytes_for(elements).unwrap().div_ceil(8))
        .flat_map(|_| rng.next_u64().to_le_bytes())
        .collect();
    bytes.truncate(ty.bytes_for(elements).unwrap());
    make_valid(ty, &mut bytes, &mut rng);
    bytes
}

/// Every tensor of the fixture (one per type, gguf-py's random valid blocks, with zero
/// scales giving -0.0), as a quantized byte tensor, into f32 (bit for bit the host's), f16
/// and bf16 (the host's f32 rounded by `DType::encode_f32`); the plain types also from a
/// tensor of their own dtype.
#[test]
fn every_fixture_type_matches_the_host_bit_for_bit() {
    let (Some(gpu), Some(path)) = (gpu(), types_gguf()) else {
        return;
    };
    let file = GgufFile::open(&path).unwrap();
    let mut seen = Vec::new();
    for info in file.tensors() {
        let raw = file.raw(&info.name).unwrap();
        check_all_dtypes(&gpu, &info.name, info.ggml_type, raw, &info.shape, 0);
        if let Some(dtype) = match info.ggml_type {
            GgmlType::F32 => Some(DType::F32),
            GgmlType::F16 => Some(DType::F16),
            GgmlType::BF16 => Some(DType::BF16),
            _ => None,
        } {
            let x = upload(&gpu, raw, 0, dtype, &info.shape);
            let host = file.dequantize(&info.name).unwrap();
            for out_dtype in OUT_DTYPES {
                let out = gpu
                    .dequantize_gguf(&x, info.ggml_type, &info.shape, out_dtype)
                    .unwrap();
                assert_same_bits(
                    &format!("{} from a {dtype} tensor", info.name),
                    out_dtype,
                    &download(&gpu, &out),
                    &out_dtype.encode_f32(&host).unwrap(),
                );
            }
        }
        seen.push(info.ggml_type);
    }
    for ty in GgmlType::ALL {
        assert!(seen.contains(&ty), "the fixture has no {ty} tensor");
    }
    assert_clean(&gpu);
}

/// 64 rows of 4096 random valid elements of every type (every quant and packed sub-scale
/// bit pattern, f16 scales from subnormal to 65504 and signed zeros).
#[test]
fn random_valid_blocks_of_every_type_match_the_host() {
    let Some(gpu) = gpu() else { return };
    for (i, ty) in GgmlType::ALL.into_iter().enumerate() {
        let shape = [64, 4096];
        let blocks = random_blocks(ty, 64 * 4096, 1000 + i as u64);
        check_all_dtypes(&gpu, "random blocks", ty, &blocks, &shape, 0);
    }
    // Odd sizes: one block, and rows of one block each.
    for (i, ty) in GgmlType::ALL.into_iter().enumerate() {
        let b = ty.block_elements();
        for shape in [vec![b], vec![3, b], vec![2, 1, 5 * b]] {
            let elements: usize = shape.iter().product();
            let blocks = random_blocks(ty, elements, 2000 + i as u64);
            check_all_dtypes(&gpu, "small", ty, &blocks, &shape, 0);
        }
    }
    assert_clean(&gpu);
}

/// The stored blocks at every byte alignment inside their buffer (Q8_0's 34-byte blocks
/// are 2-byte aligned at best; a GGUF tensor may sit anywhere in a mapped range).
#[test]
fn blocks_at_any_byte_offset_are_read_from_there() {
    let Some(gpu) = gpu() else { return };
    for (i, ty) in GgmlType::ALL.into_iter().enumerate() {
        let shape = [4, 512];
        let blocks = random_blocks(ty, 4 * 512, 3000 + i as u64);
        for offset in [1, 2, 3, 4, 6, 8, 12, 16, 17, 24] {
            check_all_dtypes(&gpu, "offset", ty, &blocks, &shape, offset);
        }
    }
    assert_clean(&gpu);
}

/// A Q8_0 tensor of 2^31 + 4096 elements (its blocks past 2^31 bytes) into bf16: 64-bit
/// indices. The blocks repeat a pattern of 1009 random valid blocks (a prime, so rows see
/// different ones); the first and last rows and one in the middle are checked.
#[test]
fn a_tensor_past_two_to_the_31_elements_is_indexed_in_64_bits() {
    let Some(gpu) = gpu() else { return };
    let ty = GgmlType::Q8_0;
    let (rows, cols) = ((1usize << 31) / 4096 + 1, 4096usize);
    let pattern = random_blocks(ty, 1009 * 32, 4000);
    let total_blocks = rows * cols / 32;
    let bb = ty.block_bytes();
    let mut blocks = Vec::with_capacity(total_blocks * bb);
    while blocks.len() < total_blocks * bb {
        let take = (total_blocks * bb - blocks.len()).min(pattern.len());
        blocks.extend_from_slice(&pattern[..take]);
    }
    let x = upload_blocks(&gpu, &blocks, 0);
    let out = gpu
        .dequantize_gguf(&x, ty, &[rows, cols], DType::BF16)
        .unwrap();
    drop(x);
    for row in [0, rows / 2 + 7, rows - 2, rows - 1] {
        let got = download(&gpu, &gpu.narrow(&out, 0, row, 1).unwrap());
        let row_bytes = &blocks[row * cols / 32 * bb..(row + 1) * cols / 32 * bb];
        let host = dequantize(ty, row_bytes, cols).unwrap();
        assert_same_bits(
            &format!("row {row} of {rows}"),
            DType::BF16,
            &got,
            &DType::BF16.encode_f32(&host).unwrap(),
        );
    }
    drop(out);
    assert_clean(&gpu);
}

/// Wrong byte counts, rows that are not whole blocks, a non-float output dtype, bytes of
/// another dtype and host bytes are typed errors naming the op.
#[test]
fn bad_shapes_dtypes_and_operands_are_refused() {
    let Some(gpu) = gpu() else { return };
    let shape_err = |r: ddo_core::Result<Tensor>| match r {
        Err(e @ CoreError::Shape { .. }) => {
            assert!(e.to_string().contains("dequantize_gguf"), "{e}");
        }
        Err(e) => panic!("expected a shape error, got {e}"),
        Ok(t) => panic!(
            "expected a shape error, got a tensor of shape {:?}",
            t.shape()
        ),
    };
    let q4k = random_blocks(GgmlType::Q4_K, 512, 5000);
    let x = upload_blocks(&gpu, &q4k, 0);
    // The right call works.
    gpu.dequantize_gguf(&x, GgmlType::Q4_K, &[2, 256], DType::F32)
        .unwrap();
    // Too many and too few bytes for the shape.
    shape_err(gpu.dequantize_gguf(&x, GgmlType::Q4_K, &[256], DType::F32));
    shape_err(gpu.dequantize_gguf(&x, GgmlType::Q4_K, &[3, 256], DType::F32));
    // The same element count, rows not whole blocks.
    shape_err(gpu.dequantize_gguf(&x, GgmlType::Q4_K, &[4, 128], DType::F32));
    shape_err(gpu.dequantize_gguf(&x, GgmlType::Q4_K, &[], DType::F32));
    // Another type's byte count.
    shape_err(gpu.dequantize_gguf(&x, GgmlType::Q8_0, &[2, 256], DType::F32));
    // Outputs that are not float dtypes.
    for dtype in [DType::Quantized, DType::F8E4M3, DType::F8E5M2] {
        shape_err(gpu.dequantize_gguf(&x, GgmlType::Q4_K, &[2, 256], dtype));
    }
    // Blocks in a float tensor, and a float tensor of the wrong dtype for a plain type.
    let f = gpu.tensor_from_f32(&[4], DType::F32, &[1.0; 4]).unwrap();
    shape_err(gpu.dequantize_gguf(&f, GgmlType::Q8_0, &[32], DType::F32));
    shape_err(gpu.dequantize_gguf(&f, GgmlType::F16, &[8], DType::F32));
    // A plain type from its own dtype is fine.
    let back = gpu
        .dequantize_gguf(&f, GgmlType::F32, &[2, 2], DType::BF16)
        .unwrap();
    assert_eq!(gpu.to_f32_vec(&back).unwrap(), vec![1.0; 4]);
    // Host bytes.
    let host = Tensor::new(
        vec![q4k.len()],
        DType::Quantized,
        TensorStorage::Host(HostBuffer::pageable_from(&q4k).slice_all()),
    )
    .unwrap();
    assert!(matches!(
        gpu.dequantize_gguf(&host, GgmlType::Q4_K, &[2, 256], DType::F32),
        Err(CoreError::WrongDevice { .. })
    ));
    // No elements: an empty tensor, no launch.
    let empty = upload_blocks(&gpu, &[], 0);
    let out = gpu
        .dequantize_gguf(&empty, GgmlType::Q6_K, &[0, 256], DType::BF16)
        .unwrap();
    assert_eq!(out.shape(), &[0, 256]);
    drop((x, f, back, empty, out));
    assert_clean(&gpu);
}

/// `DDO_BENCH=1`: 256M elements of Q8_0 and of Q4_K into bf16, median of 5 after a warm-up;
/// prints GB/s of bf16 written and of bytes moved (read + written). No assertion on time.
#[test]
fn bench_dequantize_into_bf16() {
    if std::env::var_os("DDO_BENCH").is_none_or(|v| v != "1") {
        println!("skipped: set DDO_BENCH=1 to run the GGUF dequantization benchmark");
        return;
    }
    let Some(gpu) = gpu() else { return };
    let elements = 256usize << 20;
    let shape = [elements / 4096, 4096];
    for ty in [GgmlType::Q8_0, GgmlType::Q4_K] {
        // A pattern of 4099 random valid blocks, repeated.
        let pattern = random_blocks(ty, 4099 * ty.block_elements(), 6000);
        let total = ty.bytes_for(elements).unwrap();
        let mut blocks = Vec::with_capacity(total);
        while blocks.len() < total {
            let take = (total - blocks.len()).min(pattern.len());
            blocks.extend_from_slice(&pattern[..take]);
        }
        let x = upload_blocks(&gpu, &blocks, 0);
        drop(gpu.dequantize_gguf(&x, ty, &shape, DType::BF16).unwrap());
        gpu.synchronize().unwrap();
        let mut times = Vec::new();
        for _ in 0..5 {
            let start = Instant::now();
            let out = gpu.dequantize_gguf(&x, ty, &shape, DType::BF16).unwrap();
            gpu.synchronize().unwrap();
            times.push(start.elapsed().as_secs_f64());
            drop(out);
        }
        times.sort_by(f64::total_cmp);
        let median = times[2];
        let written = (elements * 2) as f64;
        println!(
            "gguf {ty} -> bf16, {elements} elements: median {:.3} ms, {:.0} GB/s written, \
             {:.0} GB/s read + written (times {times:?})",
            median * 1e3,
            written / median / 1e9,
            (written + total as f64) / median / 1e9
        );
        drop(x);
    }
    assert_clean(&gpu);
}
