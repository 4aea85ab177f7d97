//! Qwen-Image's weightless tables, computed on the host: the sinusoidal timestep projection
//! ([`timestep_embedding`]), the MSRoPE positions ([`image_positions`], [`text_positions`])
//! and rotary tables ([`rope_tables`]), and the additive joint-attention mask
//! ([`attention_mask`]).

/// Positions Diffusers' `QwenEmbedRope` has tables for on each side of 0: `pos_freqs` covers
/// `0..4096` and `neg_freqs` `-4096..0`. Inputs needing a position outside are refused
/// (Diffusers fails on them with a shape mismatch).
pub const ROPE_TABLE_POSITIONS: i64 = 4096;

/// `Timesteps(dim, flip_sin_to_cos=True, downscale_freq_shift=0, scale)(t)` as Diffusers'
/// `get_timestep_embedding` computes it: `[cos(scale·(t·f)), sin(scale·(t·f))]` with
/// `f_i = exp(-ln(10000)·i/(dim/2))`, in f32 (each transcendental correctly rounded). The
/// scale multiplies the angle *after* the product with the frequency — Qwen-Image's
/// `time_proj` has `scale=1000` and gets `t / 1000` — which rounds differently from Flux's
/// `timestep * 1000` first. Row-major `[timesteps.len(), dim]`.
pub fn timestep_embedding(timesteps: &[f32], dim: usize, scale: f32) -> Vec<f32> {
    let half = dim / 2;
    let neg_log = -(10000f64.ln()) as f32;
    let freqs: Vec<f32> = (0..half)
        .map(|i| {
            let exponent = (neg_log * i as f32) / half as f32;
            (exponent as f64).exp() as f32
        })
        .collect();
    let mut out = Vec::with_capacity(timesteps.len() * dim);
    for &t in timesteps {
        let args: Vec<f32> = freqs.iter().map(|&f| scale * (t * f)).collect();
        out.extend(args.iter().map(|&a| (a as f64).cos() as f32));
        out.extend(args.iter().map(|&a| (a as f64).sin() as f32));
        if !dim.is_multiple_of(2) {
            out.push(0.0);
        }
    }
    out
}

/// `-(n - n/2) ..= n/2 - 1`: the centred positions of `n` rows or columns (`scale_rope=True`).
fn centred(n: usize) -> impl Iterator<Item = i64> {
    let n = n as i64;
    -(n - n / 2)..n / 2
}

/// The (frame, row, column) positions of the image tokens of one sample, in token order:
/// image `k` (from 0) of `img_shapes` has frames at `k ..`, its rows and columns centred
/// around 0 (`QwenEmbedRope._compute_video_freqs` with `scale_rope=True`), tokens
/// frame-major, then row, then column.
pub fn image_positions(img_shapes: &[[usize; 3]]) -> Vec<[i64; 3]> {
    let mut out = Vec::new();
    for (k, &[frames, rows, cols]) in img_shapes.iter().enumerate() {
        for f in 0..frames {
            for r in centred(rows) {
                for c in centred(cols) {
                    out.push([(k + f) as i64, r, c]);
                }
            }
        }
    }
    out
}

/// The positions of `txt` text tokens after the images of `img_shapes`: token `i` at
/// `m + i` on all three axes, with `m = max(rows / 2, cols / 2)` over the images (0 without
/// images), as `QwenEmbedRope.forward` slices `pos_freqs[m : m + txt]`.
pub fn text_positions(img_shapes: &[[usize; 3]], txt: usize) -> Vec<[i64; 3]> {
    let m = img_shapes
        .iter()
        .map(|&[_, rows, cols]| (rows / 2).max(cols / 2))
        .max()
        .unwrap_or(0) as i64;
    (0..txt as i64).map(|i| [m + i; 3]).collect()
}

/// The rotary tables of `positions` for axes of `axes_dims` widths, as `QwenEmbedRope`
/// builds its complex frequencies (`rope_params`, all in f32: `f_j = 1 / theta^(2j / d)`,
/// angle `position · f_j`, then `cos`/`sin` of it), laid out for
/// [`Ops::rope`](ddo_core::Ops::rope): each pair's value repeated for its two channels
/// (complex multiplication of interleaved pairs is that rotation). Returns `(cos, sin)`,
/// each row-major `[positions.len(), sum(axes_dims)]`.
pub fn rope_tables(
    positions: &[[i64; 3]],
    axes_dims: &[usize],
    theta: f32,
) -> (Vec<f32>, Vec<f32>) {
    let width: usize = axes_dims.iter().sum();
    let freqs: Vec<Vec<f32>> = axes_dims
        .iter()
        .map(|&d| {
            (0..d / 2)
                .map(|j| {
                    let exponent = (2 * j) as f32 / d as f32;
                    1.0 / ((theta as f64).powf(exponent as f64) as f32)
                })
                .collect()
        })
        .collect();
    let mut cos = Vec::with_capacity(positions.len() * width);
    let mut sin = Vec::with_capacity(positions.len() * width);
    for p in positions {
        for (axis, fs) in freqs.iter().enumerate() {
            let pos = p.get(axis).copied().unwrap_or(0) as f32;
            for &f in fs {
                let angle = (pos * f) as f64;
                let (c, s) = (angle.cos() as f32, angle.sin() as f32);
                cos.extend([c, c]);
                sin.extend([s, s]);
            }
        }
    }
    (cos, sin)
}

/// The additive key mask of the joint attention over `[text, image]`, `[batch, 1, 1, txt +
/// img]` row-major: `0` for a key attended to, `-inf` for a padding text token
/// (`text_mask[b · txt + i] == false`); image keys are always attended to. Diffusers builds
/// the boolean mask `cat([encoder_hidden_states_mask, ones(img)])[:, None, None, :]`, which
/// scaled dot-product attention applies as this.
pub fn attention_mask(text_mask: &[bool], batch: usize, txt: usize, img: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(batch * (txt + img));
    for b in 0..batch {
        out.extend((0..txt).map(|i| match text_mask.get(b * txt + i) {
            Some(false) => f32::NEG_INFINITY,
            _ => 0.0,
        }));
        out.extend(std::iter::repeat_n(0.0, img));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_are_centred_and_text_follows() {
        let p = image_positions(&[[1, 3, 4]]);
        assert_eq!(p.len(), 12);
        assert_eq!(p[0], [0, -2, -2]);
        assert_eq!(p[11], [0, 0, 1]);
        let rows: Vec<i64> = p.iter().step_by(4).map(|q| q[1]).collect();
        assert_eq!(rows, [-2, -1, 0]);
        let two = image_positions(&[[1, 2, 2], [2, 1, 1]]);
        assert_eq!(two[4..], [[1, -1, -1], [2, -1, -1]]);
        assert_eq!(text_positions(&[[1, 3, 4], [1, 6, 2]], 2), [[3; 3], [4; 3]]);
        assert_eq!(text_positions(&[], 1), [[0; 3]]);
    }

    #[test]
    fn the_mask_hides_padding_keys_only() {
        let m = attention_mask(&[true, true, true, false], 2, 2, 1);
        assert_eq!(m[..3], [0.0, 0.0, 0.0]);
        assert_eq!(m[3], 0.0);
        assert_eq!(m[4], f32::NEG_INFINITY);
        assert_eq!(m[5], 0.0);
    }
}
