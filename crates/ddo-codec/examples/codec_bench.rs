//! Encode and host-decode throughput of the codec on N(0, 0.02) bf16 weights, with the
//! compression ratio and the exponents' entropy.
//!
//! `cargo run --release -p ddo-codec --example codec_bench [TOTAL_MIB [UNIT_MIB]]`
//! (defaults: 256 MiB in 16 MiB units). Encoding and decoding run on every core, then on
//! one; every unit is checked to decode bit for bit.

use std::time::Instant;

use ddo_codec::{Encoder, Stats, decode_unit, decode_units_parallel, encode_unit_into};

/// N(0, 0.02) bf16 words (Box-Muller over SplitMix64), as little-endian bytes.
fn normal_bf16(words: usize, seed: u64) -> Vec<u8> {
    let mut state = seed;
    let mut next = move || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32
    };
    let mut out = Vec::with_capacity(2 * words);
    while out.len() < 2 * words {
        let (u, v) = (next().max(1e-7), next());
        let r = 0.02 * (-2.0 * u.ln()).sqrt();
        let angle = std::f32::consts::TAU * v;
        for x in [r * angle.cos(), r * angle.sin()] {
            let b = x.to_bits();
            let w = ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16;
            out.extend_from_slice(&w.to_le_bytes());
        }
    }
    out.truncate(2 * words);
    out
}

fn gbps(bytes: usize, seconds: f64) -> f64 {
    bytes as f64 / seconds / 1e9
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let total_mib: usize = args.next().map_or(Ok(256), |a| a.parse())?;
    let unit_mib: usize = args.next().map_or(Ok(16), |a| a.parse())?;
    let unit_bytes = unit_mib << 20;
    let words = normal_bf16(total_mib << 19, 42);
    let encoder = Encoder::new();
    println!(
        "{total_mib} MiB of N(0, 0.02) bf16 in {unit_mib} MiB units, {} thread(s)",
        encoder.threads()
    );

    // Warm up (page faults of the output buffers), then time.
    drop(encoder.encode_split(&words[..unit_bytes.min(words.len())], unit_bytes)?);
    let t = Instant::now();
    let units = encoder.encode_split(&words, unit_bytes)?;
    let enc_all = t.elapsed().as_secs_f64();
    let stats = Stats::total(units.iter().map(|u| u.stats()));

    let t = Instant::now();
    let one = Encoder::with_threads(1).encode_split(&words[..unit_bytes], unit_bytes)?;
    let enc_one = t.elapsed().as_secs_f64();
    drop(one);

    // As a streaming engine would: each thread encodes its units into one reused buffer
    // (`encode_unit_into`), so no unit pays for fresh pages.
    let chunks: Vec<&[u8]> = words.chunks(unit_bytes).collect();
    let threads = encoder.threads();
    let mut reused: Vec<Vec<u8>> = (0..threads).map(|_| Vec::new()).collect();
    for buf in &mut reused {
        encode_unit_into(chunks[0], buf)?;
    }
    let t = Instant::now();
    let results: Vec<Result<(), String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = reused
            .iter_mut()
            .enumerate()
            .map(|(i, buf)| {
                let chunks = &chunks;
                scope.spawn(move || {
                    for unit in chunks.iter().skip(i).step_by(threads) {
                        encode_unit_into(unit, buf).map_err(|e| e.to_string())?;
                    }
                    Ok(())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("an encoder thread panicked".into()))
            })
            .collect()
    });
    for r in results {
        r?;
    }
    let enc_reused = t.elapsed().as_secs_f64();

    let mut out = vec![0u8; words.len()];
    let t = Instant::now();
    {
        let mut pairs: Vec<(&[u8], &mut [u8])> = units
            .iter()
            .map(|u| u.bytes())
            .zip(out.chunks_mut(unit_bytes))
            .collect();
        decode_units_parallel(&mut pairs, encoder.threads())?;
    }
    let dec_all = t.elapsed().as_secs_f64();
    if out != words {
        return Err("the decoded weights differ from the originals".into());
    }
    let t = Instant::now();
    decode_unit(units[0].bytes(), &mut out[..unit_bytes])?;
    let dec_one = t.elapsed().as_secs_f64();

    println!("{stats}");
    println!(
        "ratio {:.4}, exponent entropy {:.3} bits/word, coded exponents {:.3} bits/word",
        stats.ratio(),
        stats.exponent_entropy(),
        stats.exponent_bits()
    );
    println!(
        "encode: {:.2} GB/s on {} thread(s), {:.2} GB/s on one (input bytes)",
        gbps(words.len(), enc_all),
        encoder.threads(),
        gbps(unit_bytes, enc_one)
    );
    println!(
        "encode into reused buffers: {:.2} GB/s on {threads} thread(s)",
        gbps(words.len(), enc_reused)
    );
    println!(
        "host decode: {:.2} GB/s on {} thread(s), {:.2} GB/s on one (output bytes), bit-identical",
        gbps(words.len(), dec_all),
        encoder.threads(),
        gbps(unit_bytes, dec_one)
    );
    Ok(())
}
