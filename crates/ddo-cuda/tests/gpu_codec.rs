//! The GPU decoder of ddo-codec's units (`ddo_cuda::codec`, `kernels/codec.cu`) against the
//! host encoder: N(0, 0.02) weights, edge lengths, all-equal words, every 16-bit pattern
//! (raw), every exponent sprinkled into weights and rare exponents (12-bit codes) decode
//! bit for bit on a copy stream, with and without checksum verification, at offsets into larger buffers;
//! corrupt units are flagged in the status, never reported clean; misaligned or short
//! buffers are refused before launch. A throughput measurement decodes 256 MiB of
//! N(0, 0.02) bf16 in 16 MiB units and prints the decoded GB/s (asserting only that the
//! output is right). Without a driver or a device each test prints "skipped: no CUDA
//! device" and passes (unless `DDO_REQUIRE_GPU=1`), like `tests/gpu.rs`.

mod common;

use std::sync::Arc;

use ddo_codec::{CHUNK_WORDS, EncodedUnit, Encoder, Mode, UnitHeader, encode_unit};
use ddo_core::device::{download, upload};
use ddo_core::rng::SplitMix64;
use ddo_core::{Device, DeviceBuffer, HostBuffer, Stream};
use ddo_cuda::CudaDevice;
use ddo_cuda::codec::{self, DecodeStatus, SCRATCH_BYTES};

fn gpu() -> Option<Arc<CudaDevice>> {
    common::open_gpu(false)
}

/// `f` as bf16 bits, rounded to nearest even.
fn bf16(f: f32) -> u16 {
    let u = f.to_bits();
    ((u + 0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

/// `n` N(0, 0.02) bf16 words (Box-Muller), as bytes.
fn normal_words(n: usize, seed: u64) -> Vec<u8> {
    let mut r = SplitMix64::new(seed);
    let mut uniform = move || ((r.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    (0..n)
        .flat_map(|_| {
            let (u, v) = (uniform(), uniform());
            let x = 0.02 * (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos();
            bf16(x as f32).to_le_bytes()
        })
        .collect()
}

fn to_bytes(words: &[u16]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

/// The cases every decode test runs: (name, words).
fn cases() -> Vec<(&'static str, Vec<u8>)> {
    let normal = normal_words(3 * CHUNK_WORDS + 333, 1);
    let mut sprinkled = normal_words(1 << 20, 2);
    for (i, v) in (0..=u16::MAX).enumerate() {
        sprinkled[32 * i..32 * i + 2].copy_from_slice(&v.to_le_bytes());
    }
    // Every exponent a few times among 2M weights: 12-bit codes.
    let mut rare = normal_words(1 << 21, 8);
    for i in 0..1024 {
        let v = (((i % 256) << 7) | (i % 128)) as u16;
        rare[4096 * i..4096 * i + 2].copy_from_slice(&v.to_le_bytes());
    }
    let mut r = SplitMix64::new(3);
    let random: Vec<u8> = (0..20_000).map(|_| r.next_u64() as u8).collect();
    let mut out = vec![
        ("N(0, 0.02), 3 chunks + 333", normal.clone()),
        (
            "every 16-bit pattern (raw)",
            to_bytes(&(0..=u16::MAX).collect::<Vec<_>>()),
        ),
        ("every exponent in weights", sprinkled),
        ("rare exponents, 12-bit codes", rare),
        ("random bytes (raw)", random),
        (
            "all-equal 0x3c00",
            to_bytes(&vec![0x3c00; 2 * CHUNK_WORDS + 5]),
        ),
        ("all negative zero", to_bytes(&vec![0x8000; CHUNK_WORDS])),
    ];
    for n in [
        1,
        2,
        5,
        127,
        129,
        1000,
        CHUNK_WORDS - 1,
        CHUNK_WORDS,
        CHUNK_WORDS + 1,
        2 * CHUNK_WORDS - 1,
        2 * CHUNK_WORDS + 1,
    ] {
        out.push(("N(0, 0.02), edge length", normal[..2 * n].to_vec()));
    }
    out
}

/// A device copy of `bytes` at byte `offset` of a larger buffer.
fn upload_at(dev: &CudaDevice, bytes: &[u8], offset: usize, stream: &Stream) -> DeviceBuffer {
    let buf = dev.alloc(offset + bytes.len() + 64).unwrap();
    let src = HostBuffer::pageable_from(bytes);
    dev.copy_h2d(
        &src.slice_all(),
        &buf.slice(offset, bytes.len()).unwrap(),
        stream,
    )
    .unwrap();
    buf
}

/// Zeroed scratch for one stream's decodes.
fn scratch(dev: &CudaDevice, stream: &Stream) -> DeviceBuffer {
    let s = dev.alloc(SCRATCH_BYTES).unwrap();
    codec::clear_scratch(dev, &s.slice_all(), stream).unwrap();
    s
}

/// Decodes `unit` on `stream` (at `src_off` in its buffer, into `dst_off` of the output)
/// and returns the decoded bytes and the status.
fn gpu_decode(
    dev: &CudaDevice,
    unit: &[u8],
    header: &UnitHeader,
    (src_off, dst_off): (usize, usize),
    stream: &Stream,
    verify: bool,
) -> (Vec<u8>, DecodeStatus) {
    let src = upload_at(dev, unit, src_off, stream);
    let n = header.decoded_len() as usize;
    let dst = dev.alloc(dst_off + n + 8).unwrap();
    let s = scratch(dev, stream);
    codec::decode_unit(
        dev,
        header,
        &src.slice(src_off, unit.len()).unwrap(),
        &dst.slice(dst_off, n).unwrap(),
        &s.slice_all(),
        stream,
        verify,
    )
    .unwrap();
    let status = codec::read_status(dev, &s.slice_all(), stream).unwrap();
    let out = download(dev, &dst.slice(dst_off, n).unwrap(), stream).unwrap();
    (out, status)
}

#[test]
fn units_decode_bit_for_bit_on_a_copy_stream() {
    let Some(dev) = gpu() else { return };
    let stream = dev.create_stream().unwrap();
    for (name, words) in cases() {
        let unit = encode_unit(&words).unwrap();
        for (verify, offsets) in [(true, (0, 0)), (false, (0, 0)), (true, (4096 + 16, 8))] {
            let (out, status) =
                gpu_decode(&dev, unit.bytes(), unit.header(), offsets, &stream, verify);
            assert!(
                out == words,
                "{name} ({} words, {:?}, verify {verify}, offsets {offsets:?}): the GPU decode differs",
                words.len() / 2,
                unit.header().mode()
            );
            assert!(status.is_ok(), "{name}: status {status:?}");
        }
    }
    // The cases cover both modes and the longest codes.
    let modes: Vec<Mode> = cases()
        .iter()
        .map(|(_, w)| encode_unit(w).unwrap().header().mode())
        .collect();
    assert!(modes.contains(&Mode::Raw) && modes.contains(&Mode::Huffman));
    let longest = cases()
        .iter()
        .map(|(_, w)| encode_unit(w).unwrap().header().max_code_len())
        .max();
    assert_eq!(longest, Some(ddo_codec::MAX_CODE_LEN));
}

#[test]
fn corrupt_units_are_flagged_and_the_status_clears() {
    let Some(dev) = gpu() else { return };
    let stream = dev.create_stream().unwrap();
    let words = normal_words(2 * CHUNK_WORDS + 100, 4);
    let unit = encode_unit(&words).unwrap();
    let h = unit.header();
    assert_eq!(h.mode(), Mode::Huffman);
    // The GPU trusts the host-validated header; the bytes on the device are damaged: a
    // mantissa byte (only the checksum sees it), a stream byte (the stream or the
    // checksum), the last stream byte (padding or code bits).
    let spots = [
        h.mantissa_offset() as usize + 5000,
        h.stream_offset() as usize + 10,
        (h.stream_offset() + 2 * h.stream_words()) as usize - 1,
    ];
    for at in spots {
        let mut bad = unit.bytes().to_vec();
        bad[at] ^= 0x10;
        let (out, status) = gpu_decode(&dev, &bad, h, (0, 0), &stream, true);
        assert!(
            !status.is_ok(),
            "byte {at}: a corrupt unit decoded with a clean status (output {})",
            if out == words { "intact" } else { "wrong" }
        );
    }
    let (_, status) = gpu_decode(
        &dev,
        &{
            let mut bad = unit.bytes().to_vec();
            bad[spots[0]] ^= 1;
            bad
        },
        h,
        (0, 0),
        &stream,
        true,
    );
    assert!(status.bad_checksum(), "{status:?}");
    // A raw unit's damage is the checksum's to see.
    let mut r = SplitMix64::new(5);
    let random: Vec<u8> = (0..10_000).map(|_| r.next_u64() as u8).collect();
    let raw = encode_unit(&random).unwrap();
    assert_eq!(raw.header().mode(), Mode::Raw);
    let mut bad = raw.bytes().to_vec();
    bad[raw.header().mantissa_offset() as usize + 77] ^= 0x80;
    let (_, status) = gpu_decode(&dev, &bad, raw.header(), (0, 0), &stream, true);
    assert!(status.bad_checksum(), "{status:?}");
    // The status is sticky until cleared.
    let src = upload_at(&dev, &bad, 0, &stream);
    let dst = dev.alloc(random.len()).unwrap();
    let s = scratch(&dev, &stream);
    let decode = |verify| {
        codec::decode_unit(
            &dev,
            raw.header(),
            &src.slice_all(),
            &dst.slice_all(),
            &s.slice_all(),
            &stream,
            verify,
        )
        .unwrap()
    };
    decode(true);
    assert!(
        !codec::read_status(&dev, &s.slice_all(), &stream)
            .unwrap()
            .is_ok()
    );
    codec::clear_scratch(&dev, &s.slice_all(), &stream).unwrap();
    assert!(
        codec::read_status(&dev, &s.slice_all(), &stream)
            .unwrap()
            .is_ok()
    );
    decode(false);
    assert!(
        codec::read_status(&dev, &s.slice_all(), &stream)
            .unwrap()
            .is_ok()
    );
}

#[test]
fn misaligned_and_short_buffers_are_refused_before_launch() {
    let Some(dev) = gpu() else { return };
    let stream = dev.compute_stream();
    let words = normal_words(5000, 6);
    let unit = encode_unit(&words).unwrap();
    let h = unit.header();
    let src = upload_at(&dev, unit.bytes(), 8, &stream);
    let dst = dev.alloc(words.len() + 16).unwrap();
    let s = scratch(&dev, &stream);
    let n = words.len();
    let try_decode =
        |src: ddo_core::DeviceSlice, dst: ddo_core::DeviceSlice, sc: ddo_core::DeviceSlice| {
            codec::decode_unit(&dev, h, &src, &dst, &sc, &stream, true)
        };
    let err = try_decode(
        src.slice(8, unit.len()).unwrap(),
        dst.slice(0, n).unwrap(),
        s.slice_all(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("16-byte aligned"), "{err}");
    let good_src = upload_at(&dev, unit.bytes(), 0, &stream);
    let err = try_decode(
        good_src.slice(0, unit.len() - 16).unwrap(),
        dst.slice(0, n).unwrap(),
        s.slice_all(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("slice holds"), "{err}");
    let err = try_decode(
        good_src.slice_all(),
        dst.slice(0, n - 2).unwrap(),
        s.slice_all(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("output holds"), "{err}");
    let err = try_decode(
        good_src.slice_all(),
        dst.slice(2, n).unwrap(),
        s.slice_all(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("8-byte aligned"), "{err}");
    let err = try_decode(
        good_src.slice_all(),
        dst.slice(0, n).unwrap(),
        s.slice(0, 8).unwrap(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("scratch"), "{err}");
    // The refusals launched nothing: the good decode is clean.
    try_decode(
        good_src.slice_all(),
        dst.slice(0, n).unwrap(),
        s.slice_all(),
    )
    .unwrap();
    assert!(
        codec::read_status(&dev, &s.slice_all(), &stream)
            .unwrap()
            .is_ok()
    );
    assert!(download(&*dev, &dst.slice(0, n).unwrap(), &stream).unwrap() == words);
    // Another device's handles are refused too (a host buffer is not a CUDA allocation).
    let host = ddo_host::HostDevice::new(ddo_host::HostDeviceConfig::default()).unwrap();
    let foreign = upload(&*host, unit.bytes(), &host.compute_stream()).unwrap();
    assert!(try_decode(foreign.slice_all(), dst.slice(0, n).unwrap(), s.slice_all()).is_err());
}

/// Decoded GB/s of 256 MiB of N(0, 0.02) bf16 in 16 MiB units, each unit decoded from its
/// own place in one device buffer into its place in the output, on a copy stream, timed
/// with device events over several passes; printed for verify off and on.
#[test]
fn decode_throughput_on_256_mib() {
    let Some(dev) = gpu() else { return };
    const TOTAL: usize = 256 << 20;
    const UNIT: usize = 16 << 20;
    let words = normal_words(TOTAL / 2, 7);
    let t = std::time::Instant::now();
    let units: Vec<EncodedUnit> = Encoder::new().encode_split(&words, UNIT).unwrap();
    let encode_s = t.elapsed().as_secs_f64();
    let stats = ddo_codec::Stats::total(units.iter().map(|u| u.stats()));
    println!(
        "host encode of 256 MiB: {:.2} GB/s on {} thread(s); {stats}",
        TOTAL as f64 / encode_s / 1e9,
        Encoder::new().threads()
    );
    // Units back to back in one buffer, each 256-byte aligned.
    let mut offsets = Vec::new();
    let mut at = 0usize;
    for u in &units {
        offsets.push(at);
        at += u.len().div_ceil(256) * 256;
    }
    let stream = dev.create_stream().unwrap();
    let src = dev.alloc(at).unwrap();
    for (u, &o) in units.iter().zip(&offsets) {
        let host = HostBuffer::pageable_from(u.bytes());
        dev.copy_h2d(&host.slice_all(), &src.slice(o, u.len()).unwrap(), &stream)
            .unwrap();
    }
    let dst = dev.alloc(TOTAL).unwrap();
    let s = scratch(&dev, &stream);
    let pass = |verify: bool| {
        for (i, (u, &o)) in units.iter().zip(&offsets).enumerate() {
            codec::decode_unit(
                &dev,
                u.header(),
                &src.slice(o, u.len()).unwrap(),
                &dst.slice(i * UNIT, u.header().decoded_len() as usize)
                    .unwrap(),
                &s.slice_all(),
                &stream,
                verify,
            )
            .unwrap();
        }
    };
    for verify in [false, true] {
        pass(verify); // warm-up: the kernel's module loads
        dev.synchronize_stream(&stream).unwrap();
        const PASSES: usize = 10;
        let start = dev.record_timed_event(&stream).unwrap();
        for _ in 0..PASSES {
            pass(verify);
        }
        let end = dev.record_timed_event(&stream).unwrap();
        dev.synchronize_event(&end).unwrap();
        let ns = dev
            .event_elapsed_ns(&start, &end)
            .unwrap()
            .unwrap_or(0)
            .max(1);
        println!(
            "GPU decode, verify {verify}: {:.1} GB/s of output ({} units of {} MiB, {PASSES} passes, {:.1} us per unit)",
            (PASSES * TOTAL) as f64 / ns as f64,
            units.len(),
            UNIT >> 20,
            ns as f64 / 1e3 / (PASSES * units.len()) as f64
        );
        assert!(
            codec::read_status(&dev, &s.slice_all(), &stream)
                .unwrap()
                .is_ok()
        );
    }
    let out = download(&*dev, &dst.slice_all(), &stream).unwrap();
    assert!(out == words, "the 256 MiB decode differs from the original");
}

/// A safetensors file of bf16 `tensors` (name, shape, bytes) at `path`.
fn write_bf16_safetensors(path: &std::path::Path, tensors: &[(&str, [usize; 2], Vec<u8>)]) {
    let mut header = String::from("{");
    let mut data = Vec::new();
    for (i, (name, shape, bytes)) in tensors.iter().enumerate() {
        let start = data.len();
        data.extend_from_slice(bytes);
        if i > 0 {
            header.push(',');
        }
        header.push_str(&format!(
            "\"{name}\":{{\"dtype\":\"BF16\",\"shape\":[{},{}],\"data_offsets\":[{start},{}]}}",
            shape[0],
            shape[1],
            data.len()
        ));
    }
    header.push('}');
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(&data);
    std::fs::write(path, out).unwrap();
}

/// Issue 35: a coded checkpoint tensor (`ddo convert --compress lossless`) copied to the
/// device gives its weights bit for bit, on both of CUDA's paths (a large one uploaded
/// coded and decoded on the device, a small one decoded on the host into an upload
/// buffer); a unit corrupted in the file is the copy's typed error naming the tensor.
#[test]
fn coded_checkpoint_tensors_upload_bit_for_bit_and_corruption_is_an_error() {
    let Some(dev) = gpu() else { return };
    let dir = std::env::temp_dir().join(format!("ddo-gpu-coded-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let big = normal_words(2048 * 4608, 21);
    let small = normal_words(256 * 512, 22);
    let raw = dir.join("raw.safetensors");
    write_bf16_safetensors(
        &raw,
        &[
            ("big.weight", [2048, 4608], big.clone()),
            ("small.weight", [256, 512], small.clone()),
        ],
    );
    let coded = dir.join("coded.safetensors");
    let mut file = std::fs::File::create_new(&coded).unwrap();
    ddo_core::coded_file::write_coded_safetensors(&raw, &mut file, &coded).unwrap();
    drop(file);
    let stream = dev.create_stream().unwrap();
    let copy = |path: &std::path::Path, name: &str| -> ddo_core::Result<Vec<u8>> {
        let ckpt = ddo_core::Checkpoint::open(path)?;
        assert!(ckpt.tensor(name)?.coded.is_some(), "{name} is not coded");
        let host = ckpt.host_buffer(name)?;
        let dst = dev.alloc(host.len())?;
        dev.copy_h2d(&host.slice_all(), &dst.slice_all(), &stream)?;
        download(&*dev, &dst.slice_all(), &stream)
    };
    assert!(
        copy(&coded, "big.weight").unwrap() == big,
        "the large tensor differs"
    );
    assert!(
        copy(&coded, "small.weight").unwrap() == small,
        "the small tensor differs"
    );
    // A byte of the large unit's sign+mantissa section flipped: only the checksum tells.
    let ckpt = ddo_core::Checkpoint::open(&coded).unwrap();
    let t = ckpt.tensor("big.weight").unwrap().clone();
    drop(ckpt);
    let mut bytes = std::fs::read(&coded).unwrap();
    let at = t.offset + t.coded.as_ref().unwrap().mantissa_offset() as usize + 12345;
    bytes[at] ^= 0x08;
    let bad = dir.join("bad.safetensors");
    std::fs::write(&bad, &bytes).unwrap();
    let err = copy(&bad, "big.weight").unwrap_err().to_string();
    assert!(
        err.contains("big.weight") && err.contains("bad.safetensors"),
        "{err}"
    );
    // The device is still usable after the refusal.
    assert!(copy(&coded, "big.weight").unwrap() == big);
    let _ = std::fs::remove_dir_all(&dir);
}
