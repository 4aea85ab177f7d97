//! The transformer's weightless tables, computed on the host: the sinusoidal timestep
//! projection ([`timestep_embedding`]) and the rotary tables ([`rope_tables`]).

/// Diffusers' `get_timestep_embedding(t, dim, flip_sin_to_cos=True, downscale_freq_shift=0,
/// scale=1, max_period=10000)`: `[cos(t·f), sin(t·f)]` with `f_i = exp(-ln(10000)·i/(dim/2))`,
/// computed in f32 as PyTorch does (each transcendental correctly rounded). Row-major
/// `[timesteps.len(), dim]`.
pub fn timestep_embedding(timesteps: &[f32], dim: usize) -> Vec<f32> {
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
        let args: Vec<f32> = freqs.iter().map(|&f| t * f).collect();
        out.extend(args.iter().map(|&a| (a as f64).cos() as f32));
        out.extend(args.iter().map(|&a| (a as f64).sin() as f32));
        if !dim.is_multiple_of(2) {
            out.push(0.0);
        }
    }
    out
}

/// `FluxPosEmbed(theta, axes_dims)(ids)`: for each axis, `get_1d_rotary_pos_embed` with
/// `use_real=True, repeat_interleave_real=True` in f64, rounded to f32, concatenated along
/// the width. Returns `(cos, sin)`, each row-major `[ids.len(), sum(axes_dims)]`.
pub fn rope_tables(ids: &[[f32; 3]], axes_dims: &[usize], theta: f64) -> (Vec<f32>, Vec<f32>) {
    let width: usize = axes_dims.iter().sum();
    let freqs: Vec<Vec<f64>> = axes_dims
        .iter()
        .map(|&d| {
            (0..d / 2)
                .map(|j| 1.0 / theta.powf((2 * j) as f64 / d as f64))
                .collect()
        })
        .collect();
    let mut cos = Vec::with_capacity(ids.len() * width);
    let mut sin = Vec::with_capacity(ids.len() * width);
    for id in ids {
        for (axis, fs) in freqs.iter().enumerate() {
            let pos = id.get(axis).copied().unwrap_or(0.0) as f64;
            for &f in fs {
                let angle = pos * f;
                let (c, s) = (angle.cos() as f32, angle.sin() as f32);
                cos.extend([c, c]);
                sin.extend([s, s]);
            }
        }
    }
    (cos, sin)
}
