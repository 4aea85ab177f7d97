//! [`SplitMix64`]: the deterministic generator behind DDO's random weights (`--config`,
//! `ddo_nn::RandomWeights`), the soak's inputs and the tests' data: the same seed gives the
//! same values on every machine and backend.

/// Deterministic generator (SplitMix64) for weights and inputs.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[-1, 1)`.
    pub fn next_signed(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// `n` values uniform in `[-1, 1)` from `seed` (probe operands: a GEMM timed for the compute
/// floor, the fp8 path's self-check).
pub fn signed_values(seed: u64, n: usize) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed);
    (0..n).map(|_| rng.next_signed()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signed_values_are_spread_and_follow_the_seed() {
        let v = signed_values(3, 1000);
        assert!(v.iter().all(|x| (-1.0..1.0).contains(x)));
        assert!(v.iter().filter(|x| **x == 0.0).count() < 5);
        assert_ne!(v, signed_values(4, 1000));
        assert_eq!(v, signed_values(3, 1000));
    }
}
